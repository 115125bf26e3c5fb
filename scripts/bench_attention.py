#!/usr/bin/env python
"""Shim for ``eagle-jax bench attention`` (the code: eagle_jax.bench.attention)."""

import sys

from eagle_jax.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
