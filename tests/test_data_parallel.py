"""Data parallelism (``eagle_jax.engine.data_parallel``): replicas of the engine, each on
its own devices, behind one engine interface.

The replicas need several devices: the engines run in one child process with 4 host
devices (``tests/multidevice.py``) and the assertions run here on what it
returns. The router and the stats aggregation need no devices and run in this process,
on the real class over stand-in replicas.
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax import parallel
from eagle_jax.engine import DataParallelEngine, Engine, EngineConfig
from eagle_jax.engine.data_parallel import least_loaded
from eagle_jax.engine.types import SchedulerStats, SpecDecodeStats

from .multidevice import run_data_parallel_in_subprocess
from .test_tensor_parallel import ENGINE_CONFIG, write_served_target

# Four requests joining at steps 0, 0, 1 and 3, so the router sees replicas of unequal
# load. The reference is one plain engine.
SCHEDULE = [(0, "a", [5, 9, 13, 21, 40, 7, 88], 6),
            (0, "b", [3, 4, 5, 6, 100, 101, 102], 5),
            (1, "c", [11, 12, 13], 4),
            (3, "d", [8, 30, 31, 32, 33], 4)]
# Plain decoding only: a replica's speculative step is the engine's own (tested at every
# tensor-parallel size in tests/test_tensor_parallel.py); at 2 x 1 it would double the
# child's ~70 s.
RUNS = [(1, 1, "NONE"), (2, 1, "NONE"), (2, 2, "NONE")]
VOCAB = 320


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """write_served_target's target (tests/test_tensor_parallel.py)."""
    return write_served_target(str(tmp_path_factory.mktemp("dp_target")), VOCAB)


@pytest.fixture(scope="module")
def dp_run(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_engine") / "run.npz"
    return run_data_parallel_in_subprocess(target, None, str(out), RUNS, schedule=SCHEDULE,
                                           config=ENGINE_CONFIG)


@pytest.mark.parametrize("dp,tp,algo", [r for r in RUNS if r[0] > 1])
def test_greedy_output_equals_one_engine(dp_run, dp, tp, algo):
    for _, rid, _, max_tokens in SCHEDULE:
        ref = dp_run[f"1x1/NONE/{rid}"]
        assert len(ref) == max_tokens
        np.testing.assert_array_equal(dp_run[f"{dp}x{tp}/{algo}/{rid}"], ref, err_msg=rid)


@pytest.mark.parametrize("dp,tp,algo", [r for r in RUNS if r[0] > 1])
def test_requests_go_to_the_least_loaded_replica(dp_run, dp, tp, algo):
    """a and b join an idle engine (replicas 0, 1); c joins when both hold one (ties: the
    lowest index, 0); d goes to the replica with the fewest unfinished requests then."""
    key = f"{dp}x{tp}/{algo}"
    route = {rid: int(dp_run[f"{key}/route/{rid}"]) for rid in "abcd"}
    loads = {rid: list(dp_run[f"{key}/loads/{rid}"]) for rid in "abcd"}
    assert (route["a"], route["b"], route["c"]) == (0, 1, 0)
    assert (loads["a"], loads["b"], loads["c"]) == ([0, 0], [1, 0], [1, 1])
    assert route["d"] == int(np.argmin(loads["d"])), loads["d"]


@pytest.mark.parametrize("dp,tp,algo", [r for r in RUNS if r[0] > 1])
def test_each_replica_lives_on_its_own_devices(dp_run, dp, tp, algo):
    for i in range(dp):
        want = list(range(i * tp, (i + 1) * tp))
        for part in ("params", "state"):
            assert list(dp_run[f"{dp}x{tp}/{algo}/devices/{i}/{part}"]) == want, (i, part)


def test_abort_reaches_the_replica_holding_the_request(dp_run):
    assert list(dp_run["abort/route"]) == [0, 1]
    assert list(dp_run["abort/reasons"]) == ["length", "abort"]
    assert len(dp_run["abort/x_tokens"]) == 4
    assert not dp_run["abort/unfinished"].any()


def test_too_many_devices_names_the_fix(dp_run):
    msg = str(dp_run["errors/2x4"])
    assert "data-parallel size 2 x tensor-parallel size 4 = 8 devices exceeds the 4" in msg
    assert "use at most 4 in all (lower --data-parallel-size" in msg


def test_server_with_data_parallel_2_serves_greedy_output_of_one_engine(target, dp_run):
    """scripts/serve.py --data-parallel-size 2 on 2 host devices: three concurrent greedy
    completions are one plain engine's tokens."""
    import concurrent.futures

    import httpx

    from eagle_jax.testutil.server import ServerProcess
    from .multidevice import FAST_COMPILE_FLAGS

    c = ENGINE_CONFIG
    proc = ServerProcess([
        "--model", target, "--speculative-algorithm", "NONE", "--data-parallel-size", "2",
        "--max-model-len", str(c["max_model_len"]), "--max-num-seqs", str(c["max_num_seqs"]),
        "--batch-buckets", "2", "--prefill-buckets", "16", "--dtype", "float32",
        "--kv-cache-memory", str(c["kv_cache_memory"]), "--no-precompile"],
        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE_FLAGS}"})

    def complete(rid, prompt, max_tokens):
        with httpx.Client(base_url=proc.base_url, timeout=120) as http:
            r = http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
            assert r.status_code == 200, r.text
            return rid, [int(t.split(":", 1)[1])
                         for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            served = dict(pool.map(lambda job: complete(*job[1:]), SCHEDULE[:3]))
    finally:
        proc.stop()
    assert "Traceback" not in proc.log_text()
    for rid, tokens in served.items():
        assert tokens == list(dp_run[f"1x1/NONE/{rid}"]), rid


# ---- In this process: the router, the stats and the errors. ----------------------------


class _Replica:
    """A stand-in replica: requests it was given, its load, stats."""

    def __init__(self, running=0, waiting=0, stats=None, sched=None):
        self.running, self.waiting, self.added, self.aborted = running, waiting, [], []
        self.stats = stats or SpecDecodeStats()
        self.sched = sched
        self.config = EngineConfig(model="m", speculative_algorithm="NONE")
        self.tokenizer, self.vocab_size, self.model_name = None, 10, "m"
        self.max_model_len, self.num_slots, self.num_steps = 32, 4, 0

    def num_running(self):
        return self.running

    def num_waiting(self):
        return self.waiting

    def add_request(self, rid, prompt, params):
        self.added.append(rid)
        self.waiting += 1

    def abort_request(self, rid):
        self.aborted.append(rid)

    def scheduler_stats(self):
        return self.sched


def test_least_loaded_ties_go_to_the_lowest_index():
    assert least_loaded([0, 0, 0]) == 0
    assert least_loaded([2, 1, 1]) == 1
    assert least_loaded([3, 2, 0]) == 2


def test_router_counts_running_and_waiting_and_aborts_reach_the_owner():
    replicas = [_Replica(running=2), _Replica(waiting=1), _Replica(running=1, waiting=1)]
    engine = DataParallelEngine(replicas)
    for rid in "pqrs":
        engine.add_request(rid, [1, 2], None)
    # Loads 2, 1, 2 -> p to 1 (2, 2, 2) -> q to 0 (3, 2, 2) -> r to 1 -> s to 2.
    assert [r.added for r in replicas] == [["q"], ["p", "r"], ["s"]]
    assert [engine.replica_of(rid) for rid in "pqrs"] == [1, 0, 1, 2]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("q", [1], None)
    engine.abort_request("r")
    engine.abort_request("unknown")
    assert [r.aborted for r in replicas] == [[], ["r"], []]
    assert engine.num_slots == 12


def test_stats_are_summed_and_kv_usage_averaged():
    a = SpecDecodeStats(num_steps=3, num_drafts=4, accepted_per_pos=[1, 2],
                        drafted_per_pos=[4, 4], draft_length_steps=[0, 1, 2])
    b = SpecDecodeStats(num_steps=1, num_drafts=2, accepted_per_pos=[3, 0],
                        drafted_per_pos=[2, 1], draft_length_steps=[1, 0, 0])
    sa = SchedulerStats(2, 1, 0.5, 3, 10, 4)
    sb = SchedulerStats(1, 0, 0.25, 1, 6, 2)
    engine = DataParallelEngine([_Replica(stats=a, sched=sa), _Replica(stats=b, sched=sb)])
    s = engine.stats
    assert (s.num_steps, s.num_drafts) == (4, 6)
    assert s.accepted_per_pos == [4, 2] and s.drafted_per_pos == [6, 5]
    assert s.draft_length_steps == [1, 1, 2]
    assert engine.scheduler_stats() == SchedulerStats(3, 1, 0.375, 4, 16, 6)


def test_bad_data_parallel_sizes_name_the_fix():
    with pytest.raises(ValueError, match="make_engine"):
        Engine(EngineConfig(model="m", speculative_algorithm="NONE", data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(model="m", speculative_algorithm="NONE", data_parallel_size=0)
    with pytest.raises(ValueError, match="use at most 1 in all"):
        parallel.device_groups(2, 1)  # this process has one CPU device
    assert [len(g) for g in parallel.device_groups(1, 1)] == [1]
