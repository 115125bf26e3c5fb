"""The kernels' blockwise inverse-CDF draw (``_common.inverse_cdf_block``), which scans
only the block the target can fall in, against one search over the whole row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from eagle_jax.kernels import _common


def _draw(w, target, block):
  """The kernels' loop: blocks in column order, then the token."""
  def body(k, carry):
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    return _common.inverse_cdf_block(carry, cols, lax.dynamic_slice(w, (k * block,), (block,)),
                                     target)
  carry = lax.fori_loop(0, w.shape[0] // block, body, _common.inverse_cdf_init())
  return _common.inverse_cdf_token(carry)


def _expected(w, target):
  """First column whose cumulative weight exceeds target among positive weights; else the
  last positive column; else -1."""
  csum = np.cumsum(w, dtype=np.float64)
  hit = np.nonzero((csum > target) & (w > 0))[0]
  if hit.size:
    return int(hit[0])
  pos = np.nonzero(w > 0)[0]
  return int(pos[-1]) if pos.size else -1


@pytest.mark.parametrize("block", [8, 32])
def test_blockwise_draw_matches_a_whole_row_search(block):
  rng = np.random.default_rng(7)
  draw = jax.jit(_draw, static_argnums=2)
  for trial in range(40):
    cols = 4 * block
    # Multiples of 1/64 with zeros and whole zero blocks: float32 sums are exact, so
    # targets can sit exactly on a block's (or a column's) cumulative boundary.
    w = rng.integers(0, 5, cols).astype(np.float32) / 64
    w[rng.uniform(size=cols) < 0.3] = 0.0
    if trial % 4 == 0:
      w[block:2 * block] = 0.0
    csum = np.cumsum(w)
    edges = csum[block - 1::block]  # cumulative weight at each block's end
    targets = [0.0, float(rng.uniform(0, csum[-1])), float(csum[-1]), float(csum[-1]) + 1.0,
               *map(float, edges), *map(float, csum[rng.integers(0, cols, 4)])]
    for t in targets:
      assert int(draw(jnp.asarray(w), jnp.float32(t), block)) == _expected(w, t), (trial, t)
  zero = np.zeros(2 * block, np.float32)
  assert int(draw(jnp.asarray(zero), jnp.float32(0.0), block)) == -1
