#!/usr/bin/env python
"""Shim for ``eagle-jax bench engine`` (the code: eagle_jax.bench.engine)."""

import sys

from eagle_jax.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
