"""Engine configuration."""

from __future__ import annotations

import argparse
import dataclasses
import os

ALGORITHMS = ("EAGLE", "EAGLE3", "NONE")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
SPECULATIVE_POLICIES = ("adaptive", "fixed")
TREE_VERIFY_METHODS = ("traversal", "recursive_rejection", "target_only")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_TREE_TOKENS = 32
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine is built and compiled.

    Attributes:
      model: Hugging Face directory of the target model.
      draft_model: directory of the EAGLE-1 / EAGLE-3 draft (required unless NONE).
      speculative_algorithm: "EAGLE", "EAGLE3" or "NONE" (plain decoding).
      num_steps: S, draft tokens proposed per step (chain drafting), or the depth of a
        draft tree (at most S tokens accepted from it).
      speculative_eagle_topk: K, children per expanded node; 1 drafts a chain, K > 1 an
        EAGLE-2 dynamic tree (``draft_tree.py``), expanding K nodes per level.
      num_draft_tokens: tokens the target verifies per step, the root (the last
        committed token) included: S + 1 for chains (None derives it); for trees the
        root and num_draft_tokens - 1 drafted nodes (None: 32, SGLang's usual choice),
        at most 1 + K + (S-1) K^2 (the candidates there are).
      tree_verify: how a tree's sampled rows are verified, all exact:
        "traversal" (the draft's real q, children drawn without replacement, whole
        paths accepted at once, leaves first: Traversal Verification,
        ``traversal_sampler.py``), "recursive_rejection" (the same trees, token by
        token: ``tree_sampler.py``; fewer tokens accepted at T > 0, and a slower
        sampler on an H200: docs/BENCHMARKS.md, "Tree drafting") or "target_only"
        (SGLang's rule over the draft's top-K children; the baseline).
        Greedy rows take the target's argmax path in every case.
      speculative_policy: "adaptive" chooses each step's draft length among
        ``draft_lengths`` for the most expected committed tokens per second (each
        variant timed at start-up, acceptance estimated while serving:
        ``draft_policy.py``); "fixed" drafts num_steps in every step. None = the
        backend's default: adaptive on a GPU; fixed on a CPU, where every length is
        another step executable to compile at start-up (seconds each), and fixed for
        trees (the policy chooses chain lengths).
      draft_lengths: the lengths "adaptive" chooses from, 0 (the target's step) to
        num_steps; None = 0, 1, 2, 3 and num_steps. A step that carries a prompt chunk
        drafts num_steps (its chunk rows are num_steps + 1 wide).
      draft_sample_method: "probabilistic" (the default) draws a sampled row's draft
        tokens from the draft's q and tests them against the real q; greedy rows still
        propose the argmax (001), so greedy output is the same under both. "greedy"
        proposes every row's argmax (q one-hot in the accept test): a sampled row then
        accepts less (on the default pair at temperature 1, accept length 1.67-1.87
        against 2.66-2.77).
      max_model_len: prompt + generated tokens per request; None = the target's own
        limit, capped by what the KV pool holds (on a CPU, by CPU_MAX_MODEL_LEN).
      max_num_seqs: most requests decoded at once (slots); None = the backend's default
        (``for_backend``). Requests wait for KV pages beyond that: the pool, not the slot
        count, bounds the tokens held.
      page_size: positions per KV page.
      enable_prefix_caching: share the KV pages of a prompt prefix some earlier request
        computed (full pages, target and draft) instead of prefilling it again.
      max_num_batched_tokens: prefill positions one engine step may run besides the
        decode rows of the running requests (the decode rows count against it too; a
        step that has no room left still prefills one smallest chunk, so prompts always
        progress). A long prompt is prefilled a chunk per step while the running
        requests keep decoding. None = the backend's default (``for_backend``).
      max_num_partial_prefills: most requests whose prompt chunks one forward carries
        (vLLM's name): a decode step, or a prefill with nothing decoding, runs the next
        chunk of up to this many requests in prefill in one forward, one read of the
        weights for all of them. Chunk counts are compiled in powers of two up to it.
        None = the backend's default: 16 on a GPU, where a forward over a few hundred
        positions costs about its weight read; 1 on a CPU, whose forward is bound by
        its arithmetic (several chunks at once gain nothing there).
      batch_buckets / prefill_buckets: compiled batch sizes and prompt chunk lengths.
      kv_cache_memory: KV pool budget in bytes (per device: tensor-parallel, each device
        holds its kv heads' share of the pool; more than a device has free beside the
        weights is an error at start); kv_cache_memory_fraction: or this share
        of the free device memory (a GPU; default 0.75 there). On a CPU without either,
        the pool holds max_num_seqs requests of max_model_len.
      tensor_parallel_size: N, devices the target is split over (``eagle_jax.parallel``:
        a mesh of the first N local devices; 1 = one device, no mesh). It must divide the
        target's attention heads and MLP width and divide or be a multiple of its kv heads
        (checked when the engine loads the target).
      dtype: parameter and activation dtype ("bfloat16" or "float32"); None = the
        backend's default (float32 on a CPU, bfloat16 on a GPU).
      quantization: "fp8" quantizes a float target's decoder-layer projections to FP8
        while loading (per-channel e4m3 weights, per-token activations; ``eagle_jax.fp8``).
        A checkpoint whose config.json has an FP8 quantization_config (compressed-tensors,
        fbgemm_fp8) loads in FP8 whatever this says. The e4m3 format follows the device
        (e4m3fnuz on gfx942, e4m3fn elsewhere); the embedding, the LM head and the norms
        stay in ``dtype``, the KV cache as ``kv_cache_dtype`` says.
      draft_quantization: "fp8" quantizes the draft's linear layers (its LM head
        excepted) on the fly as well; None keeps the draft in ``dtype``.
      kv_cache_dtype: "auto" keeps the KV pools (the target's and the draft's) in
        ``dtype``; "fp8" stores them in OCP e4m3 (``paged_attention.KV_FP8``, every
        device: the attention kernel widens each K / V tile to ``dtype`` in registers),
        each value saturated to +-448 with no scale (vLLM's default for an FP8 cache
        without calibrated scales): the same memory holds 2x the positions of bfloat16.
      precompile: compile every bucket at start (with a progress bar).
      precompile_logprobs: with precompile, also compile every bucket's logprobs
        variant at start. Otherwise the first request that asks for logprobs (as
        lm-eval's loglikelihood tasks do) compiles them while serving, and every running
        stream waits for those compiles.
      compile_in_background: with precompile, compile first the few executables that
        serve any request (``BucketMenu.ready_set``), return, and compile the rest in
        background threads; until an executable is compiled the scheduler picks a
        compiled one that can serve (a larger batch bucket, another prefill shape),
        and an "adaptive" policy drafts num_steps. The server's default (it answers
        while the rest compile); False compiles everything before the engine returns.
        One engine over several processes (``multihost``) compiles everything first.
      background_compile_threads: threads compiling in the background while the engine
        serves (the ready set, and everything with compile_in_background False, compile
        with up to 16 before it serves). Each compile holds host cores, and its tracing
        the GIL, that the serving loop needs: an H100 (16 cores) serving the 8B shape
        right after ready gave a first TTFT of 511 ms with 16 threads and 124 ms with 2
        (38 ms at rest). More finish the background sooner.
      compilation_cache_dir: in its ``executables`` folder, the engine's compiled
        executables (``executable_store``: a warm start neither traces nor compiles);
        an engine that stores none (another ``compile_fn``) points JAX's persistent
        compilation cache here instead; "" disables both.
      async_scheduling: dispatch each step before reading the previous one's tokens.
      synthetic_acceptance: benchmarks only: accept each draft token with this
        probability instead of by the sampler's verdict (fixes the accept length, as
        serving benchmarks do); committed tokens are then not the model's output.
    """

    model: str
    draft_model: str | None = None
    speculative_algorithm: str = "EAGLE3"
    num_steps: int = 5
    speculative_eagle_topk: int = 1
    num_draft_tokens: int | None = None
    tree_verify: str = "traversal"
    speculative_policy: str | None = None
    draft_lengths: tuple[int, ...] | None = None
    draft_sample_method: str = "probabilistic"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    page_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_partial_prefills: int | None = None
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    prefill_buckets: tuple[int, ...] = DEFAULT_PREFILL_BUCKETS
    kv_cache_memory: int | None = None
    kv_cache_memory_fraction: float | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str | None = None
    quantization: str | None = None
    draft_quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    precompile: bool = True
    precompile_logprobs: bool = False
    compile_in_background: bool = False
    background_compile_threads: int = 2
    compilation_cache_dir: str = os.path.join(
        os.path.expanduser("~"), ".cache", "eagle_jax", "jax_cache")
    served_model_name: str | None = None
    async_scheduling: bool = True
    synthetic_acceptance: float | None = None

    def __post_init__(self):
        self._check_speculation()
        self._check_sizes()

    def _check_speculation(self) -> None:
        """Checks the speculative fields and fills those whose default follows others."""
        algo = self.speculative_algorithm.upper()
        object.__setattr__(self, "speculative_algorithm", algo)
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {algo!r}")
        if algo != "NONE" and not self.draft_model:
            raise ValueError(f"speculative_algorithm {algo} needs a draft_model directory")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        topk = self.speculative_eagle_topk
        if topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {topk}")
        if self.tree_verify not in TREE_VERIFY_METHODS:
            raise ValueError(f"tree_verify must be one of {TREE_VERIFY_METHODS}, got "
                             f"{self.tree_verify!r}")
        if topk == 1:
            if self.num_draft_tokens is None:
                object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
            elif self.num_draft_tokens != self.num_steps + 1:
                raise ValueError(
                    f"chain drafting verifies num_steps + 1 tokens: num_draft_tokens must be "
                    f"{self.num_steps + 1} for num_steps {self.num_steps}, got "
                    f"{self.num_draft_tokens} (or set speculative_eagle_topk > 1 for a tree)")
        else:
            most = 1 + topk + (self.num_steps - 1) * topk * topk
            if self.num_draft_tokens is None:
                object.__setattr__(self, "num_draft_tokens", min(DEFAULT_TREE_TOKENS, most))
            elif not 2 <= self.num_draft_tokens <= most:
                raise ValueError(
                    f"a tree of topk {topk} and {self.num_steps} steps verifies 2 .. {most} "
                    f"tokens (root included), got num_draft_tokens {self.num_draft_tokens}")
            if self.speculative_policy == "adaptive":
                raise ValueError("speculative_policy 'adaptive' chooses chain lengths; with "
                                 "speculative_eagle_topk > 1 use 'fixed' (or leave it unset)")
            if self.speculative_policy is None:
                object.__setattr__(self, "speculative_policy", "fixed")
        if self.speculative_policy is not None and (
                self.speculative_policy not in SPECULATIVE_POLICIES):
            raise ValueError(f"speculative_policy must be one of {SPECULATIVE_POLICIES}, "
                             f"got {self.speculative_policy!r}")
        if self.draft_lengths is None:
            lengths = {0, 1, 2, 3, self.num_steps}
        else:
            lengths = set(self.draft_lengths)
            if not lengths or any(not 0 <= s <= self.num_steps for s in lengths):
                raise ValueError(f"draft_lengths must lie in [0, num_steps = {self.num_steps}]"
                                 f", got {self.draft_lengths}")
            if self.num_steps not in lengths:
                raise ValueError(f"draft_lengths {self.draft_lengths} must include num_steps "
                                 f"({self.num_steps}), the longest length (or lower num_steps)")
        object.__setattr__(self, "draft_lengths",
                           tuple(sorted(s for s in lengths if s <= self.num_steps)))
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {self.draft_sample_method!r}")

    def _check_sizes(self) -> None:
        """Checks the sizes, budgets and parallelism; sorts the buckets."""
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_num_partial_prefills is not None and self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got "
                             f"{self.max_num_partial_prefills}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive byte count, got "
                             f"{self.kv_cache_memory}")
        if not self.batch_buckets or any(b < 1 for b in self.batch_buckets):
            raise ValueError(f"batch_buckets must be positive, got {self.batch_buckets}")
        if not self.prefill_buckets or any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive, got {self.prefill_buckets}")
        object.__setattr__(self, "batch_buckets", tuple(sorted(set(self.batch_buckets))))
        object.__setattr__(self, "prefill_buckets", tuple(sorted(set(self.prefill_buckets))))
        if self.synthetic_acceptance is not None and not 0 <= self.synthetic_acceptance <= 1:
            raise ValueError("synthetic_acceptance must be in [0, 1]")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.precompile_logprobs and not self.precompile:
            raise ValueError("precompile_logprobs compiles at start, which precompile=False "
                             "turns off: drop one of the two")
        for name in ("quantization", "draft_quantization"):
            if getattr(self, name) not in (None, *QUANTIZATIONS):
                raise ValueError(f"{name} must be one of {QUANTIZATIONS} or None (the "
                                 f"checkpoint's own), got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.draft_quantization is not None and not self.speculative:
            raise ValueError("draft_quantization quantizes the draft, and "
                             "speculative_algorithm NONE runs none: drop one of the two")
        threads = self.background_compile_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"background_compile_threads must be a positive integer, got "
                             f"{threads!r}")
        for name, one in (("tensor_parallel_size", "device"), ("data_parallel_size", "engine")):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer (1 = one {one}), "
                                 f"got {n!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, **kwargs) -> argparse._ArgumentGroup:
        """Declares the engine's command-line flags on ``parser``
        (``config_flags.add_cli_args``, which takes the same keywords)."""
        from eagle_jax.engine import config_flags  # it imports this module
        return config_flags.add_cli_args(cls, parser, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineConfig":
        """The config of the flags ``add_cli_args`` declared (``config_flags.from_cli_args``)."""
        from eagle_jax.engine import config_flags  # it imports this module
        return config_flags.from_cli_args(cls, args, **overrides)

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm != "NONE"

    def for_backend(self, backend: str) -> tuple["EngineConfig", list[str]]:
        """This config with every field left None filled for ``backend`` ("cpu" or a GPU
        platform), and one line per field so filled (for the start-up log).

        A CPU decodes a few requests of a modest context in float32 (bfloat16 matmuls
        are emulated there, several times slower); a GPU serves many in bfloat16 from
        its KV memory budget.
        """
        defaults = CPU_DEFAULTS if backend == "cpu" else GPU_DEFAULTS
        chosen = {name: value for name, value in defaults.items()
                  if getattr(self, name) is None
                  and (self.speculative or name != "speculative_policy")}
        notes = [f"{name}={value} (the {backend} default; set it to change)"
                 for name, value in chosen.items()]
        return dataclasses.replace(self, **chosen), notes


# Fields left None, by backend. (max_model_len left None is the target's limit, capped by
# the KV pool; a CPU, which has no memory budget to size the pool from, caps it at
# CPU_MAX_MODEL_LEN.)
CPU_DEFAULTS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=512,
                    max_num_partial_prefills=1, speculative_policy="fixed")
GPU_DEFAULTS = dict(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                    max_num_partial_prefills=16, speculative_policy="adaptive")
CPU_MAX_MODEL_LEN = 4096
