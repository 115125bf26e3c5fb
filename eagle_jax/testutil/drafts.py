"""Tiny random EAGLE-1 / EAGLE-3 drafts for tests, in exactly the published layouts.

Written with numpy + ``eagle_jax.checkpoint.save_safetensors`` (no transformers): the
tensor names, shapes and dtypes are those of the published drafts (see
``eagle_jax.models.draft_checkpoint``), so these files exercise the same loader path a
real checkpoint does. The draft's geometry follows the target's ``config.json``.

EAGLE-3 also comes in the ``speculators`` layout, with the config as speculators 0.9.0's
``Eagle3DraftModel.save_pretrained`` writes it (transformers-5 ``rope_parameters``,
``target_hidden_size: null``, ``speculators_config``), compared field by field with that
package's output; the package itself (transformers <= 5.19, torchvision, datasets, ...)
is not a test dependency.
"""

from __future__ import annotations

import json
import os

import numpy as np

from eagle_jax.checkpoint import CheckpointReader, save_safetensors


def _target_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def _geometry(t: dict) -> dict:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    return dict(h=h, n=heads, k=t.get("num_key_value_heads") or heads,
                d=t.get("head_dim") or h // heads, i=t["intermediate_size"], v=t["vocab_size"])


def _llama_fields(t: dict, g: dict, max_position_embeddings: int | None) -> dict:
    return dict(
        model_type="llama", hidden_act="silu", vocab_size=g["v"], hidden_size=g["h"],
        intermediate_size=g["i"], num_attention_heads=g["n"], num_key_value_heads=g["k"],
        head_dim=g["d"], rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=t.get("rope_theta", 10000.0),
        max_position_embeddings=max_position_embeddings or t.get("max_position_embeddings", 2048),
        tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=t.get("bos_token_id"), eos_token_id=t.get("eos_token_id"))


def _attn_mlp(prefix: str, g: dict, in_features: int, normal) -> dict:
    h, n, k, d, i = g["h"], g["n"], g["k"], g["d"], g["i"]
    return {
        f"{prefix}.self_attn.q_proj.weight": normal((n * d, in_features)),
        f"{prefix}.self_attn.k_proj.weight": normal((k * d, in_features)),
        f"{prefix}.self_attn.v_proj.weight": normal((k * d, in_features)),
        f"{prefix}.self_attn.o_proj.weight": normal((h, n * d)),
        f"{prefix}.mlp.gate_proj.weight": normal((i, h)),
        f"{prefix}.mlp.up_proj.weight": normal((i, h)),
        f"{prefix}.mlp.down_proj.weight": normal((h, i)),
    }


def _target_embedding(target_dir: str) -> np.ndarray:
    return np.array(CheckpointReader(target_dir).get("model.embed_tokens.weight"), np.float32)


def write_tiny_eagle3_draft(out_dir: str, target_dir: str, *, draft_vocab_size: int | None = None,
                            seed: int = 0, init_std: float = 0.1,
                            aux_layer_ids: list[int] | None = None, with_embed: bool = False,
                            with_lm_head: bool = True, norm_before_residual: bool = False,
                            max_position_embeddings: int | None = None,
                            architecture: str | None = None,
                            checkpoint_format: str = "sglang") -> str:
    """A random EAGLE-3 draft for the target in ``target_dir``.

    checkpoint_format: "sglang" (``LlamaForCausalLMEagle3``, ``midlayer.*``) or
    "speculators" (``Eagle3DraftModel``, ``layers.0.*``); the same seed gives the same
    weights in both. draft_vocab_size: None = the whole target vocabulary; else a random
    subset of that many target ids, sorted, with ``d2t``/``t2d`` consistent (speculators
    omits both for the whole vocabulary). aux_layer_ids: the config's
    ``eagle_aux_hidden_state_layer_ids`` in the layout's own convention (sglang: layer
    OUTPUT ids; speculators: layer INPUT ids); None = omit them, so the target's default
    feature layers 2, L//2, L-3 apply. with_embed: also write ``embed_tokens.weight`` (a
    copy of the target's). Returns ``out_dir``.
    """
    t = _target_config(target_dir)
    g = _geometry(t)
    h, v = g["h"], g["v"]
    vd = v if draft_vocab_size is None else int(draft_vocab_size)
    rng = np.random.default_rng(seed)

    def normal(shape):
        return (rng.standard_normal(shape) * init_std).astype(np.float32)

    def norm_w():
        return rng.uniform(0.8, 1.2, (h,)).astype(np.float32)

    n_aux = 3 if aux_layer_ids is None else len(aux_layer_ids)
    tensors = {"fc.weight": normal((h, n_aux * h))}
    tensors["midlayer.input_layernorm.weight"] = norm_w()
    tensors["midlayer.hidden_norm.weight"] = norm_w()
    tensors.update(_attn_mlp("midlayer", g, 2 * h, normal))
    tensors["midlayer.post_attention_layernorm.weight"] = norm_w()
    tensors["norm.weight"] = norm_w()
    if with_lm_head:
        tensors["lm_head.weight"] = normal((vd, h))
    ids = np.arange(v) if vd == v else np.sort(rng.choice(v, vd, replace=False))
    tensors["d2t"] = (ids - np.arange(vd)).astype(np.int64)
    t2d = np.zeros(v, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    if with_embed:
        tensors["embed_tokens.weight"] = _target_embedding(target_dir)

    llama = _llama_fields(t, g, max_position_embeddings)
    if checkpoint_format == "speculators":
        tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): a
                   for k, a in tensors.items() if vd != v or k not in ("d2t", "t2d")}
        cfg = _speculators_config(llama, vd, norm_before_residual, aux_layer_ids,
                                  architecture or "Eagle3DraftModel")
    else:
        cfg = dict(architectures=[architecture or "LlamaForCausalLMEagle3"], **llama,
                   num_hidden_layers=1, draft_vocab_size=vd, target_hidden_size=h,
                   norm_before_residual=norm_before_residual)
        if aux_layer_ids is not None:
            cfg["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
                                       use_aux_hidden_state=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    return out_dir


def _speculators_config(llama: dict, draft_vocab_size: int, norm_before_residual: bool,
                        aux_layer_ids: list[int] | None, architecture: str) -> dict:
    """config.json of a speculators EAGLE-3 draft, laid out as speculators 0.9.0 writes it."""
    layer = {k: v for k, v in llama.items() if k not in ("rope_theta", "torch_dtype")}
    layer.update(num_hidden_layers=1, mlp_bias=False, attention_bias=False,
                 rope_parameters=dict(rope_theta=llama["rope_theta"], rope_type="default"))
    return dict(
        architectures=[architecture],
        speculators_model_type="eagle3",
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        norm_before_fc=False, fc_norm=False, norm_output=False, embed_requires_grad=False,
        target_hidden_size=None,
        eagle_aux_hidden_state_layer_ids=None if aux_layer_ids is None else list(aux_layer_ids),
        tie_word_embeddings=False,
        dtype="float32",
        speculators_config=dict(
            algorithm="eagle3",
            default_proposal_method="greedy",
            proposal_methods=[dict(accept_tolerance=0.0, proposal_type="greedy",
                                   speculative_tokens=3, verifier_accept_k=1)],
            verifier=dict(architectures=["LlamaForCausalLM"], name_or_path="tiny-target")),
        speculators_version="0.9.0",
    )


def write_tiny_eagle1_draft(out_dir: str, target_dir: str, *, seed: int = 0,
                            init_std: float = 0.1, num_layers: int = 1, with_embed: bool = True,
                            architecture: str = "LlamaForCausalLM",
                            max_position_embeddings: int | None = None) -> str:
    """A random EAGLE-1 draft as the originals are published: config says
    ``LlamaForCausalLM``; tensors ``fc.weight``, ``fc.bias``, ``layers.{i}.*`` (layer 0
    without ``input_layernorm``) and, with ``with_embed``, ``embed_tokens.weight`` (a copy
    of the target's). Returns ``out_dir``."""
    t = _target_config(target_dir)
    g = _geometry(t)
    h = g["h"]
    rng = np.random.default_rng(seed)

    def normal(shape):
        return (rng.standard_normal(shape) * init_std).astype(np.float32)

    tensors = {"fc.weight": normal((h, 2 * h)), "fc.bias": normal((h,))}
    for layer in range(num_layers):
        p = f"layers.{layer}"
        if layer > 0:
            tensors[f"{p}.input_layernorm.weight"] = rng.uniform(0.8, 1.2, (h,)).astype(np.float32)
        tensors.update(_attn_mlp(p, g, h, normal))
        tensors[f"{p}.post_attention_layernorm.weight"] = (
            rng.uniform(0.8, 1.2, (h,)).astype(np.float32))
    if with_embed:
        tensors["embed_tokens.weight"] = _target_embedding(target_dir)
    cfg = dict(architectures=[architecture], **_llama_fields(t, g, max_position_embeddings),
               num_hidden_layers=num_layers)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    return out_dir
