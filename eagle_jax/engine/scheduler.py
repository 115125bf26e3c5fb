"""The host scheduler: the queue, the slots, aborts, admission, preemption, and the plans.

One direction per step: the scheduler plans (a ``PrefillPlan`` for prompt chunks run
alone, a ``StepPlan`` for a decode step and the chunks riding in it), the runner
dispatches the plan, and the scheduler turns the plan's host output into
``RequestOutput``s through the output processor. It never touches device arrays, and it
is the only writer of a request's bookkeeping (slot, length, steps in flight, draft lag).

Between steps, waiting requests join free slots when the pool has pages for them (the
full pages of a prefix an earlier request computed shared from the prefix cache),
finished and aborted requests leave and return their pages. A joined request's remaining
prompt is prefilled in chunks, at most ``max_num_batched_tokens`` positions per engine
step less the running requests' decode rows, so a long prompt does not stall the
requests already decoding: the next chunks of up to ``max_num_partial_prefills``
requests in prefill ride in the decode step itself (extra rows of its forward, so the
weights are read once for all), or, when nothing decodes, run together as a prefill of
their own. Before each step every running request is given the pages the step may
write; when the pool runs out, the newest running request is preempted: its pages are
freed and it goes back to the front of the queue, to be recomputed from its prompt and
the tokens it already produced (nothing it streamed is repeated).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import numpy as np

from eagle_jax.engine.buckets import (
    BucketMenu, ExecutableKey, PrefillKey, StepKey, chunk_shape)
from eagle_jax.engine.kv_cache_manager import KVCacheManager, PageClaim
from eagle_jax.engine.output_processor import OutputProcessor, token_logprobs
from eagle_jax.engine.plans import FirstToken, PrefillPlan, StepPlan
from eagle_jax.engine.request import Request, threefry_key
from eagle_jax.engine.slot_changes import SlotChanges
from eagle_jax.engine.state import MAX_DRAFT_LAG, PrefillChunks, PrefillOutput, SlotUpdates
from eagle_jax.engine.types import RequestOutput, SchedulerStats
from eagle_jax.sampling import SamplingRows

logger = logging.getLogger("eagle_jax.engine")

class Scheduler:
    def __init__(self, *, menu: BucketMenu, kv: KVCacheManager, processor: OutputProcessor,
                 draft_policy, num_slots: int, step_tokens: int, has_draft_lag: bool,
                 seed: int | None,
                 available: Callable[[ExecutableKey], bool] = lambda key: True):
        """``available(key)``: whether the executable of ``key`` can run without waiting
        for a compile (``ExecutableCache.available``). While executables compile in the
        background the plans use available ones only where one can serve (a larger
        batch bucket, another prefill shape, no chunks riding in a step); once all
        are, every plan is what the menu alone would choose."""
        self.menu, self.kv, self.processor = menu, kv, processor
        self.available = available
        self.draft_policy = draft_policy
        self.num_slots, self.step_tokens = num_slots, step_tokens
        self.has_draft_lag = has_draft_lag  # steps of length 0 leave the draft behind
        self.slots: list[Request | None] = [None] * num_slots
        self.slot_changes = SlotChanges(num_slots)
        self._waiting: collections.deque[Request] = collections.deque()
        self._requests: dict[str, Request] = {}
        self._aborted: set[str] = set()
        self._rng = np.random.default_rng(seed)
        self._num_admitted = 0
        self.num_preemptions = 0
        self.num_prefill_runs = 0  # prompt chunks prefilled by executables of their own

    # ---------------------------------------------------------------- requests
    def add(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self._aborted.add(request_id)

    def knows(self, request_id: str) -> bool:
        """Whether a request of this id is waiting or running."""
        return request_id in self._requests

    def has_requests(self) -> bool:
        return bool(self._requests)

    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def slot_of(self, request_id: str) -> int | None:
        """The slot a request holds, None while it waits (or is unknown)."""
        req = self._requests.get(request_id)
        return req.slot if req is not None and req.slot >= 0 else None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.num_running(), num_waiting=self.num_waiting(),
                              kv_cache_usage=self.kv.usage,
                              num_preemptions=self.num_preemptions,
                              prefix_cache_queries=self.kv.prefix_cache_queries,
                              prefix_cache_hits=self.kv.prefix_cache_hits)

    def process_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self._aborted):
            req = self._requests.get(rid)
            self._aborted.discard(rid)
            if req is None:
                continue
            if req.slot < 0:
                self._waiting.remove(req)
            self.processor.finish(req, "abort", None)
            self._retire(req)
            outputs.append(self.processor.output(req, [], []))
        return outputs

    def _retire(self, req: Request) -> None:
        """A finished request leaves: its slot and pages returned, its record dropped."""
        self._release_slot(req)
        self._requests.pop(req.request_id, None)

    def _release_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self.slots[req.slot] = None
            self.kv.free(req)
            self.slot_changes.release(req.slot)

    # ---------------------------------------------------------------- prefill
    def prefill_budget(self) -> tuple[int, bool]:
        """(positions of prompt chunks this step may run: max_num_batched_tokens less the
        running requests' decode rows, at least one smallest chunk; whether any request
        decodes, so the chunks ride in its step)."""
        decoding = sum(r is not None and not r.in_prefill for r in self.slots)
        budget = max(self.menu.max_num_batched_tokens - decoding * self.menu.verify_width,
                     self.menu.prefill_buckets[0])
        return budget, bool(decoding)

    def prefill_candidates(self, budget: int) -> list[Request]:
        """The requests whose next chunks the next forward carries, in the order they are
        served: those in prefill, oldest first, then waiting requests admitted one by one
        while their positions to prefill stay under ``budget``, at most
        max_num_partial_prefills in all. A waiting request whose next page not in the
        cache is a page a candidate is about to compute, and would be a hit once
        computed, waits (admitted after that chunk ran, it shares the page rather than
        computing it again), so requests that arrive together share the pages of their
        common prefix. With a draft, a page whose next token differs is no hit: requests
        whose prompts part inside the page after a cached prefix do not wait for each
        other."""
        most = self.menu.max_num_partial_prefills
        page = self.kv.page_size
        reqs = sorted((r for r in self.slots if r is not None and r.in_prefill),
                      key=lambda r: r.admitted)[:most]
        wanted = sum(r.prefill_len - r.seq_len for r in reqs)
        computing = {claim for r in reqs for claim in self.kv.claims(r, r.seq_len // page)}
        while len(reqs) < most and wanted < budget and (
                req := self._admit(computing)) is not None:
            reqs.append(req)
            wanted += req.prefill_len - req.seq_len
            computing.update(self.kv.claims(req, req.seq_len // page))
        return reqs

    def _admit(self, computing: set[PageClaim]) -> Request | None:
        """Gives the oldest waiting request a slot and the pages of its known tokens
        (``KVCacheManager.allocate_prompt``), if a slot is free and the pool has them;
        else None (it waits)."""
        if not self._waiting or None not in self.slots:
            return None
        req = self._waiting[0]
        slot = self.slots.index(None)
        cached = self.kv.allocate_prompt(req, slot, computing)
        if cached is None:
            return None
        self._waiting.popleft()
        if not req.output:
            req.num_cached_tokens = cached
        req.slot, req.seq_len, req.in_flight, req.in_prefill = slot, cached, 0, True
        req.admitted = self._num_admitted = self._num_admitted + 1
        self.slots[slot] = req
        if req.seed is None:
            req.seed = req.params.seed if req.params.seed is not None else int(
                self._rng.integers(0, 2**31 - 1))
        # A resumed request draws from a fresh stream, not the one it began with.
        key = threefry_key(req.seed + (req.preemptions << 32))
        self.slot_changes.assign(slot, SamplingRows.from_params(req.params), key)
        return req

    def plan_prefill(self, budget: int) -> PrefillPlan | None:
        """The next chunks of the prefill candidates in one prefill of their own,
        ``budget`` positions at most; None when no request has a chunk to run."""
        reqs = self.prefill_candidates(budget)
        if not reqs:
            return None
        with_logprobs = any(r.params.logprobs is not None for r in reqs)
        shapes = self.menu.prefill_shapes()
        # (None available: a logprobs variant still compiling, which the prefill waits for.)
        shapes = [s for s in shapes if self.available(PrefillKey(*s, with_logprobs))] or shapes
        chunks, firsts = self._pack_chunks(reqs, shapes, budget)
        self.num_prefill_runs += 1
        return PrefillPlan(chunks, self.slot_changes.take(), with_logprobs, firsts,
                           int(chunks.length.sum()))

    def can_carry_chunks(self) -> bool:
        """Whether a decode step can carry prompt chunks now: a step of the largest
        bucket with lanes is available (else the chunks run as prefills of their own)."""
        batch = self.menu.batch_buckets[-1]
        return any(self.available(StepKey(batch, False, n, self.menu.num_steps))
                   for n in self.menu.step_lane_counts(batch))

    def _pack_chunks(self, reqs: list[Request], shapes: list[tuple[int, int]],
                     budget: int | None, split: bool = False
                     ) -> tuple[PrefillChunks, tuple[FirstToken, ...]]:
        """The next chunks of ``reqs`` in the shape among ``shapes`` that runs the most of
        them (``chunk_shape``), within ``budget`` positions (a step's lanes: all of
        them), and the chunks that sample a new request's first token."""
        cap = self.menu.chunk_len if split else budget
        num, size = chunk_shape(shapes, [min(r.prefill_len - r.seq_len, cap) for r in reqs],
                                split)
        chunks = self._take_chunks(reqs, num, size, num * size if split else budget, split)
        by_slot = {r.slot: r for r in reqs}
        return chunks, tuple((i, by_slot[slot]) for i, slot in enumerate(chunks.slot.tolist())
                             if chunks.sample_next[i])

    def _take_chunks(self, reqs: list[Request], num: int, size: int, budget: int,
                     split: bool) -> PrefillChunks:
        """The next chunk of each of ``reqs`` in turn, ``budget`` positions in all, as
        ``num`` chunks of ``size`` positions (padding chunks after them): a request's
        chunk is one of them, or with ``split`` up to chunk_len positions over as many
        consecutive ones as it needs (its last names the slot; the others write no slot
        state). Advances each request's prefilled length; a request's last chunk ends
        its prefill."""
        chunks = PrefillChunks.padding(num, size, self.num_slots,
                                       self.kv.allocator.max_pages_per_owner)
        i = 0
        for req in reqs:
            tokens, known, start = req.known_tokens(), req.prefill_len, req.seq_len
            total = min(known - start, budget, (num - i) * size if split else size,
                        self.menu.chunk_len if split else size)
            if total <= 0 or i >= num:
                break
            budget -= total
            page_row = self.kv.page_row(req.slot)
            draft_copy = self.kv.draft_copy(req.slot)
            self.kv.features_written(req.slot, start, start + total)
            for first in range(start, start + total, size):
                end = min(first + size, start + total)
                chunks.start[i], chunks.length[i] = first, end - first
                chunks.page_row[i] = page_row
                chunks.draft_col[i], chunks.draft_page[i] = draft_copy
                chunks.tokens[i, :end - first] = tokens[first:end]
                # The known token after the chunk (a new request's first token is sampled).
                chunks.next_token[i] = tokens[end] if end < len(tokens) else 0
                i += 1
            is_last = start + total == known
            chunks.slot[i - 1] = req.slot
            chunks.is_last[i - 1] = is_last
            chunks.sample_next[i - 1] = is_last and req.samples_first_token
            req.seq_len += total
            req.in_prefill = not is_last
            self.kv.cache_pages(req)
        return chunks

    def commit_first_tokens(self, firsts, out: PrefillOutput) -> list[RequestOutput]:
        """Commits the first tokens that new requests' last prefill chunks sampled (chunk
        i's in ``out``'s row i, host arrays; ``out.logprob`` read only for requests that
        asked for logprobs)."""
        now = time.monotonic()
        outputs = []
        for i, req in firsts:
            token, logprobs = int(out.token[i]), None
            if req.params.logprobs is not None:
                logprobs = token_logprobs([token], out.logprob[i:i + 1], out.top_ids[i:i + 1],
                                          out.top_logprobs[i:i + 1], req.params.logprobs)
            req.first_token_time = now
            outputs.append(self._commit(req, [token], logprobs))
        return outputs

    def _commit(self, req: Request, tokens: list[int], logprobs) -> RequestOutput:
        if req.first_token_time is None:  # (a constrained request's, from its first step)
            req.first_token_time = time.monotonic()
        output = self.processor.commit(req, tokens, logprobs)
        if req.finished:
            self._retire(req)
        else:
            self.kv.cache_pages(req)  # the pages its tokens completed
        return output

    # ---------------------------------------------------------------- decode
    def plan_step(self, carried: list[Request]) -> StepPlan | None:
        """The step of the smallest bucket covering every running request, with the next
        prompt chunks of ``carried`` (requests in prefill, in the order they are served)
        riding in it, as many as the step's chunk shape takes; None when nothing
        decodes."""
        occupied = self._reserve_step_pages(
            {i: r for i, r in enumerate(self.slots) if r is not None and not r.in_prefill})
        if not occupied:
            return None
        slot_updates = self.slot_changes.take() if self.slot_changes else None
        carried = [r for r in carried if r.in_prefill and r.slot >= 0]  # (not preempted)
        # (A carried chunk's first token takes its logprobs from this step too.)
        with_logprobs = any(r.params.logprobs is not None
                            for r in (*occupied.values(), *carried))
        batch, lane_shapes = self._step_bucket(max(occupied), with_logprobs, bool(carried))
        # A step carrying chunks drafts num_steps (their rows are verify_width wide).
        length = self.menu.num_steps if carried else self.draft_policy.choose(batch)
        catch_up = self._catch_up_draft(occupied, length)
        page_updates = self.kv.page_updates()
        chunks, firsts = None, ()
        if carried:
            chunks, firsts = self._pack_chunks(carried, lane_shapes, None, split=True)
        behind = length == 0 and self.has_draft_lag  # (a draft to leave behind)
        for req in occupied.values():
            req.in_flight += 1
            req.draft_lag += behind
        # Rows under a grammar run the step's constrained variant (``StepKey.constrained``).
        grammars = {slot: req.grammar for slot, req in occupied.items() if req.grammar}
        return StepPlan(
            StepKey(batch, with_logprobs, 0 if chunks is None else len(chunks.slot), length,
                    bool(grammars)),
            slot_updates, catch_up, page_updates, chunks,
            {slot: (req, req.preemptions) for slot, req in occupied.items()},
            tuple((i, req, req.preemptions) for i, req in firsts), grammars)

    def _step_bucket(self, max_slot: int, with_logprobs: bool, carrying: bool
                     ) -> tuple[int, list[tuple[int, int]]]:
        """(the smallest batch bucket whose rows include ``max_slot`` and that has an
        available step: of one of the draft policy's lengths, or ``carrying`` chunks, of
        a lane count; the (lanes, positions) shapes available to it). When none has (a
        logprobs variant still compiling), the smallest bucket, whose compile the step
        waits for."""
        menu = self.menu
        for batch in menu.batch_buckets:
            if batch <= max_slot:
                continue
            if carrying:
                shapes = [(n, size) for n, size in menu.step_lane_shapes(batch) if
                          self.available(StepKey(batch, with_logprobs, n, menu.num_steps))]
                if shapes:
                    return batch, shapes
            elif any(self.available(StepKey(batch, with_logprobs, 0, s))
                     for s in self.draft_policy.lengths):
                return batch, []
        batch = menu.batch_for(max_slot)
        return batch, menu.step_lane_shapes(batch) if carrying else []

    def _reserve_step_pages(self, occupied: dict[int, Request]) -> dict[int, Request]:
        """Gives every running request the pages the next step may write: positions up
        to its length plus one step's tokens for each step in flight and this one.
        When the pool runs out, preempts the newest running request and tries again.
        Returns the requests still running."""
        for req in sorted(occupied.values(), key=lambda r: r.admitted):
            while req.slot >= 0 and not self.kv.reserve(
                    req, req.seq_len + (req.in_flight + 1) * self.step_tokens):
                self._preempt(max((r for r in self.slots if r is not None),
                                  key=lambda r: r.admitted))
        return {slot: req for slot, req in occupied.items() if req.slot == slot}

    def _preempt(self, req: Request) -> None:
        """Frees the request's pages and slot; it goes back to the front of the queue, to
        be recomputed from its prompt and generated tokens. Its steps in flight are
        dropped when collected."""
        logger.info("KV pool full: preempting request %s (%d tokens)", req.request_id,
                    req.seq_len)
        self._release_slot(req)
        req.slot, req.in_flight, req.in_prefill, req.draft_lag = -1, 0, False, 0
        req.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    def _catch_up_draft(self, occupied: dict[int, Request], length: int) -> bool:
        """Whether the draft's catch-up over the positions steps of length 0 skipped runs
        before this step: before a step that drafts, or a step of length 0 that would put
        a row's draft more than MAX_DRAFT_LAG positions behind."""
        if not self.has_draft_lag:
            return False
        lags = [r.draft_lag for r in occupied.values()]
        if not any(lags) or (length == 0 and max(lags) < MAX_DRAFT_LAG):
            return False
        for req in occupied.values():
            req.draft_lag = 0
        return True

    def update_from_output(self, plan: StepPlan, out) -> tuple[list[RequestOutput],
                                                                dict[int, str]]:
        """Commits a step's tokens (``out``: the host StepOutput) and the first tokens of
        the requests whose last prompt chunks it carried. Returns the outputs and the
        step's live rows (slot -> request id): the requests neither finished nor
        preempted since the step was dispatched."""
        outputs = self.commit_first_tokens(
            [(i, req) for i, req, preemptions in plan.firsts
             if req.preemptions == preemptions and not req.finished], out.prefill)
        live = {}
        for slot, (req, preemptions) in plan.rows.items():
            if req.preemptions != preemptions:
                continue  # preempted after dispatch: recomputed on readmission
            req.in_flight -= 1
            if not req.finished:
                live[slot] = req
        tokens, num_tokens = out.tokens.tolist(), out.num_tokens.tolist()
        for slot, req in live.items():
            n = num_tokens[slot]
            self.kv.features_written(slot, req.seq_len, req.seq_len + n)
            req.seq_len += n
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = token_logprobs(tokens[slot][:n], out.logprob[slot, :n],
                                          out.top_ids[slot, :n], out.top_logprobs[slot, :n],
                                          req.params.logprobs)
            outputs.append(self._commit(req, tokens[slot][:n], logprobs))
        return outputs, {slot: req.request_id for slot, req in live.items()}
