"""EAGLE-1 and EAGLE-3 draft models (Flax NNX).

A draft is its own small model class. It never imports or calls the target's code
(``decoder.py``): it borrows two *arrays* from the target at load time (the token
embedding and, for EAGLE-1, the LM head; the same ``jax.Array`` objects, no copy) and
builds everything else from ``layers.py``. There is no "draft mode" flag anywhere that a
batch could get wrong (seed 003).

Shapes: B = batch, T = positions per request, H = draft hidden size, Ht = the target's
hidden size, F = feature width (EAGLE-1: Ht, EAGLE-3: len(feature_layers) * Ht),
V = target vocabulary, Vd = draft vocabulary.

EAGLE-1 (Li et al. 2024; checkpoints ``yuhuili/EAGLE-*``, sglang ``llama_eagle``)::

    x   = fc(concat(embed(token), feature))               fc: 2H -> H, with bias
    x   = Llama layers (layer 0 without input_layernorm)  ``layers.{i}.*``
    out = x                                               no final norm
    logits = target_lm_head(out)                          the TARGET's head, all V

EAGLE-3 (Li et al. 2025; ``LlamaForCausalLMEagle3``, sglang ``llama_eagle3``)::

    h   = fc(concat(aux features))                       fc: 3Ht -> H, no bias  (project)
    x   = concat(input_layernorm(embed(token)), hidden_norm(h))          2H (rmsnorm_concat)
    h   = h + o_proj(attention(x))                       q/k/v_proj: 2H -> heads
    h   = h + mlp(post_attention_layernorm(h))           carry = h (before the final norm)
    logits = lm_head(norm(h))                            Vd rows; target id = d + d2t[d]

With ``norm_before_residual`` the residual is hidden_norm(h) instead of h (the
"speculators" convention).

Positions/tokens (as sglang): the draft row at position j takes (token x_{j+1}, feature
of the target at position j) and predicts x_{j+2}. The step's ``hidden_out`` is fed back
as ``hidden`` of the next draft step (EAGLE-1: the last layer's output; EAGLE-3: the
midlayer output before the final norm). Padding rows carry a position >= the cache
length, so their KV writes are dropped (see ``layers.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.kernels.gathered_lm_head import gathered_lm_head
from eagle_jax.kernels.norm_concat import rmsnorm_concat
from eagle_jax.models.draft_config import EAGLE, EAGLE3, DraftConfig
from eagle_jax.models.layers import (
    MLP,
    Attention,
    Embedding,
    AttentionBatch,
    KVCache,
    KVPages,
    Linear,
    RMSNorm,
    TreeLayout,
    rms_norm,
    rope_inv_freq,
)

Array = jax.Array


class Shared(nnx.Variable):
    """A weight borrowed from the target (embedding, LM head): the target's own
    ``jax.Array``, never copied, never trained (not an ``nnx.Param``)."""


class VocabMap(nnx.Variable):
    """EAGLE-3 ``d2t``: int32 [Vd] offsets, target_id = draft_id + d2t[draft_id]."""


# --------------------------------------------------------------------------- kernels


def _rmsnorm_concat(embeds: Array, hidden: Array, w_e: Array, w_h: Array, eps_e: float,
                    eps_h: float, use_kernels: bool) -> Array:
    """[..., H] x2 -> concat(rmsnorm(embeds), rmsnorm(hidden)) [..., 2H] (seed 002).

    With ``use_kernels`` the fused Pallas kernel runs (it falls back to the unfused path
    itself when its guards fail); without, the unfused jnp path (differentiable).
    """
    if not use_kernels:
        return jnp.concatenate([rms_norm(embeds, w_e, eps_e), rms_norm(hidden, w_h, eps_h)], -1)
    lead = embeds.shape[:-1]
    out = rmsnorm_concat(embeds.reshape(-1, embeds.shape[-1]),
                         hidden.reshape(-1, hidden.shape[-1]), w_e, w_h, eps_e, eps_h)
    return out.reshape(*lead, out.shape[-1])


def _gathered_lm_head(hidden: Array, rows: Array, weight: Array, use_kernels: bool) -> Array:
    """hidden [N, H], rows [B] -> logits [B, V] f32 of the selected rows only (seed 000)."""
    if not use_kernels:
        picked = jnp.take(hidden, jnp.clip(rows, 0, hidden.shape[0] - 1), axis=0)
        return jnp.einsum("bh,vh->bv", picked.astype(weight.dtype), weight,
                          preferred_element_type=jnp.float32)
    return gathered_lm_head(hidden.astype(weight.dtype), rows.astype(jnp.int32), weight)


def _flat_rows(hidden_out: Array, rows: Array) -> tuple[Array, Array]:
    """[B, T, H], rows [B] -> ([B*T, H], flat indices b*T + rows[b])."""
    b, t, h = hidden_out.shape
    rows = jnp.clip(rows.astype(jnp.int32), 0, t - 1)
    return hidden_out.reshape(b * t, h), jnp.arange(b, dtype=jnp.int32) * t + rows


# An ``attend`` callback runs one attention module over its input and threads a carry:
#   attend(layer_index, attn: Attention, x [B, T, in]) given carry -> (out [B, T, H], carry)
# Inference threads the KV cache (``_cache_attend``); training threads the per-step keys
# and values of its unrolled forward (``eagle_jax.train.unroll``).
Attend = Callable[[int, Attention, Array, Any], tuple[Array, Any]]


def _cache_attend(positions: Array, inv_freq: Array, batch: AttentionBatch) -> Attend:
    def attend(i, attn, x, cache):
        return attn(x, positions, cache, i, inv_freq, batch)
    return attend


class _DraftBase(nnx.Module):
    """What both drafts share: the uniform API the engine calls."""

    kind: str
    config: DraftConfig

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @property
    def max_positions(self) -> int:
        """The draft's ``max_position_embeddings``: the length it was trained on. The
        context limit is the target's; past this the draft runs on with its RoPE (the
        engine warns)."""
        return self.config.max_position_embeddings

    @property
    def dtype(self):
        """The activations' dtype (the fc layer's, FP8 weights or not)."""
        return self.fc.dtype

    @property
    def inv_freq(self) -> Array:
        c = self.config
        return rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def embed_weight(self) -> Array:
        """[V, H] token embedding: the draft's own, else the target's (shared)."""
        return (self.embed_tokens.weight if self.embed_tokens is not None
                else self.target_embed)[...]

    def embed(self, tokens: Array) -> Array:
        """tokens [...] -> [..., H] in the draft's dtype (ids clamped into the table)."""
        w = self.embed_weight
        return jnp.take(w, jnp.clip(tokens, 0, w.shape[0] - 1), axis=0).astype(self.dtype)

    def init_pages(self, num_pages: int, page_size: int, dtype=None) -> KVPages:
        """The draft's own KV pool (its layers, its heads), zeroed."""
        c = self.config
        return KVPages.zeros(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim,
                             dtype or self.dtype)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """A stand-alone paged cache of ``batch`` rows of ``max_len`` positions each."""
        c = self.config
        return KVCache.contiguous(c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim,
                                  dtype or self.dtype)

    def __call__(self, tokens: Array, hidden: Array, positions: Array,
                 cache: KVCache, tree: TreeLayout | None = None) -> tuple[Array, KVCache]:
        """tokens [B, T] i32, hidden [B, T, H] (already projected), positions [B, T] (each
        row's valid tokens a prefix at consecutive positions; padding past the page
        table's capacity) -> (hidden_out [B, T, H], cache). ``tree``: a draft tree
        level's RoPE positions and mask (``positions`` are then its scratch slots)."""
        batch = cache.attention_batch(positions, None if tree is None else tree.block_mask)
        attend = _cache_attend(positions if tree is None else tree.rope_positions,
                               self.inv_freq, batch)
        return self.forward(tokens, hidden, attend, cache)

    def forward(self, tokens: Array, hidden: Array, attend: Attend, carry: Any):
        raise NotImplementedError

    def lm_head_weight(self) -> Array:
        raise NotImplementedError

    def final_norm(self, hidden_out: Array) -> Array:
        raise NotImplementedError

    def logits(self, hidden_out: Array) -> Array:
        """hidden_out [..., H] -> logits [..., Vd] f32, every row."""
        w = self.lm_head_weight()
        return jnp.einsum("...h,vh->...v", self.final_norm(hidden_out).astype(w.dtype), w,
                          preferred_element_type=jnp.float32)

    def select_logits(self, hidden_out: Array, rows: Array) -> Array:
        """hidden_out [B, T, H], rows [B] i32 -> [B, Vd] f32: ONE row per request.

        Only row ``rows[b]`` of request b goes through the final norm and the LM head
        (the gathered LM head kernel; seed 000): [B, Vd] logits, never [B, T, Vd].
        """
        flat, idx = _flat_rows(hidden_out, rows)
        w = self.lm_head_weight()
        if self.has_final_norm:
            picked = self.final_norm(jnp.take(flat, idx, axis=0))
            return _gathered_lm_head(picked, jnp.arange(idx.shape[0], dtype=jnp.int32), w,
                                     self.use_kernels)
        return _gathered_lm_head(flat, idx, w, self.use_kernels)


# --------------------------------------------------------------------------- EAGLE-1


class Eagle1Layer(nnx.Module):
    """A Llama decoder layer. Layer 0 has no ``input_layernorm``: EAGLE-1's fc output
    enters attention directly (EAGLE ``cnets.py``; the published checkpoints lack
    ``layers.0.input_layernorm.weight``)."""

    def __init__(self, cfg: DraftConfig, index: int, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = None if index == 0 else RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def attention_input(self, x: Array) -> Array:
        return x if self.input_layernorm is None else self.input_layernorm(x)

    def output(self, x: Array, attn: Array) -> Array:
        """x + attn, then the MLP block with its residual."""
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle1Draft(_DraftBase):
    """EAGLE-1: fc over concat(embedding, target hidden) + Llama layer(s); the target's
    LM head (and, unless the checkpoint has its own, the target's embedding)."""

    kind = EAGLE
    feature_layers = None  # the target's final-norm hidden states
    has_final_norm = False

    def __init__(self, cfg: DraftConfig, *, own_embed: bool, dtype=jnp.float32,
                 rngs: nnx.Rngs, use_kernels: bool = True):
        h = cfg.hidden_size
        self.config = cfg
        self.use_kernels = use_kernels
        self.embed_tokens = (Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
                             if own_embed else None)
        self.fc = Linear(2 * h, h, bias=cfg.fc_bias, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Eagle1Layer(cfg, i, dtype=dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.target_embed = nnx.data(None)  # Shared, set by bind_target
        self.target_lm_head = nnx.data(None)

    def bind_target(self, embed: Array, lm_head: Array, d2t: Array | None = None) -> None:
        """Borrows the target's embedding [V, H] and LM head [V, H] (no copy)."""
        if d2t is not None:
            raise ValueError("EAGLE-1 drafts predict over the target vocabulary: no d2t")
        if self.embed_tokens is None:
            self.target_embed = Shared(embed)
        self.target_lm_head = Shared(lm_head)

    d2t = None

    def project(self, features: Array) -> Array:
        """EAGLE-1 features are the target's hidden states: identity (cast to the dtype)."""
        return features.astype(self.dtype)

    def forward(self, tokens, hidden, attend: Attend, carry):
        """The layer stack with a pluggable attention; see ``Attend``."""
        x = self.fc(jnp.concatenate([self.embed(tokens), hidden.astype(self.dtype)], -1))
        for i, layer in enumerate(self.layers):
            attn, carry = attend(i, layer.self_attn, layer.attention_input(x), carry)
            x = layer.output(x, attn)
        return x, carry

    def lm_head_weight(self) -> Array:
        return self.target_lm_head[...]

    def final_norm(self, hidden_out: Array) -> Array:
        return hidden_out


# --------------------------------------------------------------------------- EAGLE-3


class Eagle3Layer(nnx.Module):
    """EAGLE-3's ``midlayer``: attention over concat(norm(embeds), norm(hidden)) [2H]."""

    def __init__(self, cfg: DraftConfig, *, dtype, rngs: nnx.Rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype=dtype)
        self.self_attn = Attention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def attention_input(self, embeds: Array, hidden: Array,
                        use_kernels: bool) -> tuple[Array, Array]:
        """embeds, hidden [B, T, H] -> (attention input [B, T, 2H], residual [B, T, H])."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            return jnp.concatenate([self.input_layernorm(embeds), hidden], -1), hidden
        x = _rmsnorm_concat(embeds, hidden, self.input_layernorm.weight[...],
                            self.hidden_norm.weight[...], self.input_layernorm.eps,
                            self.hidden_norm.eps, use_kernels)
        return x, hidden

    def output(self, residual: Array, attn: Array) -> Array:
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(_DraftBase):
    """EAGLE-3 (``LlamaForCausalLMEagle3``): fc over the target's aux features, one
    midlayer, final norm, LM head over a reduced vocabulary mapped through ``d2t``."""

    kind = EAGLE3
    has_final_norm = True

    def __init__(self, cfg: DraftConfig, *, own_embed: bool, own_lm_head: bool,
                 dtype=jnp.float32, rngs: nnx.Rngs, use_kernels: bool = True):
        h = cfg.hidden_size
        self.config = cfg
        self.use_kernels = use_kernels
        self.embed_tokens = (Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
                             if own_embed else None)
        self.fc = Linear(cfg.feature_size, h, bias=cfg.fc_bias, dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Layer(cfg, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (Linear(h, cfg.draft_vocab_size, dtype=dtype, rngs=rngs)
                        if own_lm_head else None)
        self.target_embed = nnx.data(None)  # Shared, set by bind_target
        self.target_lm_head = nnx.data(None)
        self.d2t_map = nnx.data(None)  # VocabMap

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def d2t(self) -> Array | None:
        return None if self.d2t_map is None else self.d2t_map[...]

    def bind_target(self, embed: Array, lm_head: Array | None, d2t: Array | None) -> None:
        """Borrows the target's embedding / LM head where the draft has none (no copy),
        and sets ``d2t`` (int32 [Vd]; None when Vd == V and the map is the identity)."""
        if self.embed_tokens is None:
            self.target_embed = Shared(embed)
        if self.lm_head is None and not self.config.tie_word_embeddings:
            if lm_head is None or lm_head.shape[0] != self.draft_vocab_size:
                raise ValueError("EAGLE-3 draft without lm_head needs the target's LM head "
                                 "and draft_vocab_size == the target vocabulary")
            self.target_lm_head = Shared(lm_head)
        self.d2t_map = None if d2t is None else VocabMap(jnp.asarray(d2t, jnp.int32))

    def project(self, features: Array) -> Array:
        """Target aux features [..., len(feature_layers) * Ht] -> [..., H] (fc)."""
        return self.fc(features.astype(self.dtype))

    def forward(self, tokens, hidden, attend: Attend, carry):
        """The midlayer with a pluggable attention; see ``Attend``."""
        x, residual = self.midlayer.attention_input(self.embed(tokens), hidden.astype(self.dtype),
                                                    self.use_kernels)
        attn, carry = attend(0, self.midlayer.self_attn, x, carry)
        return self.midlayer.output(residual, attn), carry

    def lm_head_weight(self) -> Array:
        if self.lm_head is not None:
            return self.lm_head.weight[...]
        if self.config.tie_word_embeddings:
            return self.embed_weight
        return self.target_lm_head[...]

    def final_norm(self, hidden_out: Array) -> Array:
        return self.norm(hidden_out)


Draft = Eagle1Draft | Eagle3Draft


def new_draft(cfg: DraftConfig, *, target_embed: Array, target_lm_head: Array,
              d2t: Array | None = None, dtype=jnp.float32, seed: int = 0, init_std: float = 0.02,
              use_kernels: bool = True, own_lm_head: bool = True) -> Draft:
    """A randomly initialised draft bound to the target's arrays (for training).

    Projections ~ N(0, init_std) (biases 0, norms 1), drawn with numpy (no per-shape
    compilations). EAGLE-3 gets its own reduced-vocabulary LM head, initialised from the
    target's rows of the draft vocabulary when the hidden sizes agree (a good starting
    point), unless ``own_lm_head=False``: then it borrows the target's head (frozen, the
    whole vocabulary, so ``cfg.draft_vocab_size`` must be the target's and ``d2t`` None).
    The embedding is always the target's (frozen, as in the published recipes).
    """
    import numpy as np

    if cfg.kind == EAGLE:
        draft = nnx.eval_shape(lambda: Eagle1Draft(
            cfg, own_embed=False, dtype=dtype, rngs=nnx.Rngs(0), use_kernels=use_kernels))
    else:
        draft = nnx.eval_shape(lambda: Eagle3Draft(
            cfg, own_embed=False, own_lm_head=own_lm_head, dtype=dtype, rngs=nnx.Rngs(0),
            use_kernels=use_kernels))
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(draft):
        if not isinstance(var, nnx.Param):
            continue
        name = ".".join(str(p) for p in path)
        if "norm" in name:
            value = np.ones(var.shape, np.float32)
        elif name.endswith("bias"):
            value = np.zeros(var.shape, np.float32)
        else:
            value = rng.standard_normal(var.shape, np.float32) * init_std
        var.set_value(jnp.asarray(value, dtype))
    if cfg.kind == EAGLE:
        draft.bind_target(target_embed, target_lm_head)
        return draft
    if not own_lm_head:
        if d2t is not None:
            raise ValueError("a draft that borrows the target's LM head predicts over the "
                             "whole target vocabulary: no d2t")
        draft.bind_target(target_embed, target_lm_head, None)
        return draft
    if target_lm_head.shape[1] == cfg.hidden_size:
        ids = np.arange(cfg.draft_vocab_size) + (0 if d2t is None else np.asarray(d2t))
        rows = np.asarray(jax.device_get(target_lm_head))[ids]
        draft.lm_head.weight.set_value(jnp.asarray(rows, dtype))
    draft.bind_target(target_embed, None, d2t)
    return draft
