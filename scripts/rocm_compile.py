#!/usr/bin/env python
"""Shim for ``eagle-jax rocm-compile`` (the code: eagle_jax.bench.rocm_compile)."""

import sys

from eagle_jax.bench.rocm_compile import main

if __name__ == "__main__":
    sys.exit(main())
