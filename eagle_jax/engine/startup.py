"""Compiling at start-up: the whole bucket menu before serving, or the ready set first
(``BucketMenu.ready_set``: the executables that can serve any request) and the rest in
background threads while the engine serves (``EngineConfig.compile_in_background``).
On a GPU the ready set then runs once on inputs that change nothing (``warm_up``)."""

from __future__ import annotations

import logging
import time

import jax

from eagle_jax.engine.buckets import BucketMenu, ExecutableKey, PrefillKey, StepKey
from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.executables import ExecutableCache
from eagle_jax.engine.plans import PrefillPlan, StepPlan
from eagle_jax.engine.runner import ModelRunner
from eagle_jax.engine.slot_changes import SlotChanges
from eagle_jax.engine.state import PrefillChunks
from eagle_jax.engine.step_timing import adaptive_policy
from eagle_jax.engine.types import CompileProgress

logger = logging.getLogger("eagle_jax.engine")


def precompile_menu(executables: ExecutableCache, menu: BucketMenu,
                    with_logprobs: bool = False) -> None:
    """Compiles every executable of ``menu`` (their variants that compute logprobs
    ``with_logprobs``) before returning, several at once."""
    executables.precompile(menu.executables(with_logprobs),
                           "compiling buckets" + (" (logprobs)" if with_logprobs else ""))


def warm_up(runner: ModelRunner, keys: list[ExecutableKey]) -> None:
    """Runs the prefills and steps (and the slot update) of ``keys`` once, through the
    runner's own dispatch, on inputs that change nothing: padding chunks, every row
    inactive, no slot change. Before any request holds a slot. On a GPU an executable's
    first run loads its kernels and captures its command buffers: the first request
    after ready took 420 ms to its first token against 116 ms for the next ones (8B
    shape, H100), so the ready set pays that before the engine says it is ready."""
    no_change = SlotChanges(runner.num_slots).take()
    for key in keys:
        if isinstance(key, PrefillKey):
            chunks = PrefillChunks.padding(key.num, key.size, runner.num_slots,
                                           runner.pool.max_pages)
            runner.run_prefill(PrefillPlan(chunks, no_change, key.with_logprobs, (), 0))
        elif isinstance(key, StepKey) and not key.num_lanes and not key.constrained:
            runner.run_step(StepPlan(key, no_change, False, runner.step_inputs()[3], None,
                                     {}, ()))
    jax.block_until_ready(runner.state)


def compile_at_start(config: EngineConfig, runner: ModelRunner, started: float) -> None:
    """Precompile as ``config`` asks: the whole menu (and its logprobs variants with
    ``precompile_logprobs``), or with ``compile_in_background`` the ready set now and the
    rest queued for the background; then, on a GPU, the ready set's first run
    (``warm_up``). ``started``: the engine's ``time.monotonic()`` at construction, for
    the log's ready and complete times."""
    executables, menu = runner.executables, runner.menu
    ready = menu.ready_set()
    warm = runner.devices[0].platform != "cpu"  # (no first-run cost there to move)
    background = config.compile_in_background
    if background and jax.process_count() > 1:
        # Every process must choose the same executables (``multihost``): which are
        # compiled at a given step would differ between them.
        logger.info("engine: compiling every executable before serving: the engine "
                    "spans %d processes, whose steps must agree", jax.process_count())
        background = False
    if not background:
        precompile_menu(executables, menu)
        if config.precompile_logprobs:
            precompile_menu(executables, menu, with_logprobs=True)
        if warm:
            warm_up(runner, ready)
        return
    keys = menu.executables()
    if config.precompile_logprobs:
        keys += menu.executables(with_logprobs=True)
    executables.precompile(ready, "compiling the ready set")
    if warm:
        warm_up(runner, ready)
    rest = [key for key in keys if key not in ready]
    ready_seconds = time.monotonic() - started
    logger.info("engine: ready after %.1f s, %d of %d executables compiled; compiling "
                "the other %d in the background (%d threads)", ready_seconds,
                len(executables), len(executables) + len(rest), len(rest),
                config.background_compile_threads)

    def log_complete() -> None:  # called from a compile thread
        now = time.monotonic() - started
        logger.info("engine: all %d executables compiled, %.1f s after start (%.1f s "
                    "after ready)", len(executables), now, now - ready_seconds)

    executables.compile_in_background(rest, config.background_compile_threads,
                                      on_complete=log_complete)


class StartupCompile:
    """The start-up compile (``compile_at_start``) and the draft policy that waits for it.

    An adaptive policy (``draft_policy.AdaptiveDraftLength``) times every step variant, so
    it starts once all are compiled, at a moment no request holds a slot (timing runs
    the steps); until then steps draft num_steps (``FixedDraftLength``)."""

    def __init__(self, config: EngineConfig, runner, scheduler, started: float):
        self._runner, self._scheduler = runner, scheduler
        self._policy_pending = len(runner.menu.draft_lengths) > 1
        if config.precompile:
            compile_at_start(config, runner, started)
        self.start_policy_if_ready(idle=True, log=False)

    @property
    def progress(self) -> CompileProgress:
        """Executables compiled, and pending in the background."""
        executables = self._runner.executables
        return CompileProgress(compiled=len(executables), pending=executables.num_pending)

    def start_policy_if_ready(self, idle: bool, log: bool = True) -> None:
        """Starts the adaptive policy if it waits, every executable is compiled and
        ``idle`` (no request holds a slot and no step is in flight)."""
        if not (self._policy_pending and idle and self.progress.complete):
            return
        if log:
            logger.info("engine: every executable compiled; timing the draft lengths for "
                        "the adaptive policy")
        self._scheduler.draft_policy = adaptive_policy(self._runner)
        self._policy_pending = False

    def finish(self, idle: bool) -> None:
        """Waits for the background compiles, then ``start_policy_if_ready(idle)``."""
        self._runner.executables.wait()
        self.start_policy_if_ready(idle)
