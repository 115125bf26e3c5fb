"""FP8 weights (issue 63): the FP8 linear layers, the e4m3fn -> e4m3fnuz conversion, the
checkpoint layouts (compressed-tensors, FBGEMM, on the fly) and their errors, and FP8
targets in the engine.

Tolerances come from e4m3's 3 mantissa bits: rounding to nearest leaves a normal value
within a relative 2**-4 (U below) of itself, and a value in the subnormal range within
half the smallest subnormal, times its scale. The layer's error against the dequantized
weights is then the activation's rounding carried through the dot product (the bound of
``_activation_bound``); the weights' own rounding is checked element by element.
"""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from eagle_jax.checkpoint import CheckpointError, CheckpointReader, save_sharded
from eagle_jax.config import ModelConfig
from eagle_jax.fp8 import (
    Fp8Spec, dequantize, fn_to_fnuz, fnuz_to_fn, fp8_dtype, fp8_linear, quantize_activation,
    quantize_weight)
from eagle_jax.models.decoder import Decoder, load_decoder, save_decoder
from eagle_jax.models.layers import FusedLinear, Linear
from eagle_jax.testutil.models import tiny_config

U = 2.0 ** -4  # e4m3: 3 mantissa bits, round to nearest
FN, FNUZ = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e4m3fnuz)


def _half_subnormal(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal) / 2


def _activation_bound(x, w_deq, dtype, input_scale=None):
    """|fp8_linear(x) - x @ w_deq.T| <= sum_i |xq_i s - x_i| |w_i|, with each activation
    within U |x_i| + (half a subnormal) s of itself (s its token's scale, or the static
    one; a static scale also saturates at the format's max, which the inputs here stay
    inside), plus float32 accumulation."""
    x = np.asarray(x, np.float64)
    top = float(ml_dtypes.finfo(dtype).max)
    s = (np.abs(x).max(-1, keepdims=True) / top if input_scale is None
         else np.full(x.shape[:-1] + (1,), input_scale))
    absw = np.abs(np.asarray(w_deq, np.float64))
    bound = U * np.abs(x) @ absw.T + _half_subnormal(dtype) * s * absw.sum(-1)
    return bound + 1e-5 * (np.abs(x) @ absw.T) + 1e-6


def _fp8_linear_module(w, dtype, static_scale=None, bias=None, seed=0):
    """A Linear of FP8 weight ``w`` [out, in] quantized per row (to fn, then ``dtype``)."""
    quant = Fp8Spec(dtype=dtype.name, activation="dynamic" if static_scale is None else "static")
    layer = Linear(w.shape[1], w.shape[0], bias=bias is not None, quant=quant,
                   rngs=nnx.Rngs(seed))
    q, scale = quantize_weight(w)
    if dtype == FNUZ:
        q, scale = fn_to_fnuz(q, scale)
    layer.weight.set_value(jnp.asarray(q))
    layer.weight_scale.set_value(jnp.asarray(scale))
    if static_scale is not None:
        layer.input_scale.set_value(jnp.full((1,), static_scale, jnp.float32))
    if bias is not None:
        layer.bias.set_value(jnp.asarray(bias))
    return layer, dequantize(q, scale)


@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_weight_quantization_rounds_each_element_within_e4m3(dtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 80)).astype(np.float32) * rng.uniform(0.01, 3, (48, 1))
    q, scale = quantize_weight(w)
    np.testing.assert_allclose(scale, np.abs(w).max(-1) / 448, rtol=1e-6)
    if dtype == FNUZ:
        q, scale = fn_to_fnuz(q, scale)
    assert q.dtype == dtype
    err = np.abs(dequantize(q, scale) - w)
    assert np.all(err <= U * np.abs(w) + _half_subnormal(FN) * scale[:, None] + 1e-12)
    assert err.max() > 0  # it did round


@pytest.mark.parametrize("dtype", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_linear_matches_the_dequantized_reference(dtype):
    """Dynamic per-token activations, a bias, a batch of [2, 5] tokens."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 96)).astype(np.float32) * rng.uniform(0.05, 2, (40, 1))
    bias = rng.standard_normal(40).astype(np.float32)
    x = (rng.standard_normal((2, 5, 96)) * rng.uniform(0.1, 10, (2, 5, 1))).astype(np.float32)
    layer, w_deq = _fp8_linear_module(w, dtype, bias=bias)
    y = np.asarray(jax.jit(lambda m, x: m(x))(layer, jnp.asarray(x)))
    ref = x.astype(np.float64) @ w_deq.T.astype(np.float64) + bias
    err = np.abs(y - ref)
    assert np.all(err <= _activation_bound(x, w_deq, dtype)), err.max()
    assert err.max() > 1e-4  # the activations were quantized
    assert y.dtype == np.float32


def test_fp8_linear_static_input_scale():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    static = float(np.abs(x).max() / 300)  # inside 448: nothing saturates
    layer, w_deq = _fp8_linear_module(w, FN, static_scale=static)
    y = np.asarray(layer(jnp.asarray(x)))
    err = np.abs(y - x.astype(np.float64) @ w_deq.T)
    assert np.all(err <= _activation_bound(x, w_deq, FN, static))
    # The static scale is used: one 100x too small saturates every large activation.
    layer.input_scale.set_value(jnp.full((1,), static / 100, jnp.float32))
    assert np.abs(np.asarray(layer(jnp.asarray(x))) - y).max() > 10 * err.max()


def test_fused_fp8_linear_keeps_its_parts_and_shard_layout():
    """q / k / v as one FP8 GEMM laid out for 2 shards: each part's output equals its own
    FP8 Linear's (the same per-row scales, the same per-token activation scale)."""
    rng = np.random.default_rng(4)
    parts = (("q_proj", 32), ("k_proj", 16), ("v_proj", 16))
    ws = [rng.standard_normal((n, 48)).astype(np.float32) for _, n in parts]
    spec = Fp8Spec()
    fused = FusedLinear(48, parts, shards=2, quant=spec, rngs=nnx.Rngs(0))
    q, scale = quantize_weight(np.concatenate(ws))
    from eagle_jax.checkpoint import fused_row_order
    order = fused_row_order((32, 16, 16), 2)
    fused.weight.set_value(jnp.asarray(q[order]))
    fused.weight_scale.set_value(jnp.asarray(scale[order]))
    x = jnp.asarray(rng.standard_normal((3, 48)).astype(np.float32))
    outs = fused(x)
    for (_, n), w, out in zip(parts, ws, outs):
        single, _ = _fp8_linear_module(w, FN)
        np.testing.assert_allclose(np.asarray(out), np.asarray(single(x)), rtol=1e-6, atol=1e-6)


def test_fnuz_conversion_keeps_every_value():
    """Every e4m3fn bit pattern: its fnuz counterpart times the doubled scale is the same
    number; -0 becomes +0 and NaN stays NaN; converting back restores the bits."""
    fn = np.arange(256, dtype=np.uint8).view(FN)
    scale = np.full(256, 0.37, np.float32)
    fnuz, fnuz_scale = fn_to_fnuz(fn, scale)
    assert fnuz.dtype == FNUZ
    a = fn.astype(np.float64) * scale
    b = fnuz.astype(np.float64) * fnuz_scale
    finite = np.isfinite(a)
    np.testing.assert_array_equal(a[finite], b[finite])
    assert np.all(np.isnan(b[~finite])) and (~finite).sum() == 2
    assert fnuz.view(np.uint8)[0x80] == 0  # fn's -0: fnuz has no -0 (its 0x80 is NaN)
    back, back_scale = fnuz_to_fn(fnuz, fnuz_scale)
    keep = finite & (np.arange(256) != 0x80)
    np.testing.assert_array_equal(back.view(np.uint8)[keep], fn.view(np.uint8)[keep])
    np.testing.assert_array_equal(back_scale, scale)


@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_activation_quantization_rounds_like_ml_dtypes(dtype):
    """Jitted, every row's values / scale become the format's nearest value, as
    ml_dtypes rounds them, including values far below the smallest subnormal of both
    signs (a negative that rounds to zero is +0 in fnuz, whose 0x80 is NaN: XLA's CPU
    loop emitters, the suite's, write 0x80)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[:, :16] *= 1e-6  # under half the smallest subnormal once scaled
    x[:, 0] = -0.0
    x[0, 1] = -3e-7
    xq, scale = jax.jit(quantize_activation, static_argnums=1)(jnp.asarray(x), dtype)
    assert xq.dtype == dtype
    scaled = np.clip(x / np.asarray(scale), -float(ml_dtypes.finfo(dtype).max),
                     float(ml_dtypes.finfo(dtype).max))
    expected = scaled.astype(dtype)
    np.testing.assert_array_equal(np.asarray(xq).astype(np.float32), expected.astype(np.float32))
    assert not np.isnan(np.asarray(xq).astype(np.float32)).any()


def test_fp8_dtype_follows_the_device():
    dev = lambda cc, kind: types.SimpleNamespace(compute_capability=cc, device_kind=kind)
    assert fp8_dtype(dev("gfx942:sramecc+:xnack-", "AMD Instinct MI300X")) == "float8_e4m3fnuz"
    assert fp8_dtype(dev("", "AMD Instinct MI325X")) == "float8_e4m3fnuz"
    assert fp8_dtype(dev("gfx950", "AMD Instinct MI355X")) == "float8_e4m3fn"
    assert fp8_dtype(dev("9.0", "NVIDIA H100 80GB HBM3")) == "float8_e4m3fn"
    assert fp8_dtype(jax.devices("cpu")[0]) == "float8_e4m3fn"


# ----------------------------------------------------------------- checkpoint layouts
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF = tiny_config("llama", vocab_size=256, hidden_size=64, num_layers=2, intermediate_size=128)


def _ct_config(preset: str) -> dict:
    """compressed-tensors' own quantization_config of a preset scheme ("FP8_DYNAMIC":
    channel weights, dynamic per-token activations; "FP8": tensor weights, static
    activations), as its releases write it."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset,
                                                                            ["Linear"])},
                                ignore=["lm_head"], format="float-quantized",
                                quantization_status="compressed")
    return json.loads(json.dumps(config.model_dump()))


FBGEMM_CONFIG = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                 "modules_to_not_convert": ["lm_head"]}


def _quantize_by_hand(w: np.ndarray, per_channel: bool):
    """The checkpoints' own recipe (absolute maximum to 448), written here apart from
    ``eagle_jax.fp8`` so that the layouts do not depend on the code they test."""
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1)
    scale = (amax / 448.0).astype(np.float32)
    return (w / (scale if per_channel else scale[0])).astype(FN), scale


def _write_fp8(src: str, out: str, qconfig: dict, *, per_channel=True, static=False,
               edit=None) -> str:
    """The float checkpoint ``src`` as an FP8 one: every projection's ``weight`` F8_E4M3
    and ``weight_scale`` ([out, 1] per channel, [1] per tensor), ``input_scale`` [1] when
    static; ``edit(tensors)`` then breaks it (error tests)."""
    reader = CheckpointReader(src)
    tensors = {}
    for name in reader.keys():
        w = np.asarray(reader.get(name))
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            tensors[name], tensors[module + ".weight_scale"] = _quantize_by_hand(w, per_channel)
            if static:
                tensors[module + ".input_scale"] = np.array([0.02], np.float32)
        else:
            tensors[name] = w
    if edit is not None:
        edit(tensors)
    save_sharded(out, tensors)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(HF, quantization_config=qconfig), f)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny float Llama (weights of std 0.1: peaked logits) and its FP8 layouts."""
    root = tmp_path_factory.mktemp("fp8")
    model = Decoder(ModelConfig.from_hf_dict(HF), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    from eagle_jax.params import module_param_paths
    for path, var in module_param_paths(model):
        shape = var.shape
        value = (rng.uniform(0.8, 1.2, shape) if "norm" in str(path) else
                 rng.normal(0, 0.1, shape))
        var.set_value(jnp.asarray(value, jnp.float32))
    save_decoder(model, str(root / "float"), HF)
    src = str(root / "float")
    return dict(
        float=src,
        ct_channel=_write_fp8(src, str(root / "ct_channel"), _ct_config("FP8_DYNAMIC")),
        ct_tensor=_write_fp8(src, str(root / "ct_tensor"), _ct_config("FP8"),
                             per_channel=False, static=True),
        fbgemm=_write_fp8(src, str(root / "fbgemm"), FBGEMM_CONFIG),
        root=root)


def _relative_rms(out, ref) -> float:
    return float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))


def _logits(model):
    """Logits at 256 positions (8 rows of 32): enough that the argmax agreement below is
    within ~0.02 of its mean, not a handful of near-ties' coin flips."""
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)
    return np.asarray(model(tokens, jnp.broadcast_to(jnp.arange(32), (8, 32)), None).logits)


@pytest.mark.parametrize("layout", ["ct_channel", "ct_tensor", "fbgemm"])
def test_fp8_checkpoint_loads_and_saves_back_to_its_layout(checkpoints, layout, tmp_path):
    """Each layout loads (the weights' bits and scales as stored), and saves back with
    the same tensor names, dtypes, shapes, values and quantization_config."""
    src = checkpoints[layout]
    model = load_decoder(src)
    proj = model.layers[1].mlp.down_proj
    assert proj.weight.dtype == FN and proj.weight_scale.dtype == np.float32
    assert (proj.input_scale is not None) == (layout == "ct_tensor")
    save_decoder(model, str(tmp_path), HF)
    a, b = CheckpointReader(src), CheckpointReader(str(tmp_path))
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        assert (a.dtype(name), a.shape(name)) == (b.dtype(name), b.shape(name)), name
        np.testing.assert_array_equal(np.asarray(a.get(name)).view(np.uint8),
                                      np.asarray(b.get(name)).view(np.uint8), err_msg=name)
    saved = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    assert saved == json.load(open(os.path.join(src, "config.json")))["quantization_config"]


@pytest.mark.parametrize("layout", ["ct_channel", "ct_tensor", "fbgemm", "on_the_fly"])
def test_fp8_logits_stay_close_to_the_float_model(checkpoints, layout):
    """Tolerance: rounding to e4m3 leaves each weight and activation within 2**-4 of
    itself (about 2.5% rms for the usual values), so each FP8 projection's output carries
    about sqrt(2) x 2.5% ~ 3.6% rms relative noise, whatever its width (the errors add as
    the products do). Seven projections a layer, two layers, and a random model that
    amplifies them: measured 10-11% rms on the logits (per-tensor static: 11-12%) and
    85-91% of the 256 argmaxes kept (two random models; 12 positions, as this test first
    took, gave 83-92%: a coin flip against the 85% it then asked); the test allows 15%
    and needs 80%, ~3 standard deviations of the agreement below the lowest mean. A
    wrong scale (a row's, the fnuz doubling, a fused part's) moves the logits by their
    own size and keeps ~1/256 of the argmaxes."""
    ref = _logits(load_decoder(checkpoints["float"]))
    model = (load_decoder(checkpoints["float"], quantization="fp8") if layout == "on_the_fly"
             else load_decoder(checkpoints[layout]))
    out = _logits(model)
    err = _relative_rms(out, ref)
    agree = np.mean(out.argmax(-1) == ref.argmax(-1))
    print(f"{layout}: rms logit error / rms logit = {err:.4f}, argmax agreement {agree:.3f}")
    assert 0 < err < 0.15
    assert agree >= 0.8


def test_on_the_fly_quantization_saves_as_compressed_tensors(checkpoints, tmp_path):
    """A float checkpoint quantized while loading saves as compressed-tensors (channel
    weights, dynamic activations; compressed-tensors reads its config), which loads back
    to the same model."""
    from compressed_tensors.quantization import QuantizationConfig

    model = load_decoder(checkpoints["float"], quantization="fp8")
    save_decoder(model, str(tmp_path), HF)
    qc = json.load(open(os.path.join(tmp_path, "config.json")))["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    group = parsed.config_groups["group_0"]
    assert group.weights.strategy == "channel" and group.input_activations.dynamic
    assert CheckpointReader(str(tmp_path)).shape("model.layers.0.self_attn.k_proj.weight_scale") \
        == (32, 1)
    np.testing.assert_array_equal(_logits(load_decoder(str(tmp_path))), _logits(model))


def test_fnuz_loading_keeps_the_products(checkpoints, monkeypatch, tmp_path):
    """On gfx942 (a device reporting it; the CPU computes fnuz dots too) a compressed-
    tensors checkpoint loads as e4m3fnuz with doubled scales: the dequantized weights
    equal the fn checkpoint's exactly, and it saves back to the fn layout bit for bit."""
    import eagle_jax.models.decoder as decoder_module

    fn_model = load_decoder(checkpoints["ct_tensor"])
    monkeypatch.setattr(decoder_module, "fp8_dtype", lambda device=None: "float8_e4m3fnuz")
    model = load_decoder(checkpoints["ct_tensor"])
    a, b = fn_model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.qkv_proj
    assert b.weight.dtype == FNUZ
    np.testing.assert_array_equal(dequantize(b.weight[...], b.weight_scale[...]),
                                  dequantize(a.weight[...], a.weight_scale[...]))
    np.testing.assert_array_equal(np.asarray(b.input_scale[...]),
                                  2 * np.asarray(a.input_scale[...]))
    assert _relative_rms(_logits(model), _logits(fn_model)) < 0.15
    save_decoder(model, str(tmp_path), HF)
    src, saved = CheckpointReader(checkpoints["ct_tensor"]), CheckpointReader(str(tmp_path))
    for name in src.keys():
        np.testing.assert_array_equal(np.asarray(src.get(name)).view(np.uint8),
                                      np.asarray(saved.get(name)).view(np.uint8))


# ------------------------------------------------------------------------- errors
def _set(name, value):
    def edit(tensors):
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    return edit


SCALE = "model.layers.1.mlp.down_proj.weight_scale"
K_SCALE = "model.layers.0.self_attn.k_proj.weight_scale"


@pytest.mark.parametrize("edit, match", [
    (_set(SCALE, None), rf"lacks tensor '{SCALE}'; expected shape \(64, 1\)"),
    (_set(K_SCALE, np.ones((32, 2), np.float32)),
     rf"'{K_SCALE}' has shape \(32, 2\); expected shape \(32, 1\)"),
    (_set(SCALE, np.full((64, 1), np.nan, np.float32)), rf"'{SCALE}' holds nan; .*finite and"),
    (_set(SCALE, np.zeros((64, 1), np.float32)), rf"'{SCALE}' holds 0.0; .*positive"),
    (_set(SCALE, -np.ones((64, 1), np.float32)), rf"'{SCALE}' holds -1.0"),
], ids=["missing", "shape", "nan", "zero", "negative"])
def test_bad_scales_name_the_file_and_tensor(checkpoints, tmp_path, edit, match):
    out = _write_fp8(checkpoints["float"], str(tmp_path), _ct_config("FP8_DYNAMIC"), edit=edit)
    with pytest.raises(CheckpointError, match=match) as info:
        load_decoder(out)
    assert str(tmp_path) in str(info.value)


def _int4_config():
    qc = _ct_config("FP8_DYNAMIC")
    qc["format"] = "pack-quantized"
    qc["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    return qc


def _block_config():
    qc = _ct_config("FP8_DYNAMIC")
    qc["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    return qc


@pytest.mark.parametrize("qconfig, match", [
    (_int4_config, r"format 'pack-quantized' is not supported"),
    (_block_config, r"weights.strategy 'block' is not supported"),
    (lambda: {"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise"),
    (lambda: {"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
], ids=["int4", "block", "hf-fp8-block", "gptq"])
def test_unsupported_schemes_are_refused(checkpoints, tmp_path, qconfig, match):
    out = _write_fp8(checkpoints["float"], str(tmp_path), qconfig())
    with pytest.raises(CheckpointError, match=match) as info:
        load_decoder(out)
    assert os.path.join(str(tmp_path), "config.json") in str(info.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(checkpoints, tmp_path):
    out = _write_fp8(checkpoints["float"], str(tmp_path), {})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(HF, f)
    with pytest.raises(CheckpointError, match=r"proj.weight' is float8_e4m3fn; .*"
                                              r"quantization_config"):
        load_decoder(out)


# ------------------------------------------------------------------------- engines
# precompile=False: only the executables the requests use are compiled (CPU compiles
# dominate these tests).
ENGINE = dict(dtype="float32", max_model_len=96, max_num_seqs=4, batch_buckets=(4,),
              prefill_buckets=(32,), compilation_cache_dir="", num_steps=3, precompile=False)


@pytest.fixture(scope="module")
def fp8_target(models, tmp_path_factory):
    """conftest's tiny Llama (with its tokenizer) as a compressed-tensors FP8 checkpoint."""
    import shutil

    out = str(tmp_path_factory.mktemp("fp8_engine") / "target")
    os.makedirs(out)
    for name in os.listdir(models["target"]):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(models["target"], name), out)
    global HF
    hf = json.load(open(os.path.join(models["target"], "config.json")))
    saved, HF = HF, hf
    try:
        _write_fp8(models["target"], out, _ct_config("FP8_DYNAMIC"))
    finally:
        HF = saved
    return out


def _greedy(engine, prompts, max_tokens):
    from eagle_jax import SamplingParams
    from eagle_jax.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]


def _target_greedy(target, prompts, max_tokens, vocab, length, with_logits=False):
    """Plain greedy decoding by the target's own forward (no cache: each step attends
    causally over the whole padded sequence, one compile): the speculative engine's
    greedy output must be this. ``with_logits``: also each prompt's [max_tokens, vocab]
    logits of the steps."""
    graph, params = nnx.split(target)
    forward = jax.jit(lambda params, tokens: nnx.merge(graph, params)(
        tokens, jnp.arange(length)[None], None).logits[0, :, :vocab])
    out, logits = [], []
    for prompt in prompts:
        ids, rows = list(prompt), []
        for _ in range(max_tokens):
            tokens = np.zeros((1, length), np.int32)
            tokens[0, :len(ids)] = ids
            rows.append(np.asarray(forward(params, tokens))[len(ids) - 1])
            ids.append(int(np.argmax(rows[-1])))
        out.append(ids[len(prompt):])
        logits.append(np.stack(rows))
    return (out, logits) if with_logits else out


# The largest gap between the FP8 target's two best logits at which the speculative
# engine's greedy token may differ from the target's own forward's. The two compute the
# same model in other shapes, whose float32 sums round differently (~1e-6); where that
# moves an activation across an e4m3 rounding boundary it quantizes to the next value,
# 6-12% off, and the change spreads to every later position through the KV. Measured on
# the default target in FP8 (the same four prompts, one forward padded to 160 positions,
# one to 176): logits agree to 1e-5 up to the first such flip, then differ by a median
# of 0.19 and at most 0.53 (in float32: at most 1.4e-5 throughout).
NEAR_TIE = 0.6


def _near_tie_divergences(out, ref, ref_logits) -> list[tuple[int, int, float]]:
    """(prompt, position, gap) of each prompt's first difference between ``out`` and the
    reference; AssertionError if one is not a near-tie of the reference's top two."""
    found = []
    for k, (a, b, logits) in enumerate(zip(out, ref, ref_logits)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        top2 = np.argsort(logits[i])[::-1][:2]
        gap = float(logits[i][top2[0]] - logits[i][top2[1]])
        print(f"prompt {k} first differs at {i} ({a[i]} vs {b[i]}): the target's top two "
              f"{top2.tolist()}, gap {gap:.2e}")
        assert {a[i], b[i]} == {int(t) for t in top2} and gap < NEAR_TIE, (k, i, gap)
        found.append((k, i, gap))
    return found


def test_speculation_over_an_fp8_target_is_exact(models, fp8_target, caplog):
    """An EAGLE-3 engine over the compressed-tensors FP8 target, its draft quantized too
    (--draft-quantization fp8) and fed the FP8 target's features as they come: its greedy
    output is the FP8 target's own plain greedy output, token for token."""
    from eagle_jax.engine import Engine, EngineConfig

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(7, 300, int(rng.integers(3, 30)))]
               for _ in range(4)]
    with caplog.at_level("INFO", logger="eagle_jax.engine"):
        spec = Engine(EngineConfig(model=fp8_target, draft_model=models["eagle3"],
                                   speculative_algorithm="EAGLE3", draft_quantization="fp8",
                                   **ENGINE))
    assert "the target in FP8: float8_e4m3fn weights (a compressed-tensors checkpoint)" \
        in caplog.text
    assert "the draft's linear layers in FP8" in caplog.text
    assert spec.runner.draft.fc.weight.dtype == FN
    assert spec.runner.target.layers[0].mlp.gate_up_proj.weight.dtype == FN
    out = _greedy(spec, prompts, 20)
    assert out == _target_greedy(spec.runner.target, prompts, 20, spec.runner.vocab_size, 64)
    assert spec.stats.num_invalid_tokens == 0


def test_default_pair_in_fp8_agrees_with_float32():
    """The default pair, its target quantized to FP8 on the fly (the draft in float32,
    the default), on four held-out prompts: speculative greedy output the FP8 target's
    own but at most one near-tie of its two best logits (``NEAR_TIE``); against
    float32's, how much of it agrees and both accept lengths, printed; the accept length
    within 5% of float32's, up to the sample's noise.

    The two runs decode different texts once their outputs part (most do within a few
    tokens), so their accept lengths differ by chance as well: over ~40 draft steps a
    run's mean has a standard error near 8%, and 5% alone is a coin flip (+9.9% in one
    environment, inside it in another). The band is 5% plus 3.3 standard errors of the
    difference (the rows' accept lengths, every step, both runs; about 40% here): a
    false alarm below 1e-3 where the true difference is within 5%, a failure for an FP8
    path that breaks the draft's features (accept length near 1). Resolving 5% takes a
    sample ~50x this one: a benchmark's (issue 63), not a CPU test's."""
    from eagle_jax.assets import DEFAULT_DIR, DEFAULT_DRAFT, DEFAULT_TARGET
    from eagle_jax.engine import Engine, EngineConfig

    with open(os.path.join(DEFAULT_DIR, "heldout_prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][4:8]
    small = dict(dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=(4,),
                 prefill_buckets=(128,), compilation_cache_dir="", num_steps=5,
                 precompile=False)
    runs, accepted = {}, {}
    for name, quantization in (("float32", None), ("fp8", "fp8")):
        engine = Engine(EngineConfig(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT,
                                     speculative_algorithm="EAGLE3",
                                     quantization=quantization, **small))
        ids = [engine.tokenizer.encode(p) for p in prompts]
        rows = accepted[name] = []
        engine.add_step_listener(lambda event, rows=rows: event.output is None or rows.extend(
            event.output.accept_len[list(event.rows)].tolist()))
        runs[name] = (_greedy(engine, ids, 40), engine.stats.mean_accept_length)
        assert np.isclose(1 + np.mean(rows), runs[name][1])
    assert engine.runner.draft.fc.weight.dtype == np.float32
    assert engine.runner.target.layers[0].self_attn.o_proj.weight.dtype == FN
    (ref, ref_accept), (out, accept) = runs["float32"], runs["fp8"]
    own, own_logits = _target_greedy(engine.runner.target, ids, 40, engine.runner.vocab_size,
                                     max(len(i) for i in ids) + 40, with_logits=True)
    assert len(_near_tie_divergences(out, own, own_logits)) <= 1
    same = [int(np.sum(np.cumprod(np.equal(a, b)))) for a, b in zip(out, ref)]
    match = float(np.mean([np.mean(np.equal(a, b)) for a, b in zip(out, ref)]))
    print(f"\ndefault pair, FP8 target vs float32: identical prefixes {same} of 40 tokens, "
          f"{match:.1%} of tokens equal; accept length {accept:.3f} vs {ref_accept:.3f} "
          f"({accept / ref_accept - 1:+.1%})")
    se = np.hypot(*(np.std(a, ddof=1) / np.sqrt(len(a)) for a in accepted.values()))
    print(f"standard error of the difference {se:.3f} over {len(accepted['fp8'])} and "
          f"{len(accepted['float32'])} row-steps")
    assert abs(accept - ref_accept) <= 0.05 * ref_accept + 3.3 * se


def test_fp8_scales_shard_with_their_weights_output_axis(checkpoints):
    """Tensor parallelism: every parameter of an FP8 decoder gets its role's spec; a
    weight_scale [out] splits with a column-parallel weight's rows and is whole beside a
    row-parallel weight (whose input axis splits), a static input_scale is replicated."""
    from jax.sharding import PartitionSpec as P

    from eagle_jax.parallel import TP_AXIS, param_spec
    from eagle_jax.params import module_param_paths

    model = load_decoder(checkpoints["ct_tensor"])
    specs = {path[-2:]: param_spec(path, var.shape, 2)
             for path, var in module_param_paths(model) if path[:2] == ("layers", 0)}
    assert specs["qkv_proj", "weight"] == specs["gate_up_proj", "weight"] == P(TP_AXIS, None)
    assert specs["qkv_proj", "weight_scale"] == specs["gate_up_proj", "weight_scale"] == P(TP_AXIS)
    assert specs["o_proj", "weight"] == specs["down_proj", "weight"] == P(None, TP_AXIS)
    assert specs["o_proj", "weight_scale"] == specs["down_proj", "weight_scale"] == P()
    assert specs["qkv_proj", "input_scale"] == specs["down_proj", "input_scale"] == P()


def test_quantization_flags_and_their_checks():
    import argparse

    from eagle_jax.engine import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--quantization", "fp8", "--draft-quantization", "fp8"])
    config = EngineConfig.from_cli_args(args, model="t", draft_model="d")
    assert (config.quantization, config.draft_quantization) == ("fp8", "fp8")
    assert EngineConfig.from_cli_args(parser.parse_args([]), model="t",
                                      draft_model="d").quantization is None
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8',\)"):
        EngineConfig(model="t", speculative_algorithm="NONE", quantization="int4")
    with pytest.raises(ValueError, match="draft_quantization quantizes the draft"):
        EngineConfig(model="t", speculative_algorithm="NONE", draft_quantization="fp8")


def test_fp8_tensor_parallel_2_equals_1(checkpoints, tmp_path):
    """The static, per-tensor compressed-tensors checkpoint loaded tensor-parallel over 2
    host devices (``tests/multidevice.py``'s child: a ragged prefill through the paged
    cache, decode steps, a tree verify): logits and greedy tokens those of one device
    (the FP8 products are exact; only float32 summation order differs)."""
    from .multidevice import run_in_subprocess

    a = run_in_subprocess(checkpoints["ct_tensor"], str(tmp_path / "run.npz"), (1, 2), seed=3,
                          devices=2, decode_steps=2)
    keys = sorted(k.split("/", 1)[1] for k in a if k.startswith("tp1/")
                  and k.split("/", 1)[1].startswith(("prefill", "decode", "tree")))
    assert {"prefill", "decode1", "tree"} <= set(keys)
    for key in keys:
        ref, got = a[f"tp1/{key}"], a[f"tp2/{key}"]
        assert np.all(np.isfinite(ref)) and np.std(ref) > 0.1, key
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=key)
    np.testing.assert_array_equal(a["tp2/greedy"], a["tp1/greedy"])


def test_ignored_modules_stay_float(checkpoints, tmp_path):
    """compressed-tensors' ``ignore`` (names and "re:" patterns): an ignored projection
    loads its float tensor unquantized; ignoring only some of a fused projection's parts
    is refused, naming them."""
    down = "model.layers.1.mlp.down_proj"
    float_down = CheckpointReader(checkpoints["float"]).get(down + ".weight")

    def keep_float(tensors):
        tensors[down + ".weight"] = np.asarray(float_down)
        del tensors[down + ".weight_scale"]

    qc = _ct_config("FP8_DYNAMIC")
    qc["ignore"] = ["lm_head", r"re:.*layers\.1\.mlp\.down_proj"]
    model = load_decoder(_write_fp8(checkpoints["float"], str(tmp_path / "a"), qc,
                                    edit=keep_float))
    assert model.layers[1].mlp.down_proj.quant is None
    np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.down_proj.weight[...]),
                                  float_down)
    assert model.layers[0].mlp.down_proj.weight.dtype == FN
    qc["ignore"] = ["lm_head", "model.layers.0.self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"quantizes some of model\.layers\.0\.self_attn\."
                                         r"\{q_proj, k_proj, v_proj\} only"):
        load_decoder(_write_fp8(checkpoints["float"], str(tmp_path / "b"), qc))
