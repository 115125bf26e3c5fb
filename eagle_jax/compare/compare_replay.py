"""XLA vs op-by-op vs torch graph-replay comparison (``scripts/compare_replay.py``).

One workload (the same prompts, per-request seeds and sampling parameters) runs through:

1. ``xla``: the engine as served -- one ``jax.jit``-compiled step per batch bucket over
   static, donated buffers (the JAX stand-in for CUDA-graph capture / replay);
2. ``eager``: the same pure step functions (``spec_step``, ``prefill_chunks``, ...)
   evaluated op by op (one dispatch per primitive, no fusion, no donation) -- the
   analogue of ``--disable-cuda-graph`` (``eagle_jax.compare.engines.eager_compile``);
3. ``torch-replay``: where torch sees a CUDA / HIP GPU, a torch CUDA-graph reference of
   the sampling stage reproducing seed 004 and its copy-out fix
   (``eagle_jax.compare.torch_replay``); otherwise "skipped: no torch GPU".

Requests alternate greedy (even index, temperature 0) and sampled (odd index,
``--temperature``), in one batch, so that every step mixes both kinds of rows (seed 001).

Pass criteria for modes 1 vs 2 (exit status 1 when any fails):

* greedy requests: token-for-token identical (float32).
* sampled requests: mean token agreement (common prefix / length) >= ``--min-agreement``
  (default 0.9). Why not 1.0: XLA fusion reorders float32 reductions (softmax sums,
  matmul accumulation), so p and q differ between the paths by ~1e-7..1e-6 relative; a
  draw changes only when its uniform lands within that distance of a decision boundary
  (``u * q(d) < p(d)`` or one of the CDF edges), i.e. with probability about (relative
  error) x (number of CDF edges with non-negligible mass): ~1e-5..1e-4 per draw, well
  under one flip per default workload (~3 sampled requests x 24 tokens x (S + 2)
  draws). A flip forks the rest of that request, costing at most 1 / (sampled requests)
  of the mean; a real fault (a stale or recycled buffer, a wrong token) forks every
  request within a few tokens and lands far below 0.9.
* ``--dtype bfloat16``: the unfused path rounds every intermediate to bf16 while XLA
  keeps fused intermediates in f32, ~1e-2 relative. Greedy requests then need token
  agreement >= ``--min-agreement`` (near-ties may flip); sampled requests are reported
  but not checked (their draws are not expected to agree).
* in both modes: no committed id outside [0, vocab), no non-finite or otherwise
  malformed draft probability, no sampler fallback.

Exit status: 0 pass, 1 a criterion failed, 2 usage error (models missing, bad flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np

from eagle_jax.argtypes import positive_int
from eagle_jax.engine.config import EngineConfig
from eagle_jax.eval import metrics
from eagle_jax.eval.models import EXIT_NO_MODEL, ModelsMissing, detect_algorithm, resolve_pair

MODES = ("xla", "eager", "torch-replay")
DEFAULT_MIN_AGREEMENT = 0.9


def _modes(s: str) -> list[str]:
    vals = [x.strip() for x in s.split(",") if x.strip()]
    bad = [v for v in vals if v not in MODES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {s!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    from eagle_jax.compare.engines import PERTURB_KINDS

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--algorithm", default="auto", help="EAGLE, EAGLE3, NONE or auto")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=None,
                   help="prompts from a dataset (evaluate.py formats); default: random ids")
    g.add_argument("--limit", type=positive_int, default=None)
    g.add_argument("--num-prompts", type=positive_int, default=6)
    g.add_argument("--prompt-len", type=positive_int, default=12,
                   help="length of the random prompts (default 12)")
    g.add_argument("--max-tokens", type=positive_int, default=24)
    g.add_argument("--temperature", type=float, default=1.0,
                   help="temperature of the sampled (odd-index) requests")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--batch-size", type=positive_int, default=4, help="engine slots")
    # The engine's flags it varies (EngineConfig.add_cli_args); the seed is the engine's
    # and request i's is seed + i.
    EngineConfig.add_cli_args(
        p, include=("model", "draft_model", "dtype", "num_steps", "draft_sample_method",
                    "max_model_len", "seed", "batch_buckets", "prefill_buckets",
                    "compilation_cache_dir"),
        defaults=dict(dtype="float32", num_steps=3, max_model_len=128))
    g = p.add_argument_group("comparison")
    g.add_argument("--modes", type=_modes, default=list(MODES),
                   help="comma-separated subset of xla,eager,torch-replay (default all)")
    g.add_argument("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT,
                   help="least mean token agreement of sampled requests (default 0.9)")
    g.add_argument("--perturb", nargs="?", const="weight-noise", default="none",
                   choices=PERTURB_KINDS,
                   help="test hook: perturb the jitted decode step: weight-noise (the "
                        "default when the flag is given bare: the target's parameters "
                        "scaled by 1 + scale * N(0, 1) inside the step) or flip-token (the "
                        "last token of every step replaced by its successor)")
    g.add_argument("--perturb-scale", type=float, default=0.5,
                   help="relative standard deviation of the weight noise (default 0.5)")
    g.add_argument("--replay-steps", type=positive_int, default=32,
                   help="decode steps of the torch replay reference")
    g.add_argument("--json", default=None, metavar="PATH")
    return p


# ---------------------------------------------------------------------------- modes
@dataclasses.dataclass
class ModeResult:
    mode: str
    tokens: list[list[int]]
    records: list
    stats: dict
    nonfinite_draft_probs: int | None  # None: greedy drafting, q is implicit one-hot
    wall_s: float
    setup_s: float


class _NonFiniteCounter:
    """``draft_probs_hook``: counts non-finite draft-probability entries, returns q as is.

    Attached only with probabilistic drafting (where the step materialises q anyway),
    so the hook never changes what the sampler is given.
    """

    def __init__(self):
        self.count = 0

    def _add(self, n):
        self.count += int(n)

    def __call__(self, q):
        import jax
        import jax.numpy as jnp

        jax.debug.callback(self._add, jnp.sum(~jnp.isfinite(q)))
        return q


def _run_mode(mode: str, config, tokenizer, prompts, params, perturb, perturb_scale):
    from eagle_jax.compare.engines import make_engine
    from eagle_jax.engine import LLM

    counter = _NonFiniteCounter() if (config.speculative and
                                      config.draft_sample_method == "probabilistic") else None
    t0 = time.perf_counter()
    engine, recorder = make_engine(mode, config, tokenizer=tokenizer,
                         perturb=perturb if mode == "xla" else "none",
                         perturb_scale=perturb_scale, draft_probs_hook=counter)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = LLM(engine=engine).generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    order = {o.request_id: i for i, o in enumerate(outs)}
    # Records keyed by request index, in step order.
    records = [dataclasses.replace(r, request_id=str(order[r.request_id]))
               for r in recorder.step_records]
    return ModeResult(mode, [list(o.token_ids) for o in outs], records,
                      dataclasses.asdict(engine.stats),
                      None if counter is None else counter.count, wall, setup)


def _mode_summary(res: ModeResult, num_steps: int, vocab: int) -> dict:
    acc = metrics.accept_summary(res.records, num_steps) if num_steps else None
    stray = sum(1 for t in res.tokens for x in t if not 0 <= x < vocab)
    return {
        "mode": res.mode,
        "mean_accept_length": None if acc is None else acc["mean_accept_length"],
        "acceptance_per_position": None if acc is None else acc["acceptance_per_position"],
        "num_drafts": None if acc is None else acc["num_drafts"],
        "num_accepted_tokens": None if acc is None else acc["num_accepted_tokens"],
        "nonfinite_draft_probs": res.nonfinite_draft_probs,
        "malformed_draft_probs": res.stats["num_malformed_draft_probs"],
        "sampler_fallbacks": res.stats["num_sampler_fallbacks"],
        "tokens_ge_vocab": res.stats["num_invalid_tokens"] + stray,
        "num_output_tokens": sum(len(t) for t in res.tokens),
        "setup_s": res.setup_s, "wall_s": res.wall_s,
    }


def _agreement(a: ModeResult, b: ModeResult, greedy: list[bool]) -> dict:
    per = [metrics.token_agreement(x, y) for x, y in zip(a.tokens, b.tokens)]
    first_diff = [None if x == y else metrics.common_prefix(x, y)
                  for x, y in zip(a.tokens, b.tokens)]

    def part(sel):
        idx = [i for i, g in enumerate(greedy) if g == sel]
        if not idx:
            return None
        return {"requests": len(idx), "identical": sum(a.tokens[i] == b.tokens[i] for i in idx),
                "token_agreement": sum(per[i] for i in idx) / len(idx),
                "first_difference": {str(i): first_diff[i] for i in idx
                                     if first_diff[i] is not None}}

    # Accept lengths of the request-steps both runs made, in order.
    def by_req(res):
        out = {}
        for r in res.records:
            out.setdefault(r.request_id, []).append(r.accept_len)
        return out

    ra, rb = by_req(a), by_req(b)
    same = total = 0
    for rid in ra:
        for x, y in zip(ra[rid], rb.get(rid, [])):
            total += 1
            same += x == y
    return {"modes": [a.mode, b.mode], "greedy": part(True), "sampled": part(False),
            "accept_len_step_agreement": same / total if total else None}


def _verdict(agree: dict, summaries: list[dict], min_agreement: float, dtype: str):
    failures = []
    g, s = agree["greedy"], agree["sampled"]
    if g is not None:
        if dtype == "float32":
            if g["identical"] != g["requests"]:
                failures.append(f"greedy: {g['requests'] - g['identical']} of {g['requests']} "
                                f"requests differ between {' and '.join(agree['modes'])} "
                                "(float32 greedy must be token-for-token equal)")
        elif g["token_agreement"] < min_agreement:
            failures.append(f"greedy ({dtype}): token agreement {g['token_agreement']:.3f} < "
                            f"{min_agreement}")
    if s is not None and dtype == "float32" and s["token_agreement"] < min_agreement:
        failures.append(f"sampled: token agreement {s['token_agreement']:.3f} < {min_agreement}")
    for m in summaries:
        for key, what in (("tokens_ge_vocab", "token id(s) outside the vocabulary"),
                          ("nonfinite_draft_probs", "non-finite draft probabilities"),
                          ("malformed_draft_probs", "malformed draft probabilities"),
                          ("sampler_fallbacks", "sampler fallback emissions")):
            if m.get(key):
                failures.append(f"{m['mode']}: {m[key]} {what}")
    return failures


def format_report(report: dict) -> str:
    lines = [f"compare_replay: {report['config']['algorithm']} S={report['config']['num_steps']} "
             f"{report['config']['draft_sample_method']} drafting, {report['config']['dtype']}, "
             f"{report['workload']['num_requests']} requests "
             f"({report['workload']['num_greedy']} greedy, "
             f"{report['workload']['num_sampled']} sampled at T="
             f"{report['config']['temperature']:g}), {report['config']['max_tokens']} tokens each"
             + (f"; PERTURBED jitted step: {report['config']['perturb']}"
                if report["config"]["perturb"] != "none" else "")]
    head = (f"  {'mode':14s} {'accept':>6s} {'non-finite q':>12s} {'malformed q':>11s} "
            f"{'fallbacks':>9s} {'ids>=vocab':>10s} {'run s':>7s}  acc@pos")
    lines.append(head)
    for m in report["modes"]:
        nf = "n/a" if m["nonfinite_draft_probs"] is None else str(m["nonfinite_draft_probs"])
        acc = ("-" if m["acceptance_per_position"] is None
               else " ".join(f"{a:.2f}" for a in m["acceptance_per_position"]))
        mal = m["mean_accept_length"]
        lines.append(f"  {m['mode']:14s} {'-' if mal is None else format(mal, '.2f'):>6s} "
                     f"{nf:>12s} {m['malformed_draft_probs']:11d} {m['sampler_fallbacks']:9d} "
                     f"{m['tokens_ge_vocab']:10d} {m['wall_s']:7.1f}  {acc}")
    a = report.get("agreement")
    if a:
        for kind in ("greedy", "sampled"):
            part = a[kind]
            if part is None:
                continue
            fd = part["first_difference"]
            lines.append(f"  agreement {a['modes'][0]} vs {a['modes'][1]}, {kind}: "
                         f"{part['identical']}/{part['requests']} requests identical, token "
                         f"agreement {part['token_agreement']:.3f}"
                         + (f" (first differences at {fd})" if fd else ""))
        if a["accept_len_step_agreement"] is not None:
            lines.append(f"  accept lengths equal on {a['accept_len_step_agreement']:.3f} of "
                         "the request-steps both modes ran")
        lines.append(f"  tolerance: {report['tolerance']}")
    if report.get("torch_replay") is not None:
        from eagle_jax.compare.torch_replay import format_replay

        lines.append(format_replay(report["torch_replay"]))
    if report["failures"]:
        lines.append("FAIL:")
        lines.extend(f"  - {f}" for f in report["failures"])
    else:
        lines.append("PASS" if report.get("agreement") else "no comparison made (one mode)")
    return "\n".join(lines)


def _workload(args, tokenizer, vocab):
    if args.dataset is not None:
        from eagle_jax.eval.dataset import load_dataset

        exs = load_dataset(args.dataset, tokenizer, limit=args.limit or args.num_prompts,
                           seed=args.seed, vocab_size=vocab)
        room = args.max_model_len - args.max_tokens
        return [e.prompt_ids[-room:] for e in exs]
    rng = np.random.default_rng(args.seed)
    lo = 3 if vocab > 16 else 0
    return [[int(t) for t in rng.integers(lo, vocab, args.prompt_len)]
            for _ in range(args.num_prompts)]


def compare(args) -> dict:
    from eagle_jax.sampling import SamplingParams

    need_draft = args.algorithm.upper() != "NONE"
    target, draft = resolve_pair(args.model, args.draft_model, need_draft=need_draft)
    algo = args.algorithm.upper()
    if algo == "AUTO":
        algo = detect_algorithm(draft)
    if algo not in ("EAGLE", "EAGLE3", "NONE"):
        raise ValueError(f"--algorithm must be EAGLE, EAGLE3, NONE or auto, got {args.algorithm}")
    if not args.temperature > 0:
        raise ValueError("--temperature is that of the sampled requests: it must be > 0")
    if not 0 <= args.min_agreement <= 1:
        raise ValueError("--min-agreement must be in [0, 1]")
    from eagle_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir_if_present(target)
    with open(os.path.join(target, "config.json")) as f:
        model_vocab = json.load(f)["vocab_size"]
    vocab = min(tokenizer.vocab_size, model_vocab) if tokenizer is not None else model_vocab
    prompts = _workload(args, tokenizer, vocab)
    greedy = [i % 2 == 0 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0 if g else args.temperature, top_p=args.top_p,
                             seed=args.seed + i, max_tokens=args.max_tokens, ignore_eos=True)
              for i, g in enumerate(greedy)]
    config = EngineConfig.from_cli_args(
        args, model=target, draft_model=draft if algo != "NONE" else None,
        speculative_algorithm=algo, max_num_seqs=args.batch_size,
        # Every mode drafts num_steps in every step: the adaptive policy's choices
        # follow each mode's own step times, so the modes' steps would differ.
        speculative_policy="fixed")
    num_steps = args.num_steps if algo != "NONE" else 0
    if args.dtype == "float32":
        tolerance = (f"greedy requests token-for-token equal (float32); sampled requests: "
                     f"mean token agreement >= {args.min_agreement}")
    else:
        tolerance = (f"greedy requests: token agreement >= {args.min_agreement}; sampled "
                     f"requests reported, not checked ({args.dtype}: the unfused path rounds "
                     "every intermediate to bf16, moving probabilities by ~1e-2 relative, so "
                     "sampled draws are not expected to agree; compare in float32)")
    report = {
        "tool": "compare_replay", "version": 1,
        "config": {"model": target, "draft_model": config.draft_model, "algorithm": algo,
                   "num_steps": args.num_steps, "draft_sample_method": args.draft_sample_method,
                   "dtype": args.dtype, "temperature": args.temperature, "top_p": args.top_p,
                   "max_tokens": args.max_tokens, "batch_size": args.batch_size,
                   "seed": args.seed, "perturb": args.perturb,
                   "perturb_scale": args.perturb_scale, "modes": args.modes,
                   "vocab_size": vocab},
        "workload": {"num_requests": len(prompts), "num_greedy": sum(greedy),
                     "num_sampled": len(greedy) - sum(greedy),
                     "prompt_lengths": [len(p) for p in prompts]},
        "tolerance": tolerance, "min_agreement": args.min_agreement,
        "modes": [], "agreement": None, "torch_replay": None, "failures": [],
    }
    results = {}
    for mode in ("xla", "eager"):
        if mode in args.modes:
            results[mode] = _run_mode(mode, config, tokenizer, prompts, params, args.perturb,
                                      args.perturb_scale)
            report["modes"].append(_mode_summary(results[mode], num_steps, vocab))
    if "xla" in results and "eager" in results:
        report["agreement"] = _agreement(results["xla"], results["eager"], greedy)
        report["failures"] = _verdict(report["agreement"], report["modes"],
                                      args.min_agreement, args.dtype)
        report["tokens"] = {m: r.tokens for m, r in results.items()}
    else:
        report["failures"] = _verdict({"greedy": None, "sampled": None, "modes": []},
                                      report["modes"], args.min_agreement, args.dtype)
    if "torch-replay" in args.modes:
        from eagle_jax.compare.torch_replay import run_torch_replay

        width = model_vocab if model_vocab > vocab else None
        report["torch_replay"] = run_torch_replay(
            batch=args.batch_size, num_steps=max(1, args.num_steps), vocab_size=vocab,
            width=width, steps=args.replay_steps, temperature=args.temperature, seed=args.seed)
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.dtype == "float32":
        # GPUs run float32 matmuls in TF32 by default (~1e-3 relative), which would make
        # the float32 tolerance below meaningless: compare at full float32 precision.
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
    try:
        report = compare(args)
    except ModelsMissing as e:
        print(f"compare_replay.py: {e}", file=sys.stderr)
        return EXIT_NO_MODEL
    except ValueError as e:
        print(f"compare_replay.py: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report written to {args.json}")
    return 1 if report["failures"] else 0
