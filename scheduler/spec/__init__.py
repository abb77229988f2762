"""Speculative decoding's scheduler side: drafting (n-gram prompt lookup, suffix decoding) and its counters."""
