"""Compile every Pallas kernel for AMD GPUs on a CPU: gfx950 (MI355X) and gfx942 (MI300X).

Usage:
  python scripts/rocm_compile.py [--arch gfx950,gfx942[,sm_90]] [--model llama-3.1-8b,qwen3-32b]
                                 [--json PATH] [--write-doc [docs/ROCM.md]]

For each kernel call the engine makes (``CASES``, at the shapes of ``MODELS``), JAX lowers
the call for ROCm on this CPU (``jax.jit(f).trace(...).lower(lowering_platforms=("rocm",))``,
each kernel asked for the block sizes of that target) and the Triton IR is read where XLA
reads it: the MLIR bytecode in the backend config of each ``__gpu$xla.gpu.triton`` custom
call of the StableHLO module, beside the call's ``num_warps`` and ``num_stages``. No JAX
internal is imported or hooked; the backend config's layout is JAX's (not an API),
checked on jax / jaxlib 0.10.2, the release the ``rocm`` extra pins.

The ``triton`` package then compiles those exact bytes for ``GPUTarget("hip", arch, 64)``
with its AMD backend, on the CPU, from its TTIR passes to the hsaco, and the kernel's
resources are read from the code object's AMDGPU metadata note: VGPRs (arch + AGPR on
CDNA), SGPRs, VGPR / SGPR spills, scratch, and the LDS Triton allocates (given at launch,
so not in the note's static LDS field). Waves per SIMD is what those allow on CDNA3 /
CDNA4 (``waves_per_simd``). The exit status is 1 if a kernel fails to compile, spills or
needs more LDS than a CU has; ``tests/test_rocm_compile.py`` runs this in CI and checks
that docs/ROCM.md holds the table it prints (``--write-doc`` rewrites it). ``sm_90``
lowers for CUDA and compiles a cubin instead (registers and local memory from the
wheel's cuobjdump), to compare with the NVIDIA choices; it is not in the table.

Version pairing. MLIR bytecode stores each op's properties by position, as the op is
defined in the writer's Triton dialect, so the reader's Triton must define the ops as
jaxlib 0.10.2's does. Of triton 3.6.0, 3.7.1, 3.8.0 and 3.9.0, only 3.8.0 reads the
bytes, even of a one-line copy kernel (a tt.load and a tt.store): 3.6 and 3.7 stop with
"expected DenseArrayAttr<int32_t>, but got: 1 : i32", 3.9 with "expected BoolAttr, but
got: 1 : i32". The ``rocm-check`` extra pins that pair (``TESTED_PAIRING``). The
numbers are upstream triton 3.8's AMD pipeline on that IR; XLA compiles the same IR with
the pipeline of its own Triton snapshot in the jax-rocm plugin, so a GPU run's numbers
are close to these, not guaranteed equal.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple


import jax
import jax.numpy as jnp

from eagle_jax.kernels._common import GPU_TARGETS, TRITON_CUSTOM_CALL
from eagle_jax.kernels.draft_proposal import propose_draft_tokens
from eagle_jax.kernels.gathered_lm_head import gathered_lm_head
from eagle_jax.kernels.norm_concat import rmsnorm_concat
from eagle_jax.kernels.paged_attention import KV_FP8, paged_attention
from eagle_jax.kernels.spec_sampler import speculative_sample
from eagle_jax.kernels.tree_mask import build_tree_mask
from eagle_jax.kernels.tree_verify import verify_tree
from eagle_jax.sampling import SamplingRows

TESTED_PAIRING = {"jax": "0.10.2", "triton": "3.8.0"}
ARCHS = ("gfx950", "gfx942")
DOC = Path(__file__).resolve().parents[2] / "docs" / "ROCM.md"
DOC_BEGIN = "<!-- rocm_compile.py table: begin -->"
DOC_END = "<!-- rocm_compile.py table: end -->"


class ModelShape(NamedTuple):
  hidden: int
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int            # logits columns (the embedding's rows)
  tokenizer_vocab: int  # ids the sampler may emit
  draft_vocab: int      # the EAGLE-3 head's reduced vocabulary


# Qwen3-8B has Llama-3.1-8B's attention and hidden sizes (only the vocabulary differs), so
# the Qwen3 shape is Qwen3-32B: 8 query heads per KV head and a 5120-wide hidden state.
MODELS = {
    "llama-3.1-8b": ModelShape(4096, 32, 8, 128, 128256, 128256, 32000),
    "qwen3-32b": ModelShape(5120, 64, 8, 128, 151936, 151669, 32000),
}
BATCH = 64       # a batch bucket of the engine
STEPS = 5        # S draft tokens, S + 1 verified
TREE = (4, 6, 32)  # a draft tree: K children per expanded node, S levels, N verified
PAGE_SIZE = 16
TABLE = 8192     # page-table tokens (max_model_len) of the batched cases
LONG = 32768     # one long sequence: split-K and the combine kernel
PREFILL = 512    # the largest prefill chunk bucket

S = jax.ShapeDtypeStruct
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _rows(b):
  return SamplingRows(S((b,), f32), S((b,), i32), S((b,), f32), S((b,), f32))


def _sampler(m: ModelShape, target: str, probabilistic: bool):
  b, s, v = BATCH, STEPS, m.vocab
  if probabilistic:
    fn = lambda d, q, l, rows, u, a, ok: speculative_sample(
        d, q, l, rows, u, m.tokenizer_vocab, a, draft_probs_ok=ok, interpret=False,
        target=target)
    return fn, [S((b, s), i32), S((b, s, v), f32), S((b, s + 1, v), f32), _rows(b),
                S((b, s + 1), f32), S((b,), jnp.bool_), S((b, s), jnp.bool_)]
  fn = lambda d, l, rows, u, a: speculative_sample(
      d, None, l, rows, u, m.tokenizer_vocab, a, interpret=False, target=target)
  return fn, [S((b, s), i32), S((b, s + 1, v), f32), _rows(b), S((b, s + 1), f32),
              S((b,), jnp.bool_)]


def _proposal(m: ModelShape, target: str):
  fn = lambda l, rows, u, d2t: propose_draft_tokens(
      l, rows, u, d2t=d2t, target_vocab_size=m.vocab, interpret=False, target=target)
  return fn, [S((BATCH, m.draft_vocab), f32), _rows(BATCH), S((BATCH,), f32),
              S((m.draft_vocab,), i32)]


def _norm_concat(m: ModelShape, target: str):
  fn = lambda e, h, we, wh: rmsnorm_concat(e, h, we, wh, 1e-6, 1e-6, interpret=False,
                                           target=target)
  rows = BATCH * (STEPS + 1)
  return fn, [S((rows, m.hidden), bf16)] * 2 + [S((m.hidden,), bf16)] * 2


def _lm_head(m: ModelShape, target: str, batch: int, rows: int):
  fn = lambda h, r, w: gathered_lm_head(h, r, w, interpret=False, target=target)
  return fn, [S((batch, m.hidden), bf16), S((batch,), i32), S((rows, m.hidden), bf16)]


def _attention(m: ModelShape, target: str, batch: int, tokens: int, table: int,
               tree: bool = False, kv_dtype=bf16):
  pages = table // PAGE_SIZE
  pool = S((batch * pages + 8, PAGE_SIZE, m.kv_heads, m.head_dim), kv_dtype)
  args = [S((batch, tokens, m.heads, m.head_dim), bf16), pool, pool, S((batch, pages), i32),
          S((batch,), i32), S((batch,), i32)]
  if tree:
    args.append(S((batch, tokens, tokens), jnp.bool_))
  fn = lambda q, k, v, pt, kv, ql, *mask: paged_attention(
      q, k, v, pt, kv, ql, block_mask=mask[0] if mask else None, interpret=False,
      target=target)
  return fn, args


def _tree_sampler(m: ModelShape, target: str, verify: str):
  k, depth, n = TREE
  b, e, v = BATCH, 1 + (depth - 1) * k, m.vocab
  # Traversal: with the argmax kernel of its greedy rows.
  fn = lambda tok, par, q, qr, p, g, u, a, ok: verify_tree(
      tok, par, q, qr, p, g, u, m.tokenizer_vocab, a, method=verify, max_depth=depth,
      draft_probs_ok=ok, max_children=k, interpret=False, target=target)
  return fn, [S((b, n), i32), S((b, n), i32), S((b, e, v), f32), S((b, n), i32),
              S((b, n, v), f32), S((b,), jnp.bool_), S((b, n + 1), f32), S((b,), jnp.bool_),
              S((b, e), jnp.bool_)]


def _tree_mask(m: ModelShape, target: str):
  return (lambda par: build_tree_mask(par, interpret=False, target=target),
          [S((BATCH, TREE[2]), i32)])


def _attention_draft_level(m: ModelShape, target: str):
  """A draft tree level: K queries, each seeing its ancestors among the K (S-1) scratch
  keys before it (the wide block mask)."""
  k, depth, _ = TREE
  pages = TABLE // PAGE_SIZE
  pool = S((BATCH * pages + 8, PAGE_SIZE, m.kv_heads, m.head_dim), bf16)
  fn = lambda q, kp, vp, pt, kv, ql, mask: paged_attention(
      q, kp, vp, pt, kv, ql, block_mask=mask, interpret=False, target=target)
  return fn, [S((BATCH, k, m.heads, m.head_dim), bf16), pool, pool, S((BATCH, pages), i32),
              S((BATCH,), i32), S((BATCH,), i32), S((BATCH, k, k * (depth - 1)), jnp.bool_)]


# label -> (model, target) -> (fn, ShapeDtypeStruct args): every kernel call of a step.
CASES = {
    f"sampler, probabilistic draft, B={BATCH}": lambda m, t: _sampler(m, t, True),
    f"sampler, greedy draft (one-hot q), B={BATCH}": lambda m, t: _sampler(m, t, False),
    f"draft proposal, B={BATCH}": _proposal,
    f"norm-concat, {BATCH * (STEPS + 1)} rows": _norm_concat,
    f"gathered LM head, B={BATCH}": lambda m, t: _lm_head(m, t, BATCH, m.draft_vocab),
    "gathered LM head, B=8": lambda m, t: _lm_head(m, t, 8, m.draft_vocab),
    f"gathered LM head, EAGLE-1 (target vocabulary), B={BATCH}":
        lambda m, t: _lm_head(m, t, BATCH, m.vocab),
    f"attention decode, B={BATCH}": lambda m, t: _attention(m, t, BATCH, 1, TABLE),
    f"attention verify T={STEPS + 1}, B={BATCH}":
        lambda m, t: _attention(m, t, BATCH, STEPS + 1, TABLE),
    f"attention verify T={STEPS + 1}, B=8 (split-K)":
        lambda m, t: _attention(m, t, 8, STEPS + 1, TABLE),
    f"attention decode, FP8 KV, B={BATCH}":
        lambda m, t: _attention(m, t, BATCH, 1, TABLE, kv_dtype=KV_FP8),
    f"attention verify T={STEPS + 1}, FP8 KV, B={BATCH}":
        lambda m, t: _attention(m, t, BATCH, STEPS + 1, TABLE, kv_dtype=KV_FP8),
    f"attention tree verify T={STEPS + 1}, B={BATCH}":
        lambda m, t: _attention(m, t, BATCH, STEPS + 1, TABLE, tree=True),
    f"attention tree verify T={TREE[2]}, B={BATCH}":
        lambda m, t: _attention(m, t, BATCH, TREE[2], TABLE, tree=True),
    f"attention draft tree level, K={TREE[0]}, B={BATCH}": _attention_draft_level,
    f"tree sampler, traversal, N={TREE[2]}, B={BATCH}":
        lambda m, t: _tree_sampler(m, t, "traversal"),
    f"tree sampler, real q, N={TREE[2]}, B={BATCH}":
        lambda m, t: _tree_sampler(m, t, "recursive_rejection"),
    f"tree sampler, target-only, N={TREE[2]}, B={BATCH}":
        lambda m, t: _tree_sampler(m, t, "target_only"),
    f"tree mask, N={TREE[2]}, B={BATCH}": _tree_mask,
    f"attention prefill chunk {PREFILL}, B=1": lambda m, t: _attention(m, t, 1, PREFILL, TABLE),
    f"attention decode, B=1, {LONG} tokens (split-K)": lambda m, t: _attention(m, t, 1, 1, LONG),
}


# --------------------------------------------------------------------------------------
# The IR JAX hands to XLA.
# --------------------------------------------------------------------------------------


class TritonCall(NamedTuple):
  name: str
  ir: bytes  # MLIR bytecode of the Triton module
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.operation.name == "stablehlo.custom_call":
          yield inner.operation
        yield from _custom_calls(inner.operation)


def triton_calls(fn, args, platform: str = "rocm") -> list[TritonCall]:
  """The Triton kernels of ``fn(*args)`` as JAX lowers them for ``platform``, in call order."""
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  calls = []
  for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
    if str(op.attributes["call_target_name"]).strip('"') != TRITON_CUSTOM_CALL:
      continue
    config = op.attributes["mhlo.backend_config"]
    value = lambda key: config[key].value
    calls.append(TritonCall(
        str(config["name"]).strip('"'), config["ir"].value_bytes, value("num_warps"),
        value("num_stages"), (value("grid_x"), value("grid_y"), value("grid_z"))))
  if not calls:
    raise RuntimeError(
        f"no {TRITON_CUSTOM_CALL} call with a bytecode 'ir' in the lowered module: this reads "
        f"the backend config of jax {TESTED_PAIRING['jax']} (found jax {jax.__version__})")
  return calls


# --------------------------------------------------------------------------------------
# Compiling it with the triton package, and what the code object says.
# --------------------------------------------------------------------------------------


def compile_kernel(call: TritonCall, arch: str) -> tuple[bytes, int]:
  """(code object, LDS / shared-memory bytes) of ``call`` compiled for ``arch``: a gfx
  name (an hsaco, wavefront 64) or sm_NN (a cubin, for comparison with NVIDIA).

  Runs the backend's stages from make_ttir on, as ``triton.compile`` does for a Python
  kernel: for an IR file it would read the bytes as text and skip the TTIR passes, which
  XLA does run.
  """
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget, Language
  from triton.compiler.compiler import make_backend

  target = (GPUTarget("hip", arch, 64) if arch.startswith("gfx")
            else GPUTarget("cuda", int(arch.removeprefix("sm_")), 32))
  backend = make_backend(target)
  options = backend.parse_options(dict(num_warps=call.num_warps, num_stages=call.num_stages))
  context = ir.context()
  ir.load_dialects(context)
  backend.load_dialects(context)
  with tempfile.NamedTemporaryFile(suffix=".mlirbc") as f:
    f.write(call.ir)
    f.flush()
    try:
      module = ir.parse_mlir_module(f.name, context)
    except RuntimeError as e:
      raise RuntimeError(
          f"triton {_triton_version()} could not read jax {jax.__version__}'s Triton bytecode "
          f"(tested pairing: {TESTED_PAIRING})") from e
  module.context = context
  stages: dict = {}
  backend.add_stages(stages, options, Language.TRITON)
  metadata = dict(options.__dict__, target=target, hash=call.name)
  for stage in stages.values():
    module = stage(module, metadata)
  return module, metadata["shared"]


def _triton_version() -> str:
  import triton
  return triton.__version__


def code_object_metadata(hsaco: bytes) -> dict:
  """The one kernel's entry of the AMDGPU metadata note (msgpack) of an ELF code object."""
  import msgpack

  (shoff,) = struct.unpack_from("<Q", hsaco, 0x28)
  shentsize, shnum = struct.unpack_from("<HH", hsaco, 0x3A)
  for i in range(shnum):
    (sh_type,) = struct.unpack_from("<I", hsaco, shoff + i * shentsize + 4)
    offset, size = struct.unpack_from("<QQ", hsaco, shoff + i * shentsize + 0x18)
    if sh_type != 7:  # SHT_NOTE
      continue
    pos = offset
    while pos < offset + size:
      namesz, descsz, note_type = struct.unpack_from("<III", hsaco, pos)
      name = hsaco[pos + 12:pos + 12 + namesz].rstrip(b"\0")
      desc = pos + 12 + (namesz + 3) // 4 * 4
      if name == b"AMDGPU" and note_type == 32:  # NT_AMDGPU_METADATA
        [kernel] = msgpack.unpackb(hsaco[desc:desc + descsz])["amdhsa.kernels"]
        return kernel
      pos = desc + (descsz + 3) // 4 * 4
  raise ValueError("no AMDGPU metadata note in the code object")


def _cubin_resources(cubin: bytes) -> dict:
  """Registers and local-memory (spill) bytes of a cubin, from the wheel's cuobjdump."""
  import triton

  tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                         text=True, check=True).stdout
  m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
  return dict(regs=int(m[1]), stack=int(m[2]), local=int(m[3]))


# CDNA3 (gfx942) and CDNA4 (gfx950): per SIMD, 512 VGPRs per lane shared by the arch VGPRs
# and AGPRs of its waves (allocated in granules of 8), at most 8 waves; SGPRs per wave as
# LLVM's GFX9 occupancy table; the CU's LDS shared by the workgroups resident on it.
_MAX_WAVES = 8
_VGPRS_PER_SIMD = 512
_SGPR_WAVES = ((80, 10), (88, 9), (100, 8), (112, 7), (128, 6), (144, 5), (168, 4), (204, 3),
               (256, 2))


def waves_per_simd(arch: str, vgprs: int, sgprs: int, lds: int, num_warps: int):
  """(waves, limiter): the waves per SIMD the resources allow, and what limits them."""
  limits = {"max": _MAX_WAVES,
            "VGPR": _VGPRS_PER_SIMD // (-(-max(vgprs, 1) // 8) * 8),
            "SGPR": next((w for n, w in _SGPR_WAVES if sgprs <= n), 1)}
  if lds:
    workgroups = GPU_TARGETS[arch].shared_bytes // lds
    limits["LDS"] = workgroups * num_warps // 4  # a workgroup's waves spread over 4 SIMDs
  waves = min(limits.values())
  return waves, min(limits, key=lambda k: (limits[k], k != "max"))


def resources(call: TritonCall, arch: str) -> dict:
  binary, lds = compile_kernel(call, arch)
  if not arch.startswith("gfx"):
    return dict(_cubin_resources(binary), lds=lds)
  md = code_object_metadata(binary)
  vgprs = md[".vgpr_count"]  # arch VGPRs + AGPRs on CDNA
  waves, limiter = waves_per_simd(arch, vgprs, md[".sgpr_count"], lds, call.num_warps)
  return dict(vgpr=vgprs, agpr=md.get(".agpr_count", 0), sgpr=md[".sgpr_count"],
              vgpr_spill=md[".vgpr_spill_count"], sgpr_spill=md[".sgpr_spill_count"],
              scratch=md[".private_segment_fixed_size"], lds=lds, waves=waves,
              limiter=limiter)


# --------------------------------------------------------------------------------------
# The run, the table.
# --------------------------------------------------------------------------------------


def run(models, archs, log=print) -> list[dict]:
  """One row per (model, case, kernel, arch); a row whose compile failed holds 'error'."""
  rows = []
  for model in models:
    for label, case in CASES.items():
      for arch in archs:
        calls = triton_calls(*case(MODELS[model], arch), GPU_TARGETS[arch].platform)
        for call in calls:
          row = dict(model=model, case=label, kernel=call.name, arch=arch,
                     num_warps=call.num_warps, num_stages=call.num_stages, grid=call.grid)
          start = time.perf_counter()
          try:
            row.update(resources(call, arch))
          except Exception as e:  # noqa: BLE001 - reported per kernel, fails the run
            row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
          row["seconds"] = round(time.perf_counter() - start, 2)
          log(_line(row))
          rows.append(row)
  return rows


def failures(rows) -> list[str]:
  """Rows that did not compile, spill, or need more LDS than a CU has, as messages."""
  bad = []
  for r in rows:
    where = f"{r['model']} | {r['case']} | {r['kernel']} | {r['arch']}"
    if "error" in r:
      bad.append(f"{where}: {r['error']}")
      continue
    if "regs" in r:  # NVIDIA
      if r["local"] or r["stack"]:
        bad.append(f"{where}: {r['local']} bytes of local memory, {r['stack']} of stack")
      continue
    if r["vgpr_spill"] or r["sgpr_spill"] or r["scratch"]:
      bad.append(f"{where}: spills {r['vgpr_spill']} VGPRs, {r['sgpr_spill']} SGPRs, "
                 f"{r['scratch']} bytes of scratch")
    if r["waves"] < 1:
      bad.append(f"{where}: {r['lds']} bytes of LDS, more than the CU's "
                 f"{GPU_TARGETS[r['arch']].shared_bytes}: cannot launch")
  return bad


def _line(r) -> str:
  head = (f"{r['model']} | {r['case']} | {r['kernel']} | {r['arch']} | "
          f"w{r['num_warps']} s{r['num_stages']}")
  if "error" in r:
    return f"{head} | ERROR {r['error']}"
  if "regs" in r:
    return (f"{head} | {r['regs']} registers, {r['local']} bytes local, {r['stack']} stack, "
            f"shared {r['lds']} | {r['seconds']} s")
  return (f"{head} | VGPR {r['vgpr']} (AGPR {r['agpr']}) SGPR {r['sgpr']} spills "
          f"{r['vgpr_spill']}/{r['sgpr_spill']} LDS {r['lds']} waves {r['waves']} "
          f"({r['limiter']}) | {r['seconds']} s")


def table(rows) -> str:
  """Markdown: one line per (model, case, kernel), the AMD architectures side by side."""
  rows = [r for r in rows if r["arch"].startswith("gfx")]
  archs = list(dict.fromkeys(r["arch"] for r in rows))
  head = ["model", "case", "kernel"] + [
      f"{a}: warps, stages: VGPR / SGPR / spills / LDS / waves per SIMD" for a in archs]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  by_key = {(r["model"], r["case"], r["kernel"], r["arch"]): r for r in rows}
  for key in dict.fromkeys((r["model"], r["case"], r["kernel"]) for r in rows):
    lines.append("| " + " | ".join([*key, *(cell(by_key.get((*key, a))) for a in archs)])
                 + " |")
  return "\n".join(lines)


def cell(r) -> str:
  """One kernel on one target: launch, then VGPR / SGPR / spills / LDS / waves (limiter).
  None: the heuristic launches no such kernel for this target's shapes (a combine kernel
  where only one architecture's core count splits the keys)."""
  if r is None:
    return "not launched"
  if "error" in r:
    return "does not compile"
  limiter = "" if r["limiter"] == "max" else f" ({r['limiter']})"
  return (f"w{r['num_warps']} s{r['num_stages']}: {r['vgpr']} / {r['sgpr']} / "
          f"{r['vgpr_spill'] + r['sgpr_spill']} / {r['lds']} / {r['waves']}{limiter}")


def write_doc(text: str, path: Path = DOC) -> None:
  """Replaces the table between the markers of ``path``."""
  doc = path.read_text()
  start, end = doc.index(DOC_BEGIN) + len(DOC_BEGIN), doc.index(DOC_END)
  path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def doc_table(path: Path = DOC) -> str:
  doc = path.read_text()
  return doc[doc.index(DOC_BEGIN) + len(DOC_BEGIN):doc.index(DOC_END)].strip()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--arch", default=",".join(ARCHS),
                  help="gfx950, gfx942, or sm_90 (NVIDIA, for comparison; not in the table)")
  ap.add_argument("--model", default=",".join(MODELS))
  ap.add_argument("--json", help="write every row here")
  ap.add_argument("--write-doc", nargs="?", const=str(DOC),
                  help="replace the table in this markdown file (default docs/ROCM.md)")
  args = ap.parse_args(argv)
  print(f"jax {jax.__version__}, triton {_triton_version()} (tested pairing: {TESTED_PAIRING})")
  start = time.perf_counter()
  rows = run(args.model.split(","), args.arch.split(","))
  text = table(rows)
  print(f"\n{text}\n\n{len(rows)} compiles in {time.perf_counter() - start:.0f} s")
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
  if args.write_doc:
    write_doc(text, Path(args.write_doc))
  bad = failures(rows)
  for line in bad:
    print("FAIL", line)
  sys.exit(1 if bad else 0)

