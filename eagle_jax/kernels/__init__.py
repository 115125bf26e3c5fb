"""Pallas (Triton path) kernels of EAGLE speculative decoding, each with its reference.

One module per kernel, imported from that module (``from eagle_jax.kernels.norm_concat
import rmsnorm_concat``):

* ``filters``: logits -> sampling probabilities (temperature, top-k, top-p, min-p), draws;
* ``draft_proposal``: one draft token per row and the q it was drawn from;
* ``spec_sampler``: the verify sampler (rejection sampling);
* ``traversal_sampler``, ``tree_sampler``: a draft tree's verify samplers (Traversal
  Verification; recursive rejection sampling, the target-only rule and greedy rows),
  ``tree_common`` what they share, ``tree_verify`` their one entry point (``verify_tree``);
* ``tree_mask``: a draft tree's ancestor mask;
* ``gathered_lm_head``: the LM head over selected rows only;
* ``norm_concat``: EAGLE-3's fused dual RMSNorm + concat;
* ``paged_attention``: ragged paged attention of query blocks over the paged KV pool.

The package re-exports nothing: a function named like its module (``gathered_lm_head``)
would hide the module, and the comparison tool finds each kernel's ``_*_pallas`` entry
point on its module.
"""
