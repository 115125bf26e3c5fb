"""Loading and saving EAGLE-1 / EAGLE-3 drafts in the published checkpoint layouts.

EAGLE-3, sglang layout (``LlamaForCausalLMEagle3``; yuhuili/EAGLE3-*, SpecForge outputs)::

    fc.weight                                   [H, n * Ht]   (n = number of aux layers, 3)
    midlayer.input_layernorm.weight             [H]
    midlayer.hidden_norm.weight                 [H]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * D, 2H]
    midlayer.self_attn.o_proj.weight            [H, N * D]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [Vd, H]  (absent: the target's head, Vd == V)
    d2t                                         int64 [Vd]  target_id = draft_id + d2t[draft_id]
    t2d                                         bool [V]    True where a target id is drafted
    embed_tokens.weight                         [V, H]   optional (absent: the target's)

EAGLE-3, speculators layout (``speculators_model_type: "eagle3"``; ``Eagle3Speculator``,
``Eagle3DraftModel``; what vLLM reads): the same tensors with ``layers.0.*`` in place of
``midlayer.*``; ``lm_head.weight`` always present; ``d2t`` / ``t2d`` absent when Vd == V;
``embed_tokens.weight`` optional (speculators' trainer writes a copy of the target's).
Its config and aux-layer-id convention: ``draft_config.DraftConfig``.

EAGLE-1 (yuhuili/EAGLE-*; sglang ``LlamaForCausalLMEagle``)::

    fc.weight [H, 2H], fc.bias [H], layers.{i}.* (a Llama layer; layer 0 has no
    input_layernorm), embed_tokens.weight optional. The LM head is always the target's.

Kind detection (``detect_kind``): a ``speculators_model_type`` key means speculators
(``eagle3`` only). Else ``architectures`` naming an EAGLE-3 class
(``LlamaForCausalLMEagle3``, ``Eagle3LlamaForCausalLM``) or an EAGLE-1 class
(``LlamaForCausalLMEagle``, ``EagleLlamaForCausalLM``) decides. Anything else (the
published EAGLE-1 checkpoints say plain ``LlamaForCausalLM``) is decided by the tensors:
``midlayer.*`` means EAGLE-3, ``fc.weight`` with ``layers.0.*`` means EAGLE-1; neither is
an error. Tensor names may carry a ``model.`` prefix (some conversions write one).

Pickle checkpoints (``pytorch_model.bin``, as the published LLaMA-3.1-8B EAGLE-3 draft
ships) are never read: ``scripts/convert_checkpoint.py`` turns them into safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.checkpoint import (
    CheckpointError,
    CheckpointReader,
    dotted,
    load_into,
    module_tensors,
    save_sharded,
)
from eagle_jax.config import read_json, resolve_dtype
from eagle_jax.models.draft import Eagle1Draft, Eagle3Draft
from eagle_jax.models.draft_config import (
    EAGLE,
    EAGLE1_ARCHITECTURES,
    EAGLE3,
    EAGLE3_ARCHITECTURES,
    SGLANG,
    SPECULATORS,
    DraftConfig,
)

if TYPE_CHECKING:  # only for annotations: loading reads the target's arrays, never runs it
    from eagle_jax.models.decoder import Decoder

Draft = Eagle1Draft | Eagle3Draft


def detect_kind(cfg: dict, reader: CheckpointReader, source: str) -> str:
    """"EAGLE" or "EAGLE3" from config.json (speculators_model_type, else architectures),
    else from the tensors."""
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise CheckpointError(
                f"{source}: speculators_model_type {cfg['speculators_model_type']!r}: eagle_jax "
                "reads speculators' 'eagle3' drafts only (EAGLE-1 drafts load from the sglang "
                "layout)")
        return EAGLE3
    archs = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return EAGLE3
    if any(a in EAGLE1_ARCHITECTURES for a in archs):
        return EAGLE
    names = set(reader.keys())
    stripped = {n[len("model."):] if n.startswith("model.") else n for n in names}
    if any(n.startswith("midlayer.") for n in stripped):
        return EAGLE3
    if "fc.weight" in stripped and any(n.startswith("layers.0.") for n in stripped):
        return EAGLE
    raise CheckpointError(
        f"{source}: not an EAGLE draft: architectures {archs!r} name no EAGLE class and the "
        "checkpoint has neither midlayer.* (EAGLE-3) nor fc.weight + layers.0.* (EAGLE-1)")


# the EAGLE-3 decoder layer's checkpoint prefix in each layout (the module's is "midlayer.")
_MIDLAYER_PREFIX = {SGLANG: "midlayer.", SPECULATORS: "layers.0."}


def _name_fn(prefix: str, checkpoint_format: str = SGLANG):
    """Parameter path -> checkpoint name in ``checkpoint_format`` (``prefix`` before all
    but the LM head)."""
    midlayer = _MIDLAYER_PREFIX[checkpoint_format]

    def name_of(path: tuple) -> str:
        name = dotted(path)
        if name.startswith("midlayer."):
            name = midlayer + name[len("midlayer."):]
        return name if name.startswith("lm_head") else prefix + name
    return name_of


def _target_arrays(target: "Decoder") -> tuple[jax.Array, jax.Array]:
    """The target's embedding and LM head arrays themselves (shared, not copied)."""
    embed = target.embed_tokens.weight.get_value()
    head = embed if target.lm_head is None else target.lm_head.weight.get_value()
    return embed, head


def _read_vocab_map(reader: CheckpointReader, cfg: DraftConfig, prefix: str) -> np.ndarray | None:
    """Validated d2t [Vd] int32 (None: the identity map over the whole vocabulary)."""
    name = prefix + "d2t" if prefix + "d2t" in reader else "d2t"
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    if name not in reader:
        if vd != v:
            raise CheckpointError(
                f"{reader.model_dir}: draft_vocab_size {vd} < vocab_size {v} but the checkpoint "
                "has no 'd2t' tensor mapping draft ids to target ids")
        return None
    d2t = np.asarray(reader.get(name, expected_shape=(vd,))).astype(np.int64)
    target_ids = np.arange(vd) + d2t
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= v))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(
            f"{reader.file_of(name)}: d2t maps draft id {i} to target id {int(target_ids[i])}, "
            f"outside the target vocabulary [0, {v})")
    if np.unique(target_ids).size != vd:
        raise CheckpointError(f"{reader.file_of(name)}: d2t maps two draft ids to one target id")
    t2d_name = prefix + "t2d" if prefix + "t2d" in reader else "t2d"
    if t2d_name in reader:
        t2d = np.asarray(reader.get(t2d_name, expected_shape=(v,))).astype(bool)
        if int(t2d.sum()) != vd or not t2d[target_ids].all():
            raise CheckpointError(
                f"{reader.file_of(t2d_name)}: t2d ({int(t2d.sum())} ids set) disagrees with d2t "
                f"({vd} draft ids)")
    if vd == v and not d2t.any():
        return None
    return d2t.astype(np.int32)


def load_draft(draft_dir: str, target: "Decoder", dtype="float32", *,
               use_kernels: bool = True) -> Draft:
    """Builds the EAGLE-1 / EAGLE-3 draft in ``draft_dir`` against ``target``.

    The draft borrows the target's embedding when the checkpoint has none, and the
    target's LM head (EAGLE-1 always; EAGLE-3 when it has no ``lm_head.weight``):
    the same arrays, no copy. Raises CheckpointError / ValueError naming the file and
    the value on a mismatch with the target (hidden size, vocabulary, aux layers).
    ``use_kernels=False`` keeps the Pallas kernels out (training: they have no VJP).
    """
    draft_dir = os.fspath(draft_dir)
    source = os.path.join(draft_dir, "config.json")
    raw = read_json(source)
    reader = CheckpointReader(draft_dir)
    kind = detect_kind(raw, reader, source)
    cfg = DraftConfig.from_hf_dict(raw, kind, target.config, source)
    dtype = resolve_dtype(dtype)
    prefix = "model." if ("fc.weight" not in reader and "model.fc.weight" in reader) else ""
    own_embed = prefix + "embed_tokens.weight" in reader
    t_embed, t_head = _target_arrays(target)
    if not own_embed and t_embed.shape[1] != cfg.hidden_size:
        raise CheckpointError(
            f"{draft_dir}: no embed_tokens.weight and the target's embedding has width "
            f"{t_embed.shape[1]} != the draft's hidden_size {cfg.hidden_size}")
    if kind == EAGLE:
        draft = nnx.eval_shape(lambda: Eagle1Draft(
            cfg, own_embed=own_embed, dtype=dtype, rngs=nnx.Rngs(0), use_kernels=use_kernels))
        load_into(draft, reader, _name_fn(prefix), dtype)
        draft.bind_target(t_embed, t_head)
        return draft
    own_head = "lm_head.weight" in reader or prefix + "lm_head.weight" in reader
    if not own_head and not cfg.tie_word_embeddings and (
            cfg.draft_vocab_size != cfg.vocab_size or t_head.shape[1] != cfg.hidden_size):
        raise CheckpointError(
            f"{draft_dir}: no lm_head.weight; the target's LM head {tuple(t_head.shape)} cannot "
            f"serve draft_vocab_size {cfg.draft_vocab_size} x hidden_size {cfg.hidden_size}")
    d2t = _read_vocab_map(reader, cfg, prefix)
    draft = nnx.eval_shape(lambda: Eagle3Draft(
        cfg, own_embed=own_embed, own_lm_head=own_head, dtype=dtype, rngs=nnx.Rngs(0),
        use_kernels=use_kernels))
    head_prefix = prefix if prefix + "lm_head.weight" in reader else ""
    name_of = _name_fn(prefix, cfg.checkpoint_format)
    load_into(draft, reader,
              lambda p: head_prefix + name_of(p) if p[0] == "lm_head" else name_of(p), dtype)
    draft.bind_target(t_embed, None if own_head else t_head,
                      None if d2t is None else jnp.asarray(d2t))
    return draft


def vocab_maps(d2t: np.ndarray | None, draft_vocab_size: int,
               vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [Vd], t2d bool [V]) as the published EAGLE-3 checkpoints store them."""
    d2t = np.zeros(draft_vocab_size, np.int64) if d2t is None else np.asarray(d2t, np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[np.arange(draft_vocab_size) + d2t] = True
    return d2t, t2d


def save_draft(draft: Draft, out_dir: str, dtype=None, *, checkpoint_format: str | None = None,
               verifier: str | None = None, write_target_head: bool = True) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in a published layout.

    ``checkpoint_format``: "sglang" or "speculators" (EAGLE-3 only); None = the draft's own
    (``draft.config.checkpoint_format``: the layout it was loaded from). ``verifier``: the
    target's name or path that the speculators config names (``speculators_config.verifier.
    name_or_path``; None = the draft config's, null when unknown: vLLM takes the target
    from its own arguments, speculators' loader needs it set).
    EAGLE-3 gets ``lm_head.weight`` (the target's head is written out when the draft
    borrowed it, unless ``write_target_head=False``: then the sglang checkpoint has no head
    and ``load_draft`` borrows the target's again, as sglang's ``load_lm_head_from_target``;
    the speculators layout always carries the head), ``d2t`` (int64) and ``t2d`` (bool)
    (speculators: only when they are not the identity); the embedding is written
    only when the draft owns one. EAGLE-1's config says ``LlamaForCausalLMEagle`` (sglang's
    class; ``load_draft`` also accepts the plain ``LlamaForCausalLM`` of the originals).
    """
    cfg = draft.config
    if any(getattr(m, "quant", None) is not None for _, m in nnx.iter_graph(draft)):
        raise ValueError("this draft's linear layers were quantized to FP8 on the fly "
                         "(draft_quantization); save the float draft it was loaded from")
    if checkpoint_format is not None:
        cfg = dataclasses.replace(cfg, checkpoint_format=checkpoint_format)
    if verifier is not None:
        cfg = dataclasses.replace(cfg, verifier=verifier)
    speculators = cfg.checkpoint_format == SPECULATORS
    if speculators and not write_target_head:
        raise ValueError("write_target_head=False: the speculators layout always carries "
                         "lm_head.weight (speculators' Eagle3 model loads its head from the "
                         f"checkpoint); save with checkpoint_format {SGLANG!r} to leave it out")
    hf = cfg.to_hf_dict()  # first: it refuses what the layout cannot hold
    os.makedirs(out_dir, exist_ok=True)
    cast = None if dtype is None else resolve_dtype(dtype)
    tensors = module_tensors(draft, _name_fn("", cfg.checkpoint_format), cast)
    if draft.kind == EAGLE3:
        if draft.lm_head is None and (speculators or (not cfg.tie_word_embeddings
                                                      and write_target_head)):
            w = np.asarray(jax.device_get(draft.lm_head_weight()))
            tensors["lm_head.weight"] = w if cast is None else w.astype(cast)
        d2t = None if draft.d2t is None else np.asarray(jax.device_get(draft.d2t))
        if not (speculators and d2t is None):  # speculators: no maps for the identity
            tensors["d2t"], tensors["t2d"] = vocab_maps(d2t, cfg.draft_vocab_size,
                                                        cfg.vocab_size)
    dtype_name = np.dtype(cast if cast is not None else draft.dtype).name
    hf["torch_dtype"] = dtype_name
    if speculators:
        hf["transformer_layer_config"]["torch_dtype"] = dtype_name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_sharded(out_dir, tensors)
