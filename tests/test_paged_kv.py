"""The paged KV pool: the allocator, admission that waits for pages, preemption and
recompute, and no page leaked, on tiny models (float32, CPU, kernels interpreted)."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.page_allocator import OutOfPages, PageAllocator, plan_pool

# --------------------------------------------------------------------------- allocator


def test_allocator_reserves_frees_and_reports_updates():
    alloc = PageAllocator(num_pages=10, page_size=4, max_pages_per_owner=4)
    alloc.reserve(0, 5)  # 2 pages
    alloc.reserve(1, 4)  # 1 page
    alloc.reserve(0, 8)  # still 2 pages: nothing new
    assert alloc.pages(0) == [0, 1] and alloc.pages(1) == [2]
    assert alloc.take_updates() == [(0, 0, 0), (0, 1, 1), (1, 0, 2)]
    assert alloc.take_updates() == []
    alloc.reserve(0, 100)  # capped at the table width: 4 pages
    assert len(alloc.pages(0)) == 4 and alloc.num_free == 10 - 5
    np.testing.assert_array_equal(alloc.page_row(0), alloc.pages(0))
    assert abs(alloc.usage - 0.5) < 1e-9
    alloc.reserve(2, 16)  # 4 pages, 1 left
    with pytest.raises(OutOfPages):
        alloc.reserve(3, 8)  # 2 pages wanted, 1 free: nothing taken
    assert alloc.num_free == 1 and alloc.pages(3) == []
    alloc.free(0)
    assert alloc.num_free == 5 and alloc.pages(0) == []
    alloc.reserve(3, 4)  # the last page freed is the first reused
    assert alloc.pages(3) == [alloc.take_updates(3)[0][2]]


def test_allocator_drops_updates_of_a_freed_owner():
    alloc = PageAllocator(num_pages=4, page_size=2, max_pages_per_owner=4)
    alloc.reserve(0, 3)
    alloc.reserve(1, 1)
    alloc.free(0)
    assert [u[0] for u in alloc.take_updates()] == [1]


def test_pool_plan_from_a_budget():
    kw = dict(model_limit=1000, num_slots=4, page_size=16, step_tokens=6, bytes_per_token=100,
              unbudgeted_max_model_len=500)
    # No budget (a CPU): every slot at max_model_len, plus two steps' reach; by default
    # the target's limit capped at the unbudgeted length.
    assert plan_pool(max_model_len=100, budget=None, **kw) == (100, 4 * 7, 7)  # 112 each
    assert plan_pool(max_model_len=None, budget=None, **kw) == (500, 4 * 32, 32)  # 512
    # A budget of 40 pages: 640 positions; the models' 1000 is capped to 628 by default...
    plan = plan_pool(max_model_len=None, budget=40 * 16 * 100, **kw)
    assert plan == (628, 40, 40)
    # ...and an explicit length it cannot hold, or one past the models' limit, is an error.
    with pytest.raises(ValueError, match="fewer than one request of max_model_len 700"):
        plan_pool(max_model_len=700, budget=40 * 16 * 100, **kw)
    with pytest.raises(ValueError, match="exceeds the target.s limit of 1000"):
        plan_pool(max_model_len=1001, budget=None, **kw)
    with pytest.raises(ValueError, match="holds no request"):
        plan_pool(max_model_len=None, budget=100, **kw)


# ----------------------------------------------------------------------------- engine

BASE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, batch_buckets=(4,),
            prefill_buckets=(16,), compilation_cache_dir="", num_steps=3, page_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    root = tmp_path_factory.mktemp("paged")
    target = write_tiny_target(str(root / "target"), "llama", vocab_size=320, num_layers=2,
                               eos_token_id=2, init_std=0.15)
    write_test_tokenizer(target, vocab_size=300)
    return dict(target=target,
                eagle3=write_tiny_eagle3_draft(str(root / "eagle3"), target,
                                               draft_vocab_size=200))


def _engine(models, algo="EAGLE3", **kw):
    draft = models["eagle3"] if algo == "EAGLE3" else None
    return Engine(EngineConfig(model=models["target"], draft_model=draft,
                               speculative_algorithm=algo, **{**BASE, **kw}))


def _pool_bytes(engine: Engine, tokens: int) -> int:
    """kv_cache_memory for a pool of ``tokens`` positions of ``engine``'s models."""
    return engine.kv_bytes // (engine.num_pages * engine.page_size) * tokens


def _drive(engine, requests, max_steps=2000):
    """requests: [(id, prompt, params)] all queued at once -> (id -> tokens, id -> text,
    the most requests running at once)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    text = {rid: "" for rid, _, _ in requests}
    most = 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            text[o.request_id] += o.new_text
            if o.finished:
                assert o.text == text[o.request_id]  # streamed pieces add up, no repeats
        most = max(most, engine.num_running())
    assert not engine.has_unfinished_requests()
    return tokens, text, most


def _prompts(n, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(7, 300, int(rng.integers(lo, hi)))] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(models):
    """Greedy outputs of the target alone with a pool that never runs short."""
    engine = _engine(models, "NONE")
    prompts = _prompts(6, seed=1, lo=8, hi=30)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    return reqs, _drive(engine, reqs)[0]


@pytest.mark.parametrize("algo", ["EAGLE3", "NONE"])
def test_preemption_and_recompute_give_identical_greedy_output(models, reference, algo):
    """A pool of 96 positions for 4 slots of requests up to 59 tokens long: the newest
    running request is preempted when the pool runs out, and is recomputed from its
    prompt and generated tokens. Greedy output equals the roomy run's; nothing raises;
    the streamed text is not repeated; every page comes back."""
    reqs, expect = reference
    probe = _engine(models, algo, precompile=False)
    engine = _engine(models, algo, kv_cache_memory=_pool_bytes(probe, 96))
    assert engine.num_pages * engine.page_size == 96
    got, _, _ = _drive(engine, reqs)
    assert got == expect
    assert engine.num_preemptions > 0
    assert engine.scheduler_stats().kv_cache_usage == 0.0
    assert engine.scheduler_stats().num_preemptions == engine.num_preemptions


def test_admission_waits_for_pages(models):
    """With pages for one long request at a time, the others wait: never more than one
    runs, all finish, and their outputs equal a roomy run's."""
    prompts = _prompts(3, seed=5, lo=40, hi=41)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reqs = [(f"w{i}", p, params) for i, p in enumerate(prompts)]
    roomy, _, _ = _drive(_engine(models, "NONE", max_model_len=56), reqs)
    probe = _engine(models, "NONE", max_model_len=56, precompile=False)
    tight = _engine(models, "NONE", max_model_len=56, kv_cache_memory=_pool_bytes(probe, 60))
    got, _, most = _drive(tight, reqs)
    assert got == roomy and most == 1


def test_no_page_leaks_after_many_random_requests(models):
    """500 requests of random prompt lengths, budgets, stop conditions and aborts over a
    tight pool: afterwards every page is free and no request is left."""
    probe = _engine(models, "EAGLE3", precompile=False)
    engine = _engine(models, "EAGLE3", kv_cache_memory=_pool_bytes(probe, 120))
    rng = np.random.default_rng(9)
    done = set()
    for i in range(500):
        prompt = [int(t) for t in rng.integers(7, 300, int(rng.integers(1, 40)))]
        params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])),
                                max_tokens=int(rng.integers(1, 8)), seed=i,
                                stop_token_ids=[int(rng.integers(7, 300))])
        engine.add_request(f"q{i}", prompt, params)
        if i % 7 == 3:
            engine.abort_request(f"q{i - 1}")
        if i % 4 == 3:
            done |= {o.request_id for o in engine.step() if o.finished}
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert len(done) == 500
    stats = engine.scheduler_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0


def test_explicit_max_model_len_beyond_the_pool_is_an_error(models):
    probe = _engine(models, "NONE", precompile=False)
    with pytest.raises(ValueError, match="fewer than one request of max_model_len 64"):
        _engine(models, "NONE", kv_cache_memory=_pool_bytes(probe, 40), precompile=False)


@pytest.mark.parametrize("field, value, message", [
    ("page_size", 12, "page_size must be a power of two"),
    ("kv_cache_memory", 0, "kv_cache_memory must be a positive byte count"),
    ("max_model_len", 1, "max_model_len must be >= 2"),
])
def test_bad_pool_settings_are_named(models, field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=models["target"], speculative_algorithm="NONE", **{field: value})


def test_backend_defaults_fill_only_what_is_unset():
    cfg = EngineConfig(model="m", speculative_algorithm="NONE", max_num_seqs=8)
    cpu, notes = cfg.for_backend("cpu")
    assert (cpu.dtype, cpu.max_num_seqs) == ("float32", 8)
    assert notes == ["dtype=float32 (the cpu default; set it to change)"]
    gpu, _ = cfg.for_backend("gpu")
    assert (gpu.dtype, gpu.max_num_seqs) == ("bfloat16", 8)
    assert EngineConfig(model="m", speculative_algorithm="NONE").for_backend("gpu")[0] \
        .max_num_seqs == 64


def test_cpu_engine_defaults_and_the_targets_context_limit(models, tmp_path, caplog):
    """On a CPU an engine left at its defaults decodes a few requests in float32 over the
    target's whole context (the test target's 512 positions); a draft trained on fewer
    positions does not cap it, and says so."""
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft

    short_draft = write_tiny_eagle3_draft(str(tmp_path / "short"), models["target"],
                                          draft_vocab_size=200, max_position_embeddings=32)
    with caplog.at_level("INFO", logger="eagle_jax.engine"):
        engine = Engine(EngineConfig(model=models["target"], draft_model=short_draft,
                                     compilation_cache_dir="", precompile=False))
    assert engine.dtype == np.float32 and engine.num_slots == 4
    assert engine.max_model_len == engine.model_config.max_position_embeddings > 32
    text = caplog.text
    assert "dtype=float32 (the cpu default" in text and "max_num_seqs=4" in text
    assert "below the target's" in text
