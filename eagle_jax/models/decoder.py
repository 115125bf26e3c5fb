"""The target model: one decoder for Llama 2/3/3.1/3.2, Qwen2 and Qwen3.

A single forward serves prefill (a padded prompt chunk), single-token decode and the
multi-token verify of speculative decoding: the caller passes tokens with their
absolute positions and a paged ``KVCache``, and the layers write keys/values into the
pool at those positions (see ``layers.py``). Padding tokens carry a position past the
page table's capacity, so their writes are dropped. Without a cache (training,
scoring) the forward is plain causal attention over the tokens given.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax import parallel
from eagle_jax.checkpoint import CheckpointReader, dotted, load_into, module_tensors, save_sharded
from eagle_jax.config import ModelConfig, read_json, resolve_dtype
from eagle_jax.fp8 import Fp8Spec, fp8_dtype
from eagle_jax.fp8_checkpoint import (
    Fp8Loader, checkpoint_layout, on_the_fly_spec, quantization_config, spec_from_config)
from eagle_jax.kernels._common import lowering_context
from eagle_jax.models.layers import (
    MLP,
    Attention,
    AttentionBatch,
    Embedding,
    KVCache,
    KVPages,
    Linear,
    RMSNorm,
    TreeLayout,
    rope_inv_freq,
)

Array = jax.Array


class DecoderOutput(NamedTuple):
    """logits: [B, R, V] f32 for the requested rows (R = T when no rows are given);
    hidden: [B, T, H] final-norm hidden states (EAGLE-1 features);
    aux_hidden: [B, T, len(aux_layers) * H] inputs of the requested layers (EAGLE-3);
    cache: the updated KV cache (None without one)."""

    logits: Array | None
    hidden: Array
    aux_hidden: Array | None
    cache: KVCache | None


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, mesh=None, quant: Fp8Spec | None = None,
                 prefix: str = "", rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm, norm_eps=cfg.rms_norm_eps, dtype=dtype, mesh=mesh,
            quant=quant, prefix=prefix + "self_attn.", rngs=rngs)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, dtype=dtype,
                       shards=parallel.tensor_parallel_size(mesh), quant=quant,
                       prefix=prefix + "mlp.", rngs=rngs)

    def __call__(self, x, positions, cache: KVCache | None, layer: int, inv_freq,
                 batch: AttentionBatch | None):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, cache, layer, inv_freq,
                                     batch)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _shared_layer(graphdef: nnx.GraphDef, tail: tuple[int, int], kernel_context: tuple,
                  state, x, positions, k_pool, v_pool, page_table, inv_freq, slots, kv_len,
                  q_len, block_mask):
    """One decoder layer over its own pool, as one jitted function that every layer of
    the stack calls: JAX traces and lowers it once per shape (the call's jaxpr and its
    lowered function are cached), and XLA inlines the calls, so the compiled program is
    the unrolled stack's. ``k_pool`` / ``v_pool``: the layer's [P, page_size, K, D]
    (None without a cache); ``tail``: ``AttentionBatch``'s static (tail_rows,
    tail_blocks); ``kernel_context``: ``kernels._common.lowering_context()``, unused but
    as the trace cache's key (the attention kernel reads it while tracing). Returns (x,
    k_pool, v_pool)."""
    del kernel_context
    layer = nnx.merge(graphdef, state)
    if k_pool is None:
        return layer(x, positions, None, 0, inv_freq, None)[0], None, None
    cache = KVCache(KVPages((k_pool,), (v_pool,)), page_table)
    batch = AttentionBatch(slots, kv_len, q_len, block_mask, *tail)
    x, cache = layer(x, positions, cache, 0, inv_freq, batch)
    return x, cache.pages.k[0], cache.pages.v[0]


def run_layers(layers: Sequence[DecoderLayer], x: Array, positions: Array,
               cache: KVCache | None, inv_freq: Array, batch: AttentionBatch | None,
               capture: Sequence[int] = ()) -> tuple[Array, KVCache | None, dict[int, Array]]:
    """The decoder stack: x [B, T, H] through ``layers`` in order, each writing its
    keys and values into its pool of ``cache``. Returns (x, cache, {i: layer i's input
    for i in capture}) (EAGLE-3's features)."""
    captured = {}
    k_pools, v_pools = (None, None) if cache is None else map(list, cache.pages)
    table = None if cache is None else cache.page_table
    arrays = (None,) * 4 if batch is None else batch[:4]
    tail = (0, 0) if batch is None else (batch.tail_rows, batch.tail_blocks)
    for i, layer in enumerate(layers):
        if i in capture:
            captured[i] = x
        graphdef, state = nnx.split(layer)
        x, k, v = _shared_layer(graphdef, tail, lowering_context(), state, x, positions,
                                None if cache is None else k_pools[i],
                                None if cache is None else v_pools[i], table, inv_freq,
                                *arrays)
        if cache is not None:
            k_pools[i], v_pools[i] = k, v
    if cache is not None:
        cache = cache._replace(pages=KVPages(tuple(k_pools), tuple(v_pools)))
    return x, cache, captured


class Decoder(nnx.Module):
    """Llama / Qwen decoder with an LM head.

    Parameter names follow the checkpoint: ``embed_tokens``, ``layers[i]``, ``norm``
    (under the checkpoint's ``model.`` prefix) and ``lm_head`` (absent when tied).

    ``mesh`` (``eagle_jax.parallel.make_mesh``): built for tensor parallelism over the
    mesh's "tp" devices: fused projections laid out shard by shard, the attention kernel
    per shard, pools from ``init_pages`` / ``init_cache`` sharded by kv head. The
    parameters are placed by ``parallel.shard_params`` (``load_decoder`` does it).

    ``quant`` (``eagle_jax.fp8.Fp8Spec``): the decoder layers' projections in FP8 (those
    the spec does not ignore); the embedding and the LM head stay in ``dtype``.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, mesh=None,
                 quant: Fp8Spec | None = None, rngs: nnx.Rngs):
        if mesh is not None:
            parallel.check_tensor_parallel(cfg, parallel.tensor_parallel_size(mesh))
        self.config = cfg
        self.mesh = mesh
        self.quant = quant
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, mesh=mesh, quant=quant,
                                             prefix=f"model.layers.{i}.", rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))

    @property
    def lm_head_weight(self) -> Array:
        """[V, H]: the output projection (the embedding when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight[...]

    def logits(self, hidden: Array) -> Array:
        """hidden: [..., H] -> logits [..., V] float32."""
        w = self.lm_head_weight
        return jnp.einsum("...h,vh->...v", hidden.astype(w.dtype), w,
                          preferred_element_type=jnp.float32)

    @property
    def pool_kv_heads(self) -> int:
        """KV heads of the pool: the config's, or the tensor-parallel size when that is
        larger (each kv head replicated, ``eagle_jax.parallel``)."""
        return self.layers[0].self_attn.num_kv_heads

    def init_pages(self, num_pages: int, page_size: int, dtype=None) -> KVPages:
        """The target's KV pool (every layer), zeroed; sharded by kv head with a mesh."""
        cfg = self.config
        pages = KVPages.zeros(cfg.num_layers, num_pages, page_size, self.pool_kv_heads,
                              cfg.head_dim, dtype or self.embed_tokens.weight.dtype)
        return pages if self.mesh is None else parallel.shard_pages(pages, self.mesh)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """A stand-alone paged cache of ``batch`` rows of ``max_len`` positions each."""
        cfg = self.config
        dtype = dtype or self.embed_tokens.weight.dtype
        cache = KVCache.contiguous(cfg.num_layers, batch, max_len, self.pool_kv_heads,
                                   cfg.head_dim, dtype)
        return (cache if self.mesh is None else
                cache._replace(pages=parallel.shard_pages(cache.pages, self.mesh)))

    def __call__(self, tokens: Array, positions: Array, cache: KVCache | None, *,
                 logit_rows: Array | None = None, aux_layers: Sequence[int] = (),
                 compute_logits: bool = True, tree: TreeLayout | None = None,
                 tail_rows: int = 0, tail_blocks: int = 1) -> DecoderOutput:
        """tokens, positions: [B, T] int32; logit_rows: [B, R] indices into T or None;
        cache: the pool and the batch rows' page tables, or None (causal attention over
        the tokens given, no cache: training, scoring).

        With a cache, each row's valid tokens are a prefix of its T at consecutive
        positions ending the sequence; padding positions (>= the page table's
        capacity) are dropped. ``tree`` (a draft tree's verify): the tokens rotate at
        ``tree.rope_positions`` and attend through ``tree.block_mask``, while
        ``positions`` say where their keys and values go (``tree.block_mask`` covers
        all but the tail rows). ``tail_rows`` (static): the last rows are
        ``tail_blocks`` prompt chunks in rows of T, each attended as one query block
        (``AttentionBatch``).
        """
        cfg = self.config
        if any(not 0 <= i < cfg.num_layers for i in aux_layers):
            raise ValueError(f"aux_layers {tuple(aux_layers)} outside [0, {cfg.num_layers})")
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        x = self.embed_tokens(tokens)
        batch = None if cache is None else cache.attention_batch(
            positions, None if tree is None else tree.block_mask, tail_rows, tail_blocks)
        rope_positions = positions if tree is None else tree.rope_positions
        x, cache, captured = run_layers(self.layers, x, rope_positions, cache, inv_freq, batch,
                                        aux_layers)
        hidden = self.norm(x)
        logits = None
        if compute_logits:
            rows = hidden if logit_rows is None else jnp.take_along_axis(
                hidden, logit_rows[..., None], axis=1)
            logits = self.logits(rows)
        aux_hidden = (jnp.concatenate([captured[i] for i in aux_layers], axis=-1)
                      if aux_layers else None)
        return DecoderOutput(logits, hidden, aux_hidden, cache)


def checkpoint_name(path: tuple) -> str:
    """Parameter path -> Hugging Face tensor name (``model.`` prefix but for lm_head)."""
    name = dotted(path)
    return name if path[0] == "lm_head" else f"model.{name}"


def load_decoder(model_dir: str, dtype="float32", *, mesh=None,
                 quantization: str | None = None) -> Decoder:
    """Builds the decoder described by ``model_dir/config.json`` from its safetensors;
    with ``mesh``, tensor-parallel over it, each parameter sent from the host to its
    devices shard by shard (``param_shardings``).

    FP8 (``eagle_jax.fp8``): a checkpoint whose config.json has an FP8
    ``quantization_config`` (compressed-tensors, fbgemm_fp8) loads with its FP8 weights
    and scales; ``quantization="fp8"`` quantizes a float checkpoint's projections while
    loading (on the host, each tensor before it is sent). The weights take the device's
    e4m3 format (``fp8.fp8_dtype``: fnuz on gfx942, its scales doubled).

    Raises CheckpointError naming the file, tensor and expected shape on any mismatch.
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    cfg = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype(dtype)
    reader = CheckpointReader(model_dir)
    source = os.path.join(model_dir, "config.json")
    fp8 = fp8_dtype(None if mesh is None else mesh.devices.flat[0])
    quant = spec_from_config(read_json(source), source, fp8)
    loader = None
    if quant is not None or quantization == "fp8":
        loader = Fp8Loader(reader, quant or on_the_fly_spec(fp8), quantize=quant is None)
        quant = loader.spec
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, mesh=mesh, quant=quant,
                                           rngs=nnx.Rngs(0)))
    load_into(model, reader, checkpoint_name, dtype,
              shardings=None if mesh is None else parallel.param_shardings(model, mesh),
              read=None if loader is None else loader.read)
    return model


def save_decoder(model: Decoder, model_dir: str, hf_config: dict, dtype=None, *,
                 max_shard_bytes: int | None = None) -> None:
    """Writes config.json and safetensors shards that transformers loads.

    ``max_shard_bytes`` bounds each shard (default: ``save_sharded``'s 5 GiB). An FP8
    model is written in the layout it was loaded from (``fp8_checkpoint``: its
    ``quantization_config``, e4m3fn weights and their scales; compressed-tensors for
    one quantized on the fly); ``dtype`` then casts the other tensors.
    """
    os.makedirs(model_dir, exist_ok=True)
    tensors = module_tensors(model, checkpoint_name, dtype)
    if model.quant is not None:
        hf_config = dict(hf_config, quantization_config=quantization_config(model.quant))
        tensors = checkpoint_layout(tensors, model.quant)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if max_shard_bytes is None:
        save_sharded(model_dir, tensors)
    else:
        save_sharded(model_dir, tensors, max_shard_bytes=max_shard_bytes)
