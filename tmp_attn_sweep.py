import functools, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "scripts")
from benchtools import time_ms
from eagle_jax.kernels.paged_attention import paged_attention, paged_attention_config
N, K, D, PS = 32, 8, 128, 16
ctx = 256
for B in (1, 8, 32):
    for T, tree in ((6, False), (32, True)):
        kv = ctx + T
        pages = -(-kv // PS) + 1
        P = B * pages
        key = jax.random.key(0)
        q = jax.random.normal(key, (B, T, N, D), jnp.bfloat16)
        kp = jax.random.normal(jax.random.key(1), (P, PS, K, D), jnp.bfloat16)
        vp = jax.random.normal(jax.random.key(2), (P, PS, K, D), jnp.bfloat16)
        pt = jnp.arange(P, dtype=jnp.int32).reshape(B, pages)
        kvl = jnp.full((B,), kv, jnp.int32); ql = jnp.full((B,), T, jnp.int32)
        mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0) if tree else None
        for bq, warps in ((None, None), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8)):
            if True:
                try:
                    cfg = paged_attention_config(q, kp, pt, block_q=bq, num_warps=warps)
                    att = functools.partial(paged_attention, block_mask=mask, interpret=False, block_q=bq, num_warps=warps)
                    R = 16
                    f = jax.jit(lambda q, kp, vp, pt, kvl, ql: sum(att(q + jnp.bfloat16(i), kp, vp, pt, kvl, ql)[0, 0, 0, 0].astype(jnp.float32) for i in range(R)))
                    ms = time_ms(f, q, kp, vp, pt, kvl, ql, calls=5, repeats=5) / R
                    print(f"B={B} T={T} bq={bq} warps={warps} cfg=({cfg.block_q},{cfg.num_splits},{cfg.num_warps}): {ms*1000:.1f} us", flush=True)
                except Exception as e:
                    print(f"B={B} T={T} bq={bq} warps={warps}: FAILED {str(e)[:150]}", flush=True)
