#!/usr/bin/env python
"""OpenAI-compatible server for an EAGLE / EAGLE-3 speculative-decoding engine.

    python scripts/serve.py --model TARGET_DIR --draft-model DRAFT_DIR \
        [--speculative-algorithm EAGLE3] [--num-steps 5] [--port 8000] ...

Without --model it serves the project's embedded default model and its EAGLE-3 draft
(eagle_jax/assets/default/{target,draft}).
Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/tokenize, /detokenize, /tokenizer_info.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from eagle_jax.cli import positive_int  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    from eagle_jax.engine.config import TREE_VERIFY_METHODS

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="HF checkpoint directory of the target (default: the embedded model)")
    g.add_argument("--draft-model", default=None, help="checkpoint directory of the draft")
    g.add_argument("--speculative-algorithm", default="EAGLE3",
                   choices=["EAGLE", "EAGLE3", "NONE"], type=str.upper)
    g.add_argument("--num-steps", type=positive_int, default=5,
                   help="draft steps per step: a chain's length, a tree's depth")
    g.add_argument("--speculative-eagle-topk", type=positive_int, default=1,
                   help="K: 1 drafts a chain (default); K > 1 an EAGLE-2 dynamic tree, "
                        "K children per expanded node (the policy is then fixed)")
    g.add_argument("--num-draft-tokens", type=positive_int, default=None,
                   help="tokens the target verifies per step, the root included: a chain's "
                        "num_steps + 1 (its only value); a tree's root + nodes (default 32, "
                        "at most 1 + K + (num_steps - 1) K^2)")
    g.add_argument("--tree-verify", default="traversal",
                   choices=list(TREE_VERIFY_METHODS),
                   help="trees: how sampled requests are verified, all exact: traversal "
                        "(the draft's real q, whole paths at once; default), "
                        "recursive_rejection (the same trees, token by token: fewer tokens "
                        "accepted) or target_only (SGLang's rule); greedy requests take the "
                        "target's argmax path")
    g.add_argument("--speculative-policy", default=None, choices=["adaptive", "fixed"],
                   help="adaptive: each step drafts the length (of --speculative-draft-lengths)"
                        " with the most expected committed tokens per second; fixed: every "
                        "step drafts --num-steps (default: adaptive on a GPU, fixed on a CPU)")
    g.add_argument("--speculative-draft-lengths", default=None, type=_int_tuple,
                   help="comma-separated lengths the adaptive policy picks from, 0 (the "
                        "target's step) to --num-steps (default: 0,1,2,3,num_steps)")
    g.add_argument("--draft-sample-method", default="probabilistic",
                   choices=["greedy", "probabilistic"],
                   help="probabilistic: sampled requests draw draft tokens from the draft's "
                        "distribution (greedy requests propose its argmax either way)")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="tokens per request (default: the target's own limit, capped by "
                        "what the KV pool holds; on a CPU by 4096)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="batch slots, requests decoded at once; more wait for KV pages "
                        "(default: 4 on a CPU, 64 on a GPU)")
    g.add_argument("--page-size", type=positive_int, default=16,
                   help="positions per KV page (a power of two)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt in full instead of sharing the KV pages of a "
                        "prefix an earlier request computed")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="positions one step computes: the running requests' decode rows "
                        "plus prefill chunks of new prompts (default: 512 on a CPU, 2048 on "
                        "a GPU); a longer prompt is prefilled over several steps while the "
                        "others keep decoding")
    g.add_argument("--max-num-partial-prefills", type=positive_int, default=None,
                   help="most requests whose prompt chunks one forward carries (default: 1 "
                        "on a CPU, 16 on a GPU): requests arriving together are prefilled "
                        "with one read of the weights")
    g.add_argument("--batch-buckets", default=None,
                   help="comma-separated batch buckets (default: the engine's powers of two "
                        "up to --max-num-seqs)")
    g.add_argument("--prefill-buckets", default=None,
                   help="comma-separated prompt chunk lengths compiled for prefill "
                        "(default: the engine's)")
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="devices the target is split over (a mesh of the first N local "
                        "devices; default 1); multi-host: every process's devices, e.g. 16 "
                        "for 2 hosts x 8 GPUs")
    g.add_argument("--data-parallel-size", type=positive_int, default=1,
                   help="engine replicas behind the server, each over its own "
                        "--tensor-parallel-size devices; requests go to the least loaded "
                        "(default 1)")
    g.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: float32 on a CPU, bfloat16 on a GPU")
    g.add_argument("--kv-cache-memory", type=positive_int, default=None,
                   help="KV pool bytes")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="or this share of the free device memory (GPU; default 0.75)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-precompile", action="store_true",
                   help="compile batch buckets lazily instead of at start-up")
    g.add_argument("--precompile-logprobs", action="store_true",
                   help="also compile the buckets' logprobs variants at start-up, so that "
                   "the first request asking for logprobs (lm-eval's loglikelihood tasks) "
                   "does not stall the running streams while they compile")
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


def _int_tuple(arg: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in arg.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {arg!r}")


def _buckets(arg: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in arg.split(",") if x.strip()}))


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

    from eagle_jax.engine import EngineConfig, make_engine, multihost

    try:  # before anything asks jax for its devices
        distributed = multihost.initialize(args.coordinator_address, args.num_processes,
                                           args.process_id)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    extra = {}
    if args.prefill_buckets:
        extra["prefill_buckets"] = _buckets(args.prefill_buckets)
    if args.batch_buckets:
        extra["batch_buckets"] = _buckets(args.batch_buckets)
    try:
        config = EngineConfig(
            model=model,
            draft_model=draft,
            speculative_algorithm=args.speculative_algorithm,
            num_steps=args.num_steps,
            speculative_eagle_topk=args.speculative_eagle_topk,
            num_draft_tokens=args.num_draft_tokens,
            tree_verify=args.tree_verify,
            draft_sample_method=args.draft_sample_method,
            speculative_policy=args.speculative_policy,
            draft_lengths=args.speculative_draft_lengths,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            page_size=args.page_size,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_partial_prefills=args.max_num_partial_prefills,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            seed=args.seed,
            precompile=not args.no_precompile,
            precompile_logprobs=args.precompile_logprobs,
            **extra,
        )
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
    log.info("serving %s on http://%s:%d (api key %s)", args.served_model_name or engine.model_name,
             args.host, args.port, "required" if api_key else "not required")
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


if __name__ == "__main__":
    sys.exit(main())
