"""The bytes the benchmarks' physical bounds count (scripts/bench_engine.py,
scripts/bench_prefix.py), against parameter counts written out from the Llama shapes.

A decode or prefill bound of weight bytes over copy bandwidth is only as right as the
bytes: counting an untied embedding table, of which a forward reads a few rows,
counted 7% too many at the Llama-3.1-8B shape (16.06 GB where it reads 15.01)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from eagle_jax.bench.roofline import (
    Device, ModelCost, SpecRoofline, expected_tokens, weight_bytes)
from eagle_jax.bench.prefix import hit_read_floor
from eagle_jax.models.decoder import Decoder
from eagle_jax.testutil.random_models import SMALL, random_eagle3, random_target


def _layer_params(s: dict) -> int:
    """One Llama decoder layer: q, k, v, o, gate, up, down and two norms."""
    h, d, i = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    attention = h * d * (2 * s["num_heads"] + 2 * s["num_kv_heads"])
    return attention + 3 * h * i + 2 * h


def test_weight_bytes_leave_out_an_untied_embedding_table_only():
    s = SMALL
    untied = random_target(s, jnp.bfloat16)
    table, head = s["vocab_size"] * s["hidden_size"], s["vocab_size"] * s["hidden_size"]
    body = s["num_layers"] * _layer_params(s) + s["hidden_size"]  # layers and final norm
    assert weight_bytes(untied) == 2 * (body + head)  # the table's rows aside

    cfg = dataclasses.replace(untied.config, tie_word_embeddings=True)
    tied = Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert tied.lm_head is None
    assert weight_bytes(tied) == 4 * (body + table)  # the table is the LM head, read whole


def test_hit_read_floor_counts_both_models_weights_and_kv():
    s = SMALL
    target = random_target(s, jnp.bfloat16)
    draft = random_eagle3(target, jnp.bfloat16, 1024)
    h = s["hidden_size"]
    # EAGLE-3's draft: fc over 3 captured layers, one layer whose attention takes
    # [embedding, hidden] (2H wide) in, two input norms, its final norm and head.
    draft_params = (3 * h * h + _layer_params(s) + h * s["head_dim"] * (
        s["num_heads"] + 2 * s["num_kv_heads"]) + h + h + 1024 * h)
    assert weight_bytes(draft) == 2 * draft_params
    kv_per_position = 2 * (s["num_layers"] + 1) * s["num_kv_heads"] * s["head_dim"] * 2
    for positions in (1, 2112):
        assert hit_read_floor(target, draft, positions) == (
            weight_bytes(target) + weight_bytes(draft) + positions * kv_per_position)


# ------------------------------------------------------------------ the roofline
def test_model_cost_counts_every_matmul_parameter_once():
    """``ModelCost.of`` against the SMALL shape's parameters written out: the target's
    layers and (untied) LM head; the EAGLE-3 draft's fc over three features, its midlayer
    over [embedding, hidden] (2H wide) and its own reduced-vocabulary head; the KV and
    attention costs per position and per key."""
    s, h, d, i = SMALL, SMALL["hidden_size"], SMALL["head_dim"], SMALL["intermediate_size"]
    target = random_target(s, jnp.bfloat16)
    draft = random_eagle3(target, jnp.bfloat16, 1024)
    heads, kv = s["num_heads"], s["num_kv_heads"]

    cost = ModelCost.of(target)
    layer = h * d * (2 * heads + 2 * kv) + 3 * h * i  # matmuls only (norms are 1-D)
    assert cost.body_params == s["num_layers"] * layer
    assert cost.head_params == s["vocab_size"] * h
    assert cost.weight_bytes == weight_bytes(target)
    assert cost.kv_bytes_per_token == 2 * s["num_layers"] * kv * d * 2
    assert cost.attention_flops_per_key == 4 * heads * d * s["num_layers"]

    cost = ModelCost.of(draft)
    midlayer = 2 * h * d * (heads + 2 * kv) + heads * d * h + 3 * h * i
    assert cost.body_params == 3 * h * h + midlayer
    assert cost.head_params == 1024 * h
    assert cost.weight_bytes == 2 * (cost.body_params + cost.head_params + 4 * h)  # + norms
    assert cost.kv_bytes_per_token == 2 * kv * d * 2
    assert cost.attention_flops_per_key == 4 * heads * d


def _llama_8b_roofline(copy_gb_s=2900.0, matmul_tflops=700.0) -> SpecRoofline:
    """The Llama-3.1-8B target and its EAGLE-3 draft (32000-token head), by hand."""
    target = ModelCost(weight_bytes=15_010_000_000, body_params=6_980_000_000,
                       head_params=128256 * 4096, kv_bytes_per_token=131072,
                       attention_flops_per_key=4 * 32 * 128 * 32)
    draft = ModelCost(weight_bytes=848_000_000, body_params=293_000_000,
                      head_params=32000 * 4096, kv_bytes_per_token=4096,
                      attention_flops_per_key=4 * 32 * 128)
    return SpecRoofline(target, draft, Device(copy_gb_s * 1e9, matmul_tflops * 1e12))


def test_the_roofline_at_the_8b_shape():
    """Worked by hand (H100-like roofs: 2.9 TB/s, 700 TFLOP/s; 256 live positions; a =
    0.83): at batch 64 the plain step reads 17.16 GB (5.92 ms) and the verify of S = 3
    (256 rows, 3.88 TFLOP: 5.54 ms) is still bound by the same reads, so S = 3 costs
    5.92 + 3 draft forwards of 0.32 ms: 3.09 tokens for 6.88 ms, a speed-up of 2.66 and
    the best (S = 4: the verify's 320 rows are compute-bound, 6.9 ms). At batch 1 every
    forward reads its weights alone: the speed-up is E(S) x t_target / (t_target + S
    t_draft), and the best S is long. At batch 2048 drafting never pays."""
    roof = _llama_8b_roofline()
    plain = roof.plain_step_s(64, 256)
    assert plain == pytest.approx((15.01e9 + 64 * 256 * 131072) / 2.9e12)
    assert roof.spec_step_s(64, 256, 3) == pytest.approx(
        plain + 3 * (848e6 + 64 * 256 * 4096) / 2.9e12)
    assert expected_tokens(0.83, 3) == pytest.approx(1 + 0.83 + 0.83 ** 2 + 0.83 ** 3)
    assert roof.optimal(64, 256, 0.83) == (3, pytest.approx(2.664, abs=1e-3))
    assert roof.speedup(64, 256, 0.83, 0) == 1.0

    t, d = (m.weight_bytes + 256 * m.kv_bytes_per_token for m in (roof.target, roof.draft))
    for s in (1, 5, 8):
        assert roof.speedup(1, 256, 0.83, s) == pytest.approx(
            expected_tokens(0.83, s) * t / (t + s * d))
    assert roof.optimal(1, 256, 0.83)[0] == 8  # the longest offered
    assert roof.optimal(1, 256, 0.83, draft_lengths=(0, 1, 2, 3, 5))[0] == 5
    assert roof.optimal(2048, 256, 0.83) == (0, 1.0)
    # Faster matmuls move the batch-64 optimum to longer drafts; lower acceptance, shorter.
    assert roof.optimal(64, 256, 0.83)[0] < _llama_8b_roofline(
        matmul_tflops=2000).optimal(64, 256, 0.83)[0]
    assert roof.optimal(64, 256, 0.3)[0] < roof.optimal(64, 256, 0.83)[0]


@pytest.mark.parametrize("acceptance", [0.5, 0.7, 0.85])
def test_the_adaptive_policy_chooses_the_rooflines_length(acceptance):
    """Issue 62's check of the adaptive draft policy against the roofline, at the 8B
    shape: given the roofline's step times for every (batch bucket, compiled length) and
    the true acceptance, the policy (probes off) picks the roofline's best compiled
    length at batches 1-128; with its preference for shorter drafts (2%), a length
    whose roofline speed-up is within 2% of the best."""
    from eagle_jax.engine.draft_policy import AdaptiveDraftLength

    roof, live, lengths = _llama_8b_roofline(), 256, (0, 1, 2, 3, 5)
    batches = (1, 8, 32, 64, 128)
    seconds = {(b, s): roof.spec_step_s(b, live, s) for b in batches for s in lengths}
    exact = AdaptiveDraftLength(lengths, seconds, probe_every=10 ** 9, prefer_shorter=0.0)
    default = AdaptiveDraftLength(lengths, seconds, probe_every=10 ** 9)
    chosen = []
    for policy in (exact, default):
        policy.set_acceptance([acceptance] * max(lengths), trials=1e6)
    for b in batches:
        best, speedup = roof.optimal(b, live, acceptance, lengths)
        assert exact.choose(b) == best, (b, best)
        s = default.choose(b)
        assert roof.speedup(b, live, acceptance, s) >= 0.98 * speedup, (b, s, best)
        chosen.append(best)
    assert chosen[0] > chosen[-1]  # long drafts at batch 1, short ones at 128
