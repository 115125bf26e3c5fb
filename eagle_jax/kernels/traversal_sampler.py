"""Tree speculative-decoding verify sampler: Traversal Verification (TV).

Verifies an EAGLE-2 dynamic draft tree per batch row, lossless at any temperature, with
the draft's real probabilities, deciding whole paths instead of single tokens (Weng et
al. 2025, "Traversal Verification for Speculative Tree Decoding", NeurIPS; on a chain it
is Sun et al.'s block verification, "Block Verification Accelerates Speculative
Decoding", ICLR 2025). The engine's default for sampled tree rows
(``EngineConfig.tree_verify = "traversal"``; recursive rejection, ``tree_sampler.py``,
accepts fewer tokens); greedy rows take the target's argmax path as in
``tree_sampler.py``, whose tree layout and guards this module shares (``tree_common.py``):
node 0 is the root, node i > 0 holds ``node_tokens[b, i]`` and parent ``parents[b, i]``
in [0, i) (negative: absent), and the present children of a node, in increasing node
index, were drawn in that order WITHOUT replacement from the parent's draft distribution
q = ``draft_probs[b, q_row[b, i]]``. ``target_probs[b, i]`` is p_i, the target's
filtered distribution after node i.

Algorithm (sampling rows). Every node c carries a weight alpha_c in [0, 1], a target
distribution r_c (initially p_c / its mass) and a proposal q'_c (initially q at c).
alpha_root = 1. When the walk first enters a child k of c (token x), it fixes
alpha_k = min(1, alpha_c r_c(x) / q'_c(x)): the sequence-level ratio of the path, capped
at 1, where token-level verification would cap every factor. Then, repeatedly:

1. Descend from the root to the first leaf v of the remaining tree (first remaining child
   at every node, i.e. the deepest node of the leftmost remaining path), fixing alpha on
   the way; a node whose children were all removed is a leaf now.
2. Accept v with probability alpha_v (coin ``uniforms[b, v]``; the root: always). On
   accept, the path root .. v is committed, and one token is drawn from r_v with the
   final coin ``uniforms[b, N+1]`` (inverse CDF). Stop.
3. Reject: remove v. At its parent c (with a = alpha_c, x = v's token):
   w = max(a r_c - q'_c, 0), Delta = sum w;
   r_c <- w / Delta;  alpha_c <- Delta / (Delta + 1 - a);  q'_c <- q'_c with x zeroed,
   renormalised (the distribution c's next child was drawn from). Go to 1.

Every node is tested once, in post-order, so each coin is used at most once. With one
child per node this is block verification; with depth-1 trees it is recursive rejection
sampling (alpha_root stays 1, and alpha_k = min(1, r / q'), ``tree_sampler.py``).

Why the output is distributed exactly as the target's samples. Claim: for a node c whose
state is (alpha, r, q') and whose remaining children are drawn from q' in turn (each
without replacement, given the earlier ones), the procedure run on c's subtree (its
children's subtrees, then c itself) accepts c and then emits a continuation y with
probability alpha * R(y), where R(y) = r(y_1) p(y_2 | c, y_1) ... is the target's
probability of y with the first token from r; so it rejects c with probability 1 - alpha.
By induction over the number of remaining children. None: c is tested alone, accepted
with probability alpha, and draws y_1 from r. Otherwise the first remaining child k,
token x ~ q', has alpha_k = min(1, alpha r(x) / q'(x)) and (induction, at k) is accepted
with its continuation y' with probability alpha_k P_target(y' | c, x): summed with x's
probability q'(x), min(q'(x), alpha r(x)) P_target(y' | c, x). It is rejected with
probability 1 - sum_x min(q', alpha r)(x) = Delta + 1 - alpha, whatever happens below it,
after which c's state is (Delta / (Delta + 1 - alpha), w / Delta, q' without x) and (the
induction, c now having one child less, drawn from exactly that q') c is accepted with y
with probability Delta / (Delta + 1 - alpha) * w(y_1) / Delta * P_target(y_2.. | c, y_1).
The two cases sum to (min(q', alpha r) + max(alpha r - q', 0))(y_1) P_target(..) =
alpha R(y). At the root (alpha = 1, r = p_root) the committed tokens therefore follow the
target's autoregressive distribution. The claim holds for any number of children and any
shape below them, so the tree may be shaped by anything that does not peek at the tokens
whose draws it conditions: the number of children of a node (and whether a node is kept)
must not depend on that node's own token or on tokens drawn after it among its siblings
and below them; it may depend on its ancestors, its earlier siblings and other branches
(the engine's rule in ``draft_tree.py``: scores fixed before each candidate's draw).
``tests/test_draft_tree.py`` checks the first two tokens of the engine's trees against
the target, and shows EAGLE-2's rerank failing the same test.

Guards (seed 004). Per node k > 0, in the wrapper (``_node_scalars``):

* q'_k(x_k) = q(x_k) / (q's mass less its earlier siblings' tokens), the distribution k
  was drawn from. A node whose token is outside [0, vocab_size), whose q row is flagged
  by ``draft_probs_ok`` or is not its earlier siblings' (siblings share their parent's
  row), or whose q'_k(x_k) is not a probability in (0, 1] (NaN, inf, 0, > 1, a
  duplicate of an earlier sibling) is set aside with its subtree before the
  walk (``usable`` false), without touching its parent's state: a node removed by a rule
  that does not look at the coins leaves the claim's distribution of the rest as it was.
  The ones with an in-vocabulary token are counted in ``num_malformed_q``.
* q and p entries outside [0, 1] count as 0; columns >= vocab_size are never read or
  emitted; nodes deeper than ``max_depth`` are never tested.
* If the distribution to draw from has no mass (rounding, or all of p filtered), the
  row draws from p of the accepted node and counts ``num_fallback``; with no mass there
  either, uniformly from [0, vocab_size) with the final coin.
* Inactive rows: tokens and path all PAD_TOKEN, counters 0.

Kernel design: the states first, then the coins. The walk looks sequential (alpha_k
depends on every rejection before k), but no state depends on a coin: node k is tested
only once every node before it in post-order has been rejected, so its parent's state
when the walk enters k, and k's own state when it is tested, are fixed functions of the
tree, p and q. So:

1. Passes, in rounds (``_schedule``, ``_pass_kernel``, one pallas_call per round on a
   grid of B x (N+1) x vocabulary blocks). Node k's pass sums max(a r - q'_k, 0) over
   the vocabulary (its Delta, were it rejected), with a, r its parent's alpha and
   residual after k's earlier siblings, rebuilt blockwise from the parent's p and q
   rows and those siblings' (alpha, Delta): r <- max(a_j r - q'_j, 0) / Delta_j, no
   scratch memory. It needs its parent's entry alpha and its earlier siblings' Deltas,
   so it runs in round (parent's round + rank among siblings + 1): at most
   max_depth x max_children rounds (24 for K = 4, S = 6), each a single launch whose due
   nodes' blocks spread over the whole GPU. Each program writes its block's partial sum,
   and block 0's program k's entry alpha min(1, a r(x_k) / q'_k(x_k)) (r at x_k by the
   same recurrence, scalar); later rounds sum the partials they read.
2. The walk (XLA, scalars only): a node's test alpha is its alpha after all its usable
   children were rejected, Delta / (Delta + 1 - a) of the last one; the accepted node is
   the first node in post-order whose coin is below its test alpha (the root: always),
   found by descending into the first child whose subtree holds one.
3. The draw (``_draw_kernel``, one program per row): the accepted node's final r is w /
   Delta of its last child's pass (a leaf's: p / its mass), so that pass's block partials
   are r's block masses; the inverse CDF starts at the block the target falls in
   (``_common.inverse_cdf_block``) and stops at the token.

On an H200 (32 nodes over 128256 columns, every node rejected) this takes about 180 us,
against 1.9 ms for one program per row walking its tree, a pass per rejection on a
single core (docs/history/2026-12-04-issue-15-traversal-verification.md). A pass reads
each block of the parent's q row once for all of its children, whose scalars are read
once before: ``max_children`` (static, the tree's K) slots unrolled. The node scalars (masses of the p and q rows, q'_k(x_k),
p_c(x_k), which nodes are usable) are XLA in the wrapper, where they fuse with reading
p and q once. The decisions are the reference's arithmetic except that vocabulary sums
are blockwise, so they and the final draw may differ from the reference only by a
rounding error. The public function falls back to the pure-jnp reference on backends
without a Triton lowering (TPU) and for non-float inputs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common, tree_sampler
from eagle_jax.kernels.filters import sample_from_probs
from eagle_jax.kernels.tree_common import (
    PAD_TOKEN, TreeSamplerOutput, as_prob, check_tree_shapes, inverse)

_NO_INDEX = _common.NO_INDEX


class _Nodes(NamedTuple):
  """Per-node scalars of a row's walk (``_node_scalars``), each [B, N+1]."""

  present: jax.Array  # bool: node k > 0 whose parent is in [0, k)
  valid: jax.Array  # bool: present, with a token in [0, vocab_size)
  usable: jax.Array  # bool: node 0, and nodes reached through usable parents that are
  #                    well formed (``Guards``) and no deeper than max_depth
  malformed: jax.Array  # bool: set aside for a malformed q' (counted)
  depth: jax.Array  # int32: depth below the root of a present node (-1: absent)
  q_row: jax.Array  # int32: the q row node k was drawn from, clipped into [0, E)
  q_norm: jax.Array  # f32: mass of the q' node k was drawn from
  q_tok: jax.Array  # f32: q(x_k) in that row
  p_tok: jax.Array  # f32: p_c(x_k) / mass of p_c, c = k's parent
  p_mass: jax.Array  # f32: mass of p_k (entries in [0, 1] below vocab_size)


def _node_scalars(tok, par, q_row, q, q_ok, p, vocab_size: int, max_depth: int,
                  max_children: int) -> _Nodes:
  """The walk's per-node scalars, batched jnp. tok, par, q_row [B, N+1]; q [B, E, V];
  q_ok [B, E] bool; p [B, N+1, V]. A node with ``max_children`` earlier siblings or more
  is not tested (the kernel keeps that many sibling slots)."""
  batch, n1 = tok.shape
  nodes = jnp.arange(n1, dtype=jnp.int32)
  rows = jnp.arange(batch)[:, None]
  in_vocab = jnp.arange(p.shape[-1]) < vocab_size
  present = (nodes > 0) & (par >= 0) & (par < nodes)
  valid = present & (tok >= 0) & (tok < vocab_size)
  safe_tok = jnp.where(valid, tok, 0)
  safe_par = jnp.where(present, par, 0)
  p_mass = jnp.sum(jnp.where(in_vocab, as_prob(p.astype(jnp.float32)), 0.0), axis=-1)
  q_rows = q.shape[1]
  q_in = (q_row >= 0) & (q_row < q_rows)
  e = jnp.where(q_in, q_row, 0)
  q_tot = jnp.sum(jnp.where(in_vocab, as_prob(q.astype(jnp.float32)), 0.0), axis=-1)
  q_tok = as_prob(q[rows, e, safe_tok].astype(jnp.float32))
  # Earlier present siblings s < k of node k, and the first occurrences of their tokens.
  sib = (present[:, :, None] & present[:, None, :] & (par[:, :, None] == par[:, None, :])
         & (nodes[None, :, None] > nodes[None, None, :]))
  same = valid[:, :, None] & valid[:, None, :] & (safe_tok[:, :, None] == safe_tok[:, None, :])
  dup = jnp.any(sib & same, axis=-1)  # [B, N+1]: k repeats an earlier sibling's token
  first = valid & ~dup
  q_sib = as_prob(q[rows[:, :, None], e[:, :, None], safe_tok[:, None, :]].astype(jnp.float32))
  taken = jnp.sum(jnp.where(sib & first[:, None, :], q_sib, 0.0), axis=-1)
  q_norm = q_tot[rows, e] - taken
  q_prime = jnp.where(q_norm > 0.0, q_tok / jnp.where(q_norm > 0.0, q_norm, 1.0), 0.0)
  other_row = jnp.any(sib & (e[:, :, None] != e[:, None, :]), axis=-1)  # not its siblings'
  well = (valid & q_in & q_ok[rows, e] & ~dup & ~other_row & (q_prime > 0.0)
          & (q_prime <= 1.0))
  beyond = jnp.sum(sib, axis=-1) >= max_children  # by node order only: no peeking
  depth = jnp.where(nodes == 0, 0, -1) + jnp.zeros_like(tok)
  usable = jnp.broadcast_to(nodes == 0, tok.shape)
  for _ in range(max_depth + 1):  # static, small: a node of depth d settles by step d
    up_depth = jnp.take_along_axis(depth, safe_par, axis=1)
    depth = jnp.where(present & (up_depth >= 0), up_depth + 1, depth)
    usable = (nodes == 0) | (present & well & ~beyond & (depth >= 1) & (depth <= max_depth)
                             & jnp.take_along_axis(usable, safe_par, axis=1))
  parent_usable = jnp.take_along_axis(usable, safe_par, axis=1)
  malformed = valid & ~well & ~beyond & parent_usable & (depth >= 1) & (depth <= max_depth)
  pm_par = jnp.take_along_axis(p_mass, safe_par, axis=1)
  p_at = as_prob(p[rows, safe_par, safe_tok].astype(jnp.float32))
  p_tok = jnp.where(pm_par > 0.0, p_at / jnp.where(pm_par > 0.0, pm_par, 1.0), 0.0)
  return _Nodes(present, valid, usable, malformed, depth, e.astype(jnp.int32), q_norm, q_tok,
                p_tok, p_mass)


def _outputs(acc, token, fallback, n: _Nodes, tok, par, run, active, greedy_out,
             greedy, max_depth: int) -> TreeSamplerOutput:
  """The row's result from the accepted node ``acc`` [B] and the drawn token [B]: the
  path root .. acc (max_depth + 1 static gathers up the parents), merged with the greedy
  rows' result."""
  batch = tok.shape[0]
  rows = jnp.arange(batch)
  steps = jnp.arange(max_depth + 1, dtype=jnp.int32)[None]
  acc = jnp.where(run, acc, 0)
  accept_len = jnp.where(run, n.depth[rows, acc], 0)
  path = jnp.full((batch, max_depth + 1), PAD_TOKEN, jnp.int32)
  v = acc
  for _ in range(max_depth + 1):
    d = n.depth[rows, v]
    path = jnp.where(steps == jnp.maximum(d, 0)[:, None], v[:, None], path)
    v = jnp.where(v > 0, jnp.maximum(par[rows, v], 0), 0)
  path = jnp.where(steps <= accept_len[:, None], path, PAD_TOKEN)
  nxt = jnp.maximum(jnp.roll(path, -1, axis=1), 0)
  toks = jnp.where(steps < accept_len[:, None], jnp.take_along_axis(tok, nxt, axis=1),
                   PAD_TOKEN)
  toks = jnp.where(steps == accept_len[:, None], token[:, None], toks)
  zero = jnp.zeros((batch,), jnp.int32)
  tv = TreeSamplerOutput(
      tokens=jnp.where(run[:, None], toks, PAD_TOKEN).astype(jnp.int32),
      path=jnp.where(run[:, None], path, PAD_TOKEN).astype(jnp.int32),
      num_tokens=jnp.where(run, accept_len + 1, zero),
      accept_len=accept_len.astype(jnp.int32),
      num_malformed_q=jnp.where(run, jnp.sum(n.malformed, axis=1), zero).astype(jnp.int32),
      num_fallback=jnp.where(run, fallback, zero).astype(jnp.int32))
  pick = greedy & active
  return jax.tree.map(
      lambda g, t: jnp.where(pick.reshape((-1,) + (1,) * (g.ndim - 1)), g, t), greedy_out, tv)


def _alpha_after(delta, a):
  """A node's alpha after rejecting a child whose pass summed to Delta, its alpha before
  being a: Delta / (Delta + 1 - a) (0 where that is not positive)."""
  den = delta + 1.0 - a
  return jnp.where(den > 0.0, delta / jnp.where(den > 0.0, den, 1.0), 0.0)


def _r_after(r, a, q, delta):
  """A node's r at one later child's token x after rejecting a child: max(a r(x) - q'(x),
  0) / Delta, with q = q'(x) of the rejected child's distribution."""
  return jnp.maximum(a * r - q, 0.0) / jnp.where(delta > 0.0, delta, 1.0)


def _after_rejection(delta, a_c, here, at_c, later, q_v, alpha, rk, a_rej, d_rej):
  """The walk's state after rejecting node v at its parent c (Delta ``delta``, c's alpha
  ``a_c``), as vectors over the nodes (``here``: v's lane, ``at_c``: c's, ``later``:
  c's later usable children, ``q_v``: q'_v at each node's token): c's new alpha, v's
  record, and c's new r at its later children's tokens. The reference's; the kernel
  shares its two scalar steps (``_alpha_after``, ``_r_after``)."""
  alpha = jnp.where(at_c, _alpha_after(delta, a_c), alpha)
  a_rej = jnp.where(here, a_c, a_rej)
  d_rej = jnp.where(here, delta, d_rej)
  rk = jnp.where(later, _r_after(rk, a_c, q_v, delta), rk)
  return alpha, rk, a_rej, d_rej


def _walk_row(n: _Nodes, tok, par, q, p, u, run, *, vocab_size: int, max_depth: int):
  """One row's walk, pure jnp (the reference): (accepted node, token, fallback)."""
  num_nodes, num_cols = p.shape
  nodes = jnp.arange(num_nodes, dtype=jnp.int32)
  cols = jnp.arange(num_cols, dtype=jnp.int32)
  in_vocab = cols < vocab_size
  present, valid = n.present, n.valid
  p = jnp.where(in_vocab, as_prob(p.astype(jnp.float32)), 0.0)
  q = jnp.where(in_vocab, as_prob(q.astype(jnp.float32)), 0.0)
  q_prime = jnp.where(n.q_norm > 0.0, n.q_tok / jnp.where(n.q_norm > 0.0, n.q_norm, 1.0), 0.0)

  def residual(c, upto, deleted, a_rej, d_rej):
    """r_c after its rejected children below node index `upto`, and the columns of its
    children's tokens below `upto` (excluded from the next q'). Usable siblings share
    one q row (``_node_scalars``): the first child's."""
    mass = n.p_mass[c]
    r0 = p[c] * inverse(mass)
    first = jnp.min(jnp.where(present & (par == c), nodes, _NO_INDEX))
    q_c = q[n.q_row[jnp.where(first < _NO_INDEX, first, 0)]]

    def body(s, carry):
      r, excl = carry
      sib = present[s] & (par[s] == c) & (s < upto)
      qv = jnp.where(excl, 0.0, q_c) * inverse(n.q_norm[s])
      step = jnp.maximum(a_rej[s] * r - qv, 0.0) * inverse(d_rej[s])
      r = jnp.where(sib & deleted[s], step, r)
      return r, excl | (sib & valid[s] & (cols == tok[s]))

    return lax.fori_loop(0, num_nodes, body, (r0, jnp.zeros((num_cols,), jnp.bool_)))

  def descend(alpha, rk, deleted):
    def step(_, carry):
      v, alpha = carry
      kids = n.usable & ~deleted & (par == v) & (nodes > 0)
      k = jnp.min(jnp.where(kids, nodes, _NO_INDEX))
      has = k < _NO_INDEX
      k = jnp.where(has, k, 0)
      a_k = jnp.minimum(1.0, alpha[v] * rk[k] / jnp.where(has, q_prime[k], 1.0))
      alpha = jnp.where(has & (alpha[k] < 0.0) & (nodes == k), a_k, alpha)
      return jnp.where(has, k, v), alpha

    return lax.fori_loop(0, max_depth, step, (jnp.int32(0), alpha))

  def test(_, carry):
    alpha, rk, deleted, a_rej, d_rej, done, acc = carry
    v, alpha_d = descend(alpha, rk, deleted)
    alpha = jnp.where(done, alpha, alpha_d)
    accept = ~done & ((v == 0) | (u[v] < alpha[v]))
    reject = ~done & ~accept
    c = jnp.where(reject, par[v], 0)
    a_c = alpha[c]
    r, excl = residual(c, v, deleted, a_rej, d_rej)
    qv = jnp.where(excl, 0.0, q[n.q_row[v]]) * inverse(n.q_norm[v])
    delta = jnp.sum(jnp.maximum(a_c * r - qv, 0.0))
    here = reject & (nodes == v)
    later = reject & n.usable & ~deleted & (par == c) & (nodes > v)
    q_v = n.q_tok / jnp.where(n.q_norm[v] > 0.0, n.q_norm[v], 1.0)
    alpha, rk, a_rej, d_rej = _after_rejection(
        delta, a_c, here, reject & (nodes == c), later, q_v, alpha, rk, a_rej, d_rej)
    deleted = deleted | here
    acc = jnp.where(~done & accept, v, acc)
    return alpha, rk, deleted, a_rej, d_rej, done | accept, acc

  zeros = jnp.zeros((num_nodes,), jnp.float32)
  init = (jnp.where(nodes == 0, 1.0, -1.0), n.p_tok, jnp.zeros((num_nodes,), jnp.bool_),
          zeros, zeros, ~run, jnp.int32(0))
  _, _, deleted, a_rej, d_rej, _, acc = lax.fori_loop(0, num_nodes, test, init)
  r, _ = residual(acc, num_nodes, deleted, a_rej, d_rej)
  fallback = ~(jnp.sum(r) > 0.0)
  weights = jnp.where(fallback, p[acc], r)
  coin = u[num_nodes]
  drawn = sample_from_probs(weights, coin)
  uniform_token = jnp.minimum((coin * vocab_size).astype(jnp.int32), vocab_size - 1)
  drawn = jnp.where(jnp.any(weights > 0.0), drawn, uniform_token)
  return acc, drawn, (run & fallback).astype(jnp.int32)


def _prepare(node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
             vocab_size, active, max_depth, draft_probs_ok, max_children):
  if draft_probs is None or q_row is None:
    raise ValueError("traversal_sample verifies with the draft's real q: draft_probs "
                     "[B, E, V] and q_row [B, N+1] are required (for deterministic "
                     "candidates use tree_speculative_sample(target_only=True))")
  node_tokens = jnp.asarray(node_tokens, jnp.int32)
  parents = jnp.asarray(parents, jnp.int32)
  greedy = jnp.asarray(greedy, jnp.bool_)
  uniforms = jnp.asarray(uniforms, jnp.float32)
  target_probs = jnp.asarray(target_probs)
  draft_probs = jnp.asarray(draft_probs)
  q_row = jnp.asarray(q_row, jnp.int32)
  check_tree_shapes(
      node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms, vocab_size,
      active, max_depth, draft_probs_ok)
  batch = node_tokens.shape[0]
  active = jnp.ones((batch,), jnp.bool_) if active is None else jnp.asarray(active, jnp.bool_)
  q_ok = (jnp.ones(draft_probs.shape[:2], jnp.bool_) if draft_probs_ok is None
          else jnp.asarray(draft_probs_ok, jnp.bool_))
  max_children = node_tokens.shape[1] - 1 if max_children is None else max_children
  if max_children < 1:
    raise ValueError(f"max_children {max_children} < 1")
  nodes = _node_scalars(node_tokens, parents, q_row, draft_probs, q_ok, target_probs,
                        vocab_size, max_depth, max_children)
  return (node_tokens, parents, draft_probs, target_probs, greedy, uniforms, active, nodes,
          max_children)


def traversal_sample_reference(
    node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
    vocab_size: int, active=None, *, max_depth: int, draft_probs_ok=None,
    max_children: int | None = None) -> TreeSamplerOutput:
  """Pure-jnp reference of :func:`traversal_sample` (same arguments and result)."""
  tok, par, q, p, greedy, u, active, n, _ = _prepare(
      node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms, vocab_size,
      active, max_depth, draft_probs_ok, max_children)
  run = active & ~greedy
  acc, token, fallback = jax.vmap(functools.partial(
      _walk_row, vocab_size=vocab_size, max_depth=max_depth))(n, tok, par, q, p, u, run)
  greedy_out = tree_sampler.tree_speculative_sample_reference(
      tok, par, None, None, p, greedy, u, vocab_size, active & greedy, max_depth=max_depth)
  return _outputs(acc, token, fallback, n, tok, par, run, active, greedy_out, greedy,
                  max_depth)


# --------------------------------------------------------------------------------------
# Pallas kernels (Triton path): every node's pass in rounds, parents before children, then
# the walk (XLA, scalars only) and the draw at the accepted node.
# --------------------------------------------------------------------------------------

# Fields of the per-node state the passes write ([B, N+1, 2] float32).
_ENTRY, _BEFORE = range(2)  # alpha_k when the walk enters k; its parent's alpha before k
_NUM_FIELDS = 2


class _Schedule(NamedTuple):
  """The order of a row's passes, from the tree alone (``_schedule``)."""

  kids: jax.Array  # int32 [B, N+1, K]: node c's first K present children by index (-1)
  round: jax.Array  # int32 [B, N+1]: the launch that makes a usable node's pass (-1: none)
  last_kid: jax.Array  # int32 [B, N+1]: node c's last usable child (-1: none)
  in_subtree: jax.Array  # bool [B, N+1, N+1]: [b, v, u]: u is v or below it


def _schedule(par, n: _Nodes, run, max_depth: int, max_children: int) -> _Schedule:
  """When each node's pass can run. Node k's pass (its Delta over the vocabulary) needs
  its parent c's alpha when the walk enters k, i.e. c's entry alpha (fixed when c's own
  pass runs) and the passes of k's earlier siblings. So k's round is its parent's round
  plus its rank among its siblings plus 1, summed down its path: at most
  max_depth x max_children, and at most N (each unit is a distinct node)."""
  batch, n1 = par.shape
  nodes = jnp.arange(n1, dtype=jnp.int32)
  safe_par = jnp.where(n.present, par, 0)
  child = n.present[:, None, :] & (par[:, None, :] == nodes[None, :, None])  # [B, c, k]
  rank = jnp.cumsum(child.astype(jnp.int32), axis=2) - 1
  kids = jnp.stack([jnp.min(jnp.where(child & (rank == j), nodes, _NO_INDEX), axis=2)
                    for j in range(max_children)], axis=-1)
  kids = jnp.where(kids < _NO_INDEX, kids, -1).astype(jnp.int32)
  last_kid = jnp.max(jnp.where(child & n.usable[:, None, :], nodes, -1), axis=2)
  own_rank = jnp.sum(jnp.where(child, rank, 0), axis=1)  # [B, k]
  usable = n.usable & (nodes > 0)
  rounds = jnp.zeros((batch, n1), jnp.int32)
  eye = jnp.broadcast_to(nodes[:, None] == nodes[None, :], (batch, n1, n1))
  in_subtree = eye
  for _ in range(max_depth + 1):  # static, small: a node of depth d settles by step d
    rounds = jnp.where(usable, jnp.take_along_axis(rounds, safe_par, axis=1) + own_rank + 1,
                       0)
    above = jnp.take_along_axis(in_subtree, jnp.broadcast_to(safe_par[:, None, :],
                                                             (batch, n1, n1)), axis=2)
    in_subtree = eye | (n.present[:, None, :] & above)
  rounds = jnp.where(usable & run[:, None], rounds, -1)
  return _Schedule(kids, rounds.astype(jnp.int32), last_kid.astype(jnp.int32), in_subtree)


class _Slot(NamedTuple):
  """One child of a node, as a pass over the node's vocabulary sees it."""

  rejected: jax.Array  # bool: a usable child, rejected before the pass
  alpha: jax.Array  # f32: the node's alpha when the child was rejected
  delta: jax.Array  # f32: the child's Delta
  inv_delta: jax.Array  # f32: 1 / Delta (1 where Delta is 0)
  q_norm: jax.Array  # f32: the q' mass the child was drawn from (1 where not positive)
  token: jax.Array  # int32
  excludes: jax.Array  # bool: a valid token, missing from the later children's q'


def _slots(b, c, upto, alpha_c, kids_ref, usable_ref, valid_ref, tok_ref, qn_ref,
           partial_ref, *, max_children: int, num_blocks: int):
  """Node c's first ``max_children`` present children below node index ``upto``, and c's
  alpha after the usable ones were rejected (from ``alpha_c``, its entry alpha). A
  child's Delta is the sum of its pass's block partials (an earlier round's)."""
  blocks = jnp.arange(_common.next_power_of_2(num_blocks), dtype=jnp.int32)
  a = alpha_c
  slots = []
  for j in range(max_children):  # static: the tree's K
    i = kids_ref[b, c, j]
    take = (i >= 0) & (i < upto)
    i = jnp.where(take, i, 0)
    rejected = take & (usable_ref[b, i] != 0)
    delta = jnp.sum(plgpu.load(partial_ref.at[b, i, blocks],
                               mask=rejected & (blocks < num_blocks), other=0.0))
    qn = qn_ref[b, i]
    slots.append(_Slot(rejected, a, delta, inverse(delta), jnp.where(qn > 0.0, qn, 1.0),
                       tok_ref[b, i], take & (valid_ref[b, i] != 0)))
    a = jnp.where(rejected, _alpha_after(delta, a), a)
  return slots, a


def _residual_block(pv, inv_mass, cols, slots, q_block):
  """r of a node at columns ``cols`` after its rejected children in ``slots`` (the
  reference's ``residual``): from its p block ``pv`` and the block of its children's q
  row (loaded once for all of them); and the columns of their tokens. No scratch memory:
  r <- max(a_j r - q'_j, 0) / Delta_j, child by child, in registers."""
  r = pv * inv_mass
  excl = jnp.zeros(cols.shape, jnp.int32)
  for s in slots:  # static: max_children
    qv = jnp.where(excl != 0, 0.0, q_block) * (1.0 / s.q_norm)
    r = jnp.where(s.rejected, jnp.maximum(s.alpha * r - qv, 0.0) * s.inv_delta, r)
    excl = excl | jnp.where(s.excludes & (cols == s.token), 1, 0)
  return r, excl


def _pass_kernel(t_ref, round_ref, par_ref, tok_ref, qr_ref, usable_ref, valid_ref, kids_ref,
                 qn_ref, qtok_ref, ptok_ref, pmass_ref, p_ref, q_ref, entry_in_ref,
                 partial_in_ref, entry_ref, partial_ref, *, max_children, vocab_size, block,
                 num_blocks):
  """Program (b, k, kb), in round t: if node k's pass is due (``_schedule``), the sum of
  max(a r - q'_k, 0) over vocabulary block kb (a, r: k's parent's alpha and residual
  when the walk reaches k), and, from block 0's program, k's entry alpha and a. Reads
  earlier rounds' results only (``entry_in_ref``, ``partial_in_ref``; aliased to the
  outputs); writes nothing when k is not due."""
  b, k, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  @pl.when(round_ref[b, k] == t_ref[0])
  def _():
    c = par_ref[b, k]
    slots, a = _slots(b, c, k, entry_in_ref[b, c, _ENTRY], kids_ref, usable_ref, valid_ref,
                      tok_ref, qn_ref, partial_in_ref, max_children=max_children,
                      num_blocks=num_blocks)

    @pl.when(kb == 0)
    def _():
      q_tok = qtok_ref[b, k]
      r_tok = ptok_ref[b, k]  # r of c at k's token, after each earlier sibling
      for s in slots:
        r_tok = jnp.where(s.rejected, _r_after(r_tok, s.alpha, q_tok / s.q_norm, s.delta),
                          r_tok)
      qn_k = qn_ref[b, k]
      alpha_k = jnp.minimum(1.0, a * r_tok / (q_tok / jnp.where(qn_k > 0.0, qn_k, 1.0)))
      fields = jnp.arange(_NUM_FIELDS, dtype=jnp.int32)
      plgpu.store(entry_ref.at[b, k, fields], jnp.where(fields == _ENTRY, alpha_k, a))

    cols = kb * block + jnp.arange(block, dtype=jnp.int32)
    live = cols < vocab_size
    q_block = as_prob(plgpu.load(q_ref.at[b, qr_ref[b, k], cols], mask=live, other=0.0))
    pv = as_prob(plgpu.load(p_ref.at[b, c, cols], mask=live, other=0.0))
    r, excl = _residual_block(pv, inverse(pmass_ref[b, c]), cols, slots, q_block)
    qv = jnp.where(excl != 0, 0.0, q_block) * inverse(qn_ref[b, k])
    partial_ref[b, k, kb] = jnp.sum(jnp.maximum(a * r - qv, 0.0))


def _draw_kernel(acc_ref, flags_ref, start_ref, cdf_ref, kids_ref, usable_ref, valid_ref,
                 tok_ref, qr_ref, qn_ref, pmass_ref, p_ref, q_ref, entry_ref, partial_ref,
                 out_ref, *, max_children, vocab_size, block, num_blocks, num_nodes):
  """Program b: the inverse-CDF draw at row b's accepted node from its final r (after
  all its usable children were rejected), or from its p (``flags_ref[b]``: draws,
  fallback), starting at block ``start_ref[b]``, where the blocks' masses (the passes'
  partials) put the target (``cdf_ref[b]``: the mass before that block, the target);
  -1 where the row does not draw."""
  b = pl.program_id(0)
  acc = acc_ref[b]
  draw = flags_ref[b, 0] != 0
  fallback = flags_ref[b, 1] != 0
  slots, _ = _slots(b, acc, num_nodes, entry_ref[b, acc, _ENTRY], kids_ref, usable_ref,
                    valid_ref, tok_ref, qn_ref, partial_ref, max_children=max_children,
                    num_blocks=num_blocks)
  first_kid = kids_ref[b, acc, 0]
  has_kids = first_kid >= 0
  e = qr_ref[b, jnp.where(has_kids, first_kid, 0)]
  inv_mass = inverse(pmass_ref[b, acc])
  target = cdf_ref[b, 1]

  def more(carry):
    kb, (_, found, _) = carry
    return draw & (kb < num_blocks) & (found == _NO_INDEX)

  def step(carry):
    kb, cdf = carry
    cols = kb * block + jnp.arange(block, dtype=jnp.int32)
    live = cols < vocab_size
    pv = as_prob(plgpu.load(p_ref.at[b, acc, cols], mask=live, other=0.0))
    q_block = as_prob(plgpu.load(q_ref.at[b, e, cols], mask=live & has_kids & ~fallback,
                                 other=0.0))
    r, _ = _residual_block(pv, inv_mass, cols, slots, q_block)
    return kb + 1, _common.inverse_cdf_block(cdf, cols, jnp.where(fallback, pv, r), target)

  _, cdf = lax.while_loop(
      more, step, (start_ref[b], _common.inverse_cdf_init(before=cdf_ref[b, 0])))
  out_ref[b] = _common.inverse_cdf_token(cdf)


def _block_config(vocab_size: int, gpu: _common.GpuTarget) -> tuple[int, int]:
  """(BLOCK, num_warps) of both kernels (the draw reads the passes' block partials, so
  they share the width). A round's grid is B x (N+1) x blocks, of which only the due
  nodes' programs work, so a round costs about a launch: on an H200 (32 nodes, 128256
  columns, 24 rounds) 1024 to 8192 columns at 4 to 16 warps all measured 177-205 us per
  call; 4096 at 8 warps (16 per thread) was the fastest. AMD: 1024 at 8 waves (2 per
  lane): the draw's loop carries every sibling slot's scalars, and at 2048 x 8 (or
  1024 x 4) it spilled 12-19 SGPRs on gfx942 and gfx950; 1024 x 8 spills none
  (scripts/rocm_compile.py). Not measured on AMD hardware. Smaller for a small
  vocabulary."""
  if gpu.platform == "rocm":
    block = min(1024, _common.next_power_of_2(vocab_size))
    return block, min(8, max(4, block // 128))
  block = min(4096, _common.next_power_of_2(vocab_size))
  return block, min(8, max(4, block // 512))


def traversal_sample(
    node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
    vocab_size: int, active=None, *, max_depth: int, draft_probs_ok=None,
    max_children: int | None = None, interpret: bool | None = None,
    target: str | None = None, block_v: int | None = None,
    num_warps: int | None = None) -> TreeSamplerOutput:
  """Verify a draft tree per row by Traversal Verification (see the module docstring).

  Arguments and result as :func:`tree_sampler.tree_speculative_sample` with the draft's
  real q (``draft_probs`` [B, E, V] and ``q_row`` [B, N+1] are required); greedy rows
  take the target's argmax path (``tree_sampler``'s kernel, run for those rows only).
  ``max_children`` (static): the most children a node has (the draft tree's K; None: N);
  the kernels unroll that many sibling slots, and a node with more earlier siblings is
  not tested.
  """
  supported = (
      _common.kernel_backend_ok(interpret, target_probs, draft_probs)
      and jnp.ndim(node_tokens) == 2 and jnp.shape(node_tokens)[1] >= 1
      and jnp.issubdtype(jnp.result_type(target_probs), jnp.floating)
      and draft_probs is not None
      and jnp.issubdtype(jnp.result_type(draft_probs), jnp.floating))
  if not supported:
    return traversal_sample_reference(
        node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
        vocab_size, active, max_depth=max_depth, draft_probs_ok=draft_probs_ok,
        max_children=max_children)
  tok, par, q, p, greedy, u, active, n, max_children = _prepare(
      node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms, vocab_size,
      active, max_depth, draft_probs_ok, max_children)
  p = p.astype(jnp.float32)
  q = q.astype(jnp.float32)
  run = active & ~greedy
  batch, n1 = tok.shape
  default_block, default_warps = _block_config(vocab_size, _common.resolve_target(target))
  block = block_v or default_block
  if block & (block - 1):
    raise ValueError(f"block {block} must be a power of two")
  num_blocks = _common.cdiv(vocab_size, block)
  sched = _schedule(par, n, run, max_depth, max_children)
  nodes = jnp.arange(n1, dtype=jnp.int32)
  valid = n.valid.astype(jnp.int32)
  usable = n.usable.astype(jnp.int32)
  kernel_args = dict(max_children=max_children, vocab_size=vocab_size, block=block,
                     num_blocks=num_blocks)
  params = plgpu.CompilerParams(num_warps=num_warps or default_warps, num_stages=1)
  interpret = _common.resolve_interpret(interpret)

  # 1. Every usable node's pass, in rounds (``_schedule``): entry alphas and Delta partials.
  state_shapes = (jax.ShapeDtypeStruct((batch, n1, _NUM_FIELDS), jnp.float32),
                  jax.ShapeDtypeStruct((batch, n1, num_blocks), jnp.float32))
  passes = pl.pallas_call(
      functools.partial(_pass_kernel, **kernel_args), out_shape=state_shapes,
      grid=(batch, n1, num_blocks), input_output_aliases={14: 0, 15: 1},
      compiler_params=params, interpret=interpret, name="traversal_sampler")
  node_args = (sched.round, par, tok, n.q_row, usable, valid, sched.kids,
               n.q_norm, n.q_tok, n.p_tok, n.p_mass, p, q)
  entry = jnp.zeros((batch, n1, _NUM_FIELDS), jnp.float32).at[:, 0, _ENTRY].set(1.0)
  partial = jnp.zeros((batch, n1, num_blocks), jnp.float32)
  num_rounds = min(n1 - 1, max_depth * max_children)
  entry, partial = lax.fori_loop(
      1, num_rounds + 1,
      lambda t, state: passes(jnp.full((1,), t, jnp.int32), *node_args, *state),
      (entry, partial))

  # 2. The walk: every node's test alpha is its alpha after its usable children were
  # rejected; the accepted node is the first in post-order whose coin is below it (the
  # root: always), found by descending into the first child whose subtree holds one.
  delta = jnp.sum(partial, axis=-1)
  last = jnp.maximum(sched.last_kid, 0)
  alpha_last = _alpha_after(jnp.take_along_axis(delta, last, axis=1),
                            jnp.take_along_axis(entry[..., _BEFORE], last, axis=1))
  alpha_test = jnp.where(sched.last_kid >= 0, alpha_last, entry[..., _ENTRY])
  accept = (nodes == 0) | (n.usable & (u[:, :n1] < alpha_test))
  holds = jnp.any(sched.in_subtree & accept[:, None, :], axis=2)
  acc = jnp.zeros((batch,), jnp.int32)
  for _ in range(max_depth):  # static
    down = n.usable & holds & (par == acc[:, None]) & (nodes > 0)
    first = jnp.min(jnp.where(down, nodes, _NO_INDEX), axis=1)
    acc = jnp.where(first < _NO_INDEX, first, acc)

  # 3. The draw at the accepted node. Its final r is w / Delta of its last usable child's
  # pass (a leaf's: p / its mass), so the blocks' masses are that pass's partials; with
  # no mass, p of the node (fallback), whose block masses are summed here.
  rows = jnp.arange(batch)
  last_acc = sched.last_kid[rows, acc]
  has_kids = last_acc >= 0
  delta_acc = delta[rows, jnp.maximum(last_acc, 0)]
  mass_acc = n.p_mass[rows, acc]
  fallback = ~(jnp.where(has_kids, delta_acc, mass_acc) > 0.0)
  width = num_blocks * block  # the blocks' columns: p's may end before or after them
  p_acc = p[rows, acc, :width]
  p_acc = jnp.pad(p_acc, ((0, 0), (0, width - p_acc.shape[-1])))
  in_vocab = jnp.arange(width) < vocab_size
  p_blocks = jnp.sum(jnp.where(in_vocab, as_prob(p_acc), 0.0).reshape(
      batch, num_blocks, block), axis=-1)
  r_blocks = jnp.where(has_kids[:, None],
                       partial[rows, jnp.maximum(last_acc, 0)] * inverse(delta_acc)[:, None],
                       p_blocks * inverse(mass_acc)[:, None])
  blocks_mass = jnp.where(fallback[:, None], p_blocks, r_blocks)
  total = jnp.sum(blocks_mass, axis=1)
  coin = u[:, n1]
  goal = coin * total
  reach = jnp.cumsum(blocks_mass, axis=1)
  start = jnp.argmax(reach * _common.CDF_SLACK >= goal[:, None], axis=1).astype(jnp.int32)
  before = jnp.take_along_axis(reach - blocks_mass, start[:, None], axis=1)[:, 0]
  draws = run & (total > 0.0)
  drawn = pl.pallas_call(
      functools.partial(_draw_kernel, num_nodes=n1, **kernel_args),
      out_shape=jax.ShapeDtypeStruct((batch,), jnp.int32), grid=(batch,),
      compiler_params=params, interpret=interpret, name="traversal_draw",
  )(acc, jnp.stack([draws, fallback], axis=1).astype(jnp.int32), start,
    jnp.stack([before, goal], axis=1), sched.kids, usable, valid, tok,
    n.q_row, n.q_norm, n.p_mass, p, q, entry, partial)
  uniform_token = jnp.minimum((coin * vocab_size).astype(jnp.int32), vocab_size - 1)
  token = jnp.where(drawn >= 0, drawn, uniform_token)

  greedy_out = tree_sampler.tree_speculative_sample(
      tok, par, None, None, p, greedy, u, vocab_size, active & greedy, max_depth=max_depth,
      interpret=interpret, target=target, block_v=block_v, num_warps=num_warps)
  return _outputs(acc, token, (run & fallback).astype(jnp.int32), n, tok, par, run, active,
                  greedy_out, greedy, max_depth)
