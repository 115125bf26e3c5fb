"""``python -m eagle_jax``: the ``eagle-jax`` command line."""

import sys

from eagle_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
