"""Helpers shared by kvpool's tests (not tests themselves)."""
