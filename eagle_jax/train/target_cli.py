"""Train a small Llama-architecture target from scratch on a build-corpus corpus.

Toy size on a CPU:

    eagle-jax train-target --corpus /tmp/corpus --out /tmp/target --layers 2 \\
        --hidden 32 --heads 4 --kv-heads 2 --intermediate 64 --seq-len 64 --batch-size 8 \\
        --steps 50 --warmup 10 --dtype float32

The embedded default model on one GPU (~31 MB of bf16 safetensors):

    eagle-jax train-target --corpus corpus --out runs/target --export-dir model/target \\
        --layers 8 --hidden 384 --heads 6 --kv-heads 2 --intermediate 1024 --seq-len 512 \\
        --batch-size 64 --steps 20000 --lr 3e-3 --warmup 200 --time-budget-s 240 \\
        --fit-steps-to-budget

``--resume`` continues from the newest checkpoint in OUT/ckpt (parameters, optimizer
state, step, the total step count of the schedule). ``--time-budget-s`` stops the loop
before the budget would be exceeded (then evaluates, saves and exports);
``--fit-steps-to-budget`` measures the step time early (during warm-up) and shortens the
cosine schedule so that it ends at the budget. The Hugging Face checkpoint (bf16,
shards <= --max-shard-bytes, tokenizer, generation_config.json) goes to --export-dir
(default OUT); OUT/train_log.json holds the losses, held-out evaluations and throughput.
"""

from __future__ import annotations

import argparse
import json

from eagle_jax.train.target import TargetTrainConfig, train_target


def parse_args(argv=None) -> TargetTrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="build_corpus.py output directory")
    p.add_argument("--out", required=True, help="run directory (checkpoints, train_log.json)")
    p.add_argument("--export-dir", default=None, help="Hugging Face checkpoint (default: --out)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=2000, help="length of the cosine schedule")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype (master weights and optimizer are float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=1 << 19,
                   help="held-out tokens evaluated (from the start of heldout.npy)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop this invocation at that step (continue later with --resume)")
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument("--fit-steps-to-budget", action="store_true")
    p.add_argument("--export-best", action="store_true",
                   help="export the evaluated parameters with the lowest held-out loss")
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--max-shard-bytes", type=int, default=15 * 10**6)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return TargetTrainConfig(
        corpus=a.corpus, out=a.out, export_dir=a.export_dir, layers=a.layers, hidden=a.hidden,
        heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate, seq_len=a.seq_len,
        batch_size=a.batch_size, steps=a.steps, lr=a.lr, min_lr_ratio=a.min_lr_ratio,
        warmup=a.warmup, weight_decay=a.weight_decay, clip_norm=a.clip_norm, dtype=a.dtype,
        seed=a.seed, eval_every=a.eval_every, save_every=a.save_every, log_every=a.log_every,
        eval_tokens=a.eval_tokens, resume=a.resume, stop_after=a.stop_after,
        time_budget_s=a.time_budget_s,
        fit_steps_to_budget=a.fit_steps_to_budget, export_best=a.export_best,
        max_position_embeddings=a.max_position_embeddings, rope_theta=a.rope_theta,
        max_shard_bytes=a.max_shard_bytes, progress=not a.no_progress)


def main(argv=None) -> int:
    final = train_target(parse_args(argv))
    final.pop("files", None)
    print(json.dumps(final, indent=2))
    return 0

