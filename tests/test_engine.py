"""Engine invariants: greedy equality, continuous batching, the seed write-ups' guarantees.

Every engine here runs float32 on the CPU with tiny random models; speculative and
plain engines share the target, so greedy outputs must agree token for token.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.executables import jit_compile

# One batch bucket and one prefill chunk keep compiles few; engines are shared per module.
# Executables compile on first use (a test that times or counts compiles says
# precompile=True): the requests here run a few of the bucket menu's.
BASE = dict(dtype="float32", max_model_len=96, max_num_seqs=4, batch_buckets=(4,),
            prefill_buckets=(32,), compilation_cache_dir="", num_steps=3, precompile=False)
# A draft tree: 3 children per expanded node, 3 levels, root + 11 nodes verified.
TREE = dict(speculative_eagle_topk=3, num_draft_tokens=12)


def _new_engine(models, algo="EAGLE3", hook=None, **kw):
    draft = None if algo == "NONE" else models["eagle3" if algo == "EAGLE3" else "eagle1"]
    return Engine(EngineConfig(model=models["target"], draft_model=draft,
                               speculative_algorithm=algo, **{**BASE, **kw}),
                  draft_probs_hook=hook)


@pytest.fixture(scope="module")
def engines(models):
    """Engines built on first use and shared by the tests of this module."""
    built = {}

    def get(name):
        if name not in built:
            algo, method = {"none": ("NONE", "greedy"), "eagle3": ("EAGLE3", "greedy"),
                            "eagle3_prob": ("EAGLE3", "probabilistic"),
                            "eagle1": ("EAGLE", "greedy"),
                            "eagle3_tree": ("EAGLE3", "probabilistic"),
                            "eagle1_tree": ("EAGLE", "probabilistic")}[name]
            # Sampled tree rows: traversal (the default) for EAGLE-3, recursive
            # rejection for EAGLE-1, so the engine runs both real-q rules.
            tree = ({**TREE, "tree_verify": "recursive_rejection"} if name == "eagle1_tree"
                    else TREE if name.endswith("_tree") else {})
            built[name] = _new_engine(models, algo, draft_sample_method=method, **tree)
        return built[name]

    return get


def _prompts(n, seed=0, lo=3, hi=40, vocab=300):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(7, vocab, int(rng.integers(lo, hi)))] for _ in range(n)]


def _call_recording(record, returned=None):
    """A ``CompileFn`` of ``jit_compile``'s executables whose every call first does
    ``record(executable name, call arguments)`` and, with ``returned``, then
    ``returned(executable name, its outputs)``."""
    def compile_fn(key, fn, example_args, donate_argnums):
        compiled = jit_compile(key, fn, example_args, donate_argnums)

        def call(*args):
            record(key.name, args)
            out = compiled(*args)
            if returned is not None:
                returned(key.name, out)
            return out
        return call
    return compile_fn


def _run(engine, schedule):
    """schedule: list of (join_step, request_id, prompt, params). Returns id -> tokens."""
    out = {rid: [] for _, rid, _, _ in schedule}
    done, step = set(), 0
    while len(done) < len(schedule):
        for join, rid, prompt, params in schedule:
            if join == step:
                engine.add_request(rid, prompt, params)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
        step += 1
        assert step < 500
    return out


@pytest.mark.parametrize("name", ["eagle3", "eagle1", "eagle3_tree", "eagle1_tree"])
def test_greedy_speculative_equals_target_with_joins_and_leaves(engines, name):
    prompts = _prompts(6, seed=1)
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (20, 7, 33, 12, 25, 9)]
    # 6 requests over 4 slots: queueing, and requests joining mid-run as others leave.
    schedule = [(j, f"r{i}", p, g) for i, (j, p, g) in enumerate(zip((0, 0, 2, 3, 5, 9), prompts,
                                                                      greedy))]
    ref = _run(engines("none"), schedule)
    eng = engines(name)
    got = _run(eng, schedule)
    assert got == ref
    assert eng.stats.num_drafts > 0 and eng.stats.num_invalid_tokens == 0
    # Random drafts against a random target still agree sometimes; the counts add up.
    s = eng.stats
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert s.num_emitted_tokens == s.num_drafts + s.num_accepted_tokens


def test_greedy_rows_keep_argmax_accept_length_under_rejection_sampling(engines):
    """001: with probabilistic drafting, temperature-0 rows still propose the argmax, so
    their accept lengths equal the argmax path's, step for step."""
    prompts = _prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lengths = {}
    for name in ("eagle3", "eagle3_prob"):
        eng = engines(name)
        before = (eng.stats.num_accepted_tokens, list(eng.stats.accepted_per_pos))
        out = _run(eng, [(0, f"g{i}", p, params) for i, p in enumerate(prompts)])
        lengths[name] = (out, eng.stats.num_accepted_tokens - before[0],
                         [a - b for a, b in zip(eng.stats.accepted_per_pos, before[1])])
    assert lengths["eagle3"] == lengths["eagle3_prob"]


@pytest.mark.parametrize("name", ["eagle3_prob", "eagle3_tree", "eagle1_tree"])
def test_mixed_batch_keeps_each_rows_behaviour(engines, name):
    prompts = _prompts(4, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    alone = _run(engines("none"), [(0, f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    eng = engines(name)
    mixed = _run(eng, [(0, f"r{i}", p, greedy if i % 2 == 0 else sampled)
                       for i, p in enumerate(prompts)])
    assert mixed["r0"] == alone["r0"] and mixed["r2"] == alone["r2"]
    assert all(0 <= t < 300 for t in mixed["r1"] + mixed["r3"])


@pytest.mark.parametrize("name", ["eagle3_prob", "eagle3_tree"])
def test_same_seed_same_output_regardless_of_batch(engines, name):
    prompts = _prompts(3, seed=4)
    p = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, ignore_eos=True, seed=100 + i)
         for i in range(3)]
    eng = engines(name)
    together = _run(eng, [(0, f"r{i}", q, s) for i, (q, s) in enumerate(zip(prompts, p))])
    alone = _run(eng, [(0, "r1", prompts[1], p[1])])
    assert alone["r1"] == together["r1"]
    again = _run(eng, [(0, f"r{i}", q, s) for i, (q, s) in enumerate(zip(prompts, p))])
    assert again == together


def test_corrupted_draft_probs_never_commit_invalid_tokens(models):
    """004: malformed draft probabilities inside the step are rejected and counted; no
    committed id is negative or >= the tokenizer vocabulary (300 < width 320)."""
    # Whole 64-aligned column runs are overwritten, as the recycled mask did upstream:
    # NaN, -inf, 0, a negative value and a value > 1, each in its own runs.
    values = jax.numpy.asarray([np.nan, -np.inf, 0.0, -0.5, 7.0], jax.numpy.float32)

    def hook(q):
        run = np.arange(q.shape[-1]) // 64
        return jax.numpy.where(run % 2 == 1, values[(run // 2) % 5], q)

    eng = _new_engine(models, "EAGLE3", hook=hook, draft_sample_method="probabilistic")
    prompts = _prompts(8, seed=6)
    out = _run(eng, [(0, f"r{i}", p, SamplingParams(temperature=1.0, max_tokens=20,
                                                    ignore_eos=True, seed=i))
                     for i, p in enumerate(prompts)])
    toks = [t for v in out.values() for t in v]
    assert len(toks) == 160 and all(0 <= t < 300 for t in toks)
    assert eng.stats.num_invalid_tokens == 0
    assert eng.stats.num_malformed_draft_probs > 0


def test_draft_extend_projects_one_row_and_draft_never_runs_target_code(models, monkeypatch):
    """000: the draft-extend LM head sees one row per request ([B, H] -> [B, V_draft]),
    never [B, S+1, H]. 003: the target's forward is entered by the target module only,
    during prefill and the step alike."""
    from eagle_jax.models import draft as draft_mod
    from eagle_jax.models.decoder import Decoder

    seen, callers = [], []
    select, forward = draft_mod._DraftBase.select_logits, Decoder.__call__

    def select_spy(self, hidden_out, rows):
        out = select(self, hidden_out, rows)
        seen.append((hidden_out.shape, rows.shape, out.shape))
        return out

    def forward_spy(self, *args, **kwargs):
        callers.append(type(self).__name__)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(draft_mod._DraftBase, "select_logits", select_spy)
    monkeypatch.setattr(Decoder, "__call__", forward_spy)
    eng = _new_engine(models, "EAGLE3")
    _run(eng, [(0, "a", _prompts(1, lo=35, hi=36)[0],
                SamplingParams(temperature=0, max_tokens=8))])
    steps = [s for s in seen if s[0] == (4, 4, s[0][2])]  # the step: B = 4, window S+1 = 4
    assert steps, seen
    for hidden_shape, rows_shape, out_shape in seen:
        assert rows_shape == (hidden_shape[0],) and out_shape == (hidden_shape[0], 200)
    assert callers and set(callers) == {"Decoder"}
    assert type(eng.draft).__name__ == "Eagle3Draft" and not isinstance(eng.draft, Decoder)


def test_no_recompilation_after_warmup(engines):
    eng = engines("eagle3_prob")
    params = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True)
    _run(eng, [(0, f"w{i}", p, params) for i, p in enumerate(_prompts(3, seed=8))])
    compiles = []
    listening = [True]

    def listener(event, duration, **kwargs):
        if listening[0] and "compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        _run(eng, [(0, f"x{i}", p, params) for i, p in enumerate(_prompts(3, seed=9))])
        _run(eng, [(0, "y", _prompts(1, seed=10)[0], params)])
    finally:
        listening[0] = False
    assert compiles == []


@pytest.mark.parametrize("precompile_logprobs", [False, True])
def test_precompile_logprobs_leaves_nothing_to_compile_for_a_logprobs_request(
        models, precompile_logprobs):
    """With ``precompile_logprobs`` the start-up compiles every bucket's logprobs
    variant too, so a request asking for logprobs (prefill alone, then steps) compiles
    nothing while serving; without it the same request compiles its variants on first
    use. Both return the request's logprobs. Asking for it without precompile is a
    ValueError naming both fields."""
    compiled = []

    def recording(key, fn, example_args, donate_argnums):
        compiled.append(key.name)
        return jit_compile(key, fn, example_args, donate_argnums)

    engine = Engine(EngineConfig(model=models["target"], draft_model=models["eagle3"],
                                 **{**BASE, "precompile": True,
                                    "precompile_logprobs": precompile_logprobs}),
                    compile_fn=recording)
    at_start = len(compiled)
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=2)
    engine.add_request("lp", _prompts(1, seed=41)[0], params)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            logprobs += o.new_logprobs or []
    assert len(tokens) == len(logprobs) == 6
    late = compiled[at_start:]
    if precompile_logprobs:
        assert late == []
    else:
        assert "prefill" in late and "step" in late, late
    with pytest.raises(ValueError, match="precompile_logprobs.*precompile=False"):
        EngineConfig(model=models["target"], speculative_algorithm="NONE", precompile=False,
                     precompile_logprobs=True)


def test_first_token_returns_before_its_first_decode_step_is_dispatched(models, engines):
    """A request reaching an idle engine gets its first token from the call that ran its
    prefill, which writes it to the host's pinned memory itself; that call dispatches no
    decode step (its launch would delay the token), the next call does. Later tokens
    still equal the target's greedy ones."""
    calls, prefilled = [], []
    compile_fn = _call_recording(
        lambda name, args: calls.append(name),
        lambda name, out: prefilled.append(out[1].token) if name == "prefill" else None)
    engine = Engine(EngineConfig(model=models["target"], draft_model=models["eagle3"],
                                 **BASE), compile_fn=compile_fn)
    prompt = _prompts(1, seed=43)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", prompt, params)
    outs = engine.step()
    assert [len(o.new_token_ids) for o in outs] == [1] and calls == ["prefill"]
    tokens = outs[0].new_token_ids
    assert prefilled[0].sharding.memory_kind == "pinned_host"
    assert int(np.asarray(prefilled[0])[0]) == tokens[0]
    engine.step()
    assert "step" in calls
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == _run(engines("none"), [(0, "a", prompt, params)])["a"]


def test_slot_changes_ride_in_the_next_dispatch(models, engines):
    """Admitting and releasing requests dispatch nothing of their own (each dispatch is
    host time on a request's time to first token): a request reaching an idle engine is
    one prefill dispatch, its admission and the previous request's release inside it;
    while requests decode, a step applies every change since the last one in at most one
    dispatch before it. The outputs stay the target's greedy tokens."""
    calls = collections.Counter()
    engine = Engine(EngineConfig(model=models["target"], speculative_algorithm="NONE",
                                 **BASE),
                    compile_fn=_call_recording(lambda name, args: calls.update([name])))
    def greedy(n):
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    prompts = _prompts(6, seed=31, hi=30)  # one prefill chunk each
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"idle{i}", prompt, greedy(1))
        assert [o.finished for o in engine.step()] == [True]
    assert calls == {"prefill": 3}

    schedule = [(0, "long", prompts[3], greedy(12))] + [
        (2, f"short{i}", p, SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True))
        for i, p in enumerate(prompts[4:])]
    per_step = []
    engine.add_step_listener(lambda _: per_step.append(calls.pop("update_slots", 0)))
    out = _run(engine, schedule)
    assert max(per_step) == 1  # (the shorts' releases: a step applies them at once)
    reference = _run(engines("none"), [(0, "long", prompts[3], greedy(12))])
    assert out["long"] == reference["long"]


def test_host_inputs_travel_in_one_buffer():
    """An executable's host inputs (a prefill's chunks and slot changes) are packed into
    one int32 buffer by ``jit_compile``: every field comes back bit for bit inside the
    executable (negative ints, full-range uint32 keys, float NaN payloads and signed
    zeros, bools), and a field of another shape or dtype, or of an unsupported dtype, is
    an error naming it, never a shifted read."""
    from eagle_jax.engine.host_inputs import HostLayout
    from eagle_jax.engine.state import SlotUpdates
    from eagle_jax.sampling import SamplingRows

    rng = np.random.default_rng(17)
    n = 5
    floats = rng.standard_normal(n).astype(np.float32)
    floats[:3] = [np.float32(-0.0), np.float32(np.inf), np.uint32(0x7FC01234).view(np.float32)]
    slots = SlotUpdates(
        assign=rng.random(n) < 0.5, release=rng.random(n) < 0.5,
        sampling=SamplingRows(floats, rng.integers(-2**31, 2**31, n, dtype=np.int32),
                              rng.random(n).astype(np.float32), floats[::-1].copy()),
        key=rng.integers(0, 2**32, (n, 2), dtype=np.uint32))
    tokens = rng.integers(-2**31, 2**31, (3, 7), dtype=np.int32)
    example = (tokens, slots)

    def fn(scale, tokens, slots):  # a device argument before the host ones
        return scale * 2, tokens, slots

    call = jit_compile("test", fn, (jax.numpy.ones(()),) + jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example), ())
    scale, *out = call(jax.numpy.full((), 3.0), *example)
    assert float(scale) == 6.0
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(example)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()

    layout = HostLayout(example)
    assert layout.size == 3 * 7 + 6 * n + 2 * n
    with pytest.raises(ValueError, match=r"field 0 is int32\[3, 6\].*int32\[3, 7\]"):
        layout.pack((tokens[:, :6], slots))
    with pytest.raises(ValueError, match=r"field 1 is int32\[5\].*bool\[5\]"):
        layout.pack((tokens, slots._replace(assign=slots.assign.astype(np.int32))))
    with pytest.raises(ValueError, match="structure"):
        layout.pack((tokens,))
    with pytest.raises(ValueError, match="dtype int64"):
        HostLayout(tokens.astype(np.int64))


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "empty"),
    (list(range(7, 7 + 96)), SamplingParams(), "exceeds max_model_len"),
    ([5, 305], SamplingParams(), "outside the vocabulary"),
    ([5, -1], SamplingParams(), "outside the vocabulary"),
    ([5, 2**70], SamplingParams(), "token id 1180591620717411303424 is outside"),
    ([5, True], SamplingParams(), "must be integers"),
    ([5, 6.0], SamplingParams(), "must be integers"),
    ([5, "6"], SamplingParams(), "must be integers"),
])
def test_bad_requests_raise_and_engine_keeps_serving(engines, prompt, params, message):
    eng = engines("eagle3")
    eng.add_request("ok", [9, 10, 11], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, params)
    out = _run(eng, [])
    assert out == {}
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and done[0].num_output_tokens == 5


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=5), "stop"),
    (dict(stop=[1, 2]), "stop"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_eos_and_abort(engines):
    eng = engines("eagle3")
    tok = eng.tokenizer
    prompt = tok.encode("def fibonacci(n):")
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = _run(engines("none"), [(0, "f", prompt, greedy)])["f"]
    text = tok.decode(full)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    eng.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                stop=[stop]))
    eng.add_request("x", prompt, greedy)
    outs = []
    for _ in range(3):
        outs += eng.step()
    eng.abort_request("x")
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = {o.request_id: o for o in outs if o.finished}
    s = final["s"]
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert s.text == text[:text.index(stop)]
    got = [t for o in outs if o.request_id == "s" for t in o.new_token_ids]
    assert got == full[:len(got)] and len(got) < len(full)  # tokens past the stop dropped
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])
    assert final["x"].finish_reason == "abort"
    assert eng.num_running() == 0 and eng.num_waiting() == 0


def test_logprobs_of_committed_tokens(models, engines):
    import jax.numpy as jnp

    from eagle_jax.models.decoder import load_decoder

    eng = engines("eagle3")
    prompt = _prompts(1, seed=12)[0]
    eng.add_request("l", prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                ignore_eos=True))
    toks, lps = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks += o.new_token_ids
            lps += o.new_logprobs or []
    assert [lp.token_id for lp in lps] == toks and len(toks) == 6
    target = load_decoder(models["target"], "float32")
    seq = prompt + toks
    logits = np.asarray(target(jnp.asarray([seq]), jnp.arange(len(seq))[None], None).logits[0])
    ref = jax.nn.log_softmax(logits[:, :300], -1)
    for j, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp.logprob - float(row[toks[j]])) < 1e-4
        assert list(lp.top) == [int(i) for i in np.argsort(-row)[:3]]


def test_prefill_ranks_the_vocabulary_only_when_asked_for_logprobs(engines):
    """A first token's top logprobs are a top-k over the whole vocabulary (on a GPU a
    sort of 128k entries for a Llama-3 vocabulary, which also splits the prefill's
    command buffer): the prefill of requests that ask for none leaves it out (the test
    above checks the values when asked)."""
    eng = engines("eagle3")

    def traced(with_logprobs):
        return str(jax.make_jaxpr(eng.runner.prefill_function(with_logprobs))(
            *eng.runner.prefill_inputs(2, 16)))

    assert "top_k" in traced(True)
    without = traced(False)
    assert "top_k" not in without and " sort" not in without, [
        line for line in without.splitlines() if "top_k" in line or " sort" in line][:4]


def test_draft_probs_hook_with_a_tree_is_refused(models):
    with pytest.raises(ValueError, match="no effect on a tree"):
        _new_engine(models, "EAGLE3", hook=lambda q: q, **TREE)
