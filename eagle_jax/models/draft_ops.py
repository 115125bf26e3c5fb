"""The draft's two operations in the engine's step: extend over committed tokens, decode.

These are the functions the engine's jitted prefill and speculative step call (and the
tests call the same ones): there is one extend, whether the window is a prompt chunk
or the verified window of a speculative step.

Convention (as sglang): the draft row at position j takes (token x_{j+1}, the target's
feature at position j) and predicts x_{j+2}. So an extend over committed tokens
x_j .. x_{j+n-1} (the target's positions j .. j+n-1) needs the token after them,
``next_token``: the next prompt token for a prompt chunk, the target's first sampled
token after the prompt's last chunk, the token the verifier emitted after an accepted
window. Only the window's last row goes through the LM head (seed 000): [B, Vd]
logits, never [B, T, Vd].

Every function returns new arrays; the cache is threaded functionally (donate it).
Padding rows carry a position past the page table's capacity (their KV writes are
dropped); each row's valid tokens are a prefix of its window.
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

    Row j < lengths[b] - 1 gets tokens[b, j + 1]; row lengths[b] - 1 gets next_token[b];
    rows past the length get 0 (padding).
    """
    t = tokens.shape[1]
    j = jnp.arange(t)[None, :]
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    last = lengths[:, None] - 1
    out = jnp.where(j < last, nxt, 0)
    return jnp.where(j == last, next_token[:, None].astype(tokens.dtype), out).astype(tokens.dtype)


def draft_extend(draft: Draft, tokens: Array, next_token: Array, lengths: Array,
                 features: Array, positions: Array, cache: KVCache) -> DraftOutput:
    """Runs the draft over windows of committed tokens, projecting only each last row.

    tokens [B, T] i32: the committed tokens as the target saw them (row j at position
    ``positions[b, j]``), valid for j < lengths[b] (>= 1); next_token [B]: the committed
    token after each window; features [B, T, F]: the target's raw features at those
    positions (``draft.project`` is applied here); positions [B, T] (padding past the page
    table's capacity); cache: the draft's pool and the rows' page tables.
    The logits are those of row lengths - 1, predicting the token after ``next_token``.
    """
    shifted = shift_tokens(tokens, lengths, next_token)
    hidden_all, cache = draft(shifted, draft.project(features), positions, cache)
    rows = lengths.astype(jnp.int32) - 1
    logits = draft.select_logits(hidden_all, rows)
    idx = jnp.clip(rows, 0, tokens.shape[1] - 1)
    hidden = jnp.take_along_axis(hidden_all, idx[:, None, None], axis=1)[:, 0]
    return DraftOutput(logits, hidden, hidden_all, cache)


def draft_decode_step(draft: Draft, token: Array, hidden: Array, position: Array,
                      cache: KVCache) -> tuple[Array, Array, KVCache]:
    """One draft step per request: token [B], hidden [B, H] (the previous ``hidden_out``),
    position [B] -> (logits [B, Vd] f32, hidden_out [B, H], cache)."""
    out, cache = draft(token[:, None], hidden[:, None], position[:, None], cache)
    logits = draft.select_logits(out, jnp.zeros(token.shape, jnp.int32))
    return logits, out[:, 0], cache
