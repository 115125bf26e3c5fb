"""FP8 (e4m3) weights: the number formats, the device's format, quantizing, the matmul.

A quantized linear layer keeps its weight ``W [out, in]`` in e4m3 with one float32
scale per output row (``W ~ q * scale[:, None]``) and quantizes its input at run time:
per token (one scale per row of x, from its absolute maximum: "dynamic") or with one
scale a checkpoint calibrated ("static", ``input_scale``). The product is XLA's FP8 dot
(``lax.dot_general`` on float8 operands, float32 accumulation), then both scales:

    y[t, o] = (sum_i xq[t, i] wq[o, i]) * x_scale[t] * w_scale[o]

Two e4m3 formats: OCP ``float8_e4m3fn`` (NVIDIA, gfx950 MI350X / MI355X; max 448, a
-0, NaN = S.1111.111) and ``float8_e4m3fnuz`` (gfx942 MI300X / MI325X; exponent bias 8
instead of 7, max 240, no -0, NaN = 1.0000.000). A bit pattern other than those means
in fnuz exactly half what it means in fn, so an fn checkpoint's weights become fnuz by
keeping the bits (-0 becomes +0, NaN fnuz's NaN) and doubling the scales
(``fn_to_fnuz``); ``fnuz_to_fn`` undoes it. Weights are always quantized on the fn grid
(``quantize_weight``) and converted where the device wants fnuz, so one quantization
serves both and saves back to fn checkpoints without loss.

A leaf: jax, numpy and ml_dtypes only.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3FNUZ = np.dtype(ml_dtypes.float8_e4m3fnuz)
FP8_DTYPES = {"float8_e4m3fn": E4M3FN, "float8_e4m3fnuz": E4M3FNUZ}
ACTIVATION_SCHEMES = ("dynamic", "static")
CHECKPOINT_FORMATS = ("compressed-tensors", "fbgemm_fp8")
WEIGHT_STRATEGIES = ("channel", "tensor")
# Smallest scale a row or token of zeros takes: its quantized values are then 0, and
# nothing divides by zero.
MIN_SCALE = 1e-12
# Architectures whose matrix units take e4m3fnuz (CDNA3).
FNUZ_ARCHITECTURES = ("gfx940", "gfx941", "gfx942")
FNUZ_PARTS = ("MI300", "MI325")


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """How a model's linear layers are quantized.

    Attributes:
      dtype: "float8_e4m3fn" or "float8_e4m3fnuz" (``fp8_dtype``: the device's).
      activation: "dynamic" (per-token scales at run time) or "static" (the per-tensor
        ``input_scale`` the checkpoint gives; a fused projection uses the largest of its
        parts').
      checkpoint_format: the layout the model saves to: "compressed-tensors" or
        "fbgemm_fp8" (a model quantized on the fly saves as compressed-tensors).
      weight_strategy: compressed-tensors' weight scales: "channel" ([out, 1]) or
        "tensor" (one per tensor, held per row here: every row of a part the same).
      activation_scale_ub: FBGEMM's upper bound on a token's absolute maximum.
      ignore: Hugging Face module names (or "re:" patterns) left unquantized.
      config: the checkpoint's ``quantization_config`` as read (written back on save).
    """

    dtype: str = "float8_e4m3fn"
    activation: str = "dynamic"
    checkpoint_format: str = "compressed-tensors"
    weight_strategy: str = "channel"
    activation_scale_ub: float | None = None
    ignore: tuple[str, ...] = ("lm_head",)
    config: str | None = None  # JSON, kept as text so that the spec stays hashable

    def __post_init__(self):
        for name, allowed in (("dtype", tuple(FP8_DTYPES)), ("activation", ACTIVATION_SCHEMES),
                              ("checkpoint_format", CHECKPOINT_FORMATS),
                              ("weight_strategy", WEIGHT_STRATEGIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Fp8Spec.{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")

    @property
    def np_dtype(self) -> np.dtype:
        return FP8_DTYPES[self.dtype]

    @property
    def static(self) -> bool:
        return self.activation == "static"

    def describe(self) -> str:
        """One line for the start-up log."""
        source = ("quantized while loading" if self.config is None else
                  f"a {self.checkpoint_format} checkpoint")
        weights = "per-tensor" if self.weight_strategy == "tensor" else "per-channel"
        acts = ("static per-tensor" if self.static else "dynamic per-token")
        return (f"{self.dtype} weights ({source}), {weights} weight scales, {acts} "
                f"activation scales; embedding, LM head, norms and KV cache unquantized")

    def quantizes(self, module_name: str) -> bool:
        """Whether the Hugging Face module ``module_name`` (e.g.
        ``model.layers.0.mlp.down_proj``) is quantized: not named in ``ignore``."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True


def fp8_dtype(device=None) -> str:
    """The e4m3 format the device's matrix units take: "float8_e4m3fnuz" on gfx942
    (MI300X / MI325X), OCP "float8_e4m3fn" on gfx950, NVIDIA and a CPU. ``device``:
    default ``jax.devices()[0]``. ROCm reports its architecture as ``compute_capability``
    (``gfx942:sramecc+:xnack-``); ``device_kind`` names the part otherwise."""
    device = device if device is not None else jax.devices()[0]
    arch = str(getattr(device, "compute_capability", "") or "").split(":")[0]
    kind = str(getattr(device, "device_kind", "")).upper()
    if arch in FNUZ_ARCHITECTURES or any(part in kind for part in FNUZ_PARTS):
        return "float8_e4m3fnuz"
    return "float8_e4m3fn"


def fp8_max(dtype) -> float:
    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


def quantize_weight(w) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] (any float, host) -> (q [out, in] float8_e4m3fn, scale [out] float32)
    with q * scale[:, None] ~ w: each row's absolute maximum maps to 448."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-1) if w.shape[-1] else np.zeros(w.shape[:-1], np.float32)
    scale = (np.maximum(amax, MIN_SCALE) / fp8_max(E4M3FN)).astype(np.float32)
    q = np.clip(w / scale[:, None], -fp8_max(E4M3FN), fp8_max(E4M3FN)).astype(E4M3FN)
    return q, scale


def fn_to_fnuz(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """e4m3fn values and their scales -> e4m3fnuz values and scales of the same products:
    the bits kept (their fnuz value is half), the scales doubled; -0 -> 0, NaN -> NaN."""
    bits = np.asarray(q).view(np.uint8)
    bits = np.where(bits == 0x80, np.uint8(0), bits)  # fn's -0 is fnuz's NaN
    bits = np.where((bits & 0x7F) == 0x7F, np.uint8(0x80), bits)  # fn's NaNs
    return bits.astype(np.uint8).view(E4M3FNUZ), (np.asarray(scale, np.float32) * 2)


def fnuz_to_fn(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``fn_to_fnuz``. fnuz's +-240 (bits x.1111.111) would be fn's NaN: a
    value ``fn_to_fnuz`` never makes; saturated to fn's 448 (fnuz 224) if present."""
    bits = np.asarray(q).view(np.uint8)
    nan = bits == 0x80
    bits = np.where((bits & 0x7F) == 0x7F, bits - np.uint8(1), bits)
    bits = np.where(nan, np.uint8(0x7F), bits)
    return bits.astype(np.uint8).view(E4M3FN), (np.asarray(scale, np.float32) / 2)


def device_weight(q: np.ndarray, dtype: str) -> np.ndarray:
    """fn weights (a checkpoint's, or ``quantize_weight``'s) in the format ``dtype``; their
    scales go through ``device_scale``."""
    return fn_to_fnuz(q, np.ones(1, np.float32))[0] if dtype == "float8_e4m3fnuz" else q


def device_scale(scale: np.ndarray, dtype: str) -> np.ndarray:
    """An fn weight's (or a static input's) scale for the format ``dtype``: doubled for
    fnuz, whose values of the same bits are half."""
    scale = np.asarray(scale, np.float32)
    return scale * 2 if dtype == "float8_e4m3fnuz" else scale


def quantize_activation(x: jax.Array, dtype, input_scale: jax.Array | None = None,
                        scale_ub: float | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., in] -> (xq [..., in] in ``dtype``, scale [..., 1] float32), xq * scale ~ x.

    Static (``input_scale``, a scalar): x / input_scale, saturated at the format's max.
    Dynamic: one scale per row, its absolute maximum (capped at ``scale_ub``) mapped to
    the format's max."""
    top = fp8_max(dtype)
    xf = x.astype(jnp.float32)
    if input_scale is not None:
        scale = jnp.broadcast_to(input_scale.astype(jnp.float32), xf.shape[:-1] + (1,))
    else:
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
        if scale_ub is not None:
            amax = jnp.minimum(amax, scale_ub)
        scale = jnp.maximum(amax, MIN_SCALE) / top
    xs = jnp.clip(xf / scale, -top, top)
    if np.dtype(dtype) == E4M3FNUZ:
        # A negative that rounds to zero must become +0: fnuz has no -0, its bits 0x80
        # are NaN, and XLA's elemental convert (the CPU's loop emitters) writes them.
        tiny = float(ml_dtypes.finfo(E4M3FNUZ).smallest_subnormal) / 2
        xs = jnp.where(jnp.abs(xs) <= tiny, 0.0, xs)
    return xs.astype(dtype), scale


def fp8_linear(x: jax.Array, weight: jax.Array, weight_scale: jax.Array,
               input_scale: jax.Array | None = None, scale_ub: float | None = None,
               out_dtype=None) -> jax.Array:
    """x [..., in] through an FP8 weight [out, in] with scales [out] -> [..., out] in
    ``out_dtype`` (default x's): XLA's FP8 dot with float32 accumulation, then the
    scales. ``input_scale``: the static activation scale (scalar), else per token."""
    xq, x_scale = quantize_activation(x, weight.dtype, input_scale, scale_ub)
    acc = jax.lax.dot_general(xq, weight, (((x.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return (acc * x_scale * weight_scale.astype(jnp.float32)).astype(out_dtype or x.dtype)


def dequantize(weight, weight_scale) -> np.ndarray:
    """[out, in] float32 = weight * weight_scale[:, None] (references, saving to float)."""
    return (np.asarray(weight, np.float32)
            * np.asarray(weight_scale, np.float32).reshape(-1, 1))
