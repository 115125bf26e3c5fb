"""Step times: every compiled step timed at start-up (the adaptive draft policy's table),
and the cycles followed while serving."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eagle_jax import parallel
from eagle_jax.engine.buckets import StepKey
from eagle_jax.engine.draft_policy import AdaptiveDraftLength
from eagle_jax.engine.page_allocator import pages_for
from eagle_jax.engine.runner import ModelRunner
from eagle_jax.engine.plans import StepPlan
from eagle_jax.engine.state import MAX_DRAFT_LAG
from eagle_jax.sampling import SamplingRows

logger = logging.getLogger("eagle_jax.engine")


def time_steps(runner: ModelRunner, repeats: int = 8, context: int = 256,
               greedy: bool = False) -> dict[tuple[int, int], float]:
    """Seconds per step of every batch bucket and draft length: {(bucket, length): s},
    with every live row sampling at temperature 1 (the padded rows' parameters), or
    greedy (``greedy``).

    Runs before any request holds a slot (the caller checks), on rows made live for the
    purpose: every row of the bucket active at ``context`` tokens (at most half of
    max_model_len), each on pages of its own where the pool holds them, so that the
    kernels do a live row's work (an inactive row skips it) and no two rows write the
    same pool row (a scatter with repeated indices serialises on a GPU: shared pages
    made the timed steps of large buckets up to twice as slow as served ones). The pool
    holds nothing yet, and the rows' state is put back afterwards. Steps are dispatched
    back to back, as while serving, and the device time per step is taken (the context
    grows by at most a step's tokens per call); the policy then follows the measured
    cycles while serving (their context and the host's work between steps). Length 0's
    time includes its share of the draft's catch-up, which runs at least once every
    MAX_DRAFT_LAG such steps."""
    pool, menu, n = runner.pool, runner.menu, runner.num_slots
    context = max(1, min(context, pool.max_model_len // 2))
    num_pages = min(pages_for(context + (repeats + 2) * runner.step_tokens,
                              runner.config.page_size), pool.max_pages, pool.num_pages)
    table = np.zeros((n, pool.max_pages), np.int32)
    table[:, :num_pages] = (np.arange(n)[:, None] * num_pages
                            + np.arange(num_pages)) % pool.num_pages
    idle = jax.tree.map(jnp.copy, runner.state._replace(
        target_pages=None, draft_pages=None))  # the step donates what it is given
    seconds = {}
    rows = SamplingRows.padded(n)  # numpy: each step gets (donates) a copy
    if greedy:
        rows = rows._replace(top_k=np.ones_like(rows.top_k))
    jobs = [(b, s) for b in menu.batch_buckets for s in menu.draft_lengths]
    for bucket, length in tqdm(jobs, desc="timing draft lengths", leave=False):
        live = np.arange(n) < bucket
        fn = runner.executables[StepKey(bucket, False, 0, length)]
        target_params, draft_params, _, updates = runner.step_inputs()
        for calls in (1, repeats):  # the first call warms the executable up
            runner.state = runner.state._replace(
                active=jnp.asarray(live), seq_len=jnp.where(live, context, 0),
                page_table=jnp.asarray(np.where(live[:, None], table, 0)),
                draft_page_table=(None if runner.state.draft_page_table is None else
                                  jnp.asarray(np.where(live[:, None], table, 0))),
                sampling=SamplingRows(*(jnp.asarray(x) for x in rows)))
            jax.block_until_ready(runner.state.page_table)
            t0 = time.perf_counter()
            for _ in range(calls):
                runner.state, out = fn(target_params, draft_params, runner.state, updates)
            jax.block_until_ready(out)
        seconds[bucket, length] = (time.perf_counter() - t0) / repeats
        if length == 0 and runner.has_draft_lag:
            # Its share of a whole lag's catch-up of every live row.
            seconds[bucket, length] += _time_catch_up(runner, bucket, live, repeats) / (
                MAX_DRAFT_LAG)
    pages = runner.state.target_pages, runner.state.draft_pages
    runner.state = idle._replace(target_pages=pages[0], draft_pages=pages[1])
    return seconds


def _time_catch_up(runner: ModelRunner, bucket: int, live: np.ndarray, repeats: int) -> float:
    """Seconds of the bucket's draft catch-up with every ``live`` row MAX_DRAFT_LAG
    positions behind (``time_steps``' rows, after its steps)."""
    lag = parallel.put(np.where(live, MAX_DRAFT_LAG, 0).astype(np.int32),
                       runner.state.draft_lag.sharding)
    for calls in (1, repeats):  # the first call warms the executable up
        jax.block_until_ready(runner.state.draft_lag)
        t0 = time.perf_counter()
        for _ in range(calls):  # (the catch-up donates the lag it is given)
            runner.state = runner.state._replace(draft_lag=jnp.copy(lag))
            runner.catch_up(bucket)
        jax.block_until_ready(runner.state.draft_hidden)
    return (time.perf_counter() - t0) / repeats


def adaptive_policy(runner: ModelRunner, repeats: int = 8,
                    context: int = 256) -> AdaptiveDraftLength:
    """The adaptive draft-length policy over the runner's draft lengths, its table of
    step times measured now."""
    seconds = time_steps(runner, repeats, context)
    menu = runner.menu
    logger.info("engine: adaptive draft length over %s; step ms by bucket: %s",
                menu.draft_lengths, "; ".join(
                    f"{b}: " + ", ".join(f"{seconds[b, s] * 1e3:.2f}"
                                         for s in menu.draft_lengths)
                    for b in menu.batch_buckets))
    return AdaptiveDraftLength(menu.draft_lengths, seconds)


class CycleTimer:
    """Gives the draft policy the time since the last collected step: the cycle of the
    step just collected (its device time when the device is the bottleneck, the host's
    work between steps when not). Cycles that also ran a prompt chunk or the draft's
    catch-up, or follow one that collected nothing, are not a step's time."""

    def __init__(self):
        self._last_collect: float | None = None  # perf_counter() at the last collect

    def observe(self, policy, plan: StepPlan | None, ran_prefill: bool) -> None:
        now = time.perf_counter()
        if plan is not None and self._last_collect is not None and not ran_prefill:
            if plan.timed:
                policy.observe_time(plan.key.batch, plan.key.draft_length,
                                    now - self._last_collect)
        self._last_collect = now if plan is not None else None
