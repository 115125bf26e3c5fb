"""Pure functions over a draft module that the engine's jitted step calls.

Convention (as sglang): the draft row at position j takes (token x_{j+1}, the target's
feature at position j) and predicts x_{j+2}. So

* prefill: the prompt's target features [0, L) with the prompt tokens shifted left by
  one, the last row's token being the target's first sampled token (``shift_tokens``);
* decode: one row per request, fed back the previous step's ``hidden_out``;
* extend over a verified window: every row's KV entry and hidden state is kept, but only
  ``rows[b]`` (the last accepted position) goes through the LM head (seed 000).

Every function returns new arrays; the cache is threaded functionally (donate it).
Padding rows carry a position >= the cache length (their KV writes are dropped).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eagle_jax.models.draft import Draft
from eagle_jax.models.layers import KVCache

Array = jax.Array


class DraftOutput(NamedTuple):
    """logits: [B, Vd] f32 of one row per request (draft ids; map with ``d2t``);
    hidden: [B, H] ``hidden_out`` at that row (the next draft step's input);
    hidden_all: [B, T, H] every row's ``hidden_out``; cache: the updated draft cache."""

    logits: Array
    hidden: Array
    hidden_all: Array
    cache: KVCache


def shift_tokens(tokens: Array, lengths: Array, next_token: Array) -> Array:
    """tokens [B, T], lengths [B], next_token [B] -> [B, T] shifted left by one.

    Row j < lengths[b] - 1 gets tokens[b, j + 1]; row lengths[b] - 1 gets next_token[b]
    (the target's first sampled token); rows past the length keep 0 (padding).
    """
    t = tokens.shape[1]
    j = jnp.arange(t)[None, :]
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    last = lengths[:, None] - 1
    out = jnp.where(j < last, nxt, 0)
    return jnp.where(j == last, next_token[:, None].astype(tokens.dtype), out).astype(tokens.dtype)


def draft_extend(draft: Draft, tokens: Array, features: Array, positions: Array, rows: Array,
                 cache: KVCache, slots: Array | None = None) -> DraftOutput:
    """Runs the draft over T rows of target features, projecting only ``rows``.

    tokens [B, T] i32 (already shifted: row j holds x_{j+1}); features [B, T, F] raw
    target features (``draft.project`` is applied here); positions [B, T]; rows [B] the
    row (index into T) of each request whose logits are wanted; slots [B] the cache rows
    the requests own (None: rows 0..B-1).
    """
    hidden_all, cache = draft(tokens, draft.project(features), positions, cache, slots)
    logits = draft.select_logits(hidden_all, rows)
    idx = jnp.clip(rows.astype(jnp.int32), 0, tokens.shape[1] - 1)
    hidden = jnp.take_along_axis(hidden_all, idx[:, None, None], axis=1)[:, 0]
    return DraftOutput(logits, hidden, hidden_all, cache)


def draft_prefill_extend(draft: Draft, prompt_tokens: Array, next_token: Array, lengths: Array,
                         features: Array, positions: Array, cache: KVCache,
                         slots: Array | None = None) -> DraftOutput:
    """The draft's prefill over a (padded) prompt bucket.

    prompt_tokens [B, T] the prompt as the target saw it; next_token [B] the target's first
    sampled token; lengths [B] prompt lengths (>= 1); features [B, T, F] the target's
    features at the prompt positions; positions [B, T] (padding >= cache length).
    The logits are those of row lengths - 1, predicting the token after ``next_token``.
    """
    tokens = shift_tokens(prompt_tokens, lengths, next_token)
    return draft_extend(draft, tokens, features, positions, lengths - 1, cache, slots)


def draft_decode_step(draft: Draft, token: Array, hidden: Array, position: Array,
                      cache: KVCache, slots: Array | None = None) -> tuple[Array, Array, KVCache]:
    """One draft step per request: token [B], hidden [B, H] (the previous ``hidden_out``),
    position [B] (, slots [B]) -> (logits [B, Vd] f32, hidden_out [B, H], cache)."""
    out, cache = draft(token[:, None], hidden[:, None], position[:, None], cache, slots)
    logits = draft.select_logits(out, jnp.zeros(token.shape, jnp.int32))
    return logits, out[:, 0], cache
