"""Compile the paged-attention kernels' Triton IR for AMD and NVIDIA GPUs, without a GPU.

Usage:
  python scripts/compile_attention_ir.py --triton-python /tmp/venv-attn/bin/python \
      [--arch gfx942,gfx950,90] [--out DIR]

This process (JAX on a CPU) lowers ``paged_attention`` with ``interpret=False`` for
``platforms=["rocm"]`` and ``["cuda"]`` at the Llama-3.1-8B attention shape (N=32, K=8,
D=128, bf16, page_size 16) in a few configurations and writes the Triton IR that JAX
hands to the Triton compiler (captured from JAX's private Pallas/Triton lowering, so this
is a diagnostic, not an API). Each file is then compiled in a separate interpreter that
has the ``triton`` package (e.g. ``python3 -m venv /tmp/venv-attn && /tmp/venv-attn/bin/pip
install triton==3.6.0``; a separate process because jaxlib and triton both register the
Triton MLIR dialects), for ``GPUTarget("hip", gfxNNN, 64)`` or ``GPUTarget("cuda", NN,
32)``, and its register, spill and shared-memory use is printed. Both backends compile
on a CPU; the NVIDIA numbers come from cuobjdump on the cubin.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src.pallas.triton import lowering as _triton_lowering  # noqa: E402

from eagle_jax.kernels.paged_attention import paged_attention, paged_attention_config  # noqa: E402
from eagle_jax.kernels._common import TRITON_CUSTOM_CALL  # noqa: E402

# label: (B, T, table tokens, tree mask, tuning)
CASES = {
    "decode B=64": (64, 1, 4096, False, {}),
    "decode B=1 32k (split-K + combine)": (1, 1, 32768, False, {}),
    "verify T=6 B=64": (64, 6, 4096, False, {}),
    "tree verify T=6 B=64": (64, 6, 4096, True, {}),
    "prefill chunk 512": (1, 512, 4096, False, {}),
    "decode B=64 block_n=128 stages=3": (64, 1, 4096, False, dict(block_n=128, num_stages=3)),
}

_COMPILE = r"""
import json, os, re, subprocess, sys, triton
from triton.backends.compiler import GPUTarget
path, arch, warps, stages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
target = GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)
try:
  k = triton.compile(path, target=target, options=dict(num_warps=warps, num_stages=stages))
except Exception as e:
  print(json.dumps(dict(error=str(e)[-400:]))); sys.exit()
res = dict(shared_bytes=k.metadata.shared)
if "amdgcn" in k.asm:
  txt = k.asm["amdgcn"]
  for key, pat in [("vgpr", r"\.vgpr_count:\s*(\d+)"), ("agpr", r"\.agpr_count:\s*(\d+)"),
                   ("vgpr_spill", r"\.vgpr_spill_count:\s*(\d+)"),
                   ("sgpr_spill", r"\.sgpr_spill_count:\s*(\d+)"),
                   ("scratch", r"ScratchSize:\s*(\d+)"), ("occupancy", r"Occupancy:\s*(\d+)")]:
    m = re.findall(pat, txt)
    res[key] = int(m[0]) if m else None
else:
  cubin = path + ".cubin"
  open(cubin, "wb").write(k.asm["cubin"])
  tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
  out = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True,
                       text=True).stdout
  m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
  if m:
    res.update(regs=int(m[1]), stack=int(m[2]), local_spill=int(m[4]))
print(json.dumps(res))
"""


def lower(platform, b, t, table_tokens, tree, tuning):
  """[(kernel name, Triton IR text)] of one paged_attention call lowered for platform."""
  n, k, d, page_size = 32, 8, 128, 16
  s = jax.ShapeDtypeStruct
  args = [s((b, t, n, d), jnp.bfloat16), s((b * table_tokens // page_size + 8, page_size, k, d),
                                            jnp.bfloat16)]
  args += [args[1], s((b, table_tokens // page_size), jnp.int32), s((b,), jnp.int32),
           s((b,), jnp.int32)]
  mask = [s((b, t, t), jnp.bool_)] if tree else []
  fn = lambda *a: paged_attention(*a[:6], block_mask=a[6] if tree else None, interpret=False,
                                  **tuning)
  modules = []
  original = _triton_lowering.lower_jaxpr_to_triton_module

  def capture(*a, **kw):
    result = original(*a, **kw)
    op = result.module.operation
    modules.append((str(op.attributes["sym_name"]).strip('"'), op.get_asm(enable_debug_info=False)))
    return result

  _triton_lowering.lower_jaxpr_to_triton_module = capture
  try:
    jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(*args, *mask)
  finally:
    _triton_lowering.lower_jaxpr_to_triton_module = original
  cfg = paged_attention_config(args[0], args[1], args[3], **tuning)
  return modules, cfg


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--arch", default="gfx942,gfx950,90",
                  help="gfxNNN (ROCm) or an NVIDIA compute capability such as 90")
  ap.add_argument("--triton-python", default=None,
                  help="a Python with the triton package (without it: only write the IR)")
  ap.add_argument("--out", default="/tmp/attention_ttir")
  args = ap.parse_args()
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  rows = []
  for label, (b, t, table_tokens, tree, tuning) in CASES.items():
    for arch in args.arch.split(","):
      platform = "rocm" if arch.startswith("gfx") else "cuda"
      modules, cfg = lower(platform, b, t, table_tokens, tree, tuning)
      for name, text in modules:
        stem = label.split(" (")[0].replace(" ", "_").replace("=", "")
        path = out_dir / f"{stem}_{name}_{platform}.ttir"
        path.write_text(text)
        combine = name.endswith("combine")
        warps = cfg.combine_warps if combine else cfg.num_warps
        stages = 1 if combine else cfg.num_stages
        res = {}
        if args.triton_python:
          proc = subprocess.run([args.triton_python, "-c", _COMPILE, str(path), arch, str(warps),
                                 str(stages)], capture_output=True, text=True)
          lines = proc.stdout.strip().splitlines()
          res = json.loads(lines[-1]) if lines else dict(error=proc.stderr[-400:])
        line = (f"{label} | {name} | {arch} | warps {warps} stages {stages} "
                f"(block_q {cfg.block_q}, block_n {cfg.block_n}, splits {cfg.num_splits}) | "
                f"{json.dumps(res) if res else path}")
        rows.append(line)
        print(line, flush=True)


if __name__ == "__main__":
  main()
