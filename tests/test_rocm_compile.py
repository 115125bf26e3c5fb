"""Every Pallas kernel compiles for gfx950 (MI355X) and gfx942 (MI300X) without spilling.

scripts/rocm_compile.py lowers each kernel call of the engine for ROCm at the
Llama-3.1-8B and Qwen3-32B shapes, compiles the Triton IR JAX emits with the ``triton``
package (the ``rocm-check`` extra, part of ``test``) and reads the code objects'
metadata. docs/ROCM.md must hold the table it prints.
"""

import sys

import pytest

from eagle_jax.kernels import _common

if not sys.platform.startswith("linux"):  # triton publishes Linux wheels only
  pytest.skip("the triton package exists for Linux only", allow_module_level=True)


def _load_tool():
  from eagle_jax.bench import rocm_compile

  return rocm_compile


rocm_compile = _load_tool()


@pytest.fixture(scope="module")
def rows():
  return rocm_compile.run(list(rocm_compile.MODELS), list(rocm_compile.ARCHS), log=lambda _: None)


def test_every_kernel_compiles_for_both_targets_without_spills(rows):
  assert rocm_compile.failures(rows) == []
  kernels = {"spec_sampler_partials", "spec_sampler_finish", "draft_proposal",
             "rmsnorm_concat", "gathered_lm_head", "paged_attention",
             "paged_attention_combine", "tree_sampler", "traversal_sampler", "traversal_draw",
             "tree_mask"}
  for model in rocm_compile.MODELS:
    for arch in rocm_compile.ARCHS:
      compiled = {r["kernel"] for r in rows if r["model"] == model and r["arch"] == arch}
      assert compiled == kernels, (model, arch)


def test_docs_hold_the_current_table(rows):
  assert rocm_compile.doc_table() == rocm_compile.table(rows), (
      "docs/ROCM.md is stale: run python scripts/rocm_compile.py --write-doc")


def test_kernels_are_lowered_with_the_targets_choices(rows):
  """The launch read from the IR is the AMD heuristic's (the tool asks for each target
  from this CPU), e.g. the attention's 32-key tiles and the LM head's LDS-sized stages."""
  by = {(r["model"], r["case"], r["kernel"], r["arch"]): r for r in rows}
  for arch in rocm_compile.ARCHS:
    gpu = _common.gpu_target(arch)
    head = by[("llama-3.1-8b", "gathered LM head, B=64", "gathered_lm_head", arch)]
    assert head["lds"] * 2 <= gpu.shared_bytes  # two workgroups per CU
  assert all(r["waves"] >= 2 for r in rows if r["kernel"] == "paged_attention")


def test_waves_per_simd():
  waves = rocm_compile.waves_per_simd
  assert waves("gfx942", 27, 23, 32, 8) == (8, "max")
  assert waves("gfx942", 168, 77, 32768, 4) == (2, "LDS")  # 2 workgroups of 4 waves
  assert waves("gfx950", 168, 77, 32768, 4) == (3, "VGPR")  # 512 // 168
  assert waves("gfx942", 64, 110, 0, 4) == (7, "SGPR")
  assert waves("gfx942", 134, 28, 73728, 4) == (0, "LDS")  # does not fit a CU
