"""Training a small Llama-architecture target from scratch on a pre-tokenised corpus.

CLI: ``scripts/train_target.py``. The corpus directory is ``scripts/build_corpus.py``'s:
``train.npy`` / ``heldout.npy`` (uint16 ids) and the tokenizer files.

* Model: ``eagle_jax.models.decoder.Decoder`` as the engine serves it (tied embeddings),
  called exactly as at inference: tokens [B, T], positions arange(T), a fresh zero KV cache
  of length T. Parameters are float32 master weights; the forward runs in ``dtype``
  (bfloat16 by default: the parameters are cast inside the loss, so gradients and the
  optimizer stay float32); logits and the loss are float32.
* Data: the batch of step s is ``batch_size`` random windows of ``seq_len + 1`` tokens of
  the train array, drawn by ``numpy.random.default_rng([seed, s])``, so a resumed run sees
  exactly the batches an uninterrupted run would. Held-out loss: the first
  ``eval_tokens`` tokens of ``heldout.npy`` cut into consecutive windows.
* Optimizer: AdamW (b1 0.9, b2 0.95, decoupled weight decay on matrices only), global-norm
  clipping, linear warm-up then cosine decay to ``min_lr_ratio * lr`` over ``steps``. The
  learning rate is computed inside the jitted step from (step, total_steps), so fitting
  ``total_steps`` to the time budget (``fit_steps_to_budget``) needs no recompilation.
* Parallelism: one ``jax.jit`` over a Mesh with a 'data' axis spanning the local devices;
  the batch is sharded over 'data', parameters and optimizer state are replicated.
* Time budget: the loop stops before a step that would end past ``time_budget_s`` (counted
  from the start of ``train_target``), then evaluates and saves. With
  ``fit_steps_to_budget`` the step time is measured over steps 5..25 (still in warm-up,
  where the schedule does not depend on the total) and the total is set so that the cosine
  ends at the budget (never above ``steps``). With ``export_best``, a run whose final
  held-out loss is above that of an earlier evaluation exports the earlier parameters.

Run directory (``out``)::

    ckpt/step_XXXXXXX/      state.safetensors (params + optimizer state) + meta.json
    train_log.json          config, per-log-step records, evaluations, final result

The final model is exported to ``export_dir`` (default ``out``) as a Hugging Face
checkpoint (bfloat16 safetensors shards of at most ``max_shard_bytes``, config.json,
generation_config.json, the tokenizer files). The optimizer, learning rate, mesh and
checkpoint files are ``eagle_jax.train.common``'s (shared with draft training).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle_jax.config import ModelConfig, resolve_dtype
from eagle_jax.train import common

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@dataclasses.dataclass
class TargetTrainConfig:
    corpus: str
    out: str
    export_dir: str | None = None  # default: out
    layers: int = 8
    hidden: int = 384
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 1024
    seq_len: int = 512
    batch_size: int = 64  # global (sequences)
    steps: int = 2000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    dtype: str = "bfloat16"  # compute dtype; master weights are always float32
    seed: int = 0
    eval_every: int = 200
    save_every: int = 500
    log_every: int = 10
    eval_tokens: int = 1 << 19
    resume: bool = False
    stop_after: int | None = None  # end this invocation at that step (continue with resume)
    time_budget_s: float | None = None
    fit_steps_to_budget: bool = False
    export_best: bool = False  # export the evaluated parameters with the lowest held-out loss
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_shard_bytes: int = 15 * 10**6
    keep_checkpoints: int = 2
    progress: bool = True


# ----------------------------------------------------------------------------- setup


def read_tokenizer_info(corpus: str) -> dict:
    """vocab_size (with added tokens), eos / bos / pad ids from the corpus's tokenizer."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(corpus, "tokenizer.json"))
    with open(os.path.join(corpus, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)

    def tid(key):
        v = tcfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return None if v is None else tok.token_to_id(v)

    eos = tid("eos_token")
    if eos is None:
        raise ValueError(f"{corpus}/tokenizer_config.json names no eos_token")
    return dict(vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_token_id=eos,
                bos_token_id=tid("bos_token"), pad_token_id=tid("pad_token"))


def hf_config(cfg: TargetTrainConfig, tok: dict) -> dict:
    """The Hugging Face LlamaForCausalLM config of the model."""
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden {cfg.hidden} is not a multiple of heads {cfg.heads}")
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=tok["vocab_size"], hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads, hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=None, attention_bias=False,
        attention_dropout=0.0, mlp_bias=False, initializer_range=0.02, pretraining_tp=1,
        tie_word_embeddings=True, use_cache=True, torch_dtype="bfloat16",
        bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"],
        pad_token_id=tok["pad_token_id"],
    )


def new_model(mcfg: ModelConfig, seed: int):
    """A float32 Decoder, N(0, 0.02) weights; residual output projections (o_proj,
    down_proj) scaled by 1/sqrt(2 L) (GPT-2's initialisation)."""
    from eagle_jax.models.decoder import Decoder

    model = Decoder(mcfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    scale = 1.0 / math.sqrt(2 * mcfg.num_layers)
    for layer in model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.weight.set_value(lin.weight[...] * scale)
    return model


def param_count(tree) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)))


def sample_windows(data: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """[batch, seq_len + 1] int32 random windows of ``data`` for step ``step``."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, data.size - seq_len, size=batch)  # start + seq_len + 1 <= size
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def eval_windows(data: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Consecutive [n, seq_len + 1] windows (overlapping by one token) of the first
    ``max_tokens`` tokens."""
    n = min(data.size, max_tokens)
    count = (n - 1) // seq_len
    if count <= 0:
        return np.zeros((0, seq_len + 1), np.int32)
    idx = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)
    return data[idx].astype(np.int32)


# ---------------------------------------------------------------------------- export


def export_hf(params, graphdef, rest, hf: dict, tok: dict, corpus: str, export_dir: str,
              max_shard_bytes: int) -> list[str]:
    """The Hugging Face checkpoint: bf16 shards, config, generation config, tokenizer."""
    from eagle_jax.models.decoder import save_decoder

    os.makedirs(export_dir, exist_ok=True)
    for old in glob.glob(os.path.join(export_dir, "*.safetensors")) + glob.glob(
            os.path.join(export_dir, "model.safetensors.index.json")):
        os.remove(old)
    model = nnx.merge(graphdef, jax.device_get(params), rest)
    save_decoder(model, export_dir, hf, dtype=jnp.bfloat16, max_shard_bytes=max_shard_bytes)
    gen = {"_from_model_config": True, "bos_token_id": tok["bos_token_id"],
           "eos_token_id": tok["eos_token_id"]}
    if tok["pad_token_id"] is not None:
        gen["pad_token_id"] = tok["pad_token_id"]
    with open(os.path.join(export_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    for name in TOKENIZER_FILES:
        src = os.path.join(corpus, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(export_dir, name))
    return sorted(os.listdir(export_dir))


def safetensors_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))


# ------------------------------------------------------------------------- training


def train_target(cfg: TargetTrainConfig) -> dict:
    """Trains (or resumes) the target; exports it; returns a summary dict."""
    from tqdm.auto import tqdm

    t_begin = time.time()
    out = cfg.out
    export_dir = cfg.export_dir or out
    os.makedirs(out, exist_ok=True)
    cdtype = resolve_dtype(cfg.dtype)
    tok = read_tokenizer_info(cfg.corpus)
    hf = hf_config(cfg, tok)
    mcfg = ModelConfig.from_hf_dict(hf, "train_target")

    train_data = np.load(os.path.join(cfg.corpus, "train.npy"))
    held_path = os.path.join(cfg.corpus, "heldout.npy")
    held_data = np.load(held_path) if os.path.exists(held_path) else np.zeros(0, np.uint16)
    if train_data.size < cfg.seq_len + 2:
        raise ValueError(f"train.npy holds {train_data.size} tokens: too few for "
                         f"seq_len {cfg.seq_len}")
    if int(train_data.max()) >= tok["vocab_size"]:
        raise ValueError("train.npy holds ids outside the tokenizer's vocabulary")

    devices, replicated, sharded = common.data_parallel(cfg.batch_size)
    n_dev = len(devices)

    model = new_model(mcfg, cfg.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    n_params = param_count(params)
    # the learning rate is applied in the step (from (step, total): total may be refitted)
    tx = common.make_optimizer(cfg, lr_in_step=True, decay_mask=common.matrices_only)
    opt_state = tx.init(params)

    start, total, prev_wall, records, resumed_from = 0, cfg.steps, 0.0, [], None
    ckpt_root = os.path.join(out, "ckpt")
    ckpt = common.latest_checkpoint(ckpt_root) if cfg.resume else None
    if not cfg.resume and common.latest_checkpoint(ckpt_root) is not None:
        raise ValueError(f"{out}/ckpt holds checkpoints of an earlier run: pass --resume to "
                         "continue it, or use a fresh --out")
    if ckpt is not None:
        params, opt_state, meta = common.load_state(ckpt, params, opt_state)
        if meta.get("hf_config", {}).get("hidden_size") != hf["hidden_size"] or \
                meta.get("hf_config", {}).get("num_hidden_layers") != hf["num_hidden_layers"]:
            raise ValueError(f"{ckpt} was trained with another model shape")
        start, total = int(meta["step"]), int(meta["total_steps"])
        prev_wall, resumed_from = float(meta.get("wall_s", 0.0)), ckpt
        log_path = os.path.join(out, "train_log.json")
        if os.path.exists(log_path):
            with open(log_path) as f:
                records = [r for r in json.load(f).get("records", []) if r["step"] <= start]
    fit_pending = cfg.fit_steps_to_budget and cfg.time_budget_s is not None and ckpt is None
    params, opt_state = jax.device_put((params, opt_state), replicated)

    # float32 masters, `cdtype` compute
    def cast(p):
        return jax.tree.map(lambda a: a.astype(cdtype) if jnp.issubdtype(a.dtype, jnp.floating)
                            else a, p)

    def token_nll(params, tokens):
        """tokens [B, T + 1] -> next-token NLL [B, T] float32."""
        model = nnx.merge(graphdef, cast(params), rest)
        x, y = tokens[:, :-1], tokens[:, 1:]
        b, t = x.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits = model(x, pos, None).logits  # f32 [B, T, V]; no cache: differentiable
        gold = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - gold

    def train_step(params, opt_state, tokens, step, total_steps):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(token_nll(p, tokens)))(params)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                 for g in jax.tree_util.tree_leaves(grads)))
        updates, opt_state = tx.update(grads, opt_state, params)
        lr = common.warmup_cosine_lr(step, total_steps, cfg)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(loss=loss, grad_norm=grad_norm, lr=lr)

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    @jax.jit
    def eval_step(params, tokens, weights):
        nll = token_nll(params, tokens)
        return jnp.sum(nll * weights[:, None]), jnp.sum(weights) * nll.shape[1]

    eval_seqs = eval_windows(held_data, cfg.seq_len, cfg.eval_tokens)
    eval_bs = cfg.batch_size
    n_eval_batches = -(-len(eval_seqs) // eval_bs)

    def evaluate(params) -> float | None:
        if len(eval_seqs) == 0:
            return None
        total_nll, count = 0.0, 0.0
        for i in range(n_eval_batches):
            chunk = eval_seqs[i * eval_bs:(i + 1) * eval_bs]
            w = np.ones(eval_bs, np.float32)
            if len(chunk) < eval_bs:
                w[len(chunk):] = 0.0
                chunk = np.concatenate([chunk, np.repeat(chunk[:1], eval_bs - len(chunk), 0)])
            s, c = eval_step(params, jax.device_put(chunk, sharded), jax.device_put(w, sharded))
            total_nll, count = total_nll + float(s), count + float(c)
        return total_nll / count

    def write_log(final=None):
        with open(os.path.join(out, "train_log.json"), "w") as f:
            json.dump(dict(config=dataclasses.asdict(cfg), hf_config=hf, params=n_params,
                           devices=[str(d) for d in devices], total_steps=total,
                           resumed_from=resumed_from, records=records, final=final), f, indent=1)

    def checkpoint(step):
        common.save_state(common.step_dir(ckpt_root, step), params, opt_state,
                          dict(step=step, total_steps=total, seed=cfg.seed, hf_config=hf,
                               wall_s=prev_wall + time.time() - t_begin))
        common.prune_checkpoints(ckpt_root, cfg.keep_checkpoints)

    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_token = 6 * n_params + 12 * cfg.layers * cfg.hidden * cfg.seq_len
    print(f"target: {n_params / 1e6:.2f}M params ({2 * n_params / 1e6:.1f} MB bf16), "
          f"vocab {tok['vocab_size']}, {n_dev} device(s) {devices[0].platform}, "
          f"{tokens_per_step} tokens/step, ~{flops_per_token / 1e6:.0f} MFLOP/token; "
          f"train {train_data.size} tokens, held-out {len(eval_seqs)} x {cfg.seq_len}; "
          f"steps {start} -> {total}", flush=True)

    bar = tqdm(total=total, initial=start, desc="train target", disable=not cfg.progress,
               dynamic_ncols=True)
    step = start
    last_t, last_step = time.time(), start
    calib = {}
    step_time = None  # seconds per step (measured)
    last_print = 0.0
    stopped_by_budget = False
    best = None  # (held-out loss, step, host params) with export_best
    while step < (total if cfg.stop_after is None else min(total, cfg.stop_after)):
        if cfg.time_budget_s is not None and step_time is not None and \
                time.time() - t_begin + step_time > cfg.time_budget_s:
            stopped_by_budget = True
            break
        batch = jax.device_put(sample_windows(train_data, cfg.seed, step, cfg.batch_size,
                                              cfg.seq_len), sharded)
        params, opt_state, m = train_step(params, opt_state, batch, jnp.int32(step),
                                          jnp.int32(total))
        step += 1
        bar.update(1)
        if fit_pending and step - start in (5, 25):
            jax.block_until_ready(m["loss"])
            calib[step - start] = time.time()
            if step - start == 25:
                fit_pending = False
                rate = (calib[25] - calib[5]) / 20
                elapsed = calib[25] - t_begin
                per_step = rate * (1 + (n_eval_batches / 3) / max(cfg.eval_every, 1)) \
                    + 1.0 / max(cfg.save_every, 1)  # eval forwards ~1/3 step; ~1 s per save
                fit = step + int(max(cfg.time_budget_s - elapsed - 5.0, 0) * 0.97 / per_step)
                new_total = max(step + 1, min(cfg.steps, fit))
                print(f"\nmeasured {rate * 1e3:.1f} ms/step = {tokens_per_step / rate:,.0f} "
                      f"tokens/s = {flops_per_token * tokens_per_step / rate / 1e12:.3g} "
                      f"TFLOP/s; total steps {total} -> {new_total} to fit "
                      f"{cfg.time_budget_s:.0f} s "
                      f"({new_total * tokens_per_step / train_data.size:.1f} epochs)", flush=True)
                total = new_total
                bar.total = total
                bar.refresh()
        if step % cfg.log_every == 0 or step == total or step == cfg.stop_after:
            mh = jax.device_get(m)
            now = time.time()
            dt = max(now - last_t, 1e-9)
            tps = (step - last_step) * tokens_per_step / dt
            if step - last_step >= 2 and step - start > cfg.log_every:  # skip compile
                step_time = dt / (step - last_step)
            elif step_time is None:
                step_time = dt / max(step - last_step, 1)
            last_t, last_step = now, step
            rec = dict(step=step, loss=round(float(mh["loss"]), 5),
                       grad_norm=round(float(mh["grad_norm"]), 4), lr=float(mh["lr"]),
                       tokens_per_s=round(tps), wall_s=round(prev_wall + now - t_begin, 2))
            records.append(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}")
            if not cfg.progress and now - last_print >= 15.0:
                last_print = now
                print(f"step {step}/{total} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                      f"{tps:,.0f} tokens/s wall {rec['wall_s']:.0f} s", flush=True)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
            hl = evaluate(params)
            if hl is not None:
                records.append(dict(step=step, heldout_loss=round(hl, 5),
                                    heldout_ppl=round(math.exp(min(hl, 50)), 3),
                                    wall_s=round(prev_wall + time.time() - t_begin, 2)))
                bar.write(f"step {step}: held-out loss {hl:.4f} ppl {math.exp(min(hl, 50)):.2f}")
                if cfg.export_best and (best is None or hl < best[0]):
                    best = (hl, step, jax.device_get(params))
            write_log()
            last_t = time.time()  # evaluation time is not training throughput
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            checkpoint(step)
            last_t = time.time()
    bar.close()

    train_wall = time.time() - t_begin
    hl = evaluate(params)
    final = dict(step=step, total_steps=total, stopped_by_budget=stopped_by_budget,
                 heldout_loss=None if hl is None else round(hl, 5),
                 heldout_ppl=None if hl is None else round(math.exp(min(hl, 50)), 3),
                 train_loss=next((r["loss"] for r in reversed(records) if "loss" in r), None),
                 tokens_seen=step * tokens_per_step,
                 epochs=round(step * tokens_per_step / train_data.size, 2))
    if hl is not None:
        records.append(dict(step=step, heldout_loss=final["heldout_loss"],
                            heldout_ppl=final["heldout_ppl"],
                            wall_s=round(prev_wall + time.time() - t_begin, 2)))
    if step > start or ckpt is None:
        checkpoint(step)
    export_params, final["exported_step"] = params, step
    if best is not None and hl is not None and best[0] < hl:
        export_params, final["exported_step"] = best[2], best[1]
        final["exported_heldout_loss"] = round(best[0], 5)
        print(f"held-out loss rose to {hl:.4f}: exporting step {best[1]} "
              f"(held-out loss {best[0]:.4f})", flush=True)
    files = export_hf(export_params, graphdef, rest, hf, tok, cfg.corpus, export_dir,
                      cfg.max_shard_bytes)
    tps = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > start + 2 *
           cfg.log_every]
    final.update(params=n_params, export_dir=export_dir, files=files,
                 safetensors_bytes=safetensors_bytes(export_dir),
                 tokens_per_s=round(float(np.median(tps))) if tps else None,
                 train_wall_s=round(train_wall, 1), wall_s=round(time.time() - t_begin, 1),
                 resumed_from=resumed_from)
    write_log(final)
    print(f"final: step {step}/{total}, held-out loss {final['heldout_loss']} "
          f"ppl {final['heldout_ppl']}, median {final['tokens_per_s']} tokens/s, "
          f"{final['safetensors_bytes'] / 1e6:.2f} MB safetensors in {export_dir}", flush=True)
    return final
