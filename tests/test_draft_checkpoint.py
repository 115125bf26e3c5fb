"""Draft checkpoints: the published EAGLE-1 / EAGLE-3 layouts, round trips, detection,
and errors that name the file and the value."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.checkpoint import CheckpointError, CheckpointReader, save_safetensors
from eagle_jax.models import draft_ops
from eagle_jax.models.decoder import load_decoder
from eagle_jax.models.draft import Eagle1Draft, Eagle3Draft
from eagle_jax.models.draft_checkpoint import load_draft, save_draft
from eagle_jax.testutil.drafts import write_tiny_eagle1_draft, write_tiny_eagle3_draft
from eagle_jax.testutil.models import write_tiny_target

EAGLE3_NAMES = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
}
EAGLE1_NAMES = {
    "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight", "embed_tokens.weight",
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_target(str(tmp_path_factory.mktemp("ckpt") / "target"),
                             max_position_embeddings=512)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_decoder(target_dir)


def _tensors(path):
    r = CheckpointReader(path)
    return {n: np.array(r.get(n)) for n in r.keys()}


def _cfg(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _write_cfg(path, cfg):
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _prefill_logits(draft, target):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 5)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    out = target(tokens, pos, target.init_cache(2, 16), aux_layers=draft.feature_layers or ())
    feats = out.aux_hidden if draft.kind == "EAGLE3" else out.hidden
    res = draft_ops.draft_extend(draft, tokens, jnp.asarray([1, 2]), jnp.asarray([5, 3]),
                                 feats, pos, draft.init_cache(2, 16))
    return np.asarray(res.logits)


def test_published_eagle3_layout_loads(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, draft_vocab_size=100)
    t = _tensors(d)
    assert set(t) == EAGLE3_NAMES
    assert t["d2t"].dtype == np.int64 and t["t2d"].dtype == np.bool_ and t["t2d"].shape == (256,)
    assert t["fc.weight"].shape == (64, 192) and t["lm_head.weight"].shape == (100, 64)
    draft = load_draft(d, target)
    assert isinstance(draft, Eagle3Draft) and draft.draft_vocab_size == 100
    np.testing.assert_array_equal(draft.d2t, t["d2t"])
    ids = np.arange(100) + np.asarray(draft.d2t)
    assert t["t2d"][ids].all() and t["t2d"].sum() == 100
    assert draft.embed_weight is target.embed_tokens.weight.get_value()  # shared, no copy


def test_published_eagle1_layout_loads(tmp_path, target_dir, target):
    d = write_tiny_eagle1_draft(str(tmp_path / "e1"), target_dir)
    assert set(_tensors(d)) == EAGLE1_NAMES
    assert _cfg(d)["architectures"] == ["LlamaForCausalLM"]  # as the originals say
    draft = load_draft(d, target)
    assert isinstance(draft, Eagle1Draft)
    assert draft.lm_head_weight() is target.lm_head.weight.get_value()


@pytest.mark.parametrize("kind", ["EAGLE3", "EAGLE"])
def test_save_load_round_trip(tmp_path, target_dir, target, kind):
    if kind == "EAGLE3":
        src = write_tiny_eagle3_draft(str(tmp_path / "src"), target_dir, draft_vocab_size=100,
                                      aux_layer_ids=[0, 1, 2], max_position_embeddings=64)
    else:
        src = write_tiny_eagle1_draft(str(tmp_path / "src"), target_dir, with_embed=False)
    draft = load_draft(src, target)
    out = str(tmp_path / "out")
    save_draft(draft, out)
    assert set(_tensors(out)) == set(_tensors(src))
    for name, arr in _tensors(src).items():
        np.testing.assert_array_equal(_tensors(out)[name], arr, err_msg=name)
    again = load_draft(out, target)
    assert type(again) is type(draft)
    np.testing.assert_allclose(_prefill_logits(again, target), _prefill_logits(draft, target))
    cfg = _cfg(out)
    if kind == "EAGLE3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["draft_vocab_size"] == 100 and cfg["target_hidden_size"] == 64
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert again.feature_layers == (1, 2, 3) and again.max_positions == 64
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
        assert again.embed_tokens is None


def test_bf16_save_and_load(tmp_path, target_dir, target):
    src = write_tiny_eagle3_draft(str(tmp_path / "src"), target_dir, draft_vocab_size=100)
    draft = load_draft(src, target, dtype="bfloat16")
    assert draft.fc.weight.dtype == jnp.bfloat16
    save_draft(draft, str(tmp_path / "bf16"), dtype="bfloat16")
    r = CheckpointReader(str(tmp_path / "bf16"))
    assert r._files["model.safetensors"].header["fc.weight"]["dtype"] == "BF16"
    assert r._files["model.safetensors"].header["d2t"]["dtype"] == "I64"
    assert load_draft(str(tmp_path / "bf16"), target).fc.weight.dtype == jnp.float32


def test_full_vocab_draft_without_lm_head_shares_target_head(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, with_lm_head=False)
    draft = load_draft(d, target)
    assert draft.lm_head is None and draft.d2t is None
    assert draft.lm_head_weight() is target.lm_head.weight.get_value()
    save_draft(draft, str(tmp_path / "saved"))  # published layout: lm_head written out
    assert "lm_head.weight" in _tensors(str(tmp_path / "saved"))


def test_own_embedding_is_used(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, with_embed=True)
    draft = load_draft(d, target)
    assert draft.embed_tokens is not None
    assert draft.embed_weight is not target.embed_tokens.weight.get_value()
    np.testing.assert_array_equal(draft.embed_weight, target.embed_tokens.weight[...])


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "SomethingElse"])
def test_kind_detected_from_tensors(tmp_path, target_dir, target, arch):
    e3 = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, architecture=arch)
    assert isinstance(load_draft(e3, target), Eagle3Draft)
    e1 = write_tiny_eagle1_draft(str(tmp_path / "e1"), target_dir, architecture=arch)
    assert isinstance(load_draft(e1, target), Eagle1Draft)


def test_model_prefix_accepted(tmp_path, target_dir, target):
    src = write_tiny_eagle1_draft(str(tmp_path / "src"), target_dir)
    dst = tmp_path / "prefixed"
    dst.mkdir()
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    save_safetensors(str(dst / "model.safetensors"),
                     {f"model.{k}": v for k, v in _tensors(src).items()})
    np.testing.assert_allclose(_prefill_logits(load_draft(str(dst), target), target),
                               _prefill_logits(load_draft(src, target), target))


def test_not_a_draft_is_an_error(tmp_path, target_dir, target):
    with pytest.raises(CheckpointError, match="not an EAGLE draft"):
        load_draft(target_dir, target)


def test_target_hidden_size_mismatch(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir)
    cfg = _cfg(d)
    cfg["target_hidden_size"] = 128
    _write_cfg(d, cfg)
    with pytest.raises(ValueError, match=r"config.json: target_hidden_size 128 .* hidden_size 64"):
        load_draft(d, target)


def test_eagle1_hidden_size_mismatch(tmp_path, target_dir, target):
    d = write_tiny_eagle1_draft(str(tmp_path / "e1"), target_dir)
    cfg = _cfg(d)
    cfg["hidden_size"] = 32
    _write_cfg(d, cfg)
    with pytest.raises(ValueError, match=r"config.json: EAGLE-1 draft hidden_size 32"):
        load_draft(d, target)


def test_vocab_mismatch(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir)
    cfg = _cfg(d)
    cfg["vocab_size"] = 300
    _write_cfg(d, cfg)
    with pytest.raises(ValueError, match=r"config.json: vocab_size 300 != .* 256"):
        load_draft(d, target)


def test_aux_layer_ids_out_of_range(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, aux_layer_ids=[0, 1, 3])
    with pytest.raises(ValueError, match=r"config.json: .*eagle_aux_hidden_state_layer_ids "
                                         r"\[0, 1, 3\] out of range.*4 layers"):
        load_draft(d, target)


def test_d2t_outside_target_vocab(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, draft_vocab_size=100)
    t = _tensors(d)
    t["d2t"][-1] = 500
    save_safetensors(os.path.join(d, "model.safetensors"), t)
    with pytest.raises(CheckpointError, match=r"model.safetensors: d2t maps draft id 99 to "
                                              r"target id 599, outside .*\[0, 256\)"):
        load_draft(d, target)


def test_t2d_disagreeing_with_d2t(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, draft_vocab_size=100)
    t = _tensors(d)
    t["t2d"][:] = False
    save_safetensors(os.path.join(d, "model.safetensors"), t)
    with pytest.raises(CheckpointError, match="t2d .* disagrees with d2t"):
        load_draft(d, target)


def test_reduced_vocab_without_d2t(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, draft_vocab_size=100)
    t = _tensors(d)
    del t["d2t"], t["t2d"]
    save_safetensors(os.path.join(d, "model.safetensors"), t)
    with pytest.raises(CheckpointError, match="no 'd2t'"):
        load_draft(d, target)


def test_wrong_tensor_shape_names_file_tensor_shape(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir)
    t = _tensors(d)
    t["fc.weight"] = t["fc.weight"][:, :128]
    save_safetensors(os.path.join(d, "model.safetensors"), t)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'fc.weight' has shape "
                                              r"\(64, 128\); expected shape \(64, 192\)"):
        load_draft(d, target)


def test_missing_tensor(tmp_path, target_dir, target):
    d = write_tiny_eagle1_draft(str(tmp_path / "e1"), target_dir)
    t = _tensors(d)
    del t["layers.0.mlp.up_proj.weight"]
    save_safetensors(os.path.join(d, "model.safetensors"), t)
    with pytest.raises(CheckpointError, match="lacks tensor 'layers.0.mlp.up_proj.weight'"):
        load_draft(d, target)


# ------------------------------------------------------------- the speculators layout

SPECULATORS_NAMES = {n.replace("midlayer.", "layers.0.") for n in EAGLE3_NAMES}


def test_speculators_layout_equals_sglang_layout(tmp_path, target_dir, target):
    """One set of weights in both layouts gives equal draft outputs on the same target
    features. The aux layer ids differ by one: sglang's [0, 1, 2] name layer OUTPUTS,
    speculators' / vLLM's [1, 2, 3] the INPUTS of the same layers."""
    sg = write_tiny_eagle3_draft(str(tmp_path / "sg"), target_dir, draft_vocab_size=100,
                                 aux_layer_ids=[0, 1, 2], with_embed=True)
    sp = write_tiny_eagle3_draft(str(tmp_path / "sp"), target_dir, draft_vocab_size=100,
                                 aux_layer_ids=[1, 2, 3], with_embed=True,
                                 checkpoint_format="speculators")
    assert set(_tensors(sp)) == SPECULATORS_NAMES | {"embed_tokens.weight"}
    cfg = _cfg(sp)
    assert cfg["speculators_model_type"] == "eagle3" and "transformer_layer_config" in cfg
    a, b = load_draft(sg, target), load_draft(sp, target)
    assert (a.config.checkpoint_format, b.config.checkpoint_format) == ("sglang", "speculators")
    assert a.feature_layers == b.feature_layers == (1, 2, 3)
    assert b.config.verifier == "tiny-target" and b.config.norm_before_residual is False
    np.testing.assert_array_equal(_prefill_logits(a, target), _prefill_logits(b, target))
    # read in sglang's convention instead, the same ids are the layers one earlier
    cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    _write_cfg(sp, cfg)
    shifted = load_draft(sp, target)
    assert shifted.feature_layers == (0, 1, 2)
    assert not np.allclose(_prefill_logits(shifted, target), _prefill_logits(a, target))


def test_speculators_defaults(tmp_path, target_dir, target):
    """Absent ids: vLLM's default layers (2, L//2, L-3), sglang's default too; the whole
    vocabulary without d2t/t2d; the published drafts' older config style (rope_theta and
    llama3 rope_scaling, ``Eagle3Speculator``, no norm_before_residual: True, as vLLM)."""
    sg = write_tiny_eagle3_draft(str(tmp_path / "sg"), target_dir)
    sp = write_tiny_eagle3_draft(str(tmp_path / "sp"), target_dir,
                                 checkpoint_format="speculators")
    assert "d2t" not in _tensors(sp) and "t2d" not in _tensors(sp)
    a, b = load_draft(sg, target), load_draft(sp, target)
    assert a.feature_layers == b.feature_layers == target.config.eagle3_aux_layers == (2, 2, 1)
    assert b.d2t is None and b.lm_head is not None
    np.testing.assert_array_equal(_prefill_logits(a, target), _prefill_logits(b, target))
    cfg = _cfg(sp)
    layer = cfg["transformer_layer_config"]
    del layer["rope_parameters"], cfg["norm_before_residual"]
    layer.update(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    cfg["architectures"] = ["Eagle3Speculator"]
    _write_cfg(sp, cfg)
    c = load_draft(sp, target).config
    assert c.norm_before_residual is True and c.rope_theta == 500000.0
    assert c.rope_scaling.factor == 8.0 and c.architecture == "Eagle3Speculator"


def test_speculators_save_round_trip(tmp_path, target_dir, target):
    src = write_tiny_eagle3_draft(str(tmp_path / "src"), target_dir, draft_vocab_size=100,
                                  aux_layer_ids=[0, 1, 2], max_position_embeddings=64)
    draft = load_draft(src, target)
    out = str(tmp_path / "sp")
    save_draft(draft, out, checkpoint_format="speculators", verifier="meta-llama/tiny")
    assert set(_tensors(out)) == SPECULATORS_NAMES
    cfg = _cfg(out)
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's: layer inputs
    assert cfg["draft_vocab_size"] == 100 and cfg["target_hidden_size"] == 64
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["speculators_config"]["verifier"] == dict(name_or_path="meta-llama/tiny",
                                                         architectures=["LlamaForCausalLM"])
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["max_position_embeddings"] == 64 and layer["vocab_size"] == 256
    again = load_draft(out, target)
    assert again.config.checkpoint_format == "speculators" and again.feature_layers == (1, 2, 3)
    np.testing.assert_array_equal(_prefill_logits(again, target), _prefill_logits(draft, target))
    save_draft(again, str(tmp_path / "sp2"))  # its own layout by default
    assert _cfg(str(tmp_path / "sp2")) == cfg
    save_draft(again, str(tmp_path / "sg"), checkpoint_format="sglang")
    back = _tensors(str(tmp_path / "sg"))
    assert set(back) == set(_tensors(src))
    for name, arr in _tensors(src).items():
        np.testing.assert_array_equal(back[name], arr, err_msg=name)
    assert _cfg(str(tmp_path / "sg"))["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        0, 1, 2]


def test_speculators_full_vocab_borrowed_head_is_written(tmp_path, target_dir, target):
    d = write_tiny_eagle3_draft(str(tmp_path / "e3"), target_dir, with_lm_head=False)
    draft = load_draft(d, target)
    save_draft(draft, str(tmp_path / "sp"), checkpoint_format="speculators")
    t = _tensors(str(tmp_path / "sp"))
    assert "d2t" not in t and "t2d" not in t
    np.testing.assert_array_equal(t["lm_head.weight"], target.lm_head.weight[...])
    with pytest.raises(ValueError, match="always carries lm_head.weight"):
        save_draft(draft, str(tmp_path / "no_head"), checkpoint_format="speculators",
                   write_target_head=False)


@pytest.mark.parametrize("change, message", [
    (dict(norm_before_fc=True), r"norm_before_fc is true .*does not implement it"),
    (dict(norm_output=True), r"norm_output is true"),
    (dict(speculators_model_type="eagle"), r"speculators_model_type 'eagle': eagle_jax reads "
                                           r"speculators' 'eagle3' drafts only"),
    (dict(transformer_layer_config=dict(model_type="qwen3")),
     r"transformer_layer_config.model_type 'qwen3'"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 2, 4]),
     r"config.json: eagle_aux_hidden_state_layer_ids \[1, 2, 4\] out of range: the target has "
     r"4 layers \(valid ids 0..3, id i is the input of layer i"),
])
def test_speculators_config_errors(tmp_path, target_dir, target, change, message):
    d = write_tiny_eagle3_draft(str(tmp_path / "sp"), target_dir,
                                checkpoint_format="speculators")
    cfg = _cfg(d)
    for key, value in change.items():
        cfg[key] = dict(cfg[key], **value) if isinstance(value, dict) else value
    _write_cfg(d, cfg)
    with pytest.raises(ValueError, match=message):
        load_draft(d, target)


def test_speculators_layout_refuses_eagle1(tmp_path, target_dir, target):
    draft = load_draft(write_tiny_eagle1_draft(str(tmp_path / "e1"), target_dir), target)
    with pytest.raises(ValueError, match="speculators layout is written for EAGLE-3 drafts only"):
        save_draft(draft, str(tmp_path / "out"), checkpoint_format="speculators")
    assert not os.path.exists(tmp_path / "out")  # refused before anything is written


def test_train_draft_saves_the_speculators_layout(tmp_path, target_dir, target, capsys):
    """``scripts/train_draft.py --format speculators``: a few steps, then the draft loads
    from the speculators layout, naming its target as the verifier."""
    from eagle_jax.train import draft_cli as script

    corpus = tmp_path / "corpus.jsonl"
    rows = np.random.default_rng(0).integers(0, 256, (12, 17))
    corpus.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
    args = ["--target", target_dir, "--corpus", str(corpus), "--out", str(tmp_path / "run"),
            "--algorithm", "EAGLE3", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--draft-vocab-size", "100", "--ttt-steps", "1", "--eval-every", "0",
            "--save-every", "0", "--collect-batch-size", "6", "--no-progress",
            "--aux-layer-ids", "0", "1", "2", "--format", "speculators"]
    with pytest.raises(ValueError, match="checkpoint_format='speculators' is for EAGLE3 drafts "
                                         "with their own LM head"):
        script.main(args + ["--lm-head", "target"])
    assert script.main(args) == 0
    out = str(tmp_path / "run" / "draft")
    cfg = _cfg(out)
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # the same layers, vLLM's ids
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == target_dir
    assert set(_tensors(out)) == SPECULATORS_NAMES
    draft = load_draft(out, target)
    assert draft.config.checkpoint_format == "speculators" and draft.feature_layers == (1, 2, 3)
