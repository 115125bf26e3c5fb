#!/usr/bin/env python
"""Shim for ``eagle-jax train-draft`` (the code: eagle_jax.train.draft_cli)."""

import sys

from eagle_jax.train.draft_cli import main

if __name__ == "__main__":
    sys.exit(main())
