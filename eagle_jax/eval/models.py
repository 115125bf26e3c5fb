"""Which target / draft pair a tool runs: flags, or the embedded default pair."""

from __future__ import annotations

import json
import os

from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET

# Exit status of the tools when the models they need are not there (a usage error).
EXIT_NO_MODEL = 2


class ModelsMissing(Exception):
    """The requested (or default) models are not available; the message says what to do."""


def resolve_pair(model: str | None, draft_model: str | None,
                 need_draft: bool = True) -> tuple[str, str | None]:
    """(target dir, draft dir). With no --model: the default pair shipped with the package.

    Raises ModelsMissing with a message naming the missing directory and the flags.
    """
    if model is None:
        target = DEFAULT_TARGET
        draft = DEFAULT_DRAFT if draft_model is None else draft_model
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise ModelsMissing(
                f"no --model given and the embedded default pair is not shipped yet "
                f"({target} has no config.json): pass --model TARGET_DIR and "
                f"--draft-model DRAFT_DIR")
        if need_draft and not os.path.isfile(os.path.join(draft, "config.json")):
            raise ModelsMissing(
                f"the embedded default draft is not shipped yet ({draft} has no config.json): "
                f"pass --draft-model DRAFT_DIR")
        return target, draft if need_draft else draft_model
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ModelsMissing(f"--model {model}: no config.json there (a Hugging Face model "
                            "directory is expected)")
    if need_draft:
        if draft_model is None:
            raise ModelsMissing("--draft-model is required with --model (or pass "
                                "--algorithm NONE)")
        if not os.path.isfile(os.path.join(draft_model, "config.json")):
            raise ModelsMissing(f"--draft-model {draft_model}: no config.json there")
    return model, draft_model


def detect_algorithm(draft_dir: str) -> str:
    """"EAGLE3" or "EAGLE" from the draft checkpoint (architectures, else tensor names)."""
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    try:
        from eagle_jax.checkpoint import CheckpointReader
        from eagle_jax.models.draft_checkpoint import detect_kind

        return detect_kind(cfg, CheckpointReader(draft_dir), draft_dir)
    except ImportError:  # pragma: no cover - the draft module is part of the package
        archs = " ".join(cfg.get("architectures") or []).lower()
        return "EAGLE3" if "eagle3" in archs else "EAGLE"
