"""What the two tree verify samplers share: the tree layout's output, its guards' arithmetic
and its shape check.

``tree_sampler.py`` (recursive rejection sampling, the target-only rule, greedy rows) and
``traversal_sampler.py`` (Traversal Verification) verify the same EAGLE-2 draft trees,
laid out per batch row as: node 0 the root (the last committed token; its token is
ignored), node i > 0 holding draft token ``node_tokens[b, i]`` and parent
``parents[b, i]`` in [0, i) (negative: absent), its q row ``q_row[b, i]`` of
``draft_probs``, p_i = ``target_probs[b, i]``, and coins ``uniforms[b]`` (column i node
i's, column N+1 the final draw). Both return a ``TreeSamplerOutput``, PAD_TOKEN past the
accepted path and in inactive rows. Their kernels and references use ``as_prob`` and
``inverse``, so that the kernels' arithmetic stays the references'. ``tree_verify.py``
chooses between them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

PAD_TOKEN = -1


class TreeSamplerOutput(NamedTuple):
  """Result of one tree verify step. Shapes: tokens, path [B, D+1]; the rest [B]."""

  tokens: jax.Array  # int32: accepted path tokens (root excluded), the emitted token, PAD
  path: jax.Array  # int32: node 0, then each accepted node, then PAD
  num_tokens: jax.Array  # int32, accept_len + 1 (0 for inactive rows)
  accept_len: jax.Array  # int32
  num_malformed_q: jax.Array  # int32
  num_fallback: jax.Array  # int32


def inverse(x):
  """1 / x for a positive normaliser, else 1 (a scalar). Vocabulary passes multiply by it:
  a division per column made a single program's pass compute-bound. Kernels and
  references both use it, so their arithmetic stays the same."""
  return 1.0 / jnp.where(x > 0.0, x, 1.0)


def as_prob(x):
  """An entry that is not a probability in [0, 1] (NaN, +-inf, < 0, > 1) counts as 0."""
  return jnp.where((x >= 0.0) & (x <= 1.0), x, 0.0)


def check_tree_shapes(node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
                      vocab_size, active, max_depth, draft_probs_ok):
  """Raises ValueError unless the arguments have the shapes of the tree layout (module
  docstring): the one shape check of both samplers, their references included."""
  batch, num_nodes = node_tokens.shape
  if parents.shape != (batch, num_nodes):
    raise ValueError(f"parents {parents.shape} vs node_tokens {node_tokens.shape}")
  if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, num_nodes):
    raise ValueError(f"target_probs {target_probs.shape} vs node_tokens {node_tokens.shape}")
  if not 0 < vocab_size <= target_probs.shape[-1]:
    raise ValueError(f"vocab_size {vocab_size} vs V {target_probs.shape[-1]}")
  if uniforms.shape != (batch, num_nodes + 1):
    raise ValueError(f"uniforms {uniforms.shape}, expected {(batch, num_nodes + 1)}")
  if greedy.shape != (batch,) or (active is not None and jnp.shape(active) != (batch,)):
    raise ValueError("greedy and active must be [B]")
  if max_depth < 0:
    raise ValueError(f"max_depth {max_depth} < 0")
  if draft_probs is not None:
    if draft_probs.ndim != 3 or draft_probs.shape[0] != batch or (
        draft_probs.shape[2] != target_probs.shape[2]):
      raise ValueError(f"draft_probs {draft_probs.shape} vs target_probs {target_probs.shape}")
    if q_row is None or q_row.shape != (batch, num_nodes):
      raise ValueError(f"q_row must be [B, N+1] with draft_probs, got "
                       f"{None if q_row is None else q_row.shape}")
    if draft_probs_ok is not None and draft_probs_ok.shape != draft_probs.shape[:2]:
      raise ValueError(f"draft_probs_ok {draft_probs_ok.shape} vs draft_probs "
                       f"{draft_probs.shape}")
