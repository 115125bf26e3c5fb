"""The engine the server drives (``eagle_jax.engine.protocol.EngineClient``): ``Engine``,
``DataParallelEngine`` and ``multihost.LockstepEngine`` satisfy it, and the server
reaches the engine through it alone.

One small engine (a tiny random EAGLE-3 pair, float32 on the CPU, one bucket, a fixed
draft length, precompile off) serves all three: it is the data-parallel engine's one
replica, and the lockstep engine leads a job of one process with it. The server's check
reads its source with ``ast`` (nothing is imported).
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing

import pytest

from eagle_jax.engine import DataParallelEngine, Engine, EngineConfig
from eagle_jax.engine.multihost import LockstepEngine
from eagle_jax.engine.protocol import EngineClient

SERVER = pathlib.Path(__file__).resolve().parents[1] / "eagle_jax" / "server"
MEMBERS = {name: value for name, value in vars(EngineClient).items()
           if not name.startswith("_")}
METHODS = sorted(name for name, value in MEMBERS.items() if inspect.isfunction(value))
ATTRIBUTES = sorted(name for name, value in MEMBERS.items() if isinstance(value, property))
CLASSES = {"engine": Engine, "data_parallel": DataParallelEngine, "lockstep": LockstepEngine}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """kind -> an instance of CLASSES[kind], all over one Engine."""
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    root = tmp_path_factory.mktemp("protocol")
    target = write_tiny_target(str(root / "target"), vocab_size=320, eos_token_id=2)
    write_test_tokenizer(target, vocab_size=300)
    draft = write_tiny_eagle3_draft(str(root / "draft"), target)
    engine = Engine(EngineConfig(
        model=target, draft_model=draft, speculative_algorithm="EAGLE3", num_steps=2,
        speculative_policy="fixed", dtype="float32", max_model_len=64, max_num_seqs=2,
        batch_buckets=(2,), prefill_buckets=(16,), precompile=False,
        compilation_cache_dir=""))
    return {"engine": engine, "data_parallel": DataParallelEngine([engine]),
            "lockstep": LockstepEngine(engine, heartbeat_seconds=None)}


def test_the_protocol_declares_what_the_drivers_use():
    assert set(METHODS) == {
        "add_request", "abort_request", "has_unfinished_requests", "num_running",
        "num_waiting", "step", "add_step_listener", "prompt_logprobs", "scheduler_stats"}
    assert set(ATTRIBUTES) == {"config", "model_name", "tokenizer", "vocab_size",
                               "max_model_len", "num_slots", "num_steps", "stats",
                               "compile_progress"}
    assert set(MEMBERS) == set(METHODS) | set(ATTRIBUTES)


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_method_has_the_protocols_signature(kind, name):
    """Parameter names, kinds and defaults, and the annotations (resolved) of each."""
    declared, method = MEMBERS[name], getattr(CLASSES[kind], name)
    assert method is not declared, f"{kind} inherits {name} without defining it"
    assert inspect.signature(method) == inspect.signature(declared), (kind, name)
    assert typing.get_type_hints(method) == typing.get_type_hints(declared), (kind, name)


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_attribute_is_of_the_declared_type(engines, kind):
    """On an instance: each attribute exists and has the property's return type."""
    instance = engines[kind]
    assert isinstance(instance, EngineClient)
    for name in ATTRIBUTES:
        want = typing.get_type_hints(MEMBERS[name].fget)["return"]
        value = getattr(instance, name)
        assert isinstance(value, want), (kind, name, type(value), want)


@pytest.mark.parametrize("kind", ["data_parallel", "lockstep"])
def test_a_front_reads_its_engines_attributes(engines, kind):
    engine, front = engines["engine"], engines[kind]
    for name in ATTRIBUTES:
        if name != "config":
            assert getattr(front, name) == getattr(engine, name), (kind, name)
    assert front.config.data_parallel_size == 1 and front.config.model == engine.config.model


# ----------------------------------------------------------------- the server
def _is_engine(node: ast.AST) -> bool:
    """``engine`` or ``<anything>.engine``: the engine object (``async_engine`` is not)."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def _mentions_any(annotation: ast.AST | None) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return annotation is not None and any(
        (isinstance(n, ast.Name) and n.id == "Any") or
        (isinstance(n, ast.Attribute) and n.attr == "Any") for n in ast.walk(annotation))


def _server_trees():
    for path in sorted(SERVER.glob("*.py")):
        yield path.name, ast.parse(path.read_text(), str(path))


def test_the_server_never_probes_the_engine():
    probes = [f"{name}:{node.lineno}" for name, tree in _server_trees()
              for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and node.args
              and _is_engine(node.args[0])]
    assert not probes, f"getattr/hasattr on the engine: declare it in EngineClient: {probes}"


def test_the_server_types_the_engine_as_the_protocol():
    """No ``engine`` parameter or attribute is annotated with Any, and the three that take
    the engine from outside (``create_app``, ``AsyncEngine``, ``OpenAIServing``) name
    EngineClient."""
    untyped, typed = [], set()
    for name, tree in _server_trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "engine":
                        if _mentions_any(arg.annotation):
                            untyped.append(f"{name}:{node.lineno}")
                        elif ast.unparse(arg.annotation or ast.Constant(None)) == "EngineClient":
                            typed.add(f"{name}:{node.name}")
            elif isinstance(node, ast.AnnAssign) and _is_engine(node.target) and \
                    _mentions_any(node.annotation):
                untyped.append(f"{name}:{node.lineno}")
    assert not untyped, f"the engine annotated as Any: {untyped}"
    assert {"app.py:create_app", "async_engine.py:__init__",
            "serving_engine.py:__init__"} <= typed, typed
