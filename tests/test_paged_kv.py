"""The paged KV pool: the allocator, admission that waits for pages, preemption and
recompute, the prefix cache, prefill chunks that ride along with decoding, and no page
leaked, on tiny models (float32, CPU, kernels interpreted)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.page_allocator import OutOfPages, PageAllocator, page_hashes, plan_pool

from .test_engine import _call_recording

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


def test_prefix_cache_matches_shares_and_evicts_least_recently_used():
    ps = 4
    alloc = PageAllocator(num_pages=8, page_size=ps, max_pages_per_owner=6, prefix_caching=True)
    a = list(range(10, 23))  # 13 tokens: 3 full pages (4 pages in all)
    keys_a = page_hashes(a, ps)
    assert len(keys_a) == 3 and page_hashes(a[:8], ps) == keys_a[:2]
    assert page_hashes(a, ps, keys_a[:1]) == keys_a  # extended, not recomputed
    # (from the known keys: the known pages' tokens are not read again)
    assert page_hashes([0] * ps + a[ps:], ps, keys_a[:1]) == keys_a
    assert page_hashes([0] * ps + a[ps:], ps) != keys_a
    alloc.reserve(0, 13)
    alloc.register(0, keys_a, a, num_computed=8)  # only positions < 8 are in the pool
    assert alloc.num_cached == 2
    alloc.register(0, keys_a, a, num_computed=13)
    assert alloc.num_cached == 3
    # Same first 9 tokens, then different: pages 0 and 1 match (page 2 differs).
    b = a[:9] + [99, 98, 97, 96]
    hit = alloc.match(page_hashes(b, ps), b, len(b) - 1, check_next=False).pages
    assert hit == alloc.pages(0)[:2]
    # The draft's last row of page 1 took token 8, which b shares: still both pages. A
    # sequence that differs exactly at token 8 loses page 1 when the draft counts.
    c = a[:8] + [99, 98, 97]
    keys_c = page_hashes(c, ps)
    assert alloc.match(keys_c, c, len(c) - 1, check_next=False).pages == alloc.pages(0)[:2]
    assert alloc.match(keys_c, c, len(c) - 1, check_next=True) == (alloc.pages(0)[:1], False)
    # Unless the target's feature at page 1's last position was kept: then page 1 is
    # shared as a boundary page (the draft recomputes its last row in a copy).
    assert alloc.match(keys_c, c, len(c) - 1, check_next=True,
                       share_boundary=True) == (alloc.pages(0)[:1], False)
    alloc.features_written(0, 5, 8)  # a chunk over positions 5..7 kept position 7's
    assert alloc.match(keys_c, c, len(c) - 1, check_next=True,
                       share_boundary=True) == (alloc.pages(0)[:2], True)
    # At most max_tokens positions are matched: the last known one is always computed.
    assert alloc.match(keys_a, a, 8, check_next=True).pages == alloc.pages(0)[:2]
    assert alloc.match(keys_a, a, 7, check_next=True).pages == alloc.pages(0)[:1]
    alloc.reserve(1, 13, shared=hit)  # 2 pages shared, 2 new
    assert alloc.pages(1)[:2] == hit and alloc.num_free == 8 - 4 - 2
    assert alloc.draft_copy(1) is None
    alloc.check()
    # A boundary hit takes one page more, outside the page list: the draft's copy.
    assert alloc.can_reserve(2, 3 * ps, shared=hit, boundary=True)  # 2 free, 2 needed
    assert not alloc.can_reserve(2, 3 * ps + 1, shared=hit, boundary=True)
    alloc.reserve(2, 2 * ps + 1, shared=hit, boundary=True)
    index, copy = alloc.draft_copy(2)
    assert index == 1 and copy not in alloc.pages(0) + alloc.pages(1) + alloc.pages(2)
    assert alloc.pages(2)[:2] == hit and alloc.num_free == 8 - 4 - 2 - 2
    alloc.check()
    alloc.free(2)  # its own page and the copy come back
    assert alloc.draft_copy(2) is None and alloc.num_free == 2
    alloc.check()
    alloc.free(0)  # a's page 2 is unheld but cached; pages 0 and 1 are still held
    assert alloc.num_free == 4 and alloc.num_cached == 3
    alloc.free(1)
    assert alloc.usage == 0.0 and alloc.num_cached == 3
    assert alloc.match(keys_a, a, 12, check_next=True).pages == [0, 1, 2]
    alloc.check()
    # The pool fills: free pages first, then cached ones, least recently used first
    # (a's page 2, freed before the pages 0 and 1 that owner 1 held).
    alloc.reserve(2, 5 * ps)
    assert alloc.num_cached == 3
    alloc.reserve(3, 1)
    assert alloc.num_cached == 2 and alloc.pages(3) == [2]
    assert alloc.match(keys_a, a, 12, check_next=True).pages == [0, 1]
    alloc.check()
    with pytest.raises(OutOfPages):
        alloc.reserve(4, 3 * ps)
    with pytest.raises(OutOfPages):  # the copy counts: 1 page free, 2 needed
        alloc.reserve(4, 2 * ps + 1, shared=[0, 1], boundary=True)
    alloc.check()
    # A page taken anew loses its kept feature: page 1, evicted and reused, is no
    # boundary page once keyed again by an owner that never wrote its feature.
    alloc.free(2)
    alloc.free(3)
    alloc.reserve(5, 6 * ps)  # the free pages
    alloc.reserve(6, 2 * ps)  # the cached ones, evicted
    assert alloc.num_cached == 0
    alloc.register(6, keys_a, a[:9], num_computed=9)
    assert alloc.match(keys_c, c, len(c) - 1, check_next=True,
                       share_boundary=True) == (alloc.pages(6)[:1], False)


def test_prefix_cache_never_evicts_a_held_page_and_leaks_nothing():
    """500 random requests drawn from a few shared prefixes, over a pool that runs short:
    after every operation each page is free, cached or held, counts agree, and a page
    some owner holds is never handed to another (a boundary hit's draft copy included);
    at the end every page is free."""
    ps, rng = 4, np.random.default_rng(3)
    alloc = PageAllocator(num_pages=40, page_size=ps, max_pages_per_owner=12,
                          prefix_caching=True)
    prefixes = [[int(t) for t in rng.integers(0, 50, 30)] for _ in range(4)]
    live: dict[int, list[int]] = {}
    boundaries = 0
    for i in range(500):
        if live and (len(live) >= 6 or rng.random() < 0.4):
            owner = int(rng.choice(list(live)))
            tokens = live.pop(owner)
            alloc.register(owner, page_hashes(tokens, ps), tokens, len(tokens) - 1)
            alloc.free(owner)
        else:
            base = prefixes[int(rng.integers(4))]
            tokens = base[:int(rng.integers(1, 31))] + [
                int(t) for t in rng.integers(0, 50, int(rng.integers(1, 16)))]
            keys = page_hashes(tokens, ps)
            hit, boundary = alloc.match(keys, tokens, len(tokens) - 1, check_next=True,
                                        share_boundary=True)
            held = {p for o in live for p in alloc.pages(o) + [
                c[1] for c in [alloc.draft_copy(o)] if c]}
            try:
                alloc.reserve(i, len(tokens) + 2, shared=hit, boundary=boundary)
            except OutOfPages:
                alloc.check()
                continue
            copy = alloc.draft_copy(i)
            assert (copy is not None) == boundary
            fresh = set(alloc.pages(i)[len(hit):]) | ({copy[1]} if copy else set())
            assert not fresh & held  # a new page is never one another owner holds
            assert len(fresh) == len(alloc.pages(i)) - len(hit) + boundary
            boundaries += boundary
            live[i] = tokens
            alloc.features_written(i, len(hit) * ps, len(tokens) // 2)
            alloc.register(i, keys, tokens, len(tokens) // 2)
        alloc.check()
    for owner in list(live):
        alloc.free(owner)
    alloc.check()
    assert alloc.num_free == 40 and alloc.usage == 0.0
    assert boundaries > 10


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


def test_pool_plan_keeps_within_the_attention_kernels_page_limit():
    """``max_num_pages`` (the kernel's addressing limit) caps the pool whatever the
    budget: the default max_model_len follows the capped pool, an explicit one it cannot
    hold is an error naming the limit, and a budget under the limit is unchanged."""
    kw = dict(model_limit=1000, num_slots=4, page_size=16, step_tokens=6, bytes_per_token=100,
              unbudgeted_max_model_len=500)
    budget = 40 * 16 * 100  # 40 pages
    assert plan_pool(max_model_len=None, budget=budget, max_num_pages=30, **kw) == (
        30 * 16 - 12, 30, 30)
    assert plan_pool(max_model_len=None, budget=budget, max_num_pages=41, **kw) == (628, 40, 40)
    assert plan_pool(max_model_len=100, budget=None, max_num_pages=10, **kw) == (100, 10, 7)
    with pytest.raises(ValueError, match="at most 30 pages .the attention kernel's limit"):
        plan_pool(max_model_len=600, budget=budget, max_num_pages=30, **kw)


# ----------------------------------------------------------------------------- engine

# Executables compile on first use (precompile=False): a test's requests run a few of
# the bucket menu's, and compiling the rest first was most of the file's time.
BASE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, batch_buckets=(4,),
            prefill_buckets=(16,), compilation_cache_dir="", num_steps=3, page_size=4,
            precompile=False)


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
    """500 requests over a few shared prefixes, of random lengths, budgets, stop
    conditions and aborts, over a tight pool (the prefix cache evicts, requests are
    preempted): after every step each page is free, cached or held, and no page a
    request holds is free; afterwards every page is free and no request is left."""
    probe = _engine(models, "EAGLE3", precompile=False)
    engine = _engine(models, "EAGLE3", kv_cache_memory=_pool_bytes(probe, 120))
    rng = np.random.default_rng(9)
    prefixes = [[int(t) for t in rng.integers(7, 300, 30)] for _ in range(3)]
    done = set()

    def step():
        nonlocal done
        done |= {o.request_id for o in engine.step() if o.finished}
        engine.page_allocator.check()

    for i in range(500):
        prompt = prefixes[i % 3][:int(rng.integers(0, 31))] + [
            int(t) for t in rng.integers(7, 300, int(rng.integers(1, 10)))]
        params = SamplingParams(temperature=float(rng.choice([0.0, 1.0])),
                                max_tokens=int(rng.integers(1, 8)), seed=i,
                                stop_token_ids=[int(rng.integers(7, 300))])
        engine.add_request(f"q{i}", prompt, params)
        if i % 7 == 3:
            engine.abort_request(f"q{i - 1}")
        if i % 4 == 3:
            step()
    while engine.has_unfinished_requests():
        step()
    assert len(done) == 500
    stats = engine.scheduler_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert stats.prefix_cache_hits > 0 and engine.page_allocator.num_cached > 0


def test_engine_sizes_its_pool_within_the_attention_kernels_limit(models, monkeypatch, caplog):
    """The engine passes the kernel's page limit (``max_pool_pages`` of each model's pool
    shape and dtype) to its pool plan. A real limit needs pools of 2**31 rows, so the
    limit is lowered here: a budget past it gets a pool of exactly the limit, logged."""
    from eagle_jax.engine import pool_sizing as engine_module
    from eagle_jax.kernels import paged_attention

    shapes = []

    def limit(page_size, heads, dim, *, itemsize):
        shapes.append((page_size, heads, dim, itemsize))
        return 24

    monkeypatch.setattr(engine_module, "max_pool_pages", limit)
    probe = _engine(models, "EAGLE3", precompile=False)
    with caplog.at_level(logging.INFO, logger="eagle_jax.engine"):
        engine = _engine(models, "EAGLE3", kv_cache_memory=_pool_bytes(probe, 40 * 4),
                         max_model_len=None, precompile=False)
    assert engine.num_pages == 24 and engine.max_model_len == 24 * 4 - 2 * engine.step_tokens
    assert "the most the attention kernel addresses" in caplog.text
    # One limit per pool shape (the target's and the draft's) and the pool's dtype.
    tgt, dft = engine.target.config, engine.draft.config
    size = engine.runner.state.target_pages.k[0].dtype.itemsize
    assert shapes[-2:] == [(4, tgt.num_kv_heads, tgt.head_dim, size),
                           (4, dft.num_kv_heads, dft.head_dim, size)]
    assert paged_attention.max_pool_pages(4, tgt.num_kv_heads, tgt.head_dim) > 10**6


def test_explicit_max_model_len_beyond_the_pool_is_an_error(models):
    probe = _engine(models, "NONE", precompile=False)
    with pytest.raises(ValueError, match="fewer than one request of max_model_len 64"):
        _engine(models, "NONE", kv_cache_memory=_pool_bytes(probe, 40), precompile=False)


def test_kv_cache_memory_beyond_the_free_device_memory_is_an_error(models, monkeypatch):
    """A device that reports its memory (faked here: a CPU reports none): an explicit
    kv_cache_memory whose pool would not fit what is free beside the weights raises at
    construction, naming what fits; one that fits builds; unset, the pool takes the
    default fraction of the free memory."""
    from eagle_jax.engine import pool_sizing

    probe = _engine(models, "EAGLE3", precompile=False)
    need = _pool_bytes(probe, 96)
    free = {"bytes": need - 1}
    monkeypatch.setattr(pool_sizing, "free_device_memory", lambda devices: free["bytes"])
    with pytest.raises(ValueError, match=rf"kv_cache_memory={need} .* exceeds the .* GiB of "
                       r"device memory free beside the weights; pass at most ~\d+ MiB"):
        _engine(models, "EAGLE3", kv_cache_memory=need, precompile=False)
    free["bytes"] = need
    assert _engine(models, "EAGLE3", kv_cache_memory=need,
                   precompile=False).num_pages * probe.page_size == 96
    free["bytes"] = 4 * _pool_bytes(probe, 160)
    unset = _engine(models, "EAGLE3", max_model_len=None, precompile=False)
    assert unset.num_pages * unset.page_size == 3 * 160  # 0.75 of the free memory


@pytest.mark.parametrize("field, value, message", [
    ("page_size", 12, "page_size must be a power of two"),
    ("kv_cache_memory", 0, "kv_cache_memory must be a positive byte count"),
    ("max_model_len", 1, "max_model_len must be >= 2"),
])
def test_bad_pool_settings_are_named(models, field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=models["target"], speculative_algorithm="NONE", **{field: value})


def test_backend_defaults_fill_only_what_is_unset():
    cfg = EngineConfig(model="m", speculative_algorithm="NONE", max_num_seqs=8,
                       max_num_batched_tokens=100, max_num_partial_prefills=2)
    cpu, notes = cfg.for_backend("cpu")
    assert (cpu.dtype, cpu.max_num_seqs, cpu.max_num_batched_tokens,
            cpu.max_num_partial_prefills) == ("float32", 8, 100, 2)
    assert notes == ["dtype=float32 (the cpu default; set it to change)"]
    gpu, _ = cfg.for_backend("gpu")
    assert (gpu.dtype, gpu.max_num_seqs) == ("bfloat16", 8)
    # Several requests' prompt chunks in one forward on a GPU, one on a CPU.
    unset = EngineConfig(model="m", speculative_algorithm="NONE")
    assert unset.for_backend("gpu")[0].max_num_partial_prefills == 16
    assert unset.for_backend("cpu")[0].max_num_partial_prefills == 1
    assert EngineConfig(model="m", speculative_algorithm="NONE").for_backend("gpu")[0] \
        .max_num_seqs == 64
    # The draft length: chosen per step on a GPU, num_steps in every step on a CPU.
    spec = EngineConfig(model="m", draft_model="d")
    assert spec.for_backend("gpu")[0].speculative_policy == "adaptive"
    assert spec.for_backend("cpu")[0].speculative_policy == "fixed"
    assert spec.draft_lengths == (0, 1, 2, 3, 5)
    # Sampled rows draft from q by default (greedy rows propose the argmax either way).
    assert EngineConfig(model="m", speculative_algorithm="NONE").draft_sample_method \
        == "probabilistic"


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


# ------------------------------------------------------- prefix cache, mixed prefill


def _accept_lengths(engine) -> dict[str, list[int]]:
    """request id -> the accept length of each of its speculative steps (filled as the
    engine steps)."""
    seen: dict[str, list[int]] = {}

    def listen(event):
        for slot, rid in event.rows.items():
            seen.setdefault(rid, []).append(int(event.output.accept_len[slot]))

    engine.add_step_listener(listen)
    return seen


def _run(engine, requests):
    """requests: [(id, prompt, params)] queued at once -> (id -> tokens, id -> the
    num_cached_tokens its outputs reported)."""
    cached = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
        engine.page_allocator.check()
    return tokens, cached


def _draft_rows(engine, request_id: str, num: int) -> np.ndarray:
    """The draft's keys and values [2, num, K, D] (its first layer) at positions 0 ..
    num - 1 of a request that holds a slot, read through the table its draft reads."""
    slot = engine.slot_of(request_id)
    state = engine.state
    table = state.page_table if state.draft_page_table is None else state.draft_page_table
    pos = np.arange(num)
    pages = np.asarray(table[slot])[pos // engine.page_size]
    return np.stack([np.asarray(pool[0])[pages, pos % engine.page_size]
                     for pool in (state.draft_pages.k, state.draft_pages.v)])


def _step_until_done(engine, tokens: dict, cached: dict, watch: str | None, prompt_len: int):
    """Steps until no request is left -> the draft's rows of request ``watch``'s prompt,
    read once its first token is out (its prefill done, every row of the prompt made);
    None without ``watch``."""
    rows = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            cached[o.request_id] = o.num_cached_tokens
        if watch is not None and rows is None and tokens[watch]:
            rows = _draft_rows(engine, watch, prompt_len)
        engine.page_allocator.check()
    return rows


@pytest.mark.parametrize("algo,tree", [("EAGLE3", False), ("EAGLE3", True), ("NONE", False)])
def test_a_prefix_cache_hit_gives_identical_greedy_output_and_accept_lengths(algo, tree):
    """The shipped pair (a draft that accepts, so a stale draft row would show in the
    accept lengths), chain or tree drafting, pages of 16, requests one after another over
    one 70-token prefix:
    the first computes it; the second shares its 4 full pages (the partial fifth is
    recomputed); the third shares the first 64 tokens and then differs, so the draft's
    last row of page 4 (which took token 64) is stale for it: the EAGLE engine shares
    the page all the same (64 cached) and recomputes that one draft row in a copy of
    the page, from the target's feature the first request's prefill kept. The fourth
    follows the first's prompt and 16 of its generated tokens, then differs: its last
    matched page was completed by decode steps, whose verify kept the feature at the
    page's last position, so it is shared the same way (96 cached). Tokens and accept
    lengths equal a run without the prefix cache, request by request, and so do the
    third's and the fourth's draft rows (the row a stale copy would hold changes accept
    lengths too rarely to be seen there)."""
    from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from eagle_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_TARGET)
    code = tok.encode(open(__file__).read())
    prefix = code[:70]
    prompts = [prefix + code[100:110], prefix + code[200:203],
               prefix[:64] + [code[300] if code[300] != prefix[64] else code[301]]
               + code[310:315]]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = Engine(EngineConfig(
            model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT if algo == "EAGLE3" else None,
            speculative_algorithm=algo, dtype="float32", max_model_len=192, max_num_seqs=2,
            batch_buckets=(2,), prefill_buckets=(32,), compilation_cache_dir="",
            enable_prefix_caching=caching, precompile=False,
            **(dict(speculative_eagle_topk=3, num_draft_tokens=8) if tree else {})))
        accepts = _accept_lengths(engine)
        tokens, cached = {}, {}
        for i, prompt in enumerate(prompts[:2]):
            got, got_cached = _run(engine, [(f"p{i}", prompt, greedy)])
            tokens.update(got)
            cached.update(got_cached)
        tokens["p2"] = []
        engine.add_request("p2", prompts[2], greedy)
        watch = algo == "EAGLE3"
        rows = [_step_until_done(engine, tokens, cached, "p2" if watch else None,
                                 len(prompts[2]))]
        made = tokens["p0"]
        decoded = prompts[0] + made[:16] + [made[16] - 1 if made[16] else 1] + code[320:325]
        tokens["p3"] = []
        engine.add_request("p3", decoded, greedy)
        rows.append(_step_until_done(engine, tokens, cached, "p3" if watch else None,
                                     len(decoded)))
        assert engine.scheduler_stats().kv_cache_usage == 0.0
        results[caching] = tokens, accepts, cached, rows
    (tokens, accepts, cached, rows), (ref_tokens, ref_accepts, ref_cached, ref_rows) = (
        results[True], results[False])
    assert tokens == ref_tokens
    if algo == "EAGLE3":
        assert accepts == ref_accepts
        for got_rows, want_rows in zip(rows, ref_rows):
            np.testing.assert_allclose(got_rows, want_rows, rtol=1e-4, atol=1e-4)
        assert sum(map(sum, accepts.values())) > sum(map(len, accepts.values()))
    assert [cached[f"p{i}"] for i in range(4)] == [0, 64, 64, 96]
    assert set(ref_cached.values()) == {0}


@pytest.mark.parametrize("tree", [False, True])
def test_a_boundary_hit_carried_by_decode_steps_keeps_the_drafts_rows(tree):
    """The shipped pair, pages of 16, chain or tree drafting: a first request computes a
    70-token prefix; while a second decodes, a third arrives that shares the prefix's 64
    tokens of full pages and then differs, so its first chunk (the draft's extend from
    position 63, in the draft's copy of page 4) rides in the second's decode steps.
    Tokens, accept lengths and the third's draft rows equal a run without the prefix
    cache; no prefill of its own ran for the third; every page comes back."""
    from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from eagle_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEFAULT_TARGET)
    code = tok.encode(open(__file__).read())
    prefix = code[:70]
    first = prefix + code[100:106]
    running = code[400:430]
    parting = prefix[:64] + [code[300] if code[300] != prefix[64] else code[301]] + code[
        310:330]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = Engine(EngineConfig(
            model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT, speculative_algorithm="EAGLE3",
            dtype="float32", max_model_len=192, max_num_seqs=2, batch_buckets=(2,),
            prefill_buckets=(32,), max_num_batched_tokens=64, compilation_cache_dir="",
            enable_prefix_caching=caching, precompile=False,
            **(dict(speculative_eagle_topk=3, num_draft_tokens=8) if tree else {})))
        accepts = _accept_lengths(engine)
        tokens, cached = _run(engine, [("first", first, greedy)])
        engine.add_request("running", running, greedy)
        tokens["running"] = []
        while not tokens["running"]:
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
        prefills = engine.num_prefill_runs
        engine.add_request("parting", parting, greedy)
        tokens["parting"] = []
        rows = _step_until_done(engine, tokens, cached, "parting", len(parting))
        assert engine.num_prefill_runs == prefills  # carried by the decode steps
        assert engine.scheduler_stats().kv_cache_usage == 0.0
        results[caching] = tokens, accepts, cached, rows
    (tokens, accepts, cached, rows), (ref_tokens, ref_accepts, _, ref_rows) = (
        results[True], results[False])
    assert tokens == ref_tokens and accepts == ref_accepts
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-4, atol=1e-4)
    assert cached["parting"] == 64
    assert sum(accepts["parting"]) > len(accepts["parting"])


@pytest.mark.parametrize("tree", [False, True])
def test_decode_steps_keep_the_targets_feature_at_each_page_end(tree):
    """The shipped pair, pages of 16, chain or tree drafting (its accepted nodes lie off
    the first rows of the verify): a 40-token prompt generates 144 tokens, so decode
    steps complete pages 2 to 10. The feature each verify kept at those pages' last
    positions (47, 63, .., 175) equals the one a prefill of the same 184 tokens keeps
    there. The kept features start poisoned (NaN), so a page end no step wrote fails."""
    import jax.numpy as jnp

    from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from eagle_jax.tokenizer import Tokenizer

    code = Tokenizer.from_dir(DEFAULT_TARGET).encode(open(__file__).read())
    greedy = SamplingParams(temperature=0.0, max_tokens=144, ignore_eos=True)

    def kept_features(tokens: list[int], params: SamplingParams):
        """-> (the request's tokens, the kept features of its first 11 pages [11, F])."""
        engine = Engine(EngineConfig(
            model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT, speculative_algorithm="EAGLE3",
            dtype="float32", max_model_len=192, max_num_seqs=2, batch_buckets=(2,),
            prefill_buckets=(32,), compilation_cache_dir="", precompile=False,
            **(dict(speculative_eagle_topk=3, num_draft_tokens=8) if tree else {})))
        engine.state = engine.state._replace(
            boundary_features=jnp.full_like(engine.state.boundary_features, jnp.nan))
        made, _ = _run(engine, [("r", tokens, params)])
        text = tokens + made["r"]
        hit = engine.page_allocator.match(page_hashes(text, 16), text, len(text) - 1,
                                          check_next=False)
        assert len(hit.pages) >= 11
        return made["r"], np.asarray(engine.state.boundary_features)[hit.pages[:11]]

    made, decoded = kept_features(code[:40], greedy)
    _, prefilled = kept_features(code[:40] + made,
                                 SamplingParams(temperature=0.0, max_tokens=1))
    assert len(made) == 144 and not np.isnan(prefilled).any()
    np.testing.assert_allclose(decoded, prefilled, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("partial", [1, 4])
def test_requests_that_arrive_together_share_their_prefix(models, partial):
    """Two requests queued at once with one 26-token prefix: the second is admitted after
    the first's prefill ran and shares its 6 full pages (also where one forward could
    carry both prompts' chunks: the second waits for the pages the first computes);
    both decode side by side, and their greedy tokens equal a run without the prefix
    cache. The served counters (vLLM's prefix_cache_queries / hits) add up."""
    rng = np.random.default_rng(12)
    prefix = [int(t) for t in rng.integers(7, 300, 26)]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = [(f"c{i}", prefix + [int(t) for t in rng.integers(7, 300, 4 + i)], greedy)
            for i in range(2)]
    engine = _engine(models, "EAGLE3", max_num_partial_prefills=partial)
    tokens, cached = _run(engine, reqs)
    ref, _ = _run(_engine(models, "EAGLE3", enable_prefix_caching=False), reqs)
    assert tokens == ref
    assert cached == {"c0": 0, "c1": 24}
    stats = engine.scheduler_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (30 + 31, 24)


@pytest.mark.parametrize("algo,made_by", [("EAGLE3", "prefill"), ("EAGLE3", "decode"),
                                           ("NONE", "decode")])
def test_requests_parting_after_a_cached_page_do_not_wait_for_each_other(models, algo,
                                                                         made_by):
    """A 24-token prefix (6 pages of 4) is in the cache; three requests arrive together
    with it and suffixes of their own, so the draft's last row of the prefix's last page
    (which took the first request's token 24) is stale for each. Where a prefill made
    that page, or decode steps completed it, the target's feature at its last position
    was kept (by the prefill, or by the verify that accepted that position): each
    request shares the page and recomputes that draft row in a copy of its own (24
    cached), and none waits for another to compute the page. The plain engine shares it
    without a copy. One prefill dispatch
    carries all three chunks (waiting, each was a dispatch of its own, and while
    requests decode a step of its own: the TTFT tail of a shared-prefix load). Tokens
    equal a run without the prefix cache."""
    prefills = []  # the chunk lengths of each prefill dispatch

    def record(name, args):
        if name == "prefill":
            prefills.append(sorted(int(n) for n in args[3].length if n))

    rng = np.random.default_rng(14)
    prefix = [int(t) for t in rng.integers(7, 300, 24)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    draft = models["eagle3"] if algo == "EAGLE3" else None
    engine = Engine(EngineConfig(model=models["target"], draft_model=draft,
                                 speculative_algorithm=algo,
                                 **{**BASE, "max_num_partial_prefills": 4}),
                    compile_fn=_call_recording(record))
    if made_by == "prefill":
        _run(engine, [("w", prefix + [5, 6], greedy)])
    else:  # the prefix's last two tokens are the first request's first generated ones
        made, _ = _run(engine, [("w", prefix[:22], greedy)])
        prefix = prefix[:22] + made["w"][:2]
    reqs = [(f"r{i}", prefix + [int(t) for t in rng.integers(7, 300, 5 + i)], greedy)
            for i in range(3)]
    prefills.clear()
    tokens, cached = _run(engine, reqs)
    assert prefills == [[5, 6, 7]]
    assert set(cached.values()) == {24}
    ref, _ = _run(_engine(models, algo, enable_prefix_caching=False), reqs)
    assert tokens == ref


@pytest.mark.parametrize("algo", ["EAGLE3", "NONE"])
def test_prefill_chunks_ride_along_with_decoding(models, algo):
    """A 50-token prompt arrives while a request decodes: each step carries a 16-position
    chunk of it in the decode step's own forward (rows of the step's width beside the
    decode rows), so the running request commits tokens at every step while the prompt
    is prefilled. Both requests' greedy tokens equal each one run alone (the prompt then
    prefilled by its own chunk executable)."""
    rng = np.random.default_rng(13)
    short = [int(t) for t in rng.integers(7, 300, 6)]
    long = [int(t) for t in rng.integers(7, 300, 50)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The long request samples (seeded): its stream must not depend on how it was
    # prefilled.
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    width = BASE["num_steps"] + 1 if algo == "EAGLE3" else 1
    # The bucket's 4 decode rows of `width` plus 16 chunk positions.
    engine = _engine(models, algo, max_num_batched_tokens=4 * width + 16)
    assert engine.buckets.step_lane_len(4) == 16
    engine.add_request("short", short, greedy)
    tokens = {"short": [], "long": []}
    for _ in range(2):  # its prefill returns its first token, the next call its first step
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    engine.add_request("long", long, sampled)
    steps_in_prefill = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
        if not tokens["long"]:
            steps_in_prefill.append({o.request_id for o in outs if o.new_token_ids})
    alone = {rid: _run(_engine(models, algo), [(rid, prompt, params)])[0][rid]
             for rid, prompt, params in (("short", short, greedy), ("long", long, sampled))}
    assert tokens == alone and len(tokens["long"]) == 12
    # 50 positions in chunks of 16: four steps carry them; the short request (12 tokens)
    # may finish first, but not before the second chunk.
    assert len(steps_in_prefill) >= 3
    assert all(s == {"short"} for s in steps_in_prefill[:2])


def test_a_carried_prompt_gets_its_first_tokens_logprobs(models):
    """A prompt that asks for logprobs, prefilled in chunks that ride in the steps of a
    request that asks for none: its first token (sampled by the step that carried its
    last chunk) has its logprobs, equal to those of the prompt prefilled alone."""
    rng = np.random.default_rng(17)
    short = [int(t) for t in rng.integers(7, 300, 6)]
    long = [int(t) for t in rng.integers(7, 300, 50)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    asking = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)

    def first_logprob(engine, prefilled_alone):
        if not prefilled_alone:
            engine.add_request("short", short, plain)
            engine.step()
        engine.add_request("long", long, asking)
        carried_steps = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == "long" and o.new_token_ids:
                    assert o.new_logprobs and len(o.new_logprobs) == len(o.new_token_ids)
                    return o.new_logprobs[0], carried_steps
            carried_steps += 1
        raise AssertionError("the long request emitted nothing")

    width = BASE["num_steps"] + 1
    carried, steps = first_logprob(_engine(models, max_num_batched_tokens=4 * width + 16),
                                   prefilled_alone=False)
    assert steps >= 3  # 50 positions in chunks of 16, each carried by a decode step
    alone, _ = first_logprob(_engine(models), prefilled_alone=True)
    assert carried.token_id == alone.token_id
    assert abs(carried.logprob - alone.logprob) < 1e-4
    assert list(carried.top) == list(alone.top)
    assert all(abs(carried.top[t] - alone.top[t]) < 1e-4 for t in alone.top)


@pytest.mark.parametrize("algo", ["EAGLE3", "NONE"])
def test_chunks_of_several_requests_share_one_forward(models, algo):
    """Prompts that arrive together are prefilled in one forward: three reaching an idle
    engine are one prefill dispatch carrying their three chunks (padded to a compiled
    count of four); three arriving while a request decodes ride in one decode step, in
    its 64-position lanes, the longest prompt over two of them (the second lane attends
    to the first's keys, written earlier in the same forward). Every request's tokens
    (greedy, and a seeded sampled one) equal the request run alone, so neither the
    shared forward, the split prompt nor the padding changes anything."""
    carried = []  # per prefill or step dispatch: (name, lengths of its chunks)

    def record(name, args):
        chunks = args[3] if name == "prefill" else args[4] if len(args) > 4 else None
        if chunks is not None:
            carried.append((name, [int(n) for n in chunks.length]))

    width = BASE["num_steps"] + 1 if algo == "EAGLE3" else 1
    draft = models["eagle3"] if algo == "EAGLE3" else None
    config = EngineConfig(model=models["target"], draft_model=draft,
                          speculative_algorithm=algo,
                          **{**BASE, "max_num_partial_prefills": 4, "max_model_len": 160,
                             "prefill_buckets": (16, 128),
                             "max_num_batched_tokens": 4 * width + 256})
    engine = Engine(config, compile_fn=_call_recording(record))
    rng = np.random.default_rng(41)
    prompts = [[int(t) for t in rng.integers(7, 300, n)] for n in (10, 14, 30, 6, 9, 13, 100)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [greedy, sampled, greedy, long, greedy, sampled, greedy]
    tokens = {f"r{i}": [] for i in range(7)}
    finished = set()

    def step():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)

    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], params[i])
    step()
    # Round one: all three chunks in one prefill (four of 16 positions: the shape that
    # runs the most now); round two: the rest of the 30-token prompt.
    assert carried[:2] == [("prefill", [10, 14, 16, 0]), ("prefill", [14])]
    carried.clear()
    engine.add_request("r3", prompts[3], params[3])
    step()  # r3's chunk rides in the step of the three decoding
    while not {"r0", "r1", "r2"} <= finished:
        step()
    for i in range(4, 7):  # three slots free, r3 decoding
        engine.add_request(f"r{i}", prompts[i], params[i])
    while engine.has_unfinished_requests():
        step()
        engine.page_allocator.check()
    # One chunk rides in a one-lane step; three in a four-lane step (100 = 64 + 36).
    assert carried == [("step", [6]), ("step", [9, 13, 64, 36])]
    reference = _engine(models, algo, max_model_len=160)
    for i in range(7):
        alone, _ = _run(reference, [(f"r{i}", prompts[i], params[i])])
        assert tokens[f"r{i}"] == alone[f"r{i}"], i
