"""Serving benchmark: scripts/serve.py driven by AIPerf, with speculation on and off.

For each mode, EAGLE-3 speculation and plain decoding of the same target
(``--speculative-algorithm NONE``), the script starts the server and runs ``aiperf
profile`` against ``/v1/completions`` at each concurrency: streaming, synthetic prompts of
``--isl`` tokens cut from AIPerf's coding corpus with the target's own tokenizer, greedy,
``ignore_eos`` so that every request generates ``--osl`` tokens (counted by the server's
``usage``). From AIPerf's JSON export it keeps request throughput, output tokens/s, and
the TTFT and inter-token latency percentiles; from the server's ``/metrics`` the accept
length and the prefix-cache hit rate. One JSON, one plot and a Markdown table come out.

``--prefix-len N`` puts one N-token prefix before every prompt (a shared system prompt:
AIPerf's prefix prompt pool of one); ``--modes eagle3,eagle3-no-prefix-cache`` then
compares the server with prefix caching on and off:

    python scripts/bench_serve.py --prefix-len 1024 --isl 64 --osl 128 --concurrency 32 \
        --modes eagle3,eagle3-no-prefix-cache

    python scripts/bench_serve.py                          # the embedded default pair
    python scripts/bench_serve.py --model DIR --draft-model DIR
    python scripts/bench_serve.py --shape llama-8b --concurrency 1,8,32,64 --osl 256
                                                           # on a GPU (64 slots there)

``--start-together`` starts every mode's server at once, so that they load and compile in
parallel (on the H200 an 8B server compiles for minutes), and measures them one at a time
once all are healthy, each taking an equal share of the GPU's memory.

``--shape llama-8b`` (or ``small``, to try the path on a CPU) serves a random checkpoint
of that shape, written once into ``--checkpoint-dir`` before the first server starts:
the Llama-3.1-8B-shaped bfloat16 target and EAGLE-3 draft of scripts/bench_engine.py
(random weights, built in JAX and saved as ``config.json`` + safetensors by the project's
own writers, so nothing beyond ``.[bench]`` is needed on the GPU machine), and the
default pair's tokenizer with one printable token per id beyond its own vocabulary, so
that a random model's output streams as text. A random draft accepts almost nothing:
with such a pair the speculative rows measure speculation's overhead at accept length ~1,
not its speed-up (the JSON and the table carry the accept length).

AIPerf (NVIDIA, PyPI ``aiperf``) is the load generator; it is not a dependency of the
engine: ``pip install -e ".[bench]"``. It needs no download here: the prompts come from
the corpus it ships and the tokenizer from the target directory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time

from eagle_jax.testutil.server import ServerProcess

MODES = {"eagle3": "EAGLE-3", "plain": "no speculation",
         "eagle3-no-prefix-cache": "EAGLE-3, no prefix cache",
         "eagle3-one-prefill": "EAGLE-3, one request's prefill per forward"}
SHAPES = ("llama-8b", "small")
PERCENTILES = ("p50", "p90", "p99")
SERVED_NAME = "bench"
# aiperf 0.13, with HF_HUB_OFFLINE set, looks a tokenizer up only in the hub cache, so a
# local directory fails; without it a local directory is read as is, with no request.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


# ------------------------------------------------------------------ the random pair
def _write_tokenizer(target_dir: str, vocab_size: int) -> None:
    """The default pair's tokenizer, with ids past its own printing as "<|id_N|>" up to
    ``vocab_size``: plain (not special) tokens, which the server's text keeps, so that
    every token a random model generates streams as text."""
    from tokenizers import AddedToken, Tokenizer

    from eagle_jax.assets import DEFAULT_TARGET

    tok = Tokenizer.from_file(os.path.join(DEFAULT_TARGET, "tokenizer.json"))
    own = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < own:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {own} ids")
    tok.add_tokens([AddedToken(f"<|id_{i}|>", special=False, normalized=False)
                    for i in range(own, vocab_size)])
    os.makedirs(target_dir, exist_ok=True)
    tok.save(os.path.join(target_dir, "tokenizer.json"))
    shutil.copy(os.path.join(DEFAULT_TARGET, "tokenizer_config.json"), target_dir)


def _write_random_pair(shape: str, out_dir: str) -> None:
    """Writes ``out_dir/{target,draft}`` of a random pair of ``shape`` (bench_engine's
    shapes and initialisation) and the target's tokenizer. Runs in a child process, so
    the device memory it takes is released before the server starts."""
    import jax.numpy as jnp

    from eagle_jax.testutil.random_models import LLAMA_8B, SMALL, random_eagle3, random_target

    from eagle_jax.models.decoder import save_decoder
    from eagle_jax.models.draft_checkpoint import save_draft

    # The small shape takes the tokenizer's 8192 ids (bench_engine's has 4096).
    geometry, draft_vocab = ((LLAMA_8B, 32000) if shape == "llama-8b"
                             else (dict(SMALL, vocab_size=8192), 1024))
    dtype = jnp.bfloat16
    target = random_target(geometry, dtype)
    c = target.config
    r = c.rope_scaling
    target_dir, draft_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")
    _write_tokenizer(target_dir, c.vocab_size)
    # The fields random_target builds its ModelConfig from, as config.json says them; EOS
    # is the tokenizer's (id 0), which the benchmark's requests ignore.
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama",
              vocab_size=c.vocab_size, hidden_size=c.hidden_size,
              intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
              num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, hidden_act="silu",
              max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
              rope_theta=c.rope_theta,
              rope_scaling=dict(rope_type="llama3", factor=r.factor,
                                low_freq_factor=r.low_freq_factor,
                                high_freq_factor=r.high_freq_factor,
                                original_max_position_embeddings=(
                                    r.original_max_position_embeddings)),
              tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=0,
              eos_token_id=0)
    save_decoder(target, target_dir, hf, dtype=dtype)
    save_draft(random_eagle3(target, dtype, draft_vocab), draft_dir, dtype=dtype)


def random_pair(shape: str, checkpoint_dir: str) -> tuple[str, str]:
    """(target_dir, draft_dir) of the random pair of ``shape``, written when absent."""
    target_dir, draft_dir = (os.path.join(checkpoint_dir, n) for n in ("target", "draft"))
    if all(os.path.isfile(os.path.join(d, "config.json")) for d in (target_dir, draft_dir)):
        print(f"random {shape} pair: reusing {checkpoint_dir}", flush=True)
        return target_dir, draft_dir
    print(f"random {shape} pair: writing {checkpoint_dir}", flush=True)
    child = multiprocessing.get_context("spawn").Process(
        target=_write_random_pair, args=(shape, checkpoint_dir))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"error: writing the random {shape} pair into {checkpoint_dir} "
                         f"failed (exit code {child.exitcode}); see the traceback above")
    return target_dir, draft_dir


# ------------------------------------------------------------------ one run
COUNTERS = ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_drafts",
            "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")


def _scrape_counters(base_url: str) -> dict[str, float]:
    """COUNTERS so far, from the server's vLLM-named /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            if s.name.endswith("_total") and s.name[:-len("_total")] in totals:
                totals[s.name[:-len("_total")]] += s.value
    return totals


def _stat(metric: dict) -> dict:
    return {k: metric[k] for k in ("avg", *PERCENTILES) if k in metric}


def run_aiperf(args, base_url: str, tokenizer_dir: str, concurrency: int,
               artifact_dir: str) -> dict:
    """One ``aiperf profile`` at ``concurrency``; its summary numbers."""
    requests = args.requests or args.requests_per_stream * concurrency
    cmd = [args.aiperf, "profile", "--model", SERVED_NAME, "--url", base_url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", tokenizer_dir,
           "--prompt-corpus", "coding", "--isl", str(args.isl), "--osl", str(args.osl),
           "--concurrency", str(concurrency), "--request-count", str(requests),
           "--warmup-request-count", str(concurrency), "--random-seed", str(args.seed),
           "--use-server-token-count", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", "temperature:0", "--artifact-dir", artifact_dir]
    if args.prefix_len:  # one prefix before every prompt (a shared system prompt)
        cmd += ["--prefix-prompt-pool-size", "1", "--prefix-prompt-length", str(args.prefix_len)]
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARIABLES}
    with open(artifact_dir + ".log", "wb") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"error: aiperf exited with {proc.returncode}; its log: "
                         f"{artifact_dir}.log")
    with open(os.path.join(artifact_dir, "profile_export_aiperf.json")) as f:
        m = json.load(f)
    error_rate = m.get("request_error_rate", {}).get("avg", 0)
    if error_rate or m.get("error_summary"):
        raise SystemExit(f"error: {error_rate:.0f}% of aiperf's requests failed "
                         f"({m.get('error_summary')}); see {artifact_dir}.log and the "
                         "server log")
    return dict(
        concurrency=concurrency, requests=int(m["request_count"]["avg"]),
        request_throughput=m["request_throughput"]["avg"],
        output_token_throughput=m["output_token_throughput"]["avg"],
        output_tokens_per_request=m["output_sequence_length"]["avg"],
        ttft_ms=_stat(m["time_to_first_token"]), itl_ms=_stat(m["inter_token_latency"]),
        request_latency_ms=_stat(m["request_latency"]))


def start_server(args, mode: str, target: str, draft: str | None, out_dir: str,
                 wait: bool = True, env: dict | None = None) -> ServerProcess:
    """scripts/serve.py for ``mode``; healthy on return unless ``wait`` is False."""
    spec = (["--speculative-algorithm", "NONE"] if mode == "plain" else
            ["--draft-model", draft, "--speculative-algorithm", "EAGLE3"])
    if mode == "eagle3-no-prefix-cache":
        spec.append("--no-prefix-caching")
    if mode == "eagle3-one-prefill":
        spec += ["--max-num-partial-prefills", "1"]
    server_args = ["--model", target, *spec, "--served-model-name", SERVED_NAME,
                   "--seed", str(args.seed), *args.server_arg]
    print(f"[{mode}] starting: serve.py {' '.join(server_args)}", flush=True)
    # JAX_PLATFORMS: the caller's, else every backend (ServerProcess defaults to the CPU).
    platforms = os.environ.get("JAX_PLATFORMS", "")
    launched = time.monotonic()
    server = ServerProcess(server_args, env={"JAX_PLATFORMS": platforms, **(env or {})},
                           log_path=os.path.join(out_dir, f"server-{mode}.log"),
                           startup_timeout=args.startup_timeout, wait=wait)
    server.launched = launched
    return server


def bench_mode(args, mode: str, target: str, draft: str | None, out_dir: str,
               on_run=None, server: ServerProcess | None = None) -> list[dict]:
    """Every concurrency of one mode on one server (``server``, started and not yet
    healthy, or a new one); ``on_run(run)`` after each one. Stops the server."""
    if server is None:
        server = start_server(args, mode, target, draft, out_dir)
    else:
        try:
            server.wait_healthy(args.startup_timeout)
        except BaseException:
            server.stop()
            raise
    startup_s = getattr(server, "startup_s", None) or time.monotonic() - server.launched
    print(f"[{mode}] server healthy {startup_s:.0f} s after its launch (load + compile)",
          flush=True)
    runs = []
    try:
        for c in args.concurrency:
            before = _scrape_counters(server.base_url)
            run = run_aiperf(args, server.base_url, target, c,
                             os.path.join(out_dir, "aiperf", f"{mode}-c{c}"))
            # Warm-up requests count too: they decode the same kind of prompts.
            d = {k: v - before[k] for k, v in _scrape_counters(server.base_url).items()}
            drafts = d["vllm:spec_decode_num_drafts"]
            run["accept_length"] = (1 + d["vllm:spec_decode_num_accepted_tokens"] / drafts
                                    if drafts else None)
            queries = d["vllm:prefix_cache_queries"]
            run["prefix_cache_hit_rate"] = (d["vllm:prefix_cache_hits"] / queries
                                            if queries else None)
            run["mode"] = mode
            run["server_startup_s"] = round(startup_s, 1)
            # The 1-minute load average as the run ends: on a CPU, other work on the cores
            # (beyond this server and aiperf) slows the run.
            run["load_average"] = os.getloadavg()[0]
            runs.append(run)
            print(f"[{mode}] concurrency {c}: {_row(run)}", flush=True)
            if on_run is not None:
                on_run(run)
    finally:
        server.stop()
    return runs


# ------------------------------------------------------------------ reporting
def _row(r: dict) -> str:
    al = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
    return (f"{r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} "
            f"output tok/s, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, ITL p50 "
            f"{r['itl_ms']['p50']:.1f} ms, accept length {al}, prefix-cache hits "
            f"{_percent(r.get('prefix_cache_hit_rate'))}")


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown_table(runs: list[dict]) -> str:
    head = ("| mode | concurrency | req/s | output tok/s | TTFT ms p50 / p90 / p99 | "
            "ITL ms p50 / p90 / p99 | accept length | prefix-cache hits |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in runs:
        t, i = r["ttft_ms"], r["itl_ms"]
        al = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        lines.append(
            f"| {MODES[r['mode']]} | {r['concurrency']} | {r['request_throughput']:.2f} | "
            f"{r['output_token_throughput']:.1f} | "
            f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
            f"{i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f} | {al} | "
            f"{_percent(r.get('prefix_cache_hit_rate'))} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_token_throughput", None, "output tokens/s"),
              ("request_throughput", None, "requests/s"),
              ("ttft_ms", "p50", "TTFT (ms): p50 (o), p90 (x, dotted)"),
              ("itl_ms", "p50", "inter-token latency (ms): p50 (o), p90 (x, dotted)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, pct, label) in zip(axes, panels):
        for mode in MODES:
            runs = [r for r in result["runs"] if r["mode"] == mode]
            if not runs:
                continue
            xs = [r["concurrency"] for r in runs]
            ys = [r[key][pct] if pct else r[key] for r in runs]
            ax.plot(xs, ys, marker="o", label=MODES[mode])
            if pct:  # how far the tail sits from the median
                ax.plot(xs, [r[key]["p90"] for r in runs], linestyle=":", marker="x",
                        color=ax.lines[-1].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["concurrency"], [str(c) for c in result["concurrency"]])
        ax.set_xlabel("concurrent requests")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    shared = f"{result['prefix_len']} shared + " if result.get("prefix_len") else ""
    fig.suptitle(f"{result['model_label']}, {result['device']}: prompts {shared}"
                 f"{result['isl']} tokens, {result['osl']} generated "
                 f"(aiperf {result['client_version']})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _device() -> str:
    """The device the server will run on, in words (a short child process, so that this
    one never holds the accelerator)."""
    code = ("import jax; d = jax.devices()[0]; "
            "print(f'{len(jax.devices())} x {d.device_kind} ({jax.default_backend()}), "
            "jax {jax.__version__}')")
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True)
    return out.stdout.strip() or "unknown device"


def _aiperf_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).strip().split()[-1] if out.returncode == 0 else "?"


def _earlier_runs(path: str, result: dict, modes: list[str]) -> list[dict]:
    """The runs of ``path`` (an earlier call's results.json) of the modes this call does
    not run, when that call measured the same model under the same load."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --append: there is no {path} to add to; run once without "
                         "--append first")
    with open(path) as f:
        earlier = json.load(f)
    same = ("model", "draft_model", "isl", "osl", "prefix_len", "concurrency", "seed")
    differ = [k for k in same if earlier.get(k) != result[k]]
    if differ:
        raise SystemExit(f"error: --append: {path} measured another setting ({', '.join(differ)}"
                         " differ); give this call another --out")
    return [r for r in earlier["runs"] if r["mode"] not in modes]


# ------------------------------------------------------------------ main
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("the model (default: the embedded default pair)")
    m.add_argument("--model", default=None, help="target checkpoint directory")
    m.add_argument("--draft-model", default=None, help="its EAGLE-3 draft directory")
    m.add_argument("--shape", choices=SHAPES, default=None,
                   help="serve a random pair of this shape (written into --checkpoint-dir)")
    m.add_argument("--checkpoint-dir", default=None,
                   help="where --shape's pair is written and reused "
                        "(default: $TMPDIR/eagle_jax_bench/SHAPE)")
    w = p.add_argument_group("the load")
    w.add_argument("--concurrency", type=_ints, default=[1, 2, 4],
                   help="comma-separated concurrent requests, one aiperf run each")
    w.add_argument("--isl", type=int, default=128, help="prompt tokens (after the prefix)")
    w.add_argument("--prefix-len", type=int, default=0,
                   help="tokens of one prefix that every prompt begins with (a shared "
                        "system prompt; aiperf's prefix prompt pool of one)")
    w.add_argument("--osl", type=int, default=64, help="generated tokens per request")
    w.add_argument("--requests-per-stream", type=int, default=8,
                   help="measured requests per concurrent stream (after one warm-up each)")
    w.add_argument("--requests", type=int, default=None,
                   help="measured requests per run (overrides --requests-per-stream)")
    w.add_argument("--modes", default="eagle3,plain",
                   help="comma-separated: eagle3 (speculation on), plain (off), "
                        "eagle3-no-prefix-cache (speculation on, prefix caching off), "
                        "eagle3-one-prefill (one request's prompt chunk per forward)")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("the tools")
    s.add_argument("--server-arg", action="append", default=[],
                   help="an extra scripts/serve.py argument, repeatable "
                        "(e.g. --server-arg=--max-num-seqs=64)")
    s.add_argument("--aiperf", default=None,
                   help="the aiperf executable (default: beside this Python, else on PATH)")
    s.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a server may take to load and compile")
    s.add_argument("--start-together", action="store_true",
                   help="start every mode's server at once, so that they load and compile "
                        "in parallel; once all are healthy, measure them one at a time "
                        "(the others idle); "
                        "on a GPU each gets 0.9 / modes of its memory "
                        "(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench_serve_out",
                   help="folder for results.json, the plot, aiperf's artifacts, server logs")
    o.add_argument("--plot", default=None, help="the plot's path (default: OUT/serving.png)")
    o.add_argument("--label", default=None, help="the model's name in the plot and JSON")
    o.add_argument("--append", action="store_true",
                   help="keep OUT/results.json's runs of the other modes (split the modes "
                        "over two calls with the same settings; the plot shows both)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    unknown = [x for x in modes if x not in MODES]
    if unknown or not modes:
        print(f"error: --modes takes {', '.join(MODES)}; got {args.modes!r}", file=sys.stderr)
        return 2
    args.aiperf = args.aiperf or shutil.which(
        "aiperf", path=os.path.dirname(sys.executable)) or shutil.which("aiperf")
    if not args.aiperf:
        print("error: aiperf not found beside this Python or on PATH: "
              "pip install -e \".[bench]\", or pass --aiperf PATH", file=sys.stderr)
        return 2
    if args.shape and (args.model or args.draft_model):
        print("error: --shape serves a random pair; it takes no --model / --draft-model",
              file=sys.stderr)
        return 2

    if args.shape:
        checkpoint_dir = args.checkpoint_dir or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), "eagle_jax_bench", args.shape)
        target, draft = random_pair(args.shape, checkpoint_dir)
        label = args.label or f"random {args.shape}-shaped pair"
    elif args.model:
        target, draft = args.model, args.draft_model
        if any(m != "plain" for m in modes) and not draft:
            print("error: speculation needs --draft-model DIR (or --modes plain)",
                  file=sys.stderr)
            return 2
        label = args.label or os.path.basename(os.path.normpath(target))
    else:
        from eagle_jax.assets import default_pair

        target, draft = default_pair()
        label = args.label or "embedded default pair"

    out_dir = os.path.abspath(args.out)
    os.makedirs(os.path.join(out_dir, "aiperf"), exist_ok=True)
    result = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), device=_device(),
        model_label=label, model=target, draft_model=draft,
        client="aiperf", client_version=_aiperf_version(args.aiperf),
        isl=args.isl, osl=args.osl, prefix_len=args.prefix_len,
        concurrency=args.concurrency, seed=args.seed,
        server_args=args.server_arg, cpu_count=os.cpu_count(),
        command=" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]), runs=[])
    results_path = os.path.join(out_dir, "results.json")
    if args.append:
        result["runs"] = _earlier_runs(results_path, result, modes)

    def save(run: dict | None = None) -> None:
        # After every run, so that a call stopped part-way (a time limit) keeps its rows.
        if run is not None:
            result["runs"].append(run)
        with open(results_path, "w") as f:
            json.dump(result, f, indent=2)

    servers = {}
    if args.start_together and len(modes) > 1:
        # Every mode's server loads and compiles at once (start-up is the long part on a
        # GPU); each then serves alone while the others wait idle. On a GPU each takes
        # an equal share of the device memory (XLA's preallocation, then its KV pool).
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                  f"{0.9 / len(modes):.2f}")
        result["servers_started_together"] = dict(xla_python_client_mem_fraction=fraction)
        for mode in modes:
            servers[mode] = start_server(args, mode, target, draft, out_dir, wait=False,
                                         env={"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction})
    try:
        for server in servers.values():  # none is measured while another still compiles
            server.wait_healthy(args.startup_timeout)
            server.startup_s = time.monotonic() - server.launched  # at most this
        for mode in modes:
            bench_mode(args, mode, target, draft, out_dir, on_run=save,
                       server=servers.pop(mode, None))
    finally:
        for server in servers.values():
            server.stop()
    save()
    plot_path = args.plot or os.path.join(out_dir, "serving.png")
    plot(result, plot_path)
    print(f"\n{label}, {result['device']}, prompts {args.prefix_len} shared + {args.isl} "
          f"tokens, {args.osl} generated:")
    print(markdown_table(result["runs"]))
    print(f"\nresults: {results_path}; plot: {plot_path}")
    return 0

