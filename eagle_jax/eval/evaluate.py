"""Offline batch evaluation of a target + draft pair (``scripts/evaluate.py``).

For every setting of the sweep the dataset runs through ``LLM.generate`` in batches of
``--batch-size`` prompts. The settings: chains (``--speculative-eagle-topk`` 1, the
default) for each ``--num-steps`` x ``--draft-sample-method``; EAGLE-2 draft trees for
each ``--speculative-eagle-topk`` K > 1 x ``--tree-num-steps`` (default: the
``--num-steps`` list) x ``--num-draft-tokens`` x ``--tree-verify``; each of them at
every ``--temperature``. The same prompts, seeds and temperatures also run through the
target alone (speculative_algorithm NONE) for the speed-up and the greedy identity
check. The per-request-step accept lengths come from the engine's own step outputs
(``StepRecorder``, see ``eagle_jax.eval.recording``), and are checked against the
engine's cumulative ``SpecDecodeStats`` (``stats_consistent`` in the report).

A tree of depth S commits at most S + 1 tokens per step like a chain of S, so accept
lengths and the acceptance per position (position d = depth d of the accepted path) are
counted the same way for both; each run of the report names its setting (``topk``: K,
1 for a chain; ``num_verify_tokens``: tokens verified per step, the root included, the
engine's ``num_draft_tokens``, S + 1 for a chain; ``tree_verify``: None for a chain).

Request i of the dataset gets ``SamplingParams(temperature=T, top_p=--top-p,
seed=--seed + i, max_tokens=--max-tokens)`` in every run, so runs are reproducible and
the baseline draws from the same per-request seeds.

Exit status: 0 on success, 2 when the models are missing or a flag is wrong, 1 when a
run produced an invalid token (an id outside the vocabulary).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import sys
import time

from tqdm.auto import tqdm

from eagle_jax.argtypes import positive_int
from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.protocol import EngineClient
from eagle_jax.eval import metrics
from eagle_jax.eval.dataset import DatasetError, describe_rule, load_dataset
from eagle_jax.eval.models import EXIT_NO_MODEL, ModelsMissing, detect_algorithm, resolve_pair

logger = logging.getLogger("eagle_jax.eval")


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _float_list(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}")
    if not vals or any(v < 0 or not math.isfinite(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative numbers, got {s!r}")
    return vals


def _method_list(s: str) -> list[str]:
    vals = [x.strip() for x in s.split(",") if x.strip()]
    bad = [v for v in vals if v not in ("greedy", "probabilistic")]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of greedy / probabilistic, got {s!r}")
    return vals


def _verify_list(s: str) -> list[str]:
    from eagle_jax.engine.config import TREE_VERIFY_METHODS

    vals = [x.strip() for x in s.split(",") if x.strip()]
    bad = [v for v in vals if v not in TREE_VERIFY_METHODS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {' / '.join(TREE_VERIFY_METHODS)}, got {s!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--algorithm", default="auto",
                   help="EAGLE, EAGLE3, NONE, or auto (from the draft checkpoint; default)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=None,
                   help="JSONL ({\"prompt\": text | ids, \"reference\": optional}), a .json "
                        "list, or a directory of text / code files (see --prompt-tokens); "
                        "default: built-in prompts")
    g.add_argument("--prompt-tokens", type=positive_int, default=64,
                   help="directory datasets: prompt tokens per window (default 64)")
    g.add_argument("--continuation-tokens", type=positive_int, default=32,
                   help="directory datasets: reference tokens per window (default 32)")
    g.add_argument("--windows-per-file", type=positive_int, default=None,
                   help="directory datasets: keep the first N windows of each file")
    g.add_argument("--limit", type=positive_int, default=None, help="use the first N examples")
    g = p.add_argument_group("generation and sweep")
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help="tokens per request (default: --continuation-tokens for a directory "
                        "dataset, else 32)")
    g.add_argument("--batch-size", type=positive_int, default=8,
                   help="prompts per LLM.generate call (= the engine's max_num_seqs)")
    g.add_argument("--num-steps", type=_int_list, default=[5],
                   help="draft steps S, comma-separated sweep (default 5)")
    g.add_argument("--temperature", type=_float_list, default=[0.0],
                   help="temperatures, comma-separated sweep (default 0)")
    g.add_argument("--draft-sample-method", type=_method_list, default=["probabilistic"],
                   help="probabilistic (the engine's default) and/or greedy, "
                        "comma-separated sweep; chains only: a tree draws its nodes as "
                        "its --tree-verify rule needs (the draft's top K, or without "
                        "replacement from q for the real-q rules' sampled rows), so "
                        "trees are not run once per method")
    g.add_argument("--speculative-eagle-topk", type=_int_list, default=[1],
                   help="K, comma-separated sweep (default 1): 1 runs chains (each "
                        "--num-steps x --draft-sample-method), K > 1 EAGLE-2 dynamic trees "
                        "with K children per expanded node (each --tree-num-steps x "
                        "--num-draft-tokens x --tree-verify)")
    g.add_argument("--tree-num-steps", type=_int_list, default=None,
                   help="tree depths S, comma-separated sweep (default: the --num-steps "
                        "list); lets one command compare chains of one S with trees of "
                        "another")
    g.add_argument("--num-draft-tokens", type=_int_list, default=None,
                   help="trees: tokens verified per step, the root included (root + N - 1 "
                        "drafted nodes), comma-separated sweep; default: the engine's (32, or "
                        "1 + K + (S-1) K^2 if fewer). Chains always verify S + 1")
    g.add_argument("--tree-verify", type=_verify_list, default=["traversal"],
                   help="trees: traversal (the draft's real q, whole paths; default), "
                        "recursive_rejection (real q, token by token) and/or target_only "
                        "(SGLang's rule, the baseline), comma-separated sweep; greedy rows "
                        "take the target's argmax path in every case")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    g.add_argument("--skip-baseline", action="store_true",
                   help="do not run the target alone (no speed-up, no identity check)")
    # The engine's flags (EngineConfig.add_cli_args), less those swept above or named
    # otherwise here (--algorithm, --batch-size); the seed is the engine's and request
    # i's is seed + i; --speculative-policy applies to chains only (trees always draft
    # their fixed depth).
    EngineConfig.add_cli_args(
        p, exclude=("speculative_algorithm", "num_steps", "speculative_eagle_topk",
                    "num_draft_tokens", "tree_verify", "draft_sample_method", "max_num_seqs"),
        defaults=dict(dtype="float32", max_model_len=512, speculative_policy="fixed"))
    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    g.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


# --------------------------------------------------------------------------- running
@dataclasses.dataclass
class RunResult:
    """One pass of the dataset through one engine at one temperature."""

    outputs: list  # CompletionOutput per example, in dataset order
    wall_s: float
    records: list  # StepRecord
    first_token_time: dict
    finish_time: dict
    stats_delta: dict

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def tpots(self) -> list[float | None]:
        return [metrics.tpot(self.first_token_time.get(o.request_id),
                             self.finish_time.get(o.request_id), len(o.token_ids))
                for o in self.outputs]


def _params(args, temperature: float, index: int, max_tokens: int):
    from eagle_jax.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_p=args.top_p, seed=args.seed + index,
                          max_tokens=max_tokens, ignore_eos=args.ignore_eos)


def _run(llm, recorder, examples, args, temperature: float, max_tokens: int,
         label: str) -> RunResult:
    engine = llm.engine
    recorder.reset()
    before = dataclasses.asdict(engine.stats)
    outputs, wall = [], 0.0
    bar = tqdm(total=len(examples), desc=label, disable=args.no_progress, leave=False)
    for start in range(0, len(examples), args.batch_size):
        chunk = examples[start:start + args.batch_size]
        params = [_params(args, temperature, start + j, max_tokens) for j in range(len(chunk))]
        t0 = time.perf_counter()
        outputs.extend(llm.generate([e.prompt_ids for e in chunk], params, use_tqdm=False))
        wall += time.perf_counter() - t0
        bar.update(len(chunk))
    bar.close()
    return RunResult(outputs, wall, list(recorder.step_records),
                     dict(recorder.first_token_time), dict(recorder.finish_time),
                     metrics.stats_delta(dataclasses.asdict(engine.stats), before))


@dataclasses.dataclass(frozen=True)
class Setting:
    """One speculative engine of the sweep (run at every temperature).

    A chain: topk 1, num_draft_tokens None (S + 1), tree_verify None. A tree: topk K > 1,
    num_draft_tokens N (None: the engine's default), tree_verify, method None."""

    num_steps: int
    method: str | None = "probabilistic"
    topk: int = 1
    num_draft_tokens: int | None = None
    tree_verify: str | None = None

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def label(self, temperature: float, adaptive: bool = False,
              num_verify_tokens: int | None = None) -> str:
        if self.is_tree:
            n = self.num_draft_tokens if num_verify_tokens is None else num_verify_tokens
            return (f"S={self.num_steps} K={self.topk} N={n} T={temperature:g} "
                    f"{self.tree_verify}")
        return (f"S={self.num_steps}{' adaptive' if adaptive else ''} T={temperature:g} "
                f"{self.method}")


def _settings(args) -> list[Setting]:
    """The sweep's speculative settings, in the order of --speculative-eagle-topk."""
    out = []
    for topk in dict.fromkeys(args.speculative_eagle_topk):
        if topk == 1:
            out += [Setting(s, m) for s in dict.fromkeys(args.num_steps)
                    for m in dict.fromkeys(args.draft_sample_method)]
            continue
        out += [Setting(s, None, topk, n, v)
                for s in dict.fromkeys(args.tree_num_steps or args.num_steps)
                for n in dict.fromkeys(args.num_draft_tokens or [None])
                for v in dict.fromkeys(args.tree_verify)]
    return out


def _engine_config(args, target, draft, algo, setting: Setting):
    """The EngineConfig of a setting (its checks run here: a wrong flag fails before any
    run)."""
    kw = dict(model=target, draft_model=draft if algo != "NONE" else None,
              speculative_algorithm=algo, num_steps=setting.num_steps,
              max_num_seqs=args.batch_size)
    if setting.is_tree:
        kw.update(speculative_eagle_topk=setting.topk,
                  num_draft_tokens=setting.num_draft_tokens,
                  tree_verify=setting.tree_verify, speculative_policy="fixed")
    else:
        kw.update(draft_sample_method=setting.method,
                  speculative_policy=args.speculative_policy)
    return EngineConfig.from_cli_args(args, **kw)


def _make_llm(config, tokenizer):
    from eagle_jax.engine import LLM, make_engine
    from eagle_jax.eval.recording import StepRecorder

    engine = make_engine(config, tokenizer=tokenizer)
    return LLM(engine=engine), StepRecorder(engine)


def _warm_up(llm, examples, max_tokens: int) -> None:
    """One short request, so that the lazily jitted slot updates compile before timing."""
    from eagle_jax.sampling import SamplingParams

    llm.generate([examples[0].prompt_ids],
                 SamplingParams(temperature=0.0, max_tokens=min(2, max_tokens)), use_tqdm=False)


# ----------------------------------------------------------------------- the figures
def _exact_match(outputs, examples) -> dict | None:
    matched = total = 0
    per = []
    for o, e in zip(outputs, examples):
        if e.reference_ids is None:
            per.append(None)
            continue
        ok = list(o.token_ids[:len(e.reference_ids)]) == list(e.reference_ids)
        per.append(ok)
        total += 1
        matched += ok
    if not total:
        return None
    return {"matched": matched, "total": total, "rate": matched / total, "per_request": per}


def _text_match(outputs, examples, tokenizer) -> dict | None:
    """Text references: the decoded output, stripped, starts with the stripped reference."""
    if tokenizer is None:
        return None
    matched = total = 0
    for o, e in zip(outputs, examples):
        if e.reference_text is None:
            continue
        total += 1
        matched += tokenizer.decode(o.token_ids).strip().startswith(e.reference_text.strip())
    return {"matched": matched, "total": total, "rate": matched / total} if total else None


def _stray(outputs, tokenizer_vocab: int) -> int:
    return sum(1 for o in outputs for t in o.token_ids if not 0 <= t < tokenizer_vocab)


def _timing(run: RunResult) -> dict:
    tp = metrics.mean(run.tpots())
    return {"num_output_tokens": run.num_output_tokens, "wall_s": run.wall_s,
            "output_tokens_per_s": run.num_output_tokens / run.wall_s if run.wall_s else None,
            "mean_tpot_ms": None if tp is None else 1e3 * tp}


def _summarise_baseline(run: RunResult, examples, temperature, tokenizer, vocab) -> dict:
    em = _exact_match(run.outputs, examples)
    return {"temperature": temperature, **_timing(run),
            "num_invalid_tokens": run.stats_delta.get("num_invalid_tokens", 0),
            "num_stray_output_tokens": _stray(run.outputs, vocab),
            "exact_match": None if em is None else {k: v for k, v in em.items()
                                                   if k != "per_request"},
            "exact_match_text": _text_match(run.outputs, examples, tokenizer)}


def _summarise_spec(run: RunResult, examples, setting: Setting, config, temperature: float,
                    baseline: dict | None, baseline_run: RunResult | None, tokenizer,
                    vocab: int) -> dict:
    """One run's figures; ``config``: the setting's EngineConfig (its resolved
    num_draft_tokens). A tree of depth S commits at most S + 1 tokens per step, as a
    chain of S does: the accept figures count S positions (depths) either way."""
    num_steps, method = setting.num_steps, setting.method
    acc = metrics.accept_summary(
        run.records, num_steps,
        tree_nodes=config.num_draft_tokens - 1 if setting.topk > 1 else None)
    cnt = metrics.counters(run.records)
    d = run.stats_delta
    consistent = (d["num_drafts"] == acc["num_drafts"]
                  and d["num_accepted_tokens"] == acc["num_accepted_tokens"]
                  and d["num_draft_tokens"] == acc["num_draft_tokens"]
                  and list(d["accepted_per_pos"]) == acc["accepted_per_position"]
                  and d["num_emitted_tokens"] == cnt["num_emitted_tokens"]
                  and d["num_invalid_tokens"] == cnt["num_invalid_tokens"]
                  and d["num_malformed_draft_probs"] == cnt["num_malformed_draft_probs"]
                  and d["num_sampler_fallbacks"] == cnt["num_sampler_fallbacks"])
    timing = _timing(run)
    adaptive = d["forecast_seconds"] > 0
    out = {"label": setting.label(temperature, adaptive, config.num_draft_tokens),
           "num_steps": num_steps, "temperature": temperature, "draft_sample_method": method,
           "topk": setting.topk, "num_verify_tokens": config.num_draft_tokens,
           "tree_verify": setting.tree_verify, **acc}
    # The steps dispatched per draft length, and what the adaptive policy expected of
    # them (committed tokens per second of step time) against the realised rate.
    out["draft_length_steps"] = {str(s): n for s, n in enumerate(d["draft_length_steps"])}
    out["forecast_goodput_tok_s"] = (d["forecast_tokens"] / d["forecast_seconds"]
                                     if d["forecast_seconds"] else None)
    per_req = metrics.per_request_accept_length(run.records)
    vals = list(per_req.values())
    out["per_request_accept_length"] = (
        {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals)} if vals else None)
    out.update(timing)
    identical = None
    if baseline is not None:
        out["baseline_output_tokens_per_s"] = baseline["output_tokens_per_s"]
        out["baseline_mean_tpot_ms"] = baseline["mean_tpot_ms"]
        bt, st = baseline["output_tokens_per_s"], timing["output_tokens_per_s"]
        out["speedup"] = st / bt if bt and st else None
        btp, stp = baseline["mean_tpot_ms"], timing["mean_tpot_ms"]
        out["tpot_speedup"] = btp / stp if btp and stp else None
        if temperature == 0.0 and baseline_run is not None:
            identical = [list(a.token_ids) == list(b.token_ids)
                         for a, b in zip(run.outputs, baseline_run.outputs)]
    out["greedy_identical"] = (None if identical is None else
                               {"identical": sum(identical), "total": len(identical)})
    out.update({
        "num_emitted_tokens": d["num_emitted_tokens"],
        "num_invalid_tokens": d["num_invalid_tokens"],
        "num_stray_output_tokens": _stray(run.outputs, vocab),
        "num_malformed_draft_probs": d["num_malformed_draft_probs"],
        "num_sampler_fallbacks": d["num_sampler_fallbacks"],
        "stats_consistent": consistent,
        "engine_stats": d,
    })
    em = _exact_match(run.outputs, examples)
    out["exact_match"] = None if em is None else {k: v for k, v in em.items()
                                                 if k != "per_request"}
    out["exact_match_text"] = _text_match(run.outputs, examples, tokenizer)
    tpots = run.tpots()
    out["requests"] = [{
        "source": e.source, "prompt_tokens": len(e.prompt_ids),
        "output_tokens": len(o.token_ids), "finish_reason": o.finish_reason,
        "mean_accept_length": per_req.get(o.request_id),
        "tpot_ms": None if t is None else 1e3 * t,
        "identical_to_baseline": None if identical is None else identical[i],
        "exact_match": None if em is None else em["per_request"][i],
    } for i, (e, o, t) in enumerate(zip(examples, run.outputs, tpots))]
    return out


def _score_references(engine: EngineClient, examples, max_model_len: int) -> dict | None:
    """Next-token accuracy and perplexity of the target on the reference continuations."""
    lps, hits, n_ex = [], 0, 0
    for e in examples:
        if not e.reference_ids:
            continue
        ref = list(e.reference_ids)[:max_model_len - 1]
        prompt = list(e.prompt_ids)[-(max_model_len - len(ref)):]
        scored = engine.prompt_logprobs(prompt + ref, top_n=1)[len(prompt):]
        for tok, lp in zip(ref, scored):
            lps.append(lp.logprob)
            hits += bool(lp.top) and next(iter(lp.top)) == tok
        n_ex += 1
    if not lps:
        return None
    return {"num_examples": n_ex, "num_tokens": len(lps),
            "next_token_accuracy": hits / len(lps), "perplexity": metrics.perplexity(lps),
            "mean_logprob": sum(lps) / len(lps)}


# -------------------------------------------------------------------------- output
def _fmt(v, spec=".2f", none="-"):
    if v is None:
        return none
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def format_table(report: dict) -> str:
    """The report as a text table. With a tree among the runs it gains the columns K
    (topk), N (tokens verified per step, root included) and tree verify; a sweep of
    chains alone prints as before."""
    lines = []
    runs = report.get("runs") or []
    trees = any(r.get("topk", 1) > 1 for r in runs)
    head = ("setting", "accept len", "acc@pos", "drafted", "accepted", "tok/s", "TPOT ms",
            "speed-up", "greedy ==", "invalid", "fallback", "EM")
    if trees:
        head = head[:1] + ("K", "N", "tree verify") + head[1:]
    rows = []
    for b in report.get("baseline") or []:
        em = b.get("exact_match")
        rows.append((f"NONE T={b['temperature']:g}",) + ("-",) * 3 * trees + (
            "-", "-", "-", "-",
            _fmt(b["output_tokens_per_s"], ".1f"), _fmt(b["mean_tpot_ms"], ".2f"),
            "1.00", "-", str(b["num_invalid_tokens"] + b["num_stray_output_tokens"]),
            "-", "-" if em is None else f"{em['matched']}/{em['total']}"))
    for r in runs:
        gi, em = r["greedy_identical"], r["exact_match"]
        rows.append((r["label"],) + ((
            str(r["topk"]), str(r["num_verify_tokens"]), r["tree_verify"] or "-")
            if trees else ()) + (
            f"{r['mean_accept_length']:.2f}",
            " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]),
            str(r["num_draft_tokens"]), str(r["num_accepted_tokens"]),
            _fmt(r["output_tokens_per_s"], ".1f"), _fmt(r["mean_tpot_ms"], ".2f"),
            _fmt(r.get("speedup"), ".2f"),
            "-" if gi is None else f"{gi['identical']}/{gi['total']}",
            str(r["num_invalid_tokens"] + r["num_stray_output_tokens"]),
            str(r["num_sampler_fallbacks"]),
            "-" if em is None else f"{em['matched']}/{em['total']}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for r in report.get("runs") or []:
        dist = " ".join(f"{k}:{v:.2f}" for k, v in r["accept_length_distribution"].items())
        lines.append(f"{r['label']}: accept length distribution {dist}"
                     + ("" if r["stats_consistent"] else "  [per-step counts != engine.stats]"))
        if r["forecast_goodput_tok_s"] is not None:
            steps = " ".join(f"{s}:{n}" for s, n in r["draft_length_steps"].items())
            lines.append(f"{r['label']}: steps per draft length {steps}; goodput forecast "
                         f"{r['forecast_goodput_tok_s']:.1f} tok/s, realised "
                         f"{_fmt(r['output_tokens_per_s'], '.1f')} tok/s")
    sc = report.get("reference_scores")
    if sc:
        lines.append(f"target on references: next-token accuracy "
                     f"{sc['next_token_accuracy']:.3f}, perplexity {sc['perplexity']:.2f} "
                     f"({sc['num_tokens']} tokens, {sc['num_examples']} examples)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def evaluate(args) -> dict:
    target, draft = resolve_pair(args.model, args.draft_model,
                                 need_draft=args.algorithm.upper() != "NONE")
    algo = args.algorithm.upper()
    if algo == "AUTO":
        algo = detect_algorithm(draft)
    if algo not in ("EAGLE", "EAGLE3", "NONE"):
        raise ValueError(f"--algorithm must be EAGLE, EAGLE3, NONE or auto, got {args.algorithm}")
    from eagle_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir_if_present(target)
    with open(os.path.join(target, "config.json")) as f:
        model_vocab = json.load(f).get("vocab_size")
    vocab = min(tokenizer.vocab_size, model_vocab) if tokenizer is not None else model_vocab
    is_dir = args.dataset is not None and os.path.isdir(args.dataset)
    max_tokens = args.max_tokens or (args.continuation_tokens if is_dir else 32)
    examples = load_dataset(args.dataset, tokenizer, prompt_tokens=args.prompt_tokens,
                            continuation_tokens=args.continuation_tokens,
                            windows_per_file=args.windows_per_file, limit=args.limit,
                            seed=args.seed, vocab_size=vocab)
    # Every setting's EngineConfig first: a flag the engine refuses fails before any run.
    plan = ([(st, _engine_config(args, target, draft, algo, st)) for st in _settings(args)]
            if algo != "NONE" else [])
    room = args.max_model_len - max_tokens
    if room < 1:
        raise ValueError(f"--max-model-len {args.max_model_len} leaves no room for a prompt "
                         f"with --max-tokens {max_tokens}")
    truncated = 0
    for e in examples:
        bad = [t for t in e.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise DatasetError(f"{e.source}: prompt token id {bad[0]} is outside the "
                               f"vocabulary [0, {vocab})")
        if len(e.prompt_ids) > room:
            e.prompt_ids = e.prompt_ids[-room:]  # keep the end, next to the continuation
            truncated += 1

    report = {
        "tool": "evaluate", "version": 1,
        "config": {"model": target, "draft_model": draft if algo != "NONE" else None,
                   "algorithm": algo, "dtype": args.dtype, "max_model_len": args.max_model_len,
                   "batch_size": args.batch_size, "max_tokens": max_tokens, "seed": args.seed,
                   "top_p": args.top_p, "ignore_eos": args.ignore_eos,
                   "num_steps": args.num_steps, "temperature": args.temperature,
                   "draft_sample_method": args.draft_sample_method,
                   "speculative_eagle_topk": args.speculative_eagle_topk,
                   "tree_num_steps": args.tree_num_steps or args.num_steps,
                   "num_draft_tokens": args.num_draft_tokens,
                   "tree_verify": args.tree_verify,
                   "tokenizer_vocab_size": vocab},
        "dataset": {"path": args.dataset, "num_examples": len(examples),
                    "num_with_reference": sum(e.reference_ids is not None for e in examples),
                    "num_prompts_truncated": truncated,
                    "rule": describe_rule(args.dataset, args.prompt_tokens,
                                          args.continuation_tokens, args.windows_per_file)},
        "baseline": [], "runs": [], "reference_scores": None,
    }
    temps = list(dict.fromkeys(args.temperature))
    baseline, baseline_runs = {}, {}
    has_refs = any(e.reference_ids for e in examples)
    if not args.skip_baseline or algo == "NONE":
        llm, recorder = _make_llm(_engine_config(args, target, None, "NONE",
                                                 Setting(1, "greedy")), tokenizer)
        _warm_up(llm, examples, max_tokens)
        for t in temps:
            run = _run(llm, recorder, examples, args, t, max_tokens, f"NONE T={t:g}")
            baseline_runs[t] = run
            baseline[t] = _summarise_baseline(run, examples, t, tokenizer, vocab)
            report["baseline"].append(baseline[t])
        if has_refs:
            report["reference_scores"] = _score_references(llm.engine, examples,
                                                           args.max_model_len)
        del llm
        gc.collect()
    for setting, config in plan:
        llm, recorder = _make_llm(config, tokenizer)
        _warm_up(llm, examples, max_tokens)
        for t in temps:
            label = setting.label(t, num_verify_tokens=config.num_draft_tokens)
            run = _run(llm, recorder, examples, args, t, max_tokens, label)
            report["runs"].append(_summarise_spec(
                run, examples, setting, config, t, baseline.get(t), baseline_runs.get(t),
                tokenizer, vocab))
        if has_refs and report["reference_scores"] is None:
            report["reference_scores"] = _score_references(llm.engine, examples,
                                                           args.max_model_len)
        del llm
        gc.collect()
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = evaluate(args)
    except ModelsMissing as e:
        print(f"evaluate.py: {e}", file=sys.stderr)
        return EXIT_NO_MODEL
    except (DatasetError, ValueError) as e:
        print(f"evaluate.py: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report written to {args.json}")
    if args.plot:
        from eagle_jax.eval.plots import write_plots

        for path in write_plots(report, args.plot):
            print(f"chart written to {path}")
    bad = sum(r["num_invalid_tokens"] + r["num_stray_output_tokens"]
              for r in report["runs"] + report["baseline"])
    if bad:
        print(f"evaluate.py: {bad} generated token(s) outside the vocabulary", file=sys.stderr)
        return 1
    return 0
