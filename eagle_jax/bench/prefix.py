"""Prefix caching and prefill that rides along with decoding, on the engine.

The Llama-3.1-8B-shaped bfloat16 target and EAGLE-3 draft of ``bench_engine.py``
(random weights; the speculative engine fixes its accept length with
``synthetic_acceptance``); every executable a timed request runs is compiled before
timing (the time-to-first-token engines compile lazily, by warm-up requests).

1. **Time to first token** of a request whose prompt is a ``--prefix``-token prefix
   another request computed before plus a ``--suffix``-token suffix (a prefix-cache hit),
   against the same request with a prefix no one computed (a miss), and against an
   engine without the prefix cache. Medians of ``--repeats`` requests, one at a time,
   each asking for ``--ttft-max-tokens`` tokens (16, as a client would). Before
   2026-12-03's fifth session the script asked for 1: such a request ends at its
   prefill, so its first token also waits for the request's release, and the earlier
   ratios in docs/history/ (issue 14's files up to 2026-12-03) are of such requests.
   A fresh prompt of the hit's computed length (``fresh``) shows what the hit costs
   beyond its own tokens (attention over the cached prefix), and miss / fresh is the
   most the ratio can reach: a hit computes those positions too, so it is never faster
   than the fresh prompt. A third request on the prefix (``third``) is a hit after a
   hit: a hit right after its miss also pays XLA's update of the prefill's CUDA graph,
   whose buffers the miss's larger chunks moved. Below both, the hit's read floor: the
   bytes its prefill must read (``hit_read_floor``) over the copy bandwidth measured in
   the same run, and miss / floor, the most the ratio could be on the device.
2. **Streams while a long prompt arrives**: ``--streams`` requests decode; once every
   stream has its first token (all running: their own prompts' prefill is not what is
   measured) and ``--arrive-after`` steps more, a ``--long``-token prompt arrives. For
   each ``--budgets`` value (``max_num_batched_tokens``) the table gives the streams'
   inter-token time at the median and at p99, their ratio, the worst, and the long
   prompt's time to first token.
   The inter-token time is the gap between two outputs of a stream: one engine step,
   which commits several tokens at once when speculation accepts (per-token gaps would
   measure the accept length's spread, not stalls). A budget of 0 is the run without
   mixing: the long prompt in one chunk (the prefill buckets extended to hold it, the
   budget to hold it and the streams' rows), so one step stalls the streams for its whole
   prefill. Other budgets carry chunks of at most the largest default prefill bucket.
   Every prompt is drawn afresh: no prefix cache hit.

    python scripts/bench_prefix.py [--prefix 2048 --suffix 64] [--ttft-max-tokens 16]
        [--streams 32 --long 8192]
        [--budgets 256,320,704,0] [--small] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax import SamplingParams
from eagle_jax.argtypes import positive_int
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.config import DEFAULT_PREFILL_BUCKETS
from eagle_jax.engine.executables import jit_compile
from eagle_jax.bench.roofline import kv_bytes_per_token, weight_bytes
from eagle_jax.bench.timing import copy_bandwidth, device_ms_per_op, print_profile
from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target


class _PrefillTimer:
    """Times where a request's first token goes: the host's work before the prefill
    executable is called (admission, prefix match, slot assignment), the call's dispatch
    (until it returns: argument handling and the launch of XLA's command buffers), the
    wait until its output is ready (the device's work), and the host's work after
    (first token's read and commit). Its ``compile_fn`` is the engine's (the seam through
    which the engine builds its executables): it wraps each prefill executable, which
    then waits for its output while the timer is ``active``."""

    def __init__(self):
        self.calls: list[tuple[float, float, float]] = []  # (call, returned, ready)
        self.records: list[tuple[float, ...]] = []  # (before, dispatch, wait, after)
        self.active = False

    def compile_fn(self, key, fn, example_args, donate_argnums):
        run = jit_compile(key, fn, example_args, donate_argnums)
        if key.name != "prefill":
            return run

        def call(*args):
            if not self.active:
                return run(*args)
            t0 = time.perf_counter()
            out = run(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)  # the engine reads it next anyway
            self.calls.append((t0, t1, time.perf_counter()))
            return out
        return call

    def record(self, t0: float, t_first: float) -> None:
        """Splits one request's time to first token at its prefill calls."""
        calls = [c for c in self.calls if c[0] >= t0]  # (not an untimed request's)
        self.calls.clear()
        start, ready = calls[0][0], calls[-1][2]
        dispatch = sum(t1 - t0 for t0, t1, _ in calls)
        self.records.append((start - t0, dispatch, ready - start - dispatch, t_first - ready))

    def medians(self) -> dict:
        """Milliseconds of each part, medians over the recorded requests."""
        before, dispatch, wait, after = (1e3 * statistics.median(x) for x in zip(*self.records))
        return dict(host_before_ms=before, prefill_dispatch_ms=dispatch,
                    prefill_wait_ms=wait, host_after_ms=after)


def _first_token_time(engine: Engine, rid: str, prompt: list[int], max_tokens: int = 1,
                      timer: _PrefillTimer | None = None) -> float:
    """Seconds from add_request to the output carrying the request's first token; the
    request then runs to its end. With ``timer``, it also records where the time went."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
                if timer is not None:
                    timer.record(t0, t0 + ttft)
    return ttft


def ttft_rows(engines: dict[str, Engine], timers: dict[str, _PrefillTimer], args,
              vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    n = args.ttft_max_tokens
    for name, engine in engines.items():
        # The engines compile lazily: these requests compile what the timed ones run (a
        # miss's chunks, a hit's, a fresh prompt's, the decode steps), checked below.
        warm = [int(t) for t in rng.integers(10, vocab, args.prefix + args.suffix)]
        _first_token_time(engine, f"{name}-warm", warm, n)
        before = engine.prefix_cache_hits
        _first_token_time(engine, f"{name}-warm-hit", warm[:args.prefix] + warm[:args.suffix], n)
        computed = args.prefix + args.suffix - (engine.prefix_cache_hits - before)
        _first_token_time(engine, f"{name}-warm-fresh",
                          [int(t) for t in rng.integers(10, vocab, computed)], n)
        compiled = engine.num_compiled
        miss, hit, third, cached, fresh = [], [], [], [], []
        for r in range(args.repeats):
            prefix = [int(t) for t in rng.integers(10, vocab, args.prefix)]
            suffix = lambda: [int(t) for t in rng.integers(10, vocab, args.suffix)]  # noqa: E731
            miss.append(_first_token_time(engine, f"{name}-m{r}", prefix + suffix(), n))
            before = engine.prefix_cache_hits
            hit.append(_first_token_time(engine, f"{name}-h{r}", prefix + suffix(), n))
            cached.append(engine.prefix_cache_hits - before)
            # A hit after a hit. Right after its miss, whose 512-position chunks ran
            # just before the 128-position prefill's last run, XLA first updates that
            # prefill's CUDA graph (its buffers lie elsewhere now); after a hit it does
            # not (docs/history/2026-12-04-issue-14-prefix-caching.md, third session).
            third.append(_first_token_time(engine, f"{name}-t{r}", prefix + suffix(), n))
            computed = args.prefix + args.suffix - cached[-1]
            fresh.append(_first_token_time(engine, f"{name}-f{r}", [
                int(t) for t in rng.integers(10, vocab, computed)], n))
        if engine.num_compiled != compiled:
            raise SystemExit(f"{name}: the timed requests compiled "
                             f"{engine.num_compiled - compiled} executable(s) the warm-up "
                             "did not: their times include compiles; warm those shapes up")
        row = dict(engine=name, prefix=args.prefix, suffix=args.suffix, max_tokens=n,
                   miss_ttft_ms=1e3 * statistics.median(miss),
                   second_ttft_ms=1e3 * statistics.median(hit),
                   third_ttft_ms=1e3 * statistics.median(third),
                   cached_tokens=int(statistics.median(cached)),
                   fresh_ttft_ms=1e3 * statistics.median(fresh))
        row["ratio"] = row["miss_ttft_ms"] / row["second_ttft_ms"]
        row["ratio_ceiling"] = row["miss_ttft_ms"] / row["fresh_ttft_ms"]
        # Where a hit's time goes, in requests of their own: the timer waits for each
        # prefill call, which the timed requests above do not.
        timer = timers[name]
        timer.active = True
        for r in range(args.repeats):
            prefix = [int(t) for t in rng.integers(10, vocab, args.prefix)]
            _first_token_time(engine, f"{name}-pm{r}", prefix + [1] * args.suffix, n)
            _first_token_time(engine, f"{name}-ph{r}", prefix + [2] * args.suffix, n, timer)
        timer.active = False
        row["hit_phases"] = timer.medians()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def hit_read_floor(target, draft, num_positions: int) -> int:
    """Bytes a prefix-cache hit's prefill must read at least once: the target's and the
    draft's weights (``weight_bytes``: the embedding's rows aside) and both models' KV of
    its ``num_positions`` positions, the cached prefix and its own. Over the copy
    bandwidth it is the hit's physical floor, and miss / floor the most its ratio can
    reach on the device (docs/BENCHMARKS.md, "Prefix caching": a fresh prompt of the hit's
    length, the measured ceiling, is no faster than this floor either)."""
    t, d = target.config, draft.config
    itemsize = target.embed_tokens.weight[...].dtype.itemsize
    kv = kv_bytes_per_token(dict(num_layers=t.num_layers, num_kv_heads=t.num_kv_heads,
                                 head_dim=t.head_dim), itemsize)
    kv += 2 * d.num_kv_heads * d.head_dim * itemsize  # the draft's one layer
    return weight_bytes(target) + weight_bytes(draft) + num_positions * kv


def hit_profile(engine: Engine, args, vocab: int, out_dir: str, requests: int = 4):
    """Device time per op of a prefix-cache hit's time to first token (the prefixes are
    computed outside the trace)."""
    rng = np.random.default_rng(7)
    prompts = []
    for r in range(requests):
        prefix = [int(t) for t in rng.integers(10, vocab, args.prefix)]
        _first_token_time(engine, f"pre{r}", prefix + [int(t) for t in rng.integers(10, vocab, 8)])
        prompts.append(prefix + [int(t) for t in rng.integers(10, vocab, args.suffix)])
    with jax.profiler.trace(out_dir):
        for r, prompt in enumerate(prompts):
            _first_token_time(engine, f"hitp{r}", prompt)
        jax.effects_barrier()
    return device_ms_per_op(out_dir, requests)


class _GcPauses:
    """Wall time of the interpreter's garbage collections while active (a stall source
    that is neither the device nor the scheduler)."""

    def __init__(self):
        self.pauses, self._t0 = [], None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def _phase_summary(steps: list[tuple[str, float]]) -> dict:
    """Step wall times (ms) by where the long prompt was: median, p99, max, count."""
    out = {}
    for phase in dict.fromkeys(p for p, _ in steps):
        ms = np.asarray([t for p, t in steps if p == phase]) * 1e3
        out[phase] = dict(steps=len(ms), median_ms=float(np.median(ms)),
                          p99_ms=float(np.percentile(ms, 99)), max_ms=float(ms.max()))
    return out


def streams_row(engine: Engine, budget: int, args, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{budget}-{i}", [int(t) for t in rng.integers(10, vocab, 128)],
                           params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    long_id, long_t0, long_ttft = f"long{budget}", None, None
    steps = 0  # since every stream is running
    phase = "start"  # the streams' prompts; then the long prompt: before / prefill / ...
    step_times: list[tuple[str, float]] = []
    with _GcPauses() as pauses:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            step_times.append((phase, now - t0))
            steps += phase != "start"
            for o in outs:
                if o.request_id == long_id:
                    if o.new_token_ids and long_ttft is None:
                        long_ttft = now - long_t0
                        phase = "decode"
                    if o.finished:
                        phase = "done"
                    continue
                if not o.new_token_ids:
                    continue
                if o.request_id in last and phase != "start":
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
            if phase == "start" and len(last) == args.streams:
                phase = "before"
            if phase == "before" and steps == args.arrive_after:
                phase = "prefill"
                long_t0 = time.perf_counter()
                engine.add_request(long_id, [int(t) for t in rng.integers(10, vocab, args.long)],
                                   SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    gaps_ms = np.asarray(gaps) * 1e3
    median, p99 = float(np.median(gaps_ms)), float(np.percentile(gaps_ms, 99))
    return dict(budget=budget, streams=args.streams, long=args.long, itl_median_ms=median,
                itl_p99_ms=p99, p99_over_median=p99 / median, itl_max_ms=float(gaps_ms.max()),
                long_ttft_ms=1e3 * long_ttft, step_ms_by_phase=_phase_summary(step_times),
                slowest_steps=[dict(step=i, phase=p, ms=1e3 * t) for i, (p, t) in sorted(
                    enumerate(step_times), key=lambda x: -x[1][1])[:12]],
                gc_pauses_over_1ms=[(g, 1e3 * t) for g, t in pauses.pauses if t > 1e-3])


def _check_memory(kv_bytes: int, engines: int, headroom: int = 4 << 30) -> None:
    """Stops, naming the fix, where ``engines`` KV pools of ``kv_bytes`` beside the models
    (already on the device) and ``headroom`` for activations would not fit JAX's share
    of the device. The engine itself refuses a pool larger than the free memory, but
    only as it is built, and with no room kept for activations: a pool that leaves too
    little fails later, in the allocator's retries."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return  # a CPU: no fixed limit to check
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if engines * kv_bytes + headroom > free:
        most = max((free - headroom) // engines >> 30, 0)
        raise SystemExit(
            f"{engines} engine(s) of {kv_bytes / (1 << 30):.1f} GiB KV each need "
            f"{(engines * kv_bytes + headroom) / (1 << 30):.1f} GiB beside the models; "
            f"{free / (1 << 30):.1f} GiB of JAX's device memory are free: pass "
            f"--kv-cache-gib {most} or less (or raise XLA_PYTHON_CLIENT_MEM_FRACTION)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ttft-max-tokens", type=positive_int, default=16,
                    help="tokens each timed request asks for (1: it ends at its prefill)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=512)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--arrive-after", type=int, default=8, help="steps before it arrives")
    ap.add_argument("--budgets", default="256,320,704,0",
                    help="max_num_batched_tokens per run; 0: the long prompt in one chunk")
    EngineConfig.add_cli_args(ap, include=("num_steps",))
    ap.add_argument("--acceptance", type=float, default=0.83)
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV pool in GiB (default 24; 0.25 with --small); the "
                         "ttft part holds two engines at once")
    ap.add_argument("--only", default="ttft,streams", help="parts to run (comma-separated)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default="", help="trace prefix-cache hits into DIR and "
                    "print their device time per op (then exit)")
    ap.add_argument("--compilation-cache", default="/tmp/eagle_jax_bench_cache",
                    help="JAX's persistent cache: engines of the same shapes compile once")
    args = ap.parse_args(argv)
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        ap.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    shape = SMALL if args.small else LLAMA_8B
    dtype = jnp.bfloat16
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 1 << 30)  # (before the models fill it)
    target = random_target(shape, dtype)
    draft = random_eagle3(target, dtype, min(32000, shape["vocab_size"]))
    floor_ms = 1e3 * hit_read_floor(target, draft, args.prefix + args.suffix) / bw
    vocab = shape["vocab_size"]
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else 0.25 if args.small else 24
    kv_bytes = int(kv_gib * (1 << 30))
    _check_memory(kv_bytes, engines=2 if "ttft" in args.only.split(",") and not args.profile
                  else 1)
    max_len = max(args.long, args.prefix + args.suffix) + 512
    budgets = [int(b) for b in args.budgets.split(",")]

    def engine(caching=True, budget=2048, slots=8, buckets=(1, 8),
               prefill=DEFAULT_PREFILL_BUCKETS, precompile=True, timer=None):
        return Engine(EngineConfig(
            model="random", draft_model="random", speculative_algorithm="EAGLE3",
            num_steps=args.num_steps, speculative_policy="fixed",
            synthetic_acceptance=args.acceptance, dtype="bfloat16",
            max_model_len=max_len, max_num_seqs=slots, batch_buckets=buckets,
            kv_cache_memory=kv_bytes,
            enable_prefix_caching=caching, max_num_batched_tokens=budget,
            prefill_buckets=prefill,
            precompile=precompile, compilation_cache_dir=args.compilation_cache),
            target=target, draft=draft,
            compile_fn=jit_compile if timer is None else timer.compile_fn)

    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=shape,
                  num_steps=args.num_steps, acceptance=args.acceptance, copy_gbs=bw / 1e9,
                  hit_read_floor_ms=floor_ms)
    parts = args.only.split(",")
    if args.profile:
        on = engine(budget=16384, precompile=False)
        _first_token_time(on, "warm", [int(t) for t in np.arange(args.prefix + args.suffix) % vocab])
        print(f"device time per prefix-cache hit ({args.prefix} cached + {args.suffix}):")
        print_profile(hit_profile(on, args, vocab, args.profile), top=40)
        return
    # Compiled lazily, by their warm-up requests: all 29 buckets of two engines take over
    # 9 minutes on an H200, more than one device call
    # (docs/history/2026-12-06-issue-14-prefix-caching.md).
    timers = {name: _PrefillTimer() for name in ("prefix caching", "no prefix caching")}
    result["ttft"] = [] if "ttft" not in parts else ttft_rows(
        {name: engine(caching=name == "prefix caching", budget=16384, precompile=False,
                      timer=timer) for name, timer in timers.items()},
        timers, args, vocab)
    for row in result["ttft"]:
        row["ratio_read_floor"] = row["miss_ttft_ms"] / floor_ms
    result["streams"] = []
    slots = 1 << (args.streams).bit_length()  # the streams and the long prompt
    for budget in budgets if "streams" in parts else []:
        rows = -(-args.long // (args.num_steps + 1))  # of the verify width, for the chunk
        one_chunk = dict(budget=(rows + slots) * (args.num_steps + 1),
                         prefill=DEFAULT_PREFILL_BUCKETS + (rows * (args.num_steps + 1),))
        eng = engine(slots=slots, buckets=(args.streams, slots),
                     **(one_chunk if budget == 0 else dict(budget=budget)))
        # Warm-up: the long prompt arrives too (every executable of the timed run runs).
        streams_row(eng, budget, dict_args(args, stream_tokens=64, arrive_after=2), vocab, seed=1)
        result["streams"].append(streams_row(eng, budget, args, vocab, seed=2))
        print(json.dumps(result["streams"][-1]), flush=True)
        del eng
    print(f"\nTime to first token, requests of max_tokens={args.ttft_max_tokens}:")
    print("| engine | TTFT miss (ms) | TTFT second request (ms) | TTFT third request (ms) | "
          "cached tokens | miss / second | TTFT fresh prompt of the computed length (ms) | "
          "miss / fresh (the ratio's ceiling) | miss / the hit's read floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["ttft"]:
        print(f"| {r['engine']} | {r['miss_ttft_ms']:.1f} | {r['second_ttft_ms']:.1f} | "
              f"{r['third_ttft_ms']:.1f} | {r['cached_tokens']} | {r['ratio']:.1f}x | "
              f"{r['fresh_ttft_ms']:.1f} | {r['ratio_ceiling']:.1f}x | "
              f"{r['ratio_read_floor']:.1f}x |")
    print(f"The hit's read floor: {floor_ms:.2f} ms (the target's and the draft's weights a "
          f"forward reads and the KV of {args.prefix + args.suffix} positions, at the copy "
          f"bandwidth of {bw / 1e9:.0f} GB/s measured in this run)")
    for r in result["ttft"]:
        print(f"{r['engine']}, second request: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["hit_phases"].items()))
    print(f"\n| max_num_batched_tokens | ITL median (ms) | ITL p99 (ms) | p99 / median | "
          f"worst (ms) | {args.long}-token prompt TTFT (ms) |")
    print("|---|---|---|---|---|---|")
    for r in result["streams"]:
        print(f"| {r['budget'] or 'one chunk (no mixing)'} | {r['itl_median_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
              f"{r['p99_over_median']:.2f} | {r['itl_max_ms']:.1f} | {r['long_ttft_ms']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def dict_args(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})

