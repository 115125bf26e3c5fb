#!/usr/bin/env python
"""Shim for ``eagle-jax compare-replay`` (the code: eagle_jax.compare.compare_replay)."""

import sys

from eagle_jax.compare.compare_replay import main

if __name__ == "__main__":
    sys.exit(main())
