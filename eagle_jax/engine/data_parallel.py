"""Data parallelism: M engine replicas behind one server, each over its own devices.

Replica i is an ``Engine`` over local devices [i N, (i + 1) N) for tensor-parallel size
N (``parallel.device_groups``): a mesh of its own at N > 1, one committed device at
N = 1. ``DataParallelEngine`` is an ``EngineClient`` (``engine/protocol.py``), the
interface the server drives: a request goes to the replica with the fewest unfinished
(running + waiting) requests, ties to the lowest index, and stays there (its id
remembers the replica, so an abort reaches it); ``step()`` steps every replica with
work.

The replicas are stepped one after another in the calling thread. That already overlaps
their devices: ``Engine.step`` dispatches its device work before it reads the previous
step's tokens (async scheduling), so while replica 1's host bookkeeping runs, replica
0's step is running on its devices. A thread per replica (to overlap the host work too)
is a possible later improvement, to be decided by measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from eagle_jax import parallel
from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.engine import Engine
from eagle_jax.engine.protocol import EngineFront
from eagle_jax.engine.types import (
    CompileProgress, RequestOutput, SchedulerStats, SpecDecodeStats, StepEvent, TokenLogprob)
from eagle_jax.sampling import SamplingParams


def make_engine(config: EngineConfig, *, tokenizer=None,
                **kwargs) -> Engine | DataParallelEngine:
    """The engine ``config`` asks for: a plain ``Engine`` at data_parallel_size 1 (the
    keyword arguments passed on), else a ``DataParallelEngine`` of that many replicas
    (one ``tokenizer``, given or loaded once, for all). Raises ValueError naming the fix
    when the replicas need more devices than there are, or, with several processes
    (``multihost``), unless the config asks for one engine over every process's
    devices."""
    m = config.data_parallel_size
    if jax.process_count() > 1:  # one group over every process's devices, or an error
        parallel.global_device_group(m, config.tensor_parallel_size)
    if m == 1:
        return Engine(config, tokenizer=tokenizer, **kwargs)
    if kwargs:
        raise ValueError(f"{sorted(kwargs)}: a data-parallel engine loads its replicas "
                         f"from the config; pass them with data_parallel_size 1")
    groups = parallel.device_groups(m, config.tensor_parallel_size)
    one = dataclasses.replace(config, data_parallel_size=1)
    first = Engine(one, devices=groups[0], tokenizer=tokenizer)
    return DataParallelEngine([first] + [Engine(one, devices=g, tokenizer=first.tokenizer)
                                         for g in groups[1:]])


def least_loaded(loads: list[int]) -> int:
    """The index of the smallest load, the lowest index among equals."""
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class DataParallelEngine(EngineFront):
    """Replicas of one ``Engine`` config, driven as one engine (module docstring). Not
    thread-safe: drive it from one thread, as an ``Engine``. The model's attributes are
    the first replica's; ``config``, ``num_slots`` and the stats are the replicas'."""

    def __init__(self, replicas: list[Engine]):
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        self._config = dataclasses.replace(self.primary.config,
                                           data_parallel_size=len(self.replicas))
        self._owner: dict[str, int] = {}  # request id -> its replica's index

    @property
    def primary(self) -> Engine:
        return self.replicas[0]

    @property
    def config(self) -> EngineConfig:
        """The replicas' config, with ``data_parallel_size`` their number."""
        return self._config

    @property
    def num_slots(self) -> int:
        """Every replica's slots (the server sizes its waiting queue from them)."""
        return sum(r.num_slots for r in self.replicas)

    # ---------------------------------------------------------------- requests
    def route(self) -> int:
        """The replica a new request goes to: the fewest unfinished requests."""
        return least_loaded([r.num_running() + r.num_waiting() for r in self.replicas])

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queues a request on the least-loaded replica (``Engine.add_request``'s
        errors); ids are unique across replicas."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        i = self.route()
        self.replicas[i].add_request(request_id, prompt_token_ids, params)
        self._owner[request_id] = i

    def replica_of(self, request_id: str) -> int | None:
        """The index of the replica holding an unfinished request (None if unknown)."""
        return self._owner.get(request_id)

    def abort_request(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def num_running(self) -> int:
        return sum(r.num_running() for r in self.replicas)

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Steps every replica that has work (each dispatches before it reads: see the
        module docstring); returns all their outputs."""
        outputs: list[RequestOutput] = []
        for r in self.replicas:
            if r.has_unfinished_requests():
                outputs.extend(r.step())
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)
        return outputs

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """``Engine.add_step_listener`` on every replica (each event is one replica's)."""
        for r in self.replicas:
            r.add_step_listener(listener)

    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[TokenLogprob | None]:
        """``Engine.prompt_logprobs`` on the least-loaded replica."""
        return self.replicas[self.route()].prompt_logprobs(prompt_token_ids, top_n)

    # ------------------------------------------------------------------- stats
    @property
    def stats(self) -> SpecDecodeStats:
        """The replicas' speculative-decoding counters summed (per-position and
        per-length histograms elementwise; ``num_steps`` counts every replica's steps)."""
        total = SpecDecodeStats()
        for r in self.replicas:
            for f in dataclasses.fields(SpecDecodeStats):
                a, b = getattr(total, f.name), getattr(r.stats, f.name)
                if isinstance(b, list):
                    n = max(len(a), len(b))
                    pad = lambda x: list(x) + [0] * (n - len(x))
                    setattr(total, f.name, [x + y for x, y in zip(pad(a), pad(b))])
                else:
                    setattr(total, f.name, a + b)
        return total

    @property
    def compile_progress(self) -> CompileProgress:
        """The replicas' counts summed."""
        return sum((r.compile_progress for r in self.replicas[1:]),
                   self.replicas[0].compile_progress)

    def scheduler_stats(self) -> SchedulerStats:
        """Counts summed over the replicas; KV usage their mean (the replicas' pools are
        equal, so the mean is the share of all their pages in use)."""
        each = [r.scheduler_stats() for r in self.replicas]
        total = lambda name: sum(getattr(s, name) for s in each)
        return SchedulerStats(
            num_running=total("num_running"), num_waiting=total("num_waiting"),
            kv_cache_usage=total("kv_cache_usage") / len(each),
            num_preemptions=total("num_preemptions"),
            prefix_cache_queries=total("prefix_cache_queries"),
            prefix_cache_hits=total("prefix_cache_hits"))
