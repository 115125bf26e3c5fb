"""The ``config.json`` of an EAGLE draft: ``DraftConfig``, read and written.

Two layouts (``CHECKPOINT_FORMATS``):

* ``"sglang"``: the published EAGLE / SGLang layout (yuhuili/EAGLE*, SpecForge outputs): a
  flat Llama config plus the EAGLE fields; EAGLE-1 architectures ``EAGLE1_ARCHITECTURES``,
  EAGLE-3 ``EAGLE3_ARCHITECTURES`` (the names sglang uses).
* ``"speculators"``: the layout of the ``speculators`` library, which vLLM reads (EAGLE-3
  only): ``speculators_model_type: "eagle3"``, the decoder layer's Llama config nested
  under ``transformer_layer_config``, ``speculators_config`` naming the verifier (the
  target), and aux layer ids in vLLM's convention (see ``DraftConfig``).

``DraftConfig.from_hf_dict`` parses either (the layout is told by the
``speculators_model_type`` key) and checks it against the target's ``ModelConfig``;
``to_hf_dict`` writes the config in the draft's ``checkpoint_format``, so a saved draft
reloads with its kind and layout unambiguous. The draft modules that a ``DraftConfig``
builds are in ``draft.py``; the tensor names of each layout are in ``draft_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from eagle_jax.config import ModelConfig, RopeScaling, _rope_scaling, _rope_theta

EAGLE, EAGLE3 = "EAGLE", "EAGLE3"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
SGLANG, SPECULATORS = "sglang", "speculators"
CHECKPOINT_FORMATS = (SGLANG, SPECULATORS)
# speculators' class names: the converter's (and the published drafts') and its trainer's
SPECULATORS_EAGLE3_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
# speculators' EAGLE-3 extensions that eagle_jax's draft does not implement
_SPECULATORS_UNSUPPORTED = {
    "norm_before_fc": "an RMSNorm over the concatenated aux features before fc",
    "fc_norm": "a per-aux-layer RMSNorm before fc",
    "norm_output": "a midlayer output fed back after the final norm",
}


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE draft as its ``config.json`` describes it, resolved against the target.

    ``feature_layers`` are the target layers whose INPUTS feed EAGLE-3's fc (the decoder's
    ``aux_layers``; 0 is the embedding output). The two layouts number them differently:

    * sglang: ``eagle_config.eagle_aux_hidden_state_layer_ids`` name layer OUTPUTS, so
      ``feature_layers = ids + 1`` (sglang's ``llama.py``: ``set_eagle3_layers_to_capture``
      sets ``layers_to_capture = [val + 1 for val in layer_ids]`` and the model captures
      before running each of those layers); the default ids are (1, L//2 - 1, L - 4).
    * speculators / vLLM: the top-level ``eagle_aux_hidden_state_layer_ids`` name layer
      INPUTS, so ``feature_layers = ids``, one less than sglang's for the same layer. Read
      in vLLM's ``model_executor/models/llama.py`` (``LlamaModel.forward`` appends
      ``hidden_states + residual`` for ``idx in aux_hidden_state_layers`` before running
      layer ``idx``; the default is ``(2, L // 2, L - 3)``) and in speculators 0.9.0
      (``models/utils.py: resolve_target_layer_ids``: default ``[2, L // 2, L - 3]``, valid
      ``0..L`` where ``L`` is the final hidden state, which eagle_jax does not offer).
      Absent ids mean that default, the same layers as sglang's default.

    ``checkpoint_format`` is the layout the config was read from and ``to_hf_dict``
    writes; ``verifier`` is speculators' ``speculators_config.verifier.name_or_path`` (the
    target the draft was made for; None when unknown) and ``target_architecture`` the
    target's ``architectures[0]``.
    """

    kind: str  # "EAGLE" or "EAGLE3"
    architecture: str
    vocab_size: int  # the target vocabulary the tokens index
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    fc_bias: bool = False
    tie_word_embeddings: bool = False
    feature_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    checkpoint_format: str = SGLANG
    verifier: str | None = None
    target_architecture: str = ""
    extra: tuple[tuple[str, str], ...] = ()  # other config.json keys (JSON text), for saving

    def __post_init__(self):
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format {self.checkpoint_format!r}: expected one of "
                             f"{', '.join(CHECKPOINT_FORMATS)}")

    @property
    def aux_layer_ids(self) -> list[int] | None:
        """The EAGLE-3 feature layers as the ``checkpoint_format`` numbers them."""
        if self.feature_layers is None:
            return None
        shift = 1 if self.checkpoint_format == SGLANG else 0
        return [i - shift for i in self.feature_layers]

    @property
    def feature_size(self) -> int:
        """F: the width of the target features ``project`` takes."""
        if self.kind == EAGLE:
            return self.target_hidden_size
        return len(self.feature_layers) * self.target_hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], kind: str, target: ModelConfig,
                     source: str = "config.json") -> "DraftConfig":
        """Parses a draft ``config.json`` in either layout and checks it against the target.

        A ``speculators_model_type`` key means the speculators layout, else the sglang one.
        Raises ValueError naming ``source`` and the offending value on any mismatch.
        """
        if kind not in (EAGLE, EAGLE3):
            raise ValueError(f"{source}: unknown draft kind {kind!r}")
        try:
            if "speculators_model_type" in cfg:
                fields = _speculators_fields(cfg, kind, target, source)
            else:
                fields = _sglang_fields(cfg, kind, target)
            layer = cfg.get("transformer_layer_config", cfg)
            fields.update(_llama_fields(layer, target, source))
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        archs = cfg.get("architectures") or []
        out = cls(kind=kind, architecture=archs[0] if archs else "",
                  target_architecture=target.architecture,
                  extra=tuple(sorted((k, json.dumps(v)) for k, v in layer.items()
                                     if k in _KEPT_KEYS)),
                  **fields)
        out.check_target(target, source)
        return out

    def check_target(self, target: ModelConfig, source: str = "config.json") -> None:
        """Raises ValueError when this draft cannot serve ``target``."""
        if self.kind == EAGLE and self.hidden_size != target.hidden_size:
            raise ValueError(
                f"{source}: EAGLE-1 draft hidden_size {self.hidden_size} != the target's "
                f"hidden_size {target.hidden_size} (its features are the target's hidden states)")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{source}: target_hidden_size {self.target_hidden_size} != the target's "
                f"hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{source}: vocab_size {self.vocab_size} != the target's vocab_size "
                f"{target.vocab_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"{source}: draft_vocab_size {self.draft_vocab_size} outside "
                f"[1, {self.vocab_size}] (the target vocabulary)")
        if self.kind == EAGLE3:
            if self.num_layers != 1:
                raise ValueError(
                    f"{source}: num_hidden_layers {self.num_layers}: only single-midlayer "
                    "EAGLE-3 drafts are supported")
            bad = [i for i in self.feature_layers if not 0 <= i < target.num_layers]
            if bad or not self.feature_layers:
                n = target.num_layers
                if self.checkpoint_format == SGLANG:
                    field, valid = ("eagle_config.eagle_aux_hidden_state_layer_ids",
                                    f"-1..{n - 2}, the output of layer i feeds layer i + 1")
                else:
                    field, valid = ("eagle_aux_hidden_state_layer_ids",
                                    f"0..{n - 1}, id i is the input of layer i (vLLM's "
                                    "convention)")
                raise ValueError(
                    f"{source}: {field} {self.aux_layer_ids} out of range: the target has "
                    f"{n} layers (valid ids {valid})")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` of ``checkpoint_format``: the sglang layout the published
        drafts carry (Llama fields + EAGLE fields), or the speculators layout."""
        if self.checkpoint_format == SPECULATORS:
            return self._speculators_dict()
        cfg = self._llama_dict()
        # An EAGLE class name, so the kind is unambiguous on reload (sglang's names).
        names = EAGLE3_ARCHITECTURES if self.kind == EAGLE3 else EAGLE1_ARCHITECTURES
        cfg = dict(architectures=[self.architecture if self.architecture in names else names[0]],
                   **cfg)
        if self.kind == EAGLE3:
            cfg.update(
                draft_vocab_size=self.draft_vocab_size,
                target_hidden_size=self.target_hidden_size,
                norm_before_residual=self.norm_before_residual,
                eagle_config=dict(eagle_aux_hidden_state_layer_ids=self.aux_layer_ids,
                                  use_aux_hidden_state=True),
            )
            if self.fc_bias:
                cfg["bias"] = True
        elif not self.fc_bias:
            cfg["bias"] = False
        return cfg

    def _llama_dict(self) -> dict[str, Any]:
        """The Llama fields of the draft's decoder layer(s) (+ the carried-over keys)."""
        cfg = {k: json.loads(v) for k, v in self.extra}
        cfg.update(
            model_type="llama",
            hidden_act="silu",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            cfg["rope_scaling"] = dict(
                rope_type="llama3", factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                high_freq_factor=rs.high_freq_factor,
                original_max_position_embeddings=rs.original_max_position_embeddings)
        return cfg

    def _speculators_dict(self) -> dict[str, Any]:
        """speculators' EAGLE-3 config. The checkpoint always carries ``lm_head.weight``
        (``save_draft`` writes the head a draft borrows), so the head is never tied."""
        if self.kind != EAGLE3:
            raise ValueError("the speculators layout is written for EAGLE-3 drafts only; "
                             f"this draft is {self.kind}: save it with checkpoint_format "
                             f"{SGLANG!r}")
        if self.fc_bias:
            raise ValueError("this EAGLE-3 draft's fc has a bias, which speculators' fc "
                             f"(bias=False) cannot hold: save it with checkpoint_format {SGLANG!r}")
        layer = dict(self._llama_dict(), mlp_bias=False, tie_word_embeddings=False)
        return dict(
            architectures=[self.architecture if self.architecture in
                           SPECULATORS_EAGLE3_ARCHITECTURES
                           else SPECULATORS_EAGLE3_ARCHITECTURES[0]],
            speculators_model_type="eagle3",
            transformer_layer_config=layer,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            norm_before_residual=self.norm_before_residual,
            eagle_aux_hidden_state_layer_ids=self.aux_layer_ids,
            tie_word_embeddings=False,
            speculators_config=dict(
                algorithm="eagle3",
                proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3,
                                       verifier_accept_k=1, accept_tolerance=0.0)],
                default_proposal_method="greedy",
                verifier=dict(name_or_path=self.verifier,
                              architectures=[self.target_architecture]
                              if self.target_architecture else []),
            ),
        )


# config.json keys other than the architecture that a save should carry over.
_KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "initializer_range")


def _llama_fields(cfg: dict[str, Any], target: ModelConfig, source: str) -> dict[str, Any]:
    """DraftConfig fields from the Llama config of the draft's layer(s) (sglang: the whole
    config.json; speculators: its ``transformer_layer_config``)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return dict(
        vocab_size=int(cfg.get("vocab_size") or target.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg.get("num_hidden_layers", 1)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_theta(cfg)),
        rope_scaling=_rope_scaling(cfg, source),
        max_position_embeddings=int(cfg.get("max_position_embeddings")
                                    or target.max_position_embeddings),
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _sglang_fields(cfg: dict[str, Any], kind: str, target: ModelConfig) -> dict[str, Any]:
    """The EAGLE fields of an sglang-layout config.json (aux ids name layer OUTPUTS)."""
    hidden = int(cfg["hidden_size"])
    vocab = int(cfg.get("vocab_size") or target.vocab_size)
    dvocab = cfg.get("draft_vocab_size")
    aux_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    features = None
    if kind == EAGLE3:
        features = (tuple(int(i) + 1 for i in aux_ids) if aux_ids is not None
                    else tuple(target.eagle3_aux_layers))
    return dict(
        checkpoint_format=SGLANG,
        draft_vocab_size=vocab if (dvocab is None or kind == EAGLE) else int(dvocab),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        fc_bias=bool(cfg.get("bias", kind == EAGLE)),
        feature_layers=features,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )


def _speculators_fields(cfg: dict[str, Any], kind: str, target: ModelConfig,
                        source: str) -> dict[str, Any]:
    """The EAGLE fields of a speculators EAGLE-3 config.json (aux ids name layer INPUTS)."""
    model_type = cfg["speculators_model_type"]
    if model_type != "eagle3" or kind != EAGLE3:
        raise ValueError(
            f"{source}: speculators_model_type {model_type!r}: eagle_jax reads speculators' "
            "'eagle3' drafts only (EAGLE-1 drafts load from the sglang layout)")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{source}: missing required field 'transformer_layer_config' (the "
                         "Llama config of the draft's decoder layer)")
    layer_type = layer.get("model_type", "llama")
    if layer_type != "llama":
        raise ValueError(
            f"{source}: transformer_layer_config.model_type {layer_type!r}: eagle_jax's "
            "EAGLE-3 midlayer is a Llama layer (model_type 'llama')")
    if layer.get("mlp_bias"):
        raise ValueError(f"{source}: transformer_layer_config.mlp_bias is true: eagle_jax's "
                         "EAGLE-3 MLP has no bias")
    for key, what in _SPECULATORS_UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"{source}: {key} is true ({what}): eagle_jax's EAGLE-3 draft "
                             f"does not implement it; only drafts with {key} false load")
    hidden = int(layer["hidden_size"])
    aux_ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return dict(
        checkpoint_format=SPECULATORS,
        draft_vocab_size=int(cfg["draft_vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        fc_bias=False,
        # vLLM's convention: the ids ARE the layers whose inputs are captured; absent or
        # empty means vLLM's default, the target's eagle3_aux_layers (2, L//2, L-3)
        feature_layers=(tuple(int(i) for i in aux_ids) if aux_ids
                        else tuple(target.eagle3_aux_layers)),
        # absent: True, as vLLM reads it (``update_eagle3``); speculators always writes it
        norm_before_residual=bool(cfg.get("norm_before_residual", True)),
        verifier=verifier,
    )
