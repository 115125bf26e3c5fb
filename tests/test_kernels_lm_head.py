"""Gathered LM head against hidden[rows] @ W.T (seed 000)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels._common import MAX_INDEXED_ELEMENTS
from eagle_jax.kernels.gathered_lm_head import gathered_lm_head, gathered_lm_head_reference


@pytest.mark.parametrize("num_rows,batch,hidden,vocab,dtype,tuning", [
    (4, 1, 64, 1000, jnp.float32, dict(block_v=128, block_k=32)),
    (12, 5, 64, 1531, jnp.bfloat16, dict(block_v=128, block_k=32)),
    (40, 20, 96, 1000, jnp.bfloat16, dict(block_v=128, block_k=32)),
    (12, 5, 96, 1531, jnp.bfloat16, dict(target="gfx942"))])  # AMD: 64-column tiles
def test_matches_reference(num_rows, batch, hidden, vocab, dtype, tuning):
  rng = np.random.default_rng(vocab + batch)
  h = jnp.asarray(rng.standard_normal((num_rows, hidden)), dtype)
  w = jnp.asarray(rng.standard_normal((vocab, hidden)) * 0.1, dtype)
  rows = jnp.asarray(rng.integers(0, num_rows, batch), jnp.int32)
  out = gathered_lm_head(h, rows, w, **tuning)
  ref = gathered_lm_head_reference(h, rows, w)
  assert out.shape == (batch, vocab) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_out_of_range_rows_are_clamped():
  rng = np.random.default_rng(9)
  h = jnp.asarray(rng.standard_normal((6, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((100, 32)), jnp.float32)
  rows = jnp.asarray([-3, 0, 5, 6, 1 << 20], jnp.int32)
  out = gathered_lm_head(h, rows, w)
  expect = np.asarray(h)[[0, 0, 5, 5, 5]] @ np.asarray(w).T
  np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-4)


def test_a_head_past_int32_offsets_takes_the_reference():
  """A [V, H] weight of more than 2**31 elements runs as the reference's XLA dot, one at
  the limit as the kernel (read from the traced program; shapes only, nothing allocated)."""
  hidden = jax.ShapeDtypeStruct((8, 8192), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((4,), jnp.int32)

  def program(vocab):
    weight = jax.ShapeDtypeStruct((vocab, 8192), jnp.bfloat16)
    return str(jax.make_jaxpr(gathered_lm_head)(hidden, rows, weight))

  assert "pallas_call" in program(MAX_INDEXED_ELEMENTS // 8192)
  assert "pallas_call" not in program(MAX_INDEXED_ELEMENTS // 8192 + 1)
