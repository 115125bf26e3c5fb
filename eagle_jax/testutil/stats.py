"""Goodness-of-fit statistics the sampling tests share (scipy is not installed)."""

from __future__ import annotations

import jax
import numpy as np


def chi2_pvalue(observed, expected_probs) -> float:
    """Pearson chi-square p-value of counts against probabilities (any matching shapes,
    e.g. joint counts of two tokens), via the regularised upper incomplete gamma.

    Fails the calling test outright if an outcome of probability 0 was observed."""
    observed = np.asarray(observed, np.float64).ravel()
    expected_probs = np.asarray(expected_probs, np.float64).ravel()
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "an outcome of probability 0 was drawn"
    expected = observed.sum() * expected_probs[support]
    stat = np.sum((observed[support] - expected) ** 2 / expected)
    return float(jax.scipy.special.gammaincc((support.sum() - 1) / 2.0, stat / 2.0))
