"""Fused dual RMSNorm + concat against the unfused reference (seed 002)."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels.norm_concat import rmsnorm_concat, rmsnorm_concat_reference, rmsnorm_reference


@pytest.mark.parametrize("num_rows,hidden,dtype", [
    (1, 64, jnp.float32), (7, 96, jnp.bfloat16), (5, 130, jnp.float32), (9, 256, jnp.bfloat16)])
def test_matches_reference(num_rows, hidden, dtype):
  rng = np.random.default_rng(num_rows * hidden)
  e = jnp.asarray(rng.standard_normal((num_rows, hidden)) * 3, dtype)
  h = jnp.asarray(rng.standard_normal((num_rows, hidden)) + 1, dtype)
  we = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.float32)
  wh = jnp.asarray(rng.uniform(0.5, 1.5, hidden), jnp.bfloat16)  # weight dtype may differ
  out = rmsnorm_concat(e, h, we, wh, 1e-6, 1e-6)
  ref = rmsnorm_concat_reference(e, h, we, wh, 1e-6, 1e-6)
  assert out.dtype == dtype and out.shape == (num_rows, 2 * hidden)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(out[:, :hidden], np.float32),
                             np.asarray(rmsnorm_reference(e, we, 1e-6), np.float32), rtol=tol, atol=tol)


def test_guards_fall_back():
  rng = np.random.default_rng(0)
  e = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  h = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  w = jnp.ones((32,), jnp.float32)
  for args in [(e, h, w, w, 1e-6, 1e-5), (e, h.astype(jnp.bfloat16), w, w, 1e-6, 1e-6),
               (e.astype(jnp.float16), h.astype(jnp.float16), w, w, 1e-6, 1e-6)]:
    np.testing.assert_array_equal(np.asarray(rmsnorm_concat(*args), np.float32),
                                  np.asarray(rmsnorm_concat_reference(*args), np.float32))
