"""Helpers for the test suite: tiny tokenizers and models written to temporary directories."""
