"""Draft length per step: adaptive vs plain decoding and every fixed length, one run.

The Llama-3.1-8B-shaped bfloat16 target and EAGLE-3-shaped draft of bench_engine.py
(random weights), with synthetic acceptance a (each draft token accepted with
probability a). One speculative engine compiles every (batch bucket, draft length)
step once; a is a device value it reads (``Engine.set_synthetic_acceptance``) and each
cell swaps the policy: ``FixedDraftLength(s)`` for every compiled length s (0: the
target's step alone in the speculative engine, the draft catching up every
``MAX_DRAFT_LAG`` steps; beside plain decoding it shows what keeping a draft costs), and a
fresh ``AdaptiveDraftLength`` over the step times the engine measured at start-up (so
every adaptive cell pays its own learning from the prior). Plain decoding is a separate
engine without a draft. Each cell decodes ``batch`` requests of ``--new-tokens`` tokens,
or ``--cell-tokens / batch`` if more (small batches run long enough that the realised
acceptance of their steps is near a), after a ``--prompt-len`` prompt (prefill excluded
from the rate), greedy.

For every (a, batch) the table gives tok/s of plain and each fixed length, the adaptive
policy's tok/s, the lengths it chose (share of steps), and adaptive / best of the others
(the issue's bar: >= 0.97), and the same ratio of the rates while every request of the
cell ran (``DecodeRate.full_batch_tok_s``: the batch's steady state, without the tail in
which a closed batch's last requests run on alone); beside plain, its physical bound: one read of the weights
and of the live KV entries (the mean live length while decoding) per step, over the
device-to-device copy bandwidth measured in the same run. ``--plot`` draws tok/s and
adaptive / best against batch, one column per a; ``--from-json`` tables and plots saved
runs together (a grid measured in several calls).

    python scripts/bench_draft_policy.py [--acceptance 0.5,0.7,0.85] [--repeats 3]
        [--batch-sizes 1,8,32,64,128] [--json PATH] [--plot PATH] [--small]
    python scripts/bench_draft_policy.py --from-json RUN.json [RUN.json ...] [--plot PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.draft_policy import AdaptiveDraftLength, FixedDraftLength
from eagle_jax.bench.engine import decode_rate
from eagle_jax.bench.roofline import (
    Device, ModelCost, SpecRoofline, kv_bytes_per_token, weight_bytes)
from eagle_jax.bench.timing import copy_bandwidth, matmul_throughput
from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target


class RecordedPolicy:
    """A draft policy that also keeps the step cycles the engine reports to it, by
    (batch bucket, length): what the policy's step-time estimates are learnt from."""

    def __init__(self, policy):
        self.policy = policy
        self.cycles: dict[tuple[int, int], list[float]] = {}

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def observe_time(self, bucket: int, length: int, seconds: float) -> None:
        self.cycles.setdefault((bucket, length), []).append(seconds)
        self.policy.observe_time(bucket, length, seconds)

    def cycle_summary(self) -> dict[str, list[float]]:
        """'bucket,length' -> [steps, median ms, mean ms] of the reported cycles."""
        return {f"{b},{s}": [len(v), round(float(np.median(v)) * 1e3, 3),
                             round(float(np.mean(v)) * 1e3, 3)]
                for (b, s), v in sorted(self.cycles.items())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--acceptance", default="0.5,0.7,0.85")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    ap.add_argument("--draft-lengths", default="0,1,2,3,5",
                    help="compiled lengths (the largest is num_steps)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--cell-tokens", type=int, default=4096,
                    help="tokens decoded per cell at least (batch x new tokens)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measurements of each configuration per cell, interleaved (the "
                         "median is reported)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: print the table (and --plot) of saved runs")
    args = ap.parse_args(argv)
    if args.from_json:
        return from_json(args.from_json, args.plot)
    rates = [float(a) for a in args.acceptance.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    lengths = tuple(sorted({int(s) for s in args.draft_lengths.split(",")}))
    shape = SMALL if args.small else LLAMA_8B
    dtype = jnp.bfloat16
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}; {datetime.date.today()}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 1 << 30)
    flops = matmul_throughput(256 if args.small else 8192, dtype)
    t0 = time.perf_counter()
    target = random_target(shape, dtype)
    weights = weight_bytes(target)
    kv_bytes = kv_bytes_per_token(shape, jnp.dtype(dtype).itemsize)  # per live token
    draft = random_eagle3(target, dtype, min(args.draft_vocab, shape["vocab_size"]))
    roofline = SpecRoofline(ModelCost.of(target), ModelCost.of(draft), Device(bw, flops))
    def new_tokens(batch):
        return max(args.new_tokens, args.cell_tokens // batch)

    max_len = args.prompt_len + new_tokens(min(batches)) + 2 * (max(lengths) + 1) + 32
    common = dict(model="random", dtype="bfloat16", max_model_len=max_len,
                  max_num_seqs=max(batches), batch_buckets=tuple(batches),
                  prefill_buckets=(min(512, args.prompt_len),), compilation_cache_dir="")
    plain = Engine(EngineConfig(speculative_algorithm="NONE", **common), target=target)
    spec = Engine(EngineConfig(
        speculative_algorithm="EAGLE3", draft_model="random", num_steps=max(lengths),
        speculative_policy="adaptive", draft_lengths=lengths, synthetic_acceptance=rates[0],
        **common), target=target, draft=draft)
    step_seconds = dict(spec.draft_policy.step_seconds)
    print(f"built and compiled in {time.perf_counter() - t0:.0f} s; step ms by (batch, "
          "length): " + ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in step_seconds.items()),
          flush=True)
    decode_rate(plain, max(batches), args.prompt_len, 8, seed=1)  # warm-up
    decode_rate(spec, max(batches), args.prompt_len, 8, seed=1)

    plain_runs = {b: [decode_rate(plain, b, args.prompt_len, new_tokens(b), seed=2 + r)
                      for r in range(args.repeats)] for b in batches}
    # Plain decoding's bound: one read of the weights and of the live KV per step.
    bound = {b: b * bw / (weights + b * (args.prompt_len + new_tokens(b) / 2) * kv_bytes)
             for b in batches}
    fixed = list(lengths)
    rows = []
    for a in rates:
        spec.set_synthetic_acceptance(a)
        for b in batches:
            row = dict(acceptance=a, batch=b, plain_bound=bound[b])  # tok/s
            # The roofline's choice among the compiled lengths, and its speed-up.
            live = args.prompt_len + new_tokens(b) / 2
            row["roofline_draft_length"], row["roofline_speedup"] = roofline.optimal(
                b, live, a, lengths)
            # Each repetition runs every policy once, in a rotated order, on its own seed:
            # a cell's configurations see the same drift of the device.
            names = [f"fixed{s}" for s in fixed] + ["adaptive"]
            measured = {name: [] for name in names}
            measured["plain"] = plain_runs[b]
            steps = np.zeros(len(spec.stats.draft_length_steps), np.int64)
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    spec.draft_policy = RecordedPolicy(
                        AdaptiveDraftLength(lengths, step_seconds) if name == "adaptive"
                        else FixedDraftLength(int(name[len("fixed"):])))
                    before = list(spec.stats.draft_length_steps)
                    measured[name].append(decode_rate(spec, b, args.prompt_len,
                                                      new_tokens(b), seed=2 + r))
                    # The step cycles of the last repetition, by (bucket, length).
                    row[f"{name}_cycles"] = spec.draft_policy.cycle_summary()
                    if name == "adaptive":
                        steps += np.subtract(spec.stats.draft_length_steps, before)
                        # What the policy had learnt by the end of the cell (the last
                        # repetition's): its step times and acceptance estimate.
                        policy = spec.draft_policy
                        row["adaptive_step_ms"] = {
                            str(s): round(policy.step_seconds[b, s] * 1e3, 3) for s in lengths}
                        row["adaptive_acceptance"] = [round(float(x), 3)
                                                      for x in policy.acceptance]
            row["adaptive_lengths"] = {str(s): int(steps[s]) for s in lengths if steps[s]}
            # Two rates per configuration (bench_engine.DecodeRate): the closed batch's
            # (until its last request finished) and its full-batch steady state.
            for suffix, field in (("", "tok_s"), ("_full", "full_batch_tok_s")):
                for name, runs in measured.items():
                    row[f"{name}{suffix}_tok_s"] = float(np.median([getattr(m, field)
                                                                    for m in runs]))
                others = [name for name in measured if name != "adaptive"]
                best = max(others, key=lambda name: row[f"{name}{suffix}_tok_s"])
                row[f"best_other{suffix}"] = best
                row[f"adaptive_vs_best{suffix}"] = (row[f"adaptive{suffix}_tok_s"]
                                                    / row[f"{best}{suffix}_tok_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\nsynthetic acceptance per token, S <= {max(lengths)}, prompt {args.prompt_len}, "
          f"max({args.new_tokens}, {args.cell_tokens} / batch) new tokens, greedy; tok/s "
          f"(decode; the median of {args.repeats} interleaved runs)\n")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; matmul {flops / 1e12:.3g} TFLOP/s; weights "
          f"{weights / 1e9:.2f} GB; KV {kv_bytes / 1024:.0f} KiB per live token; roofline: "
          "the best compiled length and its speed-up over plain (bench/roofline.py)\n")
    print_table(rows, fixed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, date=str(datetime.date.today()), lengths=lengths,
                           copy_bandwidth=bw, matmul_flops=flops, weight_bytes=weights,
                           kv_bytes_per_token=kv_bytes,
                           step_seconds={f"{b},{s}": v for (b, s), v in step_seconds.items()},
                           prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                           cell_tokens=args.cell_tokens, repeats=args.repeats,
                           rows=rows), f, indent=2)
    if args.plot:
        plot(rows, fixed, f"draft length per step, {device}", args.plot)


def print_table(rows: list[dict], fixed: list[int]) -> None:
    head = (["a", "batch", "plain", "plain / bound"] + [f"fixed {s}" for s in fixed]
            + ["adaptive", "lengths chosen (share of steps)", "roofline length (speed-up)",
               "adaptive speed-up / roofline's", "adaptive / best",
               "full batch: adaptive / best"])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        total = sum(r["adaptive_lengths"].values())
        chosen = " ".join(f"{s}:{n / total:.0%}" for s, n in r["adaptive_lengths"].items())
        roof = ("- | -" if "roofline_speedup" not in r else  # (runs before the roofline)
                f"{r['roofline_draft_length']} ({r['roofline_speedup']:.2f}x) | "
                f"{r['adaptive_tok_s'] / r['plain_tok_s'] / r['roofline_speedup']:.2f}")
        print(f"| {r['acceptance']} | {r['batch']} | {r['plain_tok_s']:.0f} | "
              f"{r['plain_tok_s'] / r['plain_bound']:.0%} | " + " | ".join(
            f"{r[f'fixed{s}_tok_s']:.0f}" for s in fixed) + f" | {r['adaptive_tok_s']:.0f} | "
            f"{chosen} | {roof} | {r['adaptive_vs_best']:.3f} ({r['best_other']}) | "
            f"{r['adaptive_vs_best_full']:.3f} ({r['best_other_full']}) |")
    for suffix, what in (("", "closed batch"), ("_full", "full batch")):
        worst = min(r[f"adaptive_vs_best{suffix}"] for r in rows)
        print(f"worst cell, {what}: adaptive / best = {worst:.3f}")


def plot(rows: list[dict], fixed: list[int], title: str, path: str) -> None:
    """Per acceptance a: tok/s of every configuration against batch (top), and adaptive /
    best of the others, closed batch and full batch, against the issue's 0.97 (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["acceptance"] for r in rows})
    fig, axes = plt.subplots(2, len(rates), figsize=(5 * len(rates), 7), squeeze=False,
                             sharex=True, height_ratios=(2, 1))
    for col, a in enumerate(rates):
        sel = sorted((r for r in rows if r["acceptance"] == a), key=lambda r: r["batch"])
        xs = [r["batch"] for r in sel]
        ax = axes[0][col]
        ax.plot(xs, [r["plain_tok_s"] for r in sel], "k--", label="plain")
        for s in fixed:
            ax.plot(xs, [r[f"fixed{s}_tok_s"] for r in sel], alpha=0.6, label=f"fixed {s}")
        ax.plot(xs, [r["adaptive_tok_s"] for r in sel], "r-o", lw=2, label="adaptive")
        ax.set_yscale("log")
        ax.set_title(f"synthetic acceptance a = {a}")
        ax.set_ylabel("decode tok/s")
        ax = axes[1][col]
        ax.plot(xs, [r["adaptive_vs_best"] for r in sel], "r-o", label="closed batch")
        ax.plot(xs, [r["adaptive_vs_best_full"] for r in sel], "b-s", label="full batch")
        ax.axhline(0.97, color="k", ls=":", label="0.97")
        ax.set_ylabel("adaptive / best other")
        ax.set_xlabel("batch")
        ax.set_xscale("log", base=2)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    axes[1][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def from_json(paths: list[str], plot_path: str | None) -> None:
    """The table (and plot) of saved runs (``--json``), their rows together: a grid
    measured in several calls."""
    runs = [json.load(open(p)) for p in paths]
    fixed = [s for s in runs[0]["lengths"]]
    rows = sorted((r for run in runs for r in run["rows"]),
                  key=lambda r: (r["acceptance"], r["batch"]))
    for p, run in zip(paths, runs):
        print(f"{p}: {run['device']}, {run['date']}, batches "
              f"{sorted({r['batch'] for r in run['rows']})}, repeats {run['repeats']}")
    print()
    print_table(rows, fixed)
    if plot_path:
        plot(rows, fixed, f"draft length per step, {runs[0]['device']} "
                          f"({len(runs)} runs)", plot_path)
