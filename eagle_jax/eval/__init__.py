"""Offline evaluation of a target + draft pair: accept length, speed-up, identity, accuracy.

``scripts/evaluate.py`` is the command line; the logic is in :mod:`eagle_jax.eval.evaluate`.
"""
