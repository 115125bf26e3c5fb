"""The engine loop in its own thread, bridged to asyncio.

``Engine`` methods are not thread-safe, so one thread owns the engine and calls every
one of its methods. The event loop talks to it through a thread-safe inbox of commands
(add a request, abort one, compute prompt logprobs) that the engine thread drains before
each ``engine.step()``. Step outputs go back to per-request ``asyncio.Queue``s through
``loop.call_soon_threadsafe``. When nothing is queued and no request is unfinished, the
engine thread sleeps on a condition variable (no busy loop).

An exception inside ``engine.step()`` is logged with its traceback; every in-flight
request fails with ``RequestFailedError`` (the server answers 500) and is aborted in
the engine; the loop keeps serving new requests.

An HTTP request becomes several engine requests, its ``Choice``s: ``n`` samples of each
prompt, indexed prompt-major (prompt ``p``, sample ``i`` -> ``p * n + i``) as vLLM does.
They start together (``AsyncEngine.start_choices``: all or none), their outputs arrive
through one fan-in (``merge``) or run to completion (``collect``), and when the client
disconnects or anything fails they are aborted together (``abort_all``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from ..engine.protocol import EngineClient
from ..engine.types import RequestOutput, SpecDecodeStats, TokenLogprob
from ..sampling import SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger("eagle_jax.server")


class RequestFailedError(RuntimeError):
    """The engine failed while the request was in flight (HTTP 500)."""


class QueueFullError(RuntimeError):
    """All slots are busy and the waiting queue is full (HTTP 503)."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running."""


@dataclasses.dataclass
class _Tracker:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    num_output_tokens: int = 0

    def push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class RequestStream:
    """Async iterator over a request's ``RequestOutput``s; ends after the finished one."""

    def __init__(self, async_engine: "AsyncEngine", tracker: _Tracker):
        self._engine = async_engine
        self._tracker = tracker
        self.request_id = tracker.request_id
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._tracker.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Aborts the request unless it already finished (idempotent, non-blocking)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Owns an ``Engine`` and runs its loop in a daemon thread."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics | None = None,
        *,
        log_interval: float = 10.0,
        max_queue_len: int = 1024,
    ):
        self.engine = engine
        self.metrics = metrics
        self.log_interval = float(log_interval)
        self.max_queue_len = int(max_queue_len)
        # Slots: the engine may hold fewer than config.max_num_seqs (KV memory budget).
        self.max_num_seqs = engine.num_slots
        self._cond = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._trackers: dict[str, _Tracker] = {}  # engine thread only
        # Snapshots for the event loop (written by the engine thread, read anywhere).
        self.num_running = 0
        self.num_waiting = 0
        self._pending_adds = 0  # guarded by _cond
        self.last_error: BaseException | None = None
        # Periodic log state (engine thread only).
        self._log_t0 = time.monotonic()
        self._log_tokens = 0
        self._log_stats = None
        self._idle = True

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="eagle-jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------ event-loop side API
    def _submit(self, fn: Callable[[], None], *, is_add: bool = False) -> None:
        with self._cond:
            if self._stop or self._thread is None:
                raise EngineStoppedError("the engine loop is not running")
            self._inbox.append(fn)
            if is_add:
                self._pending_adds += 1
            self._cond.notify()

    async def run_in_engine(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``fn(*args, **kwargs)`` on the engine thread and returns its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def _set(f, ok, value):
            if not f.done():
                if ok:
                    f.set_result(value)
                else:
                    f.set_exception(value)

        def cmd():
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # delivered to the awaiting coroutine
                loop.call_soon_threadsafe(_set, fut, False, e)
            else:
                loop.call_soon_threadsafe(_set, fut, True, result)

        self._submit(cmd)
        return await fut

    def queue_is_full(self, new_requests: int = 1) -> bool:
        """True when every slot is busy and the waiting queue holds max_queue_len requests."""
        with self._cond:
            pending = self._pending_adds
        in_engine = self.num_running + self.num_waiting + pending
        return in_engine + new_requests > self.max_num_seqs + self.max_queue_len

    async def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Adds a request; returns once the engine accepted it.

        Raises ValueError (the engine's validation message) or EngineStoppedError.
        """
        loop = asyncio.get_running_loop()
        tracker = _Tracker(
            request_id=request_id,
            loop=loop,
            queue=asyncio.Queue(),
            arrival=time.monotonic(),
            num_prompt_tokens=len(prompt_token_ids),
        )
        fut = loop.create_future()

        def _set(ok, value):
            if not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)

        def cmd():
            with self._cond:
                self._pending_adds -= 1
            try:
                if request_id in self._trackers:
                    raise ValueError(f"duplicate request id {request_id!r}")
                self.engine.add_request(request_id, list(prompt_token_ids), params)
            except BaseException as e:
                loop.call_soon_threadsafe(_set, False, e)
                return
            self._trackers[request_id] = tracker
            if self.metrics is not None:
                self.metrics.add_prompt_tokens(len(prompt_token_ids))
            self._refresh_queue_sizes()
            loop.call_soon_threadsafe(_set, True, None)

        self._submit(cmd, is_add=True)
        try:
            await fut
        except asyncio.CancelledError:
            # The caller went away while the add was in flight: abort it if it landed.
            self.abort(request_id)
            raise
        return RequestStream(self, tracker)

    async def start_choices(self, request_id: str, choices: list[Choice]) -> None:
        """Adds every choice as request ``{request_id}-{index}``, all or none.

        Raises QueueFullError when they do not fit, and what ``add_request`` raises
        (ValueError, EngineStoppedError) after aborting the choices already added.
        """
        if self.queue_is_full(len(choices)):
            raise QueueFullError("the server is overloaded: all slots are busy and the "
                                 "waiting queue is full; retry later")
        try:
            for c in choices:
                c.stream = await self.add_request(f"{request_id}-{c.index}", c.prompt_ids,
                                                  c.params)
        except BaseException:
            abort_all(choices)
            raise

    def abort(self, request_id: str) -> None:
        """Aborts a request (non-blocking; unknown or finished ids are ignored)."""

        def cmd():
            tracker = self._trackers.pop(request_id, None)
            if tracker is None:
                return
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort_request(%s) failed", request_id)
            self._finish_metrics(tracker, "abort", time.monotonic())
            tracker.push(
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finished=True,
                    finish_reason="abort",
                    num_prompt_tokens=tracker.num_prompt_tokens,
                    num_output_tokens=tracker.num_output_tokens,
                )
            )

        try:
            self._submit(cmd)
        except EngineStoppedError:
            pass

    # ---------------------------------------------------------- engine thread
    def _refresh_queue_sizes(self) -> None:
        try:
            stats = self.engine.scheduler_stats()
        except Exception:
            logger.exception("reading the engine's scheduler stats failed")
            return
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting
        if self.metrics is not None:
            self.metrics.update_scheduler(stats)

    def _finish_metrics(self, tracker: _Tracker, reason: str, now: float) -> None:
        if self.metrics is None:
            return
        ttft = None if tracker.first_token_time is None else tracker.first_token_time - tracker.arrival
        self.metrics.observe_finished(reason, now - tracker.arrival, ttft, tracker.num_output_tokens)

    def _run(self) -> None:
        busy = False
        consecutive_errors = 0
        while True:
            with self._cond:
                while not self._inbox and not self._stop and not busy:
                    self._cond.wait()
                if self._stop:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            for cmd in commands:
                try:
                    cmd()
                except Exception:  # commands deliver their own errors; never die here
                    logger.exception("engine command failed")
            try:
                busy = bool(self.engine.has_unfinished_requests())
            except Exception:
                logger.exception("has_unfinished_requests() failed")
                busy = False
            if not busy:
                self._refresh_queue_sizes()
                continue
            t0 = time.monotonic()
            if self._idle:
                self._idle = False
                self._log_t0, self._log_tokens = t0, 0
            try:
                outputs = self.engine.step()
            except Exception as e:
                consecutive_errors += 1
                self.last_error = e
                logger.exception("engine step failed; failing %d in-flight request(s)",
                                 len(self._trackers))
                self._fail_all(e)
                # Back off so that an engine that fails every step does not spin.
                time.sleep(min(0.01 * 2 ** min(consecutive_errors, 7), 1.0))
                self._refresh_queue_sizes()
                try:
                    busy = bool(self.engine.has_unfinished_requests())
                except Exception:
                    busy = False
                continue
            consecutive_errors = 0
            self._dispatch(outputs, t0)
            self._refresh_queue_sizes()
            if self.metrics is not None:
                try:
                    self.metrics.update_spec_decode(self.engine.stats)
                except Exception:
                    logger.exception("reading engine.stats failed")
            self._maybe_log()
            if not self._trackers:
                try:
                    self._idle = not self.engine.has_unfinished_requests()
                except Exception:
                    self._idle = True
        # Shutdown: whoever still waits gets an error.
        self._fail_all(EngineStoppedError("the server is shutting down"), abort=False)

    def _fail_all(self, error: BaseException, abort: bool = True) -> None:
        trackers = list(self._trackers.values())
        self._trackers.clear()
        for tracker in trackers:
            if abort:
                try:
                    self.engine.abort_request(tracker.request_id)
                except Exception:
                    logger.exception("abort_request(%s) failed", tracker.request_id)
            tracker.push(RequestFailedError(f"engine error: {type(error).__name__}: {error}"))

    def _dispatch(self, outputs: list[RequestOutput], t0: float) -> None:
        now = time.monotonic()
        for out in outputs:
            tracker = self._trackers.get(out.request_id)
            if tracker is None:  # aborted or failed meanwhile
                continue
            n_new = len(out.new_token_ids)
            tracker.num_output_tokens += n_new
            self._log_tokens += n_new
            if self.metrics is not None:
                self.metrics.add_generation_tokens(n_new)
            if tracker.first_token_time is None and (n_new or out.finished):
                tracker.first_token_time = now
                if self.metrics is not None:
                    self.metrics.observe_first_token(now - tracker.arrival, t0 - tracker.arrival)
            if out.finished:
                del self._trackers[out.request_id]
                self._finish_metrics(tracker, out.finish_reason or "stop", now)
            tracker.push(out)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._log_t0
        if self.log_interval <= 0 or elapsed < self.log_interval:
            return
        stats = self.engine.stats
        interval = stats.since(self._log_stats or SpecDecodeStats())
        policy = ""
        mean_len = interval.mean_accept_length
        per_pos_s = ", ".join(f"{a / d:.3f}" if d else "0" for a, d in
                              zip(interval.accepted_per_pos, interval.drafted_per_pos))
        if interval.forecast_seconds > 0:
            lengths = " ".join(f"{s}:{n}" for s, n in
                               enumerate(interval.draft_length_steps) if n)
            policy = (f", steps per draft length: {lengths}, goodput forecast: "
                      f"{interval.forecast_goodput:.1f} tokens/s")
        self._log_stats = copy.deepcopy(stats)
        logger.info(
            "running: %d, waiting: %d, generation throughput: %.1f tokens/s, "
            "mean accept length: %.3f, per-position acceptance: [%s]%s",
            self.num_running,
            self.num_waiting,
            self._log_tokens / elapsed,
            mean_len,
            per_pos_s,
            policy,
        )
        self._log_t0 = now
        self._log_tokens = 0


# ------------------------------------------------------------------- choices
class Choice:
    """One engine request of an HTTP request: a sample of prompt ``prompt_index``, choice
    ``index`` of the response. Accumulates its outputs as they arrive."""

    def __init__(self, index: int, prompt_index: int, prompt_ids: list[int],
                 params: SamplingParams | None):
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream: RequestStream | None = None  # set once the engine took it
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served

    def absorb(self, out: RequestOutput) -> None:
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids.extend(out.new_token_ids)
        self.text += out.new_text
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def fan_out(prompts: Sequence[list[int]], n: int,
            params: Callable[[int, int], SamplingParams | None]) -> list[Choice]:
    """``n`` choices per prompt in prompt-major order; ``params(prompt_index,
    sample_index)`` gives each its sampling parameters."""
    return [Choice(p * n + i, p, ids, params(p, i))
            for p, ids in enumerate(prompts) for i in range(n)]


def abort_all(choices: Sequence[Choice]) -> None:
    """Aborts every started choice (finished ones are left alone)."""
    for c in choices:
        if c.stream is not None:
            c.stream.abort()


async def merge(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Yields ``(choice, output)`` from every started choice as outputs arrive: each output
    is absorbed into its choice, and yielded when it carries a token, text or the finish.
    An engine failure is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        try:
            async for out in c.stream:
                await queue.put((c, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((c, e))
            return
        await queue.put((c, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices if c.stream is not None]
    remaining = len(tasks)
    try:
        while remaining:
            c, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            c.absorb(item)
            if item.new_token_ids or item.new_text or item.finished:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()


async def collect(choices: Sequence[Choice],
                  is_disconnected: Callable[[], Awaitable[bool]]) -> bool:
    """Runs every started choice to completion. Polls ``is_disconnected`` meanwhile: if the
    client went away, aborts them all and returns False. On an engine failure aborts them
    all and raises it."""

    async def consume(c: Choice):
        async for out in c.stream:
            c.absorb(out)

    tasks = [asyncio.ensure_future(consume(c)) for c in choices if c.stream is not None]

    async def watch():
        while True:
            await asyncio.sleep(0.1)
            if await is_disconnected():
                return

    watcher = asyncio.ensure_future(watch())
    try:
        gathered = asyncio.gather(*tasks)
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:  # the client went away
            abort_all(choices)
            gathered.cancel()
            with contextlib.suppress(BaseException):
                await gathered
            return False
        gathered.result()
        return True
    except BaseException:
        abort_all(choices)
        for t in tasks:
            t.cancel()
        raise
    finally:
        watcher.cancel()
