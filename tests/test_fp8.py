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
    Fp8Spec, dequantize, fn_to_fnuz, fnuz_to_fn, fp8_dtype, fp8_linear, quantize_weight)
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


def test_fp8_dtype_follows_the_device():
    dev = lambda cc, kind: types.SimpleNamespace(compute_capability=cc, device_kind=kind)
    assert fp8_dtype(dev("gfx942:sramecc+:xnack-", "AMD Instinct MI300X")) == "float8_e4m3fnuz"
    assert fp8_dtype(dev("", "AMD Instinct MI325X")) == "float8_e4m3fnuz"
    assert fp8_dtype(dev("gfx950", "AMD Instinct MI355X")) == "float8_e4m3fn"
    assert fp8_dtype(dev("9.0", "NVIDIA H100 80GB HBM3")) == "float8_e4m3fn"
    assert fp8_dtype(jax.devices("cpu")[0]) == "float8_e4m3fn"
