"""Train an EAGLE-1 / EAGLE-3 draft for a target model with optax.

Toy size on a CPU (a tiny target, a few hundred steps):

    eagle-jax train-draft --target /tmp/tiny --corpus corpus.jsonl --out /tmp/run \\
        --algorithm EAGLE3 --steps 300 --batch-size 8 --seq-len 64 --lr 3e-3 --warmup 20 \\
        --draft-vocab-size 200 --ttt-steps 3 --eval-every 50 --save-every 100

Useful size on a GPU (all local devices, data parallel):

    eagle-jax train-draft --target Llama-3.1-8B-Instruct --corpus sharegpt.jsonl \\
        --out runs/eagle3 --steps 20000 --batch-size 16 --seq-len 2048 --lr 1e-4 \\
        --warmup 500 --draft-vocab-size 32000 --ttt-steps 7 --dtype bfloat16

The corpus is a directory of text files or a JSONL of {"text"} / {"prompt", "response"}
/ {"input_ids"} rows. ``--resume`` continues from the newest checkpoint in ``--out``
(parameters, optimizer state, step and rng). The final draft is written in the
published layout to ``OUT/draft`` (load it with ``eagle_jax.models.draft_checkpoint.
load_draft``, sglang or vLLM); ``--format speculators`` writes the layout of the
``speculators`` library instead (EAGLE-3; vLLM reads it, with the aux layer ids in vLLM's
convention, naming layer inputs).
"""

from __future__ import annotations

import argparse
import json

from eagle_jax.train import TrainConfig, train


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory (HF layout)")
    p.add_argument("--corpus", required=True, help="text directory or JSONL file")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE3", "EAGLE"])
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-norm", type=float, default=0.5)
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="EAGLE-3 reduced vocabulary (default: the target's)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="EAGLE-3 training-time-test unroll length (7 in published recipes)")
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--label-mode", default="hard", choices=["hard", "soft"],
                   help="EAGLE-3 labels: hard = cross-entropy against the target's top-1 "
                        "token; soft = KL to the target's temperature-1 distribution over "
                        "the draft vocabulary (better acceptance when sampling; the feature "
                        "cache also stores the target's final hidden states)")
    p.add_argument("--lm-head", default="own", choices=["own", "target"],
                   help="EAGLE-3 LM head: own = trained over the draft vocabulary "
                        "(--draft-vocab-size); target = the target's head, frozen, over the "
                        "whole vocabulary and left out of the checkpoint (the engine borrows "
                        "it again)")
    p.add_argument("--eval-steps", type=int, default=None,
                   help="unroll steps measured at evaluation (default: --ttt-steps)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--target-dtype", default=None, choices=[None, "float32", "bfloat16"])
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--max-sequences", type=int, default=None)
    p.add_argument("--chunk-sequences", type=int, default=256,
                   help="sequences per cached .npy chunk (bounds host memory)")
    p.add_argument("--collect-batch-size", type=int, default=8)
    p.add_argument("--data-dir", default=None, help="feature cache (default: OUT/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop this invocation at that step (continue later with --resume)")
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--aux-layer-ids", type=int, nargs="+", default=None,
                   help="EAGLE-3 feature layers as layer OUTPUT ids, sglang's convention, "
                        "whatever --format (default 1, L//2-1, L-4)")
    p.add_argument("--format", default="sglang", choices=["sglang", "speculators"],
                   help="layout of the saved draft: sglang = the published EAGLE layout "
                        "(sglang, vLLM); speculators = the speculators library's (vLLM; "
                        "EAGLE3 with --lm-head own only)")
    p.add_argument("--eagle1-noise", type=float, default=0.0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return TrainConfig(
        target=a.target, corpus=a.corpus, out=a.out, algorithm=a.algorithm,
        tokenizer=a.tokenizer, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len,
        lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup=a.warmup, weight_decay=a.weight_decay,
        clip_norm=a.clip_norm, draft_vocab_size=a.draft_vocab_size, ttt_steps=a.ttt_steps,
        ttt_decay=a.ttt_decay, label_mode=a.label_mode, lm_head=a.lm_head,
        eval_steps=a.eval_steps, dtype=a.dtype,
        target_dtype=a.target_dtype, eval_every=a.eval_every, save_every=a.save_every,
        log_every=a.log_every, eval_fraction=a.eval_fraction, eval_batches=a.eval_batches,
        max_sequences=a.max_sequences, chunk_sequences=a.chunk_sequences,
        collect_batch_size=a.collect_batch_size, data_dir=a.data_dir, seed=a.seed,
        resume=a.resume, stop_after=a.stop_after, intermediate_size=a.intermediate_size,
        max_position_embeddings=a.max_position_embeddings,
        aux_layer_ids=tuple(a.aux_layer_ids) if a.aux_layer_ids else None,
        eagle1_noise=a.eagle1_noise, progress=not a.no_progress, checkpoint_format=a.format)


def main(argv=None) -> int:
    summary = train(parse_args(argv))
    summary.pop("draft", None)
    keys = ("step", "initial_eval_acc", "final_eval_acc", "initial_eval_accept",
            "final_eval_accept", "draft_dir", "resumed_from")
    print(json.dumps({k: summary[k] for k in keys}, indent=2))
    return 0

