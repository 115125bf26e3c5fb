"""The pure decode steps the engine jits: the plain step, the speculative chain and tree
steps, and the draft's catch-up.

Everything here is a function of arrays (the state: ``state.py``). The host side owns the
requests, picks a bucket, and calls the compiled executables; nothing in this module
reads a device value back to the host.

Structured output (``grammar``: the constrained variant of a step, None otherwise, so an
unconstrained step is traced as before): ``grammar(drafted [B, n])`` is each row's token
bitmask [B, W] after its n tokens drafted so far in this step (from the host's matchers,
``grammar_masks.host_masks``). The draft proposes from its masked logits (its q is what
it sampled from), and the target is masked at every verify position by the mask after
the draft prefix before it, so the accepted output follows the target's distribution
renormalised over the tokens the grammar allows, whatever the draft proposes; greedy
rows take the allowed argmax, as the masked plain step does.

A step of draft length 0 (the target's step alone) leaves the draft behind by the
position it commits, keeping that position's token and feature; ``catch_up_draft``
extends the draft over them before the next step that drafts. A step may carry prompt
chunks of requests in prefill in its target forward (``prefill.py``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from eagle_jax.engine.draft_tree import build_draft_tree
from eagle_jax.engine.grammar_masks import drafted, masked_draft_logits
from eagle_jax.engine.prefill import apply_chunk_pages, finish_chunks, store_step_features
from eagle_jax.engine.state import (
    MAX_DRAFT_LAG, PAD_POSITION, Array, DecodeState, PrefillChunks, StepOutput,
    apply_page_updates, slot_rows, split_keys, token_logprobs, uniforms, write_rows)
from eagle_jax.kernels.draft_proposal import propose_draft_tokens
from eagle_jax.kernels.filters import apply_token_bitmask, sample_from_probs, sampling_probs
from eagle_jax.kernels.spec_sampler import SamplerOutput, speculative_sample
from eagle_jax.kernels.tree_verify import verify_tree
from eagle_jax.models.draft_ops import draft_decode_step, draft_extend
from eagle_jax.models.layers import KVCache, KVPages, TreeLayout
from eagle_jax.sampling import SamplingRows


def _draft_argmax(logits: Array, d2t: Array | None, vocab_size: int | None) -> Array:
    """Greedy drafting: the first index of the maximum, mapped to target ids."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok if d2t is None else tok + d2t[tok]


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
               grammar: Callable[[Array], Array] | None = None,
               ) -> tuple[DecodeState, StepOutput]:
    """One token per request from the target alone (the non-speculative baseline); with
    ``chunks``, prompt chunks of requests in prefill ride in the same forward."""
    state = apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = slot_rows(state, batch)
    keys, sub = split_keys(keys, 1)
    positions = jnp.where(active, seq_len, PAD_POSITION)[:, None]
    _, _, logits, chunk_hidden, chunk_aux, pages = _forward_with_chunks(
        target, state, last[:, None], positions, chunks, ())
    logits = logits[:, 0]
    masked = logits if grammar is None else apply_token_bitmask(logits,
                                                                 grammar(drafted([], batch)))
    res = _target_token(masked, rows, uniforms(sub[:, 0], 1)[:, 0], vocab_size, active)
    token, n = res.tokens[:, 0], res.num_tokens
    state = state._replace(
        target_pages=pages,
        seq_len=write_rows(state.seq_len, batch, seq_len + n),
        last_token=write_rows(state.last_token, batch, jnp.where(active, token, last)),
        # An inactive row's key is not consumed: a slot in prefill (its chunk carried by
        # this step, or prefilled alone) samples the same stream either way.
        key=write_rows(state.key, batch, jnp.where(active[:, None], keys, state.key[:batch])),
    )
    lp = (token_logprobs(logits[:, None], token[:, None], vocab_size) if with_logprobs
          else (None,) * 3)
    zeros = jnp.zeros((batch,), jnp.int32)
    prefill = None
    if chunks is not None:
        state, prefill = finish_chunks(target, None, state, chunks, chunk_hidden, chunk_aux,
                                        vocab_size=vocab_size, with_logprobs=with_logprobs)
    return state, StepOutput(token[:, None], n, zeros, zeros, zeros, *lp, prefill=prefill)


def spec_step(target, draft, state: DecodeState, page_updates: Array, *, batch: int,
              num_steps: int, probabilistic: bool, vocab_size: int, with_logprobs: bool,
              draft_probs_hook: Callable[[Array], Array] | None = None,
              chunks: PrefillChunks | None = None,
              grammar: Callable[[Array], Array] | None = None,
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
    state = apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = slot_rows(state, batch)
    keys, sub = split_keys(keys, 3)
    u_propose, u_accept = uniforms(sub[:, 0], S), uniforms(sub[:, 1], S + 1)
    target_vocab = target.config.vocab_size

    # 1. Propose: S tokens, one draft forward per token after the first.
    draft_tokens, draft_probs, draft_probs_ok, draft_cache, masks = _propose(
        draft, state, batch, rows, u_propose, num_steps=S, probabilistic=probabilistic,
        target_vocab=target_vocab, vocab_size=vocab_size, grammar=grammar)
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
    # Verify position j masked by the grammar after d_1 .. d_j (logprobs: the raw target's).
    verify_logits = target_logits if masks is None else apply_token_bitmask(target_logits, masks)

    # 3. Accept (Pallas sampler). A step that drafts nothing (S = 0, the adaptive
    # policy's plain step) samples the target's token as plain_step does.
    if S == 0:
        res = _target_token(verify_logits[:, 0], rows, u_accept[:, 0], vocab_size, active)
    else:
        res = speculative_sample(draft_tokens, draft_probs, verify_logits, rows, u_accept,
                                 vocab_size, active, draft_probs_ok=draft_probs_ok)
    if state.synthetic_acceptance is not None and S:
        res = _synthetic_verdict(res, draft_tokens, target_logits, uniforms(sub[:, 2], S),
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
    state = store_step_features(state, batch, features, committed_pos)
    return _commit(target, draft, state, batch, res, emitted, keys, target_pages, ext, lp,
                   chunks, chunk_hidden, chunk_aux, vocab_size=vocab_size)


def _propose(draft, state: DecodeState, batch: int, rows: SamplingRows, u_propose: Array, *,
             num_steps: int, probabilistic: bool, target_vocab: int, vocab_size: int,
             grammar: Callable[[Array], Array] | None = None
             ) -> tuple[Array, Array | None, Array | None, KVCache, Array | None]:
    """``spec_step``'s proposal: S draft tokens from the draft's state, one draft forward
    per token after the first. Greedy drafting proposes every row's argmax (q is then
    one-hot); probabilistic drafting samples the rows that sample and still proposes the
    argmax for greedy rows (top_k <= 1, 001). With ``grammar`` each token is proposed
    from the draft's logits masked by the grammar after the tokens before it.

    Returns (draft tokens [B, S], their q [B, S, V] and each q's validity [B, S] when
    drafting is probabilistic (else None), the draft's cache after its forwards, and with
    ``grammar`` the bitmasks [B, S + 1, W] of the verify positions (else None))."""
    S = num_steps
    # A reduced draft vocabulary (d2t) holds real tokens only; a full-width draft shares
    # the target's padded embedding width and must mask the padding columns.
    draft_vocab = None if draft.d2t is not None else vocab_size
    seq_len, _, _, _, active = slot_rows(state, batch)
    draft_cache = state.draft_cache(batch)
    hidden = state.draft_hidden[:batch]
    logits = state.draft_logits[:batch]
    tokens, qs, qs_ok, masks = [], [], [], []
    for i in range(S):
        if grammar is not None:
            masks.append(grammar(drafted(tokens, batch)))
            logits = masked_draft_logits(logits, masks[-1], draft.d2t, target_vocab)
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
    if grammar is not None:
        masks.append(grammar(draft_tokens))
    masks = jnp.stack(masks, axis=1) if grammar is not None else None  # [B, S + 1, W]
    return draft_tokens, draft_probs, draft_probs_ok, draft_cache, masks


def _commit(target, draft, state: DecodeState, batch: int, res, emitted: Array, keys: Array,
            target_pages: KVPages, ext, lp: tuple, chunks: PrefillChunks | None,
            chunk_hidden: Array | None, chunk_aux: Array | None, *, vocab_size: int
            ) -> tuple[DecodeState, StepOutput]:
    """A speculative step's end (chain or tree): the rows' accept_len + 1 tokens (the
    emitted one last) committed, the draft's state after its extend ``ext`` kept (None:
    the step left the draft behind), the chunks the step carried finished; the step's
    output."""
    seq_len, last, _, _, active = slot_rows(state, batch)
    accept = res.accept_len
    n = jnp.where(active, accept + 1, 0)
    state = state._replace(
        target_pages=target_pages,
        seq_len=write_rows(state.seq_len, batch, seq_len + n),
        last_token=write_rows(state.last_token, batch, jnp.where(active, emitted, last)),
        # An inactive row's key is not consumed: a slot in prefill (its chunk carried by
        # this step, or prefilled alone) samples the same stream either way.
        key=write_rows(state.key, batch, jnp.where(active[:, None], keys, state.key[:batch])),
    )
    if ext is not None:
        state = _keep_draft(state, batch, ext, active)
    prefill = None
    if chunks is not None:
        state, prefill = finish_chunks(target, draft, state, chunks, chunk_hidden, chunk_aux,
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
    state = apply_chunk_pages(apply_page_updates(state, page_updates), chunks)
    seq_len, last, rows, keys, active = slot_rows(state, batch)
    keys, sub = split_keys(keys, 2)
    u_accept = uniforms(sub[:, 1], N + 2)

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
    res = verify_tree(
        verify_tokens, tree.parents, tree.draft_probs, tree.q_row, target_probs,
        rows.is_greedy, u_accept, vocab_size, active, method=tree_verify, max_depth=S,
        draft_probs_ok=tree.draft_probs_ok, max_children=K)
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
    state = store_step_features(state, batch, path_features, path_pos)
    return _commit(target, draft, state, batch, res, emitted, keys, target_pages, ext, lp,
                   chunks, chunk_hidden, chunk_aux, vocab_size=vocab_size)


def _keep_draft(state: DecodeState, batch: int, ext, rows: Array) -> DecodeState:
    """The draft's pool after the extend ``ext``, and its hidden and logits in ``rows``
    [B] (the others keep theirs)."""
    keep = rows[:, None]
    return state._replace(
        draft_pages=ext.cache.pages,
        draft_hidden=write_rows(state.draft_hidden, batch,
                                 jnp.where(keep, ext.hidden, state.draft_hidden[:batch])),
        draft_logits=write_rows(state.draft_logits, batch,
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
        draft_lag=write_rows(state.draft_lag, batch, lag + active))


def catch_up_draft(draft, state: DecodeState, *, batch: int) -> DecodeState:
    """Extends the draft over the positions that steps of draft length 0 left it behind
    by (the last ``draft_lag[b]`` below seq_len, at most MAX_DRAFT_LAG): one forward over
    their kept tokens and target features, the rows the steps' own extends would have
    run (row j takes token j + 1, the last row last_token), the LM head on each row's
    last. Rows not behind keep their draft state; every lag of the bucket is 0 after."""
    _require_lag_buffers(state)
    seq_len, last, _, _, active = slot_rows(state, batch)
    lag = state.draft_lag[:batch]
    behind = active & (lag > 0)
    j = jnp.arange(MAX_DRAFT_LAG)[None]
    positions = jnp.where(behind[:, None] & (j < lag[:, None]), (seq_len - lag)[:, None] + j,
                          PAD_POSITION)
    ext = draft_extend(draft, state.lag_tokens[:batch], last, jnp.maximum(lag, 1),
                       state.lag_features[:batch], positions, state.draft_cache(batch))
    state = _keep_draft(state, batch, ext, behind)
    return state._replace(draft_lag=write_rows(state.draft_lag, batch, jnp.zeros_like(lag)))


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
