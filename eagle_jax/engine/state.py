"""The engine's device state, and the arrays that travel with an executable.

State layout (one row per slot, ``B_max`` rows; a step for bucket B works on rows
[0, B)): ``seq_len[b]`` tokens of request b are in the target's KV pool (positions
0 .. seq_len-1, in the pages ``page_table[b]`` lists); ``last_token[b]`` is the newest
committed token, at position seq_len, not yet in the pool. The draft has consumed every
committed token but the last ``draft_lag[b]``: its pool holds positions 0 .. seq_len -
draft_lag - 1 in the same pages (row j took token j+1 with the target's feature of
position j), ``draft_hidden[b]`` is its output at the last of those rows and
``draft_logits[b]`` the LM-head projection of that row, from which the next step's first
draft token comes.

The host's page allocator gives pages out between steps; each step and prefill first
applies the page-table entries the host assigned since the last one (``page_updates``),
so the table never travels whole.

A prefix-cache hit shares the target's pages of the whole matched prefix, but the draft's
last row of the last shared page (the boundary page) took the token after the page of
the request that computed it. Where the new request's token there differs, the draft
reads its own copy of that page (``draft_page_table``: the target's table with that one
entry replaced), and the request's first chunk recomputes the row into it
(``prefill.py``), with the target's feature there kept from the step that computed it
(``boundary_features``). So the target computes none of the cached positions and the
draft one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.models.layers import KVCache, KVPages
from eagle_jax.sampling import MAX_LOGPROBS, SamplingRows

Array = jax.Array

# Position given to padding tokens: past any page table, so their KV writes are dropped.
PAD_POSITION = 1 << 30

# Positions the draft may fall behind (steps of draft length 0 in a row): the host
# catches it up (``catch_up_draft``) before a row's lag would pass this.
MAX_DRAFT_LAG = 8


class DecodeState(NamedTuple):
    """Per-slot device buffers. Shapes: [B_max] unless noted; H = draft hidden size."""

    target_pages: KVPages  # per layer [P, page_size, K, D]
    draft_pages: KVPages | None  # the draft's pool, the same P pages
    page_table: Array  # [B_max, max_pages] i32
    seq_len: Array  # i32
    last_token: Array  # i32
    draft_hidden: Array | None  # [B_max, H]
    draft_logits: Array | None  # [B_max, V_draft] f32
    sampling: SamplingRows  # [B_max] each; free slots hold the padded rows
    key: Array  # [B_max, 2] u32, per-request PRNG key (threefry raw)
    active: Array  # bool
    # Benchmarks only: [] f32, accept each draft token with this probability instead of
    # by the sampler's verdict (a value, so one compiled step serves every rate).
    synthetic_acceptance: Array | None = None
    # With draft length 0 among the step's variants: the committed positions the draft
    # has not consumed, the last draft_lag[b] below seq_len (module docstring).
    draft_lag: Array | None = None  # [B_max] i32, at most MAX_DRAFT_LAG
    lag_tokens: Array | None = None  # [B_max, MAX_DRAFT_LAG] i32 the tokens there
    lag_features: Array | None = None  # [B_max, MAX_DRAFT_LAG, F] the target's features
    # With a draft and prefix caching (module docstring): the page table the draft's pool
    # is read through, and the target's feature at the last position of each page.
    draft_page_table: Array | None = None  # [B_max, max_pages] i32
    boundary_features: Array | None = None  # [P, F]

    def draft_cache(self, batch: int) -> KVCache:
        """The draft's pool and the page tables of rows [0, batch)."""
        table = self.page_table if self.draft_page_table is None else self.draft_page_table
        return KVCache(self.draft_pages, table[:batch])


class PrefillOutput(NamedTuple):
    """Per chunk ([L] leading): the token after it, sampled where it ends a new
    request's prompt (the first generated token), and that token's logprobs (None when
    no request of the call asked for logprobs: their top-k is a sort of the whole
    vocabulary per chunk)."""

    token: Array  # [L] i32
    logprob: Array | None  # [L] f32
    top_ids: Array | None  # [L, MAX_LOGPROBS] i32
    top_logprobs: Array | None  # [L, MAX_LOGPROBS] f32


class StepOutput(NamedTuple):
    """What the host reads after a step. Shapes [B, W] with W = S + 1 (1 for plain)."""

    tokens: Array  # i32, -1 past num_tokens
    num_tokens: Array  # [B] i32 committed this step (accept_len + 1; 0 for inactive)
    accept_len: Array  # [B] i32
    num_malformed: Array  # [B] i32 draft-probability entries that were not probabilities
    num_fallback: Array  # [B] i32 residual draws that fell back to p
    logprob: Array | None  # [B, W] f32 logprob of each committed token
    top_ids: Array | None  # [B, W, MAX_LOGPROBS] i32
    top_logprobs: Array | None  # [B, W, MAX_LOGPROBS] f32
    prefill: PrefillOutput | None = None  # the chunks the step carried (``chunks=``)


class PrefillChunks(NamedTuple):
    """The next chunk of the known tokens of each of L requests, chunk i to prefill into
    the pages of ``slot[i]``. Shapes [L] unless noted.

    page_row: [L, max_pages] the slots' page-table rows (the host reserved every page of
    the known tokens); tokens: [L, C] (padded past ``length``) at positions start ..
    start+length-1; next_token: the known token after the chunk (the next prompt token,
    or a resumed request's last generated token); sample_next: the chunk ends a new
    request's prompt, so the token after it is sampled (the first generated token)
    instead. A padding chunk has length 0 and slot B_max: it writes nothing.

    draft_col, draft_page: the request's boundary page (module docstring), column
    ``draft_col`` of ``page_row``, which the draft reads from its own copy
    ``draft_page``; -1: none. The chunk that starts right after that page (``lead``)
    makes the copy and extends the draft from the page's last position.
    """

    slot: Array  # i32
    page_row: Array  # [L, max_pages] i32
    tokens: Array  # [L, C] i32
    start: Array  # i32
    length: Array  # i32
    next_token: Array  # i32
    is_last: Array  # bool
    sample_next: Array  # bool
    draft_col: Array  # i32
    draft_page: Array  # i32

    @classmethod
    def padding(cls, num: int, size: int, num_slots: int, max_pages: int) -> "PrefillChunks":
        """``num`` padding chunks of ``size`` positions (host arrays, slot ``num_slots`` =
        B_max, length 0): a prefill of them writes nothing."""
        zeros = np.zeros((num,), np.int32)
        return cls(slot=np.full((num,), num_slots, np.int32),
                   page_row=np.zeros((num, max_pages), np.int32),
                   tokens=np.zeros((num, size), np.int32), start=zeros, length=zeros.copy(),
                   next_token=zeros.copy(), is_last=np.zeros((num,), bool),
                   sample_next=np.zeros((num,), bool),
                   draft_col=np.full((num,), -1, np.int32), draft_page=zeros.copy())

    def lead(self, page_size: int) -> Array:
        """[L] bool: the chunk starts right after its request's boundary page."""
        return (self.draft_col >= 0) & (self.start == (self.draft_col + 1) * page_size)

    def boundary_page(self) -> Array:
        """[L] the shared page at column ``draft_col`` (column 0's where there is none)."""
        return jnp.take_along_axis(self.page_row, jnp.maximum(self.draft_col, 0)[:, None],
                                   axis=1)[:, 0]

    def draft_page_row(self) -> Array:
        """[L, max_pages] the page-table rows the draft reads its pool through."""
        col = jnp.arange(self.page_row.shape[1])[None]
        return jnp.where(col == self.draft_col[:, None], self.draft_page[:, None],
                         self.page_row)

    def positions(self) -> Array:
        """[L, C] the tokens' positions, PAD_POSITION past ``length``."""
        idx = jnp.arange(self.tokens.shape[1])[None]
        return jnp.where(idx < self.length[:, None], self.start[:, None] + idx, PAD_POSITION)

    def rows(self, width: int) -> tuple[Array, Array, Array]:
        """The chunks as [L C / width, width] rows of tokens and positions, and each row's
        page-table row, so a decode step's forward carries them beside its own rows
        (each chunk attended as one block: ``AttentionBatch.tail_rows``)."""
        size = self.tokens.shape[1]
        return (self.tokens.reshape(-1, width), self.positions().reshape(-1, width),
                jnp.repeat(self.page_row, size // width, axis=0))


class SlotUpdates(NamedTuple):
    """The slots admitted and released since the last executable ran, applied by the
    next one (``update_slots``): a prefill chunk applies them itself, a step after one
    dispatch of their own, however many requests came and went. Shapes [B_max]; no slot
    is both assigned and released."""

    assign: Array  # bool: a new request's slot (inactive until prefilled)
    release: Array  # bool: a slot its request left
    sampling: SamplingRows  # the assigned slots' rows (other rows are not read)
    key: Array  # [B_max, 2] u32 the assigned slots' PRNG keys


def split_keys(keys: Array, num: int) -> tuple[Array, Array]:
    """keys: [B, 2] -> (next keys [B, 2], subkeys [B, num, 2])."""
    split = jax.vmap(lambda k: jax.random.split(k, num + 1))(keys)
    return split[:, 0], split[:, 1:]


def uniforms(subkey: Array, n: int) -> Array:
    """subkey: [B, 2] -> [B, n] uniform in [0, 1)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(subkey)


def token_logprobs(logits: Array, tokens: Array, vocab_size: int):
    """Raw-distribution logprobs of tokens [...] and the top MAX_LOGPROBS alternatives."""
    lp = jax.nn.log_softmax(logits[..., :vocab_size].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.clip(tokens, 0, vocab_size - 1)[..., None], -1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, vocab_size))
    return chosen, top_ids.astype(jnp.int32), top_lp


def apply_page_updates(state: DecodeState, updates: Array) -> DecodeState:
    """updates [U, 3] i32 rows (slot, index, page); a slot >= B_max (padding) is dropped.
    The draft's table takes them too (they never name a boundary page's column: that
    page came with the request's first chunk)."""
    def apply(table):
        return table.at[updates[:, 0], updates[:, 1]].set(updates[:, 2], mode="drop")

    return state._replace(page_table=apply(state.page_table),
                          draft_page_table=(None if state.draft_page_table is None else
                                            apply(state.draft_page_table)))


def slot_rows(state: DecodeState, batch: int):
    return (state.seq_len[:batch], state.last_token[:batch], state.sampling.rows(batch),
            state.key[:batch], state.active[:batch])


def write_rows(x: Array, batch: int, new: Array) -> Array:
    return x.at[:batch].set(new.astype(x.dtype))


# The fields ``update_slots`` writes: admissions and releases dispatch an executable over
# these alone, not the whole state (the KV pools are ~2 x layers buffers, each of them a
# cost of every dispatch it passes through).
SLOT_FIELDS = ("seq_len", "sampling", "key", "active", "draft_lag")


def slot_fields(state: DecodeState) -> DecodeState:
    """``state`` with only ``SLOT_FIELDS``, every other field None."""
    return DecodeState(**{f: getattr(state, f) if f in SLOT_FIELDS else None
                          for f in DecodeState._fields})


def update_slots(state: DecodeState, updates: SlotUpdates) -> DecodeState:
    """Applies ``updates``: an assigned slot takes its request's sampling row and key, at
    length 0; a released slot takes the padded row (TOP_K_ALL, T = 1). Both end
    inactive."""
    assign, release = updates.assign, updates.release
    padded = SamplingRows.padded(1)
    sampling = SamplingRows(*(
        jnp.where(assign, new.astype(old.dtype), jnp.where(release, pad[0], old))
        for old, new, pad in zip(state.sampling, updates.sampling, padded)))
    return state._replace(
        sampling=sampling,
        key=jnp.where(assign[:, None], updates.key, state.key),
        active=state.active & ~(assign | release),
        seq_len=jnp.where(assign, 0, state.seq_len),
        draft_lag=None if state.draft_lag is None else jnp.where(assign, 0, state.draft_lag),
    )
