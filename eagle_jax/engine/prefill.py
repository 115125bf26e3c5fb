"""Prompt chunks: prefilled in a forward of their own, or finished after a decode step's
forward carried them (``step.py``).

A step may carry the next prompt chunk of each of L requests in prefill (``chunks``):
their L x C positions become L C / W extra rows of the step's width W beside the B
decode rows of the target's forward (the weights are read once for decode and every
prefill), each chunk's rows with its own slot's page-table row. Each chunk attends as
one query block of C positions (one kernel call for all L, beside the decode rows'), so
its prefix is read from the pool once, not once per row. A prefill with no request
decoding runs the L chunks as a batch of its own (``prefill_chunks``). The KV pool is
written before attention in every layer.

A chunk that follows its request's boundary page (``state.py``) recomputes that page's
last draft row: its draft extend starts one position early, with the target's feature
there kept (``boundary_features``, written at each page's last position by every prefill
chunk and by every verify that accepts that position).
"""

from __future__ import annotations

import jax.numpy as jnp

from eagle_jax.engine.state import (
    PAD_POSITION, Array, DecodeState, PrefillChunks, PrefillOutput, SlotUpdates, split_keys,
    token_logprobs, uniforms, update_slots)
from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.models.draft_ops import draft_extend
from eagle_jax.models.layers import KVCache
from eagle_jax.sampling import SamplingRows


def prefill_chunks(target, draft, state: DecodeState, chunks: PrefillChunks,
                   slots: SlotUpdates, *, vocab_size: int, with_logprobs: bool = False
                   ) -> tuple[DecodeState, PrefillOutput]:
    """Prefills the next chunk of each of L requests into the pages of their slots, alone
    (a step with no request decoding; else the decode step carries the chunks), after
    the slot changes ``slots`` (``update_slots``: the chunks' own admissions among them,
    so that new requests' prefill is one dispatch). One forward over the [L, C] chunks:
    the weights are read once for all of them.

    On a request's last chunk its slot becomes active with the token after the chunk as
    ``last_token``; the draft (a different model class: 003) runs its own extend over
    each chunk, the tokens shifted by one.
    """
    state = apply_chunk_pages(update_slots(state, slots), chunks)
    out = target(chunks.tokens, chunks.positions(),
                 KVCache(state.target_pages, chunks.page_row), compute_logits=False,
                 aux_layers=(draft.feature_layers or ()) if draft is not None else ())
    state = state._replace(target_pages=out.cache.pages)
    return finish_chunks(target, draft, state, chunks, out.hidden, out.aux_hidden,
                          vocab_size=vocab_size, with_logprobs=with_logprobs)


def apply_chunk_pages(state: DecodeState, chunks: PrefillChunks | None) -> DecodeState:
    """The chunks' slots take their page-table rows (a padding chunk's slot, B_max, is
    dropped), and the draft's; a chunk that follows a boundary page copies that page of
    the draft's pool into the request's own (``lead``)."""
    if chunks is None:
        return state
    state = state._replace(page_table=state.page_table.at[chunks.slot].set(
        chunks.page_row, mode="drop"))
    if state.draft_page_table is None:
        return state
    pages = state.draft_pages
    lead = chunks.lead(pages.page_size)
    dst = jnp.where(lead, chunks.draft_page, pages.num_pages)  # out of range: dropped
    return state._replace(
        draft_page_table=state.draft_page_table.at[chunks.slot].set(
            chunks.draft_page_row(), mode="drop"),
        draft_pages=pages.copy_pages(chunks.boundary_page(), dst))


def finish_chunks(target, draft, state: DecodeState, chunks: PrefillChunks, hidden: Array,
                   aux_hidden: Array | None, *, vocab_size: int, with_logprobs: bool
                   ) -> tuple[DecodeState, PrefillOutput]:
    """After the target's forward over the chunks (hidden [L, C, H], aux_hidden [L, C,
    F]): the token after each (sampled where it ends a new request's prompt), the
    draft's extend over each, and the slots' state. Writes to a padding chunk's slot
    (B_max) are dropped."""
    slot, length, is_last = chunks.slot, chunks.length, chunks.is_last
    row = jnp.minimum(slot, state.seq_len.shape[0] - 1)  # where a padding chunk reads
    last = jnp.clip(length - 1, 0, hidden.shape[1] - 1)
    last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = target.logits(last_hidden)  # [L, V]
    key, sub = split_keys(state.key[row], 1)
    probs = sampling_probs(logits, SamplingRows(*(x[row] for x in state.sampling)), vocab_size)
    first = sample_from_probs(probs, uniforms(sub[:, 0], 1)[:, 0])
    following = jnp.where(chunks.sample_next, first, chunks.next_token)
    lp, top_ids, top_lp = (token_logprobs(logits, first, vocab_size) if with_logprobs
                           else (None,) * 3)

    def put(x, new):
        return x.at[slot].set(new.astype(x.dtype), mode="drop")

    updates = dict(
        seq_len=put(state.seq_len, jnp.where(is_last, chunks.start + length,
                                             state.seq_len[row])),
        last_token=put(state.last_token, jnp.where(is_last, following, state.last_token[row])),
        key=put(state.key, jnp.where(is_last[:, None], key, state.key[row])),
        active=put(state.active, state.active[row] | is_last),
    )
    if draft is not None:
        features = aux_hidden if draft.feature_layers else hidden
        if state.boundary_features is None:
            window = chunks.tokens, features, chunks.positions(), length
            table = chunks.page_row
        else:
            window = _draft_window(chunks, features, state.boundary_features,
                                   state.draft_pages.page_size)
            table = chunks.draft_page_row()
            updates.update(boundary_features=_keep_page_end_features(
                state.boundary_features, chunks.page_row, features, chunks.positions(),
                state.draft_pages.page_size))
        tokens, features, positions, rows = window
        ext = draft_extend(draft, tokens, following, jnp.maximum(rows, 1), features, positions,
                           KVCache(state.draft_pages, table))
        updates.update(draft_pages=ext.cache.pages,
                       draft_hidden=put(state.draft_hidden, ext.hidden),
                       draft_logits=put(state.draft_logits, ext.logits))
    return state._replace(**updates), PrefillOutput(first, lp, top_ids, top_lp)


def _draft_window(chunks: PrefillChunks, features: Array, boundary_features: Array,
                  page_size: int) -> tuple[Array, Array, Array, Array]:
    """The draft extend's window over each chunk: tokens [L, C + 1], features [L, C + 1,
    F], positions [L, C + 1] and valid rows [L]. A chunk that follows its request's
    boundary page (``lead``) starts one position early, at that page's last position,
    with the target's feature kept there (``boundary_features`` of the page it shares);
    the others take their C positions and a padding row."""
    lead = chunks.lead(page_size)
    pad_token = jnp.zeros_like(chunks.tokens[:, :1])
    tokens = jnp.where(lead[:, None], jnp.concatenate([pad_token, chunks.tokens], axis=1),
                       jnp.concatenate([chunks.tokens, pad_token], axis=1))
    kept = boundary_features[chunks.boundary_page()][:, None].astype(features.dtype)
    features = jnp.where(lead[:, None, None], jnp.concatenate([kept, features], axis=1),
                         jnp.concatenate([features, jnp.zeros_like(kept)], axis=1))
    rows = chunks.length + lead
    j = jnp.arange(tokens.shape[1])[None]
    positions = jnp.where(j < rows[:, None], (chunks.start - lead)[:, None] + j, PAD_POSITION)
    return tokens, features, positions, rows


def _keep_page_end_features(table: Array, page_table: Array, features: Array,
                            positions: Array, page_size: int) -> Array:
    """``table`` [P, F] with the features [R, W, F] computed at ``positions`` [R, W]
    (PAD_POSITION where none) kept where a position is its page's last, for a later
    prefix hit's draft (``_draft_window``); row r's pages are ``page_table[r]``. Prefill
    chunks and verify steps both keep them, so every page can be a boundary page."""
    page_end = (positions < PAD_POSITION) & (positions % page_size == page_size - 1)
    cols = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
    pages = jnp.where(page_end, jnp.take_along_axis(page_table, cols, axis=1),
                      table.shape[0])  # out of range: dropped
    return table.at[pages.reshape(-1)].set(
        features.reshape(-1, features.shape[-1]).astype(table.dtype), mode="drop")


def store_step_features(state: DecodeState, batch: int, features: Array,
                         positions: Array) -> DecodeState:
    """The state after a verify step whose rows committed features [B, W, F] at
    ``positions`` [B, W] (PAD_POSITION past each row's accepted ones)."""
    if state.boundary_features is None:
        return state
    return state._replace(boundary_features=_keep_page_end_features(
        state.boundary_features, state.page_table[:batch], features, positions,
        state.draft_pages.page_size))
