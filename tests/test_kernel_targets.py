"""The GPU target the block-size heuristics tune for, and what they pick per target.

The NVIDIA choices were measured on an H200 and must stay as they were; the AMD ones
follow from the compiled resource use in docs/ROCM.md.
"""

import importlib
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.kernels import _common
from eagle_jax.kernels._common import GPU_TARGETS, compiled_kernels, resolve_target

sampler = importlib.import_module("eagle_jax.kernels.spec_sampler")
proposal = importlib.import_module("eagle_jax.kernels.draft_proposal")
norm_concat = importlib.import_module("eagle_jax.kernels.norm_concat")
lm_head = importlib.import_module("eagle_jax.kernels.gathered_lm_head")
attention = importlib.import_module("eagle_jax.kernels.paged_attention")

SM90, GFX942, GFX950 = GPU_TARGETS["sm_90"], GPU_TARGETS["gfx942"], GPU_TARGETS["gfx950"]


def test_resolve_target():
  assert resolve_target(None) == SM90  # a CPU: JAX's own no-GPU assumption
  assert resolve_target("gfx942") == GFX942
  with compiled_kernels(target="gfx950"):
    assert resolve_target(None) == GFX950
    assert resolve_target("sm_90") == SM90  # an explicit argument wins
    with compiled_kernels():
      assert resolve_target(None) == GFX950  # an inner block without a target keeps it
  assert resolve_target(None) == SM90
  with pytest.raises(ValueError, match="gfx90a"):
    resolve_target("gfx90a")
  with pytest.raises(ValueError, match="unknown GPU target"), compiled_kernels(target="mi300"):
    pass


def test_device_target():
  def device(platform, kind, cc=None):
    return SimpleNamespace(platform=platform, device_kind=kind, compute_capability=cc)

  mi300x = device("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-")
  assert _common._device_target(mi300x) == GFX942
  assert _common._device_target(device("gpu", "AMD Instinct MI355X")) == GFX950
  assert _common._device_target(device("rocm", "AMD Instinct MI250X", "gfx90a")) == GFX942
  assert _common._device_target(device("gpu", "NVIDIA H200", "9.0")) == SM90
  assert _common._device_target(device("cuda", "NVIDIA H100 80GB HBM3")) == SM90


@pytest.mark.parametrize("vocab", [1000, 32000, 128256, 151936, 152064])
def test_nvidia_choices_unchanged(vocab):
  block = min(2048, _common.next_power_of_2(vocab))
  assert sampler._block_sizes(vocab, SM90) == (
      block, min(16384, max(block, _common.next_power_of_2(vocab))), 8, 3)
  proposal_block = min(2048, max(32, _common.next_power_of_2(vocab)))
  assert proposal._block_size(vocab, SM90) == (proposal_block,
                                               8 if proposal_block >= 1024 else 4)
  for batch in (1, 8, 64, 128):
    assert lm_head._block_sizes(batch, vocab, 2, SM90) == (
        min(64, max(16, _common.next_power_of_2(batch))), 128, 64, 4, 4)
  for hidden in (96, 4096, 5120):
    assert norm_concat._block_h(hidden, SM90) == (
        max(32, _common.next_power_of_2(hidden)),
        min(8, max(1, max(32, _common.next_power_of_2(hidden)) // 512)))


def test_nvidia_attention_choices_unchanged():
  cfg = attention._block_sizes
  # (batch, T, G, D, K, capacity) -> (block_q, block_n, splits, warps, stages)
  for args, want in [((64, 1, 4, 128, 8, 4096), (16, 64, 1, 4, 2)),
                     ((64, 6, 4, 128, 8, 4096), (32, 64, 1, 4, 2)),
                     ((1, 1, 4, 128, 8, 32768), (16, 64, 64, 4, 2)),
                     # A prefill chunk's 64-row tiles: 4 warps (8 past D = 128, below).
                     ((1, 512, 4, 128, 8, 8192), (64, 64, 1, 4, 2)),
                     # A 126-token chunk riding in a decode step: 64 programs of 64 rows,
                     # < 132 SMs: the short-chunk tile (32 rows, 128 keys, 3 stages).
                     ((1, 126, 4, 128, 8, 8704), (32, 128, 4, 4, 3)),
                     ((8, 6, 8, 256, 8, 8192), (64, 32, 8, 8, 2))]:
    c = cfg(*args, gpu=SM90)
    assert (c.block_q, c.block_n, c.num_splits, c.num_warps, c.num_stages) == want, args
  # A draft tree's verify (a block mask) keeps 8 warps for its 64-row tiles; a causal
  # block of the same size takes 4.
  assert cfg(64, 32, 4, 128, 8, 4096, gpu=SM90, causal=False).num_warps == 8
  assert cfg(64, 32, 4, 128, 8, 4096, gpu=SM90).num_warps == 4


def test_amd_choices():
  # Attention: 32-key tiles on a 64-wide wavefront (16 past D = 128), same splits.
  for gpu in (GFX942, GFX950):
    c = attention._block_sizes(64, 6, 4, 128, 8, 8192, gpu=gpu)
    assert (c.block_q, c.block_n, c.num_splits, c.num_warps) == (32, 32, 1, 4)
    assert attention._block_sizes(1, 1, 4, 256, 8, 8192, gpu=gpu).block_n == 16
    # A short chunk over a long prefix keeps 64-row tiles and splits at 2 x rows (the
    # NVIDIA short-chunk tile is untimed on AMD).
    c = attention._block_sizes(1, 126, 4, 128, 8, 8704, gpu=gpu)
    assert (c.block_q, c.block_n, c.min_split, c.num_splits, c.num_stages) == (
        64, 32, 1024, 8, 2)
  # LM head: 64-column tiles while 128 gives fewer programs than CUs; stages from LDS.
  assert lm_head._block_sizes(64, 32000, 2, GFX942) == (64, 64, 64, 4, 3)
  assert lm_head._block_sizes(64, 32000, 2, GFX950) == (64, 64, 64, 4, 4)
  assert lm_head._block_sizes(64, 128256, 2, GFX942) == (64, 128, 64, 4, 2)
  assert lm_head._block_sizes(8, 32000, 2, GFX942) == (16, 64, 64, 4, 4)
  assert lm_head._block_sizes(64, 32000, 4, GFX942) == (64, 64, 64, 4, 2)  # float32
  # Sampler: 8192-column chunks on 256-304 CUs.
  assert sampler._block_sizes(128256, GFX942).chunk == 8192
  assert sampler._block_sizes(151936, GFX950).chunk == 8192
  assert sampler._block_sizes(1000, GFX950).chunk == 1024


def test_arrays_past_the_kernels_int32_offsets_take_the_reference():
  """An input of more than 2**31 elements (the Triton path's offsets are int32) sends a
  kernel to its reference on any backend; None inputs are skipped; shapes only."""
  limit = _common.MAX_INDEXED_ELEMENTS
  at, past = (jax.ShapeDtypeStruct((limit // 1024, 1024), jnp.bfloat16),
              jax.ShapeDtypeStruct((limit // 1024 + 1, 1024), jnp.bfloat16))
  assert _common.kernel_backend_ok(None, at, None)
  assert not _common.kernel_backend_ok(None, at, past)
  assert not _common.kernel_backend_ok(False, past)  # a forced path too
