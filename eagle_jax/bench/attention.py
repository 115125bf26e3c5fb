"""Check, benchmark and tune the ragged paged-attention kernel against its XLA reference.

Usage:
  python scripts/bench_attention.py [--small] [--sweep] [--sweep-seconds S] [--json PATH]
                                    [--only ROWS]

One run does three things, in this order:
1. Checks: the kernel against ``paged_attention_reference`` on fresh random inputs at
   realistic shapes (ragged decode, verify, tree verify, prefill chunk, long-context
   split-K, GQA 8, float32), with every pool row that holds no live key set to NaN.
   One PASS/FAIL line per shape: relative error max|out - ref| / max|ref|, finiteness,
   exact zeros on padding rows.
2. Copy bandwidth of the device (``benchtools.copy_bandwidth``): the 100% of "% copy".
3. Timings (Llama-3.1-8B attention: N=32, K=8, D=128, bf16, page_size 16): decode
   B=64 x 4096 live tokens, the S+1=6 verify block at B=64 x 4096, a random-tree verify
   block at the same size, decode B=1 x 32768, decode B=64 x 128 live tokens with a page
   table sized for 32768 (the cost must follow the live tokens), a 512-token prefill
   chunk over 4096 tokens (compute bound; TFLOP/s), a prefix-cache hit as the engine
   runs it (``suffix``: its 64 new positions in the 64-row bucket over 2112 keys, an
   8704-token table; 80 live rows of a 128-row block until 2026-12-06, when a hit began
   sharing its boundary page; before 2026-12-05 a fully live 128-token chunk over 2048),
   a fresh prompt of the hit's 64 positions (``fresh``, over its own 64 keys) and a
   128-token chunk
   riding late in a long prompt (``rider``, over 8192). Per row: kernel ms, live KV
   bytes, GB/s, % of copy bandwidth, the reference's ms and the ratio.
   The kernel is timed as R calls inside one jit on R different query arrays (divided
   by R; median over repeats), so a ~10 us kernel is not hidden behind Python dispatch;
   the reference, ms-scale, as back-to-back jitted calls.
With --sweep, each timed row also tries a few block_n / num_warps / num_stages /
num_splits settings (each one checked against the reference) and reports the best;
past --sweep-seconds (default 170) into the run the remaining rows run their heuristic
setting only, so that one GPU call stays within ~4 minutes.
--small runs tiny shapes in interpret mode on a CPU (a test of this script).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels.paged_attention import (
    paged_attention, paged_attention_config, paged_attention_reference)

from eagle_jax.bench.timing import copy_bandwidth, time_ms

ROWS = "decode,verify,long,short,tree,prefill,suffix,fresh,rider"
# Rows of one short chunk (few programs: their sweep tries splits and tiles).
CHUNK_ROWS = ("suffix", "fresh", "rider")


def make_inputs(seed, kv, ql, *, t, n, k, d, page_size, dtype, table_tokens=None,
                poison=True, garbage_table=True):
  """Random queries and pools, pages handed out from a shuffled free list.

  kv, ql: per-sequence live keys and query-block lengths (numpy). The page table has
  room for table_tokens (default: the longest sequence); its columns past a sequence's
  pages hold garbage page ids. With poison, pool rows that hold no live key are NaN.
  """
  rng = np.random.default_rng(seed)
  kv, ql = np.asarray(kv, np.int64), np.asarray(ql, np.int64)
  b = len(kv)
  need = -(-kv // page_size)
  max_pages = max(int(need.max()), -(-(table_tokens or 1) // page_size), 1)
  num_pages = int(need.sum()) + 8
  free = rng.permutation(num_pages)
  lo, hi = (-3, num_pages + 100) if garbage_table else (0, num_pages)
  table = rng.integers(lo, hi, size=(b, max_pages)).astype(np.int32)
  live = np.zeros((num_pages, page_size), bool)
  used = 0
  for i in range(b):
    pages = free[used:used + need[i]]
    used += need[i]
    table[i, :need[i]] = pages
    full, rest = divmod(int(kv[i]), page_size)
    live[pages[:full]] = True
    if rest:
      live[pages[full], :rest] = True
  keys = jax.random.split(jax.random.key(seed), 3)
  shape = (num_pages, page_size, k, d)
  live_d = jnp.asarray(live)[:, :, None, None]

  def pool(key):
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    return jnp.where(live_d, x, jnp.nan).astype(dtype) if poison else x

  q = jax.random.normal(keys[2], (b, t, n, d), jnp.float32).astype(dtype)
  return dict(q=q, k_pages=pool(keys[0]), v_pages=pool(keys[1]),
              page_table=jnp.asarray(table), kv_len=jnp.asarray(kv, jnp.int32),
              q_len=jnp.asarray(ql, jnp.int32))


def random_trees(seed, ql, t):
  """[B, T, T] masks: node i has a random parent < i, sees its ancestors and itself."""
  rng = np.random.default_rng(seed)
  masks = np.zeros((len(ql), t, t), bool)
  for i, n in enumerate(ql):
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
    for node in range(n):
      a = node
      while a >= 0:
        masks[i, node, a] = True
        a = parent[a]
  return jnp.asarray(masks)


def rel_error(out, ref, ql):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  finite = bool(np.all(np.isfinite(out)))
  zeros = all(np.all(out[i, max(int(n), 0):] == 0) for i, n in enumerate(np.asarray(ql)))
  err = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
  return err, finite, zeros


def bench_in_jit(kernel, inp, block_mask, *, reps, repeats, warmup):
  """(ms per kernel call, the output for inp["q"]): `reps` calls on `reps` different q
  arrays inside one jit, so that Python dispatch does not hide a ~10 us kernel."""
  qs = [inp["q"]] + [
      jax.random.normal(jax.random.key(100 + i), inp["q"].shape, jnp.float32).astype(inp["q"].dtype)
      for i in range(reps - 1)]
  rest = (inp["k_pages"], inp["v_pages"], inp["page_table"], inp["kv_len"], inp["q_len"],
          block_mask)
  one = jax.jit(kernel)
  many = jax.jit(lambda qs, *rest: [one(q, *rest) for q in qs])
  out = many(qs, *rest)[0]
  ms = time_ms(many, qs, *rest, calls=1, repeats=repeats, warmup=warmup) / reps
  return ms, out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU, interpret mode)")
  ap.add_argument("--sweep", action="store_true", help="try tuning settings per timed row")
  ap.add_argument("--json", type=str, default=None)
  ap.add_argument("--sweep-seconds", type=float, default=170,
                  help="past this many seconds into the run, timed rows skip the sweep "
                       "and run their heuristic setting only")
  ap.add_argument("--only", type=str, default=None,
                  help=f"timed rows, of {ROWS} (default: all; decode,tree,long with --small)")
  args = ap.parse_args(argv)
  small = args.small
  bf16, f32 = jnp.bfloat16, jnp.float32
  t_start = time.perf_counter()
  print(f"devices: {jax.devices()}  jax {jax.__version__}", flush=True)
  checks, results, sweeps = [], [], []
  failed = 0

  def kernel_fn(tuning):
    return lambda q, k, v, pt, kl, ql, m: paged_attention(
        q, k, v, pt, kl, ql, block_mask=m, **tuning)

  ref_fn = jax.jit(lambda q, k, v, pt, kl, ql, m: paged_attention_reference(
      q, k, v, pt, kl, ql, block_mask=m))

  def call_args(inp, mask):
    return (inp["q"], inp["k_pages"], inp["v_pages"], inp["page_table"], inp["kv_len"],
            inp["q_len"], mask)

  # ---- 1. checks --------------------------------------------------------------------
  rng = np.random.default_rng(0)
  if small:
    N, K, D, ctx = 4, 2, 64, 100
  else:
    N, K, D, ctx = 32, 8, 128, 4096
  check_cases = [
      # label, B, T, longest context, N, K, D, dtype, tree, tuning
      ("decode ragged", 16, 1, ctx, N, K, D, bf16, False, {}),
      ("verify S+1=6 ragged", 16, 6, ctx, N, K, D, bf16, False, {}),
      ("tree verify T=6", 16, 6, ctx, N, K, D, bf16, True, {}),
      ("verify forced splits", 8, 6, ctx, N, K, D, bf16, False,
       dict(num_splits=8, min_split=64)),
      ("prefill chunk", 4, 64 if small else 256, ctx // 2, N, K, D, bf16, False, {}),
      ("decode long (split-K)", 1, 1, 8 * ctx, N, K, D, bf16, False, {}),
      ("verify GQA 8", 8, 6, ctx, 2 * N, K, D, bf16, False, {}),
      ("decode float32 D=64", 8, 1, ctx, N, K, 64, f32, False, {}),
  ]
  if small:  # every path (tree, splits, query tiles, float32) in under a minute
    check_cases = [c for c in check_cases if c[0] in (
        "decode ragged", "tree verify T=6", "verify forced splits", "prefill chunk",
        "decode float32 D=64")]
  for i, (label, b, t, kv_max, n, k, d, dt, tree, tuning) in enumerate(check_cases):
    ql = rng.integers(1, t + 1, b)  # ragged blocks: rows past q_len are padding
    kv = ql + rng.integers(0, kv_max + 1, b)
    if b >= 4:
      kv[0] = ql[0]  # a sequence whose only keys are its block
      kv[1], ql[1] = 0, 0  # an empty slot
    inp = make_inputs(10 + i, kv, ql, t=t, n=n, k=k, d=d, page_size=16, dtype=dt)
    mask = random_trees(i, ql, t) if tree else None
    a = call_args(inp, mask)
    out = jax.jit(kernel_fn(tuning))(*a)
    ref = ref_fn(*a)
    err, finite, zeros = rel_error(out, ref, ql)
    # float32: Triton's dot on a GPU takes TF32 operands (10-bit mantissa), ~3e-4 relative.
    ok = finite and zeros and err < (2e-2 if dt == bf16 else 1e-3)
    failed += not ok
    cfg = paged_attention_config(inp["q"], inp["k_pages"], inp["page_table"],
                                 causal=mask is None, **tuning)
    line = (f"{'PASS' if ok else 'FAIL'} {label}: B={b} T={t} N={n} K={k} D={d} "
            f"{jnp.dtype(dt).name} max kv={int(kv.max())}: rel err {err:.2e}, "
            f"finite={finite}, padding zeros={zeros} (splits={cfg.num_splits})")
    checks.append(line)
    print(line, flush=True)
    del inp

  # ---- 2. copy bandwidth --------------------------------------------------------------
  reps, repeats, warmup = (1, 2, 1) if small else (20, 10, 2)
  copy_gbs = copy_bandwidth((4 << 20) if small else (1 << 30), calls=1 if small else 10,
                            repeats=repeats) / 1e9
  print(f"copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)

  # ---- 3. timings ---------------------------------------------------------------------
  if small:
    B, ctx, long_ctx, short_ctx, table_ctx, chunk = 4, 96, 600, 8, 400, 32
  else:
    B, ctx, long_ctx, short_ctx, table_ctx, chunk = 64, 4096, 32768, 128, 32768, 512
  hit_q = chunk // 8  # the 64 new tokens, in the 64-position bucket
  hit_kv, hit_table = ctx // 2 + chunk // 8, 2 * ctx + 512  # 2112 keys; 8704
  rows = {
      # name: (label, B, T, kv, q_len, table tokens, tree)
      "decode": (f"decode B={B} x {ctx}", B, 1, ctx, 1, None, False),
      "verify": (f"verify S+1=6 B={B} x {ctx}", B, 6, ctx, 6, None, False),
      "tree": (f"tree verify T=6 B={B} x {ctx}", B, 6, ctx, 6, None, True),
      "long": (f"decode B=1 x {long_ctx}", 1, 1, long_ctx, 1, None, False),
      "short": (f"decode B={B} x {short_ctx} (table {table_ctx})", B, 1, short_ctx, 1,
                table_ctx, False),
      "prefill": (f"prefill chunk {chunk} over {ctx}, B=1", 1, chunk, ctx, chunk, None, False),
      # A prefix-cache hit as the engine runs it (docs/BENCHMARKS.md, "Prefix caching"): a
      # 2048-token prefix + 64 computes its 64 new positions in the 64-row bucket (the
      # target shares the prefix's last page; the draft recomputes its one stale row),
      # over a table of max_model_len 8704.
      "suffix": (f"prefix-cache hit: {hit_q} positions over {hit_kv}, B=1 "
                 f"(table {hit_table})", 1, hit_q, hit_kv, hit_q, hit_table, False),
      # A fresh prompt of the hit's computed length: what the hit's attention costs beyond
      # its own positions is ``suffix`` less this.
      "fresh": (f"fresh prompt: {hit_q} positions over {hit_q}, B=1 "
                f"(table {hit_table})", 1, hit_q, hit_q, hit_q, hit_table, False),
      # A prompt chunk riding in a decode step, late in a long prompt.
      "rider": (f"prefill chunk {chunk // 4} over {2 * ctx}, B=1", 1, chunk // 4, 2 * ctx,
                chunk // 4, None, False),
  }
  for name in (args.only or ("decode,tree,long" if small else ROWS)).split(","):
    label, b, t, kv_n, q_n, table_tokens, tree = rows[name]
    kv, ql = np.full(b, kv_n), np.full(b, q_n)
    inp = make_inputs(1000 + len(results), kv, ql, t=t, n=N, k=K, d=D, page_size=16,
                      dtype=bf16, table_tokens=table_tokens, garbage_table=False)
    mask = random_trees(7, ql, t) if tree else None
    a = call_args(inp, mask)
    ref = ref_fn(*a)
    r_ms = time_ms(ref_fn, *a, calls=1 if small else 3, repeats=repeats, warmup=1)
    default = paged_attention_config(inp["q"], inp["k_pages"], inp["page_table"],
                                     causal=mask is None)
    configs = [{}]
    if args.sweep and name in CHUNK_ROWS:
      configs += [dict(num_splits=1)] + [dict(num_splits=x, min_split=max(256, kv_n // x))
                                         for x in (2, 4, 8, 16)]
      # Latency-bound loops: deeper pipelines and other tile heights, at the heuristic's
      # splits. Below 5 stages Triton (3.8, sm_90) keeps one K/V buffer when the page ids
      # are loaded in the tile that uses them, so 5 is the first depth that overlaps a
      # tile's gathers with the dots before it (docs/history/2026-12-04-issue-14-prefix-caching.md, fourth session).
      configs += [dict(num_stages=3), dict(num_stages=4), dict(num_stages=5),
                  dict(block_n=64, num_stages=3), dict(block_n=64, num_stages=4),
                  dict(block_q=16), dict(block_q=64)]
      # Shorter splits (one or two key tiles a program) and a query tile holding a KV
      # head's every row of the hit (fewer re-reads of its keys): the hit's 64 rows
      # over 2112 keys take 33 us a layer for 8.65 MB of K and V on an H200, latency-
      # rather than bandwidth-bound (docs/history/2026-12-06-issue-14-prefix-caching.md).
      configs += [dict(num_splits=16, min_split=128), dict(num_splits=32, min_split=64,
                                                            block_n=64),
                  dict(block_q=128, num_warps=8)]
    elif args.sweep and name != "tree":  # tree verify: as verify
      s = default.num_splits
      configs += [dict(block_n=32), dict(block_n=128), dict(num_warps=12 - default.num_warps),
                  dict(num_stages=1), dict(num_stages=3)]
      configs += [dict(num_splits=x) for x in sorted({max(1, s // 2), 2 * s} - {s})][:2]
      if small:
        configs = configs[:2]
    best = None
    print(f"[{time.perf_counter() - t_start:.0f} s] {label}", flush=True)
    for tuning in configs:
      if tuning and time.perf_counter() - t_start > args.sweep_seconds:
        line = f"  {label} {tuning}: skipped (past --sweep-seconds)"
        sweeps.append(line)
        print(line, flush=True)
        continue
      try:
        ms, out = bench_in_jit(kernel_fn(tuning), inp, mask, reps=reps, repeats=repeats,
                               warmup=warmup)
        err, finite, zeros = rel_error(out, ref, ql)
      except Exception as e:  # a setting the compiler refuses (e.g. shared memory)
        line = f"  {label} {tuning or 'heuristic'}: failed: {type(e).__name__}: {str(e)[:200]}"
        sweeps.append(line)
        print(line, flush=True)
        continue
      ok = finite and zeros and err < 2e-2
      failed += not ok
      line = (f"  {label} {tuning or 'heuristic'}: {ms:.4f} ms, rel err {err:.1e}"
              f"{'' if ok else '  FAIL'}")
      sweeps.append(line)
      print(line, flush=True)
      if ok and (best is None or ms < best[0]):
        best = (ms, tuning)
    if best is None:
      continue
    k_ms, tuning = best
    kv_bytes = int(kv.sum()) * K * D * 2 * 2  # keys and values, bf16
    gbs = kv_bytes / k_ms / 1e6
    # 2 dots of 2 * D flops per visible (query, key) pair and query head (causal block).
    pairs = int((ql * (kv - ql) + ql * (ql + 1) // 2).sum())
    flops = 4 * pairs * N * D if name == "prefill" or name in CHUNK_ROWS else None
    cfg = paged_attention_config(inp["q"], inp["k_pages"], inp["page_table"],
                                 causal=mask is None, **tuning)
    results.append(dict(
        row=label, kernel_ms=k_ms, reference_ms=r_ms, ratio=r_ms / k_ms, kv_bytes=kv_bytes,
        gbs=gbs, pct_copy=100 * gbs / copy_gbs,
        tflops=flops / k_ms / 1e9 if flops else None,
        best=tuning or "heuristic", config=cfg._asdict(), default=default._asdict()))
    del inp, ref

  # ---- report -----------------------------------------------------------------------
  lines = ["| row | kernel ms | live KV MB | GB/s | % copy BW | reference ms | ratio (ref/kernel) "
           "| best setting | config |", "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    c = r["config"]
    cfg = (f"q{c['block_q']} n{c['block_n']} s{c['num_splits']} w{c['num_warps']} "
           f"st{c['num_stages']}")
    extra = f" ({r['tflops']:.0f} TFLOP/s)" if r["tflops"] else ""
    lines.append(f"| {r['row']} | {r['kernel_ms']:.4f}{extra} | {r['kv_bytes'] / 1e6:.1f} | "
                 f"{r['gbs']:.0f} | {r['pct_copy']:.0f}% | {r['reference_ms']:.4f} | "
                 f"{r['ratio']:.2f} | {r['best']} | {cfg} |")
  print(f"\ncopy bandwidth: {copy_gbs:.0f} GB/s")
  print("\n".join(lines))
  print(f"\n{'ALL CHECKS PASSED' if not failed else f'{failed} CHECK(S) FAILED'} "
        f"({time.perf_counter() - t_start:.0f} s)")
  if args.json:
    Path(args.json).write_text(json.dumps(dict(
        device=str(jax.devices()[0]), jax=jax.__version__, copy_gbs=copy_gbs,
        date=subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
        command=" ".join(sys.argv), checks=checks, sweeps=sweeps, results=results,
        failed=failed), indent=1, default=str))
  sys.exit(1 if failed else 0)

