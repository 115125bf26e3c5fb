"""Every Pallas kernel lowers through the Triton path for CUDA and ROCm on a CPU machine.

jax.export needs the Triton custom call allowed explicitly: it carries no
serialisation-compatibility guarantee (the kernel IR is embedded in the module). Each
platform's export picks that platform's block sizes (``compiled_kernels(target=)``);
tests/test_rocm_compile.py compiles the ROCm IR for gfx950 and gfx942.
"""

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.kernels._common import TRITON_CUSTOM_CALL, compiled_kernels
from eagle_jax.kernels.draft_proposal import propose_draft_tokens
from eagle_jax.kernels.gathered_lm_head import gathered_lm_head
from eagle_jax.kernels.norm_concat import rmsnorm_concat
from eagle_jax.kernels.paged_attention import paged_attention
from eagle_jax.kernels.spec_sampler import speculative_sample
from eagle_jax.sampling import SamplingRows

S = jax.ShapeDtypeStruct
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32

TARGETS = {"cuda": "sm_90", "rocm": "gfx942"}

CASES = {
    "speculative_sample": (
        lambda d, q, l, t, k, tp, mp, u: speculative_sample(d, q, l, SamplingRows(t, k, tp, mp), u, 1000,
                                                            interpret=False),
        [S((4, 3), i32), S((4, 3, 1024), f32), S((4, 4, 1024), f32), S((4,), f32), S((4,), i32),
         S((4,), f32), S((4,), f32), S((4, 4), f32)], 2),
    "speculative_sample_onehot_q": (
        lambda d, l, t, k, tp, mp, u: speculative_sample(d, None, l, SamplingRows(t, k, tp, mp), u, 1000,
                                                         interpret=False, target_is_probs=True),
        [S((4, 3), i32), S((4, 4, 1024), f32), S((4,), f32), S((4,), i32), S((4,), f32), S((4,), f32),
         S((4, 4), f32)], 2),
    "propose_draft_tokens": (
        lambda l, t, k, tp, mp, u, d2t: propose_draft_tokens(l, SamplingRows(t, k, tp, mp), u, d2t=d2t,
                                                             target_vocab_size=2000, interpret=False),
        [S((4, 1000), f32), S((4,), f32), S((4,), i32), S((4,), f32), S((4,), f32), S((4,), f32),
         S((1000,), i32)], 1),
    "rmsnorm_concat": (
        lambda a, b, c, d: rmsnorm_concat(a, b, c, d, 1e-6, 1e-6, interpret=False),
        [S((8, 96), bf16), S((8, 96), bf16), S((96,), f32), S((96,), f32)], 1),
    "gathered_lm_head": (
        lambda h, r, w: gathered_lm_head(h, r, w, interpret=False),
        [S((16, 64), bf16), S((4,), i32), S((1000, 64), bf16)], 1),
    # Decode at B=1 over a 4096-token page table: split-K, so the attention kernel and
    # the combine; a tree-masked verify block over a 128-token table: one kernel (too short
    # to split).
    "paged_attention_split": (
        lambda q, k, v, pt, kl, ql: paged_attention(q, k, v, pt, kl, ql, interpret=False),
        [S((1, 1, 32, 128), bf16), S((300, 16, 8, 128), bf16), S((300, 16, 8, 128), bf16),
         S((1, 256), i32), S((1,), i32), S((1,), i32)], 2),
    "paged_attention_tree": (
        lambda q, k, v, pt, kl, ql, m: paged_attention(q, k, v, pt, kl, ql, block_mask=m,
                                                         interpret=False),
        [S((256, 6, 8, 64), f32), S((300, 16, 2, 64), f32), S((300, 16, 2, 64), f32),
         S((256, 8), i32), S((256,), i32), S((256,), i32), S((256, 6, 6), jnp.bool_)], 1),
}


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_exports_triton_kernel(name, platform):
  fn, args, num_calls = CASES[name]
  with compiled_kernels(target=TARGETS[platform]):
    exported = jax.export.export(
        jax.jit(fn), platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*args)
  text = exported.mlir_module()
  assert text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") == num_calls


def test_export_refused_without_opt_in():
  fn, args, _ = CASES["rmsnorm_concat"]
  with pytest.raises(ValueError, match="custom calls"):
    jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
