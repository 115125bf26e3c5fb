"""Multi-host tensor parallelism (``eagle_jax.engine.multihost``): one engine over the
devices of two processes joined by ``jax.distributed``, driven in lockstep.

The two processes (2 host devices each, tensor-parallel 4, a local coordinator) run as
children (``tests/multidevice.py``); the reference is a one-process engine at
tensor-parallel 1 in a child of its own. The flag parsing, the command encoding and the
draft policy's lockstep need no devices and run in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import multihost
from eagle_jax.engine.draft_policy import AdaptiveDraftLength

from .multidevice import run_engines_in_subprocess, run_multihost_in_subprocesses
from .test_tensor_parallel import ENGINE_CONFIG, ENGINE_SCHEDULE, write_served_target

# EAGLE-3 with the adaptive policy over lengths 0 and 2: its choices follow wall-clock
# step times, which differ between the processes (the hazard ``LockstepPolicy`` removes),
# and length 0 adds the target-only step and the draft's catch-up. Greedy output is the
# target's at every length, so the plain engine at tensor-parallel 1 is the reference.
RUNS = [("EAGLE3", {"speculative_policy": "adaptive", "draft_lengths": (0, 2)})]
# ``_lockstep_abort``'s "x", after the schedule, on an idle engine; "y" is aborted.
X = (0, "x", [5, 9, 13], 4)
VOCAB = 320


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """write_served_target's target (tests/test_tensor_parallel.py)."""
    return write_served_target(str(tmp_path_factory.mktemp("multihost_target")), VOCAB)


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    """The one-process engine's greedy tokens (tensor-parallel 1): ``1/NONE/{rid}``."""
    out = tmp_path_factory.mktemp("multihost_ref") / "ref.npz"
    return run_engines_in_subprocess(target, None, str(out), [(1, "NONE")],
                                     schedule=ENGINE_SCHEDULE + [X], config=ENGINE_CONFIG,
                                     devices=1)


@pytest.fixture(scope="module")
def runs(target, reference, tmp_path_factory):
    """(the leader's arrays, the follower's) of RUNS, and the reference's."""
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft

    root = tmp_path_factory.mktemp("multihost")
    draft = write_tiny_eagle3_draft(str(root / "eagle3"), target)
    processes = run_multihost_in_subprocesses(target, draft, str(root / "run"), RUNS,
                                              schedule=ENGINE_SCHEDULE, config=ENGINE_CONFIG)
    return processes, reference


def test_two_processes_give_one_process_greedy_tokens(runs):
    """Requests joining mid-decode (b at step 2) and after an idle spell (x)."""
    (leader, _), reference = runs
    for _, rid, _, max_tokens in ENGINE_SCHEDULE + [X]:
        ref = reference[f"1/NONE/{rid}"]
        assert len(ref) == max_tokens
        np.testing.assert_array_equal(leader[f"EAGLE3/{rid}"], ref, err_msg=rid)


def test_the_follower_steps_as_the_leader(runs):
    """Same tokens, same number of steps, the same draft length chosen in every step."""
    (leader, follower), _ = runs
    assert set(leader) == set(follower)
    for key in leader:
        if not key.endswith("local_devices"):
            np.testing.assert_array_equal(follower[key], leader[key], err_msg=key)
    lengths = leader["EAGLE3/draft_length_steps"]
    assert lengths.sum() == leader["EAGLE3/steps"] > 0


def test_an_abort_reaches_the_followers(runs):
    for arrays in runs[0]:
        assert len(arrays["EAGLE3/y"]) < 4
        assert not arrays["EAGLE3/unfinished"]


def test_each_process_holds_two_of_the_four_devices(runs):
    leader, follower = (a["EAGLE3/local_devices"] for a in runs[0])
    assert len(leader) == len(follower) == 2
    assert not set(leader) & set(follower)


def test_bad_sizes_name_the_fix(runs):
    leader = runs[0][0]
    assert "use --tensor-parallel-size 4" in str(leader["errors/tp"])
    assert "use --data-parallel-size 1" in str(leader["errors/dp"])


def test_server_on_two_processes_serves_one_process_tokens(target, reference):
    """scripts/serve.py on two processes of 2 host devices each (--tensor-parallel-size 4):
    process 0 serves two concurrent greedy completions, process 1 follows and exits when
    the server stops."""
    import concurrent.futures
    import os
    import subprocess
    import sys

    import httpx

    from eagle_jax.testutil.server import REPO, ServerProcess, free_port

    from .multidevice import FAST_COMPILE_FLAGS

    c = ENGINE_CONFIG
    flags = ["--model", target, "--speculative-algorithm", "NONE",
             "--tensor-parallel-size", "4",
             "--max-model-len", str(c["max_model_len"]), "--max-num-seqs", str(c["max_num_seqs"]),
             "--batch-buckets", "2", "--prefill-buckets", "16", "--dtype", "float32",
             "--kv-cache-memory", str(c["kv_cache_memory"]), "--no-precompile",
             "--coordinator-address", f"localhost:{free_port()}", "--num-processes", "2"]
    env = {"JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE_FLAGS}"}
    leader = ServerProcess(flags + ["--process-id", "0"], env=env, wait=False)
    follower = subprocess.Popen(
        [sys.executable, f"{REPO}/scripts/serve.py", *flags, "--process-id", "1"],
        env={**os.environ, **env}, cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)

    def complete(rid, prompt, max_tokens):
        with httpx.Client(base_url=leader.base_url, timeout=300) as http:
            r = http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
            assert r.status_code == 200, r.text
            return rid, [int(t.split(":", 1)[1])
                         for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    try:
        leader.wait_healthy(600)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            served = dict(pool.map(lambda job: complete(*job[1:]), ENGINE_SCHEDULE))
    finally:
        leader.stop()
        try:
            _, follower_log = follower.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            follower.kill()
            raise
    assert "Traceback" not in leader.log_text()
    assert follower.returncode == 0, follower_log[-4000:]
    assert "following process 0's steps" in follower_log
    for rid, tokens in served.items():
        assert tokens == list(reference[f"1/NONE/{rid}"]), rid


# ------------------------------------------------------------- flags and env
def test_flags_win_over_the_environment():
    env = {multihost.ENV_COORDINATOR: "h:1", multihost.ENV_NUM_PROCESSES: "4",
           multihost.ENV_PROCESS_ID: "3"}
    assert multihost.distributed_args("10.0.0.1:1234", 2, 1, env) == multihost.DistributedArgs(
        "10.0.0.1:1234", 2, 1)
    assert multihost.distributed_args(environ=env) == multihost.DistributedArgs("h:1", 4, 3)
    assert multihost.distributed_args(process_id=0, environ=env).process_id == 0


def test_no_flags_and_no_environment_is_one_process(monkeypatch):
    assert multihost.distributed_args(environ={}) is None
    for name in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES,
                 multihost.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert multihost.initialize() is False


@pytest.mark.parametrize("args,match", [
    (("h:1", None, None), "missing: --num-processes, --process-id"),
    ((None, 2, 0), "missing: --coordinator-address"),
    (("h:1", 2, 2), r"--process-id 2 is outside \[0, 2\)"),
    (("h:1", 2, -1), r"--process-id -1 is outside \[0, 2\)"),
    (("h:1", 0, 0), "--num-processes must be at least 1"),
    (("h:1", "two", 0), "must be integers"),
    (("h", 2, 0), "needs a port"),
])
def test_bad_distributed_args_name_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        multihost.distributed_args(*args, environ={})


def test_serve_refuses_partial_multihost_flags(tmp_path, capsys, monkeypatch):
    """scripts/serve.py exits 2 naming the missing flags, before loading anything."""
    from eagle_jax.server import serve

    for name in (multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert serve.main(["--model", str(tmp_path), "--speculative-algorithm", "NONE",
                       "--coordinator-address", "localhost:1234"]) == 2
    assert "missing: --num-processes, --process-id" in capsys.readouterr().err


# ------------------------------------------------------------------ commands
def test_a_command_survives_encoding():
    params = SamplingParams(temperature=0.0, max_tokens=7, stop=["x"], ignore_eos=True)
    command = multihost.Command(ops=[("add", "r1", [1, 2, 3], params), ("abort", "r0")],
                                step=True, step_times=[(4, 2, 0.0125)])
    payload, n = multihost.encode(command)
    assert payload.dtype == np.uint8 and payload.size == multihost.padded_size(n)
    assert multihost.decode(payload, n) == command


@pytest.mark.parametrize("n,size", [(0, 1024), (1, 1024), (1024, 1024), (1025, 2048),
                                    (5000, 8192)])
def test_payloads_pad_to_powers_of_two(n, size):
    assert multihost.padded_size(n) == size


def test_an_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown lockstep op 'reset'"):
        multihost.apply_ops(None, [("reset",)])


# -------------------------------------------------------------- draft policy
def _policy() -> AdaptiveDraftLength:
    return AdaptiveDraftLength((0, 1, 2), {(4, s): 0.01 * (1 + s) for s in (0, 1, 2)})


def test_followers_choose_from_the_leaders_step_times():
    """The follower's own (different) times are dropped and the leader's replayed, so
    both policies hold the same estimates and make the same choices."""
    leader = multihost.LockstepPolicy(_policy(), leader=True)
    follower = multihost.LockstepPolicy(_policy(), leader=False)
    accept = np.array([2, 2, 1, 2])
    for step in range(40):
        length = leader.choose(4)
        assert follower.choose(4) == length, step
        leader.observe(length, accept)
        follower.observe(length, accept)
        leader.observe_time(4, length, 0.001 * (step % 7 + 1))  # this host's clock
        follower.observe_time(4, length, 0.5)  # another host's: dropped
        follower.replay(leader.take_step_times())
        assert follower.step_seconds == leader.step_seconds
    assert leader.take_step_times() == []
    assert leader.step_seconds != _policy().step_seconds  # the leader's times took effect
