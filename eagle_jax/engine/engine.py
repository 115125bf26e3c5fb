"""The engine: its parts wired together, and ``step()``.

One direction per step, after vLLM V1: the scheduler (``scheduler.py``) plans, the
runner (``runner.py``) dispatches the plan, and the scheduler turns the step's host output
into ``RequestOutput``s through the output processor (``output_processor.py``). The KV
cache manager (``kv_cache_manager.py``) speaks for the pages in requests; the bucket
menu (``buckets.py``) is every compiled shape, which precompile compiles; step timing
(``step_timing.py``) and the counters (``stats.py``) watch.

A step runs the executable compiled for the smallest batch bucket that covers every
occupied slot and the draft length the draft policy chose for it (``draft_policy.py``:
fixed, or the length with the most expected committed tokens per second); the host then
reads the committed tokens and counts once. With ``async_scheduling`` step k+1 is
dispatched before step k's tokens are read, so the host's work hides behind the device's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp

from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.draft_policy import FixedDraftLength
from eagle_jax.engine.executables import CompileFn, jit_compile
from eagle_jax.engine.kv_cache_manager import KVCacheManager
from eagle_jax.engine.output_processor import OutputProcessor, token_logprobs
from eagle_jax.engine.request import Request, validate_prompt
from eagle_jax.engine.runner import ModelRunner
from eagle_jax.engine.plans import PrefillPlan, StepPlan
from eagle_jax.engine.scheduler import Scheduler
from eagle_jax.engine.startup import StartupCompile, precompile_menu
from eagle_jax.engine.stats import StatsCounter
from eagle_jax.engine.step_timing import CycleTimer, time_steps
from eagle_jax.engine.types import RequestOutput, SchedulerStats, StepEvent, TokenLogprob
from eagle_jax.models.decoder import Decoder
from eagle_jax.sampling import SamplingParams
from eagle_jax.tokenizer import Tokenizer

logger = logging.getLogger("eagle_jax.engine")


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    """A dispatched step whose tokens the host has not read yet."""

    plan: StepPlan
    output: object  # the step's StepOutput, on the device


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
        ``draft_probs_hook`` (tests only) rewrites the draft probabilities in the step
        (004). ``compile_fn`` turns the engine's pure
        functions into executables (``executables.CompileFn``); serving's own
        (``jit_compile``) keeps them between starts in the executable store under
        ``config.compilation_cache_dir`` (``executable_store``)."""
        if config.data_parallel_size != 1:
            raise ValueError(
                f"Engine is one replica; for data_parallel_size {config.data_parallel_size} "
                f"build the replicas with eagle_jax.engine.make_engine(config)")
        config, defaults = config.for_backend(jax.default_backend())
        for line in defaults:
            logger.info("engine: %s", line)
        self.config = config
        started = time.monotonic()
        self.tokenizer = (tokenizer if tokenizer is not None
                          else Tokenizer.from_dir_if_present(config.model))
        self.runner = runner = ModelRunner(
            config, target=target, draft=draft, devices=devices, compile_fn=compile_fn,
            draft_probs_hook=draft_probs_hook, tokenizer_vocab_size=None if self.tokenizer is None else self.tokenizer.vocab_size)
        # Settings, fixed at construction.
        self.target, self.draft = runner.target, runner.draft
        self.model_config = runner.model_config
        self.mesh, self.device, self.devices, self.dtype = (
            runner.mesh, runner.device, runner.devices, runner.dtype)
        self.vocab_size, self.num_steps, self.tree_topk = (
            runner.vocab_size, runner.num_steps, runner.tree_topk)
        self.verify_width, self.step_tokens = runner.verify_width, runner.step_tokens
        self.num_slots, self.page_size = runner.num_slots, config.page_size
        self.max_model_len, self.num_pages, self.max_pages, self.kv_bytes = (
            dataclasses.astuple(runner.pool))
        self.buckets = runner.menu
        self.batch_buckets, self.prefill_buckets, self.draft_lengths = (
            self.buckets.batch_buckets, self.buckets.prefill_buckets, self.buckets.draft_lengths)
        self.model_name = config.served_model_name or os.path.basename(
            os.path.normpath(config.model))
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_ids |= set(getattr(self.tokenizer, "eos_token_ids", ()))
        # The parts.
        self.kv_cache = KVCacheManager(
            num_pages=self.num_pages, page_size=self.page_size, max_pages=self.max_pages,
            num_slots=self.num_slots, step_tokens=self.step_tokens,
            prefix_caching=config.enable_prefix_caching, check_next=self.draft is not None,
            share_boundary=runner.keeps_boundary_features)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.max_model_len, self.eos_ids, vocab_size=self.vocab_size,
            structured_output_error=runner.structured_output_error)
        self.scheduler = Scheduler(
            menu=self.buckets, kv=self.kv_cache, processor=self.output_processor,
            draft_policy=FixedDraftLength(self.num_steps), num_slots=self.num_slots,
            step_tokens=self.step_tokens, has_draft_lag=runner.has_draft_lag, seed=config.seed,
            available=runner.executables.available)
        self._counter = StatsCounter(
            num_steps=self.num_steps, vocab_size=self.vocab_size,
            drafted_per_step=self.verify_width - 1 if self.tree_topk > 1 else None)
        self._timer = CycleTimer()
        self._step_listeners: list[Callable[[StepEvent], None]] = []
        self._in_flight: InFlightStep | None = None
        logger.info(
            "engine: %s, %s draft, %d slots, max_model_len %d, KV pool %d pages x %d tokens "
            "(%s, %.2f GiB, %d tokens), batch buckets %s, prefill buckets %s",
            self.model_name, config.speculative_algorithm, self.num_slots,
            self.max_model_len, self.num_pages, self.page_size,
            jnp.dtype(runner.kv_dtype).name, self.kv_bytes / 2**30,
            self.num_pages * self.page_size, self.batch_buckets, self.prefill_buckets)
        self.startup = StartupCompile(config, runner, self.scheduler, started)

    # ------------------------------------------------------- state and counters
    state = property(lambda self: self.runner.state,
                     lambda self, value: setattr(self.runner, "state", value),
                     doc="The device state (``step.DecodeState``).")
    draft_policy = property(lambda self: self.scheduler.draft_policy,
                            lambda self, value: setattr(self.scheduler, "draft_policy", value),
                            doc="Chooses each step's draft length (``draft_policy.py``).")
    stats = property(lambda self: self._counter.stats, doc="``SpecDecodeStats``.")
    page_allocator = property(lambda self: self.kv_cache.allocator)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    num_prefill_runs = property(lambda self: self.scheduler.num_prefill_runs,
                                doc="Prompt chunks run by prefills of their own.")
    prefix_cache_queries = property(lambda self: self.kv_cache.prefix_cache_queries)
    prefix_cache_hits = property(lambda self: self.kv_cache.prefix_cache_hits)

    num_compiled = property(lambda self: len(self.runner.executables), doc=(
        "Executables compiled so far (a lazily compiling benchmark checks its timed "
        "requests compiled none)."))

    def set_synthetic_acceptance(self, rate: float) -> None:
        """Benchmarks: ``synthetic_acceptance``, changed without compiling again."""
        self.runner.set_synthetic_acceptance(rate)

    # ------------------------------------------------------------- executables
    compile_progress = property(lambda self: self.startup.progress, doc=(
        "Executables compiled, and pending in the background (``compile_in_background``)."))

    def finish_compiling(self) -> None:
        """Waits for the background compiles; starts the adaptive policy once idle."""
        self.startup.finish(self._idle())

    def _idle(self) -> bool:
        return not self.scheduler.num_running() and self._in_flight is None

    def precompile(self, with_logprobs: bool = False) -> None:
        """Compiles the bucket menu's executables (``with_logprobs``: their variants)."""
        precompile_menu(self.runner.executables, self.buckets, with_logprobs)

    def time_steps(self, repeats: int = 8, context: int = 256, greedy: bool = False
                   ) -> dict[tuple[int, int], float]:
        """Seconds per step of each bucket and draft length (``step_timing.time_steps``)."""
        if self.scheduler.num_running() or self._in_flight is not None:
            raise RuntimeError("draft lengths are timed while no request holds a slot")
        return time_steps(self.runner, repeats, context, greedy)

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queues a request. Raises ValueError naming the problem for bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if self.scheduler.knows(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        self.scheduler.add(self.output_processor.new_request(request_id, prompt, params,
                                                             time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None

    def num_running(self) -> int:
        return self.scheduler.num_running()

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting()

    def slot_of(self, request_id: str) -> int | None:
        """The slot (a row of the device state) a request holds; None while it waits."""
        return self.scheduler.slot_of(request_id)

    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Admits waiting requests, runs prefill chunks within the step's token budget and
        one decode step (none in a call whose prefills, run alone, sampled first tokens:
        those are returned at once), returns what each request produced.

        With ``async_scheduling`` the step is dispatched before the previous step's
        tokens are read, so the host's bookkeeping overlaps the device's work; a request
        that the previous step finished is then computed once more and discarded.
        """
        self.startup.start_policy_if_ready(self._idle())
        outputs = self.scheduler.process_aborts()
        prefill_runs = self.num_prefill_runs
        carried, prefilled = self._prefill()
        outputs += prefilled
        plan = None
        # Prefills that ran alone sampled first tokens: returned now, their first decode
        # step dispatched by the next call, off their time to first token (~3 ms on the
        # H200: docs/history/2026-12-03-issue-14-prefix-caching.md).
        if not any(o.new_token_ids for o in prefilled):
            plan = self.scheduler.plan_step(carried)
        events, launched = [], None
        for launched in self._steps_to_read(self._dispatch(plan) if plan else None):
            host = jax.device_get(launched.output)
            collected, rows = self.scheduler.update_from_output(launched.plan, host)
            self._counter.count_step(host, rows, launched.plan.key.draft_length,
                                     self.draft_policy)
            # The call's earlier outputs (its prefills') go with its first event.
            events.append(StepEvent(self.stats.num_steps, host, rows,
                                    collected if events else outputs + collected))
            outputs += collected
        self._timer.observe(self.draft_policy, launched and launched.plan,
                            ran_prefill=self.num_prefill_runs > prefill_runs)
        for event in events or [StepEvent(self.stats.num_steps, None, {}, outputs)]:
            for listener in self._step_listeners:
                listener(event)
        return outputs

    def _steps_to_read(self, launched: InFlightStep | None) -> list[InFlightStep]:
        """The steps whose tokens this call reads: ``launched``; with ``async_scheduling``
        the one in flight before it, ``launched`` staying in flight unless constrained
        (the next step's grammar masks read the matchers its tokens advance)."""
        if not self.config.async_scheduling:
            return [launched] if launched else []
        previous, keep = self._in_flight, launched and not launched.plan.key.constrained
        self._in_flight = launched if keep else None
        return [s for s in (previous, None if keep else launched) if s is not None]

    def _prefill(self) -> tuple[list[Request], list[RequestOutput]]:
        """Spends this step's prefill budget on the next chunks of the requests in
        prefill (``Scheduler.prefill_candidates``). While requests decode, the chunks ride
        in the decode step (the requests are returned, for its plan) once a step with
        lanes is compiled; else they run as prefills of their own, one forward for all
        of a round's chunks, round after round while budget is left (a request whose last
        chunk ran joins this step's decode; a new one commits its first token)."""
        budget, decoding = self.scheduler.prefill_budget()
        if decoding and self.scheduler.can_carry_chunks():
            return self.scheduler.prefill_candidates(budget), []
        outputs = []
        while budget > 0 and (plan := self.scheduler.plan_prefill(budget)) is not None:
            outputs += self._run_prefill(plan)
            budget -= plan.num_positions
        return [], outputs

    def _run_prefill(self, plan: PrefillPlan) -> list[RequestOutput]:
        out = self.runner.run_prefill(plan)
        if not plan.firsts:
            return []
        with_logprobs = any(req.params.logprobs is not None for _, req in plan.firsts)
        return self.scheduler.commit_first_tokens(
            plan.firsts, self.runner.read_first_tokens(out, with_logprobs))

    def _dispatch(self, plan: StepPlan) -> InFlightStep:
        self._counter.count_plan(plan, self.draft_policy)
        return InFlightStep(plan, self.runner.run_step(plan))

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """Calls ``listener(StepEvent)`` at the end of every ``step()``, once for each
        decode step it collected from the device (host arrays, with the outputs that
        step gave; two when a constrained step is read at once behind the one in
        flight), or once with none. For observers (evaluation records, the comparison
        tool); it must not drive the engine."""
        self._step_listeners.append(listener)

    def remove_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        self._step_listeners.remove(listener)

    # ------------------------------------------------------------- scoring
    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[TokenLogprob | None]:
        """Logprob of every prompt token given its prefix (first entry None)."""
        ids = validate_prompt(prompt_token_ids, self.vocab_size, self.max_model_len,
                              generates=False)
        lp, top_ids, top_lp = self.runner.score(ids)
        return [None] + token_logprobs(ids[1:], lp[0, :len(ids) - 1], top_ids[0],
                                       top_lp[0], top_n)

