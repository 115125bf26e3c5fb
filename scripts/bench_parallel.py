#!/usr/bin/env python
"""Shim for ``eagle-jax bench parallel`` (the code: eagle_jax.bench.parallel)."""

import sys

from eagle_jax.bench.parallel import main

if __name__ == "__main__":
    sys.exit(main())
