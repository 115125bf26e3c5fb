"""Engine benchmark: speculative vs plain decoding in one run, against the bandwidth bound.

A Llama-3.1-8B-shaped bfloat16 target with random weights and an EAGLE-3-shaped draft
(random weights too). Random drafts accept nothing, so the speculative engine runs with
``synthetic_acceptance`` (each draft token accepted with probability a, as serving
benchmarks fix the accept length): E[accept length] = 1 + a + a^2 + ... + a^S. The
verify, the sampler, the draft extend and every kernel still run in full.

For each batch size the table gives decode tokens/s and mean TPOT of both engines
(prefill excluded), the speed-up, and for plain decoding the bandwidth bound: weight bytes
over the device-to-device copy bandwidth measured in the same run.

    python scripts/bench_engine.py [--batch-sizes 1,8,64] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle_jax import SamplingParams  # noqa: E402
from eagle_jax.config import ModelConfig, RopeScaling  # noqa: E402
from eagle_jax.engine import Engine, EngineConfig  # noqa: E402
from eagle_jax.models.decoder import Decoder  # noqa: E402
from eagle_jax.models.draft import new_draft  # noqa: E402
from eagle_jax.models.draft_config import EAGLE3, DraftConfig  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4,
             num_heads=4, num_kv_heads=2, head_dim=64)


def random_target(shape: dict, dtype) -> Decoder:
    cfg = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                      max_position_embeddings=131072, eos_token_ids=(), **shape)
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    fill = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02
                                       ).astype(dtype), static_argnums=1)
    for i, (path, var) in enumerate(
            (p, v) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)):
        if "norm" in str(path):
            var.set_value(jnp.ones(var.shape, dtype))
        else:
            var.set_value(fill(jax.random.PRNGKey(i), tuple(var.shape)))
    return model


def random_eagle3(target: Decoder, dtype, draft_vocab: int) -> object:
    t = target.config
    hf = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=t.hidden_size,
              intermediate_size=t.intermediate_size, num_attention_heads=t.num_heads,
              num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, num_hidden_layers=1,
              vocab_size=t.vocab_size, draft_vocab_size=draft_vocab, rms_norm_eps=1e-5,
              rope_theta=t.rope_theta, max_position_embeddings=t.max_position_embeddings)
    cfg = DraftConfig.from_hf_dict(hf, EAGLE3, t, "bench")
    d2t = jnp.asarray(np.sort(np.random.default_rng(0).choice(t.vocab_size, draft_vocab, False))
                      - np.arange(draft_vocab), jnp.int32)
    return new_draft(cfg, target_embed=target.embed_tokens.weight[...],
                     target_lm_head=target.lm_head_weight, d2t=d2t, dtype=dtype)


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(nbytes // 4, np.float32))
    copy = jax.jit(lambda a: a * 1.0001)
    copy(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times))


def decode_rate(engine: Engine, batch: int, prompt_len: int, new_tokens: int, seed: int):
    """Decode tokens/s and mean TPOT of ``batch`` requests, prefill excluded."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{seed}-{i}", [int(t) for t in rng.integers(10, 4000, prompt_len)],
                           params)
    first = {}
    last = {}
    produced = 0
    start = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if start is None and engine.num_waiting() == 0:
            start = now  # every request admitted and prefilled: decode starts here
            produced = 0
            continue
        for o in outs:
            produced += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            last[o.request_id] = (now, o.num_output_tokens)
    elapsed = max(t for t, _ in last.values()) - start
    tpot = np.mean([(t - first[r]) / max(n - 1, 1) for r, (t, n) in last.items()])
    return produced / elapsed, float(tpot)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--num-steps", type=int, default=5)
    ap.add_argument("--acceptance", type=float, default=0.83,
                    help="per-token synthetic acceptance (0.83 with 5 steps: length ~3.9)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16
    batches = [int(b) for b in args.batch_sizes.split(",")]
    shape = SMALL if args.small else LLAMA_8B
    device = jax.devices()[0].device_kind
    print(f"device: {device}; jax {jax.__version__}", flush=True)
    bw = copy_bandwidth(64 << 20 if args.small else 2 << 30)
    target = random_target(shape, dtype)
    draft = random_eagle3(target, dtype, min(args.draft_vocab, shape["vocab_size"]))
    weight_bytes = sum(v.size * v.dtype.itemsize for _, v in nnx.iter_graph(target)
                       if isinstance(v, nnx.Param))
    a, S = args.acceptance, args.num_steps
    expected_len = 1 + sum(a ** i for i in range(1, S + 1))
    max_len = args.prompt_len + args.new_tokens + 16
    common = dict(model="random", dtype="bfloat16", max_model_len=max_len,
                  max_num_seqs=max(batches), batch_buckets=tuple(batches),
                  prefill_buckets=(args.prompt_len,), compilation_cache_dir="")
    plain = Engine(EngineConfig(speculative_algorithm="NONE", **common), target=target)
    spec = Engine(EngineConfig(speculative_algorithm="EAGLE3", draft_model="random",
                               num_steps=S, synthetic_acceptance=a, **common),
                  target=target, draft=draft)
    rows = []
    for b in batches:
        decode_rate(plain, b, args.prompt_len, 16, seed=1)  # warm-up
        decode_rate(spec, b, args.prompt_len, 16, seed=1)
        p_tps, p_tpot = decode_rate(plain, b, args.prompt_len, args.new_tokens, seed=2)
        s0 = spec.stats.num_accepted_tokens, spec.stats.num_drafts
        s_tps, s_tpot = decode_rate(spec, b, args.prompt_len, args.new_tokens, seed=2)
        acc = (spec.stats.num_accepted_tokens - s0[0]) / max(spec.stats.num_drafts - s0[1], 1)
        bound = b * bw / weight_bytes  # tokens/s if a step only read the weights once
        rows.append(dict(batch=b, plain_tok_s=p_tps, plain_tpot_ms=p_tpot * 1e3,
                         spec_tok_s=s_tps, spec_tpot_ms=s_tpot * 1e3, speedup=s_tps / p_tps,
                         accept_length=1 + acc, bound_tok_s=bound,
                         plain_vs_bound=p_tps / bound))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nweights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"expected accept length {expected_len:.2f} (a = {a}, S = {S})\n")
    print("| batch | plain tok/s | plain TPOT ms | bound tok/s | plain/bound | spec tok/s | "
          "spec TPOT ms | accept len | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['plain_tpot_ms']:.2f} | "
              f"{r['bound_tok_s']:.1f} | {r['plain_vs_bound']:.0%} | {r['spec_tok_s']:.1f} | "
              f"{r['spec_tpot_ms']:.2f} | {r['accept_length']:.2f} | {r['speedup']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, copy_gbps=bw / 1e9, weight_bytes=weight_bytes,
                           rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
