"""The bytes the benchmarks' physical bounds count (scripts/bench_engine.py,
scripts/bench_prefix.py), against parameter counts written out from the Llama shapes.

A decode or prefill bound of weight bytes over copy bandwidth is only as right as the
bytes: counting an untied embedding table, of which a forward reads a few rows,
counted 7% too many at the Llama-3.1-8B shape (16.06 GB where it reads 15.01)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from eagle_jax.bench.engine import weight_bytes
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
