"""XLA (jitted, static buffers) vs op-by-op vs torch graph-replay comparison.

``scripts/compare_replay.py`` is the command line; the logic is in
:mod:`eagle_jax.compare.compare_replay`; see ``docs/COMPARE_REPLAY.md``.
"""
