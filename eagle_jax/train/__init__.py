"""EAGLE draft training: target features (``data``), the unrolled draft and its losses
(``unroll``), and the optax trainer (``trainer``; CLI: ``scripts/train_draft.py``)."""

from eagle_jax.train.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
