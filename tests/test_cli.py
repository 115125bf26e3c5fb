"""The command line: ``eagle-jax`` lists and runs every tool, ``EngineConfig`` declares the
engine's flags once, ``scripts/*.py`` are shims, and nothing edits ``sys.path``."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from eagle_jax.cli import BENCHES, COMMANDS
from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.config_flags import CLI_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
EAGLE_JAX = os.path.join(os.path.dirname(sys.executable), "eagle-jax")  # pip install -e
SUBCOMMANDS = [[c] for c in COMMANDS if c != "bench"] + [["bench", b] for b in BENCHES]
# What the README's "Run" section types, with its defaults.
README_FLAGS = ("--model --draft-model --speculative-algorithm --num-steps --num-draft-tokens "
                "--draft-sample-method --kv-cache-memory --kv-cache-memory-fraction "
                "--max-num-seqs --max-model-len --page-size --dtype --max-num-batched-tokens "
                "--max-num-partial-prefills --no-prefix-caching --speculative-policy "
                "--speculative-draft-lengths --speculative-eagle-topk --tree-verify "
                "--tensor-parallel-size --data-parallel-size").split()


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=300,
                          cwd=REPO)


@pytest.mark.parametrize("command", [[EAGLE_JAX], [sys.executable, "-m", "eagle_jax"]],
                         ids=["eagle-jax", "python -m eagle_jax"])
def test_help_lists_every_command(command):
    res = _run(*command, "--help")
    assert res.returncode == 0, res.stderr
    for name in COMMANDS:
        assert f"\n    {name}" in res.stdout, (name, res.stdout)
    res = _run(*command, "bench", "--help")
    assert res.returncode == 0, res.stderr
    for name in BENCHES:
        assert f"\n    {name}" in res.stdout, (name, res.stdout)
    assert {"engine", "kernels", "prefix", "tree", "draft-policy", "parallel", "attention",
            "serve"} <= set(BENCHES)
    assert {"serve", "evaluate", "compare-replay", "convert", "train-draft", "bench"} <= set(
        COMMANDS)


def test_an_unknown_command_is_a_usage_error():
    res = _run(EAGLE_JAX, "no-such-command")
    assert res.returncode == 2 and "invalid choice" in res.stderr


def test_every_subcommand_has_help():
    """Each command's ``--help`` (one child process for all of them: each imports jax)."""
    code = f"""
import contextlib, io, json
from eagle_jax.cli import main
out = {{}}
for cmd in {SUBCOMMANDS!r}:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = main(cmd + ["--help"])
        except SystemExit as e:
            rc = e.code
    out[" ".join(cmd)] = [rc, buf.getvalue()]
print(json.dumps(out))
"""
    res = _run(sys.executable, "-c", code)
    assert res.returncode == 0, res.stderr[-3000:]
    helps = json.loads(res.stdout.splitlines()[-1])
    assert sorted(helps) == sorted(" ".join(c) for c in SUBCOMMANDS)
    for cmd, (rc, text) in helps.items():
        assert rc == 0, cmd
        assert text.startswith(f"usage: eagle-jax {cmd} "), (cmd, text[:200])


def _engine_parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser, **kwargs)
    return parser


def test_from_cli_args_of_no_flags_is_the_default_config():
    from eagle_jax.server.serve import build_parser

    # The server's one default of its own: it serves while the executables compile.
    for parser, own in ((_engine_parser(), {}), (build_parser(), {"compile_in_background": True})):
        args = parser.parse_args([])
        assert EngineConfig.from_cli_args(args, model="t", draft_model="d") == EngineConfig(
            model="t", draft_model="d", **own)
    plain = EngineConfig.from_cli_args(_engine_parser().parse_args(
        ["--model", "t", "--speculative-algorithm", "none"]))
    assert plain == EngineConfig(model="t", speculative_algorithm="NONE")


def test_flags_reach_their_fields():
    args = _engine_parser().parse_args([
        "--model", "t", "--draft-model", "d", "--speculative-algorithm", "eagle",
        "--num-steps", "3", "--speculative-draft-lengths", "3,0,1", "--speculative-policy",
        "adaptive", "--draft-sample-method", "greedy", "--max-model-len", "256",
        "--max-num-seqs", "8", "--page-size", "32", "--no-prefix-caching",
        "--max-num-batched-tokens", "128", "--max-num-partial-prefills", "2",
        "--batch-buckets", "8,1,8", "--prefill-buckets", "64,16", "--dtype", "float32",
        "--kv-cache-memory-fraction", "0.5", "--seed", "7", "--no-precompile",
        "--compilation-cache-dir", "", "--tensor-parallel-size", "2",
        "--data-parallel-size", "3"])
    config = EngineConfig.from_cli_args(args)
    assert config == EngineConfig(
        model="t", draft_model="d", speculative_algorithm="EAGLE", num_steps=3,
        draft_lengths=(0, 1, 3), speculative_policy="adaptive", draft_sample_method="greedy",
        max_model_len=256, max_num_seqs=8, page_size=32, enable_prefix_caching=False,
        max_num_batched_tokens=128, max_num_partial_prefills=2, batch_buckets=(1, 8),
        prefill_buckets=(16, 64), dtype="float32", kv_cache_memory_fraction=0.5, seed=7,
        precompile=False, compilation_cache_dir="", tensor_parallel_size=2,
        data_parallel_size=3)
    tree = EngineConfig.from_cli_args(_engine_parser().parse_args(
        ["--speculative-eagle-topk", "4", "--num-steps", "6", "--num-draft-tokens", "16",
         "--tree-verify", "target_only", "--kv-cache-memory", "1000", "--precompile-logprobs"]),
        model="t", draft_model="d")
    assert (tree.speculative_eagle_topk, tree.num_steps, tree.num_draft_tokens,
            tree.tree_verify, tree.kv_cache_memory, tree.precompile_logprobs) == (
        4, 6, 16, "target_only", 1000, True)
    # overrides win over the flags
    assert EngineConfig.from_cli_args(args, seed=1, max_num_seqs=None) == dataclasses.replace(
        config, seed=1, max_num_seqs=None)


def test_tools_choose_flags_and_defaults():
    parser = _engine_parser(include=("model", "num_steps"), defaults=dict(num_steps=3))
    args = parser.parse_args([])
    assert EngineConfig.from_cli_args(args, model="t", draft_model="d") == EngineConfig(
        model="t", draft_model="d", num_steps=3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--page-size", "32"])  # not declared
    with pytest.raises(ValueError, match="not an engine flag's field"):
        _engine_parser(include=("no_such_field",))
    # A tool's own flag of the same name is never read as the engine's.
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-steps", default=[3, 5])
    EngineConfig.add_cli_args(parser, exclude=("num_steps",))
    assert EngineConfig.from_cli_args(parser.parse_args([]), model="t", draft_model="d",
                                      num_steps=4).num_steps == 4


def test_every_readme_flag_is_declared_once():
    from eagle_jax.eval.evaluate import build_parser as evaluate_parser
    from eagle_jax.server.serve import build_parser as serve_parser

    flags = [f.flag for f in CLI_FLAGS]
    assert len(flags) == len(set(flags))
    assert set(README_FLAGS) <= set(flags)
    serve = serve_parser()._option_string_actions
    assert set(flags) <= set(serve)
    evaluate = evaluate_parser().parse_args([])
    assert (evaluate.dtype, evaluate.max_model_len, evaluate.speculative_policy) == (
        "float32", 512, "fixed")


def _python_files():
    for top in ("eagle_jax", "scripts", "tests"):
        yield from sorted((REPO / top).rglob("*.py"))


def test_nothing_edits_sys_path():
    def is_sys_path(node):
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")

    found = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            edited = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and is_sys_path(node.func.value))
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AugAssign) else [])
            edited |= any(is_sys_path(t) or (isinstance(t, ast.Subscript)
                                             and is_sys_path(t.value)) for t in targets)
            if edited:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_scripts_are_shims():
    """Each ``scripts/*.py`` imports its command's ``main`` from the package and defines
    nothing of its own."""
    for path in sorted((REPO / "scripts").glob("*.py")):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef))], path.name
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert any(n.module.startswith("eagle_jax.") and [a.name for a in n.names] == ["main"]
                   for n in imports), path.name
