"""Engine benchmark: speculative vs plain decoding in one run, against the bandwidth bound.

A Llama-3.1-8B-shaped bfloat16 target with random weights and an EAGLE-3-shaped draft
(random weights too). Random drafts accept nothing, so the speculative engine runs with
``synthetic_acceptance`` (each draft token accepted with probability a, as serving
benchmarks fix the accept length): E[accept length] = 1 + a + a^2 + ... + a^S. The
verify, the sampler, the draft extend and every kernel still run in full.

For each max_model_len (the page table's width; every engine gets the same KV pool) and
batch size the table gives decode tokens/s and mean TPOT of both engines (prefill
excluded), the speed-up, and for plain decoding the bound: one read of the weights and
of the live KV entries (the mean live length while decoding) per step, over the
device-to-device copy bandwidth measured in the same run; for speculation, the verify
rows (B (S + 1)) and the roofline's speed-up at S and at its best S over 0-8, from that
bandwidth and the matmul throughput measured in the same run (``roofline.py``), and the
measured speed-up over the best. Options add one sequence with
a long live context (``--long``), 128 concurrent requests from a fixed KV budget
(``--capacity-gib``), a same-run HF transformers column (``--hf``, static cache,
compiled, in a subprocess) and kernel-time breakdowns from ``jax.profiler`` traces
(``--profile DIR``) of the plain step at batch 64 and 1 and the speculative step at batch
64 (those of them in ``--batch-sizes``).

    python scripts/bench_engine.py [--batch-sizes 1,8,32,64,128] [--max-model-lens 512,32768]
        [--long 32768] [--capacity-gib 8] [--kv-cache-dtype fp8] [--hf] [--profile DIR]
        [--small] [--json PATH]

``--kv-cache-dtype fp8`` runs every engine over an FP8 cache (the bound and the roofline
count its 1-byte values); the same command without it is the bfloat16 baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.bench.roofline import (
    Device, ModelCost, SpecRoofline, expected_tokens, kv_bytes_per_token, weight_bytes)
from eagle_jax.bench.timing import (
    copy_bandwidth, device_ms_per_op, matmul_throughput, print_profile)
from eagle_jax.kernels.paged_attention import KV_FP8
from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target


class DecodeRate(NamedTuple):
    tok_s: float  # decode tokens/s of the whole batch, until its last request finished
    tpot: float  # mean seconds per output token of a request
    most_running: int  # most requests running at once
    # Tokens/s while every request of the batch ran (until the first one finished): the
    # batch's steady state, without the tail of a closed batch whose last requests run
    # on in a mostly idle batch (its length depends on the spread of the requests'
    # progress, so it weighs configurations by their variance, not only their rate).
    full_batch_tok_s: float


def decode_rate(engine: Engine, batch: int, prompt_len: int, new_tokens: int,
                seed: int) -> DecodeRate:
    """The decode rates of ``batch`` requests of ``new_tokens`` tokens each, prefill
    excluded."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{seed}-{i}", [int(t) for t in rng.integers(10, 4000, prompt_len)],
                           params)
    first = {}
    last = {}
    produced = 0
    start = None
    full_batch = None  # (tokens, seconds) until the first request finished
    most = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        most = max(most, engine.scheduler_stats().num_running)
        if start is None and engine.num_waiting() == 0:
            start = now  # every request admitted and prefilled: decode starts here
            produced = 0
            continue
        for o in outs:
            produced += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            last[o.request_id] = (now, o.num_output_tokens)
        if start is not None and full_batch is None and any(o.finished for o in outs):
            full_batch = (produced, now - start)
    elapsed = max(t for t, _ in last.values()) - start
    tpot = np.mean([(t - first[r]) / max(n - 1, 1) for r, (t, n) in last.items()])
    full_batch = full_batch or (produced, elapsed)
    return DecodeRate(produced / elapsed, float(tpot), most, full_batch[0] / full_batch[1])


def step_profile(engine: Engine, batch: int, prompt_len: int, steps: int, out_dir: str):
    """Device time per op over ``steps`` decode steps of ``batch`` requests, from a
    jax.profiler trace: {device line: [(event name, ms per step)] most expensive first}."""
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [int(t) for t in rng.integers(10, 4000, prompt_len)], params)
    for _ in range(4):
        engine.step()  # admitted, prefilled, decoding
    with jax.profiler.trace(out_dir):
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.state)  # the last step dispatched, inside the trace
    while engine.has_unfinished_requests():
        engine.step()
    return device_ms_per_op(out_dir, steps)


def hf_decode_rate(shape: dict, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s of HF transformers on the same shape (random bfloat16 weights,
    static cache, compiled forward), prefill excluded: the difference between a
    ``new_tokens`` and a 1-token ``generate`` of the same prompts."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=prompt_len + new_tokens + 16,
        rope_theta=500000.0, rms_norm_eps=1e-5, torch_dtype=torch.bfloat16)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(10, 4000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
              eos_token_id=None)

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - t

    run(new_tokens)  # compiles
    run(1)
    full, short = min(run(new_tokens) for _ in range(2)), min(run(1) for _ in range(2))
    return batch * (new_tokens - 1) / (full - short)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--max-model-lens", default="512,32768",
                    help="page-table widths to compare (cost must follow live tokens)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    EngineConfig.add_cli_args(ap, include=("num_steps", "page_size", "kv_cache_dtype"))
    ap.add_argument("--acceptance", type=float, default=0.83,
                    help="per-token synthetic acceptance (0.83 with 5 steps: length ~3.9)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--long", type=int, default=0,
                    help="also decode one sequence with this many live tokens")
    ap.add_argument("--capacity-gib", type=float, default=0,
                    help="also serve 128 requests of prompt + new tokens at once from a KV "
                         "budget of this many GiB with the largest max_model_len")
    ap.add_argument("--hf", action="store_true",
                    help="HF transformers column (static cache, compiled; a subprocess)")
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default="", help="trace the plain step at batch 64 and 1 "
                    "and the speculative step at 64 into DIR")
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16
    batches = [int(b) for b in args.batch_sizes.split(",")]
    lens = [int(n) for n in args.max_model_lens.split(",")]
    shape = SMALL if args.small else LLAMA_8B
    if args.hf_only:
        for b in batches:
            print(json.dumps(dict(batch=b, hf_tok_s=hf_decode_rate(
                shape, b, args.prompt_len, args.new_tokens))), flush=True)
        return
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 1 << 30)
    flops = matmul_throughput(256 if args.small else 8192, dtype)
    target = random_target(shape, dtype)
    draft = random_eagle3(target, dtype, min(args.draft_vocab, shape["vocab_size"]))
    weights = weight_bytes(target)
    itemsize = jnp.dtype(dtype).itemsize
    kv_itemsize = KV_FP8.itemsize if args.kv_cache_dtype == "fp8" else itemsize
    roofline = SpecRoofline(ModelCost.of(target, kv_itemsize), ModelCost.of(draft, kv_itemsize),
                            Device(bw, flops))
    a, S = args.acceptance, args.num_steps
    expected_len = expected_tokens(a, S)
    per_request = args.prompt_len + args.new_tokens + 2 * (S + 1)

    kvb = kv_bytes_per_token(shape, kv_itemsize)
    draft_kvb = 2 * draft.config.num_kv_heads * draft.config.head_dim * kv_itemsize
    # With prefix caching the pool also keeps a page's share of the target feature
    # (engine/pool_sizing.py), 3 x H wide for EAGLE-3.
    draft_kvb += -(-3 * shape["hidden_size"] * itemsize // args.page_size)

    def engines(max_model_len, kv_tokens, buckets):
        """Plain and speculative engines whose pools hold ``kv_tokens`` positions
        (at least one request of max_model_len), whatever the page table's width."""
        kv_tokens = max(kv_tokens, max_model_len + 2 * (S + 1) + args.page_size)
        common = dict(model="random", dtype="bfloat16", max_model_len=max_model_len,
                      max_num_seqs=max(buckets), batch_buckets=tuple(buckets),
                      prefill_buckets=(min(512, max_model_len),), page_size=args.page_size,
                      kv_cache_dtype=args.kv_cache_dtype, compilation_cache_dir="")
        plain = Engine(EngineConfig(speculative_algorithm="NONE", kv_cache_memory=kv_tokens * kvb,
                                    **common), target=target)
        spec = Engine(EngineConfig(speculative_algorithm="EAGLE3", draft_model="random",
                                   num_steps=S, speculative_policy="fixed",
                                   synthetic_acceptance=a,
                                   kv_cache_memory=kv_tokens * (kvb + draft_kvb), **common),
                      target=target, draft=draft)
        return plain, spec

    rows = []
    extra_profile = {}
    for max_len in lens:
        plain, spec = engines(max_len, max(batches) * per_request, batches)
        for b in batches:
            decode_rate(plain, b, args.prompt_len, 16, seed=1)  # warm-up
            decode_rate(spec, b, args.prompt_len, 16, seed=1)
            p_tps, p_tpot, *_ = decode_rate(plain, b, args.prompt_len, args.new_tokens, seed=2)
            s0 = spec.stats.num_accepted_tokens, spec.stats.num_drafts
            s_tps, s_tpot, *_ = decode_rate(spec, b, args.prompt_len, args.new_tokens, seed=2)
            acc = (spec.stats.num_accepted_tokens - s0[0]) / max(spec.stats.num_drafts - s0[1], 1)
            live = args.prompt_len + args.new_tokens / 2  # mean live tokens while decoding
            bound = b * bw / (weights + b * live * kvb)  # one read of weights + live KV
            best_s, best = roofline.optimal(b, live, a)
            rows.append(dict(max_model_len=max_len, batch=b, plain_tok_s=p_tps,
                             plain_tpot_ms=p_tpot * 1e3, spec_tok_s=s_tps,
                             spec_tpot_ms=s_tpot * 1e3, speedup=s_tps / p_tps,
                             accept_length=1 + acc, bound_tok_s=bound,
                             plain_vs_bound=p_tps / bound, verify_rows=b * (S + 1),
                             roofline_speedup=roofline.speedup(b, live, a, S),
                             roofline_best_draft_length=best_s, roofline_best_speedup=best,
                             speedup_vs_roofline=s_tps / p_tps / best))
            print(json.dumps(rows[-1]), flush=True)
        for name, eng, b in (("plain", plain, 64), ("plain", plain, 1), ("spec", spec, 64)):
            if not args.profile or max_len != lens[-1] or b not in batches:
                continue
            profile = step_profile(eng, b, args.prompt_len, 20,
                                   os.path.join(args.profile, f"{name}{b}"))
            print(f"\nprofile, {name} step at batch {b} (max_model_len {max_len}), "
                  "device time per step:")
            print_profile(profile)
            extra_profile[f"{name}{b}"] = {line: events[:60] for line, events in profile.items()}
        del plain, spec

    extra = {"profile": extra_profile} if args.profile else {}
    if args.long:
        plain, spec = engines(args.long + 64, args.long + 128, [1])
        for name, eng in (("plain", plain), ("spec", spec)):
            decode_rate(eng, 1, args.long - 128, 8, seed=1)
            tps, tpot, *_ = decode_rate(eng, 1, args.long - 128, 128, seed=2)
            bound = bw / (weights + args.long * kvb)
            extra[f"long_{name}"] = dict(live_tokens=args.long, tok_s=tps, tpot_ms=tpot * 1e3,
                                         bound_tok_s=bound, vs_bound=tps / bound)
            print(json.dumps({f"long_{name}": extra[f"long_{name}"]}), flush=True)
        del plain, spec
    if args.capacity_gib:
        eng = Engine(EngineConfig(
            model="random", speculative_algorithm="NONE", dtype="bfloat16",
            max_model_len=max(lens), max_num_seqs=128, batch_buckets=(128,),
            prefill_buckets=(args.prompt_len,), page_size=args.page_size,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory=int(args.capacity_gib * 2**30), compilation_cache_dir=""),
            target=target)
        tps, _, most, _ = decode_rate(eng, 128, args.prompt_len, args.new_tokens, seed=4)
        extra["capacity"] = dict(kv_gib=args.capacity_gib, max_model_len=max(lens),
                                 pool_tokens=eng.num_pages * eng.page_size,
                                 requests=128, most_running=most,
                                 preemptions=eng.num_preemptions, tok_s=tps)
        print(json.dumps({"capacity": extra["capacity"]}), flush=True)
        del eng
    hf = {}
    if args.hf:
        import subprocess

        cmd = [sys.executable, "-m", "eagle_jax.bench.engine", "--hf-only",
               "--batch-sizes", "1,64", "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens)]
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        jax.clear_caches()
        res = subprocess.run(cmd + (["--small"] if args.small else []), env=env,
                             capture_output=True, text=True)
        for line in res.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                hf[r["batch"]] = r["hf_tok_s"]
        if res.returncode:
            print(f"HF baseline failed:\n{res.stderr[-3000:]}", flush=True)

    print(f"\nweights {weights / 1e9:.2f} GB, KV {kvb / 2**10:.0f} KiB per token "
          f"({args.kv_cache_dtype} cache), copy "
          f"bandwidth {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.3g} TFLOP/s, expected "
          f"accept length {expected_len:.2f} (a = {a}, S = {S}), page size {args.page_size}; "
          "roofline: the speed-up at S and the best S's (bench/roofline.py)\n")
    print("| max_model_len | batch | plain tok/s | plain TPOT ms | bound tok/s | plain/bound | "
          "spec tok/s | spec TPOT ms | accept len | verify rows | speed-up | roofline at S | "
          "roofline best (S) | speed-up / best | HF tok/s | plain/HF |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        h = hf.get(r["batch"]) if r["max_model_len"] == lens[-1] else None
        r["hf_tok_s"] = h
        hf_cols = "- | -" if h is None else f"{h:.1f} | {r['plain_tok_s'] / h:.2f}x"
        print(f"| {r['max_model_len']} | {r['batch']} | {r['plain_tok_s']:.1f} | "
              f"{r['plain_tpot_ms']:.2f} | {r['bound_tok_s']:.1f} | {r['plain_vs_bound']:.0%} | "
              f"{r['spec_tok_s']:.1f} | {r['spec_tpot_ms']:.2f} | {r['accept_length']:.2f} | "
              f"{r['verify_rows']} | {r['speedup']:.2f}x | {r['roofline_speedup']:.2f}x | "
              f"{r['roofline_best_speedup']:.2f}x ({r['roofline_best_draft_length']}) | "
              f"{r['speedup_vs_roofline']:.2f} | {hf_cols} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, copy_gbps=bw / 1e9, matmul_tflops=flops / 1e12,
                           weight_bytes=weights, kv_cache_dtype=args.kv_cache_dtype,
                           kv_bytes_per_token=kvb, rows=rows, **extra), f, indent=2)


if __name__ == "__main__":
    main()
