"""Checkpoint loading: sharded files, dtype casting, and errors that name the problem."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from eagle_jax.checkpoint import CheckpointError, CheckpointReader, save_safetensors, save_sharded
from eagle_jax.models.decoder import load_decoder


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _tensors(model_dir):
    r = CheckpointReader(model_dir)
    return {k: np.array(r.get(k)) for k in r.keys()}


def test_sharded_checkpoint_with_index_loads_identically(tiny_targets, tmp_path):
    src = tiny_targets("llama")
    tensors = _tensors(src)
    dst = tmp_path / "sharded"
    names = save_sharded(str(dst), tensors, max_shard_bytes=100_000)
    assert len(names) > 2 and (dst / "model.safetensors.index.json").exists()
    shutil.copy(os.path.join(src, "config.json"), dst)
    a, b = load_decoder(src), load_decoder(str(dst))
    np.testing.assert_array_equal(np.asarray(a.layers[3].mlp.down_proj.weight[...]),
                                  np.asarray(b.layers[3].mlp.down_proj.weight[...]))


def test_bfloat16_tensors_round_trip_and_cast(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    save_safetensors(str(tmp_path / "t.safetensors"), {"x": x, "i": np.arange(4, dtype=np.int64)})
    r = CheckpointReader(str(tmp_path))
    np.testing.assert_array_equal(r.get("x"), x)
    assert r.get("i").dtype == np.int64


def test_cast_to_requested_dtype(tiny_targets):
    m = load_decoder(tiny_targets("llama"), "bfloat16")
    assert m.layers[0].self_attn.qkv_proj.weight.dtype == jnp.bfloat16


def test_missing_tensor_names_file_tensor_and_shape(tiny_targets, tmp_path):
    d = _copy(tiny_targets("llama"), tmp_path / "m")
    t = _tensors(d)
    del t["model.layers.2.mlp.up_proj.weight"]
    os.remove(d / "model.safetensors")
    save_safetensors(str(d / "model.safetensors"), t)
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model\.layers\.2\.mlp\.up_proj"
                                              r"\.weight'; expected shape \(128, 64\)"):
        load_decoder(str(d))


def test_shape_mismatch_names_file_tensor_and_shapes(tiny_targets, tmp_path):
    d = _copy(tiny_targets("llama"), tmp_path / "m")
    t = _tensors(d)
    t["model.norm.weight"] = np.ones((63,), np.float32)
    save_safetensors(str(d / "model.safetensors"), t)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' "
                                              r"has shape \(63,\); expected shape \(64,\)"):
        load_decoder(str(d))


def test_unsupported_architecture(tiny_targets, tmp_path):
    d = _copy(tiny_targets("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architectures entry.*MixtralForCausalLM"):
        load_decoder(str(d))


def test_pickle_only_checkpoint_is_refused_not_loaded(tiny_targets, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(os.path.join(tiny_targets("llama"), "config.json"), d)
    # A file that would run code if unpickled: it must never be opened as a pickle.
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'exit 1'\ntR.")
    with pytest.raises(CheckpointError, match="only pickle checkpoints.*pytorch_model.bin"):
        load_decoder(str(d))


def test_missing_shard_named(tiny_targets, tmp_path):
    d = tmp_path / "s"
    save_sharded(str(d), _tensors(tiny_targets("llama")), max_shard_bytes=100_000)
    shutil.copy(os.path.join(tiny_targets("llama"), "config.json"), d)
    os.remove(d / "model-00002-of-{:05d}.safetensors".format(
        len([f for f in os.listdir(d) if f.endswith(".safetensors")])))
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-\d+\.safetensors .*missing"):
        load_decoder(str(d))


def test_corrupt_header(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!}    ")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        CheckpointReader(str(tmp_path))


def _random_tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal((64, 33)).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((7,)).astype(np.float32),
        "c": rng.integers(-5, 5, (3, 4, 5)).astype(np.int64),
        "d": rng.standard_normal((300, 16)).astype(np.float16),
        "e": (rng.standard_normal((9, 8)) * 4).astype(ml_dtypes.float8_e4m3fn),
    }


def test_prefetching_reads_each_tensor_once_ahead_within_its_budget(tmp_path, monkeypatch):
    """``prefetching`` reads the named tensors into the page cache on threads, in order,
    within a byte budget smaller than one tensor (no deadlock: one read is always in
    flight), each once; ``get`` gives the checkpoint's arrays whatever order it asks in,
    also for names absent from the order."""
    import threading

    from eagle_jax import checkpoint

    tensors = _random_tensors(0)
    save_sharded(str(tmp_path), tensors, max_shard_bytes=4000)
    warmed, lock = [], threading.Lock()
    warm = checkpoint.SafetensorsFile.warm

    def recording_warm(self, name):
        warm(self, name)
        with lock:
            warmed.append(name)

    monkeypatch.setattr(checkpoint.SafetensorsFile, "warm", recording_warm)
    r = CheckpointReader(str(tmp_path))
    with r.prefetching(["d", "a", "b", "absent", "c"], max_bytes=1500, workers=2):
        got = {name: np.array(r.get(name)) for name in ("d", "e", "a", "c", "b")}
    assert sorted(warmed) == ["a", "b", "c", "d"]
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name].view(np.uint8), want.view(np.uint8))


def test_a_truncated_tensor_is_named_by_both_ways_of_reading(tmp_path):
    save_safetensors(str(tmp_path / "model.safetensors"), _random_tensors(1))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])  # "e", the last tensor, loses its end
    r = CheckpointReader(str(tmp_path))
    np.testing.assert_array_equal(r.get("b"), _random_tensors(1)["b"])
    truncated = r"model\.safetensors: tensor 'e' spans bytes \d+\.\.\d+ but the file ends at"
    with pytest.raises(CheckpointError, match=truncated):
        r.get("e")
    with pytest.raises(CheckpointError, match=truncated):
        with r.prefetching(["b", "e"]):
            r.get("b")
            r.get("e")
