"""Sizing the KV pool: its pages, the page table's width and max_model_len, from the
models' shapes and the device memory left beside the weights."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from eagle_jax import parallel
from eagle_jax.engine.config import CPU_MAX_MODEL_LEN, EngineConfig
from eagle_jax.engine.page_allocator import plan_pool
from eagle_jax.kernels.paged_attention import max_pool_pages
from eagle_jax.models.layers import KVPages

logger = logging.getLogger("eagle_jax.engine")

DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class PoolSize:
    max_model_len: int
    num_pages: int
    max_pages: int  # a page-table row's width
    kv_bytes: int  # the pool's bytes on each device


def model_limit(target, draft) -> int:
    """The context limit: the target's max_position_embeddings. A draft trained on
    shorter sequences does not cap it: it runs past its training length with its RoPE,
    as SGLang's EAGLE workers do (warned)."""
    limit = target.config.max_position_embeddings
    if draft is not None and draft.max_positions < limit:
        logger.warning(
            "the draft's max_position_embeddings (%d) is below the target's (%d): past "
            "%d positions it drafts beyond its training length (acceptance may fall)",
            draft.max_positions, limit, draft.max_positions)
    return limit


def pool_shapes(target, draft, mesh) -> list[tuple[int, int, int]]:
    """(layers, kv heads, head dim) of each model's KV pool on one device: the target's,
    then the draft's. Tensor-parallel over N devices, a device stores the target's pool
    kv heads (``num_kv_heads * kv_replicas``) / N of them, so a per-device budget holds up
    to N times the tokens; the draft's pool is replicated, whole on every device."""
    cfg = target.config
    shapes = [(cfg.num_layers, target.pool_kv_heads // parallel.tensor_parallel_size(mesh),
               cfg.head_dim)]
    if draft is not None:
        c = draft.config
        shapes.append((c.num_layers, c.num_kv_heads, c.head_dim))
    return shapes


def free_device_memory(devices: list) -> int | None:
    """Bytes JAX may still allocate on each device, the weights already placed; None on a
    device that does not report its memory (a CPU). This process's first device
    (another process's cannot be asked); processes then agree on the smallest, since the
    pool is one array over all."""
    local = next(d for d in devices if d.process_index == jax.process_index())
    stats = local.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return parallel.min_over_processes(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def kv_budget(config: EngineConfig, devices: list) -> int | None:
    """Bytes for the KV pool: ``kv_cache_memory``, else ``kv_cache_memory_fraction``
    (default 0.75 on a device that reports its memory) of the free device memory; None on
    a device that does not (a CPU)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    free = free_device_memory(devices)
    if free is None:
        if config.kv_cache_memory_fraction is not None:
            raise ValueError("kv_cache_memory_fraction needs a device that reports its "
                             "memory; pass kv_cache_memory (bytes) instead")
        return None
    fraction = config.kv_cache_memory_fraction or DEFAULT_KV_CACHE_MEMORY_FRACTION
    return int(free * fraction)


def check_pool_fits(config: EngineConfig, kv_bytes: int, devices: list) -> None:
    """An explicit ``kv_cache_memory`` larger than the device's free memory is an error
    now, naming the most that fits, rather than minutes later in the allocator's
    retries."""
    if config.kv_cache_memory is None:
        return  # a fraction of the free memory: fits by construction
    free = free_device_memory(devices)
    if free is not None and kv_bytes > free:
        gib = 1 << 30
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} ({kv_bytes / gib:.2f} GiB of KV pool "
            f"per device) exceeds the {free / gib:.2f} GiB of device memory free beside the "
            f"weights; pass at most ~{int(0.9 * free) >> 20} MiB, leaving room for "
            "activations (or leave it unset: kv_cache_memory_fraction, default "
            f"{DEFAULT_KV_CACHE_MEMORY_FRACTION}, of the free memory)")


def size_pool(config: EngineConfig, *, target, draft, mesh, devices: list, dtype,
              kv_dtype, step_tokens: int, feature_width: int) -> PoolSize:
    """The pool of ``config`` for these models on ``devices``. Its bytes per position on
    each device: the target's KV layers plus the draft's in ``kv_dtype``, and with a draft
    and prefix caching a position's share of the target feature (in ``dtype``) kept per
    page for a hit's draft (``DecodeState.boundary_features``, ``feature_width`` wide)."""
    page_size = config.page_size
    limit = model_limit(target, draft)
    shapes = pool_shapes(target, draft, mesh)
    bytes_per_token = sum(KVPages.bytes_per_token(layers, heads, dim, kv_dtype)
                          for layers, heads, dim in shapes)
    if draft is not None and config.enable_prefix_caching:
        bytes_per_token += -(-feature_width * jnp.dtype(dtype).itemsize // page_size)
    addressable = min(max_pool_pages(page_size, heads, dim, itemsize=jnp.dtype(kv_dtype).itemsize)
                      for _, heads, dim in shapes)
    plan = plan_pool(model_limit=limit, max_model_len=config.max_model_len,
                     num_slots=config.max_num_seqs, page_size=page_size,
                     step_tokens=step_tokens, bytes_per_token=bytes_per_token,
                     budget=kv_budget(config, devices),
                     unbudgeted_max_model_len=CPU_MAX_MODEL_LEN, max_num_pages=addressable)
    if plan.num_pages == addressable:
        logger.info("engine: KV pool of %d pages (%d tokens), the most the attention "
                    "kernel addresses at this page size and head shape",
                    plan.num_pages, plan.num_pages * page_size)
    if config.max_model_len is None and plan.max_model_len < limit:
        logger.info("engine: max_model_len=%d (the target's limit %d capped by the KV pool "
                    "of %d tokens; set it to change)", plan.max_model_len, limit,
                    plan.num_pages * page_size)
    size = PoolSize(plan.max_model_len, plan.num_pages, plan.max_pages,
                    plan.num_pages * page_size * bytes_per_token)
    check_pool_fits(config, size.kv_bytes, devices)
    return size
