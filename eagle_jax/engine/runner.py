"""The model runner: the models and where they live, the device state, and the pure
functions of ``step.py`` built into executables and run for the scheduler's plans.

The runner owns one ``DecodeState`` of ``num_slots`` rows on the device and a paged KV
pool shared by all of them. Its settings (the draft's geometry, whether the draft may lag,
whether page-end features are kept) are plain fields set here from the config: no part of
the engine learns a setting by reading the device state.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from eagle_jax import parallel
from eagle_jax.config import ModelConfig, resolve_dtype
from eagle_jax.grammar import fill_masks, num_mask_words
from eagle_jax.engine import step as step_lib
from eagle_jax.engine.buckets import (
    BucketMenu, CatchUpKey, ExecutableKey, PrefillKey, ScoreKey, StepKey, UpdateSlotsKey)
from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.draft_tree import scratch_positions
from eagle_jax.engine.executable_store import ExecutableStore, store_dir
from eagle_jax.engine.executables import (
    CompileFn, ExecutableCache, enable_compilation_cache, jit_compile, merge_module,
    split_module)
from eagle_jax.engine.grammar_masks import host_masks
from eagle_jax.engine.kv_cache_manager import pad_page_updates, max_page_updates
from eagle_jax.engine.pool_sizing import size_pool
from eagle_jax.engine.prefill import prefill_chunks
from eagle_jax.engine.plans import PrefillPlan, StepPlan
from eagle_jax.engine.state import (
    MAX_DRAFT_LAG, SLOT_FIELDS, DecodeState, PrefillChunks, PrefillOutput, SlotUpdates,
    StepOutput, slot_fields, token_logprobs, update_slots)
from eagle_jax.fp8 import fp8_dtype
from eagle_jax.fp8_checkpoint import on_the_fly_spec
from eagle_jax.kernels.paged_attention import KV_FP8
from eagle_jax.models.decoder import Decoder, load_decoder
from eagle_jax.models.layers import quantize_linears
from eagle_jax.sampling import SamplingRows

logger = logging.getLogger("eagle_jax.engine")


class ModelRunner:
    def __init__(self, config: EngineConfig, *, target: Decoder | None, draft,
                 tokenizer_vocab_size: int | None, devices: list | None,
                 compile_fn: CompileFn, draft_probs_hook: Callable | None):
        """Executables of serving's ``jit_compile`` are kept between starts in the
        executable store under ``config.compilation_cache_dir`` (``executable_store``)."""
        self.config = config
        # Only serving's CompileFn is stored: another one (the comparison tool's) runs or
        # wraps the function in a way the store's key cannot see, and so does the hook.
        # The store stands in for JAX's persistent cache, which must stay off for it to
        # keep anything (``executable_store.jax_cache_in_use``); set before any compile.
        stored = compile_fn is jit_compile and draft_probs_hook is None
        if not stored:
            enable_compilation_cache(config.compilation_cache_dir)
        self.dtype = resolve_dtype(config.dtype)
        self.mesh = self._make_mesh(target, devices)
        # A replica of one device (no mesh) is committed to it, so that its executables
        # run there; its models load there (not on the default device, whose memory
        # another replica's KV pool may already hold). None: the default device, as is.
        self.device = devices[0] if devices is not None and self.mesh is None else None
        self.devices = (list(self.mesh.devices.flat) if self.mesh is not None else
                        [self.device or jax.devices()[0]])
        self.target, self.draft = self._load_models(target, draft)
        self.model_config: ModelConfig = self.target.config
        self.vocab_size = min(tokenizer_vocab_size or self.model_config.vocab_size,
                              self.model_config.vocab_size)
        self.num_steps = config.num_steps if config.speculative else 0
        self.tree_topk = config.speculative_eagle_topk if config.speculative else 1
        if draft_probs_hook is not None and self.tree_topk > 1:
            raise ValueError("draft_probs_hook rewrites a chain's draft probabilities; it has "
                             "no effect on a tree (speculative_eagle_topk > 1): drop one")
        self._draft_probs_hook = draft_probs_hook
        # Structured output: why this engine cannot serve it (None: it can), and the
        # constrained rows of the step being dispatched (slot -> grammar.RequestGrammar).
        self.structured_output_error = (
            None if self.tree_topk == 1 else
            "structured_output: not supported with tree drafting (speculative_eagle_topk "
            f"{self.tree_topk} > 1): the tree's masks are not implemented; serve it with "
            "speculative_eagle_topk 1 (a chain)")
        self.grammar_rows: dict = {}
        # Positions one step verifies per request: the chain's window (S + 1), a tree's
        # root and nodes, or 1. A prompt chunk riding in a step comes in rows this wide.
        self.verify_width = config.num_draft_tokens if self.num_steps else 1
        # Positions one step may write per request above its length: a tree's draft also
        # writes its scratch rows there.
        self.step_tokens = self.verify_width if self.tree_topk == 1 else max(
            self.verify_width,
            scratch_positions(self.tree_topk, self.num_steps, self.verify_width - 1))
        adaptive = config.speculative and config.speculative_policy == "adaptive"
        self.draft_lengths = config.draft_lengths if adaptive else (self.num_steps,)
        self.has_draft_lag = self.draft is not None and 0 in self.draft_lengths
        self.keeps_boundary_features = (self.draft is not None
                                        and config.enable_prefix_caching)
        self.num_slots = config.max_num_seqs
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else KV_FP8
        self.pool = size_pool(config, target=self.target, draft=self.draft, mesh=self.mesh,
                              devices=self.devices, dtype=self.dtype, kv_dtype=self.kv_dtype,
                              step_tokens=self.step_tokens,
                              feature_width=self._feature_width())
        self.menu = self._bucket_menu()
        self.max_page_updates = max_page_updates(self.num_slots, self.step_tokens,
                                                 config.page_size)
        self._target_graph, self.target_params = split_module(self.target)
        self._draft_graph, self.draft_params = split_module(self.draft)
        with jax.default_device(self.device):
            state = self._zero_state()
        self.state = state if self.device is None else jax.device_put(state, self.device)
        store = (ExecutableStore(store_dir(config.compilation_cache_dir),
                                 self._executable_context(), self.devices)
                 if stored and config.compilation_cache_dir else None)
        self.executables = ExecutableCache(compile_fn, self._build, store)

    # ------------------------------------------------------------------ set-up
    def _make_mesh(self, target: Decoder | None, devices: list | None):
        """The tensor-parallel mesh (``parallel.make_mesh``) of ``tensor_parallel_size``
        devices; None at 1. A caller's ``target`` brings its own mesh, which must match.

        With a mesh, the target is split over it (``parallel``), its KV pool by kv head;
        the draft (its parameters, its pool) and every other state array are replicated
        on it, so each executable sees one device set and XLA's SPMD partitioner splits
        the one jitted step. The draft stays replicated (it is small: one layer), and so
        do the sampler, the draft's LM head and the norm / concat of the EAGLE-3
        features: correct, and a per-shard split of them is left for measurement."""
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

    def _load_models(self, target, draft):
        """The target and draft (given, or loaded from ``config.model`` /
        ``config.draft_model``), placed on the runner's devices."""
        config = self.config
        with jax.default_device(self.device):
            if target is None:
                target = load_decoder(config.model, self.dtype, mesh=self.mesh,
                                      quantization=config.quantization)
            if config.speculative and draft is None:
                from eagle_jax.models.draft_checkpoint import load_draft

                draft = load_draft(config.draft_model, target, self.dtype)
                if config.draft_quantization == "fp8":
                    quantize_linears(draft, on_the_fly_spec(fp8_dtype(self.devices[0])))
        if target.quant is not None:
            logger.info("engine: the target in FP8: %s", target.quant.describe())
        if config.draft_quantization is not None and draft is not None:
            logger.info("engine: the draft's linear layers in FP8, quantized while loading")
        if self.mesh is not None and draft is not None:
            parallel.place(draft, NamedSharding(self.mesh, P()))
        if self.device is not None:
            for module in (target, draft):
                if module is not None:
                    parallel.place(module, SingleDeviceSharding(self.device))
        if draft is not None and draft.kind != config.speculative_algorithm:
            raise ValueError(f"{config.draft_model} is an {draft.kind} draft but "
                             f"speculative_algorithm is {config.speculative_algorithm}")
        return target, draft

    def _executable_context(self) -> str:
        """What shapes the executables' functions besides their arguments: the engine's
        settings (less those that only name, place or schedule), the models' classes and
        configurations, the vocabulary the sampler keeps to (the store's key)."""
        unshaping = {"served_model_name", "compilation_cache_dir", "precompile",
                     "precompile_logprobs", "compile_in_background", "async_scheduling",
                     "seed", "model", "draft_model"}
        settings = {f.name: getattr(self.config, f.name)
                    for f in dataclasses.fields(self.config) if f.name not in unshaping}
        draft = self.draft
        return repr((settings, type(self.target).__name__, self.model_config, self.target.quant,
                     None if draft is None else (type(draft).__name__, draft.config,
                                                 draft.feature_layers),
                     self.vocab_size, str(self.dtype)))

    def _feature_width(self) -> int:
        if self.draft is None:
            return 0
        layers = self.draft.feature_layers
        return self.model_config.hidden_size * (len(layers) if layers else 1)

    def _bucket_menu(self) -> BucketMenu:
        cfg, max_len = self.config, self.pool.max_model_len
        return BucketMenu(
            # The largest bucket is the slot count, so every occupancy has a bucket.
            batch_buckets=tuple(sorted({b for b in cfg.batch_buckets if b < self.num_slots}
                                       | {self.num_slots})),
            prefill_buckets=tuple(b for b in cfg.prefill_buckets if b <= max_len) or (max_len,),
            draft_lengths=self.draft_lengths, num_steps=self.num_steps,
            verify_width=self.verify_width, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_partial_prefills=cfg.max_num_partial_prefills, catch_up=self.has_draft_lag)

    def _zero_state(self) -> DecodeState:
        n, pages, page_size = self.num_slots, self.pool.num_pages, self.config.page_size
        width = self._feature_width()
        target_pages = self.target.init_pages(pages, page_size, self.kv_dtype)
        draft_pages = draft_hidden = draft_logits = None
        optional = {}
        if self.draft is not None:
            draft_pages = self.draft.init_pages(pages, page_size, self.kv_dtype)
            hidden = self.draft.project(jnp.zeros((1, width), self.dtype))
            draft_hidden = jnp.zeros((n, hidden.shape[-1]), self.dtype)
            draft_logits = jnp.zeros((n, self.draft.draft_vocab_size), jnp.float32)
        if self.has_draft_lag:
            lag = MAX_DRAFT_LAG
            optional.update(draft_lag=jnp.zeros((n,), jnp.int32),
                            lag_tokens=jnp.zeros((n, lag), jnp.int32),
                            lag_features=jnp.zeros((n, lag, width), self.dtype))
        if self.keeps_boundary_features:
            optional.update(draft_page_table=jnp.zeros((n, self.pool.max_pages), jnp.int32),
                            boundary_features=jnp.zeros((pages, width), self.dtype))
        synthetic = self.config.synthetic_acceptance
        state = DecodeState(
            target_pages=None, draft_pages=draft_pages,
            page_table=jnp.zeros((n, self.pool.max_pages), jnp.int32),
            seq_len=jnp.zeros((n,), jnp.int32), last_token=jnp.zeros((n,), jnp.int32),
            draft_hidden=draft_hidden, draft_logits=draft_logits,
            sampling=SamplingRows(*map(jnp.asarray, SamplingRows.padded(n))),
            key=jnp.zeros((n, 2), jnp.uint32), active=jnp.zeros((n,), bool),
            synthetic_acceptance=None if synthetic is None else jnp.float32(synthetic),
            **optional)
        if self.mesh is not None:  # target_pages, sharded by kv head, are already placed
            state = parallel.replicate_tree(state, self.mesh)
        return state._replace(target_pages=target_pages)

    def set_synthetic_acceptance(self, rate: float) -> None:
        """Benchmarks: the acceptance of a runner built with ``synthetic_acceptance``,
        changed between requests without compiling again."""
        if self.config.synthetic_acceptance is None:
            raise ValueError("this engine was built without synthetic_acceptance")
        if not 0 <= rate <= 1:
            raise ValueError(f"synthetic acceptance must be in [0, 1], got {rate}")
        # Placed as the state is (a replica's device, a mesh), not on the default device.
        self.state = self.state._replace(synthetic_acceptance=parallel.put(
            np.float32(rate), self.state.synthetic_acceptance.sharding))

    # ------------------------------------------------------------ the functions
    def _build(self, key: ExecutableKey) -> tuple[Callable, tuple, tuple[int, ...]]:
        """(pure function, example arguments, donated argument indices) of ``key``."""
        if isinstance(key, StepKey):
            args = self.step_inputs()
            if key.num_lanes:
                args += (self.chunks_spec(key.num_lanes, self.menu.step_lane_len(key.batch)),)
            return self.step_function(key.batch, key.with_logprobs, key.num_lanes,
                                      key.draft_length, key.constrained), args, (2,)
        if isinstance(key, PrefillKey):
            return (self.prefill_function(key.with_logprobs),
                    self.prefill_inputs(key.num, key.size), (2,))
        if isinstance(key, CatchUpKey):
            return self.catch_up_function(key.batch), (self.draft_params, self.state), (1,)
        if isinstance(key, UpdateSlotsKey):
            return update_slots, (slot_fields(self.state),
                                           self.slot_updates_spec()), (0,)
        if isinstance(key, ScoreKey):
            return self.score_function(key.bucket), (
                self.target_params, jax.ShapeDtypeStruct((1, key.bucket), jnp.int32)), ()
        raise TypeError(f"no executable is built for {key!r}")

    def step_inputs(self) -> tuple:
        """Arguments of ``step_function``'s function: (target parameters, draft
        parameters, state, page updates), the updates empty (e.g. for ``jax.export``)."""
        return (self.target_params, self.draft_params, self.state,
                pad_page_updates([], self.max_page_updates, self.num_slots))

    def step_function(self, batch: int, with_logprobs: bool = False,
                      num_lanes: int = 0, draft_length: int | None = None,
                      constrained: bool = False) -> Callable:
        """The pure step of a batch bucket:
        ``(target_params, draft_params, state, page_updates) -> (state, StepOutput)``,
        drafting ``draft_length`` tokens (default num_steps); with ``num_lanes``, a fifth
        argument, ``PrefillChunks`` of that many lanes (``BucketMenu.step_lane_len``
        positions each), rides in the step's forward; ``constrained``: its rows masked by
        the grammars of ``grammar_rows`` (``grammar_masks``). Compiled with ``state``
        donated."""
        length = self.num_steps if draft_length is None else draft_length
        if num_lanes and length != self.num_steps:
            raise ValueError("a step that carries prompt chunks drafts num_steps tokens")
        if constrained and self.structured_output_error is not None:
            raise ValueError(self.structured_output_error)
        tg, dg, cfg, vocab = self._target_graph, self._draft_graph, self.config, self.vocab_size
        grammar = (host_masks(lambda drafted: fill_masks(self.grammar_rows, drafted,
                                                         num_mask_words(vocab)),
                              num_mask_words(vocab)) if constrained else None)

        def run(target_params, draft_params, state, page_updates, chunks=None):
            target = merge_module(tg, target_params)
            common = dict(batch=batch, vocab_size=vocab, with_logprobs=with_logprobs,
                          chunks=chunks)
            if grammar is not None:
                common.update(grammar=grammar)
            if dg is None:
                return step_lib.plain_step(target, state, page_updates, **common)
            draft = merge_module(dg, draft_params)
            if self.tree_topk > 1:
                return step_lib.tree_spec_step(
                    target, draft, state, page_updates, num_steps=length, topk=self.tree_topk,
                    num_nodes=self.verify_width - 1, tree_verify=cfg.tree_verify, **common)
            return step_lib.spec_step(
                target, draft, state, page_updates, num_steps=length,
                probabilistic=cfg.draft_sample_method == "probabilistic",
                draft_probs_hook=self._draft_probs_hook, **common)

        return run

    def catch_up_function(self, batch: int) -> Callable:
        """The pure catch-up of a batch bucket's draft over the positions steps of draft
        length 0 skipped (``step.catch_up_draft``): ``(draft_params, state) -> state``,
        compiled with ``state`` donated."""
        dg = self._draft_graph

        def run(draft_params, state):
            return step_lib.catch_up_draft(merge_module(dg, draft_params), state, batch=batch)

        return run

    def chunks_spec(self, num: int, size: int) -> PrefillChunks:
        def spec(shape=(), dtype=jnp.int32):
            return jax.ShapeDtypeStruct((num,) + shape, dtype)

        return PrefillChunks(
            slot=spec(), page_row=spec((self.pool.max_pages,)), tokens=spec((size,)),
            start=spec(), length=spec(), next_token=spec(), is_last=spec((), jnp.bool_),
            sample_next=spec((), jnp.bool_), draft_col=spec(), draft_page=spec())

    def slot_updates_spec(self) -> SlotUpdates:
        n = self.num_slots
        flag = jax.ShapeDtypeStruct((n,), jnp.bool_)
        return SlotUpdates(
            assign=flag, release=flag,
            sampling=SamplingRows(*(jax.ShapeDtypeStruct((n,), x.dtype)
                                    for x in SamplingRows.padded(1))),
            key=jax.ShapeDtypeStruct((n, 2), jnp.uint32))

    def prefill_inputs(self, num: int, size: int) -> tuple:
        """Arguments of ``prefill_function``'s function for ``num`` chunks of ``size``
        positions (the chunks and slot changes as ShapeDtypeStructs)."""
        return (self.target_params, self.draft_params, self.state,
                self.chunks_spec(num, size), self.slot_updates_spec())

    def prefill_function(self, with_logprobs: bool = False) -> Callable:
        """The pure prefill: ``(target_params, draft_params, state, chunks, slot changes)
        -> (state, PrefillOutput)`` (``prefill_chunks``), its first tokens in
        the host's pinned memory. Compiled with ``state`` donated."""
        tg, dg, vocab = self._target_graph, self._draft_graph, self.vocab_size

        def run(target_params, draft_params, state, chunks, slots):
            state, out = prefill_chunks(
                merge_module(tg, target_params), merge_module(dg, draft_params), state,
                chunks, slots, vocab_size=vocab, with_logprobs=with_logprobs)
            # The executable writes the first tokens to the host as soon as they are
            # sampled. Copied out after it instead, a first token reached the host 0.3 ms
            # later on an H200: the copy waits for the whole executable, and the host
            # learns of it twice (docs/history/2026-12-04-issue-14-prefix-caching.md,
            # second session).
            return state, out._replace(token=jax.device_put(out.token, jax.memory.Space.Host))

        return run

    def score_function(self, bucket: int) -> Callable:
        """``(target_params, tokens [1, bucket] zero-padded) -> (logprob, top ids, top
        logprobs)`` of each next token: row j scores token j + 1. No KV pool: the prompt
        attends causally to itself."""
        tg, vocab = self._target_graph, self.vocab_size

        def score(params, tokens):
            logits = merge_module(tg, params)(tokens, jnp.arange(bucket)[None], None).logits
            return token_logprobs(logits, jnp.roll(tokens, -1, axis=1), vocab)

        return score

    # ------------------------------------------------------------------- running
    def run_prefill(self, plan: PrefillPlan) -> PrefillOutput:
        """Dispatches a prefill plan; its first tokens are asked for at once."""
        num, size = plan.shape
        self.state, out = self.executables[PrefillKey(num, size, plan.with_logprobs)](
            self.target_params, self.draft_params, self.state, plan.chunks,
            plan.slot_updates)
        out.token.copy_to_host_async()  # read next: asked for now, made once it is written
        return out

    def run_step(self, plan: StepPlan) -> StepOutput:
        """Dispatches a step plan: the slot changes, the draft's catch-up, the step; its
        output is asked for at once."""
        if plan.slot_updates is not None:
            fields = self.executables[UpdateSlotsKey()](slot_fields(self.state),
                                                        plan.slot_updates)
            self.state = self.state._replace(**{f: getattr(fields, f)
                                                for f in SLOT_FIELDS})
        if plan.catch_up:
            self.catch_up(plan.key.batch)
        args = (self.target_params, self.draft_params, self.state, plan.page_updates)
        self.grammar_rows = plan.grammars  # what a constrained step's masks read
        if plan.chunks is not None:
            args += (plan.chunks,)
        self.state, out = self.executables[plan.key](*args)
        for x in jax.tree.leaves(out):
            x.copy_to_host_async()
        return out

    def catch_up(self, batch: int) -> None:
        """Dispatches the draft's catch-up of the bucket's rows."""
        self.state = self.executables[CatchUpKey(batch)](self.draft_params, self.state)

    @staticmethod
    def read_first_tokens(out: PrefillOutput, with_logprobs: bool):
        """A prefill's output on the host: the tokens alone unless logprobs are asked for
        (each read is a transfer on the requests' time to first token)."""
        if with_logprobs:
            return jax.device_get(out)
        return out._replace(token=jax.device_get(out.token))

    def score(self, ids: list[int]):
        """Host (logprob [1, T], top ids, top logprobs) of each next token of ``ids``."""
        bucket = 1 << max(4, (len(ids) - 1).bit_length())
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :len(ids)] = ids
        return jax.device_get(self.executables[ScoreKey(bucket)](self.target_params, tokens))
