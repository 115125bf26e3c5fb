"""A draft tree's verify sampler, one entry point for every method (``EngineConfig.tree_verify``).

* ``"traversal"``: Traversal Verification with the draft's real q (``traversal_sampler.py``);
* ``"recursive_rejection"``: recursive rejection sampling with the draft's real q
  (``tree_sampler.py``);
* ``"target_only"``: SGLang's target-only rule, q' one-hot on each candidate
  (``tree_sampler.py``, ``target_only=True``).

All three are exact and take greedy rows down the target's argmax path; they share the
tree layout, the guards and the output (``tree_common.py``).
"""

from __future__ import annotations

from eagle_jax.kernels.traversal_sampler import traversal_sample
from eagle_jax.kernels.tree_common import TreeSamplerOutput
from eagle_jax.kernels.tree_sampler import tree_speculative_sample

METHODS = ("traversal", "recursive_rejection", "target_only")


def verify_tree(
    node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
    vocab_size: int, active=None, *, method: str, max_depth: int, draft_probs_ok=None,
    max_children: int | None = None, interpret: bool | None = None,
    target: str | None = None, block_v: int | None = None,
    num_warps: int | None = None) -> TreeSamplerOutput:
  """Verify a draft tree per row by ``method`` (one of ``METHODS``, module docstring).

  Arguments and result as :func:`tree_sampler.tree_speculative_sample`;
  ``max_children`` (the draft tree's K) is Traversal Verification's sibling slots
  (:func:`traversal_sampler.traversal_sample`), unused by the other methods.
  """
  args = (node_tokens, parents, draft_probs, q_row, target_probs, greedy, uniforms,
          vocab_size, active)
  kwargs = dict(max_depth=max_depth, draft_probs_ok=draft_probs_ok, interpret=interpret,
                target=target, block_v=block_v, num_warps=num_warps)
  if method == "traversal":
    return traversal_sample(*args, max_children=max_children, **kwargs)
  if method in ("recursive_rejection", "target_only"):
    return tree_speculative_sample(*args, target_only=method == "target_only", **kwargs)
  raise ValueError(f"tree verify method must be one of {METHODS}, got {method!r}")
