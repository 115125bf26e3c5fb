"""Tensor and data parallelism on the GPUs of one host (issue 16's benchmarks).

Random bfloat16 weights; the speculative engines accept each draft token with
probability ``--acceptance`` (``synthetic_acceptance``, as ``bench_engine.py``), so
E[accept length] = 1 + a + ... + a^S. Each part prints a table:

- ``tp``: the Llama-3.1-8B shape at tensor parallel 1 and ``--tp`` in the same run,
  plain and speculative (EAGLE-3-shaped draft), at ``--batch-sizes``: TPOT of each, the
  plain step's bound at each size (as for ``70b`` below), the ratio tp-N / tp-1 of the
  plain TPOT, the speculative speed-up at each size.
- ``70b``: the Llama-3.1-70B shape (80 layers, hidden 8192, 64 / 8 heads, MLP 28672,
  vocabulary 128256) at tensor parallel ``--tp``, batch 1: plain decoding against the
  per-GPU weight-read bound (each GPU reads its 1/N of the weights and of the live KV
  per step, over the copy bandwidth measured in the same run) and the speculative
  engine's speed-up. The weights are created sharded: one GPU does not hold them.
- ``dp``: the 8B shape, one engine against ``--dp`` replicas (one GPU each, a
  ``DataParallelEngine`` routing to the least loaded) at ``--dp-batch`` requests per
  replica: decode tokens/s and the ratio.

    python scripts/bench_parallel.py [--only tp,70b,dp] [--tp 2] [--dp 2]
        [--batch-sizes 1,8] [--small] [--json PATH]

A CPU smoke run: ``XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu
python scripts/bench_parallel.py --small``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from eagle_jax import parallel
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.data_parallel import DataParallelEngine
from eagle_jax.bench.engine import decode_rate
from eagle_jax.bench.roofline import kv_bytes_per_token, weight_bytes
from eagle_jax.bench.timing import copy_bandwidth
from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target

LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                 num_heads=64, num_kv_heads=8, head_dim=128)
SMALL_WIDE = dict(SMALL, num_layers=8)  # the smoke run's stand-in for the 70B shape


def engine(args, target, draft=None, *, batch: int, kv_gib: float, devices=None):
    """A plain (no draft) or speculative engine over ``target``, every bucket compiled."""
    common = dict(model="random", dtype="bfloat16",
                  max_model_len=args.prompt_len + args.new_tokens + 64,
                  max_num_seqs=batch, batch_buckets=(batch,),
                  prefill_buckets=(args.prompt_len,), kv_cache_memory=int(kv_gib * 2**30),
                  compilation_cache_dir="",
                  tensor_parallel_size=parallel.tensor_parallel_size(target.mesh))
    if draft is None:
        return Engine(EngineConfig(speculative_algorithm="NONE", **common), target=target,
                      devices=devices)
    return Engine(EngineConfig(speculative_algorithm="EAGLE3", draft_model="random",
                               num_steps=args.num_steps, speculative_policy="fixed",
                               synthetic_acceptance=args.acceptance, **common),
                  target=target, draft=draft, devices=devices)


def bound_tpot(args, shape, target, tp: int, batch: int, bw: float) -> float:
    """Seconds of a plain step's floor: each of ``tp`` GPUs reads its 1/tp of the weights
    and of the batch's live KV (the mean live length while decoding) at the copy
    bandwidth ``bw`` measured in the same run."""
    live = args.prompt_len + args.new_tokens / 2
    kv = batch * live * kv_bytes_per_token(shape, jnp.dtype(jnp.bfloat16).itemsize)
    return (weight_bytes(target) + kv) / tp / bw


def rate(eng, batch: int, args):
    """(tokens/s, TPOT seconds) of ``batch`` requests after a warm-up batch."""
    decode_rate(eng, batch, args.prompt_len, 8, seed=1)
    tok_s, tpot, *_ = decode_rate(eng, batch, args.prompt_len, args.new_tokens, seed=2)
    return tok_s, tpot


def pair(args, shape, tp: int, batch: int):
    """Plain and speculative rates of ``shape`` at tensor parallel ``tp``."""
    mesh = parallel.make_mesh(tp) if tp > 1 else None
    target = random_target(shape, jnp.bfloat16, mesh=mesh)
    draft = random_eagle3(target, jnp.bfloat16, min(32000, shape["vocab_size"]))
    kv = 0.25 if args.small else 8.0
    plain = rate(engine(args, target, batch=batch, kv_gib=kv), batch, args)
    spec = rate(engine(args, target, draft, batch=batch, kv_gib=kv), batch, args)
    return target, plain, spec


def tp_rows(args, shape, bw: float) -> list[dict]:
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        by_tp = {tp: pair(args, shape, tp, b) for tp in (1, args.tp)}
        (target, p1, s1), (_, pn, sn) = by_tp[1], by_tp[args.tp]
        rows.append(dict(batch=b, tp=args.tp, plain_tpot_ms_tp1=1e3 * p1[1],
                         bound_tpot_ms_tp1=1e3 * bound_tpot(args, shape, target, 1, b, bw),
                         plain_tpot_ms=1e3 * pn[1],
                         bound_tpot_ms=1e3 * bound_tpot(args, shape, target, args.tp, b, bw),
                         tpot_ratio=pn[1] / p1[1],
                         spec_tpot_ms_tp1=1e3 * s1[1], spec_tpot_ms=1e3 * sn[1],
                         speedup_tp1=s1[0] / p1[0], speedup=sn[0] / pn[0]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def big_row(args, shape, bw: float) -> dict:
    target, (p_tps, p_tpot), (s_tps, s_tpot) = pair(args, shape, args.tp, 1)
    bound_s = bound_tpot(args, shape, target, args.tp, 1, bw)
    row = dict(tp=args.tp, weights_gb=weight_bytes(target) / 1e9, plain_tpot_ms=1e3 * p_tpot,
               bound_tpot_ms=1e3 * bound_s, plain_vs_bound=bound_s / p_tpot,
               spec_tpot_ms=1e3 * s_tpot, speedup=s_tps / p_tps)
    print(json.dumps(row), flush=True)
    return row


def dp_row(args, shape) -> dict:
    devices = jax.devices()[:args.dp]
    kv = 0.25 if args.small else 8.0
    replicas = []
    for dev in devices:  # each replica's weights made on its own device
        with jax.default_device(dev):
            target = random_target(shape, jnp.bfloat16)
            draft = random_eagle3(target, jnp.bfloat16, min(32000, shape["vocab_size"]))
        replicas.append(engine(args, target, draft, batch=args.dp_batch, kv_gib=kv,
                               devices=[dev]))
    one, _ = rate(replicas[0], args.dp_batch, args)
    many, _ = rate(DataParallelEngine(replicas), args.dp * args.dp_batch, args)
    row = dict(dp=args.dp, batch_per_replica=args.dp_batch, tok_s_one=one, tok_s=many,
               ratio=many / one)
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="tp,70b,dp", help="parts to run (comma-separated)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--dp-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    EngineConfig.add_cli_args(ap, include=("num_steps",))
    ap.add_argument("--acceptance", type=float, default=0.83)
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.dp_batch, args.new_tokens, args.prompt_len = min(args.dp_batch, 4), 16, 16
    parts = args.only.split(",")
    need = max(args.tp if {"tp", "70b"} & set(parts) else 1, args.dp if "dp" in parts else 1)
    if len(jax.devices()) < need:
        raise SystemExit(f"{need} devices needed, {len(jax.devices())} found (on a CPU: "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; "
          f"jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 1 << 30)
    result = dict(device=jax.devices()[0].device_kind, copy_bandwidth=bw, args=vars(args))
    if "tp" in parts:
        result["tp"] = tp_rows(args, SMALL if args.small else LLAMA_8B, bw)
    if "70b" in parts:
        result["70b"] = big_row(args, SMALL_WIDE if args.small else LLAMA_70B, bw)
    if "dp" in parts:
        result["dp"] = dp_row(args, SMALL if args.small else LLAMA_8B)

    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s, a = {args.acceptance}, S = {args.num_steps}")
    if result.get("tp"):
        print(f"\n| batch | plain TPOT tp1 (ms) | bound tp1 (ms) | plain TPOT tp{args.tp} (ms) | "
              f"bound tp{args.tp} (ms) | ratio | spec TPOT tp1 (ms) | "
              f"spec TPOT tp{args.tp} (ms) | speed-up tp1 | speed-up tp{args.tp} |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["tp"]:
            print(f"| {r['batch']} | {r['plain_tpot_ms_tp1']:.2f} | {r['bound_tpot_ms_tp1']:.2f} | "
                  f"{r['plain_tpot_ms']:.2f} | {r['bound_tpot_ms']:.2f} | "
                  f"{r['tpot_ratio']:.2f} | {r['spec_tpot_ms_tp1']:.2f} | "
                  f"{r['spec_tpot_ms']:.2f} | {r['speedup_tp1']:.2f}x | {r['speedup']:.2f}x |")
    if "70b" in result:
        r = result["70b"]
        print(f"\n70B shape at tp{r['tp']} ({r['weights_gb']:.1f} GB): plain TPOT "
              f"{r['plain_tpot_ms']:.2f} ms, bound {r['bound_tpot_ms']:.2f} ms "
              f"({100 * r['plain_vs_bound']:.0f}% of it), speculative TPOT "
              f"{r['spec_tpot_ms']:.2f} ms, speed-up {r['speedup']:.2f}x")
    if "dp" in result:
        r = result["dp"]
        print(f"\ndata parallel {r['dp']} x {r['batch_per_replica']} requests: "
              f"{r['tok_s']:.0f} tok/s against {r['tok_s_one']:.0f} for one replica "
              f"({r['ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

