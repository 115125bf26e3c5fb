"""Draft training with optax: data-parallel jit step, evaluation, resumable checkpoints.

Run directory (``TrainConfig.out``)::

    data/                     the feature cache (``FeatureStore``), reused when it matches
    checkpoints/step_XXXXXXX/ state.safetensors (params + optimizer state) + meta.json
                              (step, rng key, data order seed)
    metrics.jsonl             one line per log / evaluation
    draft/                    the final draft in the published layout (``save_draft``):
                              ``checkpoint_format`` "sglang" or "speculators" (vLLM's)

The step is one ``jax.jit`` over a Mesh with a 'data' axis spanning the local devices:
the batch is sharded over 'data', parameters and optimizer state are replicated, and
XLA inserts the gradient all-reduce. The batch of step s is drawn from a numpy
generator seeded by (seed, s) and noise keys are ``fold_in(key, s)``, so a resumed run
draws exactly the batches an uninterrupted run would. The optimizer, the mesh and the
checkpoint files are ``eagle_jax.train.common``'s (shared with target pre-training).

Labels (EAGLE-3, ``label_mode``): "hard" trains each unroll step with cross-entropy
against the target's top-1 token mapped into the draft vocabulary (greedy acceptance).
"soft" distils the target's whole temperature-1 next-token distribution: the forward KL
from the target's distribution restricted to the draft vocabulary (renormalised) to the
draft's, per position weighted by the target mass the draft vocabulary covers (see
``unroll.soft_label_kl``), with the same geometric unroll weights. Acceptance under
rejection sampling is sum_x min(p, q) = 1 - TV(p, q), which the soft loss targets. The
cache then also holds the target's final-norm hidden state (bf16) and its full-vocabulary
logsumexp per position, and the step recomputes the target's draft-vocabulary logits as
``hidden @ lm_head[draft ids].T`` (the [Vd, H] slice gathered once); a hard-label cache is
collected again for a soft run.

LM head (EAGLE-3, ``lm_head``): "own" trains a head over the draft vocabulary (the
``draft_vocab_size`` most frequent target tokens; the target mass outside it can never
be proposed, a ceiling on acceptance when sampling); "target" borrows the target's head,
frozen, over the whole vocabulary, and the saved checkpoint leaves it out (the engine
borrows it again), which also makes the draft smaller by V x H.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from eagle_jax.config import resolve_dtype
from eagle_jax.models.draft import new_draft
from eagle_jax.models.draft_config import (
    CHECKPOINT_FORMATS,
    EAGLE,
    EAGLE3,
    SPECULATORS,
    DraftConfig,
)
from eagle_jax.models.draft_checkpoint import save_draft
from eagle_jax.train import common
from eagle_jax.train import data as data_lib
from eagle_jax.train import unroll


@dataclasses.dataclass
class TrainConfig:
    target: str
    corpus: str
    out: str
    algorithm: str = EAGLE3  # "EAGLE3" or "EAGLE"
    tokenizer: str | None = None  # default: the target directory
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    clip_norm: float = 0.5
    b1: float = 0.9
    b2: float = 0.95
    draft_vocab_size: int | None = None  # EAGLE-3; None = the target vocabulary
    ttt_steps: int = 3  # EAGLE-3 unroll length (7 in published recipes)
    ttt_decay: float = 0.8
    label_mode: str = "hard"  # EAGLE-3: "hard" (target top-1 CE) or "soft" (target distribution KL)
    lm_head: str = "own"  # EAGLE-3: "own" (trained, over the draft vocabulary) or "target" (borrowed)
    eagle1_v_weight: float = 1.0
    eagle1_p_weight: float = 0.1
    eagle1_noise: float = 0.0
    eval_steps: int | None = None  # unroll steps measured at eval (default ttt_steps)
    dtype: str = "float32"  # parameter dtype: float32 or bfloat16
    target_dtype: str | None = None  # default: dtype
    eval_every: int = 100
    save_every: int = 500
    log_every: int = 10
    eval_fraction: float = 0.05
    eval_batches: int = 4
    max_sequences: int | None = None
    chunk_sequences: int = 256
    collect_batch_size: int = 8
    data_dir: str | None = None  # default: out/data
    seed: int = 0
    resume: bool = False
    stop_after: int | None = None  # end this invocation at that step (a later --resume goes on)
    keep_checkpoints: int = 2
    progress: bool = True
    # draft geometry overrides (default: the target's)
    intermediate_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    max_position_embeddings: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None  # EAGLE-3: layer OUTPUT ids (sglang's)
    # layout of the saved draft: "sglang" or "speculators" (EAGLE-3, own LM head)
    checkpoint_format: str = "sglang"


# ----------------------------------------------------------------------------- setup


def draft_config_for(target_cfg, cfg: TrainConfig, d2t_size: int | None) -> DraftConfig:
    """A single-layer draft with the target's geometry (overridable)."""
    t = target_cfg
    heads = cfg.num_heads or t.num_heads
    raw: dict[str, Any] = dict(
        architectures=["LlamaForCausalLMEagle3" if cfg.algorithm == EAGLE3
                       else "LlamaForCausalLMEagle"],
        vocab_size=t.vocab_size, hidden_size=t.hidden_size,
        intermediate_size=cfg.intermediate_size or t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=cfg.num_kv_heads or (t.num_kv_heads if heads == t.num_heads
                                                 else heads),
        head_dim=t.head_dim if heads == t.num_heads else t.hidden_size // heads,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings or t.max_position_embeddings,
        bos_token_id=t.bos_token_id,
        eos_token_id=list(t.eos_token_ids) if t.eos_token_ids else None,
    )
    if t.rope_scaling is not None:
        rs = t.rope_scaling
        raw["rope_scaling"] = dict(rope_type="llama3", factor=rs.factor,
                                   low_freq_factor=rs.low_freq_factor,
                                   high_freq_factor=rs.high_freq_factor,
                                   original_max_position_embeddings=rs.original_max_position_embeddings)
    if cfg.algorithm == EAGLE3:
        raw.update(draft_vocab_size=d2t_size or t.vocab_size, target_hidden_size=t.hidden_size)
        if cfg.aux_layer_ids is not None:
            raw["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
                                       use_aux_hidden_state=True)
    return DraftConfig.from_hf_dict(raw, cfg.algorithm, target_cfg, source="train config")


def prepare_data(target, cfg: TrainConfig, feature_layers) -> data_lib.FeatureStore:
    """The feature cache for this run: reused when its parameters match (and, for soft
    labels, it holds the target's hidden states), else rebuilt."""
    root = cfg.data_dir or os.path.join(cfg.out, "data")
    source = dict(target=os.path.abspath(cfg.target), corpus=os.path.abspath(cfg.corpus),
                  max_sequences=cfg.max_sequences, target_dtype=cfg.target_dtype or cfg.dtype)
    expect = dict(kind=cfg.algorithm, seq_len=cfg.seq_len, source=source,
                  feature_layers=list(feature_layers) if feature_layers else None)
    soft = cfg.label_mode == "soft"
    if data_lib.FeatureStore.matches(root, **expect):
        store = data_lib.FeatureStore(root)
        if store.has_target_hidden or not soft:
            return store
    tokenizer = None
    docs = data_lib.read_corpus(cfg.corpus)
    first = next(docs, None)
    if first is None:
        raise ValueError(f"corpus {cfg.corpus} is empty")
    if isinstance(first, str):
        from eagle_jax.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(cfg.tokenizer or cfg.target)

    def all_docs():
        yield first
        yield from docs

    seqs = data_lib.chunk_sequences(all_docs(), cfg.seq_len, tokenizer, target.config.vocab_size)
    return data_lib.collect_features(
        target, seqs, root, kind=cfg.algorithm, feature_layers=feature_layers,
        seq_len=cfg.seq_len, batch_size=cfg.collect_batch_size,
        chunk_sequences=cfg.chunk_sequences, max_sequences=cfg.max_sequences,
        progress=cfg.progress, source=source, target_hidden=soft)


# ------------------------------------------------------------------------- training


def _batch_indices(seed: int, step: int, pool: np.ndarray, batch: int) -> np.ndarray:
    return np.random.default_rng([seed, step]).choice(pool, size=batch, replace=pool.size < batch)


def train(cfg: TrainConfig) -> dict:
    """Trains a draft for ``cfg.target``; returns a summary (final eval, step, paths)."""
    from eagle_jax.models.decoder import load_decoder  # the target runs only here (data)

    if cfg.algorithm not in (EAGLE, EAGLE3):
        raise ValueError(f"algorithm must be EAGLE or EAGLE3, got {cfg.algorithm!r}")
    if cfg.label_mode not in ("hard", "soft"):
        raise ValueError(f"label_mode must be 'hard' or 'soft', got {cfg.label_mode!r}")
    if cfg.label_mode == "soft" and cfg.algorithm != EAGLE3:
        raise ValueError("label_mode='soft' is for EAGLE3 (EAGLE-1's loss already uses the "
                         "target's distribution)")
    if cfg.lm_head not in ("own", "target"):
        raise ValueError(f"lm_head must be 'own' or 'target', got {cfg.lm_head!r}")
    if cfg.lm_head == "target" and cfg.algorithm != EAGLE3:
        raise ValueError("lm_head='target' is for EAGLE3 (EAGLE-1 always borrows the target's head)")
    if cfg.checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, "
                         f"got {cfg.checkpoint_format!r}")
    if cfg.checkpoint_format == SPECULATORS and (cfg.algorithm != EAGLE3
                                                 or cfg.lm_head != "own"):
        raise ValueError("checkpoint_format='speculators' is for EAGLE3 drafts with their own "
                         "LM head (the layout always carries lm_head.weight): use "
                         "algorithm='EAGLE3', lm_head='own', or checkpoint_format='sglang'")
    soft = cfg.label_mode == "soft"
    own_head = cfg.lm_head == "own"
    os.makedirs(cfg.out, exist_ok=True)
    dtype = resolve_dtype(cfg.dtype)
    target = load_decoder(cfg.target, cfg.target_dtype or cfg.dtype)
    tcfg = target.config

    # features: EAGLE-3 reads the inputs of the aux layers, EAGLE-1 the final hidden
    probe = draft_config_for(tcfg, cfg, None)
    store = prepare_data(target, cfg, probe.feature_layers)
    n = len(store)
    n_eval = max(1, int(round(n * cfg.eval_fraction))) if n > 1 else 0
    train_pool = np.arange(n - n_eval)
    eval_pool = np.arange(n - n_eval, n)
    if train_pool.size == 0:
        raise ValueError(f"only {n} sequence(s) of {cfg.seq_len} tokens: too few to train")

    d2t = None
    if cfg.algorithm == EAGLE3 and cfg.draft_vocab_size and cfg.draft_vocab_size < tcfg.vocab_size:
        if not own_head:
            raise ValueError(f"lm_head='target' predicts over the whole target vocabulary "
                             f"({tcfg.vocab_size}); drop draft_vocab_size={cfg.draft_vocab_size}")
        d2t = data_lib.build_vocab_map(store.counts, cfg.draft_vocab_size)
    dcfg = draft_config_for(tcfg, cfg, None if d2t is None else d2t.size)
    embed = target.embed_tokens.weight.get_value().astype(dtype)
    head = (target.embed_tokens if target.lm_head is None else target.lm_head).weight.get_value()
    draft = new_draft(dcfg, target_embed=embed, target_lm_head=head.astype(dtype),
                      d2t=None if d2t is None else jnp.asarray(d2t), dtype=dtype, seed=cfg.seed,
                      use_kernels=False,  # Pallas kernels have no VJP: the jnp path trains
                      own_lm_head=own_head)
    # soft labels: the target LM head's rows of the draft vocabulary, [Vd, H], in the
    # target's dtype (the target's logits are recomputed exactly from the cached hidden)
    target_head = None
    if soft:
        ids = np.arange(tcfg.vocab_size) if d2t is None else np.arange(d2t.size) + d2t
        target_head = jnp.take(head, jnp.asarray(ids, jnp.int32), axis=0)
    del target, head  # the draft keeps only the arrays it borrows
    t2d_ids = jnp.asarray(data_lib.target_to_draft(d2t, tcfg.vocab_size))

    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    tx = common.make_optimizer(cfg)  # optax's warm-up + cosine schedule over cfg.steps
    opt_state = tx.init(params)
    start, key_data = 0, np.asarray(jax.random.key_data(jax.random.key(cfg.seed)))
    ckpt_root = os.path.join(cfg.out, "checkpoints")
    ckpt = common.latest_checkpoint(ckpt_root) if cfg.resume else None
    if ckpt is not None:
        params, opt_state, meta = common.load_state(ckpt, params, opt_state)
        start, key_data = int(meta["step"]), np.asarray(meta["key"], np.uint32)
    base_key = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32))

    _, replicated, sharded = common.data_parallel(cfg.batch_size)
    params, opt_state, rest, t2d_ids, target_head = jax.device_put(
        (params, opt_state, rest, t2d_ids, target_head), replicated)
    eval_steps = cfg.eval_steps or max(cfg.ttt_steps, 1)

    def loss_fn(params, rest, batch, key):
        model = nnx.merge(graphdef, params, rest)
        if cfg.algorithm == EAGLE3:
            return unroll.eagle3_loss(model, batch, cfg.ttt_steps, t2d_ids, cfg.ttt_decay,
                                      label_mode=cfg.label_mode, target_head=target_head)
        return unroll.eagle1_loss(model, batch, v_weight=cfg.eagle1_v_weight,
                                  p_weight=cfg.eagle1_p_weight, noise_key=key,
                                  noise_std=cfg.eagle1_noise)

    @jax.jit
    def train_step(params, opt_state, rest, batch, step):
        key = jax.random.fold_in(base_key, step)
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(loss=loss, parts=parts, grad_norm=optax.tree.norm(grads))

    @jax.jit
    def eval_step(params, rest, batch):
        return unroll.step_metrics(nnx.merge(graphdef, params, rest), batch, eval_steps,
                                   target_head=target_head)

    def device_batch(idx):  # host -> shards, one transfer
        return jax.device_put(store.get(idx, with_target_hidden=soft), sharded)

    def evaluate(params) -> dict | None:
        """Held-out per-step top-1 agreement ("eval_acc") and, for soft-label data, the
        expected acceptance of a sampled draft token ("eval_accept", ``step_metrics``)."""
        if eval_pool.size == 0:
            return None
        sums: dict[str, np.ndarray] = {}
        for i in range(cfg.eval_batches):
            idx = eval_pool[np.arange(i * cfg.batch_size, (i + 1) * cfg.batch_size) % eval_pool.size]
            for k, v in jax.device_get(eval_step(params, rest, device_batch(idx))).items():
                sums[k] = sums.get(k, 0.0) + np.asarray(v, np.float64)
            if (i + 1) * cfg.batch_size >= eval_pool.size:
                break
        count = np.maximum(sums.pop("count"), 1)
        out = dict(eval_acc=[float(x) for x in sums["correct"] / count])
        if "accept" in sums:
            out["eval_accept"] = [float(x) for x in sums["accept"] / count]
        return out

    log_path = os.path.join(cfg.out, "metrics.jsonl")

    def log(record):
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    history = []
    initial = evaluate(params) if start == 0 and cfg.eval_every else None
    if initial is not None:
        log(dict(step=0, **initial))
        history.append(dict(step=0, **initial))
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc="train draft",
               disable=not cfg.progress)
    t0 = time.time()
    for step in bar:
        batch = device_batch(_batch_indices(cfg.seed, step, train_pool, cfg.batch_size))
        params, opt_state, m = train_step(params, opt_state, rest, batch, jnp.int32(step))
        done = step + 1
        if done % cfg.log_every == 0 or done == end:
            m = jax.device_get(m)
            rec = dict(step=done, loss=float(m["loss"]), parts=[float(x) for x in m["parts"]],
                       grad_norm=float(m["grad_norm"]), elapsed_s=round(time.time() - t0, 2))
            bar.set_postfix(loss=f"{rec['loss']:.4f}")
            log(rec)
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            ev = evaluate(params)
            if ev is not None:
                log(dict(step=done, **ev))
                history.append(dict(step=done, **ev))
                bar.write(f"step {done}: draft top-1 accuracy per step " +
                          " ".join(f"{a:.3f}" for a in ev["eval_acc"]) +
                          ("; expected acceptance at T=1 " +
                           " ".join(f"{a:.3f}" for a in ev["eval_accept"])
                           if "eval_accept" in ev else ""))
        if cfg.save_every and (done % cfg.save_every == 0 or done in (cfg.steps, end)):
            common.save_state(common.step_dir(ckpt_root, done), params, opt_state,
                              dict(step=done, key=[int(k) for k in key_data], seed=cfg.seed,
                                   algorithm=cfg.algorithm, label_mode=cfg.label_mode))
            common.prune_checkpoints(ckpt_root, cfg.keep_checkpoints)
    bar.close()

    final = nnx.merge(graphdef, jax.device_get(params), jax.device_get(rest))
    draft_dir = os.path.join(cfg.out, "draft")
    save_draft(final, draft_dir, checkpoint_format=cfg.checkpoint_format,
               verifier=cfg.target if cfg.checkpoint_format == SPECULATORS else None,
               write_target_head=own_head)
    last = history[-1] if history else {}
    first = initial or {}
    return dict(step=max(start, end), initial_eval_acc=first.get("eval_acc"),
                final_eval_acc=last.get("eval_acc"), initial_eval_accept=first.get("eval_accept"),
                final_eval_accept=last.get("eval_accept"),
                history=history, draft_dir=draft_dir, resumed_from=ckpt, draft=final)
