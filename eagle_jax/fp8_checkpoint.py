"""FP8 checkpoints: the layouts users have, read into and written from FP8 layers.

Two pre-quantized layouts, both e4m3fn weights (safetensors ``F8_E4M3``) in the
Hugging Face names, with ``quantization_config`` in config.json:

    compressed-tensors ("-FP8" / "-FP8-dynamic" Llama / Qwen releases)
      quant_method "compressed-tensors", format "float-quantized" (or "naive-quantized"),
      config_groups {name: {targets ["Linear"], weights {num_bits 8, type float,
      strategy channel | tensor}, input_activations {num_bits 8, type float,
      dynamic true (strategy token) | dynamic false (strategy tensor)}}}, ignore [...]
      X.weight [out, in] F8_E4M3, X.weight_scale [out, 1] (channel) or [1] (tensor),
      X.input_scale [1] (static activations only)
    FBGEMM (quant_method "fbgemm_fp8", activation_scale_ub, modules_to_not_convert)
      X.weight [out, in] F8_E4M3, X.weight_scale [out, 1]; per-token dynamic activations

and a float checkpoint quantized on the fly (``EngineConfig.quantization = "fp8"``),
per output channel, saved as compressed-tensors (channel, dynamic).

On gfx942 the fn weights become e4m3fnuz, their scales (and static input scales)
doubled (``fp8.fn_to_fnuz``); saving converts back. Every problem with a scale (absent,
of the wrong shape, not finite, not positive) and every unsupported scheme (integer,
block-wise or group-wise scales, weight-only) is a CheckpointError naming the file, the
tensor and what was expected.
"""

from __future__ import annotations

import json

import numpy as np
from flax import nnx

from eagle_jax.checkpoint import CheckpointError, CheckpointReader
from eagle_jax.fp8 import Fp8Spec, device_scale, device_weight, fnuz_to_fn, quantize_weight

FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def spec_from_config(hf: dict, source: str, dtype: str) -> Fp8Spec | None:
    """The FP8 spec of a config.json's ``quantization_config`` (None without one), the
    weights in ``dtype`` (``fp8.fp8_dtype``, the device's). ``source``: the file, for
    errors."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    text = json.dumps(qc, sort_keys=True)
    if method == "compressed-tensors":
        return _compressed_tensors_spec(qc, source, dtype, text)
    if method == "fbgemm_fp8":
        ub = qc.get("activation_scale_ub")
        return Fp8Spec(dtype=dtype, activation="dynamic", checkpoint_format="fbgemm_fp8",
                       activation_scale_ub=None if ub is None else float(ub),
                       ignore=tuple(qc.get("modules_to_not_convert") or ("lm_head",)),
                       config=text)
    if method == "fp8" and qc.get("weight_block_size"):
        raise CheckpointError(
            f"{source}: quantization_config quant_method 'fp8' with weight_block_size "
            f"{qc['weight_block_size']} (block-wise FP8 scales) is not supported; eagle_jax "
            "reads per-channel or per-tensor FP8 (compressed-tensors, fbgemm_fp8), or "
            "quantizes a bf16 checkpoint itself (--quantization fp8)")
    raise CheckpointError(
        f"{source}: quantization_config quant_method {method!r} is not supported; "
        "supported: 'compressed-tensors' (FP8 float-quantized) and 'fbgemm_fp8', or a "
        "bf16 / float32 checkpoint with --quantization fp8")


def _compressed_tensors_spec(qc: dict, source: str, dtype: str, text: str) -> Fp8Spec:
    fmt = qc.get("format")
    if fmt not in FLOAT_FORMATS:
        raise CheckpointError(f"{source}: compressed-tensors format {fmt!r} is not supported; "
                              f"expected one of {FLOAT_FORMATS} (FP8 weights)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{source}: compressed-tensors quantization_config has no "
                              "config_groups")
    schemes = set()
    for name, group in groups.items():
        where = f"{source}: config_groups.{name}"
        w, a = group.get("weights") or {}, group.get("input_activations")
        if (w.get("num_bits"), w.get("type")) != (8, "float"):
            raise CheckpointError(
                f"{where}.weights is {w.get('num_bits')}-bit {w.get('type')}; expected "
                "num_bits 8, type float (FP8): integer / 4-bit schemes are not supported")
        if w.get("strategy") not in ("channel", "tensor"):
            raise CheckpointError(
                f"{where}.weights.strategy {w.get('strategy')!r} is not supported; expected "
                "channel or tensor (block and group scales are not)")
        if a is None or (a.get("num_bits"), a.get("type")) != (8, "float"):
            raise CheckpointError(
                f"{where}.input_activations {a!r}: expected 8-bit float activations "
                "(weight-only FP8 is not supported)")
        dynamic = bool(a.get("dynamic"))
        if (dynamic and a.get("strategy") != "token") or (
                not dynamic and a.get("strategy") != "tensor"):
            raise CheckpointError(
                f"{where}.input_activations: dynamic {dynamic} with strategy "
                f"{a.get('strategy')!r}; expected dynamic per token or static per tensor")
        if set(group.get("targets") or ()) - {"Linear"}:
            raise CheckpointError(f"{where}.targets {group.get('targets')}: expected "
                                  "['Linear']")
        schemes.add((w["strategy"], "dynamic" if dynamic else "static"))
    if len(schemes) > 1:
        raise CheckpointError(f"{source}: config_groups mix schemes {sorted(schemes)}; "
                              "expected one scheme for every linear layer")
    strategy, activation = schemes.pop()
    return Fp8Spec(dtype=dtype, activation=activation, checkpoint_format="compressed-tensors",
                   weight_strategy=strategy, ignore=tuple(qc.get("ignore") or ()),
                   config=text)


def on_the_fly_spec(dtype: str) -> Fp8Spec:
    """Quantizing a float checkpoint: per-channel weights, per-token activations, the
    LM head left out; saved as compressed-tensors."""
    return Fp8Spec(dtype=dtype, activation="dynamic", checkpoint_format="compressed-tensors",
                   weight_strategy="channel", ignore=("lm_head",))


def quantization_config(spec: Fp8Spec) -> dict:
    """config.json's ``quantization_config`` for a model of ``spec``: the one it was
    loaded with, or compressed-tensors' FP8 (channel, dynamic) for one quantized here."""
    if spec.config is not None:
        return json.loads(spec.config)
    fp8 = dict(num_bits=8, type="float", symmetric=True, group_size=None)
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": dict(fp8, strategy="channel", dynamic=False),
            "input_activations": dict(fp8, strategy="token", dynamic=True)}},
        "ignore": list(spec.ignore), "kv_cache_scheme": None,
    }


class Fp8Loader:
    """Reads the tensors of an FP8 model's parameters (``checkpoint.load_into``'s
    ``read``): FP8 weights from F8_E4M3 tensors, or quantized here from float ones
    (``quantize``); their scales checked and shaped [rows]; every one converted to the
    spec's format."""

    def __init__(self, reader: CheckpointReader, spec: Fp8Spec, quantize: bool):
        self.reader, self.spec, self.quantize = reader, spec, quantize
        self._scales: dict[str, np.ndarray] = {}  # on the fly: a weight's scale, until read

    def read(self, name: str, shape: tuple[int, ...], var: nnx.Param) -> np.ndarray:
        leaf = name.rsplit(".", 1)[-1]
        is_fp8 = np.dtype(var.dtype).itemsize == 1
        if leaf == "weight" and is_fp8:
            return self._weight(name, shape)
        if leaf == "weight_scale":
            return self._weight_scale(name, shape)
        if leaf == "input_scale":
            return device_scale(self._scale(name, shape, "tensor"), self.spec.dtype)
        return self.reader.get(name, expected_shape=shape)

    def _weight(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.reader:
            self.reader.get(name, expected_shape=shape)  # raises, naming it
        code = self.reader.dtype(name)
        if self.quantize:
            w = self.reader.get(name, expected_shape=shape)
            if code == "F8_E4M3":
                raise CheckpointError(f"{self.reader.file_of(name)}: tensor {name!r} is "
                                      "already FP8 but config.json declares no "
                                      "quantization_config to read its scales by")
            q, self._scales[name + "_scale"] = quantize_weight(w)
        else:
            if code != "F8_E4M3":
                raise CheckpointError(
                    f"{self.reader.file_of(name)}: tensor {name!r} is {code}; the "
                    f"{self.spec.checkpoint_format} quantization_config expects F8_E4M3 "
                    "(float8_e4m3fn) weights")
            q = self.reader.get(name, expected_shape=shape)
        return device_weight(q, self.spec.dtype)

    def _weight_scale(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name in self._scales:
            scale = self._scales.pop(name)
        elif self.quantize:  # read before its weight
            scale = quantize_weight(self.reader.get(name[:-len("_scale")]))[1]
        else:
            scale = self._scale(name, shape, self.spec.weight_strategy)
        return device_scale(scale, self.spec.dtype)

    def _scale(self, name: str, shape: tuple[int, ...], strategy: str) -> np.ndarray:
        """A checkpoint scale as [rows] float32 (a per-tensor one repeated), checked."""
        rows = shape[0]
        if strategy == "channel":
            allowed, expected = ((rows, 1), (rows,)), f"({rows}, 1) (one per output channel)"
        else:
            allowed, expected = ((1,), ()), "(1,) (one per tensor)"
        if name not in self.reader:
            raise CheckpointError(
                f"checkpoint {self.reader.model_dir} lacks tensor {name!r}; expected shape "
                f"{expected} float32, the FP8 scale of {name.rsplit('.', 1)[0]!r}")
        arr = self.reader.get(name)
        if tuple(arr.shape) not in allowed:
            raise CheckpointError(
                f"{self.reader.file_of(name)}: tensor {name!r} has shape {tuple(arr.shape)}; "
                f"expected shape {expected} ({self.spec.checkpoint_format}, "
                f"{strategy} scales)")
        arr = np.asarray(arr, np.float32).reshape(-1)
        if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
            bad = arr[~(np.isfinite(arr) & (arr > 0))][0]
            raise CheckpointError(
                f"{self.reader.file_of(name)}: tensor {name!r} holds {bad}; every FP8 scale "
                "must be finite and positive")
        return np.broadcast_to(arr, (rows,)).astype(np.float32)


def checkpoint_layout(tensors: dict[str, np.ndarray], spec: Fp8Spec) -> dict[str, np.ndarray]:
    """``checkpoint.module_tensors`` of an FP8 model -> the tensors of its checkpoint
    layout: weights e4m3fn, ``weight_scale`` [out, 1] (channel) or [1] (tensor),
    ``input_scale`` [1], all scales float32."""
    out = dict(tensors)
    fnuz = spec.dtype == "float8_e4m3fnuz"
    for name, arr in tensors.items():
        if not name.endswith(".weight_scale"):
            continue
        base = name[:-len("_scale")]
        q, scale = out[base], np.asarray(arr, np.float32)
        if fnuz:
            q, scale = fnuz_to_fn(q, scale)
        out[base] = q
        if spec.checkpoint_format == "compressed-tensors" and spec.weight_strategy == "tensor":
            scale = scale[:1]
        else:
            scale = scale.reshape(-1, 1)
        out[name] = scale
        input_name = base[:-len("weight")] + "input_scale"
        if input_name in tensors:
            s = np.asarray(tensors[input_name], np.float32).reshape(1)
            out[input_name] = s / 2 if fnuz else s
    return out
