"""sampling_probs / sample_from_probs against a sort-based numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.sampling import TOP_K_ALL, SamplingRows


def numpy_sampling_probs(logits, t, k, p_top, p_min, vocab):
  x = logits.astype(np.float64)[:vocab] / t
  p = np.exp(x - x.max())
  p /= p.sum()
  if k <= 1:
    out = np.zeros(logits.shape[-1])
    out[np.argmax(logits[:vocab])] = 1
    return out
  if k < vocab:
    p = np.where(p >= np.sort(p)[::-1][k - 1], p, 0)
  if p_top < 1:
    s = np.sort(p)[::-1]
    cut = s[np.searchsorted(np.cumsum(s), p_top * p.sum() * (1 - 1e-6))]
    p = np.where(p >= cut, p, 0)
  p = np.where(p >= p_min * p.max(), p, 0)
  out = np.zeros(logits.shape[-1])
  out[:vocab] = p / p.sum()
  return out


@pytest.mark.parametrize("seed,num_cols,vocab", [(0, 50, 50), (1, 1000, 990), (2, 1531, 1531)])
def test_matches_numpy(seed, num_cols, vocab):
  rng = np.random.default_rng(seed)
  rows = 8
  logits = (rng.standard_normal((rows, num_cols)) * 2).astype(np.float32)
  t = rng.choice([0.5, 0.7, 1.0, 1.5], rows).astype(np.float32)
  k = rng.choice([1, 2, 7, 40, TOP_K_ALL], rows).astype(np.int32)
  tp = rng.choice([1.0, 0.9, 0.5], rows).astype(np.float32)
  mp = rng.choice([0.0, 0.1], rows).astype(np.float32)
  out = np.asarray(sampling_probs(logits, SamplingRows(t, k, tp, mp), vocab))
  assert np.all(out[:, vocab:] == 0)
  for r in range(rows):
    expect = numpy_sampling_probs(logits[r], t[r], k[r], tp[r], mp[r], vocab)
    np.testing.assert_allclose(out[r], expect, atol=2e-6, rtol=1e-4)


def test_greedy_ties_first_index_and_padding_ignored():
  logits = np.zeros((3, 2, 20), np.float32)
  logits[..., 4] = logits[..., 9] = 5.0
  logits[..., 19] = 100.0  # padding column, beyond vocab_size
  rows = SamplingRows(np.ones(3), np.ones(3, np.int32), np.ones(3), np.zeros(3))
  out = np.asarray(sampling_probs(logits, rows, vocab_size=18))  # [3] rows over [3, 2]
  assert np.all(out[..., 4] == 1.0) and np.all(out.sum(-1) == 1.0)


def test_sample_from_probs_never_zero_probability():
  rng = np.random.default_rng(3)
  probs = rng.uniform(size=(64, 300)).astype(np.float32)
  probs[:, ::2] = 0
  probs[:, -5:] = 0
  probs /= probs.sum(-1, keepdims=True)
  u = rng.uniform(size=64).astype(np.float32)
  u[:8] = np.nextafter(np.float32(1), np.float32(0))  # the top end
  ids = np.asarray(sample_from_probs(probs, u))
  assert np.all(probs[np.arange(64), ids] > 0)
  assert ids.max() < 300
  assert int(sample_from_probs(jnp.zeros((1, 10)), jnp.array([0.5]))[0]) == 0


# --------------------------------------------------------------------------------------
# Issue 61: the float32 division of an NVIDIA GPU, reproduced on the CPU.
# --------------------------------------------------------------------------------------


def gpu_div(a, b):
  """float32 a / b as XLA's NVIDIA backend computes it (``-nvptx-prec-divf32=1``:
  div.full.f32, a times an approximate reciprocal, within 2 ulp, not correctly rounded),
  emulated as a times 1 / b rounded up to float32 (within 1 ulp): x / x can then be
  1 + 2**-23 > 1, as on the GPU; a correctly rounded division never gives more than 1."""
  a, b = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with np.errstate(divide="ignore", invalid="ignore"):
    exact = 1.0 / b.astype(np.float64)
    r = exact.astype(np.float32)
    r = np.where(r < exact, np.nextafter(r, np.float32(np.inf)), r)
    return (a * r).astype(np.float32)


def eval_with_gpu_division(fn, *args):
  """``fn(*args)`` evaluated equation by equation on the CPU, every float32 division
  replaced by :func:`gpu_div` (into jit, cond and custom-derivative calls)."""
  from jax.extend import core as jcore

  def run(jaxpr, consts, *vals):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, vals))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
      if eqn.primitive.name == "div" and np.asarray(ins[0]).dtype == np.float32:
        outs = [jnp.asarray(gpu_div(*ins))]
      elif eqn.primitive.name == "cond":
        branch = eqn.params["branches"][int(ins[0])]
        outs = run(branch.jaxpr, branch.consts, *ins[1:])
      elif isinstance(sub, jcore.ClosedJaxpr):
        outs = run(sub.jaxpr, sub.consts, *ins)
      elif isinstance(sub, jcore.Jaxpr):
        outs = run(sub, [], *ins)
      else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  closed = jax.make_jaxpr(fn)(*args)
  return run(closed.jaxpr, closed.consts, *args)


def peaked_rows(seed, rows=256, vocab=1000):
  """Logits of a confident model (one token far ahead) at T 0.7 / 1.0 and top_p 0.9 /
  1.0: top-p then keeps the leading token alone, and its q is x / x."""
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((rows, vocab)).astype(np.float32)
  logits[np.arange(rows), rng.integers(0, vocab, rows)] += rng.uniform(7, 12, rows)
  t = rng.choice([0.7, 1.0], rows).astype(np.float32)
  tp = np.where(np.arange(rows) % 4 == 0, 1.0, 0.9).astype(np.float32)
  return logits, SamplingRows(t, np.full(rows, TOP_K_ALL, np.int32), tp,
                              np.zeros(rows, np.float32))


def test_gpu_division_keeps_confident_rows_probabilities():
  """Issue 61: on an H100 a healthy default pair flagged 44 draft rows malformed and fell
  back 35 times. A row that top-p cuts to one token is x / x, which the GPU's division
  can round to 1 + 2**-23: the draft's row check flags such a q (an entry > 1) and the
  verify sampler zeroes such a p (its residual and p then have no mass: a fallback, and a
  uniformly drawn token). Under the same division emulated on the CPU, sampling_probs
  keeps every entry within [0, 1], so no row is flagged and nothing falls back."""
  from eagle_jax.kernels.draft_proposal import probs_row_ok, propose_from_probs
  from eagle_jax.kernels.spec_sampler import speculative_sample

  logits, rows = peaked_rows(61)
  # The emulated division does overshoot on these rows: the test has power.
  kept = np.asarray(sampling_probs(logits, rows)).max(-1)
  assert np.any(gpu_div(kept, kept) > 1.0)
  q = np.asarray(eval_with_gpu_division(
      lambda x, *r: sampling_probs(x, SamplingRows(*r)), logits, *rows)[0])
  assert q.max() <= 1.0 and q.min() >= 0.0
  assert np.asarray(probs_row_ok(q)).all()
  n = len(logits)
  u = np.random.default_rng(1).uniform(size=(n, 2)).astype(np.float32)
  prop = propose_from_probs(q, np.zeros(n, bool), u[:, 0], block_v=256)
  assert np.asarray(prop.probs_ok).all()
  # Draft and target agree (p = q, as a confident pair's do): every token is accepted.
  d = np.asarray(prop.tokens)[:, None]
  p = np.stack([q, q], 1)
  out = speculative_sample(d, q[:, None], p, rows, u, logits.shape[-1], target_is_probs=True,
                           draft_probs_ok=np.asarray(prop.probs_ok)[:, None],
                           block_v=256, chunk_v=512)
  assert int(np.sum(out.num_malformed_q)) == 0 and int(np.sum(out.num_fallback)) == 0
  np.testing.assert_array_equal(out.accept_len, np.ones(n, np.int32))
