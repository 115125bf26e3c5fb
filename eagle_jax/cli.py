"""Argument types shared by the command-line tools (``scripts/*.py``)."""

from __future__ import annotations

import argparse


def positive_int(s: str) -> int:
    """argparse ``type=`` for counts and sizes: an int >= 1, else argparse's usage error
    naming the flag."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v
