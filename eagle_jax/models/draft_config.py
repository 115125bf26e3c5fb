"""The ``config.json`` of an EAGLE draft: ``DraftConfig``, read and written.

``DraftConfig.from_hf_dict`` parses a draft's ``config.json`` (EAGLE-1 architectures
``EAGLE1_ARCHITECTURES``, EAGLE-3 ``EAGLE3_ARCHITECTURES``, the names sglang uses) and
checks it against the target's ``ModelConfig``; ``to_hf_dict`` writes the format the
published drafts carry, so a saved draft reloads with its kind unambiguous. The draft
modules that a ``DraftConfig`` builds are in ``draft.py``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from eagle_jax.config import ModelConfig, RopeScaling, _rope_scaling, _rope_theta

EAGLE, EAGLE3 = "EAGLE", "EAGLE3"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE draft as its ``config.json`` describes it, resolved against the target.

    ``feature_layers`` are the target layers whose INPUTS feed EAGLE-3's fc (the decoder's
    ``aux_layers``); the checkpoint's ``eagle_config.eagle_aux_hidden_state_layer_ids``
    name layer OUTPUTS, so ``feature_layers = ids + 1`` (sglang's convention).
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
    extra: tuple[tuple[str, str], ...] = ()  # other config.json keys (JSON text), for saving

    @property
    def feature_size(self) -> int:
        """F: the width of the target features ``project`` takes."""
        if self.kind == EAGLE:
            return self.target_hidden_size
        return len(self.feature_layers) * self.target_hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], kind: str, target: ModelConfig,
                     source: str = "config.json") -> "DraftConfig":
        """Parses a draft ``config.json`` and checks it against the target's config.

        Raises ValueError naming ``source`` and the offending value on any mismatch.
        """
        if kind not in (EAGLE, EAGLE3):
            raise ValueError(f"{source}: unknown draft kind {kind!r}")
        archs = cfg.get("architectures") or []
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            vocab = int(cfg.get("vocab_size") or target.vocab_size)
            dvocab = cfg.get("draft_vocab_size")
            dvocab = vocab if (dvocab is None or kind == EAGLE) else int(dvocab)
            ths = int(cfg.get("target_hidden_size") or hidden)
            eagle_cfg = cfg.get("eagle_config") or {}
            aux_ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
            if kind == EAGLE3:
                features = (tuple(int(i) + 1 for i in aux_ids) if aux_ids is not None
                            else tuple(target.eagle3_aux_layers))
            else:
                features = None
            out = cls(
                kind=kind,
                architecture=archs[0] if archs else "",
                vocab_size=vocab,
                draft_vocab_size=dvocab,
                hidden_size=hidden,
                target_hidden_size=ths,
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
                fc_bias=bool(cfg.get("bias", kind == EAGLE)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                feature_layers=features,
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                extra=tuple(sorted((k, json.dumps(v)) for k, v in cfg.items()
                                   if k in _KEPT_KEYS)),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
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
                ids = [i - 1 for i in self.feature_layers]
                raise ValueError(
                    f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {ids} out of range: "
                    f"the target has {target.num_layers} layers (valid ids -1.."
                    f"{target.num_layers - 2}, the output of layer i feeds layer i + 1)")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` the published drafts carry (Llama fields + EAGLE fields)."""
        cfg = {k: json.loads(v) for k, v in self.extra}
        # An EAGLE class name, so the kind is unambiguous on reload (sglang's names).
        names = EAGLE3_ARCHITECTURES if self.kind == EAGLE3 else EAGLE1_ARCHITECTURES
        cfg.update(
            architectures=[self.architecture if self.architecture in names else names[0]],
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
        if self.kind == EAGLE3:
            cfg.update(
                draft_vocab_size=self.draft_vocab_size,
                target_hidden_size=self.target_hidden_size,
                norm_before_residual=self.norm_before_residual,
                eagle_config=dict(
                    eagle_aux_hidden_state_layer_ids=[i - 1 for i in self.feature_layers],
                    use_aux_hidden_state=True),
            )
            if self.fc_bias:
                cfg["bias"] = True
        elif not self.fc_bias:
            cfg["bias"] = False
        return cfg


# config.json keys other than the architecture that a save should carry over.
_KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "initializer_range")
