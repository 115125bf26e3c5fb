#!/usr/bin/env python
"""Offline batch evaluation of a target + EAGLE draft pair (logic: eagle_jax/eval/).

    python scripts/evaluate.py --model TARGET --draft-model DRAFT --dataset data.jsonl \
        --num-steps 3,5 --temperature 0,1 --draft-sample-method greedy,probabilistic \
        --json report.json --plot charts/

Reports accept length (mean, distribution), acceptance per draft position, drafted /
accepted tokens, output tokens/s and mean TPOT with and without speculation (speed-up),
greedy identity with the target alone, invalid-token counts and, where the dataset has
references, exact match and the target's next-token accuracy / perplexity. See
``python scripts/evaluate.py --help``.
"""

from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from eagle_jax.eval.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
