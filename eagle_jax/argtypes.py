"""Argument types shared by the command-line tools (``eagle-jax …``, ``scripts/*.py``)."""

from __future__ import annotations

import argparse


def positive_int(s: str) -> int:
    """argparse ``type=`` for counts and sizes: an int >= 1, else argparse's usage error
    naming the flag."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def int_tuple(arg: str) -> tuple[int, ...]:
    """argparse ``type=`` for a comma-separated set of ints: sorted, without repeats."""
    try:
        return tuple(sorted({int(x) for x in arg.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {arg!r}")
