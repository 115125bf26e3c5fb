"""Draft trees against chains: the step's cost and the speed-up it buys, one run.

The Llama-3.1-8B-shaped bfloat16 target and EAGLE-3-shaped draft of bench_engine.py
(random weights). For every batch size, each configuration's step is timed as the
engine times its steps at start-up (``Engine.time_steps``: every row live at
``--context`` tokens on pages of its own, steps dispatched back to back, sampled rows,
so the tree's draws from q and its q rows are all paid for): plain decoding, the chain
of ``--chain-steps`` and each tree (K, S, N) of ``--trees``, verified by each rule of
``--tree-verify`` (``EngineConfig.tree_verify``; the rules differ only in sampled rows).

Each step is timed twice: every row sampling at temperature 1 (the tree draws its
children from q and carries q to the sampler) and every row greedy (top-K children, no
q). The speed-up estimate of a configuration is its temperature-0 accept length (tokens
committed per step, ``--accept-lengths``: measured on the default pair by
``scripts/evaluate.py``, docs/BENCHMARKS.md, "Tree drafting") times plain's greedy step time over its own.
The table gives ms per step, the ratio to the chain's step, and the estimate where an
accept length is known; the best configuration per batch size is marked. Beside plain
decoding, its physical bound: one read of the weights and of every row's live KV per
step, over the device-to-device copy bandwidth measured in the same run.

    python scripts/bench_tree.py [--batch-sizes 1,8,32] [--trees 4x6x32,8x6x64]
        [--tree-verify traversal,recursive_rejection]
        [--accept-lengths chain=4.23,4x6x32=5.3] [--json PATH] [--small]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp

from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.draft_tree import scratch_positions
from eagle_jax.bench.roofline import kv_bytes_per_token, weight_bytes
from eagle_jax.bench.timing import copy_bandwidth, device_ms_per_op, print_profile
from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target


def _tree(spec: str) -> tuple[int, int, int]:
    k, s, n = (int(x) for x in spec.lower().split("x"))
    return k, s, n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--chain-steps", type=int, default=5)
    ap.add_argument("--trees", default="4x6x32,2x6x16,4x5x16,8x6x64",
                    help="K x S x N (N: tokens verified, the root included)")
    ap.add_argument("--tree-verify", default="traversal",
                    help="comma-separated rules to time each tree with (names get the rule "
                         "appended when there are several)")
    ap.add_argument("--accept-lengths", default="",
                    help="name=accept length pairs (chain, or KxSxN), for the estimate")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--kv-cache-gib", type=float, default=16.0,
                    help="each engine's KV pool; the engine's default (most of the free "
                         "memory) leaves XLA too little for the step's buffers, and it "
                         "rematerialises")
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also print each configuration's device time per op at batch 1")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    trees = [_tree(t) for t in args.trees.split(",") if t]
    rules = [r for r in args.tree_verify.split(",") if r]
    accept = {k: float(v) for k, v in (kv.split("=") for kv in args.accept_lengths.split(",")
                                       if kv)}
    shape = SMALL if args.small else LLAMA_8B
    dtype = jnp.bfloat16
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"{datetime.date.today()}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 1 << 30)
    target = random_target(shape, dtype)
    weights = weight_bytes(target)
    kv_bytes = kv_bytes_per_token(shape, jnp.dtype(dtype).itemsize)  # per live token
    # Plain decoding's bound: one read of the weights and of every row's live KV a step.
    bound_ms = {b: 1e3 * (weights + b * args.context * kv_bytes) / bw for b in batches}
    draft = random_eagle3(target, dtype, min(args.draft_vocab, shape["vocab_size"]))
    span = max([args.chain_steps + 1] + [max(n, scratch_positions(k, s, n - 1))
                                         for k, s, n in trees])
    common = dict(model="random", dtype="bfloat16",
                  max_model_len=args.context + (args.repeats + 4) * span + 64,
                  max_num_seqs=max(batches), batch_buckets=tuple(batches),
                  prefill_buckets=(64,), compilation_cache_dir="", precompile=False,
                  speculative_policy="fixed",
                  kv_cache_memory=None if args.small else int(args.kv_cache_gib * 2**30))
    configs = [("plain", dict(speculative_algorithm="NONE"))]
    configs.append(("chain", dict(speculative_algorithm="EAGLE3", draft_model="random",
                                  num_steps=args.chain_steps)))
    configs += [(f"{k}x{s}x{n}" + (f" {rule}" if len(rules) > 1 else ""),
                 dict(speculative_algorithm="EAGLE3", draft_model="random", num_steps=s,
                      speculative_eagle_topk=k, num_draft_tokens=n, tree_verify=rule))
                for k, s, n in trees for rule in rules]
    ms = {}
    for name, kw in configs:
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(**common, **kw), target=target,
                        draft=None if kw["speculative_algorithm"] == "NONE" else draft)
        for mode in ("sampled", "greedy"):
            timed = engine.time_steps(args.repeats, args.context, greedy=mode == "greedy")
            for (batch, _), seconds in timed.items():
                ms[name, batch, mode] = seconds * 1e3
        if args.profile and name != "plain":
            # time_steps runs the step 1 + repeats times per bucket; trace a batch-1 engine.
            one = Engine(EngineConfig(**{**common, "batch_buckets": (1,), "max_num_seqs": 1},
                                      **kw), target=target, draft=draft)
            one.time_steps(1, args.context)  # compiled and warm
            trace = os.path.join(args.profile, name)
            with jax.profiler.trace(trace):
                one.time_steps(args.repeats, args.context)
            print(f"device time per op, {name}, batch 1:")
            print_profile(device_ms_per_op(trace, 1 + args.repeats), top=25)
            del one
        print(json.dumps({"config": name, "built_and_timed_s": round(time.perf_counter() - t0),
                          **{f"{b} {m}": round(ms[name, b, m], 3) for b in batches
                             for m in ("sampled", "greedy")}}), flush=True)
        del engine

    rows = []
    print(f"\nms per step, every row live at {args.context} tokens, rows sampling at T = 1 "
          f"and greedy; the ratio to the chain (S={args.chain_steps}) in the same mode; "
          "speed-up estimate = accept length x plain ms / ms (greedy steps, T = 0 accept "
          "lengths)\n")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; plain's bound: weights + live KV over it")
    print("| batch | config | ms T=1 | vs chain | ms T=0 | vs chain | accept length T=0 | "
          "est. speed-up T=0 | plain: bound ms (of T=0) |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for b in batches:
        cells = []
        for name, _ in configs:
            t1, t0 = ms[name, b, "sampled"], ms[name, b, "greedy"]
            acc = 1.0 if name == "plain" else accept.get(name.split()[0])
            cells.append(dict(batch=b, config=name, ms_sampled=t1, ms_greedy=t0,
                              vs_chain_sampled=t1 / ms["chain", b, "sampled"],
                              vs_chain_greedy=t0 / ms["chain", b, "greedy"],
                              accept_length=acc, speedup_estimate=None if acc is None
                              else acc * ms["plain", b, "greedy"] / t0,
                              plain_bound_ms=bound_ms[b] if name == "plain" else None))
        known = [c for c in cells if c["speedup_estimate"] is not None]
        best = max(known, key=lambda c: c["speedup_estimate"])["config"] if known else None
        for c in cells:
            mark = " (best)" if c["config"] == best else ""
            pb = c["plain_bound_ms"]
            bound = "-" if pb is None else f"{pb:.2f} ({pb / c['ms_greedy']:.0%})"
            print(f"| {b} | {c['config']}{mark} | {c['ms_sampled']:.2f} | "
                  f"{c['vs_chain_sampled']:.2f} | {c['ms_greedy']:.2f} | "
                  f"{c['vs_chain_greedy']:.2f} | {fmt(c['accept_length'], '.2f')} | "
                  f"{fmt(c['speedup_estimate'], '.2f')} | {bound} |")
        rows += cells
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                           date=str(datetime.date.today()), shape=shape, context=args.context,
                           rows=rows), f, indent=1)

