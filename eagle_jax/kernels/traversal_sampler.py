"""Tree speculative-decoding verify sampler: Traversal Verification (TV).

Verifies an EAGLE-2 dynamic draft tree per batch row, lossless at any temperature, with
the draft's real probabilities, deciding whole paths instead of single tokens (Weng et
al. 2025, "Traversal Verification for Speculative Tree Decoding", NeurIPS; on a chain it
is Sun et al.'s block verification, "Block Verification Accelerates Speculative
Decoding", ICLR 2025). The engine uses it for sampled tree rows when asked
(``EngineConfig.tree_verify = "traversal"``; recursive rejection, ``tree_sampler.py``,
is the default while this walk costs more per step); greedy rows take the target's
argmax path as in ``tree_sampler.py``, whose tree layout and guards this module shares:
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

Kernel design. One pallas_call (Triton path), one program per row: the walk is
sequential (alpha_k depends on the state of every ancestor, which changes with each
rejection below it). Per-node scalars sit in registers as power-of-two vectors: the
tree, alpha, the record of every rejected node (alpha and Delta of its parent at its
rejection) and, for every child, its parent's current r at its own token, kept up to
date by one vector update per rejection, so that fixing alpha_k on the descent reads no
vocabulary. The vocabulary is streamed in BLOCK-wide masked loads
(``tree_sampler._block_config`` with one program per row) only for Delta at each
rejection (one pass over p_c and c's q row, rebuilding r_c blockwise from c's earlier
rejected children: r <- max(a_j r - q'_j, 0) / Delta_j, no scratch memory) and for the
final draw (two passes: r's mass, then the inverse CDF), so a row makes (rejections + 2)
passes; the walk's loop stops at the first acceptance. A pass multiplies by its
normalisers' reciprocals (``tree_sampler._inverse``): one program streams the whole
vocabulary, so a division per column and sibling made the pass compute-bound (H200, 32
rejections over 128256 columns: 2.5 ms -> 1.9 ms). A pass reads each block of c's q row
once for all of c's children, and the children's scalars once before its first block:
``max_children`` (static, the tree's K) slots unrolled, since every scalar read from a
register vector is a cross-warp reduction, which per block and per sibling would cost
more than the loads. The node
scalars (masses of the p and q rows, q'_k(x_k), p_c(x_k), which nodes are usable) are
XLA in the wrapper, where they fuse with reading p and q once. The accept/reject
decisions are the reference's arithmetic except that vocabulary sums are blockwise, so
they and the final draw may differ from the reference only by a rounding error. The
public function falls back to the pure-jnp reference on backends without a Triton
lowering (TPU) and for non-float inputs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import _common, tree_sampler
from eagle_jax.kernels.filters import sample_from_probs
from eagle_jax.kernels.tree_sampler import PAD_TOKEN, TreeSamplerOutput

_NO_INDEX = _common.NO_INDEX
# The tree samplers' shared helpers, one definition each (``tree_sampler``).
_as_prob = tree_sampler._as_prob  # noqa: SLF001
_count = tree_sampler._count  # noqa: SLF001
_inverse = tree_sampler._inverse  # noqa: SLF001
_pick = tree_sampler._pick  # noqa: SLF001
_trips = tree_sampler._trips  # noqa: SLF001
_I0 = np.int32(0)  # loop bounds, int32 (numpy: no device array at import)

# The kernel's output [B, 4] int32.
_ACCEPTED, _TOKEN, _FALLBACK = range(3)
_OUT = 4


class _Nodes(NamedTuple):
  """Per-node scalars of a row's walk (``_node_scalars``), each [B, N+1]."""

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
  p_mass = jnp.sum(jnp.where(in_vocab, _as_prob(p.astype(jnp.float32)), 0.0), axis=-1)
  q_rows = q.shape[1]
  q_in = (q_row >= 0) & (q_row < q_rows)
  e = jnp.where(q_in, q_row, 0)
  q_tot = jnp.sum(jnp.where(in_vocab, _as_prob(q.astype(jnp.float32)), 0.0), axis=-1)
  q_tok = _as_prob(q[rows, e, safe_tok].astype(jnp.float32))
  # Earlier present siblings s < k of node k, and the first occurrences of their tokens.
  sib = (present[:, :, None] & present[:, None, :] & (par[:, :, None] == par[:, None, :])
         & (nodes[None, :, None] > nodes[None, None, :]))
  same = valid[:, :, None] & valid[:, None, :] & (safe_tok[:, :, None] == safe_tok[:, None, :])
  dup = jnp.any(sib & same, axis=-1)  # [B, N+1]: k repeats an earlier sibling's token
  first = valid & ~dup
  q_sib = _as_prob(q[rows[:, :, None], e[:, :, None], safe_tok[:, None, :]].astype(jnp.float32))
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
  p_at = _as_prob(p[rows, safe_par, safe_tok].astype(jnp.float32))
  p_tok = jnp.where(pm_par > 0.0, p_at / jnp.where(pm_par > 0.0, pm_par, 1.0), 0.0)
  return _Nodes(usable, malformed, depth, e.astype(jnp.int32), q_norm, q_tok, p_tok, p_mass)


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


def _after_rejection(delta, a_c, here, at_c, later, q_v, alpha, rk, a_rej, d_rej):
  """The walk's state after rejecting node v at its parent c (Delta ``delta``, c's alpha
  ``a_c``), as vectors over the nodes (``here``: v's lane, ``at_c``: c's, ``later``:
  c's later usable children, ``q_v``: q'_v at each node's token): c's new alpha, v's
  record, and c's new r at its later children's tokens. The kernel and the reference
  share it, so their decisions are the same arithmetic."""
  den = delta + 1.0 - a_c
  new_a = jnp.where(den > 0.0, delta / jnp.where(den > 0.0, den, 1.0), 0.0)
  alpha = jnp.where(at_c, new_a, alpha)
  a_rej = jnp.where(here, a_c, a_rej)
  d_rej = jnp.where(here, delta, d_rej)
  rk = jnp.where(later, jnp.maximum(a_c * rk - q_v, 0.0)
                 / jnp.where(delta > 0.0, delta, 1.0), rk)
  return alpha, rk, a_rej, d_rej


def _walk_row(n: _Nodes, tok, par, q, p, u, run, *, vocab_size: int, max_depth: int):
  """One row's walk, pure jnp (the reference): (accepted node, token, fallback)."""
  num_nodes, num_cols = p.shape
  nodes = jnp.arange(num_nodes, dtype=jnp.int32)
  cols = jnp.arange(num_cols, dtype=jnp.int32)
  in_vocab = cols < vocab_size
  present = (nodes > 0) & (par >= 0) & (par < nodes)
  valid = present & (tok >= 0) & (tok < vocab_size)
  p = jnp.where(in_vocab, _as_prob(p.astype(jnp.float32)), 0.0)
  q = jnp.where(in_vocab, _as_prob(q.astype(jnp.float32)), 0.0)
  q_prime = jnp.where(n.q_norm > 0.0, n.q_tok / jnp.where(n.q_norm > 0.0, n.q_norm, 1.0), 0.0)

  def residual(c, upto, deleted, a_rej, d_rej):
    """r_c after its rejected children below node index `upto`, and the columns of its
    children's tokens below `upto` (excluded from the next q'). Usable siblings share
    one q row (``_node_scalars``): the first child's."""
    mass = n.p_mass[c]
    r0 = p[c] * _inverse(mass)
    first = jnp.min(jnp.where(present & (par == c), nodes, _NO_INDEX))
    q_c = q[n.q_row[jnp.where(first < _NO_INDEX, first, 0)]]

    def body(s, carry):
      r, excl = carry
      sib = present[s] & (par[s] == c) & (s < upto)
      qv = jnp.where(excl, 0.0, q_c) * _inverse(n.q_norm[s])
      step = jnp.maximum(a_rej[s] * r - qv, 0.0) * _inverse(d_rej[s])
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
    qv = jnp.where(excl, 0.0, q[n.q_row[v]]) * _inverse(n.q_norm[v])
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
  tree_sampler._check_shapes(  # noqa: SLF001 (the one shape check of tree samplers)
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
# Pallas kernel (Triton path): one program per row walks its tree.
# --------------------------------------------------------------------------------------


def _traversal_kernel(run_ref, tok_ref, par_ref, qr_ref, usable_ref, qn_ref, qtok_ref,
                      ptok_ref, pmass_ref, u_ref, p_ref, q_ref, out_ref, *, num_nodes,
                      num_nodes_pad, max_depth, max_children, vocab_size, block):
  """Program b: row b's accepted node, drawn token and fallback flag (``_ACCEPTED`` ..),
  written whatever they are (0, PAD_TOKEN, 0 for a row that does not run)."""
  b = pl.program_id(0)
  run = run_ref[b] != 0
  num_blocks = _common.cdiv(vocab_size, block)
  zero_f = jnp.float32(0.0)
  nodes = jnp.arange(num_nodes_pad, dtype=jnp.int32)
  in_tree = nodes < num_nodes
  tok = plgpu.load(tok_ref.at[b, nodes], mask=in_tree, other=-1)
  par = plgpu.load(par_ref.at[b, nodes], mask=in_tree, other=-1)
  e = plgpu.load(qr_ref.at[b, nodes], mask=in_tree, other=0)
  usable = plgpu.load(usable_ref.at[b, nodes], mask=in_tree, other=0)
  q_norm = plgpu.load(qn_ref.at[b, nodes], mask=in_tree, other=1.0)
  q_tok = plgpu.load(qtok_ref.at[b, nodes], mask=in_tree, other=0.0)
  p_tok = plgpu.load(ptok_ref.at[b, nodes], mask=in_tree, other=0.0)
  p_mass = plgpu.load(pmass_ref.at[b, nodes], mask=in_tree, other=0.0)
  coins = plgpu.load(u_ref.at[b, nodes], mask=in_tree, other=1.0)
  final_coin = u_ref[b, num_nodes]
  present = in_tree & (nodes > 0) & (par >= 0) & (par < nodes)
  valid = present & (tok >= 0) & (tok < vocab_size)
  valid_i32 = valid.astype(jnp.int32)
  safe_qn = jnp.where(q_norm > 0.0, q_norm, 1.0)
  q_prime = jnp.where(q_norm > 0.0, q_tok / safe_qn, 0.0)

  def sibling_slots(c, upto, deleted, a_rej, d_rej):
    """The scalars of c's first ``max_children`` children below node index `upto`, in
    node order, read once per pass (not once per block): per slot, whether it is a
    rejected child, its parent's alpha and Delta at its rejection, its q' mass, its
    token and whether that token is excluded from the later siblings' q'."""
    kids = present & (par == c) & (nodes < upto)
    rank = jnp.cumsum(kids.astype(jnp.int32)) - 1
    slots = []
    for j in range(max_children):
      lane = jnp.min(jnp.where(kids & (rank == j), nodes, _NO_INDEX))
      has = lane < _NO_INDEX
      lane = jnp.where(has, lane, 0)
      slots.append((has & (_pick(deleted, nodes, lane) != 0), _pick(a_rej, nodes, lane),
                    _inverse(_pick(d_rej, nodes, lane)), _inverse(_pick(q_norm, nodes, lane)),
                    _pick(tok, nodes, lane), has & (_pick(valid_i32, nodes, lane) != 0)))
    return slots

  def residual_block(cols, inv_mass, c, slots, q_block, live):
    """r_c at `cols` after the rejected children of ``slots`` (the reference's
    ``residual``), and the columns of their tokens; ``q_block``: the block of c's q row
    (its children's, loaded once for all of them)."""
    pv = _as_prob(plgpu.load(p_ref.at[b, c, cols], mask=live & (cols < vocab_size),
                             other=0.0))
    r = pv * inv_mass
    excl = jnp.zeros(cols.shape, jnp.int32)
    for rejected, a_j, inv_d_j, inv_qn_j, tok_j, hit in slots:  # static: max_children
      qv = jnp.where(excl != 0, 0.0, q_block) * inv_qn_j
      r = jnp.where(rejected, jnp.maximum(a_j * r - qv, 0.0) * inv_d_j, r)
      excl = excl | jnp.where(hit & (cols == tok_j), 1, 0)
    return r, excl

  def descend(alpha, rk, deleted):
    def step(_, carry):
      v, alpha = carry
      kids = (usable != 0) & (deleted == 0) & (par == v) & (nodes > 0)
      k = jnp.min(jnp.where(kids, nodes, _NO_INDEX))
      has = k < _NO_INDEX
      k = jnp.where(has, k, 0)
      qk = _pick(q_prime, nodes, k)
      a_k = jnp.minimum(1.0, _pick(alpha, nodes, v) * _pick(rk, nodes, k)
                        / jnp.where(has, qk, 1.0))
      unset = _pick(alpha, nodes, k) < 0.0
      alpha = jnp.where(has & unset & (nodes == k), a_k, alpha)
      return jnp.where(has, k, v), alpha

    return lax.fori_loop(_I0, np.int32(max_depth), step, (jnp.int32(0), alpha))

  def test(_, carry):
    alpha, rk, deleted, a_rej, d_rej, done, acc = carry
    v, alpha_d = descend(alpha, rk, deleted)
    alpha = jnp.where(done, alpha, alpha_d)
    accept = ~done & ((v == 0) | (_pick(coins, nodes, v) < _pick(alpha, nodes, v)))
    reject = ~done & ~accept
    c = jnp.where(reject, _pick(par, nodes, v), 0)
    a_c = _pick(alpha, nodes, c)
    e_v = _pick(e, nodes, v)
    qn_v = _pick(safe_qn, nodes, v)
    inv_qn_v = _inverse(qn_v)
    inv_mass_c = _inverse(_pick(p_mass, nodes, c))
    slots = sibling_slots(c, v, deleted, a_rej, d_rej)

    def delta_pass(kb, total):
      cols = kb * block + jnp.arange(block, dtype=jnp.int32)
      live = cols < vocab_size
      q_block = _as_prob(plgpu.load(q_ref.at[b, e_v, cols], mask=live, other=0.0))
      r, excl = residual_block(cols, inv_mass_c, c, slots, q_block, live)
      qv = jnp.where(excl != 0, 0.0, q_block) * inv_qn_v
      return total + jnp.sum(jnp.maximum(a_c * r - qv, 0.0))

    delta = lax.fori_loop(_I0, _trips(reject, num_blocks), delta_pass, zero_f)
    here = reject & (nodes == v)
    later = reject & (usable != 0) & (deleted == 0) & (par == c) & (nodes > v)
    alpha, rk, a_rej, d_rej = _after_rejection(
        delta, a_c, here, reject & (nodes == c), later, q_tok / qn_v, alpha, rk, a_rej, d_rej)
    deleted = jnp.where(here, 1, deleted)
    acc = jnp.where(~done & accept, v, acc)
    return alpha, rk, deleted, a_rej, d_rej, done | accept, acc

  zeros = jnp.zeros((num_nodes_pad,), jnp.float32)
  init = (jnp.where(nodes == 0, 1.0, -1.0).astype(jnp.float32), p_tok,
          jnp.zeros((num_nodes_pad,), jnp.int32), zeros, zeros, ~run, jnp.int32(0))
  # Until the first acceptance: each node is tested at most once, and after the accepted
  # one no state is read but the draw's.
  def walking(carry):
    i, (_, _, _, _, _, done, _) = carry
    return (i < num_nodes) & ~done

  _, (_, _, deleted, a_rej, d_rej, _, acc) = lax.while_loop(
      walking, lambda carry: (carry[0] + 1, test(*carry)), (jnp.int32(0), init))

  # The draw at the accepted node: r's mass, then its inverse CDF (or p's, on fallback).
  first_kid = jnp.min(jnp.where(present & (par == acc), nodes, _NO_INDEX))
  has_kids = first_kid < _NO_INDEX
  e_acc = _pick(e, nodes, jnp.where(has_kids, first_kid, 0))

  acc_slots = sibling_slots(acc, num_nodes, deleted, a_rej, d_rej)
  inv_mass_acc = _inverse(_pick(p_mass, nodes, acc))

  def acc_residual(cols, live):
    q_block = _as_prob(plgpu.load(q_ref.at[b, e_acc, cols], mask=live & has_kids, other=0.0))
    r, _ = residual_block(cols, inv_mass_acc, acc, acc_slots, q_block, live)
    return r

  def mass_pass(kb, total):
    cols = kb * block + jnp.arange(block, dtype=jnp.int32)
    return total + jnp.sum(acc_residual(cols, cols < vocab_size))

  mass = lax.fori_loop(_I0, _trips(run, num_blocks), mass_pass, zero_f)
  fallback = ~(mass > 0.0)
  total = jnp.where(fallback, _pick(p_mass, nodes, acc), mass)
  draw = run & (total > 0.0)

  def draw_pass(kb, carry):
    cols = kb * block + jnp.arange(block, dtype=jnp.int32)
    live = cols < vocab_size
    r = acc_residual(cols, live & ~fallback)
    pv = _as_prob(plgpu.load(p_ref.at[b, acc, cols], mask=live & fallback, other=0.0))
    return _common.inverse_cdf_block(carry, cols, jnp.where(fallback, pv, r),
                                     final_coin * total)

  drawn = _common.inverse_cdf_token(lax.fori_loop(
      _I0, _trips(draw, num_blocks), draw_pass, _common.inverse_cdf_init()))
  uniform_token = jnp.minimum((final_coin * vocab_size).astype(jnp.int32), vocab_size - 1)
  drawn = jnp.where(drawn >= 0, drawn, uniform_token)
  field = jnp.arange(_OUT, dtype=jnp.int32)
  out = jnp.where(field == _ACCEPTED, jnp.where(run, acc, 0),
                  jnp.where(field == _TOKEN, jnp.where(run, drawn, PAD_TOKEN),
                            jnp.where(field == _FALLBACK, _count(run & fallback), 0)))
  plgpu.store(out_ref.at[b, field], out.astype(jnp.int32))


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
  the kernel unrolls that many sibling slots, and a node with more earlier siblings is
  not tested.
  """
  supported = (
      _common.kernel_backend_ok(interpret)
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
  batch, num_nodes = tok.shape
  default_block, default_warps = tree_sampler._block_config(  # noqa: SLF001
      vocab_size, batch, _common.resolve_target(target))
  block = block_v or default_block
  if block & (block - 1):
    raise ValueError(f"block {block} must be a power of two")
  out = pl.pallas_call(
      functools.partial(
          _traversal_kernel, num_nodes=num_nodes,
          num_nodes_pad=_common.next_power_of_2(num_nodes), max_depth=max_depth,
          max_children=max_children, vocab_size=vocab_size, block=block),
      out_shape=jax.ShapeDtypeStruct((batch, _OUT), jnp.int32),
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps or default_warps,
                                           num_stages=1),
      interpret=_common.resolve_interpret(interpret),
      name="traversal_sampler",
  )(run.astype(jnp.int32), tok, par, n.q_row, n.usable.astype(jnp.int32), n.q_norm,
    n.q_tok, n.p_tok, n.p_mass, u, p, q)
  greedy_out = tree_sampler.tree_speculative_sample(
      tok, par, None, None, p, greedy, u, vocab_size, active & greedy, max_depth=max_depth,
      interpret=interpret, target=target, block_v=block_v, num_warps=num_warps)
  return _outputs(out[:, _ACCEPTED], out[:, _TOKEN], out[:, _FALLBACK], n, tok, par, run,
                  active, greedy_out, greedy, max_depth)
