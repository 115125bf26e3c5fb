"""The command line: ``eagle-jax COMMAND [ARGS]`` (also ``python -m eagle_jax``).

Each command is a tool's ``main(argv)``, imported only when it runs (``--help`` of one
command loads nothing of the others). ``scripts/*.py`` are shims for the same entry
points. The engine's flags are declared once, by ``EngineConfig.add_cli_args``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROG = "eagle-jax"
DESCRIPTION = ("EAGLE / EAGLE-3 speculative decoding in JAX: the server, evaluation, training "
               "and benchmark tools. 'eagle-jax COMMAND --help' documents a command's flags.")

# command -> (module whose main(argv) runs it, one line of help); "bench" -> its own table
BENCHES = {
    "engine": ("eagle_jax.bench.engine",
               "speculative vs plain decoding on the 8B shape, against the bandwidth bound"),
    "kernels": ("eagle_jax.bench.kernels", "the Pallas kernels against their references"),
    "prefix": ("eagle_jax.bench.prefix",
               "prefix caching (TTFT of a hit) and chunked prefill (the streams' stalls)"),
    "tree": ("eagle_jax.bench.tree", "draft trees against chains: step times per batch"),
    "draft-policy": ("eagle_jax.bench.draft_policy",
                     "the adaptive draft length against plain decoding and fixed lengths"),
    "parallel": ("eagle_jax.bench.parallel",
                 "tensor parallel 1 against N, the 70B shape, data-parallel replicas"),
    "attention": ("eagle_jax.bench.attention",
                  "paged attention: checks, timings and a tuning sweep"),
    "serve": ("eagle_jax.bench.serve", "the server under AIPerf, speculation on and off"),
    "startup": ("eagle_jax.bench.startup",
                "seconds to ready cold and warm, each executable's compile, weight loading"),
}
COMMANDS = {
    "serve": ("eagle_jax.server.serve", "the OpenAI-compatible server"),
    "evaluate": ("eagle_jax.eval.evaluate",
                 "offline evaluation: accept length, speed-up, greedy identity, accuracy"),
    "compare-replay": ("eagle_jax.compare.compare_replay",
                       "the jitted step against the same step op by op"),
    "convert": ("eagle_jax.convert_checkpoint",
                "a pickle checkpoint (pytorch_model.bin) to safetensors, tensors only"),
    "train-draft": ("eagle_jax.train.draft_cli", "train an EAGLE-1 / EAGLE-3 draft"),
    "train-target": ("eagle_jax.train.target_cli", "train a small Llama target from scratch"),
    "build-corpus": ("eagle_jax.train.corpus_cli",
                     "the Python-source corpus and tokenizer of the default model"),
    "rocm-compile": ("eagle_jax.bench.rocm_compile",
                     "every kernel's Triton IR compiled for gfx950 / gfx942, on a CPU"),
    "bench": (BENCHES, "the benchmarks: 'eagle-jax bench NAME --help' documents one"),
}


def main(argv: list[str] | None = None) -> int:
    return _dispatch(PROG, DESCRIPTION, COMMANDS, list(sys.argv[1:] if argv is None else argv))


def _dispatch(prog: str, description: str, commands: dict, argv: list[str]) -> int:
    """Runs ``argv[0]``'s entry point on the rest of ``argv``; the parser here only lists
    the commands (``--help``) and refuses an unknown one."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, help) in commands.items():
        sub.add_parser(name, help=help, add_help=False)
    if not argv or argv[0] not in commands:
        parser.parse_args(argv)  # --help exits 0; an unknown command, argparse's error
        parser.print_help(sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    target, help = commands[name]
    if isinstance(target, dict):
        return _dispatch(f"{prog} {name}", help, target, rest)
    entry = importlib.import_module(target).main
    saved = sys.argv
    sys.argv = [f"{prog} {name}", *rest]  # the tool's usage lines name the command
    try:
        return entry(rest) or 0
    finally:
        sys.argv = saved
