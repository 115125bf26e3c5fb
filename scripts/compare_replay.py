#!/usr/bin/env python
"""Compare the jitted (XLA) engine step with the same step op by op, and (on a torch GPU)
with a CUDA-graph replay reference of the sampling stage (seed 004).

    python scripts/compare_replay.py --model TARGET --draft-model DRAFT [--num-steps 3]
        [--draft-sample-method probabilistic] [--json report.json] [--perturb]

Exits 0 when the jitted and op-by-op paths agree within the stated tolerance, 1 when they
do not (or either emitted an invalid token), 2 on a usage error. How to read the report:
docs/COMPARE_REPLAY.md. Logic: eagle_jax/compare/.
"""

from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from eagle_jax.compare.compare_replay import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
