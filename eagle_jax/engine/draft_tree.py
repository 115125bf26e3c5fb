"""EAGLE-2 dynamic draft trees, built on the device inside the jitted step.

Per row b (seq_len L, the last committed token x_L at position L, the draft's hidden and
logits after row L - 1, which predict the token at L + 1):

* **Levels.** Level 1 draws K children of the root from the draft's logits. Level l >= 2
  expands the F_{l-1} *frontier* nodes of level l - 1 (``frontier_sizes``: at least K):
  one draft forward over their tokens (their parents' hidden states as input, RoPE
  position L + l - 1), K children each. S levels in all (``num_steps``), so a path
  drafts at most S tokens, as a chain of length S does.
* **Scratch KV.** Expanding a level writes its frontier nodes' draft keys at scratch
  positions above the committed ones, level after level (``scratch_positions`` in all).
  Each query attends to the committed context and, through the paged kernel's wide
  block mask, only to its own ancestors' scratch rows. The draft extend after
  verification writes over them.
* **The tree.** ``num_nodes`` candidates become the tree's nodes, numbered so that
  parents come before children and each node's children follow their draw order
  (candidate index order: level, then parent's frontier rank, then draw order). Node 0
  is the root.

How candidates are drawn and chosen depends on how the row is verified
(``tree_sampler.py``):

* **Greedy rows and target-only verification** take each node's top-K draft tokens
  (deterministic candidates, so any tree is exact for them) and EAGLE-2's rule: the
  frontier is the level's top F by cumulative draft log-probability, and the tree is
  the top ``num_nodes`` candidates over all levels by that score (a node never ranks
  below its child: log q <= 0, ties broken by candidate index).
* **Sampling rows verified with the draft's real q (recursive rejection sampling)**
  draw each node's K children WITHOUT replacement from q (the row's filtered draft
  distribution, the one the sampler divides by). RRS is exact only if the decision to
  include the k-th child never depends on that child's own token, on its later
  siblings, or on anything drawn below them (``tree_sampler.py``'s docstring). EAGLE-2's
  global rerank breaks this (a high-q child gets expanded, pushing other branches'
  candidates out of the top N, which lifts the child itself into the tree). So these
  rows rank each candidate by a score fixed before its own draw,
  ``sel = sum, over it and its ancestors, of log(q mass left before that node's draw)``
  (its parent's ``sel`` plus its own term), which falls along the draw order and from
  parent to child. It leaves out the drawn tokens' own q, which EAGLE-2's path score
  sums: RRS accepts a drawn token with probability min(1, p / q'), which does not fall
  with its q, so a path through a low-q draw is no worse a place to grow the tree, while
  a path through later siblings (whose earlier siblings took mass) is reached less often
  (on the default pair at T = 1, K = 4: accept length 3.45-3.48 against 3.32-3.33 with
  the parent's cumulative log q in its place,
  docs/history/2026-12-01-issue-15-tree-drafting-acceptance.md). They choose level
  by level: level l keeps its top ``level_widths[l]`` candidates, every kept node's first child
  before any later sibling (the first child's inclusion depends only on its parent's),
  then by ``sel``; every kept node is expanded. So a sampled path that reaches a kept
  node finds children there, as a chain's does. A level's ranking only compares
  candidates whose scores were fixed by draws at earlier levels and earlier siblings, so
  every inclusion decision is made before the tokens it could peek at are drawn.
  ``tests/test_draft_tree.py`` checks the first two committed tokens against the target
  (and that EAGLE-2's rerank of these rows fails the same test); docs/BENCHMARKS.md,
  "Tree drafting", has the accept lengths (greedy rows keep EAGLE-2's rule).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from eagle_jax.kernels.draft_proposal import probs_row_ok
from eagle_jax.kernels.filters import sampling_probs
from eagle_jax.kernels.tree_mask import build_tree_mask
from eagle_jax.models.layers import KVCache, TreeLayout
from eagle_jax.sampling import SamplingRows

Array = jax.Array

_NEG = -jnp.inf
# Added to the key of a sampled row's first children: above any path score, so each
# expanded node's first child is kept before any later sibling (a kept path goes on).
_FIRST_CHILD = 1e6


class DraftTree(NamedTuple):
    """A draft tree per row. N1 = num_nodes + 1 nodes (node 0 the root), E expanded
    nodes (the root, then the frontier of levels 1 .. S-1: 1 + ``scratch_positions``)."""

    tokens: Array  # [B, N1] i32 target ids (node 0: the last committed token)
    parents: Array  # [B, N1] i32, -1 for the root and absent nodes
    depth: Array  # [B, N1] i32
    mask: Array  # [B, N1, N1] bool: node j is node i or one of its ancestors
    q_row: Array  # [B, N1] i32: the expanded node whose q node i was drawn from
    draft_probs: Array | None  # [B, E, V_target] f32 (real-q verification only)
    draft_probs_ok: Array | None  # [B, E] bool
    draft_cache: KVCache  # the draft's pool with the scratch rows written


def level_widths(topk: int, num_steps: int, num_nodes: int) -> tuple[int, ...]:
    """Nodes each level contributes to a real-q tree: an even share of what is left, at
    least the level above's (so every kept node's first child fits), at most its
    candidates (K at level 1, then K per node kept above); none after a level that kept
    fewer than K (a sampled row's tree then ends)."""
    widths, left = [], num_nodes
    for level in range(1, num_steps + 1):
        if level > 1 and widths[-1] < topk:
            widths.append(0)
            continue
        room = topk if level == 1 else widths[-1] * topk
        share = -(-left // (num_steps - level + 1))
        widths.append(min(room, max(share, widths[-1] if widths else topk), left))
        left -= widths[-1]
    return tuple(widths)


def frontier_sizes(topk: int, num_steps: int, num_nodes: int) -> tuple[int, ...]:
    """Nodes each level 1 .. S-1 expands: its real-q width (every kept node of a sampled
    row gets children), at least K (EAGLE-2's frontier), at most its candidates."""
    sizes, room = [], topk
    for width in level_widths(topk, num_steps, num_nodes)[:-1]:
        sizes.append(min(room, max(topk, width)))
        room = sizes[-1] * topk
    return tuple(sizes)


def scratch_positions(topk: int, num_steps: int, num_nodes: int) -> int:
    """Draft KV rows a tree writes above the sequence: one per expanded node."""
    return sum(frontier_sizes(topk, num_steps, num_nodes))


def draw_children(logits: Array, rows: SamplingRows, real_rows: Array, draw_keys: Array,
              d2t: Array | None, vocab_size: int | None, topk: int):
    """K children of each of R expanded nodes.

    logits [B, R, Vd]; real_rows [B] (draw from q, else take the top K); draw_keys [B, 2]
    uint32, this level's PRNG key of each row. Returns (tokens [B, R, K] target ids, their
    step log-probability [B, R, K] (raw draft log-softmax for top-K rows, log q for drawn
    ones; -inf where fewer than K tokens have mass), the q mass left before each draw
    [B, R, K] (1 for top-K rows), q [B, R, Vd]).

    Drawn rows take K draws without replacement from q by the Gumbel-top-K trick: the K
    largest of log q(v) + G_v (G_v i.i.d. standard Gumbel, v with q(v) > 0), in
    decreasing order, are distributed exactly as K successive draws, each from q with the
    earlier draws removed and renormalised (Plackett-Luce; Kool et al., 2019), which is
    what recursive rejection sampling assumes of siblings. One pass over the vocabulary
    and one top-K instead of K inverse-CDF draws (a cumulative sum and a handful of
    reductions each): on the H200 the sequential draws were ~370 of a 4x6x32 tree step's
    ~1200 kernels at T = 1 (docs/history/2026-12-01-issue-15-tree-step-cost.md, "Fifth run").
    """
    num_cols = logits.shape[-1]
    lead = logits.shape[:-1]
    x = logits.astype(jnp.float32)
    if vocab_size is not None and vocab_size < num_cols:
        x = jnp.where(jnp.arange(num_cols) < vocab_size, x, _NEG)
    top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), topk)

    def draw(_):
        """K draws without replacement from q (Gumbel-top-K, see above)."""
        q = sampling_probs(logits, SamplingRows(*(jnp.broadcast_to(v[:, None], lead)
                                                   for v in rows)), vocab_size)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, lead[1:] + (num_cols,),
                                                        jnp.float32))(draw_keys)
        has_mass = jnp.isfinite(q) & (q > 0)
        score = jnp.where(has_mass, jnp.log(jnp.where(has_mass, q, 1.0)) + gumbel, -jnp.inf)
        top_score, drawn = jax.lax.top_k(score, topk)  # [B, R, K], in draw order
        # A slot past the row's tokens with mass (score -inf) is no draw: q 0, invalid.
        drawn_q = jnp.where(jnp.isfinite(top_score),
                            jnp.take_along_axis(q, drawn, axis=-1), 0.0)
        q_left = 1.0 - (jnp.cumsum(drawn_q, axis=-1) - drawn_q)  # mass before each draw
        return drawn.astype(jnp.int32), drawn_q, q_left, q

    def skip(_):  # no row samples (a greedy batch): nothing is drawn
        zeros = jnp.zeros(lead + (topk,), jnp.float32)
        return (jnp.zeros(lead + (topk,), jnp.int32), zeros, zeros + 1.0,
                jnp.zeros(logits.shape, jnp.float32))

    drawn, drawn_q, q_left, q = jax.lax.cond(jnp.any(real_rows), draw, skip, None)
    real = real_rows[:, None, None]
    ids = jnp.where(real, drawn, top_ids)
    step_lp = jnp.where(real, jnp.where(drawn_q > 0, jnp.log(drawn_q), _NEG), top_lp)
    q_left = jnp.where(real, q_left, 1.0)
    tokens = ids if d2t is None else ids + d2t[ids]
    return tokens.astype(jnp.int32), step_lp, q_left, q


class _Level(NamedTuple):
    """One level's candidates, [B, C] each (C = R * K, R its expanded parents)."""

    tokens: Array
    parent_rank: Array  # the parent's rank in the previous level's frontier
    q_row: Array  # the expanded node (row of DraftTree.draft_probs) it was drawn from
    cum: Array  # path log-probability (-inf: invalid)
    key: Array  # the level's ranking score (-inf: invalid)
    frontier: Array  # [B, F] candidate indices (within the level) of the frontier


def build_draft_tree(draft, logits: Array, hidden: Array, seq_len: Array, active: Array,
                     rows: SamplingRows, draw_keys: Array, cache: KVCache, *, topk: int,
                     num_steps: int, num_nodes: int, real_q: bool, target_vocab_size: int,
                     vocab_size: int | None, pad_position: int,
                     _eagle2_rerank_sampled_rows: bool = False) -> DraftTree:
    """Drafts one tree per row (see the module docstring).

    logits [B, Vd], hidden [B, H]: the draft's state after the committed tokens;
    seq_len, active [B]; rows: the rows' sampling parameters; draw_keys [B, 2] uint32,
    each row's PRNG key for its draws (level l draws with ``fold_in(key, l)``, so a row's
    draws depend on its own key only); cache: the draft's pool and the rows' page tables.
    ``real_q``: sampling rows are verified with the draft's q (recursive rejection
    sampling), else target-only. Absent nodes (fewer valid candidates than N) get
    parent -1. ``_eagle2_rerank_sampled_rows`` (tests only) chooses real-q rows' nodes by
    EAGLE-2's rule too: the deliberately biased variant.
    """
    real_rows = (rows.top_k > 1) & real_q  # [B]
    levels, qs, cache = _grow_levels(
        draft, logits, hidden, seq_len, active, rows, real_rows, draw_keys, cache, topk=topk,
        num_steps=num_steps, num_nodes=num_nodes, vocab_size=vocab_size,
        pad_position=pad_position)
    # Real-q rows: the levels' kept sets; other rows: EAGLE-2's top N by path score.
    tokens, parents, q_row = _choose_nodes(
        levels, level_widths(topk, num_steps, num_nodes),
        real_rows & (not _eagle2_rerank_sampled_rows), num_nodes)
    tree_mask = build_tree_mask(parents)
    draft_probs = draft_probs_ok = None
    if real_q:
        draft_probs, draft_probs_ok = _tree_draft_probs(qs, draft.d2t, real_rows,
                                                        target_vocab_size)
    return DraftTree(tokens, parents, tree_mask.depth, tree_mask.mask, q_row, draft_probs,
                     draft_probs_ok, cache)


def _grow_levels(draft, logits: Array, hidden: Array, seq_len: Array, active: Array,
                 rows: SamplingRows, real_rows: Array, draw_keys: Array, cache: KVCache, *,
                 topk: int, num_steps: int, num_nodes: int, vocab_size: int | None,
                 pad_position: int) -> tuple[list[_Level], list[Array], KVCache]:
    """The S levels of candidates, each level's frontier expanded by one draft forward
    (``build_draft_tree``'s arguments). Returns the levels, q of every expanded node
    ([B, R, Vd] per level: the root, then each frontier) and the cache."""
    K, S, N = topk, num_steps, num_nodes
    batch = logits.shape[0]
    sizes = frontier_sizes(K, S, N)

    levels: list[_Level] = []
    qs = []  # q of every expanded node: the root, then each frontier
    front_cum = jnp.zeros((batch, 1), jnp.float32)  # the root's path score
    front_sel = jnp.zeros((batch, 1), jnp.float32)  # sampled rows: the root's sel
    front_hidden = hidden[:, None]  # [B, R, H] of the expanded nodes
    front_logits = logits[:, None]  # [B, R, Vd]
    ancestors = []  # per level above: [B, F] each frontier node's ancestor's rank there
    first_row = 0  # the expanded row (of draft_probs) of the level's first parent
    for level in range(1, S + 1):
        r = front_logits.shape[1]
        tokens, step_lp, q_left, q = draw_children(
            front_logits, rows, real_rows, jax.vmap(jax.random.fold_in, (0, None))(
                draw_keys, level), draft.d2t, vocab_size, K)
        qs.append(q)
        cum = front_cum[:, :, None] + step_lp  # [B, R, K]; -inf propagates
        pre_draw = front_sel[:, :, None] + jnp.log(jnp.maximum(q_left, 0.0))  # sel
        key = jnp.where(jnp.isfinite(cum),
                        jnp.where(real_rows[:, None, None], pre_draw, cum), _NEG)
        if level > 1:  # a sampled row keeps every kept node's first child first
            first = (jnp.arange(K) == 0) & real_rows[:, None, None] & jnp.isfinite(key)
            key = jnp.where(first, key + _FIRST_CHILD, key)
        flat = lambda a: jnp.broadcast_to(a, (batch, r, K)).reshape(batch, r * K)
        key = flat(key)
        size = sizes[level - 1] if level < S else K
        _, frontier = jax.lax.top_k(key, size)  # [B, F]; candidate order on ties
        lv = _Level(flat(tokens), flat(jnp.arange(r)[None, :, None]),
                    flat(first_row + jnp.arange(r)[None, :, None]), flat(cum), key, frontier)
        levels.append(lv)
        sel = flat(pre_draw)
        if level == S:
            break
        # Expand the frontier: one draft forward over its F tokens at scratch positions,
        # each seeing its ancestors' scratch rows (the wide mask) and the context.
        first_row += r
        take = lambda a: jnp.take_along_axis(a, frontier, axis=1)
        parent_rank = take(lv.parent_rank)
        front_cum = jnp.where(jnp.isfinite(take(lv.key)), take(lv.cum), _NEG)
        front_sel = take(sel)
        ancestors = [jnp.take_along_axis(a, parent_rank, axis=1) for a in ancestors]
        ancestors.append(jnp.broadcast_to(jnp.arange(size), (batch, size)))
        offset = sum(sizes[:level - 1])
        slots = jnp.where(active[:, None], seq_len[:, None] + offset + jnp.arange(size),
                          pad_position)
        rope = jnp.broadcast_to(seq_len[:, None] + level - 1, (batch, size))
        block_mask = jnp.concatenate(
            [a[..., None] == jnp.arange(f) for a, f in zip(ancestors, sizes)], axis=2)
        parent_hidden = jnp.take_along_axis(front_hidden, parent_rank[:, :, None], axis=1)
        front_hidden, cache = draft(take(lv.tokens), parent_hidden, slots, cache,
                                    TreeLayout(rope, block_mask))
        front_logits = draft.logits(front_hidden)  # [B, F, Vd]
    return levels, qs, cache


def _choose_nodes(levels: list[_Level], widths: tuple[int, ...], level_rule: Array,
                  num_nodes: int) -> tuple[Array, Array, Array]:
    """The N nodes of each row's tree among the levels' candidates: a ``level_rule`` row
    [B] takes the levels' kept sets (``widths``), another EAGLE-2's top N by path score.
    Returns (tokens [B, N + 1] with the root first, parents [B, N + 1] (-1: the root, or
    absent), the expanded node each was drawn from [B, N + 1]), int32."""
    N = num_nodes
    batch = levels[0].key.shape[0]
    bidx = jnp.arange(batch)[:, None]
    # Every candidate, level-major; its parent as a global candidate index (-1: root).
    parent_idx, kept_real, offset, prev_frontier = [], [], 0, None
    for lv, width in zip(levels, widths):
        c = lv.key.shape[1]
        parent_idx.append(jnp.full((batch, c), -1, jnp.int32) if prev_frontier is None
                          else jnp.take_along_axis(prev_frontier, lv.parent_rank, axis=1))
        _, order = jax.lax.top_k(lv.key, c)
        rank = jnp.zeros((batch, c), jnp.int32).at[bidx, order].set(
            jnp.arange(c, dtype=jnp.int32))
        kept_real.append(rank < width)
        prev_frontier = offset + lv.frontier
        offset += c
    cat = lambda name: jnp.concatenate([getattr(lv, name) for lv in levels], axis=1)
    cum, key, tok, qrow = cat("cum"), cat("key"), cat("tokens"), cat("q_row")
    parent_idx = jnp.concatenate(parent_idx, axis=1)
    kept_real = jnp.concatenate(kept_real, axis=1)
    valid = jnp.isfinite(cum) & jnp.isfinite(key)
    final_key = jnp.where(level_rule[:, None], jnp.where(kept_real, 0.0, _NEG), cum)
    final_key = jnp.where(valid, final_key, _NEG)
    _, chosen = jax.lax.top_k(final_key, N)
    chosen = jnp.sort(chosen, axis=1)  # parents (earlier levels) before children
    take = lambda a: jnp.take_along_axis(a, chosen, axis=1)
    present = jnp.isfinite(take(final_key))
    parent_cand = take(parent_idx)
    match = chosen[:, None, :] == parent_cand[:, :, None]  # [B, N, N]
    parent_node = jnp.where(parent_cand < 0, 0,
                            jnp.where(jnp.any(match, axis=2), 1 + jnp.argmax(match, axis=2), -1))
    root = jnp.zeros((batch, 1), jnp.int32)
    parents = jnp.concatenate([root - 1, jnp.where(present, parent_node, -1)], axis=1)
    tokens = jnp.concatenate([root, jnp.where(present, take(tok), 0)], axis=1)
    q_row = jnp.concatenate([root, take(qrow)], axis=1)
    return tokens.astype(jnp.int32), parents.astype(jnp.int32), q_row.astype(jnp.int32)


def _tree_draft_probs(qs: list[Array], d2t: Array | None, real_rows: Array,
                      target_vocab_size: int) -> tuple[Array, Array]:
    """(q of every expanded node [B, E, V] in the target's vocabulary, each row's
    validity [B, E]) for the real-q verification."""
    q = jnp.concatenate(qs, axis=1)  # [B, E, Vd]
    draft_probs_ok = probs_row_ok(q)
    if d2t is None:
        return q, draft_probs_ok
    # Into the target's vocabulary (a greedy batch skips the scatter).
    ids = jnp.arange(q.shape[-1], dtype=jnp.int32) + d2t
    width = q.shape[:2] + (target_vocab_size,)
    return jax.lax.cond(
        jnp.any(real_rows),
        lambda q: jnp.zeros(width, jnp.float32).at[:, :, ids].set(q),
        lambda q: jnp.zeros(width, jnp.float32), q), draft_probs_ok
