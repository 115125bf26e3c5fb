#!/usr/bin/env python
"""Shim for ``eagle-jax bench tree`` (the code: eagle_jax.bench.tree)."""

import sys

from eagle_jax.bench.tree import main

if __name__ == "__main__":
    sys.exit(main())
