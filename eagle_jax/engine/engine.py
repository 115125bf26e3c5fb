"""The host-side engine: requests, slots, KV pages, buckets, and the compiled executables.

The engine owns one ``DecodeState`` of ``num_slots`` rows on the device and a paged KV
pool shared by all of them (``page_allocator.py`` says which request owns which page).
Between steps, waiting requests join free slots when the pool has pages for them (their
sampling tensors written; the full pages of a prefix an earlier request computed shared
from the prefix cache), finished and aborted requests leave and return their pages. A
joined request's remaining prompt is prefilled in chunks, at most
``max_num_batched_tokens`` positions per engine step less the running requests' decode
rows, so a long prompt no longer stalls the requests already decoding: the next chunks
of up to ``max_num_partial_prefills`` requests in prefill are carried by the decode step
itself (their tokens are extra rows of the step's forward, so the weights are read once
for all), or, when nothing decodes, run together as a prefill of their own before the
step (a request whose last chunk ran so joins that step). Before each step every running
request is given the pages the step may write; when the pool runs out, the newest running request is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed from its
prompt and the tokens it already produced (nothing it streamed is repeated). A step runs
the executable compiled for the smallest batch bucket that covers every occupied slot
and the draft length the draft policy chose for it (``draft_policy.py``: fixed, or the
length with the most expected committed tokens per second); the host then reads the
committed tokens and counts once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding
from tqdm.auto import tqdm

from eagle_jax import parallel
from eagle_jax.config import ModelConfig, resolve_dtype
from eagle_jax.engine import step as step_lib
from eagle_jax.engine.config import CPU_MAX_MODEL_LEN, EngineConfig
from eagle_jax.engine.draft_policy import AdaptiveDraftLength, FixedDraftLength
from eagle_jax.engine.draft_tree import scratch_positions
from eagle_jax.engine.host_inputs import HostLayout
from eagle_jax.engine.page_allocator import (
    OutOfPages, PageAllocator, page_hashes, pages_for, plan_pool)
from eagle_jax.engine.types import (
    RequestOutput, SchedulerStats, SpecDecodeStats, StepEvent, TokenLogprob)
from eagle_jax.kernels.paged_attention import max_pool_pages
from eagle_jax.models.decoder import Decoder, load_decoder
from eagle_jax.models.layers import KVPages
from eagle_jax.sampling import SamplingParams, SamplingRows

logger = logging.getLogger("eagle_jax.engine")

# Positions of a lane that a decode step carries prompt chunks in (rounded up to whole rows
# of the step's width): a few hundred positions of a forward cost about its weight read
# on a GPU, so a short chunk (a prefix-cache hit's tail) pads to one lane, while a long
# one spans several, each lane reading the chunk's prefix from the pool once.
STEP_LANE = 64


def _powers_of_two(most: int) -> tuple[int, ...]:
    """1, 2, 4, .. up to ``most``."""
    return tuple(1 << i for i in range(most.bit_length()))


class _StepVariant(NamedTuple):
    """Which compiled step a launch ran, and whether its cycle also ran a prompt chunk or
    the draft's catch-up (then it is not timed as the step's)."""

    batch: int
    draft_length: int
    ran_more: bool


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    slot: int = -1
    seq_len: int = 0  # tokens in the KV pool after the collected steps (or prefill chunks)
    in_prefill: bool = False  # holds a slot, its known tokens not all prefilled yet
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (first admission)
    page_keys: list = dataclasses.field(default_factory=list)  # of its full pages' tokens
    in_flight: int = 0  # steps dispatched for it whose tokens are not collected yet
    draft_lag: int = 0  # steps of draft length 0 dispatched since its draft caught up
    preemptions: int = 0  # also tags in-flight steps: a preempted request's are dropped
    admitted: int = 0  # admission order (the newest running request is preempted first)
    seed: int | None = None  # drawn at the first admission, kept across preemptions
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    detok: object = None
    stop_ids: frozenset = frozenset()  # stop token ids, EOS included unless ignore_eos
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None


def _enable_compilation_cache(path: str) -> None:
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _threefry_key(seed: int) -> np.ndarray:
    """A raw threefry2x32 key [2] u32 from the seed's 64 bits (high word, low word).

    Built on the host: no device round trip, so admitting a request never waits for the
    step in flight. (``jax.random.PRNGKey`` would also keep only the low 32 bits.)"""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


# How the engine turns each of its pure functions into an executable:
#   compile_fn(name, fn, example_args, donate_argnums) -> callable
# ``name`` is "step", "prefill", "catch_up", "update_slots" or "score"; ``example_args`` are
# arrays or ShapeDtypeStructs of the call's shapes. The default jits, lowers and
# compiles; the comparison tool (``eagle_jax.compare``) passes one that runs the same
# function op by op, or wraps it before jitting.
CompileFn = Callable[[str, Callable, tuple, tuple[int, ...]], Callable]

# ``precompile`` runs compiles in threads; every ``CompileFn`` traces under this lock.
# JAX's tracing is not thread-safe (a module it imports on first use registers effect
# types in a set another thread may be iterating: "Set changed size during iteration"),
# and under the GIL it would take turns anyway. XLA's compile, the long part, overlaps.
TRACE_LOCK = threading.Lock()


def jit_compile(name: str, fn: Callable, example_args: tuple,
                donate_argnums: tuple[int, ...]) -> Callable:
    """The serving ``CompileFn``: one XLA executable, the donated buffers updated in place.

    The arguments given as host arrays (numpy arrays, or ShapeDtypeStructs in
    ``example_args``: prompt chunks, slot changes, page-table updates) travel packed in
    one buffer (``HostLayout``), one host-to-device copy per call instead of one per
    field; the returned callable takes them as ``fn`` does."""
    del name
    host = [i for i, arg in enumerate(example_args) if _is_host_input(arg)]
    if not host:
        with TRACE_LOCK:
            lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*example_args)
        return lowered.compile()
    device = [i for i in range(len(example_args)) if i not in host]
    layout = HostLayout([example_args[i] for i in host])

    def unpacked(*args):
        full = dict(zip(device, args[:-1]))
        full.update(zip(host, layout.unpack(args[-1])))
        return fn(*(full[i] for i in range(len(example_args))))

    with TRACE_LOCK:
        lowered = jax.jit(unpacked, donate_argnums=tuple(
            device.index(i) for i in donate_argnums)).lower(
                *(example_args[i] for i in device), layout.spec)
    compiled = lowered.compile()

    def call(*args):
        return compiled(*(args[i] for i in device), layout.pack([args[i] for i in host]))

    return call


def _is_host_input(arg) -> bool:
    """Whether an example argument is host inputs: a pytree of numpy arrays or
    ShapeDtypeStructs (device arguments are jax arrays)."""
    leaves = jax.tree.leaves(arg)
    return bool(leaves) and all(isinstance(x, (np.ndarray, jax.ShapeDtypeStruct))
                                for x in leaves)


DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.75
MAX_COMPILE_THREADS = 16


def _split(module):
    """module -> ((graphdef, treedef), parameter leaves); (None, None) for no module."""
    if module is None:
        return None, None
    graph, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return (graph, treedef), leaves


def _merge(definition, leaves):
    """Rebuilds a module from ``_split``'s output inside a trace."""
    if definition is None:
        return None
    graph, treedef = definition
    return nnx.merge(graph, jax.tree.unflatten(treedef, leaves))


class Engine:
    """Continuous-batching EAGLE engine. Not thread-safe: drive it from one thread."""

    def __init__(self, config: EngineConfig, *, tokenizer=None, target: Decoder | None = None,
                 draft=None, draft_probs_hook: Callable | None = None,
                 compile_fn: CompileFn = jit_compile, devices: list | None = None):
        """``target`` / ``draft``: modules built by the caller (benchmarks with random
        weights) instead of loading ``config.model`` / ``config.draft_model``.
        ``devices``: the ``tensor_parallel_size`` devices this engine runs on, a
        data-parallel replica's group (``parallel.device_groups``; ``make_engine`` builds
        the replicas); None = the first local ones (one device: the default device).
        ``draft_probs_hook`` (tests only) rewrites the draft probabilities inside the
        step, as a corrupted buffer would (004). ``compile_fn`` turns the engine's pure
        functions into executables (see ``CompileFn``)."""
        if config.data_parallel_size != 1:
            raise ValueError(
                f"Engine is one replica; for data_parallel_size {config.data_parallel_size} "
                f"build the replicas with eagle_jax.engine.make_engine(config)")
        config, defaults = config.for_backend(jax.default_backend())
        for line in defaults:
            logger.info("engine: %s", line)
        self.config = config
        self._compile_fn = compile_fn
        self._step_listeners: list[Callable[[StepEvent], None]] = []
        _enable_compilation_cache(config.compilation_cache_dir)
        dtype = resolve_dtype(config.dtype)
        self.dtype = dtype
        self.mesh = self._make_mesh(target, devices)
        # A replica of one device (no mesh) is committed to it, so that its executables
        # run there; its models load there (not on the default device, whose memory
        # another replica's KV pool may already hold). None: the default device, as is.
        self.device = devices[0] if devices is not None and self.mesh is None else None
        self.devices = (list(self.mesh.devices.flat) if self.mesh is not None else
                        [self.device or jax.devices()[0]])
        with jax.default_device(self.device):
            self.target: Decoder = target if target is not None else load_decoder(
                config.model, dtype, mesh=self.mesh)
            self.draft = draft
            if config.speculative and draft is None:
                from eagle_jax.models.draft_checkpoint import load_draft

                self.draft = load_draft(config.draft_model, self.target, dtype)
        self.model_config: ModelConfig = self.target.config
        if self.mesh is not None and self.draft is not None:
            parallel.place(self.draft, NamedSharding(self.mesh, P()))
        if self.device is not None:
            for module in (self.target, self.draft):
                if module is not None:
                    parallel.place(module, SingleDeviceSharding(self.device))
        if self.draft is not None:
            if self.draft.kind != config.speculative_algorithm:
                raise ValueError(
                    f"{config.draft_model} is an {self.draft.kind} draft but "
                    f"speculative_algorithm is {config.speculative_algorithm}")
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.vocab_size = (self.tokenizer.vocab_size if self.tokenizer is not None
                           else self.model_config.vocab_size)
        self.vocab_size = min(self.vocab_size, self.model_config.vocab_size)
        self.model_name = config.served_model_name or os.path.basename(
            os.path.normpath(config.model))
        self.num_steps = config.num_steps if config.speculative else 0
        self.tree_topk = config.speculative_eagle_topk if config.speculative else 1
        # Positions one step verifies per request: the chain's window (S + 1), a tree's
        # root and nodes, or 1. A prompt chunk riding in a step comes in rows this wide.
        self.verify_width = config.num_draft_tokens if self.num_steps else 1
        # Positions one step may write per request above its length: a tree's draft also
        # writes its scratch rows there.
        self.step_tokens = self.verify_width if self.tree_topk == 1 else max(
            self.verify_width,
            scratch_positions(self.tree_topk, self.num_steps, self.verify_width - 1))
        self.page_size = config.page_size
        self.num_slots = config.max_num_seqs
        self._size_pool()
        # The largest bucket is the slot count, so every occupancy has a bucket.
        self.batch_buckets = tuple(sorted(
            {b for b in config.batch_buckets if b < self.num_slots} | {self.num_slots}))
        self.prefill_buckets = tuple(
            b for b in config.prefill_buckets if b <= self.max_model_len) or (self.max_model_len,)
        self.chunk_len = self.prefill_buckets[-1]  # longer prompts are prefilled in chunks
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.num_steps,
                                     drafted_per_pos=[0] * self.num_steps,
                                     draft_length_steps=[0] * (self.num_steps + 1))
        # The draft lengths a step may run, and the policy choosing among them (its step
        # times are measured once the executables exist: ``_time_draft_lengths``).
        adaptive = config.speculative and config.speculative_policy == "adaptive"
        self.draft_lengths = config.draft_lengths if adaptive else (self.num_steps,)
        self.draft_policy = FixedDraftLength(self.num_steps)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which served from it
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_ids |= set(getattr(self.tokenizer, "eos_token_ids", ()))
        self._rng = np.random.default_rng(config.seed)
        if draft_probs_hook is not None and self.tree_topk > 1:
            raise ValueError("draft_probs_hook rewrites a chain's draft probabilities; it has "
                             "no effect on a tree (speculative_eagle_topk > 1): drop one")
        self._draft_probs_hook = draft_probs_hook
        self._waiting: collections.deque[_Request] = collections.deque()
        self._requests: dict[str, _Request] = {}
        self._slots: list[_Request | None] = [None] * self.num_slots
        # slot -> (sampling row, key) of its new request, or None (released): the slot
        # changes the next executable's dispatch applies first (``_apply_slot_updates``).
        self._slot_updates: dict[int, tuple[SamplingRows, np.ndarray] | None] = {}
        self._aborted: set[str] = set()
        self._num_admitted = 0
        # (StepOutput on device, slot -> (request, its preemption count) at dispatch)
        self._in_flight = None
        self._last_collect = None  # perf_counter() when the last step was collected
        self._num_prefill_runs = 0  # prompt chunks prefilled by executables of their own
        self._split_models()
        self.state = self._init_state()
        self._compiled: dict = {}
        logger.info(
            "engine: %s, %s draft, %d slots, max_model_len %d, KV pool %d pages x %d tokens "
            "(%.2f GiB, %d tokens), batch buckets %s, prefill buckets %s", self.model_name,
            config.speculative_algorithm, self.num_slots, self.max_model_len,
            self.num_pages, self.page_size, self.kv_bytes / 2**30,
            self.num_pages * self.page_size, self.batch_buckets, self.prefill_buckets)
        if config.precompile:
            self.precompile()
        if config.precompile_logprobs:
            self.precompile(with_logprobs=True)
        if len(self.draft_lengths) > 1:
            self._time_draft_lengths()

    # ------------------------------------------------------------------ set-up
    def _load_tokenizer(self):
        if not os.path.exists(os.path.join(self.config.model, "tokenizer.json")):
            return None
        from eagle_jax.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.config.model)

    def _make_mesh(self, target: Decoder | None, devices: list | None):
        """The tensor-parallel mesh (``parallel.make_mesh``) of ``tensor_parallel_size``
        devices; None at 1. A caller's ``target`` brings its own mesh, which must match.

        With a mesh, the target is split over it (``parallel``), its KV pool by kv head;
        the draft (its parameters, its pool) and every other state array are replicated
        on it, so each executable sees one device set and XLA's SPMD partitioner splits
        the one jitted step. The draft stays replicated for now, the simple correct
        choice (it is small: one layer); whether sharding it is faster is for a
        measurement on GPUs. Likewise the sampler, the draft's LM head and the
        norm / concat of the EAGLE-3 features run on gathered (replicated) values:
        correct, and a per-shard vocabulary reduction is left for measurement.
        """
        n = self.config.tensor_parallel_size
        if devices is not None and len(devices) != n:
            raise ValueError(f"tensor_parallel_size {n} needs {n} devices, {len(devices)} "
                             f"given: pass one group of parallel.device_groups(M, {n})")
        if target is not None:
            if parallel.tensor_parallel_size(target.mesh) != n:
                raise ValueError(
                    f"the target given was built for tensor-parallel size "
                    f"{parallel.tensor_parallel_size(target.mesh)}, the config asks for {n}: "
                    f"build it with Decoder(mesh=parallel.make_mesh({n})) or set "
                    f"tensor_parallel_size to match")
            return target.mesh
        if n == 1:
            return None
        return parallel.make_mesh(n, ModelConfig.from_dir(self.config.model), devices)

    def _model_limit(self) -> int:
        """The context limit: the target's max_position_embeddings. A draft trained on
        shorter sequences does not cap it: it runs past its training length with its
        RoPE, as SGLang's EAGLE workers do (warned)."""
        limit = self.model_config.max_position_embeddings
        if self.draft is not None and self.draft.max_positions < limit:
            logger.warning(
                "the draft's max_position_embeddings (%d) is below the target's (%d): past "
                "%d positions it drafts beyond its training length (acceptance may fall)",
                self.draft.max_positions, limit, self.draft.max_positions)
        return limit

    def _pool_shapes(self) -> list[tuple[int, int, int]]:
        """(layers, kv heads, head dim) of each model's KV pool on one device: the target's,
        then the draft's. Tensor-parallel over N devices, a device stores the target's
        pool kv heads (``num_kv_heads * kv_replicas``) / N of them, so a per-device budget
        holds up to N times the tokens; the draft's pool is replicated, whole on every
        device."""
        cfg = self.model_config
        shapes = [(cfg.num_layers,
                   self.target.pool_kv_heads // parallel.tensor_parallel_size(self.mesh),
                   cfg.head_dim)]
        if self.draft is not None:
            c = self.draft.config
            shapes.append((c.num_layers, c.num_kv_heads, c.head_dim))
        return shapes

    def _bytes_per_token(self) -> int:
        """Pool bytes of one position on each device: the target's KV layers plus the
        draft's, and with prefix caching a position's share of the target feature kept
        per page for a hit's draft (``DecodeState.boundary_features``)."""
        kv = sum(KVPages.bytes_per_token(layers, heads, dim, self.dtype)
                 for layers, heads, dim in self._pool_shapes())
        if self.draft is not None and self.config.enable_prefix_caching:
            kv += -(-self._feature_width() * jnp.dtype(self.dtype).itemsize // self.page_size)
        return kv

    def _kv_budget(self) -> int | None:
        """Bytes for the KV pool: ``kv_cache_memory``, else ``kv_cache_memory_fraction``
        (default 0.75 on a device that reports its memory) of the free device memory;
        None on a device that does not (a CPU)."""
        cfg = self.config
        if cfg.kv_cache_memory is not None:
            return cfg.kv_cache_memory
        free = self._free_device_memory()
        if free is None:
            if cfg.kv_cache_memory_fraction is not None:
                raise ValueError("kv_cache_memory_fraction needs a device that reports its "
                                 "memory; pass kv_cache_memory (bytes) instead")
            return None
        fraction = cfg.kv_cache_memory_fraction or DEFAULT_KV_CACHE_MEMORY_FRACTION
        return int(free * fraction)

    def _free_device_memory(self) -> int | None:
        """Bytes JAX may still allocate on each device, the weights already placed; None on
        a device that does not report its memory (a CPU). This process's first device
        (another process's cannot be asked); processes then agree on the smallest, since
        the pool is one array over all."""
        local = next(d for d in self.devices if d.process_index == jax.process_index())
        stats = local.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        return parallel.min_over_processes(stats["bytes_limit"] - stats.get("bytes_in_use", 0))

    def _check_pool_fits(self) -> None:
        """An explicit ``kv_cache_memory`` larger than the device's free memory is an error
        now, naming the most that fits, rather than minutes later in the allocator's
        retries."""
        if self.config.kv_cache_memory is None:
            return  # a fraction of the free memory: fits by construction
        free = self._free_device_memory()
        if free is not None and self.kv_bytes > free:
            gib = 1 << 30
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory} ({self.kv_bytes / gib:.2f} GiB "
                f"of KV pool per device) exceeds the {free / gib:.2f} GiB of device memory "
                f"free beside the weights; pass at most ~{int(0.9 * free) >> 20} MiB, leaving "
                "room for activations (or leave it unset: kv_cache_memory_fraction, default "
                f"{DEFAULT_KV_CACHE_MEMORY_FRACTION}, of the free memory)")

    def _size_pool(self) -> None:
        """Sets max_model_len, the pool's page count and the page table's width."""
        limit = self._model_limit()
        addressable = min(max_pool_pages(self.page_size, heads, dim)
                          for _, heads, dim in self._pool_shapes())
        plan = plan_pool(model_limit=limit, max_model_len=self.config.max_model_len,
                         num_slots=self.num_slots, page_size=self.page_size,
                         step_tokens=self.step_tokens, bytes_per_token=self._bytes_per_token(),
                         budget=self._kv_budget(), unbudgeted_max_model_len=CPU_MAX_MODEL_LEN,
                         max_num_pages=addressable)
        if plan.num_pages == addressable:
            logger.info("engine: KV pool of %d pages (%d tokens), the most the attention "
                        "kernel's 32-bit offsets address at this page size and head shape",
                        plan.num_pages, plan.num_pages * self.page_size)
        if self.config.max_model_len is None and plan.max_model_len < limit:
            logger.info("engine: max_model_len=%d (the target's limit %d capped by the KV pool "
                        "of %d tokens; set it to change)", plan.max_model_len, limit,
                        plan.num_pages * self.page_size)
        self.max_model_len, self.num_pages, self.max_pages = plan
        self.kv_bytes = self.num_pages * self.page_size * self._bytes_per_token()
        self._check_pool_fits()
        self.page_allocator = PageAllocator(self.num_pages, self.page_size, self.max_pages,
                                    prefix_caching=self.config.enable_prefix_caching)
        # Page-table entries a step may add: each running request grows by at most one
        # step's tokens, which straddle at most cdiv(step_tokens, page_size) + 1 pages.
        self._max_page_updates = self.num_slots * (
            pages_for(self.step_tokens, self.page_size) + 1)

    def _split_models(self):
        # Parameters travel to the executables as flat lists: flattening a list per call
        # costs far less host time than flattening an NNX state tree.
        self._target_graph, self._target_params = _split(self.target)
        self._draft_graph, self._draft_params = _split(self.draft)

    def _init_state(self) -> step_lib.DecodeState:
        with jax.default_device(self.device):
            state = self._zero_state()
        if self.device is not None:
            state = jax.device_put(state, self.device)
        return state

    def _zero_state(self) -> step_lib.DecodeState:
        n = self.num_slots
        target_pages = self.target.init_pages(self.num_pages, self.page_size, self.dtype)
        draft_pages = draft_hidden = draft_logits = None
        if self.draft is not None:
            draft_pages = self.draft.init_pages(self.num_pages, self.page_size, self.dtype)
            hidden = self.draft.project(jnp.zeros((1, self._feature_width()), self.dtype))
            draft_hidden = jnp.zeros((n, hidden.shape[-1]), self.dtype)
            draft_logits = jnp.zeros((n, self.draft.draft_vocab_size), jnp.float32)
        lag = {}
        if self.draft is not None and 0 in self.draft_lengths:
            lag = dict(draft_lag=jnp.zeros((n,), jnp.int32),
                       lag_tokens=jnp.zeros((n, step_lib.MAX_DRAFT_LAG), jnp.int32),
                       lag_features=jnp.zeros((n, step_lib.MAX_DRAFT_LAG,
                                               self._feature_width()), self.dtype))
        if self.draft is not None and self.config.enable_prefix_caching:
            lag.update(draft_page_table=jnp.zeros((n, self.max_pages), jnp.int32),
                       boundary_features=jnp.zeros((self.num_pages, self._feature_width()),
                                                   self.dtype))
        state = step_lib.DecodeState(
            target_pages=None, draft_pages=draft_pages,
            page_table=jnp.zeros((n, self.max_pages), jnp.int32),
            seq_len=jnp.zeros((n,), jnp.int32), last_token=jnp.zeros((n,), jnp.int32),
            draft_hidden=draft_hidden, draft_logits=draft_logits,
            sampling=SamplingRows(*map(jnp.asarray, SamplingRows.padded(n))),
            key=jnp.zeros((n, 2), jnp.uint32), active=jnp.zeros((n,), bool),
            synthetic_acceptance=(None if self.config.synthetic_acceptance is None
                                  else jnp.float32(self.config.synthetic_acceptance)),
            **lag)
        if self.mesh is not None:  # target_pages, sharded by kv head, are already placed
            state = parallel.replicate_tree(state, self.mesh)
        return state._replace(target_pages=target_pages)

    def set_synthetic_acceptance(self, rate: float) -> None:
        """Benchmarks: the acceptance of an engine built with ``synthetic_acceptance``,
        changed between requests without compiling again."""
        if self.state.synthetic_acceptance is None:
            raise ValueError("this engine was built without synthetic_acceptance")
        if not 0 <= rate <= 1:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {rate}")
        # Placed as the state is (a replica's device, a mesh), not on the default device.
        self.state = self.state._replace(synthetic_acceptance=parallel.put(
            np.float32(rate), self.state.synthetic_acceptance.sharding))

    def _feature_width(self) -> int:
        layers = self.draft.feature_layers
        return self.model_config.hidden_size * (len(layers) if layers else 1)

    # ------------------------------------------------------------ compilation
    @property
    def num_compiled(self) -> int:
        """Executables compiled so far: a benchmark that compiles lazily checks that its
        timed requests compiled none."""
        return len(self._compiled)

    def _executable(self, key: tuple, build: Callable[[], tuple]) -> Callable:
        """The executable cached under ``key``; on first use ``build()`` gives (function,
        example arguments, donated argument indices) and ``compile_fn`` compiles it.
        Nothing is built on a hit: this runs on every dispatch."""
        executable = self._compiled.get(key)
        if executable is None:
            fn, example_args, donate_argnums = build()
            executable = self._compiled[key] = self._compile_fn(key[0], fn, example_args,
                                                                donate_argnums)
        return executable

    def _step_fn(self, batch: int, with_logprobs: bool, num_lanes: int = 0,
                 draft_length: int | None = None):
        """The step executable of a batch bucket drafting ``draft_length`` tokens (default
        num_steps), carrying prompt chunks in ``num_lanes`` lanes or none, compiled on
        first use."""
        length = self.num_steps if draft_length is None else draft_length

        def build():
            args = self.step_inputs()
            if num_lanes:
                args += (self._chunks_spec(num_lanes, self._step_lane_len(batch)),)
            return self.step_function(batch, with_logprobs, num_lanes, length), args, (2,)

        return self._executable(("step", batch, with_logprobs, num_lanes, length), build)

    def step_inputs(self) -> tuple:
        """Arguments of ``step_function``'s function: (target parameters, draft
        parameters, state, page updates), the updates empty (e.g. for ``jax.export``)."""
        return self._target_params, self._draft_params, self.state, self._page_updates([])

    def step_function(self, batch: int, with_logprobs: bool = False,
                      num_lanes: int = 0, draft_length: int | None = None) -> Callable:
        """The pure step of a batch bucket:
        ``(target_params, draft_params, state, page_updates) -> (state, StepOutput)``,
        drafting ``draft_length`` tokens (default num_steps); with ``num_lanes``, a fifth
        argument, ``PrefillChunks`` of that many lanes (``_step_lane_len`` positions
        each), rides in the step's forward. The engine compiles it with ``state``
        donated."""
        length = self.num_steps if draft_length is None else draft_length
        if num_lanes and length != self.num_steps:
            raise ValueError("a step that carries prompt chunks drafts num_steps tokens")
        tg, dg, cfg = self._target_graph, self._draft_graph, self.config

        def run(target_params, draft_params, state, page_updates, chunks=None):
            target = _merge(tg, target_params)
            if dg is None:
                return step_lib.plain_step(target, state, page_updates, batch=batch,
                                           vocab_size=self.vocab_size,
                                           with_logprobs=with_logprobs, chunks=chunks)
            if self.tree_topk > 1:
                return step_lib.tree_spec_step(
                    target, _merge(dg, draft_params), state, page_updates, batch=batch,
                    num_steps=length, topk=self.tree_topk, num_nodes=self.verify_width - 1,
                    tree_verify=cfg.tree_verify, vocab_size=self.vocab_size,
                    with_logprobs=with_logprobs, chunks=chunks)
            return step_lib.spec_step(
                target, _merge(dg, draft_params), state, page_updates, batch=batch,
                num_steps=length,
                probabilistic=cfg.draft_sample_method == "probabilistic",
                vocab_size=self.vocab_size, with_logprobs=with_logprobs,
                draft_probs_hook=self._draft_probs_hook, chunks=chunks)

        return run

    def _catch_up_fn(self, batch: int):
        """The catch-up executable of a batch bucket, compiled on first use."""
        return self._executable(("catch_up", batch), lambda: (
            self.catch_up_function(batch), (self._draft_params, self.state), (1,)))

    def catch_up_function(self, batch: int) -> Callable:
        """The pure catch-up of a batch bucket's draft over the positions steps of draft
        length 0 skipped (``step.catch_up_draft``): ``(draft_params, state) -> state``,
        compiled with ``state`` donated."""
        dg = self._draft_graph

        def run(draft_params, state):
            return step_lib.catch_up_draft(_merge(dg, draft_params), state, batch=batch)

        return run

    def _chunks_spec(self, num: int, size: int) -> step_lib.PrefillChunks:
        def spec(shape=(), dtype=jnp.int32):
            return jax.ShapeDtypeStruct((num,) + shape, dtype)

        return step_lib.PrefillChunks(
            slot=spec(), page_row=spec((self.max_pages,)), tokens=spec((size,)),
            start=spec(), length=spec(), next_token=spec(), is_last=spec((), jnp.bool_),
            sample_next=spec((), jnp.bool_), draft_col=spec(), draft_page=spec())

    def _prefill_fn(self, num: int, size: int, with_logprobs: bool = False):
        """The executable that prefills the chunks of ``num`` requests, ``size``
        positions each, alone; the first tokens' logprobs only ``with_logprobs``."""
        return self._executable(("prefill", num, size, with_logprobs), lambda: (
            self.prefill_function(with_logprobs), self.prefill_inputs(num, size), (2,)))

    def prefill_inputs(self, num: int, size: int) -> tuple:
        """Arguments of ``prefill_function``'s function for ``num`` chunks of ``size``
        positions (the chunks and slot changes as ShapeDtypeStructs)."""
        return (self._target_params, self._draft_params, self.state,
                self._chunks_spec(num, size), self._slot_updates_spec())

    def prefill_function(self, with_logprobs: bool = False) -> Callable:
        """The pure prefill: ``(target_params, draft_params, state, chunks, slot changes)
        -> (state, PrefillOutput)`` (``step_lib.prefill_chunks``), its first tokens in
        the host's pinned memory. The engine compiles it with ``state`` donated."""
        tg, dg = self._target_graph, self._draft_graph

        def run(target_params, draft_params, state, chunks, slots):
            state, out = step_lib.prefill_chunks(_merge(tg, target_params),
                                                 _merge(dg, draft_params), state, chunks,
                                                 slots, vocab_size=self.vocab_size,
                                                 with_logprobs=with_logprobs)
            # The executable writes the first tokens to the host as soon as they are
            # sampled. Copied out after it instead, a first token reached the host 0.3 ms
            # later on an H200: the copy waits for the whole executable, and the host
            # learns of it twice (docs/BENCHMARKS.md, 2026-12-04).
            return state, out._replace(token=jax.device_put(out.token, jax.memory.Space.Host))

        return run

    # ---------------------------------------------------------- chunk shapes
    # A forward's chunks are compiled shapes, so they come from a small set, and the
    # host picks the one that runs the most prompt positions now. A prefill alone runs
    # L requests' chunks padded to C positions each (``_prefill_shapes``, L a power of
    # two up to max_num_partial_prefills). A decode step carries its chunks in lanes of
    # STEP_LANE positions, a power-of-two count of them within its token budget
    # (``_step_lane_counts``): a request's chunk takes as many lanes as it needs (each
    # lane one query block, attending to the lanes before it, whose keys the forward
    # wrote first), so short chunks pad to at most one lane, not to the budget.
    def _chunk_counts(self) -> tuple[int, ...]:
        return _powers_of_two(self.config.max_num_partial_prefills)

    def _step_lane_len(self, batch: int) -> int:
        """Positions of a lane of a decode step of bucket ``batch``: STEP_LANE in whole
        rows of verify_width, within the step's token budget less its own rows (at least
        one row)."""
        width = self.verify_width
        room = self.config.max_num_batched_tokens - batch * width
        return max(width, min(-(-STEP_LANE // width) * width, room // width * width))

    def _step_lane_counts(self, batch: int) -> tuple[int, ...]:
        """Lane counts a step of bucket ``batch`` is compiled for: up to the lanes its
        budget holds, or that max_num_partial_prefills chunks of chunk_len can fill if
        fewer (no executable whose lanes could never all be used)."""
        lane = self._step_lane_len(batch)
        room = self.config.max_num_batched_tokens - batch * self.verify_width
        usable = self.config.max_num_partial_prefills * -(-self.chunk_len // lane)
        return _powers_of_two(max(1, min(room // lane, usable)))

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """The (chunks, positions) shapes of the prefill executables: one chunk of every
        prefill bucket, and for more chunks the longest bucket that keeps them within
        max_num_batched_tokens (no shape for a count none keeps within it)."""
        budget, buckets = self.config.max_num_batched_tokens, self.prefill_buckets
        shapes = [(1, c) for c in buckets]
        for n in self._chunk_counts()[1:]:
            fitting = [c for c in buckets if n * c <= budget]
            if fitting:
                shapes.append((n, fitting[-1]))
        return shapes

    @staticmethod
    def _chunk_shape(shapes: list[tuple[int, int]], remaining: list[int], split: bool = False
                     ) -> tuple[int, int]:
        """The (chunks, positions) shape among ``shapes`` that prefills the most of
        ``remaining`` (each request's positions to prefill now, in the order they are
        served), the fewest computed positions among equals. ``split``: a request's
        positions may span several chunks (a step's lanes)."""
        def score(shape):
            num, size = shape
            run = 0
            for r in remaining:
                if num <= 0:
                    break
                lanes = min(-(-r // size), num) if split else 1
                run += min(r, lanes * size)
                num -= lanes
            return run, -shape[0] * size

        return max(shapes, key=score)

    def _assign_slot(self, slot: int, sampling: SamplingRows, key: np.ndarray) -> None:
        """Gives ``slot`` a new request's sampling row ([1] each) and PRNG key, applied
        by the next ``_apply_slot_updates``."""
        self._slot_updates[slot] = (sampling, key)

    def _release_slot(self, slot: int) -> None:
        """Marks ``slot`` free (its request left), applied by the next
        ``_apply_slot_updates``."""
        self._slot_updates[slot] = None

    def _slot_updates_spec(self) -> step_lib.SlotUpdates:
        n = self.num_slots
        flag = jax.ShapeDtypeStruct((n,), jnp.bool_)
        return step_lib.SlotUpdates(
            assign=flag, release=flag,
            sampling=SamplingRows(*(jax.ShapeDtypeStruct((n,), x.dtype)
                                    for x in SamplingRows.padded(1))),
            key=jax.ShapeDtypeStruct((n, 2), jnp.uint32))

    def _update_slots_fn(self):
        return self._executable(("update_slots",), lambda: (step_lib.update_slots, (
            step_lib.slot_fields(self.state), self._slot_updates_spec()), (0,)))

    def _take_slot_updates(self) -> step_lib.SlotUpdates:
        """The slot changes since the last executable (the latest change of each slot) as
        host arrays, cleared here: the next executable applies them."""
        n = self.num_slots
        updates = step_lib.SlotUpdates(
            assign=np.zeros((n,), bool), release=np.zeros((n,), bool),
            sampling=SamplingRows.padded(n), key=np.zeros((n, 2), np.uint32))
        for slot, change in self._slot_updates.items():
            if change is None:
                updates.release[slot] = True
                continue
            sampling, key = change
            updates.assign[slot] = True
            updates.key[slot] = key
            for rows, row in zip(updates.sampling, sampling):
                rows[slot] = row[0]
        self._slot_updates.clear()
        return updates

    def _apply_slot_updates(self) -> None:
        """Dispatches ``step.update_slots`` for the slot changes since the last executable,
        if any: one dispatch before a step, however many requests came and went (a
        prefill chunk applies them itself). Each dispatch is host time whatever its work
        (a dispatch per admission and per release cost ~0.5 and ~0.2 ms a request on the
        H200 machine: docs/BENCHMARKS.md)."""
        if self._slot_updates:
            fields = self._update_slots_fn()(step_lib.slot_fields(self.state),
                                             self._take_slot_updates())
            self.state = self.state._replace(**{f: getattr(fields, f)
                                                for f in step_lib.SLOT_FIELDS})

    def precompile(self, with_logprobs: bool = False) -> None:
        """Compiles every prefill and step bucket ahead of serving (their variants that
        compute logprobs ``with_logprobs``), several at once: XLA's compiler runs
        outside the GIL, so threads overlap the compiles (of an 8B-shaped step, ~15 s
        each on one core) while tracing takes turns (``TRACE_LOCK``)."""
        jobs = [lambda n=n, c=c: self._prefill_fn(n, c, with_logprobs)
                for n, c in self._prefill_shapes()] + [
            lambda b=b, s=s: self._step_fn(b, with_logprobs, draft_length=s)
            for b in self.batch_buckets for s in self.draft_lengths] + [
            lambda b=b, n=n: self._step_fn(b, with_logprobs, n)
            for b in self.batch_buckets for n in self._step_lane_counts(b)] + [
            self._update_slots_fn]
        if self.state.draft_lag is not None:
            jobs += [lambda b=b: self._catch_up_fn(b) for b in self.batch_buckets]
        workers = max(1, min(len(jobs), os.cpu_count() or 1, MAX_COMPILE_THREADS))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = concurrent.futures.as_completed([pool.submit(job) for job in jobs])
            desc = "compiling buckets" + (" (logprobs)" if with_logprobs else "")
            for future in tqdm(done, total=len(jobs), desc=desc, leave=False):
                future.result()

    def _time_draft_lengths(self, repeats: int = 8, context: int = 256) -> None:
        """Times the step of every batch bucket and draft length and hands the table to
        the adaptive policy."""
        seconds = self.time_steps(repeats, context)
        self.draft_policy = AdaptiveDraftLength(self.draft_lengths, seconds)
        logger.info("engine: adaptive draft length over %s; step ms by bucket: %s",
                    self.draft_lengths, "; ".join(
                        f"{b}: " + ", ".join(f"{seconds[b, s] * 1e3:.2f}"
                                             for s in self.draft_lengths)
                        for b in self.batch_buckets))

    def time_steps(self, repeats: int = 8, context: int = 256, greedy: bool = False
                   ) -> dict[tuple[int, int], float]:
        """Seconds per step of every batch bucket and draft length: {(bucket, length): s},
        with every live row sampling at temperature 1 (the padded rows' parameters), or
        greedy (``greedy``).

        Runs before any request holds a slot, on rows made live for the purpose: every
        row of the bucket active at ``context`` tokens (at most half of max_model_len),
        each on pages of its own where the pool holds them, so that the kernels do a live
        row's work (an inactive row skips it) and no two rows write the same pool row (a
        scatter with repeated indices serialises on a GPU: shared pages made the timed
        steps of large buckets up to twice as slow as served ones). The pool holds nothing yet, and the rows' state
        is put back afterwards. Steps are dispatched back to back, as while serving, and
        the device time per step is taken (the context grows by at most a step's tokens
        per call); the policy then follows the measured cycles while serving (their
        context and the host's work between steps). Length 0's time includes its share
        of the draft's catch-up, which runs at least once every MAX_DRAFT_LAG such
        steps."""
        if any(r is not None for r in self._slots) or self._in_flight is not None:
            raise RuntimeError("draft lengths are timed while no request holds a slot")
        context = max(1, min(context, self.max_model_len // 2))
        num_pages = min(pages_for(context + (repeats + 2) * self.step_tokens, self.page_size),
                        self.max_pages, self.num_pages)
        table = np.zeros((self.num_slots, self.max_pages), np.int32)
        table[:, :num_pages] = (np.arange(self.num_slots)[:, None] * num_pages
                                + np.arange(num_pages)) % self.num_pages
        idle = jax.tree.map(jnp.copy, self.state._replace(
            target_pages=None, draft_pages=None))  # the step donates what it is given
        seconds = {}
        rows = SamplingRows.padded(self.num_slots)  # numpy: each step gets (donates) a copy
        if greedy:
            rows = rows._replace(top_k=np.ones_like(rows.top_k))
        jobs = [(b, s) for b in self.batch_buckets for s in self.draft_lengths]
        for bucket, length in tqdm(jobs, desc="timing draft lengths", leave=False):
            live = np.arange(self.num_slots) < bucket
            fn = self._step_fn(bucket, False, draft_length=length)
            args = self.step_inputs()[:2]
            updates = self._page_updates([])
            for calls in (1, repeats):  # the first call warms the executable up
                self.state = self.state._replace(
                    active=jnp.asarray(live), seq_len=jnp.where(live, context, 0),
                    page_table=jnp.asarray(np.where(live[:, None], table, 0)),
                    draft_page_table=(None if self.state.draft_page_table is None else
                                      jnp.asarray(np.where(live[:, None], table, 0))),
                    sampling=SamplingRows(*(jnp.asarray(x) for x in rows)))
                jax.block_until_ready(self.state.page_table)
                t0 = time.perf_counter()
                for _ in range(calls):
                    self.state, out = fn(*args, self.state, updates)
                jax.block_until_ready(out)
            seconds[bucket, length] = (time.perf_counter() - t0) / repeats
            if length == 0 and self.state.draft_lag is not None:
                # Its share of a whole lag's catch-up of every live row.
                seconds[bucket, length] += self._time_catch_up(bucket, live, repeats) / (
                    step_lib.MAX_DRAFT_LAG)
        pages = self.state.target_pages, self.state.draft_pages
        self.state = idle._replace(target_pages=pages[0], draft_pages=pages[1])
        return seconds

    def _time_catch_up(self, bucket: int, live: np.ndarray, repeats: int) -> float:
        """Seconds of the bucket's draft catch-up with every ``live`` row MAX_DRAFT_LAG
        positions behind (``time_steps``' rows, after its steps)."""
        catch_up = self._catch_up_fn(bucket)
        lag = parallel.put(np.where(live, step_lib.MAX_DRAFT_LAG, 0).astype(np.int32),
                        self.state.draft_lag.sharding)
        for calls in (1, repeats):  # the first call warms the executable up
            jax.block_until_ready(self.state.draft_lag)
            t0 = time.perf_counter()
            for _ in range(calls):  # (the catch-up donates the lag it is given)
                self.state = catch_up(self._draft_params,
                                      self.state._replace(draft_lag=jnp.copy(lag)))
            jax.block_until_ready(self.state.draft_hidden)
        return (time.perf_counter() - t0) / repeats

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queues a request. Raises ValueError naming the problem for bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        # Checked by type and with numpy, not token by token in Python: a long prompt's
        # checks are on its time to first token.
        kinds = set(map(type, prompt))
        if bool in kinds or not all(issubclass(k, (int, np.integer)) for k in kinds):
            raise ValueError("prompt token ids must be integers")
        try:
            ids = np.asarray(prompt, np.int64)
        except OverflowError:
            ids = None
        if ids is None or ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        prompt = ids.tolist()
        if len(prompt) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; with at least one generated token it "
                f"exceeds max_model_len {self.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        req = _Request(request_id, prompt, params, time.monotonic(),
                       stop_ids=frozenset(params.stop_token_ids) | (
                           frozenset() if params.ignore_eos else frozenset(self.eos_ids)))
        if self.tokenizer is not None:
            from eagle_jax.tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt)
        self._requests[request_id] = req
        self._waiting.append(req)

    def abort_request(self, request_id: str) -> None:
        if request_id in self._requests:
            self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.num_running(), num_waiting=self.num_waiting(),
                              kv_cache_usage=self.page_allocator.usage,
                              num_preemptions=self.num_preemptions,
                              prefix_cache_queries=self.prefix_cache_queries,
                              prefix_cache_hits=self.prefix_cache_hits)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, runs prefill chunks within the step's token budget and
        one decode step (none in a call whose prefills, run alone, sampled first tokens:
        those are returned at once), returns what each request produced.

        With ``async_scheduling`` the step is dispatched before the previous step's
        tokens are read, so the host's bookkeeping overlaps the device's work; a request
        that the previous step finished is then computed once more and discarded.
        """
        outputs: list[RequestOutput] = []
        self._process_aborts(outputs)
        prefills = self._num_prefill_runs
        carried = self._schedule_prefills(outputs)
        occupied = {i: r for i, r in enumerate(self._slots)
                    if r is not None and not r.in_prefill}
        if any(o.new_token_ids for o in outputs):
            # Prefills that ran alone (nothing was decoding) sampled first tokens: they
            # are returned now, and the next call dispatches their first decode step.
            # Dispatched first, its launch (~3 ms on the H200, docs/BENCHMARKS.md) would
            # lie on their time to first token, and no running request waits for it.
            occupied = {}
        launched = self._launch(occupied, carried) if occupied else None
        if self.config.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        collected = self._collect(*launched, outputs) if launched is not None else (None, {})
        self._time_step(launched, self._num_prefill_runs > prefills)
        if self._step_listeners:
            event = StepEvent(self.stats.num_steps, *collected, outputs)
            for listener in self._step_listeners:
                listener(event)
        return outputs

    def _time_step(self, launched, ran_prefill: bool) -> None:
        """Gives the draft policy the time since the last collected step: the cycle of
        the step just collected (its device time when the device is the bottleneck, the
        host's work between steps when not). Cycles that also ran a prompt chunk or the
        draft's catch-up, or follow one that collected nothing, are not a step's time."""
        now = time.perf_counter()
        if launched is not None and self._last_collect is not None and not ran_prefill:
            variant = launched[3]
            if not variant.ran_more:
                self.draft_policy.observe_time(variant.batch, variant.draft_length,
                                               now - self._last_collect)
        self._last_collect = now if launched is not None else None

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """Calls ``listener(StepEvent)`` at the end of every ``step()``: what the step
        collected from the device (host arrays) and the outputs it returns. For
        observers (evaluation records, the comparison tool); it must not drive the
        engine."""
        self._step_listeners.append(listener)

    def _process_aborts(self, outputs):
        for rid in list(self._aborted):
            req = self._requests.get(rid)
            self._aborted.discard(rid)
            if req is None:
                continue
            if req.slot < 0:
                self._waiting.remove(req)
            self._finish(req, "abort", None)
            outputs.append(self._output(req, [], []))

    def _known_tokens(self, req: _Request) -> list[int]:
        """Every token of the request whose position it knows: its prompt and output (the
        newest, ``last_token``, is not in the pool yet)."""
        return req.prompt + req.output

    @staticmethod
    def _prefill_len(req: _Request) -> int:
        """Positions a request's prefill computes: a new request's prompt; one resumed
        after a preemption, its prompt and every generated token but the last (which
        becomes last_token)."""
        return len(req.prompt) + max(len(req.output) - 1, 0)

    def _page_keys(self, req: _Request, tokens: list[int] | None = None) -> list[bytes]:
        """The prefix-cache keys of the request's full pages, extended as it grows (its
        tokens gathered only then, or given as ``tokens`` by a caller that has them:
        this runs for every prefilling request each step)."""
        if len(req.page_keys) < (len(req.prompt) + len(req.output)) // self.page_size:
            req.page_keys = page_hashes(self._known_tokens(req) if tokens is None else tokens,
                                        self.page_size, req.page_keys)
        return req.page_keys

    def _schedule_prefills(self, outputs) -> list[_Request]:
        """Spends this step's prefill budget (``max_num_batched_tokens`` less the running
        requests' decode rows; at least one smallest chunk) on the next chunks of the
        requests in prefill (``_prefill_candidates``). While requests decode, the chunks
        ride in the decode step (the requests are returned, for ``_launch``); else they
        run as prefills of their own, one forward for all of a round's chunks, round
        after round while budget is left (a request whose last chunk ran joins this
        step's decode)."""
        decoding = sum(r is not None and not r.in_prefill for r in self._slots)
        budget = max(self.config.max_num_batched_tokens - decoding * self.verify_width,
                     self.prefill_buckets[0])
        if decoding:
            return self._prefill_candidates(budget)
        while budget > 0 and (reqs := self._prefill_candidates(budget)):
            budget -= self._prefill(reqs, budget, outputs)
        return []

    def _prefill_candidates(self, budget: int) -> list[_Request]:
        """The requests whose next chunks the next forward carries, in the order they are
        served: those in prefill, oldest first, then waiting requests admitted one by one
        while their positions to prefill stay under ``budget``, at most
        max_num_partial_prefills in all. A request is matched against the prefix cache
        when it is admitted; one whose next page not in the cache is a page a candidate
        is about to compute, and would be a hit once computed, waits (admitted after that
        chunk ran, it shares the page rather than computing it again), so requests that
        arrive together share the pages of their common prefix. With a draft, a page
        whose next token differs is no hit (``PageAllocator``): requests whose prompts
        part inside the page after a cached prefix do not wait for each other."""
        most = self.config.max_num_partial_prefills
        reqs = sorted((r for r in self._slots if r is not None and r.in_prefill),
                      key=lambda r: r.admitted)[:most]
        wanted = sum(self._prefill_len(r) - r.seq_len for r in reqs)
        computing = {claim for r in reqs
                     for claim in self._page_claims(r, r.seq_len // self.page_size)}
        while len(reqs) < most and wanted < budget and (
                req := self._admit(computing)) is not None:
            reqs.append(req)
            wanted += self._prefill_len(req) - req.seq_len
            computing.update(self._page_claims(req, req.seq_len // self.page_size))
        return reqs

    def _page_claims(self, req: _Request, start: int, stop: int | None = None
                     ) -> list[tuple[bytes, int | None]]:
        """What another request must share for each full page [start, stop) of ``req`` to
        be its prefix-cache hit: the page's key and, with a draft (a page's last draft
        row depends on the token after it), that token (None where it is not known)."""
        keys = self._page_keys(req)[start:stop]
        if self.draft is None:
            return [(key, None) for key in keys]
        return [(key, self._known_token(req, (i + 1) * self.page_size))
                for i, key in enumerate(keys, start)]

    @staticmethod
    def _known_token(req: _Request, position: int) -> int | None:
        """The request's token at ``position`` (``_known_tokens(req)[position]`` without
        gathering them all: this runs for every prefilling request each step), or None
        where it is not known yet."""
        if position < len(req.prompt):
            return req.prompt[position]
        position -= len(req.prompt)
        return req.output[position] if position < len(req.output) else None

    def _admit(self, computing: set[tuple] = frozenset()) -> _Request | None:
        """Gives the oldest waiting request a slot and the pages of its known tokens (the
        cached pages of its prefix shared), if a slot is free, the pool has pages for
        it and its first step, and its first page not in the cache is not among
        ``computing`` (``_page_claims`` of pages about to be computed); else None (it
        waits)."""
        if not self._waiting or None not in self._slots:
            return None
        req = self._waiting[0]
        slot = self._slots.index(None)
        tokens = self._known_tokens(req)
        known = self._prefill_len(req)
        keys = self._page_keys(req)
        # The last known position is always computed: its logits (a new request's first
        # token) and its draft row (the draft's state) come from it.
        hit, boundary = self.page_allocator.match(
            keys, tokens, known - 1, check_next=self.draft is not None,
            share_boundary=self.state.boundary_features is not None)
        if len(hit) < (known - 1) // self.page_size and self._page_claims(
                req, len(hit), len(hit) + 1)[0] in computing:
            return None
        if not self.page_allocator.can_reserve(slot, known + self.step_tokens, hit, boundary):
            return None
        self._waiting.popleft()
        self.page_allocator.reserve(slot, known, shared=hit, boundary=boundary)
        self.page_allocator.take_updates(slot)  # the prefill writes the slot's whole row
        cached = len(hit) * self.page_size
        self.prefix_cache_queries += known
        self.prefix_cache_hits += cached
        if not req.output:
            req.num_cached_tokens = cached
        req.slot, req.seq_len, req.in_flight, req.in_prefill = slot, cached, 0, True
        req.admitted = self._num_admitted = self._num_admitted + 1
        self._slots[slot] = req
        if req.seed is None:
            req.seed = req.params.seed if req.params.seed is not None else int(
                self._rng.integers(0, 2**31 - 1))
        # A resumed request draws from a fresh stream, not the one it began with.
        key = _threefry_key(req.seed + (req.preemptions << 32))
        self._assign_slot(slot, SamplingRows.from_params(req.params), key)
        return req

    def _take_chunks(self, reqs: list[_Request], num: int, size: int, budget: int,
                     split: bool = False) -> step_lib.PrefillChunks:
        """The next chunk of each of ``reqs`` in turn, ``budget`` positions in all, as
        ``num`` chunks of ``size`` positions (padding chunks after them): a request's
        chunk is one of them, or with ``split`` up to chunk_len positions over as many
        consecutive ones as it needs (its last names the slot; the others write no slot
        state). Advances each request's prefilled length; a request's last chunk ends
        its prefill."""
        zeros = np.zeros((num,), np.int32)
        chunks = step_lib.PrefillChunks(
            slot=np.full((num,), self.num_slots, np.int32),
            page_row=np.zeros((num, self.max_pages), np.int32),
            tokens=np.zeros((num, size), np.int32), start=zeros, length=zeros.copy(),
            next_token=zeros.copy(), is_last=np.zeros((num,), bool),
            sample_next=np.zeros((num,), bool), draft_col=np.full((num,), -1, np.int32),
            draft_page=zeros.copy())
        i = 0
        for req in reqs:
            tokens = self._known_tokens(req)
            known = self._prefill_len(req)
            start = req.seq_len
            total = min(known - start, budget, (num - i) * size if split else size,
                        self.chunk_len if split else size)
            if total <= 0 or i >= num:
                break
            budget -= total
            page_row = self.page_allocator.page_row(req.slot)
            draft_copy = self.page_allocator.draft_copy(req.slot) or (-1, 0)
            if self.state.boundary_features is not None:
                self.page_allocator.features_written(req.slot, start, start + total)
            for first in range(start, start + total, size):
                length = min(size, start + total - first)
                end = first + length
                chunks.start[i], chunks.length[i] = first, length
                chunks.page_row[i] = page_row
                chunks.draft_col[i], chunks.draft_page[i] = draft_copy
                chunks.tokens[i, :length] = tokens[first:end]
                # The known token after the chunk (a new request's first token is sampled).
                chunks.next_token[i] = tokens[end] if end < len(tokens) else 0
                i += 1
            is_last = start + total == known
            chunks.slot[i - 1] = req.slot
            chunks.is_last[i - 1], chunks.sample_next[i - 1] = is_last, is_last and not req.output
            req.seq_len += total
            req.in_prefill = not is_last
            self._register_pages(req)
        return chunks

    def _prefill(self, reqs: list[_Request], budget: int, outputs) -> int:
        """Runs the next chunks of ``reqs`` in one prefill of their own, ``budget``
        positions at most; returns the positions it ran. A request whose last chunk ran
        decodes from the next step: a new one commits its first token, sampled by that
        chunk."""
        remaining = [min(self._prefill_len(r) - r.seq_len, budget) for r in reqs]
        num, size = self._chunk_shape(self._prefill_shapes(), remaining)
        chunks = self._take_chunks(reqs, num, size, budget)
        with_logprobs = any(r.params.logprobs is not None for r in reqs)
        self.state, out = self._prefill_fn(num, size, with_logprobs)(
            self._target_params, self._draft_params, self.state, chunks,
            self._take_slot_updates())
        out.token.copy_to_host_async()  # read next: asked for now, made once it is written
        self._num_prefill_runs += 1
        by_slot = {r.slot: r for r in reqs}
        self._commit_first_tokens([(i, by_slot[slot]) for i, slot in enumerate(
            chunks.slot.tolist()) if chunks.sample_next[i]], out, outputs)
        return int(chunks.length.sum())

    def _commit_first_tokens(self, firsts: list[tuple[int, _Request]],
                             out: step_lib.PrefillOutput, outputs):
        """Commits the first tokens that new requests' last prefill chunks sampled
        (chunk i's in ``out``'s row i; device values: only what the requests asked for
        is read back, each read a transfer on their time to first token)."""
        if not firsts:
            return
        if all(req.params.logprobs is None for _, req in firsts):
            out = out._replace(token=jax.device_get(out.token))
        else:
            out = jax.device_get(out)
        now = time.monotonic()
        for i, req in firsts:
            token, logprob = int(out.token[i]), None
            if req.params.logprobs is not None:
                k = req.params.logprobs
                logprob = [TokenLogprob(token, float(out.logprob[i]), {
                    int(t): float(v) for t, v in zip(out.top_ids[i, :k],
                                                     out.top_logprobs[i, :k])})]
            req.first_token_time = now
            self._commit(req, [token], logprob, outputs)
            if not req.finished:
                self._register_pages(req)  # the page the first token completes

    def _register_pages(self, req: _Request) -> None:
        """Offers the request's full, final pages to the prefix cache (host work only
        when it completed a page: a step's bookkeeping stays O(batch), not O(tokens))."""
        # Positions the draft lags behind are not final yet (their draft rows are not in
        # the pool): a request that finishes behind keeps those pages out of the cache.
        computed = req.seq_len - req.draft_lag
        full = min(computed, len(req.prompt) + len(req.output) - 1) // self.page_size
        if not self.config.enable_prefix_caching or full <= self.page_allocator.num_registered(
                req.slot):
            return
        tokens = self._known_tokens(req)
        self.page_allocator.register(req.slot, self._page_keys(req, tokens), tokens, computed)

    def _reserve_step_pages(self, occupied: dict[int, _Request]) -> None:
        """Gives every running request the pages the next step may write: positions up
        to its length plus one step's tokens for each step in flight and this one.
        When the pool runs out, preempts the newest running request and tries again."""
        for req in sorted(occupied.values(), key=lambda r: r.admitted):
            while req.slot >= 0:
                try:
                    self.page_allocator.reserve(
                        req.slot, req.seq_len + (req.in_flight + 1) * self.step_tokens)
                    break
                except OutOfPages:
                    newest = max((r for r in self._slots if r is not None),
                                 key=lambda r: r.admitted)
                    self._preempt(newest)
        for slot in [slot for slot, req in occupied.items() if req.slot != slot]:
            del occupied[slot]

    def _preempt(self, req: _Request) -> None:
        """Frees the request's pages and slot; it goes back to the front of the queue, to
        be recomputed from its prompt and generated tokens. Its steps in flight are
        dropped when collected."""
        logger.info("KV pool full: preempting request %s (%d tokens)", req.request_id,
                    req.seq_len)
        self._register_pages(req)  # its own pages may serve its recompute
        self.page_allocator.free(req.slot)
        self._slots[req.slot] = None
        self._release_slot(req.slot)
        req.slot, req.in_flight, req.in_prefill, req.draft_lag = -1, 0, False, 0
        req.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    def _page_updates(self, updates: list[tuple[int, int, int]]) -> np.ndarray:
        """[U, 3] (slot, index, page) rows for the step; padding rows name slot B_max."""
        if len(updates) > self._max_page_updates:
            raise RuntimeError(f"{len(updates)} page-table updates in one step, more than "
                               f"the {self._max_page_updates} a step carries")
        rows = np.zeros((self._max_page_updates, 3), np.int32)
        rows[:, 0] = self.num_slots
        if updates:
            rows[:len(updates)] = updates
        return rows

    def _launch(self, occupied: dict[int, _Request], carried: list[_Request] = ()):
        """Dispatches the step of the smallest bucket covering every occupied slot, with
        the next prompt chunks of ``carried`` (requests in prefill, in the order they
        are served) riding in it, as many as the step's chunk shape takes."""
        self._reserve_step_pages(occupied)
        if not occupied:
            return None
        self._apply_slot_updates()
        batch = next(b for b in self.batch_buckets if b > max(occupied))
        carried = [r for r in carried if r.in_prefill and r.slot >= 0]  # (not preempted)
        # (A carried chunk's first token takes its logprobs from this step too.)
        with_logprobs = any(r.params.logprobs is not None
                            for r in (*occupied.values(), *carried))
        # A step carrying chunks drafts num_steps (their rows are verify_width wide).
        length = self.num_steps if carried else self.draft_policy.choose(batch)
        caught_up = self._catch_up_draft(batch, occupied, length)
        args = (self._target_params, self._draft_params, self.state,
                self._page_updates(self.page_allocator.take_updates()))
        num_lanes, firsts = 0, []
        if carried:
            lane = self._step_lane_len(batch)
            num_lanes, _ = self._chunk_shape(
                [(n, lane) for n in self._step_lane_counts(batch)],
                [min(self._prefill_len(r) - r.seq_len, self.chunk_len) for r in carried],
                split=True)
            chunks = self._take_chunks(carried, num_lanes, lane, num_lanes * lane, split=True)
            args += (chunks,)
            by_slot = {r.slot: r for r in carried}
            firsts = [(i, by_slot[slot], by_slot[slot].preemptions)
                      for i, slot in enumerate(chunks.slot.tolist()) if chunks.sample_next[i]]
        self._count_choice(batch, length, len(occupied))
        self.state, out = self._step_fn(batch, with_logprobs, num_lanes, length)(*args)
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        behind = length == 0 and self.state.draft_lag is not None  # (a draft to leave)
        for req in occupied.values():
            req.in_flight += 1
            req.draft_lag += behind
        return (out, {slot: (req, req.preemptions) for slot, req in occupied.items()},
                firsts, _StepVariant(batch, length, bool(num_lanes) or caught_up))

    def _catch_up_draft(self, batch: int, occupied: dict[int, _Request], length: int) -> bool:
        """Before a step that drafts, or a step of length 0 that would put a row's draft
        more than MAX_DRAFT_LAG positions behind: the draft's catch-up over the
        positions steps of length 0 skipped (dispatched, so it runs before the step).
        Returns whether it dispatched one."""
        if self.state.draft_lag is None:
            return False  # no length 0 among the draft lengths: never behind
        lags = [r.draft_lag for r in occupied.values()]
        if not any(lags) or (length == 0 and max(lags) < step_lib.MAX_DRAFT_LAG):
            return False
        self.state = self._catch_up_fn(batch)(self._draft_params, self.state)
        self.stats.num_draft_catch_ups += 1
        for req in occupied.values():
            req.draft_lag = 0
        return True

    def _count_choice(self, batch: int, length: int, rows: int) -> None:
        """Counts a dispatched step's draft length and the adaptive policy's forecast:
        the tokens its rows should commit and the time its executable takes."""
        s = self.stats
        if not self.num_steps:
            return
        s.draft_length_steps[length] += 1
        expected = self.draft_policy.predicted_tokens(length)
        if expected is not None:
            s.forecast_tokens += expected * rows
            s.forecast_seconds += self.draft_policy.step_seconds[batch, length]

    def _collect(self, out, occupied: dict[int, tuple[_Request, int]],
                 firsts: list[tuple[int, _Request, int]], variant: _StepVariant, outputs):
        """Reads a step's tokens (the one host read of the step) and commits them, and
        the first tokens of the requests whose last prompt chunks the step carried
        (chunk index, request, its preemption count at dispatch).

        Returns the host StepOutput and the step's live rows (slot -> request id): the
        requests neither finished nor preempted since the step was dispatched."""
        out = jax.device_get(out)
        self._commit_first_tokens([(i, req) for i, req, preemptions in firsts
                                   if req.preemptions == preemptions and not req.finished],
                                  out.prefill, outputs)
        live = {}
        for slot, (req, preemptions) in occupied.items():
            if req.preemptions != preemptions:
                continue  # preempted after dispatch: recomputed on readmission
            req.in_flight -= 1
            if not req.finished:
                live[slot] = req
        self._count_step(out, live, variant.draft_length)
        tokens, num_tokens = out.tokens.tolist(), out.num_tokens.tolist()
        for slot, req in live.items():
            n = num_tokens[slot]
            if self.state.boundary_features is not None:  # (the step kept their features)
                self.page_allocator.features_written(slot, req.seq_len, req.seq_len + n)
            req.seq_len += n
            toks = tokens[slot][:n]
            lps = None
            if req.params.logprobs is not None:
                k = req.params.logprobs
                lps = [TokenLogprob(toks[j], float(out.logprob[slot, j]), {
                    int(i): float(v) for i, v in zip(out.top_ids[slot, j, :k],
                                                     out.top_logprobs[slot, j, :k])})
                       for j in range(n)]
            self._commit(req, toks, lps, outputs)
            if not req.finished:
                self._register_pages(req)
        return out, {slot: req.request_id for slot, req in live.items()}

    def _count_step(self, out, live: dict[int, _Request], length: int):
        """Adds the live rows of a step that drafted ``length`` tokens to the counters
        and to the draft policy's acceptance estimate (vectorised over the rows: this
        runs on the host between steps, at every batch size)."""
        s = self.stats
        s.num_steps += 1
        if not live:
            return
        rows = np.fromiter(live, np.int64, len(live))
        n = out.num_tokens[rows]
        tokens = out.tokens[rows]
        committed = np.arange(tokens.shape[1])[None] < n[:, None]
        s.num_emitted_tokens += int(n.sum())
        s.num_invalid_tokens += int(np.sum(committed & ((tokens < 0) |
                                                        (tokens >= self.vocab_size))))
        if length:
            accept = out.accept_len[rows]
            self.draft_policy.observe(length, accept)
            s.num_drafts += len(rows)
            # A tree drafts its nodes; a chain its length.
            drafted = self.verify_width - 1 if self.tree_topk > 1 else length
            s.num_draft_tokens += drafted * len(rows)
            s.num_accepted_tokens += int(accept.sum())
            # Position i (a tree's depth i + 1) drafted in every row of the step,
            # accepted in every row whose accept length exceeds i.
            for i, count in enumerate(np.sum(accept[:, None] > np.arange(length),
                                             axis=0).tolist()):
                s.accepted_per_pos[i] += count
                s.drafted_per_pos[i] += len(rows)
            s.num_malformed_draft_probs += int(out.num_malformed[rows].sum())
            s.num_sampler_fallbacks += int(out.num_fallback[rows].sum())

    # ------------------------------------------------------------------ commit
    def _commit(self, req: _Request, tokens: list[int], logprobs, outputs):
        """Appends committed tokens, applying every stop condition in order."""
        p = req.params
        # Tokens the request may still take before a length limit ends it.
        room = self.max_model_len - len(req.prompt) - len(req.output)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output))
        kept, reason, stop_reason = tokens, None, None
        stop = next((j for j, tok in enumerate(tokens) if tok in req.stop_ids), None)
        if stop is not None and stop < room:
            kept, reason = tokens[:stop + 1], "stop"
            stop_reason = tokens[stop] if tokens[stop] in p.stop_token_ids else None
        elif len(tokens) >= room:
            kept, reason = tokens[:room], "length"
        new_text = ""
        if req.detok is not None:
            new_text = req.detok.push(kept)
            if p.stop:
                new_text, kept, hit = self._apply_stop_strings(req, new_text, kept)
                if hit is not None:
                    reason, stop_reason = "stop", hit
            else:
                req.text += new_text
        req.output.extend(kept)
        lps = logprobs[:len(kept)] if logprobs is not None else None
        if lps:
            req.logprobs.extend(lps)
        if reason is not None:
            self._finish(req, reason, stop_reason)
        outputs.append(self._output(req, kept, lps, new_text))

    def _apply_stop_strings(self, req: _Request, new_text: str, kept: list[int]):
        """Cuts the text at the first stop string; drops the tokens past it.

        A stop string may span several tokens of one accepted run: the tokens after the
        one that completes the match are dropped, and the text ends before the match.
        """
        p = req.params
        before = len(req.text)
        text = req.text + new_text
        window_start = max(0, before - max(len(s) for s in p.stop) + 1)
        best = None
        for s in p.stop:
            i = text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            req.text = text
            return new_text, kept, None
        i, s = best
        end = i + len(s) if p.include_stop_str_in_output else i
        # Keep the tokens up to the one whose text completes the stop string.
        from eagle_jax.tokenizer import IncrementalDetokenizer

        probe = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt)
        probe.push(req.output)
        acc = req.text
        cut = len(kept)
        for j, tok in enumerate(kept):
            acc += probe.push([tok])
            if len(acc) >= i + len(s):
                cut = j + 1
                break
        req.text = text[:end]
        return text[before:end] if end > before else "", kept[:cut], s

    def _finish(self, req: _Request, reason: str, stop_reason):
        req.finished = True
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req.slot >= 0:
            self._slots[req.slot] = None
            self._register_pages(req)
            self.page_allocator.free(req.slot)
            self._release_slot(req.slot)
        self._requests.pop(req.request_id, None)

    def _output(self, req: _Request, new_tokens, new_logprobs, new_text: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(new_tokens), finished=req.finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            new_logprobs=new_logprobs, num_prompt_tokens=len(req.prompt),
            num_output_tokens=len(req.output), num_cached_tokens=req.num_cached_tokens,
            text=req.text, new_text=new_text, first_token_time=req.first_token_time)

    # ------------------------------------------------------------- scoring
    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[TokenLogprob | None]:
        """Logprob of every prompt token given its prefix (first entry None)."""
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, over max_model_len "
                             f"{self.max_model_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bucket = 1 << max(4, (len(ids) - 1).bit_length())
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :len(ids)] = ids
        lp, top_ids, top_lp = jax.device_get(self._score_fn(bucket)(self._target_params, tokens))
        out: list[TokenLogprob | None] = [None]
        for j in range(1, len(ids)):
            out.append(TokenLogprob(ids[j], float(lp[0, j - 1]), {
                int(i): float(v) for i, v in zip(top_ids[0, j - 1, :top_n], top_lp[0, j - 1, :top_n])}))
        return out

    def _score_fn(self, bucket: int):
        tg, vocab = self._target_graph, self.vocab_size

        def score(params, tokens):
            # tokens: [1, bucket] zero-padded; row j scores token j + 1. No KV pool: the
            # prompt attends causally to itself.
            target = _merge(tg, params)
            logits = target(tokens, jnp.arange(bucket)[None], None).logits
            return step_lib.token_logprobs(logits, jnp.roll(tokens, -1, axis=1), vocab)

        return self._executable(("score", bucket), lambda: (score, (
            self._target_params, jax.ShapeDtypeStruct((1, bucket), jnp.int32)), ()))
