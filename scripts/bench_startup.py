#!/usr/bin/env python
"""Shim for ``eagle-jax bench startup`` (the code: eagle_jax.bench.startup)."""

import sys

from eagle_jax.bench.startup import main

if __name__ == "__main__":
    sys.exit(main())
