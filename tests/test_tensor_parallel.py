"""Tensor parallelism of the target decoder (``eagle_jax.parallel``) and of the engine.

The mesh runs need several devices, which a CPU process has only when XLA_FLAGS says so
before jax starts: they run in a child process with 4 host devices
(``tests/multidevice.py``), and the assertions run here on what it returns.
The layout and error checks need no devices and run in this process.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle_jax import parallel
from eagle_jax.checkpoint import CheckpointReader, fused_row_order
from eagle_jax.config import ModelConfig
from eagle_jax.engine import EngineConfig
from eagle_jax.models.layers import FusedLinear
from eagle_jax.testutil.models import tiny_config

from . import test_engine_sampling as gof
from .multidevice import (
    COLLECTIVES, run_engines_in_subprocess, run_in_subprocess, run_sampling_in_subprocess)

LAYERS = 2
# (attention heads, kv heads): kv heads split over 2 and 4 devices; 2 kv heads at
# tensor-parallel 4 are each replicated on 2 devices.
HEAD_CASES = {"kv4": (8, 4), "kv2": (8, 2)}
TP_SIZES = (1, 2, 4)


def write_served_target(out: str, vocab_size: int = 320) -> str:
    """The kv2 target with a test tokenizer of its whole vocabulary (a server needs one;
    the engine's vocabulary is the same either way), written to ``out``."""
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    heads, kv_heads = HEAD_CASES["kv2"]
    write_tiny_target(out, "llama", num_heads=heads, num_kv_heads=kv_heads, num_layers=LAYERS,
                      vocab_size=vocab_size)
    return write_test_tokenizer(out, vocab_size)


@pytest.fixture(scope="module", params=sorted(HEAD_CASES))
def tp_run(request, tiny_targets, tmp_path_factory):
    heads, kv_heads = HEAD_CASES[request.param]
    model_dir = tiny_targets("llama", num_heads=heads, num_kv_heads=kv_heads,
                             num_layers=LAYERS)
    seed = int(np.random.default_rng().integers(1 << 30))
    out = tmp_path_factory.mktemp("tp") / "run.npz"
    arrays = run_in_subprocess(model_dir, str(out), TP_SIZES, seed=seed)
    return dict(arrays=arrays, model_dir=model_dir, heads=heads, kv_heads=kv_heads, seed=seed)


def _logit_keys(arrays):
    return sorted(k.split("/", 1)[1] for k in arrays
                  if k.startswith("tp1/") and k.split("/", 1)[1].startswith(
                      ("prefill", "decode", "tree")))


@pytest.mark.parametrize("tp", (2, 4))
def test_logits_and_greedy_tokens_equal_tensor_parallel_1(tp_run, tp):
    a = tp_run["arrays"]
    keys = _logit_keys(a)
    assert {"prefill", "decode1", "tree"} <= set(keys)
    for key in keys:
        ref, got = a[f"tp1/{key}"], a[f"tp{tp}/{key}"]
        assert np.all(np.isfinite(ref)) and np.std(ref) > 0.1, key
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{key} (seed {tp_run['seed']})")
    np.testing.assert_array_equal(a[f"tp{tp}/greedy"], a["tp1/greedy"])


@pytest.mark.parametrize("tp", (2, 4))
def test_params_and_pool_are_sharded_by_role(tp_run, tp):
    a, heads, kv_heads = tp_run["arrays"], tp_run["heads"], tp_run["kv_heads"]
    cfg = ModelConfig.from_dir(tp_run["model_dir"])
    h, d, v, inter = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    pool_kv = max(kv_heads, tp)
    expected = {
        "layers.0.self_attn.qkv_proj.weight": ((heads + 2 * pool_kv) * d // tp, h),
        "layers.1.self_attn.o_proj.weight": (h, heads * d // tp),
        "layers.0.mlp.gate_up_proj.weight": (2 * inter // tp, h),
        "layers.1.mlp.down_proj.weight": (h, inter // tp),
        "embed_tokens.weight": (v // tp, h),
        "lm_head.weight": (v // tp, h),
        "norm.weight": (h,),
        "layers.0.input_layernorm.weight": (h,),
    }
    for name, shape in expected.items():
        shards = a[f"tp{tp}/shard_shapes:{name}"]
        assert shards.shape[0] == tp, name
        assert all(tuple(s) == shape for s in shards), (name, shards, shape)
    pool = a[f"tp{tp}/pool_shards"]
    assert pool.shape[0] == tp and all(s[2] == pool_kv // tp for s in pool), pool
    assert tuple(a["tp1/pool_shards"][0])[2] == kv_heads


@pytest.mark.parametrize("tp", (2, 4))
def test_each_device_holds_its_own_q_k_v_heads(tp_run, tp):
    """Device s's rows of the fused projection are the checkpoint's q heads of shard s
    and the k / v heads they attend with (kv head = q head // (heads / kv heads))."""
    a, heads, kv_heads = tp_run["arrays"], tp_run["heads"], tp_run["kv_heads"]
    reader = CheckpointReader(tp_run["model_dir"])
    get = lambda p: reader.get(f"model.layers.0.self_attn.{p}_proj.weight")
    q, k, v = get("q"), get("k"), get("v")
    d = q.shape[0] // heads
    shards = a[f"tp{tp}/qkv_shards"]
    q_per = heads // tp
    for s in range(tp):
        q_heads = range(s * q_per, (s + 1) * q_per)
        kv_used = sorted({n // (heads // kv_heads) for n in q_heads})
        rows = lambda w, hs: np.concatenate([w[i * d:(i + 1) * d] for i in hs])
        want = np.concatenate([rows(q, q_heads), rows(k, kv_used), rows(v, kv_used)])
        np.testing.assert_array_equal(shards[s], want)


def test_decode_step_communicates_by_one_all_reduce_per_row_parallel_layer(tp_run):
    """o_proj and down_proj of every layer, and the vocabulary-parallel embedding: one
    all-reduce each; nothing is gathered or moved between devices (the fused layout
    needs no resharding)."""
    a = tp_run["arrays"]
    counts = dict(zip(COLLECTIVES, a["tp4/collectives"]))
    assert counts == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 2 * LAYERS + 1}, counts
    assert not a["tp1/collectives"].any()


@pytest.mark.parametrize("tp", (2, 4))
def test_saved_tensors_are_the_checkpoint_and_init_is_shard_count_free(tp_run, tp):
    """module_tensors of a tensor-parallel model writes the Hugging Face tensors back
    exactly, and a model initialised at any shard count writes those of shards = 1."""
    a = tp_run["arrays"]
    reader = CheckpointReader(tp_run["model_dir"])
    saved = {k.split(":", 1)[1] for k in a if k.startswith(f"tp{tp}/saved:")}
    assert saved == set(reader.keys())
    for name in saved:
        np.testing.assert_array_equal(a[f"tp{tp}/saved:{name}"], reader.get(name), name)
        np.testing.assert_array_equal(a[f"tp{tp}/init:{name}"], a[f"tp1/init:{name}"], name)


# ---- The engine at tensor-parallel 2 and 4 (one child process). ------------------------

# Two requests of different lengths, the second joining at step 2 while the first decodes
# (its prompt chunk rides in the decode step), on the kv2 target: at tensor-parallel 4 its
# 2 kv heads are each replicated on 2 devices. Greedy speculative output equals the
# target's alone (tests/test_engine.py), so the plain engine at tensor-parallel 1 is the
# reference of all four.
ENGINE_SCHEDULE = [(0, "a", [5, 9, 13, 21, 40, 7, 88], 9),
                   (2, "b", [3, 4, 5, 6, 100, 101, 102, 103, 104, 7, 8, 9, 30, 31], 6)]
ENGINE_RUNS = [(1, "NONE"), (2, "NONE"), (2, "EAGLE3"), (4, "NONE"), (4, "EAGLE3")]
KV_BUDGET = 1 << 20
ENGINE_CONFIG = dict(dtype="float32", max_model_len=64, max_num_seqs=2, batch_buckets=(2,),
                     prefill_buckets=(16,), page_size=16, num_steps=2, precompile=False,
                     compilation_cache_dir="", kv_cache_memory=KV_BUDGET)


@pytest.fixture(scope="module")
def engine_run(tiny_targets, tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft

    heads, kv_heads = HEAD_CASES["kv2"]
    target = tiny_targets("llama", num_heads=heads, num_kv_heads=kv_heads, num_layers=LAYERS)
    root = tmp_path_factory.mktemp("tp_engine")
    draft = write_tiny_eagle3_draft(str(root / "eagle3"), target)
    arrays = run_engines_in_subprocess(target, draft, str(root / "run.npz"), ENGINE_RUNS,
                                       schedule=ENGINE_SCHEDULE, config=ENGINE_CONFIG,
                                       bad_sizes=(8, 3), export_run=(2, "EAGLE3"))
    return dict(arrays=arrays, target=target, draft=draft)


@pytest.mark.parametrize("tp,algo", [r for r in ENGINE_RUNS if r[0] > 1])
def test_engine_greedy_output_equals_tensor_parallel_1(engine_run, tp, algo):
    a = engine_run["arrays"]
    for _, rid, _, max_tokens in ENGINE_SCHEDULE:
        ref = a[f"1/NONE/{rid}"]
        assert len(ref) == max_tokens
        np.testing.assert_array_equal(a[f"{tp}/{algo}/{rid}"], ref, err_msg=rid)


def test_engine_kv_pool_per_device_holds_each_devices_kv_heads(engine_run):
    """A device stores max(K, N) / N of the target's kv heads (kv heads replicated when
    N > K) and the whole replicated draft pool: the same per-device budget holds that
    much more of the target's tokens."""
    a = engine_run["arrays"]
    cfg = ModelConfig.from_dir(engine_run["target"])
    page = ENGINE_CONFIG["page_size"]
    target_bytes = {}
    for tp in (1, 2, 4):
        kv_per_device = max(cfg.num_kv_heads, tp) // tp
        target_bytes[tp] = 2 * cfg.num_layers * kv_per_device * cfg.head_dim * 4  # float32
        assert a[f"{tp}/NONE/bytes_per_token"] == target_bytes[tp], tp
        assert a[f"{tp}/NONE/num_pages"] == KV_BUDGET // (target_bytes[tp] * page), tp
    assert a["2/NONE/num_pages"] == 2 * a["1/NONE/num_pages"]
    draft_bytes = [a[f"{tp}/EAGLE3/bytes_per_token"] - target_bytes[tp] for tp in (2, 4)]
    assert draft_bytes[0] == draft_bytes[1] > 0


@pytest.mark.parametrize("platform", ("rocm", "cuda"))
def test_engine_step_exports_with_its_shardings(engine_run, platform):
    """The speculative step at tensor-parallel 2 exports for the GPU platforms (its
    kernels on their Triton path): a 2-device module whose inputs keep the engine's
    shardings (parameters by role, the target's pool by kv head, the rest replicated),
    the layers one shared function whose paged attention is a shard_map body."""
    a = engine_run["arrays"]
    e = lambda key: a[f"export/{platform}/{key}"]
    assert e("nr_devices") == 2
    np.testing.assert_array_equal(e("in_specs"), a["export/arg_specs"])
    specs = set(a["export/arg_specs"])
    # (An exported spec drops trailing Nones: the pool's is P(None, None, "tp").)
    assert {str(P(None, None, "tp")), str(P("tp", None)), str(P(None, "tp")),
            str(P())} <= specs, specs
    # Draft proposal x 2, sampler x 2, norm-concat x 2, gathered LM head, paged attention.
    assert e("triton_calls") >= 2 + 2 + 2 + 1 + 1, e("triton_calls")
    # Every layer calls the one lowered layer function (models.decoder.run_layers), in
    # which the paged attention runs under shard_map.
    assert e("paged_attention") > 0 and e("manual_computations") >= 1
    assert e("layer_functions") == 1 and e("layer_calls") == LAYERS, (
        e("layer_functions"), e("layer_calls"))


def test_engine_bad_tensor_parallel_size_names_the_fix(engine_run):
    a = engine_run["arrays"]
    assert "use at most 4" in str(a["errors/8"])
    assert "does not divide the model's 8 attention heads; use" in str(a["errors/3"])
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=engine_run["target"], speculative_algorithm="NONE",
                     tensor_parallel_size=0)


# The goodness-of-fit test's checkpoints (a module fixture of its own).
pair = gof.pair


def test_engine_sampled_output_fits_the_target_at_tensor_parallel_2(pair, tmp_path):
    """tests/test_engine_sampling.py's fit test of sampled speculative output (rejection
    sampling with the draft's q, top-k / top-p filters), its engine at tensor-parallel 2."""
    temperature, top_k, top_p = 0.7, 6, 0.9
    a = run_sampling_in_subprocess(
        *pair, str(tmp_path / "sample.npz"), 2,
        config={**gof.ENGINE, "draft_sample_method": "probabilistic"}, prompt=gof.PROMPT,
        num_requests=gof.NUM_REQUESTS,
        params=dict(max_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p))
    out = {str(i): list(t) for i, t in enumerate(a["tokens"])}
    counts, expected = gof.fit_counts(pair[0], out, temperature, top_k, top_p)
    pvalue, stat, dof = gof.chi_square_pvalue(counts.ravel(), expected.ravel())
    assert pvalue > gof.ALPHA, (stat, dof, pvalue)
    assert 0 < a["accepted"] < a["drafted"]
    assert counts[expected == 0].sum() == 0


# ---- In this process: the fused layout and the errors. ---------------------------------


def test_fused_row_order_is_shard_major():
    # q: 4 rows, k and v: 2 rows each, over 2 shards.
    np.testing.assert_array_equal(fused_row_order((4, 2, 2), 2),
                                  [0, 1, 4, 6, 2, 3, 5, 7])
    # k and v (1 row each) replicated on both shards.
    np.testing.assert_array_equal(fused_row_order((4, 1, 1), 2, (1, 2, 2)),
                                  [0, 1, 4, 5, 2, 3, 4, 5])
    np.testing.assert_array_equal(fused_row_order((4, 2, 2), 1), np.arange(8))


@pytest.mark.parametrize("shards,replicas", [(1, None), (2, None), (4, None), (4, (1, 2, 2))])
def test_fused_linear_splits_any_shard_count_like_one_shard(shards, replicas):
    """The same weights in the shard-major layout give the same q / k / v (k / v
    repeated per replica group)."""
    parts = (("q", 8), ("k", 4), ("v", 4)) if replicas is None else (("q", 8), ("k", 2),
                                                                     ("v", 2))
    seed = int(np.random.default_rng().integers(1 << 30))
    one = FusedLinear(6, parts, bias=True, rngs=nnx.Rngs(seed))
    one.bias.set_value(jax.random.normal(jax.random.key(seed), one.bias.shape))
    many = FusedLinear(6, parts, shards=shards, replicas=replicas, bias=True,
                       rngs=nnx.Rngs(seed))
    order = fused_row_order(tuple(n for _, n in parts), shards, replicas)
    many.bias.set_value(one.bias[...][order])
    np.testing.assert_array_equal(many.weight[...], one.weight[...][order])
    x = jax.random.normal(jax.random.key(seed + 1), (3, 5, 6))
    rep = replicas or (1, 1, 1)
    for r, a, b in zip(rep, one(x), many(x)):
        # A replicated part: each of its shards // r chunks appears r times in a row.
        chunks = jnp.split(a, shards // r, axis=-1)
        want = jnp.concatenate([c for c in chunks for _ in range(r)], axis=-1)
        np.testing.assert_allclose(b, want, rtol=1e-6, atol=1e-6)


def _cfg(**kw) -> ModelConfig:
    """A tiny Llama config (8 heads, 4 kv heads, MLP width 128) with ``kw`` changed."""
    base = ModelConfig.from_hf_dict(tiny_config("llama", num_heads=8, num_kv_heads=4))
    return dataclasses.replace(base, **kw)


@pytest.mark.parametrize("kw,tp,match", [
    (dict(), 3, "does not divide the model's 8 attention heads"),
    (dict(num_heads=12, num_kv_heads=6), 4, "one must divide the other"),
    (dict(intermediate_size=130), 4, "intermediate size 130"),
])
def test_bad_tensor_parallel_sizes_name_the_fix(kw, tp, match):
    with pytest.raises(ValueError, match=match) as e:
        parallel.check_tensor_parallel(_cfg(**kw), tp)
    assert "use " in str(e.value)


def test_good_tensor_parallel_sizes_pass():
    for tp in (1, 2, 4, 8):  # 8 > 4 kv heads: each replicated twice
        parallel.check_tensor_parallel(_cfg(), tp)
    assert parallel.kv_replicas(4, 8) == 2 and parallel.kv_replicas(4, 2) == 1


def test_make_mesh_refuses_more_devices_than_there_are():
    n = len(jax.local_devices())
    with pytest.raises(ValueError, match=f"use at most {n}"):
        parallel.make_mesh(n + 1)
    with pytest.raises(ValueError, match="positive integer"):
        parallel.make_mesh(0)
    mesh = parallel.make_mesh(n, _cfg())
    assert mesh.axis_names == ("tp",) and mesh.devices.size == n
