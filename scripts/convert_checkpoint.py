#!/usr/bin/env python
"""Shim for ``eagle-jax convert`` (the code: eagle_jax.convert_checkpoint)."""

import sys

from eagle_jax.convert_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
