"""The pure functions the engine jits: prefill, the speculative step, the plain step.

Everything here is a function of arrays. The host-side scheduler (``engine.py``) owns
the requests, picks a bucket, and calls the compiled executables; nothing in this
module reads a device value back to the host.

State layout (one row per slot, ``B_max`` rows; a step for bucket B works on rows
[0, B)): ``seq_len[b]`` tokens of request b are in the target's KV pool (positions
0 .. seq_len-1, in the pages ``page_table[b]`` lists); ``last_token[b]`` is the newest
committed token, at position seq_len, not yet in the pool. The draft has consumed every
committed token but the last ``draft_lag[b]``: its pool holds positions 0 .. seq_len -
draft_lag - 1 in the same pages (row j took token j+1 with the target's feature of
position j), ``draft_hidden[b]`` is its output at the last of those rows and
``draft_logits[b]`` the LM-head projection of that row, from which the next step's first
draft token comes. A step of draft length 0 (the target's step alone) leaves the draft
behind by the position it commits, keeping that position's token and feature;
``catch_up_draft`` extends the draft over them before the next step that drafts.

The host's page allocator gives pages out between steps; each step and prefill first
applies the page-table entries the host assigned since the last one (``page_updates``),
so the table never travels whole.

A prefix-cache hit shares the target's pages of the whole matched prefix, but the draft's
last row of the last shared page (the boundary page) took the token after the page of
the request that computed it. Where the new request's token there differs, the draft
reads its own copy of that page (``draft_page_table``: the target's table with that one
entry replaced), and the request's first chunk recomputes the row into it: its draft
extend starts one position early, with the target's feature there kept from the step
that computed it (``boundary_features``, written at each page's last position by every
prefill chunk and by every verify that accepts that position). So the target computes
none of the cached positions and the draft one.

A step may carry the next prompt chunk of each of L requests in prefill (``chunks``):
their L x C positions become L C / W extra rows of the step's width W beside the B
decode rows of the target's forward (the weights are read once for decode and every
prefill), each chunk's rows with its own slot's page-table row. Each chunk attends as
one query block of C positions (one kernel call for all L, beside the decode rows'), so
its prefix is read from the pool once, not once per row. A prefill with no request
decoding runs the L chunks as a batch of its own (``prefill_chunks``). The KV pool is
written before attention in every layer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from eagle_jax.engine.draft_tree import build_draft_tree
from eagle_jax.kernels.draft_proposal import propose_draft_tokens
from eagle_jax.kernels.filters import sample_from_probs, sampling_probs
from eagle_jax.kernels.spec_sampler import SamplerOutput, speculative_sample
from eagle_jax.kernels.traversal_sampler import traversal_sample
from eagle_jax.kernels.tree_sampler import tree_speculative_sample
from eagle_jax.models.draft_ops import draft_decode_step, draft_extend
from eagle_jax.models.layers import KVCache, KVPages, TreeLayout
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


def _split_keys(keys: Array, num: int) -> tuple[Array, Array]:
    """keys: [B, 2] -> (next keys [B, 2], subkeys [B, num, 2])."""
    split = jax.vmap(lambda k: jax.random.split(k, num + 1))(keys)
    return split[:, 0], split[:, 1:]


def _uniforms(subkey: Array, n: int) -> Array:
    """subkey: [B, 2] -> [B, n] uniform in [0, 1)."""
    return jax.vmap(lambda k: jax.random.uniform(k, (n,), jnp.float32))(subkey)


def token_logprobs(logits: Array, tokens: Array, vocab_size: int):
    """Raw-distribution logprobs of tokens [...] and the top MAX_LOGPROBS alternatives."""
    lp = jax.nn.log_softmax(logits[..., :vocab_size].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, jnp.clip(tokens, 0, vocab_size - 1)[..., None], -1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, vocab_size))
    return chosen, top_ids.astype(jnp.int32), top_lp


def _draft_argmax(logits: Array, d2t: Array | None, vocab_size: int | None) -> Array:
    """Greedy drafting: the first index of the maximum, mapped to target ids."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok if d2t is None else tok + d2t[tok]


def apply_page_updates(state: DecodeState, updates: Array) -> DecodeState:
    """updates [U, 3] i32 rows (slot, index, page); a slot >= B_max (padding) is dropped.
    The draft's table takes them too (they never name a boundary page's column: that
    page came with the request's first chunk)."""
    def apply(table):
        return table.at[updates[:, 0], updates[:, 1]].set(updates[:, 2], mode="drop")

    return state._replace(page_table=apply(state.page_table),
                          draft_page_table=(None if state.draft_page_table is None else
                                            apply(state.draft_page_table)))


def _rows(state: DecodeState, batch: int):
    return (state.seq_len[:batch], state.last_token[:batch], state.sampling.rows(batch),
            state.key[:batch], state.active[:batch])


def _write_rows(x: Array, batch: int, new: Array) -> Array:
    return x.at[:batch].set(new.astype(x.dtype))


def _forward_with_chunks(target, state: DecodeState, tokens: Array, positions: Array,
                         chunks: PrefillChunks | None, aux_layers,
                         tree: TreeLayout | None = None) -> tuple:
    """The target's forward over the step's rows [B, W], and the chunks' rows after them
    when the step carries some (one read of the weights for all; each chunk attends as
    one query block). ``tree``: the B rows are draft trees.

    Returns (the forward's output for the B rows: hidden, aux_hidden, logits; the
    chunks' hidden [L, C, H] and aux_hidden [L, C, F] or None; the updated pool)."""
    batch, width = tokens.shape
    table = state.page_table[:batch]
    tail_rows = tail_blocks = 0
    if chunks is not None:
        chunk_tokens, chunk_pos, chunk_table = chunks.rows(width)
        tail_rows, tail_blocks = chunk_tokens.shape[0], chunks.tokens.shape[0]
        tokens = jnp.concatenate([tokens, chunk_tokens])
        positions = jnp.concatenate([positions, chunk_pos])
        table = jnp.concatenate([table, chunk_table])
        if tree is not None:
            tree = tree._replace(rope_positions=jnp.concatenate([tree.rope_positions,
                                                                 chunk_pos]))
    out = target(tokens, positions, KVCache(state.target_pages, table), aux_layers=aux_layers,
                 compute_logits=False, tree=tree, tail_rows=tail_rows,
                 tail_blocks=tail_blocks)

    def split(x):
        if x is None:
            return None, None
        return x[:batch], (None if chunks is None else
                           x[batch:].reshape(*chunks.tokens.shape, x.shape[-1]))

    hidden, chunk_hidden = split(out.hidden)
    aux, chunk_aux = split(out.aux_hidden)
    return hidden, aux, target.logits(hidden), chunk_hidden, chunk_aux, out.cache.pages


def plain_step(target, state: DecodeState, page_updates: Array, *, batch: int,
               vocab_size: int, with_logprobs: bool, chunks: PrefillChunks | None = None,
               ) -> tuple[DecodeState, StepOutput]:
    """One token per request from the target alone (the non-speculative baseline); with
    ``chunks``, prompt chunks of requests in prefill ride in the same forward."""
    state = _apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = _rows(state, batch)
    keys, sub = _split_keys(keys, 1)
    positions = jnp.where(active, seq_len, PAD_POSITION)[:, None]
    _, _, logits, chunk_hidden, chunk_aux, pages = _forward_with_chunks(
        target, state, last[:, None], positions, chunks, ())
    logits = logits[:, 0]
    res = _target_token(logits, rows, _uniforms(sub[:, 0], 1)[:, 0], vocab_size, active)
    token, n = res.tokens[:, 0], res.num_tokens
    state = state._replace(
        target_pages=pages,
        seq_len=_write_rows(state.seq_len, batch, seq_len + n),
        last_token=_write_rows(state.last_token, batch, jnp.where(active, token, last)),
        # An inactive row's key is not consumed: a slot in prefill (its chunk carried by
        # this step, or prefilled alone) samples the same stream either way.
        key=_write_rows(state.key, batch, jnp.where(active[:, None], keys, state.key[:batch])),
    )
    lp = (token_logprobs(logits[:, None], token[:, None], vocab_size) if with_logprobs
          else (None,) * 3)
    zeros = jnp.zeros((batch,), jnp.int32)
    prefill = None
    if chunks is not None:
        state, prefill = _finish_chunks(target, None, state, chunks, chunk_hidden, chunk_aux,
                                        vocab_size=vocab_size, with_logprobs=with_logprobs)
    return state, StepOutput(token[:, None], n, zeros, zeros, zeros, *lp, prefill=prefill)


def spec_step(target, draft, state: DecodeState, page_updates: Array, *, batch: int,
              num_steps: int, probabilistic: bool, vocab_size: int, with_logprobs: bool,
              draft_probs_hook: Callable[[Array], Array] | None = None,
              chunks: PrefillChunks | None = None,
              ) -> tuple[DecodeState, StepOutput]:
    """Propose S draft tokens, verify S + 1 positions, accept, extend the draft, commit.

    S = 0 is the target's step alone (the adaptive policy's choice where drafting does
    not pay): the target's forward over last_token and its token sampled; the draft
    does no work, the position joins the draft's lag (its token and the target's
    feature kept), and ``catch_up_draft`` extends the draft over the lag before a later
    step drafts again. The host runs it before a row's lag would pass MAX_DRAFT_LAG.

    With ``chunks``, prompt chunks of requests in prefill ride in the verify forward
    (their tokens as extra rows of S + 1), then get their draft extend and, on a
    request's last chunk, its first token, as ``prefill_chunks`` would give them.

    ``draft_probs_hook`` (tests only) rewrites the draft probabilities between the
    proposal and the sampler, as a corrupted buffer would (004).
    ``state.synthetic_acceptance`` (benchmarks only) replaces the sampler's verdict by
    accepting each draft token with that probability; the emitted token is then the
    target's argmax at the first rejected position.
    """
    S = num_steps
    state = _apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = _rows(state, batch)
    draft_cache = state.draft_cache(batch)
    keys, sub = _split_keys(keys, 3)
    u_propose = _uniforms(sub[:, 0], S)
    u_accept = _uniforms(sub[:, 1], S + 1)
    target_vocab = target.config.vocab_size
    # Greedy drafting proposes every row's argmax (q is then one-hot); probabilistic
    # drafting samples the rows that sample and still proposes the argmax for greedy rows
    # (top_k <= 1, 001).
    # A reduced draft vocabulary (d2t) holds real tokens only; a full-width draft shares
    # the target's padded embedding width and must mask the padding columns.
    draft_vocab = None if draft.d2t is not None else vocab_size

    # 1. Propose: S tokens, one draft forward per token after the first.
    hidden = state.draft_hidden[:batch]
    logits = state.draft_logits[:batch]
    tokens, qs, qs_ok = [], [], []
    for i in range(S):
        if probabilistic:
            proposal = propose_draft_tokens(logits, rows, u_propose[:, i], d2t=draft.d2t,
                                            target_vocab_size=target_vocab,
                                            vocab_size=draft_vocab)
            tok = proposal.tokens
            qs.append(proposal.probs)
            qs_ok.append(proposal.probs_ok)
        else:
            tok = _draft_argmax(logits, draft.d2t, draft_vocab)
        tokens.append(tok)
        if i + 1 < S:
            pos = jnp.where(active, seq_len + i, PAD_POSITION)
            logits, hidden, draft_cache = draft_decode_step(draft, tok, hidden, pos, draft_cache)
    draft_tokens = (jnp.stack(tokens, axis=1) if S else
                    jnp.zeros((batch, 0), jnp.int32))  # [B, S]
    draft_probs = jnp.stack(qs, axis=1) if probabilistic and S else None  # [B, S, V]
    draft_probs_ok = jnp.stack(qs_ok, axis=1) if probabilistic and S else None  # [B, S]
    if draft_probs_hook is not None and S:
        if draft_probs is None:
            draft_probs = jax.nn.one_hot(draft_tokens, target_vocab, dtype=jnp.float32)
        draft_probs = draft_probs_hook(draft_probs)

    # 2. Verify: [last_token, d_1 .. d_S] at positions seq_len .. seq_len + S.
    window = jnp.arange(S + 1)
    verify_tokens = jnp.concatenate([last[:, None], draft_tokens], axis=1)
    verify_pos = jnp.where(active[:, None], seq_len[:, None] + window, PAD_POSITION)
    hidden, aux, target_logits, chunk_hidden, chunk_aux, target_pages = _forward_with_chunks(
        target, state, verify_tokens, verify_pos, chunks, draft.feature_layers or ())
    features = aux if draft.feature_layers else hidden

    # 3. Accept (Pallas sampler). A step that drafts nothing (S = 0, the adaptive
    # policy's plain step) samples the target's token as plain_step does.
    if S == 0:
        res = _target_token(target_logits[:, 0], rows, u_accept[:, 0], vocab_size, active)
    else:
        res = speculative_sample(draft_tokens, draft_probs, target_logits, rows, u_accept,
                                 vocab_size, active, draft_probs_ok=draft_probs_ok)
    if state.synthetic_acceptance is not None and S:
        res = _synthetic_verdict(res, draft_tokens, target_logits, _uniforms(sub[:, 2], S),
                                 state.synthetic_acceptance, active)
    accept = res.accept_len
    emitted = jnp.take_along_axis(res.tokens, accept[:, None], axis=1)[:, 0]

    # 4. Draft extend over the verified window's committed tokens (last_token and the
    # accepted drafts, at seq_len .. seq_len + accept; the emitted token follows them).
    # Rows past the accepted prefix are padding; only row `accept` goes through the LM
    # head (000). A step that drafted nothing leaves it to catch_up_draft.
    committed_pos = jnp.where(window[None] <= accept[:, None], verify_pos, PAD_POSITION)
    if S == 0:
        state, ext = _append_lag(state, batch, last, features[:, 0], active), None
    else:
        ext = draft_extend(draft, verify_tokens, emitted, accept + 1, features, committed_pos,
                           draft_cache)

    # 5. Commit.
    lp = (token_logprobs(target_logits, res.tokens, vocab_size) if with_logprobs
          else (None,) * 3)
    state = _store_step_features(state, batch, features, committed_pos)
    return _commit(target, draft, state, batch, res, emitted, keys, target_pages, ext, lp,
                   chunks, chunk_hidden, chunk_aux, vocab_size=vocab_size)


def _commit(target, draft, state: DecodeState, batch: int, res, emitted: Array, keys: Array,
            target_pages: KVPages, ext, lp: tuple, chunks: PrefillChunks | None,
            chunk_hidden: Array | None, chunk_aux: Array | None, *, vocab_size: int
            ) -> tuple[DecodeState, StepOutput]:
    """A speculative step's end (chain or tree): the rows' accept_len + 1 tokens (the
    emitted one last) committed, the draft's state after its extend ``ext`` kept (None:
    the step left the draft behind), the chunks the step carried finished; the step's
    output."""
    seq_len, last, _, _, active = _rows(state, batch)
    accept = res.accept_len
    n = jnp.where(active, accept + 1, 0)
    state = state._replace(
        target_pages=target_pages,
        seq_len=_write_rows(state.seq_len, batch, seq_len + n),
        last_token=_write_rows(state.last_token, batch, jnp.where(active, emitted, last)),
        # An inactive row's key is not consumed: a slot in prefill (its chunk carried by
        # this step, or prefilled alone) samples the same stream either way.
        key=_write_rows(state.key, batch, jnp.where(active[:, None], keys, state.key[:batch])),
    )
    if ext is not None:
        state = _keep_draft(state, batch, ext, active)
    prefill = None
    if chunks is not None:
        state, prefill = _finish_chunks(target, draft, state, chunks, chunk_hidden, chunk_aux,
                                        vocab_size=vocab_size, with_logprobs=lp[0] is not None)
    return state, StepOutput(res.tokens, n, jnp.where(active, accept, 0), res.num_malformed_q,
                             res.num_fallback, *lp, prefill=prefill)


def tree_spec_step(target, draft, state: DecodeState, page_updates: Array, *, batch: int,
                   num_steps: int, topk: int, num_nodes: int, tree_verify: str,
                   vocab_size: int, with_logprobs: bool, chunks: PrefillChunks | None = None,
                   ) -> tuple[DecodeState, StepOutput]:
    """Draft a tree, verify its nodes in one forward, accept a path, move its KV, extend
    the draft, commit (EAGLE-2 dynamic trees: ``draft_tree.py`` builds the tree,
    ``traversal_sampler.py`` or ``tree_sampler.py`` verifies it).

    The tree has ``num_nodes`` nodes below the root (the last committed token), at most
    ``num_steps`` deep, ``topk`` children per expanded node. The target scores root and
    nodes at consecutive pool positions seq_len .. seq_len + num_nodes, each rotated at
    seq_len + its depth and attending to its ancestors only; after the verdict the
    accepted nodes' keys and values move to positions seq_len + 1 .., the rest are left
    as scratch above the sequence (never read: attention stops at seq_len). Sampling
    rows are verified as ``tree_verify`` says (``EngineConfig``: with the draft's real q
    by Traversal Verification or recursive rejection sampling, or by SGLang's
    target-only rule); greedy rows take the target's argmax path. With ``chunks``,
    prompt chunks ride in the verify forward in rows of num_nodes + 1 positions, as in
    ``spec_step``.
    """
    S, K, N = num_steps, topk, num_nodes
    target_only = tree_verify == "target_only"
    state = _apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = _rows(state, batch)
    keys, sub = _split_keys(keys, 2)
    u_accept = _uniforms(sub[:, 1], N + 2)

    # 1. Draft the tree (its scratch KV above seq_len).
    tree = build_draft_tree(
        draft, state.draft_logits[:batch], state.draft_hidden[:batch], seq_len, active, rows,
        sub[:, 0], state.draft_cache(batch), topk=K, num_steps=S,
        num_nodes=N, real_q=not target_only, target_vocab_size=target.config.vocab_size,
        vocab_size=None if draft.d2t is not None else vocab_size, pad_position=PAD_POSITION)

    # 2. Verify the root and the N nodes in one forward with the tree mask.
    verify_tokens = tree.tokens.at[:, 0].set(last)
    verify_pos = jnp.where(active[:, None], seq_len[:, None] + jnp.arange(N + 1), PAD_POSITION)
    layout = TreeLayout(seq_len[:, None] + tree.depth, tree.mask)
    hidden, aux, target_logits, chunk_hidden, chunk_aux, target_pages = _forward_with_chunks(
        target, state, verify_tokens, verify_pos, chunks, draft.feature_layers or (), layout)
    features = aux if draft.feature_layers else hidden

    # 3. Accept a path (Pallas tree sampler).
    target_probs = sampling_probs(target_logits, rows, vocab_size)
    if tree_verify == "traversal":
        res = traversal_sample(
            verify_tokens, tree.parents, tree.draft_probs, tree.q_row, target_probs,
            rows.is_greedy, u_accept, vocab_size, active, max_depth=S,
            draft_probs_ok=tree.draft_probs_ok, max_children=K)
    else:
        res = tree_speculative_sample(
            verify_tokens, tree.parents, tree.draft_probs, tree.q_row, target_probs,
            rows.is_greedy, u_accept, vocab_size, active, max_depth=S,
            draft_probs_ok=tree.draft_probs_ok, target_only=target_only)
    accept = res.accept_len
    path = jnp.maximum(res.path, 0)  # [B, S + 1] node indices, root first
    emitted = jnp.take_along_axis(res.tokens, accept[:, None], axis=1)[:, 0]
    depth = jnp.arange(S + 1)[None]
    on_path = active[:, None] & (depth <= accept[:, None])
    path_pos = jnp.where(on_path, seq_len[:, None] + depth, PAD_POSITION)

    # 4. The accepted nodes' target KV to positions seq_len + 1 .. seq_len + accept.
    cache = KVCache(target_pages, state.page_table[:batch])
    src = cache.slots(jnp.where(on_path, seq_len[:, None] + path, PAD_POSITION))
    dst = cache.slots(jnp.where(depth > 0, path_pos, PAD_POSITION))
    target_pages = target_pages.move(src, dst)

    # 5. Draft extend over the committed path (overwriting the tree's scratch rows).
    path_features = jnp.take_along_axis(features, path[:, :, None], axis=1)
    ext = draft_extend(draft, jnp.take_along_axis(verify_tokens, path, axis=1), emitted,
                       accept + 1, path_features, path_pos, tree.draft_cache)

    # 6. Commit.
    lp = (token_logprobs(jnp.take_along_axis(target_logits, path[:, :, None], axis=1),
                         res.tokens, vocab_size) if with_logprobs else (None,) * 3)
    state = _store_step_features(state, batch, path_features, path_pos)
    return _commit(target, draft, state, batch, res, emitted, keys, target_pages, ext, lp,
                   chunks, chunk_hidden, chunk_aux, vocab_size=vocab_size)


def _keep_draft(state: DecodeState, batch: int, ext, rows: Array) -> DecodeState:
    """The draft's pool after the extend ``ext``, and its hidden and logits in ``rows``
    [B] (the others keep theirs)."""
    keep = rows[:, None]
    return state._replace(
        draft_pages=ext.cache.pages,
        draft_hidden=_write_rows(state.draft_hidden, batch,
                                 jnp.where(keep, ext.hidden, state.draft_hidden[:batch])),
        draft_logits=_write_rows(state.draft_logits, batch,
                                 jnp.where(keep, ext.logits, state.draft_logits[:batch])))


def _require_lag_buffers(state: DecodeState) -> None:
    if state.draft_lag is None:
        raise ValueError("a step of draft length 0 and the draft's catch-up need the lag "
                         "buffers: build the state with 0 among the draft lengths")


def _append_lag(state: DecodeState, batch: int, tokens: Array, features: Array,
                active: Array) -> DecodeState:
    """The active rows' draft falls one position further behind: tokens [B] (at
    seq_len) and features [B, F] (the target's there) join their lag."""
    _require_lag_buffers(state)
    lag = state.draft_lag[:batch]
    r = jnp.arange(batch)
    i = jnp.minimum(lag, MAX_DRAFT_LAG - 1)  # the host keeps lag below MAX_DRAFT_LAG here
    return state._replace(
        lag_tokens=state.lag_tokens.at[r, i].set(
            jnp.where(active, tokens, state.lag_tokens[r, i])),
        lag_features=state.lag_features.at[r, i].set(
            jnp.where(active[:, None], features, state.lag_features[r, i]).astype(
                state.lag_features.dtype)),
        draft_lag=_write_rows(state.draft_lag, batch, lag + active))


def catch_up_draft(draft, state: DecodeState, *, batch: int) -> DecodeState:
    """Extends the draft over the positions that steps of draft length 0 left it behind
    by (the last ``draft_lag[b]`` below seq_len, at most MAX_DRAFT_LAG): one forward over
    their kept tokens and target features, the rows the steps' own extends would have
    run (row j takes token j + 1, the last row last_token), the LM head on each row's
    last. Rows not behind keep their draft state; every lag of the bucket is 0 after."""
    _require_lag_buffers(state)
    seq_len, last, _, _, active = _rows(state, batch)
    lag = state.draft_lag[:batch]
    behind = active & (lag > 0)
    j = jnp.arange(MAX_DRAFT_LAG)[None]
    positions = jnp.where(behind[:, None] & (j < lag[:, None]), (seq_len - lag)[:, None] + j,
                          PAD_POSITION)
    ext = draft_extend(draft, state.lag_tokens[:batch], last, jnp.maximum(lag, 1),
                       state.lag_features[:batch], positions, state.draft_cache(batch))
    state = _keep_draft(state, batch, ext, behind)
    return state._replace(draft_lag=_write_rows(state.draft_lag, batch, jnp.zeros_like(lag)))


def _target_token(logits: Array, rows: SamplingRows, u: Array, vocab_size: int,
                  active: Array):
    """The target's own token (no draft to verify; plain_step and a step of draft
    length 0): logits [B, V], u [B] -> a sampler output of width 1 (accept length 0,
    -1 for inactive rows)."""
    token = sample_from_probs(sampling_probs(logits, rows, vocab_size), u)
    zeros = jnp.zeros_like(token)
    return SamplerOutput(tokens=jnp.where(active, token, -1)[:, None],
                         num_tokens=active.astype(jnp.int32), accept_len=zeros,
                         num_malformed_q=zeros, num_fallback=zeros)


def _synthetic_verdict(res, draft_tokens: Array, target_logits: Array, u: Array, rate: float,
                       active: Array):
    """Accepts draft token i with probability ``rate`` while all before it were accepted."""
    S = draft_tokens.shape[1]
    accept = jnp.sum(jnp.cumprod(u < rate, axis=1), axis=1).astype(jnp.int32)
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, S+1]
    emitted = jnp.take_along_axis(target_argmax, accept[:, None], axis=1)
    window = jnp.arange(S + 1)[None]
    padded = jnp.concatenate([draft_tokens, emitted], axis=1)
    tokens = jnp.where(window < accept[:, None], padded,
                       jnp.where(window == accept[:, None], emitted, -1))
    accept = jnp.where(active, accept, 0)
    tokens = jnp.where(active[:, None], tokens, -1)
    return res._replace(tokens=tokens, accept_len=accept,
                        num_tokens=jnp.where(active, accept + 1, 0))


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
    state = _apply_chunk_pages(update_slots(state, slots), chunks)
    out = target(chunks.tokens, chunks.positions(),
                 KVCache(state.target_pages, chunks.page_row), compute_logits=False,
                 aux_layers=(draft.feature_layers or ()) if draft is not None else ())
    state = state._replace(target_pages=out.cache.pages)
    return _finish_chunks(target, draft, state, chunks, out.hidden, out.aux_hidden,
                          vocab_size=vocab_size, with_logprobs=with_logprobs)


def _apply_chunk_pages(state: DecodeState, chunks: PrefillChunks | None) -> DecodeState:
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


def _finish_chunks(target, draft, state: DecodeState, chunks: PrefillChunks, hidden: Array,
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
    key, sub = _split_keys(state.key[row], 1)
    probs = sampling_probs(logits, SamplingRows(*(x[row] for x in state.sampling)), vocab_size)
    first = sample_from_probs(probs, _uniforms(sub[:, 0], 1)[:, 0])
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


def _store_step_features(state: DecodeState, batch: int, features: Array,
                         positions: Array) -> DecodeState:
    """The state after a verify step whose rows committed features [B, W, F] at
    ``positions`` [B, W] (PAD_POSITION past each row's accepted ones)."""
    if state.boundary_features is None:
        return state
    return state._replace(boundary_features=_keep_page_end_features(
        state.boundary_features, state.page_table[:batch], features, positions,
        state.draft_pages.page_size))


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
