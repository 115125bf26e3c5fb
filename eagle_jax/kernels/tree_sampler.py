"""Tree speculative-decoding verify sampler: recursive rejection sampling (RRS).

Verifies an EAGLE-2 dynamic draft tree per batch row, lossless at any temperature,
with the draft's real probabilities (Jeon et al. 2024, "Recursive Speculative
Decoding: Accelerating LLM Inference via Sampling Without Replacement").

Tree layout, per row b: node 0 is the root (the last committed token; its token is
ignored); node i > 0 holds draft token ``node_tokens[b, i]`` and parent
``parents[b, i]`` in [0, i), or a negative parent meaning node i is absent. The present
children of a node, in increasing node index, are the order in which they were drawn:
sequentially WITHOUT replacement from the parent's draft distribution
q = ``draft_probs[b, q_row[b, i]]``. ``target_probs[b, i]`` is p_i, the target's
filtered distribution of the token after node i (``sampling_probs``, outside this
function).

Algorithm (sampling rows). Start at c = root with r = p_c. Let x_1..x_m be the present
children of c. For k = 1..m:

* q'_k = q with x_1..x_{k-1} zeroed, renormalised (the distribution x_k was drawn
  from);
* accept x_k iff ``u_k * q'_k(x_k) < r(x_k)`` (probability min(1, r / q'_k)), where
  u_k = ``uniforms[b, k's node index]``; on accept move to that child: c = x_k's node,
  r = p_c, and repeat;
* on reject r = normalise(max(r - q'_k, 0)).

If all m children are rejected, or c is a leaf, or the path already has ``max_depth``
accepted nodes, emit one draw from r with the final coin ``uniforms[b, N+1]`` (inverse
CDF) and stop. Each node's coin is used at most once, since a node is tested at most
once.

Why the output is distributed exactly as p (per node, by induction over the number of
untested siblings). Claim: at node c with current distribution r, with the siblings
x_k, x_{k+1}, ... still to test, the next committed token is distributed as r. Given
the earlier siblings x_1..x_{k-1} (and everything decided so far), x_k ~ q'_k, and its
coin is independent of everything else. Then P(accept x_k = x) = q'_k(x) min(1,
r(x)/q'_k(x)) = min(q'_k, r)(x), and P(reject) = 1 - sum min(q'_k, r) = sum max(r -
q'_k, 0), after which the continuation (by induction) emits from the residual
max(r - q'_k, 0) / sum max(r - q'_k, 0): the total is min(q'_k, r) + max(r - q'_k, 0)
= r. The induction goes through because the later siblings x_{k+1}, ... are drawn
from q with x_1..x_k removed, i.e. from q'_{k+1}, ... given x_k, whatever x_k was; the
residual r does not depend on which x_k was rejected beyond what the next q' already
conditions on. The base case (no sibling left) emits from r directly. The number of
siblings m may depend on anything (the draft's own scores, other subtrees) EXCEPT on
x_k and the later siblings and their subtrees' contents, which would make the stopping
rule peek at the tokens being tested. With r = p_c at the root, the first committed
token is distributed as p_root; on accepting x the next one is p_x, and so on: the
committed sequence is distributed exactly as the target's autoregressive samples. The
residual invariant: r is always a probability vector over [0, vocab_size) (kept
unnormalised here, as weights w with mass M: r = w / M, accept iff
``u * q'(x) * M < w(x)``, residual w <- max(w - M q', 0)).

How it differs from the chain sampler (``spec_sampler.py``): the chain has one
candidate per position and stops at the first rejection; here a rejection moves on to
the next sibling against the residual, and q' excludes the earlier siblings (sampling
without replacement makes siblings distinct, so K candidates give more distinct chances
than K draws with replacement). With one child per node this reduces to the chain rule.

``target_only=True`` (SGLang's ``tree_speculative_sampling_target_only``, the
baseline): each q'_k is treated as one-hot on x_k, i.e. accept iff ``u_k < r(x_k)``,
and on reject r(x_k) is zeroed and r renormalised. This is exact given ANY candidates
(the argument above with q'_k one-hot on the realised x_k: it conditions on the
candidates instead of averaging over them), in particular for deterministic ones (the
draft's top-K), but it ignores q, so with stochastic candidates it accepts less often
than RRS. ``draft_probs=None`` means the same rule.

Greedy rows (top_k <= 1): the children were the draft's top-K distinct tokens. Accept
the first present child (node order) whose token equals argmax p_c (first index of the
maximum), and emit argmax p_c at the first node where no child matches (or at a leaf /
at max_depth). This is exactly the target's greedy chain; no coin or q is used.

Guards (seed 004, as in ``spec_sampler.py``):

* A draft token outside [0, vocab_size) is rejected (not counted as malformed).
* A child drawn from a q row flagged by ``draft_probs_ok``, or whose q'_k(x_k) is not a
  probability in (0, 1] (NaN, +-inf, 0, negative, > 1, or a duplicate of an earlier
  sibling), is rejected and counted in ``num_malformed_q``; the residual is then left
  unchanged (rejecting regardless of the token keeps the output distributed as r).
* q entries outside [0, 1] count as 0 in q'; p entries that are not finite
  probabilities in [0, 1] count as 0; columns >= vocab_size are never read or emitted.
* If the distribution to emit from has zero mass, the row falls back to p of the
  current node and counts ``num_fallback`` (0 or 1 per row); if even that has no mass,
  the token is drawn uniformly from [0, vocab_size) with the final coin.
* Inactive rows: tokens and path all PAD_TOKEN (-1), counters 0.

Kernel design. What the walk does at a node c does not depend on how it got there: it
arrives with r = p_c, tests c's present children with their own coins and, accepting
none, draws with the row's final coin. So one pallas_call (Triton path), grid (B, N+1),
gives every node a program of its own that computes the node's outcome: the accepted
child (or none), the token committed there (that child's, else the one emitted), the
malformed candidates counted there and whether the emitted token fell back to p_c.
``_walk`` then follows the accepted children from the root in plain jnp (max_depth + 1
gathers of one outcome per row, unrolled), counting the malformed candidates of the
nodes walked and the fallback of the last, as a sequential walk does. The latency is the
slowest node's instead of the sum over the accepted path; the price is that nodes the
walk never reaches compute too (a program reads its node's p row and, in a sampling row,
the q rows of its children). A node the walk cannot reach by its structure (absent,
below an absent node, deeper than max_depth) and every node of an inactive row skip all
passes; a node at depth max_depth tests no child. Within a program the tree's O(N)
metadata (tokens, parents, q rows, coins) sits in registers as power-of-two vectors; the
vocabulary is streamed in BLOCK-wide masked loads (``_block_config``: on NVIDIA 8192
float32 columns at 16 warps while every program has an SM to itself, else 4096 at 8;
2048 at 8 on AMD; the next power of two above a small vocabulary), and only for: p_c's
mass and argmax (one pass), each tested child's q' normaliser (one pass over its q row),
the residual mass after each rejection (one pass, rebuilding the residual blockwise from
the rejected siblings' slots: token, q row, normaliser, mass), and the inverse-CDF draw
where no child is accepted (one pass). The residual is never stored: w at a column is a
recursion over the siblings rejected so far (O(m) per column at a node with m tested
children), so a node costs O(m^2 V) reads with no scratch memory; m is the branching
factor (<= 10 for EAGLE-2 trees). Loops that a node does not need run zero iterations
(dynamic trip counts), so a greedy row's nodes read one p row each and never touch q.
The accept/reject decisions are the reference's arithmetic; sums over the vocabulary are
blockwise, so the final draw may differ from the reference only where a CDF boundary
moves by a rounding error. The public function falls back to the pure-jnp reference
(``_verify_row`` vmapped, ``lax.fori_loop`` over the depth and the nodes) on backends
without a Triton lowering (TPU) and for non-float inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common
from eagle_jax.kernels.filters import sample_from_probs
from eagle_jax.kernels.tree_common import (
    PAD_TOKEN, TreeSamplerOutput, as_prob, check_tree_shapes, inverse)

_NO_INDEX = _common.NO_INDEX

# Row flags passed to the kernel (one int32 per row).
_ACTIVE = 1
_GREEDY = 2


def _count(flag):
  """A scalar bool as int32 0 / 1 (a select: see ``spec_sampler._count``)."""
  return jnp.where(flag, jnp.int32(1), jnp.int32(0))


def _verify_row(tok, par, q_row, q, q_ok, p, greedy, u, active, *, vocab_size, max_depth,
                without_replacement):
  """One row's tree walk. q is [E, V] or None (one-hot candidates); p is [N+1, V]."""
  num_nodes, num_cols = p.shape
  final = num_nodes  # the final coin's column
  cols = jnp.arange(num_cols, dtype=jnp.int32)
  in_vocab = cols < vocab_size
  nodes = jnp.arange(num_nodes, dtype=jnp.int32)
  present = (nodes > 0) & (par >= 0) & (par < nodes)
  valid = present & (tok >= 0) & (tok < vocab_size)
  safe_tok = jnp.where(valid, tok, 0)
  p = jnp.where(in_vocab, as_prob(p.astype(jnp.float32)), 0.0)  # [N+1, V]
  if q is not None:
    q = jnp.where(in_vocab, as_prob(q.astype(jnp.float32)), 0.0)  # [E, V]
    row_ok = q_ok[jnp.clip(q_row, 0, q.shape[0] - 1)] & (q_row >= 0) & (q_row < q.shape[0])
  sampling = active & ~greedy
  steps = jnp.arange(max_depth + 1, dtype=jnp.int32)

  def child_test(i, carry):
    c, w, mass, excl, accepted, mal = carry
    is_child = present[i] & (par[i] == c) & (accepted == _NO_INDEX)
    x = safe_tok[i]
    onehot_x = (cols == x) & valid[i]
    if q is None:
      qp = jnp.where(onehot_x, 1.0, 0.0)
      ok = jnp.bool_(True)
    else:
      qi = q[jnp.clip(q_row[i], 0, q.shape[0] - 1)]
      if without_replacement:
        qi = jnp.where(excl, 0.0, qi)
      norm = jnp.sum(qi)
      qp = jnp.where(norm > 0.0, qi * inverse(norm), 0.0)
      ok = row_ok[i]
    qx = jnp.sum(jnp.where(onehot_x, qp, 0.0))
    wx = jnp.sum(jnp.where(onehot_x, w, 0.0))
    q_is_prob = (qx > 0.0) & (qx <= 1.0)
    good = valid[i] & ok & q_is_prob
    accept = is_child & good & (u[i] * qx * mass < wx)
    mal = mal + (is_child & valid[i] & ~(ok & q_is_prob)).astype(jnp.int32)
    subtract = is_child & good & ~accept
    w = jnp.where(subtract, jnp.maximum(w - mass * qp, 0.0), w)
    mass = jnp.where(subtract, jnp.sum(w), mass)
    excl = excl | (is_child & onehot_x)
    accepted = jnp.where(accept, i, accepted)
    return c, w, mass, excl, accepted, mal

  def depth_step(d, carry):
    c, done, path, toks, emitted, mal, fb = carry
    w = p[c]
    at_limit = d >= max_depth
    # Greedy: the first child (node order) holding argmax p_c.
    am = jnp.argmax(jnp.where(in_vocab, w, -1.0)).astype(jnp.int32)
    match = present & (par == c) & valid & (tok == am)
    child_g = jnp.min(jnp.where(match, nodes, _NO_INDEX))
    # Sampling: RRS over the children of c.
    init = (c, w, jnp.sum(w), jnp.zeros((num_cols,), jnp.bool_), jnp.int32(_NO_INDEX),
            jnp.int32(0))
    _, w_s, _, _, child_s, mal_c = lax.fori_loop(1, num_nodes, child_test, init)
    child = jnp.where(greedy, child_g, child_s)
    child = jnp.where(at_limit, _NO_INDEX, child)
    live = active & ~done
    move = live & (child != _NO_INDEX)
    stop = live & ~move
    mal = mal + jnp.where(live & sampling & ~at_limit, mal_c, 0)
    # The emitted token, if this is where the walk stops.
    base = jnp.where(at_limit, w, w_s)  # at max_depth no child is tested
    fallback = ~(jnp.sum(base) > 0.0)
    weights = jnp.where(fallback, w, base)
    coin = u[final]
    drawn = sample_from_probs(weights, coin)
    uniform_token = jnp.minimum((coin * vocab_size).astype(jnp.int32), vocab_size - 1)
    drawn = jnp.where(jnp.any(weights > 0.0), drawn, uniform_token)
    token = jnp.where(greedy, am, drawn)
    fb = fb + (stop & sampling & fallback).astype(jnp.int32)
    safe_child = jnp.where(move, child, 0)
    path = jnp.where(move & (steps == d + 1), safe_child, path)
    toks = jnp.where(move & (steps == d), tok[safe_child], toks)
    toks = jnp.where(stop & (steps == d), token, toks)
    emitted = jnp.where(stop, d, emitted)
    c = jnp.where(move, safe_child, c)
    return c, done | stop, path, toks, emitted, mal, fb

  pad = jnp.full((max_depth + 1,), PAD_TOKEN, jnp.int32)
  init = (jnp.int32(0), jnp.bool_(False), jnp.where(steps == 0, 0, pad), pad,
          jnp.int32(0), jnp.int32(0), jnp.int32(0))
  _, _, path, toks, accept_len, mal, fb = lax.fori_loop(0, max_depth + 1, depth_step, init)
  path = jnp.where(active, path, PAD_TOKEN)
  toks = jnp.where(active, toks, PAD_TOKEN)
  zero = jnp.int32(0)
  return TreeSamplerOutput(
      tokens=toks.astype(jnp.int32),
      path=path.astype(jnp.int32),
      num_tokens=jnp.where(active, accept_len + 1, zero),
      accept_len=jnp.where(active, accept_len, zero),
      num_malformed_q=jnp.where(sampling, mal, zero),
      num_fallback=jnp.where(sampling, fb, zero),
  )


# --------------------------------------------------------------------------------------
# Pallas kernel (Triton path): one program per (row, node) decides what the walk does at
# that node; ``_walk`` then follows the decisions from the root.
# --------------------------------------------------------------------------------------


# Loop bounds of the dynamic-trip-count loops, all int32 (scf.for needs one type).
_I0 = np.int32(0)  # numpy: no device array at import

# A node's outcome, the kernel's output [B, N+1, 4] int32: the accepted child's node index
# (-1: none), the token the walk commits there (the accepted child's, else the emitted
# one; PAD_TOKEN where the walk cannot arrive), the malformed candidates counted there,
# and 1 where the emitted token fell back to p of the node.
_CHILD, _TOKEN, _MALFORMED, _FALLBACK = range(4)


def _trips(flag, n: int):
  """n iterations where `flag`, else none (an int32 upper loop bound)."""
  return jnp.where(flag, jnp.int32(n), jnp.int32(0))


def _pick(vec, lanes, i):
  """vec[i] of a small register vector, as a scalar (a masked sum: no dynamic gather)."""
  zero = jnp.zeros((), vec.dtype)
  return jnp.sum(jnp.where(lanes == i, vec, zero)).astype(vec.dtype)


def _tree_kernel(flags_ref, tok_ref, par_ref, qr_ref, u_ref, p_ref, *rest, num_nodes,
                 num_nodes_pad, num_q_rows, max_depth, vocab_size, block, has_q):
  """Program (b, c): node c's outcome in row b (``_CHILD`` .. ``_FALLBACK``), written
  whatever it is (-1, PAD_TOKEN, 0, 0 where the walk cannot arrive).

  Whatever path the walk took to c, it arrives with r = p_c and tests c's children with
  their own coins, then draws with the row's final coin: the outcome is a function of c
  alone, so every node computes its own and the walk only follows them (``_walk``).
  """
  q_refs, rest = (rest[:2], rest[2:]) if has_q else (None, rest)
  (out_ref,) = rest
  b, c = pl.program_id(0), pl.program_id(1)
  flags = flags_ref[b]
  active = (flags & _ACTIVE) != 0
  greedy = (flags & _GREEDY) != 0
  sampling = active & ~greedy
  num_blocks = _common.cdiv(vocab_size, block)
  zero_f = jnp.float32(0.0)

  nodes = jnp.arange(num_nodes_pad, dtype=jnp.int32)  # also the sibling slots
  in_tree = nodes < num_nodes
  tok = plgpu.load(tok_ref.at[b, nodes], mask=in_tree, other=-1)
  par = plgpu.load(par_ref.at[b, nodes], mask=in_tree, other=-1)
  present = in_tree & (nodes > 0) & (par >= 0) & (par < nodes)
  valid = present & (tok >= 0) & (tok < vocab_size)
  valid_i32 = valid.astype(jnp.int32)
  present_i32 = present.astype(jnp.int32)
  safe_tok = jnp.where(valid, tok, 0)
  coins = plgpu.load(u_ref.at[b, nodes], mask=in_tree, other=1.0)
  final_coin = u_ref[b, num_nodes]
  if has_q:
    q_ref, q_ok_ref = q_refs
    qr = plgpu.load(qr_ref.at[b, nodes], mask=in_tree, other=0)
    qr_in = (qr >= 0) & (qr < num_q_rows)
    safe_qr = jnp.where(qr_in, qr, 0)
    row_ok = qr_in & (plgpu.load(q_ok_ref.at[b, safe_qr], mask=in_tree & qr_in, other=0) != 0)
    row_ok_i32 = row_ok.astype(jnp.int32)

  # c's depth, climbing present parents: the walk reaches c (if at all) after that many
  # moves, so c tests no child at max_depth. A node the walk can never reach (absent,
  # below an absent node, deeper than max_depth) or of an inactive row skips every pass.
  up = jnp.where(present, par, -1)

  def climb(_, carry):
    a, depth = carry
    step = a > 0
    return jnp.where(step, _pick(up, nodes, a), a), depth + _count(step)

  top, depth = lax.fori_loop(_I0, np.int32(max_depth + 1), climb, (c, jnp.int32(0)))
  live = active & (top == 0) & (depth <= max_depth)
  at_limit = depth >= max_depth

  def p_block(cols, live):
    return as_prob(plgpu.load(p_ref.at[b, c, cols], mask=live & (cols < vocab_size),
                              other=0.0))

  def excluded(cols, sib_tok, count):
    """cols [BLOCK] -> int32 1 where the column is one of the first `count` siblings'
    tokens (a loop of 1-D compares: no [BLOCK, N] intermediate in registers)."""
    def body(j, m):
      return m | jnp.where(cols == _pick(sib_tok, nodes, j), 1, 0)

    return lax.fori_loop(_I0, count, body, jnp.zeros(cols.shape, jnp.int32))

  def w_block(cols, sib, count, live):
    """The residual weights w at `cols` after the first `count` siblings were tested:
    w_0 = p_c, w_{j+1} = max(w_j - M_j q'_j, 0) where slot j subtracted, with q'_j =
    row sib_qr[j] of q, the tokens of slots < j zeroed, over sib_s[j]."""
    sib_tok, sib_qr, sib_m, sib_s, sib_sub = sib

    def body(j, carry):
      w, excl = carry
      sub = _pick(sib_sub, nodes, j) != 0
      tok_j = _pick(sib_tok, nodes, j)
      if has_q:
        s_j = _pick(sib_s, nodes, j)
        qv = as_prob(plgpu.load(q_ref.at[b, _pick(sib_qr, nodes, j), cols],
                                mask=live & sub & (cols < vocab_size), other=0.0))
        qp = jnp.where(excl != 0, 0.0, qv) * inverse(s_j)
      else:
        qp = jnp.where(cols == tok_j, 1.0, 0.0)
      w = jnp.where(sub, jnp.maximum(w - _pick(sib_m, nodes, j) * qp, 0.0), w)
      return w, excl | jnp.where(cols == tok_j, 1, 0)

    w, _ = lax.fori_loop(_I0, count, body,
                         (p_block(cols, live), jnp.zeros(cols.shape, jnp.int32)))
    return w

  # Pass over p_c: its mass M_0 and (greedy rows) its argmax, first index.
  def pass_a(k, acc):
    m, best, best_idx = acc
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    pv = p_block(cols, live)
    pm = jnp.where(cols < vocab_size, pv, -1.0)
    blk_best = jnp.max(pm)
    blk_idx = k * block + jnp.argmax(pm).astype(jnp.int32)
    better = blk_best > best
    return (m + jnp.sum(pv), jnp.where(better, blk_best, best),
            jnp.where(better, blk_idx, best_idx))

  mass0, _, am = lax.fori_loop(_I0, _trips(live, num_blocks), pass_a,
                               (zero_f, jnp.float32(-2.0), jnp.int32(0)))
  match = present & (par == c) & valid & (tok == am)
  child_g = jnp.min(jnp.where(match, nodes, _NO_INDEX))

  # Sampling: RRS over the present children of c, in node order.
  testing = live & sampling & ~at_limit

  def child_test(i, acc):
    sib, count, mass, accepted, mal = acc
    sib_tok, sib_qr, sib_m, sib_s, sib_sub = sib
    is_child = (testing & (_pick(present_i32, nodes, i) != 0) & (_pick(par, nodes, i) == c)
                & (accepted == _NO_INDEX))
    valid_i = _pick(valid_i32, nodes, i) != 0
    x = _pick(safe_tok, nodes, i)
    if has_q:
      qr_i = _pick(safe_qr, nodes, i)
      ok_i = _pick(row_ok_i32, nodes, i) != 0

      def s_pass(k, acc_s):
        cols = k * block + jnp.arange(block, dtype=jnp.int32)
        qv = as_prob(plgpu.load(q_ref.at[b, qr_i, cols], mask=cols < vocab_size,
                                other=0.0))
        return acc_s + jnp.sum(jnp.where(excluded(cols, sib_tok, count) != 0, 0.0, qv))

      norm = lax.fori_loop(
          _I0, _trips(is_child & valid_i, num_blocks), s_pass, zero_f)
      excl_x = jnp.sum(jnp.where((nodes < count) & (sib_tok == x), 1, 0)) > 0
      q_x = jnp.where(excl_x, 0.0, as_prob(q_ref[b, qr_i, x]))
      qx = jnp.where(norm > 0.0, q_x * inverse(norm), 0.0)
    else:
      qr_i = jnp.int32(0)
      ok_i = jnp.bool_(True)
      norm = jnp.float32(1.0)
      qx = jnp.where(valid_i, jnp.float32(1.0), jnp.float32(0.0))  # not weakly typed

    # w(x) by the same recursion as w_block, on one column.
    def w_at(j, w):
      sub = _pick(sib_sub, nodes, j) != 0
      tok_j = _pick(sib_tok, nodes, j)
      if has_q:
        s_j = _pick(sib_s, nodes, j)
        ex = jnp.sum(jnp.where((nodes < j) & (sib_tok == x), 1, 0)) > 0
        qv = as_prob(q_ref[b, _pick(sib_qr, nodes, j), x])
        qp = jnp.where(ex, 0.0, qv) * inverse(s_j)
      else:
        qp = jnp.where(x == tok_j, jnp.float32(1.0), jnp.float32(0.0))
      return jnp.where(sub, jnp.maximum(w - _pick(sib_m, nodes, j) * qp, 0.0), w)

    wx = lax.fori_loop(_I0, jnp.where(is_child, count, _I0), w_at,
                       as_prob(p_ref[b, c, x]))
    q_is_prob = (qx > 0.0) & (qx <= 1.0)
    good = valid_i & ok_i & q_is_prob
    accept = is_child & good & (_pick(coins, nodes, i) * qx * mass < wx)
    mal = mal + _count(is_child & valid_i & ~(ok_i & q_is_prob))
    subtract = is_child & good & ~accept
    slot = is_child & (nodes == count)
    sib = (jnp.where(slot, jnp.where(valid_i, x, -1), sib_tok),
           jnp.where(slot, qr_i, sib_qr),
           jnp.where(slot, mass, sib_m),
           jnp.where(slot, norm, sib_s),
           jnp.where(slot, _count(subtract), sib_sub))
    count = count + _count(is_child)

    def r_pass(k, acc_r):
      cols = k * block + jnp.arange(block, dtype=jnp.int32)
      return acc_r + jnp.sum(w_block(cols, sib, count, cols >= 0))

    new_mass = lax.fori_loop(_I0, _trips(subtract, num_blocks), r_pass, zero_f)
    mass = jnp.where(subtract, new_mass, mass)
    accepted = jnp.where(accept, i, accepted)
    return sib, count, mass, accepted, mal

  sib0 = (jnp.full((num_nodes_pad,), -1, jnp.int32), jnp.zeros((num_nodes_pad,), jnp.int32),
          jnp.zeros((num_nodes_pad,), jnp.float32), jnp.zeros((num_nodes_pad,), jnp.float32),
          jnp.zeros((num_nodes_pad,), jnp.int32))
  first = c + 1  # children come after their parent; a node testing none loops 0 times
  sib, count, mass, child_s, mal = lax.fori_loop(
      first, jnp.where(testing, jnp.int32(num_nodes), first), child_test,
      (sib0, jnp.int32(0), mass0, jnp.int32(_NO_INDEX), jnp.int32(0)))
  child = jnp.where(greedy, child_g, child_s)
  child = jnp.where(live & ~at_limit, child, _NO_INDEX)
  stop = live & (child == _NO_INDEX)

  # The emitted token, if the walk stops here: inverse CDF of the residual (or p_c).
  fallback = ~(mass > 0.0)
  total = jnp.where(fallback, mass0, mass)
  target = final_coin * total
  draw = stop & sampling & (total > 0.0)

  def draw_pass(k, acc_d):
    cols = k * block + jnp.arange(block, dtype=jnp.int32)
    in_vocab = cols < vocab_size
    w = jnp.where(fallback, p_block(cols, in_vocab),
                  w_block(cols, sib, count, in_vocab & ~fallback))
    return _common.inverse_cdf_block(acc_d, cols, w, target)

  drawn = _common.inverse_cdf_token(lax.fori_loop(
      _I0, _trips(draw, num_blocks), draw_pass, _common.inverse_cdf_init()))
  uniform_token = jnp.minimum((final_coin * vocab_size).astype(jnp.int32), vocab_size - 1)
  drawn = jnp.where(drawn >= 0, drawn, uniform_token)
  token = jnp.where(greedy, am, drawn)
  token = jnp.where(stop, token, _pick(tok, nodes, jnp.where(stop, 0, child)))

  field = jnp.arange(4, dtype=jnp.int32)
  outcome = jnp.where(
      field == _CHILD, jnp.where(child == _NO_INDEX, -1, child),
      jnp.where(field == _TOKEN, jnp.where(live, token, PAD_TOKEN),
                jnp.where(field == _MALFORMED, mal, _count(stop & sampling & fallback))))
  plgpu.store(out_ref.at[b, c, field], outcome.astype(jnp.int32))


def _walk(outcome, active, max_depth: int) -> TreeSamplerOutput:
  """The accepted path through the nodes' outcomes [B, N+1, 4]: from node 0, each node's
  accepted child and committed token, until a node accepts none (as one at depth
  max_depth always does) and emits. Malformed candidates count at every node walked, the fallback
  at the last, as the sequential walk counts them. max_depth + 1 gathers of one [4] row
  per batch row, unrolled (max_depth is static): a few fused XLA ops, no device loop."""
  batch = active.shape[0]
  rows = jnp.arange(batch)
  zero = jnp.zeros((batch,), jnp.int32)
  pad = jnp.full((batch,), PAD_TOKEN, jnp.int32)
  c, live = zero, active
  path, toks = [jnp.where(active, zero, pad)], []
  accept_len = num_malformed = num_fallback = zero
  for d in range(max_depth + 1):
    out = outcome[rows, c]  # [B, 4]
    move = live & (out[:, _CHILD] >= 0)
    stop = live & ~move
    child = jnp.where(move, out[:, _CHILD], 0)
    num_malformed = num_malformed + jnp.where(live, out[:, _MALFORMED], 0)
    num_fallback = num_fallback + jnp.where(stop, out[:, _FALLBACK], 0)
    toks.append(jnp.where(live, out[:, _TOKEN], pad))
    if d < max_depth:
      path.append(jnp.where(move, child, pad))
    accept_len = accept_len + _count(move)
    c, live = jnp.where(move, child, c), move
  return TreeSamplerOutput(
      tokens=jnp.stack(toks, axis=1), path=jnp.stack(path, axis=1),
      num_tokens=jnp.where(active, accept_len + 1, 0), accept_len=accept_len,
      num_malformed_q=num_malformed, num_fallback=num_fallback)


def _block_config(vocab_size: int, num_programs: int,
                  gpu: _common.GpuTarget) -> tuple[int, int]:
  """(BLOCK, num_warps) for a grid of ``num_programs`` (B x (N+1)) programs. A program
  makes one node's passes over the vocabulary, each block's load waiting on the previous
  block's arithmetic: alone on a core, a pass is latency-bound, and the widest load that
  stays in registers wins.

  NVIDIA: 8192 float32 columns at 16 warps (16 per thread) while every program has an SM
  to itself (batch 1-4 with 32 nodes on 132 SMs): that is the regime of the former
  one-program-per-row walk, where this width measured best on an H200 (a 32-node tree
  over 128256 columns: 0.70 ms at batch 1, against 1.1-1.6 ms with 1024-4096 columns at
  4-8 warps; docs/history/2026-12-01-issue-15-tree-step-cost.md). A larger grid shares
  the SMs: 4096 columns at 8 warps (still 16 per thread), half the registers per program, so that two or more programs
  per SM hide each other's load latency and the uneven work per node (the root testing
  ten children, a leaf two passes) spreads over more, smaller programs. Neither choice is
  measured for this per-node design yet (both compile for sm_90 without local memory:
  ``scripts/rocm_compile.py --arch sm_90``). One pipeline stage: the loops have no dot for
  Triton to pipeline (stages made no difference to the former kernel).
  AMD: 2048 columns at 8 waves (4 per lane of a 64-wide wavefront) at any grid. The
  loops carry many uniform values, and on CDNA wider blocks add per-column compare masks
  (64-bit SGPR pairs): the former walk, one loop level deeper, spilled SGPRs into VGPR
  lanes at this width (gfx950, real q: 2 at 1024 x 8, 10 at 2048 x 8, 43 at 8192 x 16);
  the per-node kernel compiles without spills at 2048 x 8 on gfx942 and gfx950
  (scripts/rocm_compile.py). Not measured on AMD hardware.
  Smaller for a small vocabulary (>= 4 columns per thread)."""
  if gpu.platform == "rocm":
    block = min(2048, _common.next_power_of_2(vocab_size))
    return block, min(8, max(4, block // 256))
  widest = 8192 if num_programs <= gpu.num_cores else 4096
  block = min(widest, _common.next_power_of_2(vocab_size))
  return block, min(16, max(4, block // 512))


def _tree_sample_pallas(flags, tok, par, q_row, u, p, q, q_ok, *, vocab_size, max_depth,
                        interpret, target=None, block_v=None, num_warps=None):
  batch, num_nodes = tok.shape
  default_block, default_warps = _block_config(
      vocab_size, batch * num_nodes, _common.resolve_target(target))
  block = block_v or default_block
  if block & (block - 1):
    raise ValueError(f"block {block} must be a power of two")
  num_warps = num_warps or default_warps
  has_q = q is not None
  operands = (flags, tok, par, q_row, u, p) + ((q, q_ok) if has_q else ())
  outcome = pl.pallas_call(
      functools.partial(
          _tree_kernel, num_nodes=num_nodes, num_nodes_pad=_common.next_power_of_2(num_nodes),
          num_q_rows=q.shape[1] if has_q else 1, max_depth=max_depth, vocab_size=vocab_size,
          block=block, has_q=has_q),
      out_shape=jax.ShapeDtypeStruct((batch, num_nodes, 4), jnp.int32),
      grid=(batch, num_nodes),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="tree_sampler",
  )(*operands)
  return _walk(outcome, (flags & _ACTIVE) != 0, max_depth)


def tree_speculative_sample_reference(
    node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms, vocab_size: int,
    active=None, *, max_depth: int, draft_probs_ok=None, target_only: bool = False,
    _without_replacement: bool = True) -> TreeSamplerOutput:
  """Pure-jnp reference of :func:`tree_speculative_sample` (same arguments and result).

  ``_without_replacement=False`` (tests only) computes q' as q itself, i.e. ignores
  that siblings were drawn without replacement: a deliberately biased variant.
  """
  node_tokens = jnp.asarray(node_tokens, jnp.int32)
  parents = jnp.asarray(parents, jnp.int32)
  greedy = jnp.asarray(greedy, jnp.bool_)
  uniforms = jnp.asarray(uniforms, jnp.float32)
  target_probs = jnp.asarray(target_probs)
  batch, num_nodes = node_tokens.shape
  if target_only:
    draft_probs = None
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
    q_row = jnp.asarray(q_row, jnp.int32)
  check_tree_shapes(node_tokens, parents, draft_probs, q_row, target_probs, greedy,
                    uniforms, vocab_size, active, max_depth, draft_probs_ok)
  active = jnp.ones((batch,), jnp.bool_) if active is None else jnp.asarray(active, jnp.bool_)
  if draft_probs is None:
    q_row = jnp.zeros((batch, num_nodes), jnp.int32)
    q_ok = jnp.ones((batch, 1), jnp.bool_)
  else:
    q_ok = (jnp.ones(draft_probs.shape[:2], jnp.bool_) if draft_probs_ok is None
            else jnp.asarray(draft_probs_ok, jnp.bool_))

  def row(tok, par, qr, q, ok, p, g, u, a):
    return _verify_row(tok, par, qr, q, ok, p, g, u, a, vocab_size=vocab_size,
                       max_depth=max_depth, without_replacement=_without_replacement)

  if draft_probs is None:
    return jax.vmap(lambda t, pa, qr, ok, p, g, u, a: row(t, pa, qr, None, ok, p, g, u, a))(
        node_tokens, parents, q_row, q_ok, target_probs, greedy, uniforms, active)
  return jax.vmap(row)(node_tokens, parents, q_row, draft_probs, q_ok, target_probs, greedy,
                       uniforms, active)


def tree_speculative_sample(
    node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms, vocab_size: int,
    active=None, *, max_depth: int, draft_probs_ok=None, target_only: bool = False,
    interpret: bool | None = None, target: str | None = None, block_v: int | None = None,
    num_warps: int | None = None) -> TreeSamplerOutput:
  """Verify a draft tree per row against the target (see the module docstring).

  Args:
    node_tokens: [B, N+1] int32; node 0 is the root (ignored), nodes i > 0 draft ids.
    parents: [B, N+1] int32; parents[:, 0] = -1; for i > 0 a parent in [0, i), or < 0
      for an absent node.
    draft_probs: [B, E, V] float32 draft distributions of the expanded nodes (filtered,
      target vocabulary ids), or None for deterministic (one-hot) candidates.
    q_row: [B, N+1] int32: for node i > 0, the row of draft_probs its token was drawn
      from (may be None with draft_probs=None).
    target_probs: [B, N+1, V] float32 target distributions after each node.
    greedy: [B] bool (top_k <= 1 rows).
    uniforms: [B, N+2] float32 in [0, 1): column i is node i's accept coin, column N+1
      the final draw; column 0 unused.
    vocab_size: the tokenizer's vocabulary size (<= V); no id >= it is emitted.
    active: [B] bool or None (all active); inactive rows emit only PAD_TOKEN.
    max_depth: D (static), the most nodes a path may accept.
    draft_probs_ok: [B, E] bool verdicts of the proposal's row check, or None.
    target_only: SGLang's target-only rule (q' one-hot on the candidate).
    interpret: None = automatic (interpret on CPU); False forces the Triton path.
    target: the GPU to pick the load width for (a key of ``_common.GPU_TARGETS``);
      None = automatic (``_common.resolve_target``).
    block_v, num_warps: override the heuristic (a power of two width; tests, tuning).
  Returns:
    TreeSamplerOutput with tokens, path [B, D+1] and per-row counters [B].
  """
  args = (node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
          vocab_size, active)
  kwargs = dict(max_depth=max_depth, draft_probs_ok=draft_probs_ok, target_only=target_only)
  supported = (
      _common.kernel_backend_ok(interpret, target_probs, draft_probs)
      and jnp.ndim(node_tokens) == 2 and jnp.shape(node_tokens)[1] >= 1
      and jnp.issubdtype(jnp.result_type(target_probs), jnp.floating)
      and (draft_probs is None or target_only
           or jnp.issubdtype(jnp.result_type(draft_probs), jnp.floating))
  )
  if not supported:
    return tree_speculative_sample_reference(*args, **kwargs)
  node_tokens = jnp.asarray(node_tokens, jnp.int32)
  parents = jnp.asarray(parents, jnp.int32)
  greedy = jnp.asarray(greedy, jnp.bool_)
  uniforms = jnp.asarray(uniforms, jnp.float32)
  p = jnp.asarray(target_probs).astype(jnp.float32)
  batch, num_nodes = node_tokens.shape
  q = None if target_only or draft_probs is None else jnp.asarray(draft_probs)
  check_tree_shapes(node_tokens, parents, q, None if q is None else jnp.asarray(q_row), p,
                    greedy, uniforms, vocab_size, active, max_depth,
                    None if q is None else draft_probs_ok)
  active = jnp.ones((batch,), jnp.bool_) if active is None else jnp.asarray(active, jnp.bool_)
  flags = (jnp.where(active, _ACTIVE, 0) | jnp.where(greedy, _GREEDY, 0)).astype(jnp.int32)
  if q is None:
    q_row = jnp.zeros((batch, num_nodes), jnp.int32)
    q_ok = None
  else:
    q = q.astype(jnp.float32)
    q_row = jnp.asarray(q_row, jnp.int32)
    q_ok = (jnp.ones(q.shape[:2], jnp.int32) if draft_probs_ok is None
            else jnp.asarray(draft_probs_ok).astype(jnp.int32))
  return _tree_sample_pallas(
      flags, node_tokens, parents, q_row, uniforms, p, q, q_ok, vocab_size=vocab_size,
      max_depth=max_depth, interpret=_common.resolve_interpret(interpret), target=target,
      block_v=block_v, num_warps=num_warps)
