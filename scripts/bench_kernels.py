#!/usr/bin/env python
"""Shim for ``eagle-jax bench kernels`` (the code: eagle_jax.bench.kernels)."""

import sys

from eagle_jax.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main())
