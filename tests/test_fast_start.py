"""Start-up: the executable store (a warm start loads executables without tracing) and
serving while the executables compile in the background (``compile_in_background``).

Engines are tiny (the conftest's Llama target and EAGLE-3 draft, float32 on the CPU)
with few buckets; the background engine is shared by the readiness tests, which run in
order: first with its background compiles held back, then after they finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine import executable_store
from eagle_jax.engine.buckets import PrefillKey, ScoreKey, StepKey, UpdateSlotsKey
from eagle_jax.engine.executable_store import ExecutableStore
from eagle_jax.engine.executables import CallSignature, jit_compile
from eagle_jax.engine.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _config(models, **kw) -> EngineConfig:
    return EngineConfig(**{
        **dict(model=models["target"], draft_model=models["eagle3"],
               speculative_algorithm="EAGLE3", num_steps=2, speculative_policy="fixed",
               dtype="float32", max_model_len=96, max_num_seqs=4, batch_buckets=(1, 4),
               prefill_buckets=(16, 32), compilation_cache_dir=""), **kw})


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(7, 300, int(rng.integers(5, 40)))]
            for _ in range(n)]


def _generate(engine, prompts, tag="r") -> dict[str, list[int]]:
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, GREEDY)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.fixture(autouse=True)
def keep_jax_cache_dir():
    """JAX's persistent cache off for the test (the store keeps nothing while it is in
    use: ``executable_store.jax_cache_in_use``), the session's put back afterwards. JAX
    decides once per process whether its cache is used: the decision is reset."""
    from jax._src import compilation_cache

    old = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    compilation_cache.reset_cache()


# ------------------------------------------------------------- the executable store
def test_warm_store_loads_without_tracing_and_gives_the_same_tokens(
        models, tmp_path, monkeypatch, keep_jax_cache_dir):
    lowered, traced = [], []
    lower, step_function = CallSignature.lower, ModelRunner.step_function
    monkeypatch.setattr(CallSignature, "lower",
                        lambda self, *a: lowered.append(1) or lower(self, *a))

    def counting_step_function(self, *args, **kwargs):
        fn = step_function(self, *args, **kwargs)
        return lambda *a: traced.append(args) or fn(*a)  # called only when traced

    monkeypatch.setattr(ModelRunner, "step_function", counting_step_function)
    config = _config(models, compilation_cache_dir=str(tmp_path))
    cold = Engine(config)
    menu = cold.buckets.executables()
    steps = [k for k in menu if isinstance(k, StepKey)]
    assert len(lowered) == len(menu) and len(traced) == len(steps)
    store = cold.runner.executables.store
    assert store.misses == len(menu) and store.hits == 0
    entries = os.listdir(tmp_path / executable_store.STORE_SUBDIR)
    assert len([e for e in entries if e.endswith(".bin")]) == len(menu)
    prompts = _prompts(3)
    want = _generate(cold, prompts)
    del cold

    lowered.clear()
    traced.clear()
    warm = Engine(config)
    assert lowered == [] and traced == []  # loaded, never traced
    store = warm.runner.executables.store
    assert store.hits == len(menu) and store.misses == 0
    assert _generate(warm, prompts) == want


def _double(x, y):
    return x * 2 + y, x.sum()


def _args(n=4):
    return (jnp.arange(n, dtype=jnp.float32), jnp.ones((n,), jnp.float32))


def test_a_changed_source_config_shape_or_key_is_a_miss(tmp_path, monkeypatch):
    device = jax.devices()[0]
    base = ExecutableStore(str(tmp_path), "context-a", [device])
    key = StepKey(4, False, 0, 2)
    path = base.path(key, _args(), ())
    assert ExecutableStore(str(tmp_path), "context-a", [device]).path(key, _args(), ()) == path
    assert ExecutableStore(str(tmp_path), "context-b", [device]).path(key, _args(), ()) != path
    assert base.path(key, _args(8), ()) != path
    assert base.path(key, (_args()[0].astype(jnp.int32), _args()[1]), ()) != path
    assert base.path(key, _args(), (0,)) != path
    assert base.path(StepKey(4, False, 0, 1), _args(), ()) != path
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert ExecutableStore(str(tmp_path), "context-a", [device]).path(key, _args(), ()) != path
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(executable_store, "source_hash", lambda: "edited")
    assert ExecutableStore(str(tmp_path), "context-a", [device]).path(key, _args(), ()) != path

    # End to end: stored, then loaded without lowering; a new shape compiles again.
    lowered = []
    lower = CallSignature.lower
    monkeypatch.setattr(CallSignature, "lower",
                        lambda self, *a: lowered.append(1) or lower(self, *a))
    first = ExecutableStore(str(tmp_path), "ctx", [device])
    got = first.load_or_compile(key, _double, _args(), ())(*_args())
    assert (first.misses, len(lowered)) == (1, 1)
    second = ExecutableStore(str(tmp_path), "ctx", [device])
    again = second.load_or_compile(key, _double, _args(), ())(*_args())
    assert (second.hits, second.misses, len(lowered)) == (1, 0, 1)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(got[0]))
    second.load_or_compile(key, _double, _args(8), ())
    assert (second.misses, len(lowered)) == (1, 2)


def test_a_corrupt_entry_is_logged_and_compiled_again(tmp_path, caplog):
    device = jax.devices()[0]
    key = PrefillKey(1, 16, False)
    store = ExecutableStore(str(tmp_path), "ctx", [device])
    path = store.path(key, _args(), ())
    store.load_or_compile(key, _double, _args(), ())
    for garbage in (b"not a pickle", open(path, "rb").read()[:100]):  # junk, truncated
        with open(path, "wb") as f:
            f.write(garbage)
        store = ExecutableStore(str(tmp_path), "ctx", [device])
        with caplog.at_level(logging.WARNING, logger="eagle_jax.engine"):
            out = store.load_or_compile(key, _double, _args(), ())(*_args())
        assert "does not load" in caplog.text and store.misses == 1
        np.testing.assert_array_equal(np.asarray(out[0]), np.arange(4) * 2 + 1)
        caplog.clear()
    fresh = ExecutableStore(str(tmp_path), "ctx", [device])  # rewritten: a hit again
    fresh.load_or_compile(key, _double, _args(), ())
    assert (fresh.hits, fresh.misses) == (1, 0)


def test_the_comparison_tool_and_a_draft_probs_hook_do_not_use_the_store(models, tmp_path,
                                                                          keep_jax_cache_dir):
    def own_compile(key, fn, example_args, donate_argnums):
        return jit_compile(key, fn, example_args, donate_argnums)

    engine = Engine(_config(models, compilation_cache_dir=str(tmp_path), precompile=False),
                    compile_fn=own_compile)
    assert engine.runner.executables.store is None
    hooked = Engine(_config(models, compilation_cache_dir=str(tmp_path), precompile=False),
                    draft_probs_hook=lambda q: q)
    assert hooked.runner.executables.store is None
    served = Engine(_config(models, compilation_cache_dir=str(tmp_path), precompile=False))
    assert served.runner.executables.store is not None


# ------------------------------------------------------ serving while compiling
class GatedCompiles:
    """A CompileFn: ``jit_compile``, where the background's compiles wait for ``gate``
    (so the engine serves with the ready set alone), and each compile's key name and
    thread are recorded."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self.gate_timed_out = False

    def __call__(self, key, fn, example_args, donate_argnums):
        thread = threading.current_thread().name
        self.calls.append((key.name, thread))
        if thread.startswith("eagle-jax-compile") and not self.gate.wait(timeout=60):
            self.gate_timed_out = True  # something waited on a held-back compile
        return jit_compile(key, fn, example_args, donate_argnums)


@pytest.fixture(scope="module")
def gated(models):
    compiles = GatedCompiles()
    engine = Engine(_config(models, compile_in_background=True, batch_buckets=(1, 2, 4),
                            background_compile_threads=1), compile_fn=compiles)
    yield engine, compiles
    compiles.gate.set()
    engine.finish_compiling()


def _batches(engine, prompts, tag, arrive_late=()):
    """(greedy outputs, each step's batch bucket); the prompts at ``arrive_late``
    indices join after the others decode two steps."""
    batches, out = [], {}
    listener = lambda event: event.output is not None and batches.append(
        event.output.tokens.shape[0])
    engine.add_step_listener(listener)
    for i, p in enumerate(prompts):
        if i not in arrive_late:
            engine.add_request(f"{tag}{i}", p, GREEDY)
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 2:
            for i in arrive_late:
                engine.add_request(f"{tag}{i}", prompts[i], GREEDY)
    engine.remove_step_listener(listener)
    return {k[len(tag):]: v for k, v in out.items()}, batches


def test_the_ready_set_serves_before_the_rest_compile(gated):
    engine, compiles = gated
    ready = engine.buckets.ready_set()
    assert ready == [StepKey(4, False, 0, 2), PrefillKey(1, 32, False), UpdateSlotsKey()]
    progress = engine.compile_progress
    assert progress.compiled == len(ready)
    assert progress.pending == len(engine.buckets.executables()) - len(ready)
    assert not progress.complete
    calls = len(compiles.calls)
    prefills = engine.num_prefill_runs
    out, batches = _batches(engine, _prompts(3, seed=1), "a", arrive_late=(2,))
    # Nothing compiled on the step path: every step ran a compiled executable.
    me = threading.current_thread().name
    assert [c for c in compiles.calls[calls:] if c[1] == me] == []
    assert not compiles.gate_timed_out
    assert engine.compile_progress == progress  # still held back
    assert set(batches) == {4}  # the largest bucket, the only compiled step
    assert all(len(v) == GREEDY.max_tokens for v in out.values())
    gated_outputs["ready"] = out, engine.num_prefill_runs - prefills


# What the engine did with the ready set alone: (outputs, prefills run on their own).
gated_outputs: dict[str, tuple] = {}


def test_health_and_metrics_tell_the_compile_state(gated):
    from eagle_jax.server import create_app

    engine, compiles = gated
    app = create_app(engine)

    async def read():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                health = await c.get("/health")
                metrics = (await c.get("/metrics")).text
        return health, metrics

    total = len(engine.buckets.executables())
    health, metrics = asyncio.run(read())
    assert health.status_code == 200
    assert health.json() == {"status": "ready-compiling", "executables_compiled": 3,
                             "executables_total": total}
    assert 'eagle_jax:executables_pending{model_name="' in metrics
    assert f"eagle_jax:executables_pending{{model_name=\"{engine.model_name}\"}} " \
           f"{float(total - 3)}" in metrics

    compiles.gate.set()
    engine.finish_compiling()
    health, metrics = asyncio.run(read())
    assert health.json() == {"status": "ready-complete", "executables_compiled": total,
                             "executables_total": total}
    # background_compile_threads=1: every background compile ran in the one thread.
    background = {name for _, name in compiles.calls if name.startswith("eagle-jax-compile")}
    assert len(background) == 1 and len(compiles.calls) >= total
    assert f"eagle_jax:executables_pending{{model_name=\"{engine.model_name}\"}} 0.0" in metrics
    assert f"eagle_jax:executables_compiled{{model_name=\"{engine.model_name}\"}} " \
           f"{float(total)}" in metrics


def test_once_all_are_compiled_choices_are_the_menus_and_tokens_the_same(gated):
    engine, compiles = gated
    assert engine.compile_progress.complete
    calls = len(compiles.calls)
    prefills = engine.num_prefill_runs
    out, batches = _batches(engine, _prompts(3, seed=1), "b", arrive_late=(2,))
    assert compiles.calls[calls:] == []
    ready_out, ready_prefills = gated_outputs["ready"]
    assert out == ready_out  # greedy: the target's tokens either way
    assert 2 in batches  # a smaller bucket, now compiled, is chosen
    # The late prompt, arriving while others decode, rode in the steps' lanes; with the
    # ready set alone (no step with lanes) it ran as prefills of its own.
    assert engine.num_prefill_runs - prefills < ready_prefills


def test_the_least_recently_used_entries_go_past_the_size_limit(tmp_path):
    device = jax.devices()[0]
    keys = [StepKey(b, False, 0, 2) for b in (1, 2, 3)]
    store = ExecutableStore(str(tmp_path), "ctx", [device])
    store.load_or_compile(keys[0], _double, _args(), ())
    size = os.path.getsize(store.path(keys[0], _args(), ()))
    store.max_bytes = 2 * size + size // 2  # room for two entries
    store.load_or_compile(keys[1], _double, _args(), ())
    for i, key in enumerate(keys[:2]):  # key 0 older than key 1
        os.utime(store.path(key, _args(), ()), (1000 + i, 1000 + i))
    store.load_or_compile(keys[0], _double, _args(), ())  # a hit: now the newest
    assert store.hits == 1
    store.load_or_compile(keys[2], _double, _args(), ())
    assert [os.path.exists(store.path(k, _args(), ())) for k in keys] == [True, False, True]


def test_nothing_is_stored_while_jaxs_cache_is_in_use(tmp_path, keep_jax_cache_dir):
    """With JAX's persistent cache in use a compile may be a load from it, whose
    serialization lacks its compiled functions on a CPU (the entry loaded, then failed at
    its first call): the store compiles and keeps nothing; with the cache off it keeps."""
    from jax._src import compilation_cache

    def fused(x, y):
        return jnp.where(x > 0, x + y, y * 2).sum() + jnp.tanh(x @ y.T).sum()

    args = (jax.random.normal(jax.random.key(1), (32, 32)), jnp.ones((32, 32)))
    device, key = jax.devices()[0], ScoreKey(32)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    jax.jit(fused).lower(*args).compile()  # into JAX's cache
    jax.clear_caches()
    store = ExecutableStore(str(tmp_path / "store"), "ctx", [device])
    out = store.load_or_compile(key, fused, args, ())(*args)
    assert float(out) == pytest.approx(float(fused(*args)))
    assert not os.path.exists(store.path(key, args, ())) and store.misses == 1

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    jax.clear_caches()  # (the in-memory executable is the one JAX's cache gave)
    ExecutableStore(str(tmp_path / "store"), "ctx", [device]).load_or_compile(
        key, fused, args, ())
    store = ExecutableStore(str(tmp_path / "store"), "ctx", [device])
    assert float(store.load_or_compile(key, fused, args, ())(*args)) == pytest.approx(
        float(fused(*args)))
    assert store.hits == 1


# ------------------------------------------------------------------------- warm-up
def test_warm_up_runs_the_ready_set_and_changes_nothing(models, tmp_path):
    """``startup.warm_up`` (run on a GPU before the engine says it is ready) runs the
    ready set through the runner's own dispatch on inputs that change nothing: over KV
    pools of random values, the pools, page tables, lengths, activity and sampling rows
    come back as they were, and the engine then generates what an engine that skipped
    it generates, greedy and seeded sampling alike. (The second engine loads the first's
    executables from their store: compiled once, the same programs.)"""
    from eagle_jax.engine import startup
    from eagle_jax.models.layers import KVPages

    config = _config(models, precompile=False, compilation_cache_dir=str(tmp_path))
    engine = Engine(config)
    runner = engine.runner
    rng = np.random.default_rng(0)

    def noise(pages):
        return KVPages(*(tuple(jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in kv)
                         for kv in pages))

    runner.state = runner.state._replace(target_pages=noise(runner.state.target_pages),
                                         draft_pages=noise(runner.state.draft_pages))
    keep = ("target_pages", "draft_pages", "page_table", "seq_len", "active", "sampling",
            "draft_lag", "draft_page_table")
    before = jax.device_get({f: getattr(runner.state, f) for f in keep})
    assert len(runner.executables) == 0
    startup.warm_up(runner, engine.buckets.ready_set())
    assert len(runner.executables) == len(engine.buckets.ready_set()) == 3
    after = jax.device_get({f: getattr(runner.state, f) for f in keep})
    for field in keep:
        jax.tree.map(np.testing.assert_array_equal, after[field], before[field])

    prompts = _prompts(3, seed=5)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    cold = Engine(config)
    for e in (engine, cold):
        e.add_request("s", prompts[0], sampled)
    assert _generate(engine, prompts) == _generate(cold, prompts)
