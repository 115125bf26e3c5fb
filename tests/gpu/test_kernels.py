"""Every Pallas kernel compiled for the GPU (interpret=None resolves to the Triton path
there) against its pure-jnp reference: the CPU kernel tests, run here unchanged, with
their random inputs, references and tolerances (float32 dots at the suite's "highest"
matmul precision, tests/conftest.py, so Triton's dots take IEEE float32 operands).
Before each test a gigabyte of device memory is filled with 0xFF bytes and freed, so an
output element no program writes reads as NaN / -1 (poisoned outputs, as Pallas'
interpret mode poisons them on a CPU).

Also issue 61 on the hardware: the GPU's float32 division, whose x / x can exceed 1,
and sampling_probs, which must still return probabilities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import (test_kernels_filters, test_kernels_lm_head, test_kernels_norm_concat,
                   test_kernels_paged_attention, test_kernels_proposal, test_kernels_sampler,
                   test_kernels_traversal_sampler, test_kernels_tree_mask,
                   test_kernels_tree_sampler)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_device_memory")]

# Verify sampler (chain) and draft proposal.
test_sampler_matches_reference = test_kernels_sampler.test_matches_reference
test_sampler_greedy_rows = test_kernels_sampler.test_greedy_rows_follow_argmax_path
test_sampler_fault_injection = test_kernels_sampler.test_fault_injection_never_emits_invalid_ids
test_sampler_malformed_rows = (
    test_kernels_sampler.test_draft_row_malformed_elsewhere_is_never_accepted_and_is_counted)
test_proposal_greedy_rows = test_kernels_proposal.test_greedy_rows_propose_argmax_at_temperature_one
test_proposal_matches_reference = test_kernels_proposal.test_matches_reference_with_d2t
test_proposal_follows_q = test_kernels_proposal.test_sampled_rows_follow_q
test_proposal_row_check = test_kernels_proposal.test_row_check_flags_malformed_rows

# Gathered LM head, fused norm + concat.
test_lm_head_matches_reference = test_kernels_lm_head.test_matches_reference
test_lm_head_rows_clamped = test_kernels_lm_head.test_out_of_range_rows_are_clamped
test_norm_concat_matches_reference = test_kernels_norm_concat.test_matches_reference
test_norm_concat_guards = test_kernels_norm_concat.test_guards_fall_back

# Paged attention (every pool row without a live key is NaN in these inputs).
_pa = test_kernels_paged_attention
test_attention_matches_reference = _pa.test_matches_reference
test_attention_tree_mask = _pa.test_tree_mask
test_attention_mask_wider_than_block = _pa.test_mask_wider_than_block
test_attention_wide_mask_causal = _pa.test_wide_mask_all_before_block_is_causal
test_attention_page_size = _pa.test_page_size_not_dividing_block_n
test_attention_contract_violations = _pa.test_contract_violations_never_read_out_of_bounds
test_attention_short_chunk = _pa.test_short_chunk_over_a_long_prefix
test_attention_jit_head_dim = _pa.test_jit_and_non_power_of_two_head_dim


def test_attention_reads_a_pool_past_four_gib():
  """A K / V pool of more than 2**32 bytes ([140000, 16, 8, 128] bfloat16: 4.27 GiB,
  2.29e9 elements each), the rows' pages at its end (element offsets past 2**31), every
  other page NaN: the kernel's output equals the reference's over those pages alone.
  jax's Pallas Triton lowering computes offsets in i64 for arrays past 4 GiB (its Triton
  IR shows them, docs/history/2026-12-07-issue-60-first-ttft-and-compile-threads.md): what
  the kernel's limit (``max_pool_pages``: int32 rows, not elements) relies on."""
  from eagle_jax.kernels.paged_attention import paged_attention, paged_attention_reference

  num_pages, page_size, k, d, n = 140_000, 16, 8, 128, 32
  assert num_pages * page_size * k * d > 2**31
  rng = np.random.default_rng(12)
  kv_len = np.array([128, 77, 16], np.int32)
  table = np.arange(num_pages - 24, num_pages, dtype=np.int32).reshape(3, 8)
  live = (3 * 8, page_size, k, d)
  k_live, v_live = (jnp.asarray(rng.standard_normal(live), jnp.bfloat16) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((3, 1, n, d)), jnp.bfloat16)
  put = jax.jit(lambda pool, rows: pool.at[table.ravel()].set(rows), donate_argnums=0)
  pools = [put(jnp.full((num_pages, page_size, k, d), jnp.nan, jnp.bfloat16), rows)
           for rows in (k_live, v_live)]
  ones = jnp.ones(3, jnp.int32)
  out = paged_attention(q, *pools, table, kv_len, ones, interpret=False)
  del pools
  compact = np.arange(24, dtype=np.int32).reshape(3, 8)
  ref = paged_attention_reference(q, k_live, v_live, compact, kv_len, ones)
  test_kernels_paged_attention._check(out, ref, [1, 1, 1], jnp.bfloat16)

# Tree mask.
test_tree_mask_matches_reference = (
    test_kernels_tree_mask.test_random_trees_kernel_matches_reference_and_walk)
test_tree_mask_chain = test_kernels_tree_mask.test_chain_is_lower_triangular
test_tree_mask_jit_dtypes = test_kernels_tree_mask.test_jit_and_integer_dtypes

# Tree samplers: recursive rejection and Traversal Verification.
_ts, _tv = test_kernels_tree_sampler, test_kernels_traversal_sampler
test_tree_sampler_matches_reference = _ts.test_random_trees_kernel_matches_reference
test_tree_sampler_greedy_chain = _ts.test_greedy_rows_follow_argmax_chain
test_tree_sampler_rrs_trees = _ts.test_kernel_matches_reference_on_rrs_trees
test_tree_sampler_fault_injection = _ts.test_fault_injection_never_emits_invalid_ids
test_tree_sampler_malformed_rows = _ts.test_malformed_row_rejected_and_counted
test_traversal_matches_reference = _tv.test_random_trees_kernel_matches_reference
test_traversal_greedy_rows = _tv.test_greedy_rows_equal_the_argmax_walk
test_traversal_fixed_tree = _tv.test_kernel_matches_reference_on_a_fixed_tree
test_traversal_last_round = _tv.test_the_last_round_of_passes_is_reached
test_traversal_fault_injection = _tv.test_fault_injection_never_emits_invalid_ids
test_traversal_flagged_rows = _tv.test_flagged_q_rows_are_set_aside_and_counted


def test_kernels_compile_for_the_gpu():
  """The tests above ran the Triton kernels, not the references: the backend is a GPU,
  where interpret=None means compiled."""
  from eagle_jax.kernels import _common

  assert jax.default_backend() != "cpu"
  assert _common.resolve_interpret(None) is False


def test_issue61_division_exceeds_one_but_probabilities_do_not():
  """Issue 61 on the hardware. XLA's float32 division on an NVIDIA GPU is not correctly
  rounded: x / x is 1 + 2**-23 for some x (never on a CPU). sampling_probs, which ends in
  such a division, must still give probabilities: on rows that top-p cuts to one token,
  no entry above 1, and every row passes the draft's row check. (Printed: how often the
  GPU's x / x exceeds 1, and how often the CPU regression test's emulation of the
  division, tests/test_kernels_filters.py, gives the GPU's result.)"""
  from eagle_jax.kernels.draft_proposal import probs_row_ok
  from eagle_jax.kernels.filters import sampling_probs

  x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.0, 1 << 20).astype(np.float32))
  ratio = np.asarray(jax.jit(lambda a, b: a / b)(x, x))
  overshoot = float(np.mean(ratio > 1.0))
  emulated = test_kernels_filters.gpu_div(np.asarray(x), np.asarray(x))
  print(f"\nGPU x / x > 1 for {overshoot:.1%} of x in [0.5, 1) (max {ratio.max()!r}); "
        f"the emulation > 1 for {np.mean(emulated > 1):.1%}, equal to the GPU's for "
        f"{np.mean(emulated == ratio):.1%}")
  logits, rows = test_kernels_filters.peaked_rows(61, rows=4096, vocab=8192)
  q = np.asarray(jax.jit(sampling_probs)(logits, rows))
  assert q.max() <= 1.0 and q.min() >= 0.0
  assert np.asarray(probs_row_ok(q)).all()
