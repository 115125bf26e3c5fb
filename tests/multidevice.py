"""Tensor- and data-parallel runs of the target decoder and of the engine in a process of
their own, for tests (here, not in ``eagle_jax.testutil``: it drives the engine, a layer
above the test helpers; ``tests/test_layering.py``).

A host-platform device count is fixed when jax starts, so the test process (one CPU
device) cannot grow a mesh: ``run_in_subprocess`` starts ``python -m tests.multidevice``
(from the repository root) with ``XLA_FLAGS=--xla_force_host_platform_device_count`` and
reads back an ``.npz`` of what it measured. The assertions stay in the test.

For each tensor-parallel size (1 = no mesh, the reference) the child loads the checkpoint,
runs a ragged prefill through the paged KV cache, greedy decode steps and one draft-tree
verify (a block mask), and records the logits, greedy tokens, every parameter's and the
KV pool's per-device shard shapes, layer 0's fused q/k/v shards, the collectives of the
compiled decode step and ``module_tensors`` of the loaded and of a randomly initialised
model. ``run_engines_in_subprocess`` runs whole engines (``Engine(tensor_parallel_size=)``)
on a schedule of greedy requests instead, ``run_data_parallel_in_subprocess`` the same
through ``make_engine`` (data-parallel replicas), ``run_sampling_in_subprocess`` one
engine on many sampled requests.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def run_in_subprocess(model_dir: str, out_path: str, tp_sizes: tuple[int, ...], *,
                      seed: int, devices: int = 4, decode_steps: int = 3,
                      timeout: float = 900) -> dict[str, np.ndarray]:
    """Runs ``main`` in a child with ``devices`` host devices; returns its arrays."""
    return _child(dict(kind="decoder", model_dir=model_dir, out=out_path,
                       tp_sizes=list(tp_sizes), seed=seed, decode_steps=decode_steps),
                  devices, timeout)


def run_engines_in_subprocess(target: str, draft: str, out_path: str, runs: list, *,
                              schedule: list, config: dict, bad_sizes: tuple[int, ...] = (),
                              export_run: tuple[int, str] | None = None, devices: int = 4, timeout: float = 900) -> dict[str, np.ndarray]:
    """Runs ``Engine``s in a child with ``devices`` host devices: for each (tensor-parallel
    size, algorithm) of ``runs``, an engine of ``config`` ("EAGLE3": ``target`` and
    ``draft``; "NONE": the target alone) runs ``schedule`` (``engine_schedule``'s).
    Returns ``{tp}/{algorithm}/{request id}`` (its tokens), ``.../num_pages`` and
    ``.../bytes_per_token`` (the pool, per device), ``errors/{size}``: the ValueError
    a plain engine raised at each of ``bad_sizes``, and ``export/...``: the step of the
    ``export_run`` engine exported for ROCm and CUDA (``_export_step``)."""
    return _child(dict(kind="engine", target=target, draft=draft, out=out_path,
                       runs=[list(r) for r in runs], schedule=schedule, config=config,
                       bad_sizes=list(bad_sizes), export_run=list(export_run or ())),
                  devices, timeout, FAST_COMPILE_FLAGS)


# The engines' steps are big programs that run a few times each: compiling them with
# LLVM's cheaper passes takes a third off the XLA compile time, most of such a child's
# (and of the whole CPU suite's: ``conftest.py`` sets them for the test processes too).
# XLA's older loop emitters in place of its MLIR fusion emitters take another quarter
# off (the test pair's engine, 4 executables: 21.2 s to 15.4 s) for slower steps (1000
# requests through a one-lane engine: 25 s to 40 s): test_draft_policy.py 166 s to 127 s,
# test_engine_sampling.py, the suite's most run-bound file, 336 s to 369 s.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                      " --xla_cpu_use_fusion_emitters=false")


def run_data_parallel_in_subprocess(target: str, draft: str, out_path: str, runs: list, *,
                                    schedule: list, config: dict, devices: int = 4,
                                    timeout: float = 900) -> dict[str, np.ndarray]:
    """Runs ``make_engine`` engines in a child with ``devices`` host devices: for each
    (data-parallel size, tensor-parallel size, algorithm) of ``runs``, an engine of
    ``config`` runs ``schedule`` (``engine_schedule``'s). Returns ``{dp}x{tp}/{algo}/{rid}``
    (its tokens), ``.../route/{rid}`` (the replica it went to, data-parallel runs) and
    ``.../loads/{rid}`` (each replica's unfinished requests just before),
    ``.../devices/{i}/params`` and ``.../devices/{i}/state`` (the device ids replica i's
    arrays live on), ``abort/...`` (``_abort_run``) and ``errors/{dp}x{tp}``, the
    ValueError of a data-parallel size too big for the devices."""
    return _child(dict(kind="data_parallel", target=target, draft=draft, out=out_path,
                       runs=[list(r) for r in runs], schedule=schedule, config=config),
                  devices, timeout, FAST_COMPILE_FLAGS)


def run_sampling_in_subprocess(target: str, draft: str, out_path: str, tp: int, *,
                               config: dict, prompt: list[int], num_requests: int,
                               params: dict, timeout: float = 900) -> dict[str, np.ndarray]:
    """Runs ``testutil.sampling.sample_prompt`` on an engine of ``config`` (``target`` and
    ``draft``) at tensor-parallel ``tp`` in a child with ``tp`` host devices. Returns
    ``tokens`` [num_requests, max_tokens] (request i's in row i) and the engine's
    ``accepted`` and ``drafted`` token counts."""
    return _child(dict(kind="sample", target=target, draft=draft, out=out_path, tp=tp,
                       config=config, prompt=prompt, num_requests=num_requests,
                       params=params), tp, timeout, FAST_COMPILE_FLAGS)


def run_multihost_in_subprocesses(target: str, draft: str, out_path: str, runs: list,
                                  *, schedule: list, config: dict, processes: int = 2,
                                  devices: int = 2, timeout: float = 900
                                  ) -> list[dict[str, np.ndarray]]:
    """Runs one engine over ``processes`` children of ``devices`` host devices each, joined
    by ``jax.distributed`` (a local coordinator): for each (algorithm, config overrides)
    of ``runs`` an engine of ``config`` at tensor-parallel size processes x devices,
    driven in lockstep (``engine.multihost``): the leader (process 0) runs ``schedule``
    (``engine_schedule``'s) and then ``_lockstep_abort`` through a ``LockstepEngine``, the
    others ``follow``. Returns each process's arrays: ``{algo}/{rid}`` (the tokens its
    engine produced, x and y those of ``_lockstep_abort``), ``{algo}/steps``,
    ``{algo}/draft_length_steps`` (its steps, by draft length), ``{algo}/unfinished``
    (whether its engine holds work at the end), ``{algo}/local_devices`` (the device ids
    it holds) and ``errors/tp``, ``errors/dp``: the ValueErrors of a tensor-parallel size
    short of every device and of data parallelism across processes."""
    request = dict(kind="multihost", target=target, draft=draft, runs=list(runs),
                   schedule=schedule, config=config, num_processes=processes,
                   coordinator=f"localhost:{_free_port()}")
    outs = [f"{out_path}.{i}.npz" for i in range(processes)]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         f"{FAST_COMPILE_FLAGS}")
    children = [subprocess.Popen(
        [sys.executable, "-m", __name__, json.dumps(dict(request, process_id=i, out=out))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        for i, out in enumerate(outs)]
    failures = []
    for i, child in enumerate(children):
        try:
            _, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
        if child.returncode:
            failures.append(f"process {i}:\n{stderr[-4000:]}")
    if failures:
        for c in children:
            c.kill()
        raise RuntimeError("multi-process children failed:\n" + "\n".join(failures))
    arrays = []
    for out in outs:
        with np.load(out) as f:
            arrays.append(dict(f))
    return arrays


def _free_port() -> int:
    """A TCP port free now on localhost (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _child(request: dict, devices: int, timeout: float, xla_flags: str = ""
           ) -> dict[str, np.ndarray]:
    out_path = request["out"]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {xla_flags}")
    proc = subprocess.run([sys.executable, "-m", __name__, json.dumps(request)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode:
        raise RuntimeError(f"tensor-parallel child failed:\n{proc.stderr[-4000:]}")
    with np.load(out_path) as f:
        return dict(f)


def _inputs(rng: np.random.Generator, vocab: int, capacity: int):
    """A ragged prefill of two rows: row 1 is shorter, its tail padding (position =
    capacity, whose KV write is dropped)."""
    lengths = (int(rng.integers(5, 9)), int(rng.integers(2, 5)))
    t = max(lengths)
    tokens = rng.integers(0, vocab, (2, t)).astype(np.int32)
    positions = np.full((2, t), capacity, np.int32)
    for b, n in enumerate(lengths):
        positions[b, :n] = np.arange(n)
    return tokens, positions, np.array(lengths, np.int32)


def _tree(rng: np.random.Generator, lengths: np.ndarray, nodes: int):
    """A random draft tree of ``nodes`` nodes per row after ``lengths``: node i's parent
    is a random earlier node (node 0 the root); each sees its ancestors and itself."""
    b = len(lengths)
    mask = np.zeros((b, nodes, nodes), bool)
    depth = np.zeros((b, nodes), np.int32)
    for r in range(b):
        for i in range(nodes):
            mask[r, i, i] = True
            if i:
                parent = int(rng.integers(0, i))
                mask[r, i] |= mask[r, parent]
                depth[r, i] = depth[r, parent] + 1
    positions = lengths[:, None] + np.arange(nodes, dtype=np.int32)[None]
    return positions.astype(np.int32), (lengths[:, None] + depth).astype(np.int32), mask


def _collectives(hlo: str) -> np.ndarray:
    """Counts of each of COLLECTIVES' ops (sync or async start) in compiled HLO text."""
    return np.array([len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in COLLECTIVES])


def _run(model_dir: str, tp: int, seed: int, decode_steps: int) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from eagle_jax import parallel
    from eagle_jax.checkpoint import module_tensors
    from eagle_jax.config import ModelConfig
    from eagle_jax.models.decoder import Decoder, checkpoint_name, load_decoder
    from eagle_jax.models.layers import TreeLayout
    from eagle_jax.params import module_param_paths

    mesh = None if tp == 1 else parallel.make_mesh(tp)
    model = load_decoder(model_dir, mesh=mesh)
    graph, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens, positions, cache, tree=None):
        out = nnx.merge(graph, state)(tokens, positions, cache, tree=tree)
        return out.logits, out.cache

    rng = np.random.default_rng(seed)
    cache = model.init_cache(2, 32)
    vocab = model.config.vocab_size
    tokens, positions, lengths = _inputs(rng, vocab, cache.capacity)
    logits, cache = forward(state, tokens, positions, cache)
    out: dict[str, np.ndarray] = {"prefill": np.asarray(logits)}
    last = np.asarray(logits)[np.arange(2), lengths - 1]
    greedy = []
    for _ in range(decode_steps):
        token = jnp.asarray(np.argmax(last, -1)[:, None], jnp.int32)
        greedy.append(np.asarray(token)[:, 0])
        logits, cache = forward(state, token, jnp.asarray(lengths[:, None]), cache)
        lengths = lengths + 1
        last = np.asarray(logits)[:, 0]
        out[f"decode{len(greedy)}"] = last
    out["greedy"] = np.stack(greedy, 1)
    tree_pos, rope_pos, mask = _tree(rng, lengths, 4)
    tree_tokens = rng.integers(0, vocab, tree_pos.shape).astype(np.int32)
    out["tree"] = np.asarray(forward(state, tree_tokens, tree_pos, cache,
                                     TreeLayout(jnp.asarray(rope_pos), jnp.asarray(mask)))[0])

    hlo = forward.lower(state, token, jnp.asarray(lengths[:, None]), cache).compile().as_text()
    out["collectives"] = _collectives(hlo)
    out["pool_shards"] = np.array([s.data.shape for s in cache.pages.k[0].addressable_shards])
    qkv = model.layers[0].self_attn.qkv_proj.weight[...]
    out["qkv_shards"] = np.stack([np.asarray(s.data) for s in sorted(
        qkv.addressable_shards, key=lambda s: s.device.id)])
    for path, var in module_param_paths(model):
        name = ".".join(map(str, path))
        out[f"shard_shapes:{name}"] = np.array(
            [s.data.shape for s in var[...].addressable_shards])
    for name, arr in module_tensors(model, checkpoint_name).items():
        out[f"saved:{name}"] = arr
    cfg = ModelConfig.from_dir(model_dir)
    fresh = Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(seed))
    for name, arr in module_tensors(fresh, checkpoint_name).items():
        out[f"init:{name}"] = arr
    return out


def engine_schedule(engine, schedule: list) -> dict[str, list[int]]:
    """Steps ``engine`` until every request of ``schedule`` — (join step, request id,
    prompt, max tokens) — has finished, each greedy, joining at its step. Returns
    request id -> its tokens."""
    from eagle_jax import SamplingParams

    out = {rid: [] for _, rid, _, _ in schedule}
    done, step = set(), 0
    while len(done) < len(schedule):
        for join, rid, prompt, max_tokens in schedule:
            if join == step:
                engine.add_request(rid, prompt, SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
        step += 1
        if step > 500:
            raise RuntimeError(f"the schedule did not finish in 500 steps: {out}")
    return out


def _run_engines(request: dict) -> dict[str, np.ndarray]:
    from eagle_jax.engine import Engine, EngineConfig

    cfg, out = request["config"], {}
    for tp, algo in request["runs"]:
        engine = Engine(EngineConfig(
            model=request["target"], speculative_algorithm=algo,
            draft_model=request["draft"] if algo != "NONE" else None,
            tensor_parallel_size=tp, **cfg))
        for rid, tokens in engine_schedule(engine, request["schedule"]).items():
            out[f"{tp}/{algo}/{rid}"] = np.array(tokens)
        out[f"{tp}/{algo}/num_pages"] = np.array(engine.num_pages)
        out[f"{tp}/{algo}/bytes_per_token"] = np.array(
            engine.kv_bytes // (engine.num_pages * engine.page_size))
        if [tp, algo] == request["export_run"]:
            out.update(_export_step(engine))
    for tp in request["bad_sizes"]:
        try:
            Engine(EngineConfig(model=request["target"], speculative_algorithm="NONE",
                                tensor_parallel_size=tp, **cfg))
        except ValueError as e:
            out[f"errors/{tp}"] = np.array(str(e))
    return out


def _run_data_parallel(request: dict) -> dict[str, np.ndarray]:
    import jax
    from flax import nnx

    from eagle_jax.engine import DataParallelEngine, EngineConfig, make_engine

    def device_ids(tree) -> np.ndarray:
        return np.array(sorted({d.id for x in jax.tree.leaves(tree)
                                for d in x.sharding.device_set}))

    cfg, out = request["config"], {}
    for dp, tp, algo in request["runs"]:
        engine = make_engine(EngineConfig(
            model=request["target"], speculative_algorithm=algo,
            draft_model=request["draft"] if algo != "NONE" else None,
            tensor_parallel_size=tp, data_parallel_size=dp, **cfg))
        key = f"{dp}x{tp}/{algo}"
        if isinstance(engine, DataParallelEngine):
            add = engine.add_request

            def routed(rid, *args, add=add, engine=engine):
                out[f"{key}/loads/{rid}"] = np.array([
                    r.num_running() + r.num_waiting() for r in engine.replicas])
                add(rid, *args)
                out[f"{key}/route/{rid}"] = np.array(engine.replica_of(rid))

            engine.add_request = routed  # records each request's replica
            for i, r in enumerate(engine.replicas):
                models = [nnx.state(m) for m in (r.target, r.draft) if m is not None]
                out[f"{key}/devices/{i}/params"] = device_ids(models)
                out[f"{key}/devices/{i}/state"] = device_ids(r.state)
        for rid, tokens in engine_schedule(engine, request["schedule"]).items():
            out[f"{key}/{rid}"] = np.array(tokens)
        if dp == 2 and tp == 1:
            out.update(_abort_run(engine))
    try:
        make_engine(EngineConfig(model=request["target"], speculative_algorithm="NONE",
                                 tensor_parallel_size=4, data_parallel_size=2, **cfg))
    except ValueError as e:
        out["errors/2x4"] = np.array(str(e))
    return out


def _abort_run(engine) -> dict[str, np.ndarray]:
    """On an idle 2-replica engine: "x" and "y" join (replicas 0 and 1), "y" is aborted.
    Returns ``abort/route`` (both replicas), ``abort/reasons`` (x's, y's finish) and
    ``abort/x_tokens``."""
    from eagle_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("x", [5, 9, 13], params)
    engine.add_request("y", [7, 8, 9, 10], params)
    route = [engine.replica_of("x"), engine.replica_of("y")]
    reasons, tokens, steps = {}, [], 0
    while engine.has_unfinished_requests():
        if steps == 1:
            engine.abort_request("y")
        for o in engine.step():
            if o.request_id == "x":
                tokens.extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
    return {"abort/route": np.array(route), "abort/x_tokens": np.array(tokens),
            "abort/reasons": np.array([reasons.get("x", ""), reasons.get("y", "")]),
            "abort/unfinished": np.array([r.has_unfinished_requests()
                                          for r in engine.replicas])}


def _export_step(engine) -> dict[str, np.ndarray]:
    """``export/{platform}/...`` of the engine's step (its smallest batch bucket) exported
    for ROCm and CUDA: the Triton custom calls, shard_map bodies (per-shard kernels) and
    devices of the module, and each input's PartitionSpec, the export's (``in_specs``)
    and the engine's arrays' (``arg_specs``)."""
    import jax

    from eagle_jax.kernels._common import TRITON_CUSTOM_CALL
    from eagle_jax.testutil.export import export

    spec = lambda s: str(getattr(s, "spec", None))
    args = engine.runner.step_inputs()
    out = {"export/arg_specs": np.array([spec(getattr(x, "sharding", None))
                                         for x in jax.tree.leaves(args)])}
    for platform, target in (("rocm", "gfx950"), ("cuda", "sm_90")):
        exported = export(engine.runner.step_function(engine.batch_buckets[0]), args, (2,),
                          platform, target)
        text = exported.mlir_module()
        out[f"export/{platform}/triton_calls"] = np.array(
            text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}"))
        out[f"export/{platform}/paged_attention"] = np.array(text.count("paged_attention"))
        out[f"export/{platform}/manual_computations"] = np.array(
            text.count("sdy.manual_computation"))
        out[f"export/{platform}/layer_calls"] = np.array(text.count("call @_shared_layer("))
        out[f"export/{platform}/layer_functions"] = np.array(
            text.count("func.func private @_shared_layer"))
        out[f"export/{platform}/nr_devices"] = np.array(exported.nr_devices)
        out[f"export/{platform}/in_specs"] = np.array(
            [spec(s) for s in exported.in_shardings_jax(engine.mesh)])
    return out


def _run_sampling(request: dict) -> dict[str, np.ndarray]:
    from eagle_jax.engine import Engine, EngineConfig
    from eagle_jax.testutil.sampling import sample_prompt

    engine = Engine(EngineConfig(model=request["target"], draft_model=request["draft"],
                                 tensor_parallel_size=request["tp"], **request["config"]))
    n = request["num_requests"]
    out = sample_prompt(engine, request["prompt"], n, **request["params"])
    return dict(tokens=np.array([out[str(i)] for i in range(n)]),
                accepted=np.array(engine.stats.num_accepted_tokens),
                drafted=np.array(engine.stats.num_draft_tokens))


def _lockstep_abort(engine) -> None:
    """"x" and "y" join an idle engine; "y" is aborted after one step, "x" runs out."""
    from eagle_jax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("x", [5, 9, 13], params)
    engine.add_request("y", [7, 8, 9, 10], params)
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 1:
            engine.abort_request("y")
        engine.step()
        steps += 1


def _run_multihost(request: dict) -> dict[str, np.ndarray]:
    import jax

    from eagle_jax.engine import EngineConfig, make_engine, multihost

    assert multihost.initialize(request["coordinator"], request["num_processes"],
                                request["process_id"])
    cfg, out = request["config"], {}
    tp = len(jax.devices())
    for algo, extra in request["runs"]:
        engine = make_engine(EngineConfig(
            model=request["target"], speculative_algorithm=algo,
            draft_model=request["draft"] if algo != "NONE" else None,
            tensor_parallel_size=tp, **cfg, **extra))
        tokens: dict[str, list[int]] = {}

        def record(event, tokens=tokens):
            for o in event.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

        engine.add_step_listener(record)
        if multihost.is_leader():
            lockstep = multihost.LockstepEngine(engine, heartbeat_seconds=None)
            engine_schedule(lockstep, request["schedule"])
            _lockstep_abort(lockstep)
            lockstep.shutdown()
        else:
            multihost.follow(engine)
        for rid, toks in tokens.items():
            out[f"{algo}/{rid}"] = np.array(toks)
        out[f"{algo}/steps"] = np.array(engine.stats.num_steps)
        out[f"{algo}/draft_length_steps"] = np.array(engine.stats.draft_length_steps)
        out[f"{algo}/unfinished"] = np.array(engine.has_unfinished_requests())
        out[f"{algo}/local_devices"] = np.array(sorted(
            d.id for d in engine.devices if d.process_index == jax.process_index()))
    for name, sizes in (("tp", dict(tensor_parallel_size=tp // 2)),
                        ("dp", dict(tensor_parallel_size=tp, data_parallel_size=2))):
        try:
            make_engine(EngineConfig(model=request["target"], speculative_algorithm="NONE",
                                     **sizes, **cfg))
        except ValueError as e:
            out[f"errors/{name}"] = np.array(str(e))
    return out


def main(request: dict) -> None:
    import jax

    # As in tests/conftest.py: float32 matmuls at full precision.
    jax.config.update("jax_default_matmul_precision", "highest")
    if request["kind"] == "engine":
        arrays = _run_engines(request)
    elif request["kind"] == "data_parallel":
        arrays = _run_data_parallel(request)
    elif request["kind"] == "multihost":
        arrays = _run_multihost(request)
    elif request["kind"] == "sample":
        arrays = _run_sampling(request)
    else:
        arrays = {}
        for tp in request["tp_sizes"]:
            for key, value in _run(request["model_dir"], tp, request["seed"],
                                   request["decode_steps"]).items():
                arrays[f"tp{tp}/{key}"] = value
    np.savez(request["out"], **arrays)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
