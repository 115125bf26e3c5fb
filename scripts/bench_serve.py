#!/usr/bin/env python
"""Shim for ``eagle-jax bench serve`` (the code: eagle_jax.bench.serve)."""

import sys

from eagle_jax.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
