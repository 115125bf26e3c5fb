"""The engine's command-line flags: each ``EngineConfig`` field a tool may set, declared
once (``CLI_FLAGS``) and read back into a config. Tools call them as
``EngineConfig.add_cli_args`` / ``EngineConfig.from_cli_args``."""

from __future__ import annotations

import argparse
import dataclasses

from eagle_jax.argtypes import int_tuple, positive_int
from eagle_jax.engine.config import (
    ALGORITHMS, DRAFT_SAMPLE_METHODS, KV_CACHE_DTYPES, QUANTIZATIONS, SPECULATIVE_POLICIES,
    TREE_VERIFY_METHODS)


def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                 include: tuple[str, ...] | None = None, exclude: tuple[str, ...] = (),
                 defaults: dict | None = None,
                 title: str = "engine") -> argparse._ArgumentGroup:
    """Declares the engine's command-line flags (``CLI_FLAGS``) on ``parser``, in a group
    of their own: every flag, or the fields named in ``include``, less those in
    ``exclude`` (a tool that sweeps a field, or names it otherwise, declares its own).
    ``defaults`` ({field: value}) replaces a flag's default for this tool. Read them
    back with ``from_cli_args``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    names = [f.field for f in CLI_FLAGS]
    for name in (*(include or ()), *exclude, *(defaults or {})):
        if name not in names:
            raise ValueError(f"{name!r} is not an engine flag's field (fields with a "
                             f"flag: {', '.join(names)})")
    defaults = defaults or {}
    group = parser.add_argument_group(title)
    declared = list(parser.get_default(_DECLARED) or ())
    for f in CLI_FLAGS:
        if (include is not None and f.field not in include) or f.field in exclude:
            continue
        assert f.field in fields, f.field
        kw = dict(f.kwargs)
        if f.invert:
            kw.update(action="store_true", default=False)
            note = ""
        elif f.field in defaults:
            kw["default"] = defaults[f.field]
            note = f"default: {defaults[f.field]}"
        else:
            kw["default"] = f.cli_default(cls)
            shown = kw["default"] not in (None, False) and "default" not in f.help
            note = f.default_help or (f"default: {kw['default']}" if shown else "")
        group.add_argument(f.flag, dest=f.dest,
                           help=f.help + (f" ({note})" if note else ""), **kw)
        declared.append(f.field)
    parser.set_defaults(**{_DECLARED: tuple(declared)})
    return group

def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineConfig":
    """The config of the engine flags ``add_cli_args`` declared on the parser that
    parsed ``args``; a flag left at None keeps the field's default, and ``overrides``
    ({field: value}, e.g. the model directories a tool resolved) win over both. The
    checks of ``__post_init__`` run here (ValueError naming the field)."""
    declared = set(getattr(args, _DECLARED, ()))
    kw = {}
    for f in CLI_FLAGS:
        if f.field not in declared or f.field in overrides:
            continue
        value = getattr(args, f.dest)
        if f.invert:
            kw[f.field] = not value
        elif value is not None:
            kw[f.field] = value
    kw.update(overrides)
    return cls(**kw)



@dataclasses.dataclass(frozen=True)
class CliFlag:
    """One engine flag: ``flag`` sets the field ``field``. ``invert``: a ``--no-...``
    switch of a field that is True by default."""

    flag: str
    field: str
    help: str
    kwargs: dict = dataclasses.field(default_factory=dict)  # argparse's type, choices, ...
    default_help: str = ""  # what the default means, where the help should say it
    invert: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def cli_default(self, cls) -> object:
        """The field's own default, or None where the field has none (the model) or where
        None on the command line stands for it (the buckets, the cache directory)."""
        if self.field in _NONE_ON_THE_COMMAND_LINE:
            return None
        default = {f.name: f.default for f in dataclasses.fields(cls)}[self.field]
        return None if default is dataclasses.MISSING else default


_DECLARED = "_engine_config_cli_fields"  # on the namespace: the fields add_cli_args declared
# Fields whose flag defaults to None while the field does not: None leaves the field's own.
_NONE_ON_THE_COMMAND_LINE = ("model", "batch_buckets", "prefill_buckets", "compilation_cache_dir")

CLI_FLAGS = (
    CliFlag("--model", "model", "HF checkpoint directory of the target",
            default_help="default: the embedded model"),
    CliFlag("--draft-model", "draft_model", "checkpoint directory of the draft"),
    CliFlag("--speculative-algorithm", "speculative_algorithm",
            "the draft's kind, or NONE for the target alone",
            dict(choices=list(ALGORITHMS), type=str.upper)),
    CliFlag("--num-steps", "num_steps", "draft steps per step: a chain's length, a tree's depth",
            dict(type=positive_int)),
    CliFlag("--speculative-eagle-topk", "speculative_eagle_topk",
            "K: 1 drafts a chain; K > 1 an EAGLE-2 dynamic tree, K children per "
            "expanded node (the policy is then fixed)", dict(type=positive_int)),
    CliFlag("--num-draft-tokens", "num_draft_tokens",
            "tokens the target verifies per step, the root included: a chain's num_steps + 1 "
            "(its only value); a tree's root + nodes (default 32, at most 1 + K + "
            "(num_steps - 1) K^2)", dict(type=positive_int)),
    CliFlag("--tree-verify", "tree_verify",
            "trees: how sampled requests are verified, all exact: traversal (the draft's real "
            "q, whole paths at once; default), recursive_rejection (the same trees, token by "
            "token: fewer tokens accepted) or target_only (SGLang's rule); greedy requests "
            "take the target's argmax path", dict(choices=list(TREE_VERIFY_METHODS))),
    CliFlag("--speculative-policy", "speculative_policy",
            "adaptive: each step drafts the length (of --speculative-draft-lengths) with the "
            "most expected committed tokens per second; fixed: every step drafts --num-steps",
            dict(choices=list(SPECULATIVE_POLICIES)),
            default_help="default: adaptive on a GPU, fixed on a CPU"),
    CliFlag("--speculative-draft-lengths", "draft_lengths",
            "comma-separated lengths the adaptive policy picks from, 0 (the target's step) to "
            "--num-steps", dict(type=int_tuple), default_help="default: 0,1,2,3,num_steps"),
    CliFlag("--draft-sample-method", "draft_sample_method",
            "probabilistic: sampled requests draw draft tokens from the draft's distribution "
            "(greedy requests propose its argmax either way)",
            dict(choices=list(DRAFT_SAMPLE_METHODS))),
    CliFlag("--max-model-len", "max_model_len", "tokens per request", dict(type=positive_int),
            default_help="default: the target's own limit, capped by what the KV pool holds; "
                         "on a CPU by 4096"),
    CliFlag("--max-num-seqs", "max_num_seqs",
            "batch slots, requests decoded at once; more wait for KV pages",
            dict(type=positive_int), default_help="default: 4 on a CPU, 64 on a GPU"),
    CliFlag("--page-size", "page_size", "positions per KV page (a power of two)",
            dict(type=positive_int)),
    CliFlag("--no-prefix-caching", "enable_prefix_caching",
            "prefill every prompt in full instead of sharing the KV pages of a prefix an "
            "earlier request computed", invert=True),
    CliFlag("--max-num-batched-tokens", "max_num_batched_tokens",
            "positions one step computes: the running requests' decode rows plus prefill "
            "chunks of new prompts; a longer prompt is prefilled over several steps while the "
            "others keep decoding", dict(type=positive_int),
            default_help="default: 512 on a CPU, 2048 on a GPU"),
    CliFlag("--max-num-partial-prefills", "max_num_partial_prefills",
            "most requests whose prompt chunks one forward carries: requests arriving "
            "together are prefilled with one read of the weights", dict(type=positive_int),
            default_help="default: 1 on a CPU, 16 on a GPU"),
    CliFlag("--batch-buckets", "batch_buckets", "comma-separated batch buckets",
            dict(type=int_tuple),
            default_help="default: the engine's powers of two up to --max-num-seqs"),
    CliFlag("--prefill-buckets", "prefill_buckets",
            "comma-separated prompt chunk lengths compiled for prefill", dict(type=int_tuple),
            default_help="default: the engine's"),
    CliFlag("--tensor-parallel-size", "tensor_parallel_size",
            "devices the target is split over (a mesh of the first N local devices); "
            "multi-host: every process's devices, e.g. 16 for 2 hosts x 8 GPUs",
            dict(type=positive_int)),
    CliFlag("--data-parallel-size", "data_parallel_size",
            "engine replicas, each over its own --tensor-parallel-size devices; requests go to "
            "the least loaded", dict(type=positive_int)),
    CliFlag("--dtype", "dtype", "parameter and activation dtype",
            dict(choices=["bfloat16", "float32"]),
            default_help="default: float32 on a CPU, bfloat16 on a GPU"),
    CliFlag("--quantization", "quantization",
            "fp8: the target's linear layers in FP8, quantized while loading (per-channel "
            "weights, per-token activations); an FP8 checkpoint (compressed-tensors, "
            "fbgemm_fp8) loads in FP8 without it", dict(choices=list(QUANTIZATIONS)),
            default_help="default: the checkpoint's own"),
    CliFlag("--draft-quantization", "draft_quantization",
            "fp8: the draft's linear layers in FP8 too (its LM head excepted)",
            dict(choices=list(QUANTIZATIONS)), default_help="default: the draft in --dtype"),
    CliFlag("--kv-cache-dtype", "kv_cache_dtype",
            "fp8: the KV pools in e4m3, 2x the positions of bfloat16 in the same memory "
            "(values saturated at +-448, no scale)", dict(choices=list(KV_CACHE_DTYPES)),
            default_help="default: auto, the pools in --dtype"),
    CliFlag("--kv-cache-memory", "kv_cache_memory", "KV pool bytes", dict(type=positive_int)),
    CliFlag("--kv-cache-memory-fraction", "kv_cache_memory_fraction",
            "or this share of the free device memory", dict(type=float),
            default_help="GPU; default 0.75"),
    CliFlag("--seed", "seed", "the engine's seed", dict(type=int)),
    CliFlag("--no-precompile", "precompile",
            "compile batch buckets lazily instead of at start-up", invert=True),
    CliFlag("--precompile-logprobs", "precompile_logprobs",
            "also compile the buckets' logprobs variants at start-up, so that the first "
            "request asking for logprobs (lm-eval's loglikelihood tasks) does not stall the "
            "running streams while they compile", dict(action="store_true")),
    CliFlag("--compile-in-background", "compile_in_background",
            "with precompile, be ready once the executables that serve any request are "
            "compiled, and compile the rest while serving",
            dict(action=argparse.BooleanOptionalAction)),
    CliFlag("--background-compile-threads", "background_compile_threads",
            "threads compiling in the background while serving: more finish sooner and "
            "slow the requests served meanwhile", dict(type=positive_int)),
    CliFlag("--compilation-cache-dir", "compilation_cache_dir",
            "the engine's stored executables (its 'executables' folder), or JAX's "
            "persistent compilation cache for an engine that stores none; '' disables both",
            default_help="default: ~/.cache/eagle_jax/jax_cache"),
)
