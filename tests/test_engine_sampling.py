"""Sampled speculative output follows the target's distribution (goodness of fit).

A 16-token target and an EAGLE-3 draft for it; thousands of requests with the same
prompt and distinct seeds each generate 3 tokens. The first comes from the target alone
(prefill), the next two from speculative steps (drafted, accepted or resampled, bonus).
The empirical joint distribution of (t2, t3) is compared with its exact value under the
target, p(t2, t3) = sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2), each factor after the
request's temperature / top-k / top-p, by a chi-square test.

False-alarm rate: each case rejects a correct sampler with probability ALPHA = 1e-3;
the 5 cases together with probability < 0.5%. The seeds are fixed, so the outcome is
deterministic: a correct engine passes every time.

Efficiency: the rate at which the first draft token is accepted equals its exact value
(sum_x min(p, q) for a token drawn from q, p(argmax q) for greedy drafting), again at
false-alarm rate ALPHA per case.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.models.decoder import load_decoder
from eagle_jax.sampling import TOP_K_ALL, SamplingRows
from eagle_jax.testutil.sampling import sample_prompt

VOCAB = 16
PROMPT = [3, 9, 4, 11]
NUM_REQUESTS = 4000
ALPHA = 1e-3
# The engine of every case (tests/test_tensor_parallel.py runs it at tensor-parallel 2).
# Prompts ride in decode steps 16 at a time (the GPU's default; the CPU's, 1, would take
# a step per request): a budget of 1280 tokens holds the 64 rows of 4 and 16 lanes of 64
# positions (at the default 512, 4 lanes: 4.3 requests a step against 15). Executables
# compile as the cases first use them.
ENGINE = dict(speculative_algorithm="EAGLE3", num_steps=3, dtype="float32", max_model_len=32,
              max_num_seqs=64, batch_buckets=(64,), prefill_buckets=(8,),
              max_num_partial_prefills=16, max_num_batched_tokens=1280, precompile=False,
              compilation_cache_dir="")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target

    root = tmp_path_factory.mktemp("gof")
    target = write_tiny_target(str(root / "target"), "llama", vocab_size=VOCAB, hidden_size=32,
                               num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64,
                               init_std=0.25, seed=3)
    draft = write_tiny_eagle3_draft(str(root / "draft"), target, seed=4, init_std=0.25)
    return target, draft


@pytest.fixture(scope="module")
def engines():
    """One engine per configuration, built on first use: cases that differ only in the
    requests' temperature, top-k and top-p (per-request tensors, as in serving) share
    it, so each configuration compiles once."""
    return {}


def _exact_joint(target_dir, temperature, top_k, top_p):
    """p(t2, t3) under the target with the request's filters, as a [V, V] table."""
    model = load_decoder(target_dir, "float32")
    t1, t2 = np.meshgrid(np.arange(VOCAB), np.arange(VOCAB), indexing="ij")
    seqs = np.concatenate([np.tile(PROMPT, (VOCAB * VOCAB, 1)), t1.reshape(-1, 1),
                           t2.reshape(-1, 1)], axis=1)
    n = seqs.shape[1]
    logits = model(jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(n), seqs.shape), None).logits
    rows = logits.shape[:2]
    probs = np.asarray(sampling_probs(logits, SamplingRows(
        jnp.full(rows, temperature), jnp.full(rows, top_k, jnp.int32), jnp.full(rows, top_p),
        jnp.zeros(rows))), np.float64)
    probs = probs.reshape(VOCAB, VOCAB, n, VOCAB)
    p1 = probs[0, 0, len(PROMPT) - 1]  # [t1]
    p2 = probs[:, 0, len(PROMPT)]  # [t1, t2]
    p3 = probs[:, :, len(PROMPT) + 1]  # [t1, t2, t3]
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def chi_square_pvalue(counts, expected):
    """Pools cells with expected count < 5 into one, then the chi-square survival value."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0)), stat, dof


def _run(pair, engines, method, temperature, top_k, top_p, max_tokens, hook=None,
         switching=False):
    """NUM_REQUESTS requests of PROMPT with distinct seeds through the ``engines`` entry
    of this configuration -> (its counters for these requests, {id: tokens}).
    ``switching``: each step drafts a length drawn at random from 0 to 3."""
    target, draft = pair
    lengths = dict(speculative_policy="adaptive", draft_lengths=(0, 1, 2, 3)
                   ) if switching else {}
    config = EngineConfig(model=target, draft_model=draft, draft_sample_method=method,
                          **ENGINE, **lengths)
    engine = engines.get((config, hook))
    if engine is None:
        engine = engines[config, hook] = Engine(config, draft_probs_hook=hook)
        if switching:
            from .test_draft_policy import ScriptedLengths

            engine.draft_policy = ScriptedLengths((0, 1, 2, 3), seed=7)
    before = copy.deepcopy(engine.stats)
    out = sample_prompt(engine, PROMPT, NUM_REQUESTS, max_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p)
    assert len(out) == NUM_REQUESTS and all(len(v) == max_tokens for v in out.values())
    return engine.stats.since(before), out


def fit_counts(target_dir, out, temperature, top_k, top_p):
    """(counts, expected): the (t2, t3) pairs of ``out`` (id -> 3 tokens) and their
    expected counts under the target, [V, V] each."""
    counts = np.zeros((VOCAB, VOCAB))
    for toks in out.values():
        counts[toks[1], toks[2]] += 1
    expected = _exact_joint(target_dir, temperature, TOP_K_ALL if top_k < 0 else top_k,
                            top_p) * len(out)
    return counts, expected


def _sample(pair, engines, method, temperature, top_k, top_p, hook=None, switching=False):
    stats, out = _run(pair, engines, method, temperature, top_k, top_p, 3, hook, switching)
    return (stats, *fit_counts(pair[0], out, temperature, top_k, top_p))


@pytest.mark.parametrize("method, temperature, top_k, top_p, switching", [
    ("greedy", 1.0, -1, 1.0, False),
    ("greedy", 0.7, 6, 0.9, False),
    ("probabilistic", 1.0, -1, 1.0, False),
    ("probabilistic", 0.7, 6, 0.9, False),
    # The draft length drawn at random per step (0 to 3): t2 and t3 come from steps of
    # different lengths, the target's step alone among them.
    ("probabilistic", 0.7, 6, 0.9, True),
])
def test_sampled_tokens_follow_the_target(pair, engines, method, temperature, top_k, top_p,
                                          switching):
    s, counts, expected = _sample(pair, engines, method, temperature, top_k, top_p,
                                  switching=switching)
    pvalue, stat, dof = chi_square_pvalue(counts.ravel(), expected.ravel())
    assert pvalue > ALPHA, (stat, dof, pvalue)
    # The step both accepted and rejected draft tokens, so both paths were exercised.
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    # Tokens the filters remove never appear.
    assert counts[expected == 0].sum() == 0


def halved(q):
    """A wrong accept rule's q (min(1, 2p / q): draft tokens accepted too often)."""
    return q * 0.5


def inflated(q):
    """A wrong accept rule's q (min(1, p / 1.3q): draft tokens accepted too rarely)."""
    return q * 1.3


def test_the_fit_test_detects_a_biased_sampler(pair, engines):
    """The same test on a deliberately wrong accept rule (q halved: over-acceptance of
    draft tokens) must reject: the test has power, it is not vacuous."""
    _, counts, expected = _sample(pair, engines, "probabilistic", 1.0, -1, 1.0, hook=halved)
    pvalue, _, _ = chi_square_pvalue(counts.ravel(), expected.ravel())
    assert pvalue < ALPHA


def _first_draft_acceptance(target_dir, draft_dir, method):
    """The exact probability that the first draft token is accepted at temperature 1:
    E_{t1 ~ p}[sum_x min(p(x | t1), q(x | t1))] when it is drawn from q (probabilistic),
    E_{t1 ~ p}[p(argmax q | t1)] when it is q's argmax (greedy). q comes from the
    training unroll's step 0, an implementation of the draft separate from the engine's
    extend + proposal."""
    from eagle_jax.models.draft_checkpoint import load_draft
    from eagle_jax.train import unroll

    target = load_decoder(target_dir, "float32")
    draft = load_draft(draft_dir, target, "float32", use_kernels=False)
    j = len(PROMPT) - 1  # row j: feature of the last prompt token, input token t1
    x = jnp.asarray([PROMPT + [t1] for t1 in range(VOCAB)], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
    out = target(x, pos, target.init_cache(*x.shape), aux_layers=draft.feature_layers)
    p = np.asarray(jax.nn.softmax(out.logits, -1), np.float64)
    p1, p2 = p[0, j], p[:, j + 1]  # p(t1), p(t2 | t1)
    h = unroll.unrolled_forward(draft, x, out.aux_hidden, 1)[0][:, j]
    q = np.asarray(jax.nn.softmax(draft.logits(h), -1), np.float64)  # [t1, Vd = V]
    if method == "probabilistic":
        accept = np.minimum(p2, q).sum(-1)
    else:
        accept = p2[np.arange(VOCAB), q.argmax(-1)]
    return float(p1 @ accept)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_first_draft_token_is_accepted_at_the_optimal_rate(pair, engines, method):
    """Rejection sampling accepts a token drawn from q with probability sum_x min(p, q),
    the most any exact sampler can. A sampler that accepted less and made up for it in
    the residual would still pass the fit test above, and so would drafting from a stale
    or shifted draft state; both lower this rate. One speculative step per request
    (max_tokens 2): the observed first-position acceptance of NUM_REQUESTS drafts is
    checked against the exact rate at two-sided false-alarm rate ALPHA (normal
    approximation of the binomial, z = 3.29)."""
    s, _ = _run(pair, engines, method, 1.0, -1, 1.0, 2)
    assert s.num_drafts == NUM_REQUESTS
    rate = _first_draft_acceptance(*pair, method)
    observed = s.accepted_per_pos[0] / s.num_drafts
    tol = 3.29 * np.sqrt(rate * (1 - rate) / NUM_REQUESTS)
    assert 0.05 < rate < 0.95  # a rate with room on both sides
    assert abs(observed - rate) < tol, (observed, rate, tol)


def test_the_rate_test_detects_an_under_accepting_sampler(pair, engines):
    """q scaled by 1.3 in the accept test (accepting with min(1, p / 1.3q)) lowers the
    first-position rate by more than the tolerance above: that test has power."""
    s, _ = _run(pair, engines, "probabilistic", 1.0, -1, 1.0, 2, hook=inflated)
    rate = _first_draft_acceptance(*pair, "probabilistic")
    observed = s.accepted_per_pos[0] / s.num_drafts
    assert rate - observed > 3.29 * np.sqrt(rate * (1 - rate) / NUM_REQUESTS), (observed, rate)
