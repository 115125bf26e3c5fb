"""Files shipped with the package: the embedded default model pair.

``default/target`` is a small Llama-architecture code model and ``default/draft`` its
EAGLE-3 draft, both trained by this project (README: "The embedded default model").
"""

from __future__ import annotations

import os

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default")
DEFAULT_TARGET = os.path.join(DEFAULT_DIR, "target")
DEFAULT_DRAFT = os.path.join(DEFAULT_DIR, "draft")


def default_pair() -> tuple[str, str]:
    """(target_dir, draft_dir) of the embedded model; FileNotFoundError when absent."""
    for path in (DEFAULT_TARGET, DEFAULT_DRAFT):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"the embedded default model is not shipped in this checkout ({path} has no "
                "config.json); pass --model TARGET_DIR and --draft-model DRAFT_DIR")
    return DEFAULT_TARGET, DEFAULT_DRAFT
