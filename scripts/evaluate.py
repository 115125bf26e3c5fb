#!/usr/bin/env python
"""Shim for ``eagle-jax evaluate`` (the code: eagle_jax.eval.evaluate)."""

import sys

from eagle_jax.eval.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
