"""scripts/convert_checkpoint.py: pickle checkpoints (``torch.save``) to safetensors with
the same tensors, read without running the file's code; what it refuses, by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from eagle_jax.checkpoint import CheckpointError, CheckpointReader
from eagle_jax.models.decoder import load_decoder
from eagle_jax.models.draft_checkpoint import load_draft
from eagle_jax.testutil.drafts import write_tiny_eagle3_draft


@pytest.fixture(scope="module")
def convert():
    from eagle_jax import convert_checkpoint

    return convert_checkpoint


def _tensors(path):
    r = CheckpointReader(str(path))
    return {n: np.array(r.get(n)) for n in r.keys()}


def _torch_dict(tensors):
    return {k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}


def _same(a: np.ndarray, b: np.ndarray, name=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8),
                                  err_msg=name)  # bitwise, whatever the dtype


def test_published_eagle3_draft_from_pytorch_model_bin(tmp_path, tiny_targets, convert):
    """The published EAGLE-3 draft ships config.json + pytorch_model.bin: the engine
    refuses it and names the converter; converted (into OUT, then in place) it loads."""
    target_dir = tiny_targets("llama")
    target = load_decoder(target_dir)
    src = write_tiny_eagle3_draft(str(tmp_path / "src"), target_dir, draft_vocab_size=100)
    original = _tensors(src)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(os.path.join(src, "config.json"), pickled)
    torch.save(_torch_dict(original), pickled / "pytorch_model.bin")
    torch.save({"lr": 1e-4}, pickled / "training_args.bin")  # a pickle that is not copied
    with pytest.raises(CheckpointError, match=r"pickles are never loaded: convert them to "
                                              r"safetensors with 'python scripts/convert_"
                                              r"checkpoint.py .*pickled'"):
        load_draft(str(pickled), target)

    out = tmp_path / "out"
    assert convert.main([str(pickled), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    converted = _tensors(out)
    assert set(converted) == set(original)
    for name, arr in original.items():
        _same(converted[name], arr, name)
    draft = load_draft(str(out), target)
    assert draft.draft_vocab_size == 100

    assert convert.main([str(pickled)]) == 0  # in place: beside the pickle, which stays
    assert os.path.exists(pickled / "model.safetensors") and os.path.exists(
        pickled / "pytorch_model.bin")
    assert load_draft(str(pickled), target).draft_vocab_size == 100


def test_dtypes_views_and_parameters(tmp_path, convert):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5, 2).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(-3, 5),
        "i32": torch.tensor([1, -2], dtype=torch.int32),
        "i8": torch.tensor([-5, 7], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "param": torch.nn.Parameter(torch.randn(3)),
        "transposed": base.t(),  # strides (1, 6)
        "offset_slice": base.view(-1)[5:11],  # storage offset 5
        "column": base[:, 2],  # stride 6 at offset 2
        "tied_a": base, "tied_b": base,  # one storage, two names
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    torch.save(state, tmp_path / "model.pt")
    got = convert.read_torch_pickle(str(tmp_path / "model.pt"))
    assert list(got) == list(state)
    for name, t in state.items():
        t = t.detach().contiguous()
        want = (t.view(torch.int16).numpy().view(got["bf16"].dtype) if t.dtype == torch.bfloat16
                else t.numpy())
        _same(got[name], want, name)
    out = tmp_path / "out"
    convert.convert_checkpoint(str(tmp_path / "model.pt"), str(out))
    for name, arr in _tensors(out).items():
        _same(arr, got[name], name)


def test_sharded_checkpoint_with_index(tmp_path, tiny_targets, convert):
    """HF's sharded pickles (pytorch_model-0000i-of-00002.bin + index) become one
    safetensors shard each plus model.safetensors.index.json; the target loads the same."""
    target_dir = tiny_targets("llama")
    original = _tensors(target_dir)
    names = list(original)
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(target_dir, "config.json"), src)
    weight_map = {}
    for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        shard = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save(_torch_dict({n: original[n] for n in part}), src / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    out = tmp_path / "out"
    written = convert.convert_checkpoint(str(src), str(out))
    assert written == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json", "config.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: s.replace("pytorch_model", "model").replace(
        ".bin", ".safetensors") for n, s in weight_map.items()}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in original.values())
    converted = _tensors(out)
    for name, arr in original.items():
        _same(converted[name], arr, name)
    a, b = load_decoder(target_dir), load_decoder(str(out))
    np.testing.assert_array_equal(np.asarray(a.layers[1].mlp.down_proj.weight[...]),
                                  np.asarray(b.layers[1].mlp.down_proj.weight[...]))

    # an index that disagrees with its shards
    bad = dict(weight_map, **{names[0]: "pytorch_model-00002-of-00002.bin"})
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(CheckpointError, match=rf"lists '{names[0]}' in pytorch_model-00002-of-"
                                              r"00002.bin, which lacks it"):
        convert.convert_checkpoint(str(src), str(tmp_path / "bad"))
    unlisted = {n: s for n, s in weight_map.items() if n != names[0]}  # shard 1 holds it
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": unlisted}))
    with pytest.raises(CheckpointError, match=rf"pytorch_model-00001-of-00002.bin: holds "
                                              rf"'{names[0]}', which pytorch_model.bin.index"
                                              r".json does not list"):
        convert.convert_checkpoint(str(src), str(tmp_path / "bad2"))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {names[0]: "pytorch_model-00009-of-00009.bin"}}))
    with pytest.raises(CheckpointError, match=r"shard pytorch_model-00009-of-00009.bin .* is "
                                              r"missing"):
        convert.convert_checkpoint(str(src), str(tmp_path / "bad3"))


class _RunsCode:
    """What a malicious pickle carries: unpickling it would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_in_the_pickle_is_refused_not_run(tmp_path, convert):
    marker = tmp_path / "ran"
    torch.save({"w": torch.zeros(2), "payload": _RunsCode(marker)}, tmp_path / "evil.bin")
    with pytest.raises(CheckpointError, match=r"evil.bin: refused pickle global "
                                              r"(posix|os|nt)\.system: only tensors are read"):
        convert.read_torch_pickle(str(tmp_path / "evil.bin"))
    assert not marker.exists()


@pytest.mark.parametrize("obj, message", [
    ({"model": {"w": torch.zeros(2)}, "step": 3}, r"'model' holds a dict, not a tensor: only a "
                                                  r"flat name -> tensor state dict converts"),
    ({"w": torch.zeros(2), "step": 3}, r"'step' holds a int, not a tensor"),
    ([torch.zeros(2)], r"holds a list, not a name -> tensor mapping"),
    ({"c": torch.zeros(2, dtype=torch.complex64)}, r"refused torch.ComplexFloatStorage: its "
                                                   r"dtype has no safetensors form"),
])
def test_non_tensor_content_is_refused(tmp_path, convert, obj, message):
    torch.save(obj, tmp_path / "x.bin")
    with pytest.raises(CheckpointError, match=message):
        convert.read_torch_pickle(str(tmp_path / "x.bin"))


def test_legacy_format_and_existing_output_are_refused(tmp_path, convert, capsys):
    torch.save({"w": torch.zeros(2)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="not a torch.save zip archive .*pre-1.6"):
        convert.read_torch_pickle(str(tmp_path / "old.bin"))
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    (src / "model.safetensors").write_bytes(b"")
    assert convert.main([str(src)]) == 1
    err = capsys.readouterr().err
    assert "already holds model.safetensors: remove them" in err
