"""Speculative decoding's scheduler side: drafting (n-gram prompt lookup) and its counters."""
