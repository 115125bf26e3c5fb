"""Transformer building blocks shared by the target decoder and the EAGLE drafts.

Weights keep the Hugging Face layout (``[out_features, in_features]`` for projections,
``[V, H]`` for embeddings), so a checkpoint tensor maps onto a parameter without a
transpose and the module tree reads like the checkpoint's names.

Attention works on a paged KV pool (``KVCache``): every cached call writes the new
tokens' keys and values at their positions' pool rows (through the row's page table)
and attends with the paged attention kernel over the row's live pages only. Prefill
chunks, single-token decode and the multi-token verify forward are the same code; a
padding token carries a position past the page table's capacity, so its write is
dropped. Without a cache (training, scoring) a block attends causally to itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax import parallel
from eagle_jax.checkpoint import fused_row_order
from eagle_jax.config import RopeScaling
from eagle_jax.fp8 import Fp8Spec, device_scale, device_weight, fp8_linear, quantize_weight
from eagle_jax.kernels.paged_attention import paged_attention

Array = jax.Array


def _normal(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def _fp8_params(module: nnx.Module, out_features: int, in_features: int,
                quant: Fp8Spec, meta: dict, num_parts: int = 1) -> None:
    """An FP8 layer's parameters (``eagle_jax.fp8``): ``weight`` [out, in] in the spec's
    e4m3, ``weight_scale`` [out] float32 (laid out, sharded and split like the weight's
    rows: ``meta``) and, for static activations, ``input_scale`` [parts] float32 (one per
    checkpoint tensor; the largest is used). Loaders fill them (``checkpoint``)."""
    parts = meta.get("checkpoint_parts")
    keep = dict(checkpoint_keeps_dtype=True)
    module.weight = nnx.Param(jnp.zeros((out_features, in_features), quant.np_dtype),
                              **meta, **keep)
    module.weight_scale = nnx.Param(jnp.ones((out_features,), jnp.float32), **meta, **keep)
    scale_meta = {} if parts is None else dict(checkpoint_parts=tuple((n, 1) for n, _ in parts))
    module.input_scale = (nnx.Param(jnp.ones((num_parts,), jnp.float32), **scale_meta, **keep)
                          if quant.static else None)


def module_quant(quant: Fp8Spec | None, prefix: str,
                 names: tuple[str, ...]) -> Fp8Spec | None:
    """``quant`` for the projection made of the Hugging Face modules ``prefix + name``
    (one fused GEMM: all or none quantized), None where the spec ignores them. Raises
    ValueError when the spec quantizes some of a fused projection's parts only."""
    if quant is None:
        return None
    chosen = {quant.quantizes(prefix + name) for name in names}
    if len(chosen) > 1:
        raise ValueError(f"the quantization config quantizes some of {prefix}{{"
                         f"{', '.join(names)}}} only; eagle_jax runs them as one GEMM: "
                         "quantize all of them or none")
    return quant if chosen.pop() else None


def _project(module: nnx.Module, x: Array) -> Array:
    """x [..., in] @ weight.T (+ bias) -> [..., out] in the layer's dtype: XLA's FP8 dot
    for a quantized layer, else a plain matmul in the weight's dtype."""
    if module.quant is None:
        w = module.weight[...]
        y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)
    else:
        input_scale = None if module.input_scale is None else jnp.max(module.input_scale[...])
        y = fp8_linear(x, module.weight[...], module.weight_scale[...], input_scale,
                       module.quant.activation_scale_ub, out_dtype=module.dtype)
    if module.bias is not None:
        y = y + module.bias[...]
    return y


class Linear(nnx.Module):
    """y = x @ W.T (+ b), W: [out, in] (the Hugging Face layout).

    ``quant`` (``eagle_jax.fp8.Fp8Spec``): W in FP8 with per-row scales, x quantized per
    token (or by the checkpoint's static scale), the product XLA's FP8 dot; the output
    and the bias stay in ``dtype``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype=jnp.float32, quant: Fp8Spec | None = None, rngs: nnx.Rngs):
        self.dtype = dtype
        self.quant = quant
        if quant is None:
            self.weight = _normal(rngs, (out_features, in_features), dtype)
        else:
            _fp8_params(self, out_features, in_features, quant, {})
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: Array) -> Array:
        """x: [..., in] -> [..., out] in the layer's dtype."""
        return _project(self, x)


class FusedLinear(nnx.Module):
    """Several projections of one input as one GEMM: x @ concat(W_1 .. W_n).T, split back.

    ``parts`` = ((checkpoint module name, rows), ...). The weight [sum rows, in] (and
    bias) carry them as ``checkpoint_parts`` metadata: the checkpoint reader concatenates
    the separate Hugging Face tensors on load, the writer splits them on save
    (``eagle_jax.checkpoint``), so checkpoints keep their names.

    Tensor parallelism (``shards`` > 1): the rows are ordered shard by shard, block s =
    [part 0's slice s; part 1's slice s; ...] (``checkpoint.fused_row_order``), so that
    the weight split evenly on its row axis over ``shards`` devices gives each device
    exactly its slice of every part (its q, k and v heads) and the split below stays
    local. ``replicas[i]`` > 1 stores part i that many times over (a kv head shared by
    several devices), giving it ``rows * replicas[i]`` rows. shards = 1 is the plain
    concatenation. The checkpoint keeps the per-part tensors either way.

    ``quant``: FP8 as ``Linear``'s; the weight scales are rows like the weight's (same
    layout, same shards), so the parts stay one FP8 GEMM.
    """

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], *,
                 shards: int = 1, replicas: tuple[int, ...] | None = None,
                 bias: bool = False, dtype=jnp.float32, quant: Fp8Spec | None = None,
                 rngs: nnx.Rngs):
        rows = tuple(n for _, n in parts)
        replicas = tuple(replicas or (1,) * len(parts))
        self.sizes = tuple(n * r for n, r in zip(rows, replicas))
        for (name, n), r in zip(parts, replicas):
            if shards % r or n % (shards // r):
                raise ValueError(
                    f"{name}: {n} rows stored {r} time(s) cannot be split over {shards} "
                    f"shards; use a shard count that divides the rows")
        self.shards = shards
        self.dtype = dtype
        self.quant = quant
        meta = dict(checkpoint_parts=parts, checkpoint_shards=shards,
                    checkpoint_replicas=replicas)
        if quant is None:
            # Drawn in the checkpoint's layout and then reordered: the same seed gives the
            # same model at every shard count.
            order = None if shards == 1 else fused_row_order(rows, shards, replicas)
            w = _normal(rngs, (sum(rows), in_features), dtype)[...]
            self.weight = nnx.Param(w if order is None else w[order], **meta)
        else:
            _fp8_params(self, sum(self.sizes), in_features, quant, meta, len(parts))
        self.bias = (nnx.Param(jnp.zeros((sum(self.sizes),), dtype), **meta)
                     if bias else None)

    def __call__(self, x: Array) -> tuple[Array, ...]:
        """x: [..., in] -> one [..., rows_i] per part, in the layer's dtype."""
        y = _project(self, x)
        per_shard = [n // self.shards for n in self.sizes]
        bounds = [sum(per_shard[:i + 1]) for i in range(len(per_shard) - 1)]
        y = y.reshape(*y.shape[:-1], self.shards, sum(per_shard))  # [..., shards, block]
        return tuple(p.reshape(*p.shape[:-2], -1) for p in jnp.split(y, bounds, axis=-1))


def quantize_linears(module: nnx.Module, quant: Fp8Spec,
                     skip: tuple[str, ...] = ("lm_head",)) -> nnx.Module:
    """Every float ``Linear`` / ``FusedLinear`` of a loaded ``module`` (in place; returns
    it) made FP8 on the fly: per-row weight scales (``fp8.quantize_weight``, in the
    spec's format), per-token activations; the modules named in ``skip`` (the LM head,
    which the drafts read whole) stay as they are. The new parameters go where the
    weight was, which must be whole on each of its devices (a draft: replicated)."""
    chosen = [m for path, m in nnx.iter_graph(module)
              if isinstance(m, (Linear, FusedLinear)) and m.quant is None
              and not (path and str(path[-1]) in skip)]
    for m in chosen:
        w = m.weight[...]
        if not w.sharding.is_fully_replicated:
            raise ValueError("quantize_linears needs whole weights on each device; a "
                             "tensor-parallel model quantizes while loading "
                             "(load_decoder(quantization='fp8'))")
        q, scale = quantize_weight(jax.device_get(w))
        meta = {k: v for k, v in m.weight.get_metadata().items() if k.startswith("checkpoint_")}
        meta["checkpoint_keeps_dtype"] = True
        m.weight = nnx.Param(jax.device_put(device_weight(q, quant.dtype), w.sharding), **meta)
        m.weight_scale = nnx.Param(jax.device_put(device_scale(scale, quant.dtype), w.sharding),
                                   **meta)
        m.input_scale = None
        m.quant = quant
    return module


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


class KVPages(NamedTuple):
    """One model's paged KV pool: per layer, k and v of shape [num_pages, page_size, K, D].

    One array per layer (not one stacked [L, ...] array): a layer's pool is passed to the
    attention kernel whole, never sliced (no copy), and the decoder's layers stay
    unrolled, which decodes 2.7x faster on an H100 than a ``lax.scan`` over stacked
    layers and pool (docs/history/2026-12-08-issue-60-layer-scan-measured.md). The
    engine sizes each layer's pool within ``paged_attention.max_pool_pages``.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype) -> "KVPages":
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, k: Array, v: Array, slots: Array) -> "KVPages":
        """k, v [B, T, K, D] of ``layer`` into pool rows ``slots`` [B, T] (row r is position
        r % page_size of page r // page_size); a slot past the pool (padding) is dropped.

        The scatter indexes (page, offset) of the 4-D pool rather than a flattened view:
        XLA updates the donated pool in place either way on a GPU, but on a CPU the
        reshaped form copies the whole pool at every write.
        """
        pages, offsets = slots // self.page_size, slots % self.page_size

        def put(pool, new):
            if pool.dtype.itemsize == 1:  # an FP8 pool: saturate (e4m3fn has no inf)
                top = float(jnp.finfo(pool.dtype).max)
                new = jnp.clip(new.astype(jnp.float32), -top, top)
            return pool.at[pages, offsets].set(new.astype(pool.dtype), mode="drop")

        replace = lambda pools, new: pools[:layer] + (put(pools[layer], new),) + pools[layer + 1:]
        return KVPages(replace(self.k, k), replace(self.v, v))

    def move(self, src: Array, dst: Array) -> "KVPages":
        """Copies every layer's pool rows ``src`` [B, T] to rows ``dst`` [B, T] (a draft
        tree's accepted path to consecutive positions). All rows are read before any is
        written, so a destination may be another pair's source; a ``dst`` past the pool
        (padding) is dropped."""
        ps = self.page_size
        src = jnp.clip(src, 0, self.num_pages * ps - 1)

        def moved(pool):
            return pool.at[dst // ps, dst % ps].set(pool[src // ps, src % ps], mode="drop")

        return KVPages(tuple(moved(x) for x in self.k), tuple(moved(x) for x in self.v))

    def copy_pages(self, src: Array, dst: Array) -> "KVPages":
        """Copies every layer's pages ``src`` [N] to pages ``dst`` [N] (a prefix hit's
        boundary page into the request's own); a ``dst`` past the pool is dropped."""
        src = jnp.clip(src, 0, self.num_pages - 1)

        def copied(pool):
            return pool.at[dst].set(pool[src], mode="drop")

        return KVPages(tuple(copied(x) for x in self.k), tuple(copied(x) for x in self.v))


class AttentionBatch(NamedTuple):
    """Where a forward's tokens go in the pool, computed once per forward (all layers).

    Row b's valid tokens are a prefix of its T tokens at consecutive positions ending
    the sequence (decode: 1 token, verify: S + 1, a prefill chunk, a draft window), the
    layout the paged attention kernel takes: query t sits at kv_len - q_len + t.

    ``block_mask`` (a draft tree) replaces causality over the last M keys: query t sees
    key kv_len - q_len - (M - T) + u iff block_mask[b, t, u] (``paged_attention``).

    ``tail_rows`` / ``tail_blocks`` (static): the last R of the B rows are L prompt
    chunks of R / L rows of T each (a decode step carrying the chunks of L requests),
    each chunk attended as ONE query block of R T / L queries: then ``kv_len`` /
    ``q_len`` have B - R + L entries (the head rows', then the chunks') and
    ``block_mask`` covers the B - R head rows. Rows of T attended apart would each read
    their chunk's whole prefix from the pool, R / L times its bytes.
    """

    slots: Array  # [B, T] i32 pool row of each token; num_pages * page_size = padding
    kv_len: Array  # [B - R + L | B] i32 live keys, the new tokens included
    q_len: Array  # [B - R + L | B] i32 valid tokens
    block_mask: Array | None = None  # [B - R, T, M >= T] bool, or None = causal
    tail_rows: int = 0  # R, a Python int
    tail_blocks: int = 0  # L, a Python int dividing R (>= 1 when R > 0)


class TreeLayout(NamedTuple):
    """How a forward over draft-tree nodes departs from a plain window: the nodes sit
    in consecutive pool positions (the ``positions`` the forward is given) but rotate at
    their depth in the tree, and each attends to its ancestors only."""

    rope_positions: Array  # [B, T] i32 seq_len + depth
    block_mask: Array  # [B, T, M >= T] bool (``AttentionBatch.block_mask``)


class KVCache(NamedTuple):
    """What a cached forward reads and writes: a pool and each batch row's page table.

    Position j of row b lives at pool row ``page_table[b, j // page_size] * page_size +
    j % page_size``. A position >= ``capacity`` (max_pages * page_size) marks padding:
    its KV write is dropped and it attends to nothing that counts.
    """

    pages: KVPages
    page_table: Array  # [B, max_pages] i32

    @classmethod
    def contiguous(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
                   head_dim: int, dtype, page_size: int = 16) -> "KVCache":
        """A zeroed pool where row b owns pages b * n .. b * n + n - 1 (n pages of
        ``max_len``): a stand-alone cache for one forward (tests, scoring)."""
        n = -(-max_len // page_size)
        pages = KVPages.zeros(num_layers, batch * n, page_size, num_kv_heads, head_dim, dtype)
        return cls(pages, jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n))

    @property
    def capacity(self) -> int:
        """Positions one row's page table can address."""
        return self.page_table.shape[1] * self.pages.page_size

    def slots(self, positions: Array) -> Array:
        """positions [B, T] -> pool rows [B, T] i32; padding (>= capacity) -> the row
        just past the pool, whose writes are dropped."""
        ps = self.pages.page_size
        valid = (positions >= 0) & (positions < self.capacity)
        pos = jnp.where(valid, positions, 0)
        page = jnp.take_along_axis(self.page_table, pos // ps, axis=1)
        return jnp.where(valid, page * ps + pos % ps, self.pages.num_pages * ps)

    def attention_batch(self, positions: Array, block_mask: Array | None = None,
                        tail_rows: int = 0, tail_blocks: int = 1) -> AttentionBatch:
        """positions [B, T] (padding >= capacity) -> the pool rows and lengths;
        ``block_mask`` [B - tail_rows, T, M] (a draft tree's) travels with them;
        ``tail_rows``: the last rows are ``tail_blocks`` chunks (``AttentionBatch``)."""
        def lengths(positions):
            valid = (positions >= 0) & (positions < self.capacity)
            pos = jnp.where(valid, positions, 0)
            q_len = jnp.sum(valid, axis=1).astype(jnp.int32)
            kv_len = jnp.where(q_len > 0, jnp.max(jnp.where(valid, pos, -1), axis=1) + 1, 0)
            return kv_len.astype(jnp.int32), q_len

        head = positions.shape[0] - tail_rows
        kv_len, q_len = lengths(positions[:head])
        if tail_rows:
            if tail_blocks < 1 or tail_rows % tail_blocks:
                raise ValueError(f"{tail_rows} tail rows do not split into {tail_blocks} "
                                 "chunks of equal rows")
            tail_kv, tail_q = lengths(positions[head:].reshape(tail_blocks, -1))
            kv_len, q_len = (jnp.concatenate([kv_len, tail_kv]),
                             jnp.concatenate([q_len, tail_q]))
        return AttentionBatch(self.slots(positions).astype(jnp.int32), kv_len, q_len,
                              block_mask, tail_rows, tail_blocks if tail_rows else 0)


def causal_attention(q: Array, k: Array, v: Array) -> Array:
    """Causal self-attention of a block with no cache (training, scoring).

    q [B, T, N, D]; k, v [B, T, K, D] (GQA, N % K == 0); row t sees rows <= t.
    Returns [B, T, N, D] in q's dtype. Differentiable (the paged kernel is not).
    """
    bsz, t, n, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(bsz, t, kv_heads, n // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(d))
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(bsz, t, n, d).astype(q.dtype)


class Attention(nnx.Module):
    """Multi-head attention with GQA, optional q/k/v bias (Qwen2) and q/k norm (Qwen3).

    ``in_features`` differs from the output width for EAGLE-3's first draft layer, whose
    input is concat(norm(embeds), norm(hidden)) of width 2H. q, k and v are one GEMM
    (``qkv_proj``; the checkpoint keeps ``q_proj`` / ``k_proj`` / ``v_proj``).

    ``quant``: FP8 projections (``Linear``), those of the Hugging Face modules under
    ``prefix`` that the spec does not ignore.

    ``mesh`` (tensor parallelism, ``eagle_jax.parallel``): ``qkv_proj`` is laid out shard
    by shard over the mesh's "tp" devices, kv heads replicated when the devices outnumber
    them (``num_kv_heads`` is then the pool's count, tp, not the checkpoint's), and the
    paged attention kernel runs per device under ``shard_map`` on its own heads. The mesh
    is a static attribute of the module, not an argument: every caller of the model (the
    engine's jitted steps, tests, scoring) gets the sharded kernel without threading it.
    Everything outside the kernel is global code that XLA partitions from the parameters'
    shardings.
    """

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, *, bias: bool = False, qk_norm: bool = False,
                 norm_eps: float = 1e-6, dtype=jnp.float32, mesh=None,
                 quant: Fp8Spec | None = None, prefix: str = "", rngs: nnx.Rngs):
        tp = parallel.tensor_parallel_size(mesh)
        parallel.check_heads(num_heads, num_kv_heads, tp)
        kv_rep = parallel.kv_replicas(num_kv_heads, tp)
        self.mesh = mesh
        self.num_heads, self.num_kv_heads, self.head_dim = (
            num_heads, num_kv_heads * kv_rep, head_dim)
        self.qkv_proj = FusedLinear(
            in_features, (("q_proj", num_heads * head_dim), ("k_proj", num_kv_heads * head_dim),
                          ("v_proj", num_kv_heads * head_dim)),
            shards=tp, replicas=(1, kv_rep, kv_rep), bias=bias, dtype=dtype,
            quant=module_quant(quant, prefix, ("q_proj", "k_proj", "v_proj")), rngs=rngs)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, dtype=dtype,
                             quant=module_quant(quant, prefix, ("o_proj",)), rngs=rngs)
        self.q_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, dtype=dtype) if qk_norm else None

    def __call__(self, x: Array, positions: Array, cache: KVCache | None, layer: int,
                 inv_freq: Array, batch: AttentionBatch | None = None
                 ) -> tuple[Array, KVCache | None]:
        """x: [B, T, in]; positions: [B, T] the RoPE positions.

        With a cache, the new keys and values go into the pool (``batch``: where, from
        ``cache.attention_batch(cache positions)``; a draft tree's nodes sit in
        consecutive pool positions but rotate at their depth) and the queries attend over
        each row's pages through the paged attention kernel. Without one (training, scoring), the
        block attends causally to itself. Returns ([B, T, hidden], the updated cache).
        """
        bsz, t, _ = x.shape
        q, k, v = self.qkv(x, positions, inv_freq)
        if cache is None:
            out = causal_attention(q, k, v)
        else:
            pages = cache.pages.write(layer, k, v, batch.slots)
            cache = cache._replace(pages=pages)
            out = self.paged(q, pages.k[layer], pages.v[layer], cache.page_table, batch)
        return self.o_proj(out.reshape(bsz, t, -1)), cache

    def paged(self, q: Array, k_pages: Array, v_pages: Array, page_table: Array,
              batch: AttentionBatch) -> Array:
        """q [B, T, N, D] over one layer's pool [P, page_size, K, D] -> [B, T, N, D].

        With a mesh, each device runs the kernel on its N / tp query heads and the kv
        heads they use (its K / tp pool heads); page table, lengths and block mask are
        replicated. The head order of q and of the pool is shard-major by construction
        (``FusedLinear``), so device s's query heads use exactly its kv heads.
        With ``batch.tail_rows`` the head rows and the chunks are two kernel calls (the
        chunks one query block each; the tail's page-table rows repeat per chunk row).
        """
        def attend(q, page_table, kv_len, q_len, block_mask=None):
            def kernel(q, k_pages, v_pages, page_table, kv_len, q_len, block_mask):
                return paged_attention(q, k_pages, v_pages, page_table, kv_len, q_len,
                                       block_mask=block_mask)

            args = (q, k_pages, v_pages, page_table, kv_len, q_len, block_mask)
            if self.mesh is None:
                return kernel(*args)
            heads, rep = parallel.HEADS_SPEC, jax.sharding.PartitionSpec()
            mask_spec = None if block_mask is None else rep
            return parallel.per_shard(
                kernel, self.mesh, in_specs=(heads, parallel.KV_PAGES_SPEC,
                                             parallel.KV_PAGES_SPEC, rep, rep, rep, mask_spec),
                out_specs=heads)(*args)

        if not batch.tail_rows:
            return attend(q, page_table, batch.kv_len, batch.q_len, batch.block_mask)
        rows, t, n, d = q.shape
        head = rows - batch.tail_rows
        out = attend(q[:head], page_table[:head], batch.kv_len[:head], batch.q_len[:head],
                     batch.block_mask)
        chunk_rows = batch.tail_rows // batch.tail_blocks
        chunks = attend(q[head:].reshape(batch.tail_blocks, -1, n, d),
                        page_table[head::chunk_rows], batch.kv_len[head:], batch.q_len[head:])
        return jnp.concatenate([out, chunks.reshape(batch.tail_rows, t, n, d)])

    def qkv(self, x: Array, positions: Array, inv_freq: Array) -> tuple[Array, Array, Array]:
        """x: [B, T, in] -> q [B, T, N, D], k and v [B, T, K, D]: projected, q/k-normed
        (Qwen3) and rotated at ``positions`` [B, T]."""
        bsz, t, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.reshape(bsz, t, self.num_heads, self.head_dim)
        k = k.reshape(bsz, t, self.num_kv_heads, self.head_dim)
        v = v.reshape(bsz, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one GEMM
    (``gate_up_proj``; the checkpoint keeps ``gate_proj`` / ``up_proj``). ``shards``:
    ``gate_up_proj``'s tensor-parallel layout (``FusedLinear``); ``quant`` / ``prefix``:
    as ``Attention``'s."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=jnp.float32,
                 shards: int = 1, quant: Fp8Spec | None = None, prefix: str = "",
                 rngs: nnx.Rngs):
        self.gate_up_proj = FusedLinear(
            hidden_size, (("gate_proj", intermediate_size), ("up_proj", intermediate_size)),
            shards=shards, dtype=dtype,
            quant=module_quant(quant, prefix, ("gate_proj", "up_proj")), rngs=rngs)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype,
                                quant=module_quant(quant, prefix, ("down_proj",)), rngs=rngs)

    def __call__(self, x: Array) -> Array:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(jax.nn.silu(gate) * up)
