#!/usr/bin/env python
"""Shim for ``eagle-jax serve`` (the code: eagle_jax.server.serve)."""

import sys

from eagle_jax.server.serve import main

if __name__ == "__main__":
    sys.exit(main())
