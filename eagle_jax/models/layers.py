"""Transformer building blocks shared by the target decoder and the EAGLE drafts.

Weights keep the Hugging Face layout (``[out_features, in_features]`` for projections,
``[V, H]`` for embeddings), so a checkpoint tensor maps onto a parameter without a
transpose and the module tree reads like the checkpoint's names.

Attention works on a static KV cache: every call writes the new tokens' keys and values
at their absolute positions and attends over the whole pre-sized cache with the mask
``key_position <= query_position``. Prefill, single-token decode and the multi-token
verify forward are therefore the same code; entries past a request's length are stale
but always masked, and the next write overwrites them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.config import RopeScaling

Array = jax.Array


def _normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class Linear(nnx.Module):
    """y = x @ W.T (+ b), W: [out, in] (the Hugging Face layout)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (out_features, in_features), dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: Array) -> Array:
        """x: [..., in] -> [..., out] in x's dtype."""
        w = self.weight[...]
        y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embedding, weight: [V, H]."""

    def __init__(self, vocab_size: int, features: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (vocab_size, features), dtype)

    def __call__(self, tokens: Array) -> Array:
        """tokens: [...] int -> [..., H]. Out-of-range ids are clamped, never read past."""
        w = self.weight[...]
        return jnp.take(w, jnp.clip(tokens, 0, w.shape[0] - 1), axis=0)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Llama RMSNorm: statistics in float32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, features: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((features,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jnp.ndarray:
    """Inverse rotary frequencies [D/2], with Llama 3.1's frequency-dependent scaling."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_mid, mid, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotary embedding in the rotate-half convention of Hugging Face Llama.

    x: [B, T, heads, D]; positions: [B, T] -> [B, T, heads, D].
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class KVCache(NamedTuple):
    """Static KV cache of a stack of layers. k, v: [L, B, max_len, K, D].

    Layers write into the stacked arrays in place (``.at[layer, ...]``), so a donated
    cache is updated without copies.
    """

    k: Array
    v: Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
              head_dim: int, dtype) -> "KVCache":
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def write_kv(cache: KVCache, layer: int, k: Array, v: Array, positions: Array,
             slots: Array | None = None) -> KVCache:
    """Writes k, v [B, T, K, D] of ``layer`` at positions [B, T].

    Batch row b goes to cache row ``slots[b]`` (default: row b, so a cache with more
    rows than the batch serves the batch from its first rows). Positions >= max_len
    (padding) are dropped.
    """
    rows = jnp.arange(k.shape[0]) if slots is None else slots
    b = jnp.broadcast_to(rows[:, None], positions.shape)
    kc = cache.k.at[layer, b, positions].set(k.astype(cache.k.dtype), mode="drop")
    vc = cache.v.at[layer, b, positions].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(kc, vc)


def cached_attention(q: Array, cache: KVCache, layer: int, positions: Array,
                     slots: Array | None = None) -> Array:
    """Causal attention of new queries over one layer of the whole static cache.

    q: [B, T, N, D]; cache k/v: [L, B_cache, S, K, D] with B_cache >= B; positions:
    [B, T] absolute query positions; slots: [B] cache rows (default: the first B).
    A key at position j is visible to a query at position p iff j <= p.
    Returns [B, T, N, D] in q's dtype.
    """
    bsz, t, n, d = q.shape
    if slots is None:
        keys, values = cache.k[layer, :bsz], cache.v[layer, :bsz]
    else:
        keys, values = cache.k[layer][slots], cache.v[layer][slots]
    kv_heads = keys.shape[2]
    qg = q.reshape(bsz, t, kv_heads, n // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    key_pos = jnp.arange(keys.shape[1])
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(bsz, t, n, d).astype(q.dtype)


class Attention(nnx.Module):
    """Multi-head attention with GQA, optional q/k/v bias (Qwen2) and q/k norm (Qwen3).

    ``in_features`` differs from the output width for EAGLE-3's first draft layer, whose
    input is concat(norm(embeds), norm(hidden)) of width 2H.
    """

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, *, bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(in_features, num_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(in_features, num_kv_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(in_features, num_kv_heads * head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None

    def __call__(self, x: Array, positions: Array, cache: KVCache, layer: int,
                 inv_freq: Array, slots: Array | None = None) -> tuple[Array, KVCache]:
        """x: [B, T, in]; positions: [B, T]; slots: [B] cache rows or None (rows 0..B-1).

        Returns ([B, T, hidden], updated cache).
        """
        bsz, t, _ = x.shape
        q, k, v = self.qkv(x, positions, inv_freq)
        cache = write_kv(cache, layer, k, v, positions, slots)
        out = cached_attention(q, cache, layer, positions, slots)
        return self.o_proj(out.reshape(bsz, t, -1)), cache

    def qkv(self, x: Array, positions: Array, inv_freq: Array) -> tuple[Array, Array, Array]:
        """x: [B, T, in] -> q [B, T, N, D], k and v [B, T, K, D]: projected, q/k-normed
        (Qwen3) and rotated at ``positions`` [B, T]."""
        bsz, t, _ = x.shape
        q = self.q_proj(x).reshape(bsz, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(bsz, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(bsz, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden_size, intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden_size, intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
