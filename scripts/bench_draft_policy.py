#!/usr/bin/env python
"""Shim for ``eagle-jax bench draft-policy`` (the code: eagle_jax.bench.draft_policy)."""

import sys

from eagle_jax.bench.draft_policy import main

if __name__ == "__main__":
    sys.exit(main())
