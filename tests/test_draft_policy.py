"""The draft length chosen per step: the policy on constructed tables, and the engine
switching lengths between steps without changing its output."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.engine.draft_policy import AdaptiveDraftLength, expected_tokens
from eagle_jax.engine.state import MAX_DRAFT_LAG
from eagle_jax.models.layers import KVCache

from .test_engine import BASE, _prompts, _run

LENGTHS = (0, 1, 2, 3)


# ------------------------------------------------------------------ the policy alone
def _policy(seconds_by_length, acceptance=None, **kw):
    """A policy over LENGTHS at bucket 1, its acceptance estimate set to ``acceptance``
    (per position) by one heavily weighted observation set."""
    policy = AdaptiveDraftLength(LENGTHS, {(1, s): t for s, t in zip(LENGTHS, seconds_by_length)},
                                 **kw)
    if acceptance is not None:
        policy.set_acceptance(acceptance, trials=1e6)
    return policy


def test_expected_tokens_is_the_chain_sum():
    a = np.array([0.9, 0.6, 0.5])
    got = expected_tokens(a, [0, 1, 2, 3])
    want = [1, 1 + 0.9, 1 + 0.9 + 0.9 * 0.6, 1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.5]
    np.testing.assert_allclose(got, want)


def test_picks_zero_when_the_draft_cannot_pay():
    # Acceptance 0.1 everywhere: drafting adds at most ~0.11 tokens per step for >= 20%
    # more time.
    policy = _policy([1.0, 1.2, 1.4, 1.6], acceptance=[0.1] * 3)
    assert policy.choose(1) == 0


def test_picks_the_longest_when_drafting_is_nearly_free():
    policy = _policy([1.0, 1.02, 1.04, 1.06], acceptance=[0.85] * 3)
    assert policy.choose(1) == 3


@pytest.mark.parametrize("seed", range(5))
def test_choice_maximises_expected_tokens_per_second(seed):
    rng = np.random.default_rng(seed)
    seconds = np.cumsum(rng.uniform(0.05, 1.0, 4))
    acceptance = rng.uniform(0.2, 0.95, 3)
    policy = _policy(seconds, acceptance=acceptance, probe_every=10**9)
    rate = expected_tokens(acceptance, LENGTHS) / seconds
    # The shortest length within prefer_shorter of the best rate.
    want = next(s for s, r in zip(LENGTHS, rate) if r >= (1 - policy.prefer_shorter) * rate.max())
    assert policy.choose(1) == want


def test_a_near_tie_goes_to_the_shorter_length():
    acceptance = [0.7] * 3  # E[s] = 1, 1.7, 2.19, 2.533
    seconds = [1.0, 1.2, 1.35, 1.35 * 2.533 / 2.19 * 0.99]  # length 3 1% ahead of 2
    assert _policy(seconds, acceptance=acceptance, prefer_shorter=0.02).choose(1) == 2
    assert _policy(seconds, acceptance=acceptance, prefer_shorter=0.0).choose(1) == 3


def test_acceptance_estimate_follows_observed_steps():
    """Accept lengths of a chain with per-position acceptance a = (0.8, 0.5, 0.3) give
    back those a's (conditional on reaching the position)."""
    rng = np.random.default_rng(0)
    a = np.array([0.8, 0.5, 0.3])
    policy = AdaptiveDraftLength(LENGTHS, {(1, s): 1.0 for s in LENGTHS}, half_life=1e9)
    for _ in range(400):
        accepted = rng.random((64, 3)) < a
        policy.observe(3, np.sum(np.cumprod(accepted, axis=1), axis=1))
    np.testing.assert_allclose(policy.acceptance, a, atol=0.02)


def test_a_shorter_choice_probes_the_next_length():
    """Positions past the chosen length are not observed: every probe_every steps the
    next longer length runs, so a recovered draft is found again."""
    policy = _policy([1.0, 1.5, 2.0, 2.5], acceptance=[0.2] * 3, probe_every=4)
    choices = [policy.choose(1) for _ in range(8)]
    assert choices == [0, 0, 0, 1, 0, 0, 0, 1]
    # The draft recovers: a few observed steps at length 1 (all accepted) move the
    # choice up.
    policy.set_acceptance([0.2] * 3, trials=4.0)
    for _ in range(20):
        policy.observe(1, np.ones(64, np.int64))
    assert policy.choose(1) >= 1


def test_probes_retime_a_shorter_length_whose_start_up_time_read_high():
    """Probes go to both neighbours of the best length in turn (never down to 0): a
    shorter length whose start-up time read high is timed again until the choice moves
    to it, and from there probes go up and down."""
    acceptance = [0.7] * 3  # E[s] = 1, 1.7, 2.19, 2.533
    served = {0: 1.0, 1: 1.2, 2: 1.35, 3: 1.7}  # E / t: length 2 is the best
    policy = _policy([1.0, 1.2, 1.7, 1.7], acceptance=acceptance, probe_every=4)
    choices = []
    for _ in range(200):
        choices.append(policy.choose(1))
        policy.observe_time(1, choices[-1], served[choices[-1]])
    assert choices[:8] == [3, 3, 3, 2, 3, 3, 3, 2]
    assert choices[-40:].count(2) == 30 and set(choices[-40:]) == {1, 2, 3}
    assert policy.step_seconds[1, 2] == pytest.approx(1.35, rel=0.05)
    assert 0 not in choices


def test_step_times_follow_measured_cycles_and_skip_pauses():
    policy = _policy([1.0, 1.1, 1.2, 1.3], acceptance=[0.5] * 3)
    for _ in range(60):
        policy.observe_time(1, 1, 2.0)
    assert policy.step_seconds[1, 1] == pytest.approx(2.0, rel=0.01)
    policy.observe_time(1, 2, 100.0)  # a pause of the server, not a step
    assert policy.step_seconds[1, 2] == 1.2
    # Length 1 became as slow as the measurements say: the choice moves away from it.
    assert policy.choose(1) != 1


# ------------------------------------------------------------------ in the engine
class ScriptedLengths:
    """A test policy: each step's length from a fixed random sequence."""

    def __init__(self, lengths, seed):
        self.lengths = tuple(lengths)
        self._rng = np.random.default_rng(seed)
        self.chosen = []
        self.timed = []  # the step cycles the engine reported

    def choose(self, bucket):
        self.chosen.append(int(self._rng.choice(self.lengths)))
        return self.chosen[-1]

    def observe(self, length, accept_len):
        pass

    def observe_time(self, bucket, length, seconds):
        self.timed.append(seconds)

    def predicted_tokens(self, length):
        return None


def _adaptive(models, algo="EAGLE3", lengths=LENGTHS, **kw):
    draft = models["eagle3" if algo == "EAGLE3" else "eagle1"]
    return Engine(EngineConfig(model=models["target"], draft_model=draft,
                               speculative_algorithm=algo, speculative_policy="adaptive",
                               draft_lengths=lengths, **{**BASE, **kw}))


@pytest.fixture(scope="module")
def reference(models):
    return Engine(EngineConfig(model=models["target"], speculative_algorithm="NONE", **BASE))


@pytest.fixture(scope="module")
def eagle3(models):
    """An adaptive EAGLE-3 engine and the policy it built at start-up."""
    engine = _adaptive(models)
    return engine, engine.draft_policy


@pytest.fixture(scope="module")
def synthetic(models):
    """An adaptive EAGLE-3 engine accepting each draft token with probability 0.6."""
    return _adaptive(models, synthetic_acceptance=0.6, max_model_len=200)


def _schedule(seed):
    prompts = _prompts(6, seed=seed)
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (22, 7, 31, 12, 25, 9)]
    return [(j, f"r{i}", p, g) for i, (j, p, g) in enumerate(zip((0, 0, 2, 3, 5, 9), prompts,
                                                                   greedy))]


@pytest.mark.parametrize("algo, lengths", [("EAGLE3", LENGTHS), ("EAGLE", (0, 2, 3))])
def test_greedy_output_is_the_targets_across_length_switches(models, reference, eagle3, algo,
                                                              lengths):
    """Every step drafts a length drawn at random, with requests joining and leaving: the
    output is the target's, token for token."""
    engine = eagle3[0] if algo == "EAGLE3" else _adaptive(models, algo, lengths)
    assert set(eagle3[1].step_seconds) == {(4, s) for s in LENGTHS}
    schedule = _schedule(seed=11)
    want = _run(reference, schedule)
    before = list(engine.stats.draft_length_steps)
    engine.draft_policy = ScriptedLengths(lengths, seed=3)
    assert _run(engine, schedule) == want
    chosen = np.bincount(engine.draft_policy.chosen, minlength=4)
    assert (chosen[list(lengths)] > 0).all()
    s = engine.stats
    counted = [a - b for a, b in zip(s.draft_length_steps, before)]
    # Steps that carried a prompt chunk drafted 3 without asking the policy.
    assert counted[:3] == chosen[:3].tolist() and counted[3] >= chosen[3]
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert s.drafted_per_pos[0] >= s.drafted_per_pos[-1] > 0


def test_greedy_output_is_the_targets_when_the_draft_falls_behind(reference, eagle3):
    """Mostly steps of length 0, which leave the draft behind: the draft catches up
    before each step that drafts and whenever a row would fall more than MAX_DRAFT_LAG
    positions behind; the output is the target's, token for token."""
    engine = eagle3[0]
    schedule = _schedule(seed=13)
    want = _run(reference, schedule)
    before = engine.stats.num_draft_catch_ups
    engine.draft_policy = ScriptedLengths((0,) * 8 + (1, 3), seed=5)
    assert _run(engine, schedule) == want
    chosen = engine.draft_policy.chosen
    assert engine.stats.num_draft_catch_ups > before
    # Some run of length-0 steps was long enough to force a catch-up.
    runs = "".join("0" if s == 0 else "x" for s in chosen).split("x")
    assert max(map(len, runs)) > MAX_DRAFT_LAG


def test_a_cycle_that_ran_the_drafts_catch_up_is_not_timed(monkeypatch, reference, eagle3):
    """The policy learns a length's step time from the cycles of steps of that length; a
    cycle that also ran the draft's catch-up is not one. Each catch-up here takes
    ``catch_up_seconds`` longer than any step (after a warm-up run, so that no cycle
    compiles): no reported cycle may be that long, and the output is still the target's.

    Scheduling is synchronous here, so the delay falls in the cycle of the step it was
    dispatched with whatever the backend's dispatch does (the CPU client may run a
    computation inline); with async scheduling the device's in-order stream puts it in the
    same step's cycle, the one after the previous step's tokens were read."""
    catch_up_seconds = 2.0
    engine = eagle3[0]
    schedule = _schedule(seed=17)
    want = _run(reference, schedule)
    engine.draft_policy = ScriptedLengths((0,) * 8 + (1, 3), seed=7)
    assert _run(engine, schedule) == want  # warm-up: every variant this schedule runs
    while engine.has_unfinished_requests():
        engine.step()  # (the last step in flight)
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config,
                                                              async_scheduling=False))
    catch_up = engine.runner.catch_up

    def slow_catch_up(*args):
        catch_up(*args)
        time.sleep(catch_up_seconds)

    monkeypatch.setattr(engine.runner, "catch_up", slow_catch_up)
    before = engine.stats.num_draft_catch_ups
    engine.draft_policy = policy = ScriptedLengths((0,) * 8 + (1, 3), seed=7)
    assert _run(engine, schedule) == want
    assert engine.stats.num_draft_catch_ups > before
    assert len(policy.timed) > 10
    assert max(policy.timed) < catch_up_seconds


def _draft_rows(state, slot, positions):
    """The draft's pool at a slot's positions: per layer (k, v) [len(positions), K, D]."""
    rows = KVCache(state.draft_pages, state.page_table[slot][None]).slots(positions[None])[0]
    return [(k.reshape(-1, *k.shape[2:])[rows], v.reshape(-1, *v.shape[2:])[rows])
            for k, v in zip(state.draft_pages.k, state.draft_pages.v)]


def test_caught_up_draft_equals_a_prefill_of_the_same_tokens(models, eagle3):
    """A request decodes with steps of length 0 only, until a row's lag forces the
    draft's catch-up: the draft's state then (its hidden and logits at the last caught-up
    position, its pool over every position up to it) equals what a prefill of the same
    tokens computes in an engine of its own, so the draft proposes after skipped steps
    exactly what it would have proposed had it run each of them."""
    engine = eagle3[0]
    engine.draft_policy = ScriptedLengths((0,), seed=0)
    prompt = _prompts(1, seed=21, lo=12, hi=13)[0]
    engine.add_request("behind", prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                        ignore_eos=True))
    before, snapshot, out = engine.stats.num_draft_catch_ups, None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
        if snapshot is None and engine.stats.num_draft_catch_ups > before:
            snapshot = jax.device_get(engine.state)
    slot = 0
    caught_up = int(snapshot.seq_len[slot] - snapshot.draft_lag[slot])
    assert caught_up > len(prompt) + MAX_DRAFT_LAG - 1
    tokens = prompt + out

    ref = Engine(EngineConfig(model=models["target"], draft_model=models["eagle3"],
                              speculative_algorithm="EAGLE3", enable_prefix_caching=False,
                              **BASE))
    ref.add_request("prefill", tokens[:caught_up], SamplingParams(temperature=0.0,
                                                                  max_tokens=1))
    first = [t for o in ref.step() for t in o.new_token_ids]
    assert first == [tokens[caught_up]]  # the target's greedy token, the draft's next input
    want = jax.device_get(ref.state)
    np.testing.assert_allclose(snapshot.draft_hidden[slot], want.draft_hidden[0],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(snapshot.draft_logits[slot], want.draft_logits[0],
                               rtol=1e-4, atol=1e-4)
    positions = np.arange(caught_up)
    for (k, v), (k_want, v_want) in zip(_draft_rows(snapshot, slot, positions),
                                        _draft_rows(want, 0, positions)):
        np.testing.assert_allclose(k, k_want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(v, v_want, rtol=1e-4, atol=1e-4)


def test_adaptive_policy_serves_the_targets_greedy_output(reference, eagle3):
    """The real policy (timed at start-up, estimating acceptance as it goes): the
    target's output, the chosen lengths counted, its forecast kept."""
    engine, policy = eagle3
    engine.draft_policy = policy
    timed = dict(policy.step_seconds)
    schedule = _schedule(seed=12)
    before = sum(engine.stats.draft_length_steps)
    assert _run(engine, schedule) == _run(reference, schedule)
    s = engine.stats
    assert sum(s.draft_length_steps) > before
    assert s.forecast_tokens > 0 and s.forecast_goodput > 0
    # The measured step cycles moved the start-up estimates of the lengths it ran.
    assert policy.step_seconds != timed


def test_synthetic_accept_length_per_draft_length_is_the_chain_sum(synthetic):
    """Synthetic acceptance a = 0.6, lengths switched at random: the mean accept length
    of the steps of each length s is 1 + a + ... + a^s. Each comparison is a z-test at 4
    standard errors (false alarm < 1e-4 per length)."""
    a = 0.6
    engine = synthetic
    engine.draft_policy = ScriptedLengths((1, 2, 3), seed=4)
    per_length = {1: [], 2: [], 3: []}

    def record(event):
        if event.output is not None and event.rows:
            s = event.output.tokens.shape[1] - 1
            per_length[s].extend(event.output.num_tokens[list(event.rows)].tolist())

    engine.add_step_listener(record)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    _run(engine, [(0, f"s{i}", p, params) for i, p in enumerate(_prompts(12, seed=6, hi=20))])
    engine.remove_step_listener(record)
    for s, committed in per_length.items():
        committed = np.asarray(committed, np.float64)
        want = sum(a ** i for i in range(s + 1))
        se = committed.std(ddof=1) / np.sqrt(committed.size)
        assert committed.size > 150
        assert abs(committed.mean() - want) < 4 * se, (s, committed.mean(), want, se)


def test_adaptive_policy_stops_drafting_a_draft_that_does_not_pay(synthetic):
    """Acceptance 0.6 against step times where a drafted token costs a whole target
    step (E[s] / t(s) falls with s): after the first steps (the optimistic prior) the
    engine runs the target's step alone but for one probe in every probe_every steps,
    and its acceptance estimate finds 0.6."""
    engine = synthetic
    engine.draft_policy = AdaptiveDraftLength(
        LENGTHS, {(4, s): 1.0 + s for s in LENGTHS}, half_life=8)
    before = list(engine.stats.draft_length_steps)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    _run(engine, [(0, f"z{i}", p, params) for i, p in enumerate(_prompts(4, seed=5, hi=20))])
    steps = [a - b for a, b in zip(engine.stats.draft_length_steps, before)]
    assert steps[0] > 0.8 * sum(steps), steps
    assert abs(engine.draft_policy.acceptance[0] - 0.6) < 0.25


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft_lengths=(0, 7)), r"draft_lengths must lie in \[0, num_steps = 5\]"),
    (dict(draft_lengths=(0, 1, 3)), "must include num_steps"),
    (dict(speculative_policy="greedy"), "speculative_policy must be one of"),
])
def test_bad_draft_length_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", draft_model="d", **kwargs)
