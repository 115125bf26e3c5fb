"""Start-up: seconds to ready, cold and warm; each executable's compile; weight loading.

Three measurements (``--only`` picks), each printed as a table and kept in ``--json``:

- ``server``: ``eagle-jax serve`` started as a user starts it, first with an empty
  executable store (cold), then again over the store that start filled (warm): seconds
  from launch until ``/health`` answers 200 (ready: the ready set is compiled) and until
  it says ``ready-complete`` (every executable compiled), and the time to first token of
  the first request after ready, the median of the next ones (while the background
  compiles) and, once every executable is compiled, the median at rest (steady).
- ``compile``: every executable of the engine's bucket menu compiled one after another
  as serving compiles it (``CallSignature``, the packed host inputs included): seconds
  to trace, lower and XLA-compile each, and their sums by family (decode steps by draft
  length and prompt-chunk lanes, prefill shapes, catch-up, slot update). A cold compile:
  no cache of any kind.
- ``load``: the target's safetensors read raw (the disk's speed; the page cache is
  dropped first where the process may, and the table says whether it could) and loaded
  by ``load_decoder`` into device arrays, cold and then warm, in GB/s.

With no ``--model``, the default pair; ``--shape llama-8b`` writes (once, into
``--checkpoint-dir``) the random 8B-shaped pair the serving benchmark uses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

import httpx
import jax

from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.buckets import ExecutableKey
from eagle_jax.engine.executables import CallSignature
from eagle_jax.testutil.server import ServerProcess

PROMPT = "def fibonacci(n):"
READ_CHUNK = 64 << 20


# ----------------------------------------------------------------------- the server
@dataclasses.dataclass
class ServerStart:
    """One start of the server: seconds from launch."""

    label: str
    ready_s: float
    complete_s: float | None  # None: not complete within the timeout
    first_ttft_ms: float  # the first request after ready
    compiling_ttft_ms: float  # the median of the requests right after it
    steady_ttft_ms: float | None  # the median once every executable is compiled
    executables: int


def time_to_first_token(base_url: str, max_tokens: int = 8) -> float:
    """Milliseconds from sending a streamed greedy completion to its first token."""
    body = dict(model="bench", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                stream=True)
    t0 = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        lines = r.iter_lines()  # one iterator: a stream is read once
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter()
                for _ in lines:
                    pass
                return (first - t0) * 1e3
    raise RuntimeError("the stream ended with no token")


def start_server(label: str, server_args: list[str], log_dir: str, ready_timeout: float,
                 complete_timeout: float, steady_requests: int) -> ServerStart:
    """Launches the server, polls /health every 50 ms until ready, times the first and
    the next requests, polls until every executable is compiled and times requests
    again (at rest)."""
    launched = time.monotonic()
    server = ServerProcess([*server_args, "--served-model-name", "bench"],
                           env={"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")},
                           log_path=os.path.join(log_dir, f"server-{label}.log"), wait=False)
    try:
        health = _poll_health(server, launched, ready_timeout, lambda body: True)
        ready_s = time.monotonic() - launched
        first = time_to_first_token(server.base_url)
        median_ttft = lambda: statistics.median(time_to_first_token(server.base_url)
                                                for _ in range(steady_requests))
        compiling = median_ttft()
        with contextlib.suppress(TimeoutError):
            health = _poll_health(server, launched, complete_timeout,
                                  lambda body: body["status"] == "ready-complete")
        complete_s, steady = None, None
        if health["status"] == "ready-complete":
            complete_s = time.monotonic() - launched
            steady = median_ttft()
        return ServerStart(label, ready_s, complete_s, first, compiling, steady,
                           health["executables_total"])
    finally:
        server.stop()


def _poll_health(server: ServerProcess, launched: float, timeout: float, done) -> dict:
    """/health's body once ``done(body)``; the last body seen if ``timeout`` seconds after
    launch pass first (TimeoutError if none was seen)."""
    body = None
    while time.monotonic() - launched < timeout:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n"
                               f"{server.log_text()[-5000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(server.base_url + "/health", timeout=2)
            if r.status_code == 200:
                body = r.json()
                if done(body):
                    return body
        time.sleep(0.05)
    if body is None:
        raise TimeoutError(f"the server did not answer /health within {timeout} s:\n"
                           f"{server.log_text()[-5000:]}")
    return body


# --------------------------------------------------------------------- the compiles
@dataclasses.dataclass
class CompileTime:
    key: str
    family: str
    trace_s: float
    lower_s: float
    compile_s: float


def family(key: ExecutableKey) -> str:
    """What an executable buys, for the table's sums: a decode step of a draft length
    (with chunk lanes: prompt chunks riding in it), a prefill shape, ..."""
    if key.name == "step":
        lanes = f", {key.num_lanes} chunk lanes" if key.num_lanes else ""
        return f"step, draft length {key.draft_length}{lanes}"
    if key.name == "prefill":
        return f"prefill, {key.num} x {key.size}"
    return key.name.replace("_", " ")


def time_compiles(config: EngineConfig, with_logprobs: bool = False) -> list[CompileTime]:
    """Trace, lower and compile seconds of every executable of ``config``'s bucket menu,
    one at a time, with no cache: as ``jit_compile`` builds them. (An adaptive draft
    policy compiles and times every step variant as the engine starts, before the menu's
    loop: those are timed as they come.)"""
    config = dataclasses.replace(config, precompile=False, compilation_cache_dir="")
    times: dict[ExecutableKey, CompileTime] = {}

    def timed_compile(key, fn, example_args, donate_argnums):
        signature = CallSignature.of(example_args)
        t0 = time.perf_counter()
        traced = signature.trace(fn, example_args, donate_argnums)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        t = times[key] = CompileTime(repr(key), family(key), t1 - t0, t2 - t1, t3 - t2)
        print(f"  {t.key}: trace {t.trace_s:.2f} s, lower {t.lower_s:.2f} s, compile "
              f"{t.compile_s:.2f} s", flush=True)
        return signature.wrap(compiled)

    engine = Engine(config, compile_fn=timed_compile)
    keys = engine.buckets.executables(with_logprobs)
    for key in keys:
        engine.runner.executables[key]
    return [times[key] for key in keys]


def family_table(times: list[CompileTime]) -> str:
    sums: dict[str, list[float]] = {}
    for t in times:
        row = sums.setdefault(t.family, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += t.trace_s
        row[2] += t.lower_s
        row[3] += t.compile_s
    lines = ["| family | executables | trace s | lower s | compile s | total s |",
             "|---|---|---|---|---|---|"]
    for name, (n, tr, lo, co) in sums.items():
        lines.append(f"| {name} | {n} | {tr:.1f} | {lo:.1f} | {co:.1f} | {tr + lo + co:.1f} |")
    tr, lo, co = (sum(getattr(t, f) for t in times) for f in ("trace_s", "lower_s", "compile_s"))
    lines.append(f"| all | {len(times)} | {tr:.1f} | {lo:.1f} | {co:.1f} | {tr + lo + co:.1f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ weight loading
def drop_page_cache() -> bool:
    """Asks the kernel to drop its page cache (root only); whether it could."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def safetensors_files(model_dir: str) -> list[str]:
    return sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir)
                  if f.endswith(".safetensors"))


def read_raw(paths: list[str]) -> float:
    """Seconds to read ``paths`` whole, in large sequential reads."""
    buf = bytearray(READ_CHUNK)
    t0 = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def time_load(model_dir: str, dtype: str) -> dict:
    """GB/s of the disk (a raw read) and of ``load_decoder`` cold and warm."""
    from eagle_jax.models.decoder import load_decoder

    paths = safetensors_files(model_dir)
    nbytes = sum(os.path.getsize(p) for p in paths)
    dropped = drop_page_cache()
    raw_s = read_raw(paths)
    loads = []
    for cold in (True, False):
        if cold:
            drop_page_cache()
        t0 = time.perf_counter()
        model = load_decoder(model_dir, dtype)
        jax.block_until_ready(jax.tree.leaves(model))
        loads.append(time.perf_counter() - t0)
        del model
    return dict(bytes=nbytes, page_cache_dropped=dropped, disk_gb_s=nbytes / raw_s / 1e9,
                load_cold_gb_s=nbytes / loads[0] / 1e9, load_warm_gb_s=nbytes / loads[1] / 1e9,
                load_cold_s=loads[0], load_warm_s=loads[1])


# ------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle-jax bench startup",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="server,compile,load",
                    help="comma-separated: server, compile, load")
    ap.add_argument("--shape", choices=["default", "llama-8b", "small"], default="default",
                    help="default: --model / --draft-model (the default pair if unset); "
                         "llama-8b / small: the serving benchmark's random pair")
    ap.add_argument("--checkpoint-dir", default="/tmp/eagle_jax_bench_pair",
                    help="where --shape's random pair is written (reused when present)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more flag for the server (repeat)")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--complete-timeout", type=float, default=900,
                    help="seconds after launch to wait for every executable")
    ap.add_argument("--steady-requests", type=int, default=3)
    ap.add_argument("--starts", default="cold,warm",
                    help="server: cold (an empty executable store), then warm (the store "
                         "the cold start filled); 'cold' alone fits a shorter device call")
    ap.add_argument("--with-logprobs", action="store_true",
                    help="compile: also the menu's logprobs variants")
    ap.add_argument("--json", default=None)
    EngineConfig.add_cli_args(ap, include=(
        "model", "draft_model", "speculative_algorithm", "num_steps", "dtype",
        "max_num_seqs", "max_model_len", "batch_buckets", "prefill_buckets",
        "speculative_policy", "draft_lengths", "kv_cache_memory"))
    return ap


def resolve_models(args) -> tuple[str, str | None]:
    if args.shape != "default":
        from eagle_jax.bench.serve import random_pair
        return random_pair(args.shape, args.checkpoint_dir)
    from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    if args.model is None:
        return DEFAULT_TARGET, DEFAULT_DRAFT
    return args.model, args.draft_model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    only = set(args.only.split(","))
    if only - {"server", "compile", "load"}:
        raise SystemExit(f"error: --only takes server, compile, load; got {args.only!r}")
    if args.starts not in ("cold", "cold,warm"):
        raise SystemExit(f"error: --starts takes cold or cold,warm (a warm start needs the "
                         f"cold one's store); got {args.starts!r}")
    target, draft = resolve_models(args)
    spec = {"draft_model": draft} if draft else {"speculative_algorithm": "NONE"}
    config = EngineConfig.from_cli_args(args, model=target, **spec)
    config, notes = config.for_backend(jax.default_backend())
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=args.shape,
                  model=target, draft_model=draft, date=time.strftime("%Y-%m-%d"))
    print(f"device: {result['device']}; jax {jax.__version__}; target {target}", flush=True)
    if "load" in only:
        result["load"] = time_load(target, config.dtype)
        print("\n| bytes | page cache dropped | disk GB/s | load cold GB/s | load warm GB/s |\n"
              "|---|---|---|---|---|\n| {bytes} | {page_cache_dropped} | {disk_gb_s:.2f} | "
              "{load_cold_gb_s:.2f} | {load_warm_gb_s:.2f} |".format(**result["load"]),
              flush=True)
    if "compile" in only:
        print("\ncompiling every executable, one at a time:", flush=True)
        times = time_compiles(config, args.with_logprobs)
        result["compile"] = [dataclasses.asdict(t) for t in times]
        print("\n" + family_table(times), flush=True)
    if "server" in only:
        # The server takes the pair and the speculation flags; other engine flags only
        # through --server-arg (its defaults are the ones a user gets).
        server_args = ["--model", target, "--speculative-algorithm",
                       config.speculative_algorithm, *args.server_arg]
        if config.speculative:
            server_args += ["--draft-model", draft, "--num-steps", str(config.num_steps)]
        store = tempfile.mkdtemp(prefix="eagle_jax_startup_store_")
        logs = tempfile.mkdtemp(prefix="eagle_jax_startup_logs_")
        print(f"\nthe server, {args.starts.replace(',', ' then ')} (logs in {logs}):",
              flush=True)
        starts = []
        try:
            for label in args.starts.split(","):
                starts.append(start_server(
                    label, [*server_args, "--compilation-cache-dir", store], logs,
                    args.ready_timeout, args.complete_timeout, args.steady_requests))
                print(f"  {starts[-1]}", flush=True)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        result["server"] = [dataclasses.asdict(s) for s in starts]
        print("\n| start | ready s | all compiled s | first TTFT ms | TTFT compiling ms | "
              "steady TTFT ms | executables |\n|---|---|---|---|---|---|---|", flush=True)
        for s in starts:
            complete, steady = ("-" if x is None else f"{x:{f}}" for x, f in (
                (s.complete_s, ".1f"), (s.steady_ttft_ms, ".0f")))
            print(f"| {s.label} | {s.ready_s:.1f} | {complete} | {s.first_ttft_ms:.0f} | "
                  f"{s.compiling_ttft_ms:.0f} | {steady} | {s.executables} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
