"""Speculative decoding: draft proposers, the verification of drafts, and when to speculate."""
