#!/usr/bin/env python
"""Shim for ``eagle-jax train-target`` (the code: eagle_jax.train.target_cli)."""

import sys

from eagle_jax.train.target_cli import main

if __name__ == "__main__":
    sys.exit(main())
