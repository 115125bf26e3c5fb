#!/usr/bin/env python
"""Shim for ``eagle-jax bench prefix`` (the code: eagle_jax.bench.prefix)."""

import sys

from eagle_jax.bench.prefix import main

if __name__ == "__main__":
    sys.exit(main())
