#!/usr/bin/env python
"""Shim for ``eagle-jax build-corpus`` (the code: eagle_jax.train.corpus_cli)."""

import sys

from eagle_jax.train.corpus_cli import main

if __name__ == "__main__":
    sys.exit(main())
