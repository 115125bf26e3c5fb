"""The draft tree the engine builds (``eagle_jax.engine.draft_tree``), verified by the
engine's two real-q tree samplers (Traversal Verification, ``traversal_sampler``, and
recursive rejection sampling, ``tree_sampler``): the first two committed tokens follow
the target's filtered distribution exactly, for the trees the engine really drafts
(children drawn without replacement, chosen level by level), and EAGLE-2's global rerank
applied to sampled rows does not.

The models are first-order Markov chains over a small vocabulary: the draft's logits at a
node are a row of log q chosen by the node's token, the target's a row of log p. The
test drives ``build_draft_tree`` (the function ``tree_spec_step`` calls) with a stub
draft that encodes a token as its one-hot hidden state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.engine.draft_tree import build_draft_tree, draw_children, frontier_sizes, level_widths
from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.kernels.traversal_sampler import traversal_sample
from eagle_jax.kernels.tree_sampler import tree_speculative_sample_reference
from eagle_jax.sampling import TOP_K_ALL, SamplingRows
from eagle_jax.testutil.stats import chi2_pvalue

V = 6
K, S, N = 2, 3, 9  # level widths 2, 4, 3: the last two levels are cut by the ranking
ALPHA = 1e-3  # false-alarm rate of each goodness-of-fit test
N_STAT = 30000
ROOT = 1


class MarkovDraft:
    """The draft's interface as ``build_draft_tree`` uses it, for q(. | last token)."""

    d2t = None

    def __init__(self, log_q):
        self.log_q = jnp.asarray(log_q, jnp.float32)

    def __call__(self, tokens, hidden, positions, cache, tree=None):
        return jax.nn.one_hot(tokens, V, dtype=jnp.float32), cache

    def logits(self, hidden):
        return hidden @ self.log_q


def _chains(seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((V, V)) * 1.3, rng.standard_normal((V, V)) * 1.3


SAMPLERS = {"traversal": functools.partial(traversal_sample, max_children=K),  # as the step
            "recursive_rejection": tree_speculative_sample_reference}


@functools.partial(jax.jit, static_argnames=("rerank", "verify"))
def _verify_step(key, roots, log_p, log_q, rows, rerank, verify):
    """One tree step per row from root tokens [n]: (tokens [n, S+1], accept_len [n])."""
    n = roots.shape[0]
    draft = MarkovDraft(log_q)
    k_draw, k_accept = jax.random.split(key)
    tree = build_draft_tree(
        draft, draft.log_q[roots], jax.nn.one_hot(roots, V), jnp.zeros(n, jnp.int32),
        jnp.ones(n, bool), rows, jax.random.split(k_draw, n), None, topk=K, num_steps=S, num_nodes=N,
        real_q=True, target_vocab_size=V, vocab_size=None, pad_position=1 << 30,
        _eagle2_rerank_sampled_rows=rerank)
    tokens = tree.tokens.at[:, 0].set(roots)
    p = sampling_probs(jnp.asarray(log_p, jnp.float32)[tokens], rows)
    out = SAMPLERS[verify](
        tokens, tree.parents, tree.draft_probs, tree.q_row, p, rows.top_k <= 1,
        jax.random.uniform(k_accept, (n, N + 2)), V, max_depth=S,
        draft_probs_ok=tree.draft_probs_ok)
    return out.tokens, out.accept_len


def _filtered(log_p, temperature, top_k, top_p):
    rows = SamplingRows(*(np.full(V, x, dt) for x, dt in (
        (temperature, np.float32), (top_k, np.int32), (top_p, np.float32), (0.0, np.float32))))
    return np.asarray(sampling_probs(jnp.asarray(log_p, jnp.float32), rows), np.float64)


def _two_tokens(log_p, log_q, temperature, top_k, top_p, verify, *, rerank=False, seed=0):
    rows = SamplingRows(*(jnp.full((N_STAT,), x, dt) for x, dt in (
        (temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32),
        (0.0, jnp.float32))))
    key1, key2 = jax.random.split(jax.random.key(seed))
    roots = jnp.full((N_STAT,), ROOT, jnp.int32)
    tok1, acc1 = _verify_step(jax.random.key_data(key1), roots, log_p, log_q, rows, rerank,
                              verify)
    first = tok1[:, 0]
    tok2, _ = _verify_step(jax.random.key_data(key2), first, log_p, log_q, rows, rerank, verify)
    second = jnp.where(acc1 >= 1, tok1[:, 1], tok2[:, 0])
    counts = np.zeros((V, V), np.int64)
    np.add.at(counts, (np.asarray(first), np.asarray(second)), 1)
    return counts, np.asarray(acc1)


@pytest.mark.parametrize("verify", sorted(SAMPLERS))
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, TOP_K_ALL, 1.0), (0.7, 3, 1.0), (1.0, TOP_K_ALL, 0.8)])
def test_first_two_tokens_follow_the_target(temperature, top_k, top_p, verify):
    log_p, log_q = _chains(7)
    counts, acc = _two_tokens(log_p, log_q, temperature, top_k, top_p, verify)
    p = _filtered(log_p, temperature, top_k, top_p)
    assert chi2_pvalue(counts, p[ROOT][:, None] * p) > ALPHA
    assert np.mean(acc >= 2) > 0.1  # paths reach the levels that the ranking cut


@pytest.mark.parametrize("verify", sorted(SAMPLERS))
def test_eagle2_rerank_of_sampled_rows_is_biased(verify):
    """Choosing sampled rows' nodes by their own cumulative q (EAGLE-2's rerank) lets a
    child's own token decide whether it is tested: the same test must fail."""
    log_p, log_q = _chains(7)
    counts, _ = _two_tokens(log_p, log_q, 1.0, TOP_K_ALL, 1.0, verify, rerank=True)
    p = _filtered(log_p, 1.0, TOP_K_ALL, 1.0)
    assert chi2_pvalue(counts, p[ROOT][:, None] * p) < ALPHA


def test_level_widths_and_frontiers():
    assert level_widths(2, 3, 9) == (2, 4, 3)
    assert level_widths(4, 6, 31) == (4, 6, 6, 6, 6, 3)  # never narrower than above...
    assert frontier_sizes(4, 6, 31) == (4, 6, 6, 6, 6)  # ...and every kept node expanded
    assert sum(level_widths(8, 5, 63)) == 63
    assert level_widths(4, 3, 3) == (3, 0, 0)  # no level below a cut frontier
    assert frontier_sizes(4, 3, 3) == (4, 4)  # greedy rows still expand K per level


def test_children_are_drawn_without_replacement_in_order():
    """A sampled node's K children (Gumbel-top-K) are distributed as K successive draws
    from q, each without the earlier ones: Plackett-Luce over ordered triples; the mass
    left before each draw is 1 minus the earlier draws' q; a row with fewer than K
    tokens of mass (top_k = 2 < K = 3) marks its extra slot invalid."""
    n, k = 60000, 3
    logits = jax.random.normal(jax.random.key(11), (V,)) * 1.5
    rows = SamplingRows(*(jnp.full((n,), x, dt) for x, dt in (
        (1.0, jnp.float32), (TOP_K_ALL, jnp.int32), (1.0, jnp.float32), (0.0, jnp.float32))))
    keys = jax.random.split(jax.random.key_data(jax.random.key(12)), n)
    draw = jax.jit(lambda lg, r, keys: draw_children(lg, r, jnp.ones(n, bool), keys, None,
                                                     None, k))
    tokens, step_lp, q_left, q = draw(jnp.broadcast_to(logits, (n, 1, V)), rows, keys)
    tokens, q_left = np.asarray(tokens[:, 0]), np.asarray(q_left[:, 0])
    qv = np.asarray(q[0, 0], np.float64)
    exact = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            for c in range(V):
                if len({a, b, c}) == 3:
                    exact[a, b, c] = qv[a] * qv[b] / (1 - qv[a]) * qv[c] / (1 - qv[a] - qv[b])
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    assert chi2_pvalue(counts, exact) > ALPHA
    np.testing.assert_allclose(q_left[:, 0], 1.0, atol=1e-6)
    np.testing.assert_allclose(q_left[:, 1], 1 - qv[tokens[:, 0]], atol=1e-5)
    np.testing.assert_allclose(q_left[:, 2], 1 - qv[tokens[:, 0]] - qv[tokens[:, 1]], atol=1e-5)
    np.testing.assert_allclose(np.asarray(step_lp[:, 0]), np.log(qv[tokens]), rtol=1e-5)

    top2 = rows._replace(top_k=jnp.full((n,), 2, jnp.int32))
    tokens, step_lp, _, _ = draw(jnp.broadcast_to(logits, (n, 1, V)), top2, keys)
    kept = set(np.argsort(-np.asarray(logits))[:2].tolist())
    assert set(np.unique(np.asarray(tokens[:, 0, :2])).tolist()) == kept
    assert np.all(np.isfinite(np.asarray(step_lp[:, 0, :2])))
    assert np.all(np.isneginf(np.asarray(step_lp[:, 0, 2])))  # no third token has mass
