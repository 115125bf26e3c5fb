"""Pallas (Triton path) kernels of EAGLE speculative decoding, each with its reference."""

from eagle_jax.kernels.draft_proposal import propose_draft_tokens, propose_draft_tokens_reference
from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.kernels.gathered_lm_head import gathered_lm_head, gathered_lm_head_reference
from eagle_jax.kernels.paged_attention import (
    PagedAttentionConfig, paged_attention, paged_attention_config, paged_attention_reference)
from eagle_jax.kernels.norm_concat import (
    rmsnorm_concat, rmsnorm_concat_reference, rmsnorm_reference)
from eagle_jax.kernels.spec_sampler import (
    PAD_TOKEN, SamplerOutput, speculative_sample, speculative_sample_reference)

__all__ = [
    "PAD_TOKEN", "PagedAttentionConfig", "SamplerOutput", "gathered_lm_head",
    "gathered_lm_head_reference", "paged_attention", "paged_attention_config",
    "paged_attention_reference", "propose_draft_tokens",
    "propose_draft_tokens_reference", "rmsnorm_concat",
    "rmsnorm_concat_reference", "rmsnorm_reference", "sample_from_probs",
    "sampling_probs", "speculative_sample", "speculative_sample_reference",
]
