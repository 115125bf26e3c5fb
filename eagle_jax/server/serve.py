"""OpenAI-compatible server for an EAGLE / EAGLE-3 speculative-decoding engine.

    eagle-jax serve --model TARGET_DIR --draft-model DRAFT_DIR \
        [--speculative-algorithm EAGLE3] [--num-steps 5] [--port 8000] ...

Without --model it serves the project's embedded default model and its EAGLE-3 draft
(eagle_jax/assets/default/{target,draft}).
Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/tokenize, /detokenize, /tokenizer_info.

It listens once the executables that serve any request are compiled (loading: the port
refuses connections); /health then answers 200 with {"status": "ready-compiling"} while
the others compile in the background, and "ready-complete" once all are
(--no-compile-in-background: every one before it listens).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from eagle_jax.argtypes import positive_int
from eagle_jax.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # The server answers once the executables that serve any request are compiled and
    # compiles the rest while serving (/health says which).
    EngineConfig.add_cli_args(p, title="model and engine",
                              defaults={"compile_in_background": True})
    m = p.add_argument_group(
        "multi-host (docs/MULTIHOST.md)",
        "one tensor-parallel engine over the devices of several processes (jax.distributed):"
        " start one process per host with the same flags and its own --process-id; process "
        "0 serves HTTP, the others follow its steps. Each flag defaults to its environment "
        "variable (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).")
    m.add_argument("--coordinator-address", default=None,
                   help="host:port where process 0 runs the jax.distributed coordinator")
    m.add_argument("--num-processes", type=positive_int, default=None,
                   help="processes in all (one per host)")
    m.add_argument("--process-id", type=int, default=None,
                   help="this process's number, 0 .. --num-processes - 1 (0 serves)")
    s = p.add_argument_group("server")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the model directory's name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (also env EAGLE_JAX_API_KEY)")
    s.add_argument("--max-queue-len", type=int, default=1024,
                   help="waiting requests beyond the slots before answering 503")
    s.add_argument("--max-body-bytes", type=positive_int, default=8 << 20)
    s.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between stats log lines while busy (0: off)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("eagle_jax.serve")

    model, draft = args.model, args.draft_model
    if model is None:
        from eagle_jax.assets import default_pair

        try:
            model, default_draft = default_pair()
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if draft is None and args.speculative_algorithm != "NONE":
            draft = default_draft
    if not os.path.isdir(model):
        print(f"error: --model {model!r} is not a directory", file=sys.stderr)
        return 2
    if draft is not None and not os.path.isdir(draft):
        print(f"error: --draft-model {draft!r} is not a directory", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("EAGLE_JAX_API_KEY") or None

    from eagle_jax.engine import make_engine, multihost

    try:  # before anything asks jax for its devices
        distributed = multihost.initialize(args.coordinator_address, args.num_processes,
                                           args.process_id)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    try:
        config = EngineConfig.from_cli_args(args, model=model, draft_model=draft)
    except ValueError as e:  # a flag the engine refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("loading the engine: %s", config)
    try:
        engine = make_engine(config)  # an Engine, or data-parallel replicas of one
    except ValueError as e:  # e.g. more replicas than devices
        print(f"error: {e}", file=sys.stderr)
        return 2
    if distributed and not multihost.is_leader():
        return _follow(engine, log)
    if distributed:
        engine = multihost.LockstepEngine(engine)

    import uvicorn

    from eagle_jax.server import create_app

    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_body_bytes,
        log_interval=args.log_interval,
        model_path=model,
    )
    progress = engine.compile_progress
    log.info("serving %s on http://%s:%d (api key %s; %d of %d executables compiled%s)",
             args.served_model_name or engine.model_name, args.host, args.port,
             "required" if api_key else "not required", progress.compiled,
             progress.total,
             "" if progress.complete else ", the rest compiling in the background")
    if distributed:
        # uvicorn re-raises a SIGTERM after its graceful shutdown: as an exception, not
        # the default handler's exit, so that the finally below releases the followers.
        signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        if distributed:
            engine.shutdown()  # the followers return
    return 0


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _follow(engine, log) -> int:
    """A follower process: repeats the leader's steps until the leader shuts down."""
    import jax

    from eagle_jax.engine import multihost

    log.info("process %d of %d: following process %d's steps (it serves HTTP)",
             jax.process_index(), jax.process_count(), multihost.LEADER)
    steps = multihost.follow(engine)
    log.info("the leader shut down after %d steps; exiting", steps)
    return 0
