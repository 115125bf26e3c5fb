"""Multi-host tensor parallelism: one engine over the devices of several processes.

``initialize`` starts ``jax.distributed`` (a coordinator address, the number of
processes and this process's id, from flags or the environment). ``jax.devices()`` is
then every process's devices and ``make_engine`` builds one tensor-parallel mesh over
all of them (``parallel.global_device_group``: the tensor-parallel size is the global
device count, e.g. 16 for 2 hosts x 8 GPUs; data parallelism across processes is not
supported). Each process holds its shards, and XLA's SPMD partitioner turns every step
into the same program on every process, with the collectives between them.

Such a program runs only when every process runs it, in the same order: SPMD is
multi-controller. So every process builds the same ``Engine`` and drives it identically
(lockstep). Process 0, the leader, serves: ``LockstepEngine`` is an ``EngineClient``
(``engine/protocol.py``), the interface the server drives, and before each ``step()``
(or ``prompt_logprobs``) it broadcasts a ``Command``: the requests added and aborted
since the last one, and the host inputs that differ between processes, which are the
draft policy's timings (the start-up table, and each step time the leader measured;
``LockstepPolicy``). The other processes run ``follow``: receive a command, apply it,
step, drop the outputs, until the leader's stop. Everything else the engine decides
from its inputs and from the step's outputs, which are replicated (every process reads
the same tokens), so the engines stay equal. The transport is jax's own:
``multihost_utils.broadcast_one_to_all`` (a collective over every device), first the
command's length, then its pickled bytes padded to a power of two (so that a few shapes
compile).

While the server is idle the followers wait inside that broadcast. An idle leader
sends an empty command every ``HEARTBEAT_SECONDS`` so that no collective waits for
longer (a backend may time out a collective that waits too long).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np

from eagle_jax.engine.engine import Engine
from eagle_jax.engine.protocol import EngineFront
from eagle_jax.engine.types import RequestOutput, SchedulerStats, StepEvent, TokenLogprob
from eagle_jax.sampling import SamplingParams

logger = logging.getLogger("eagle_jax.engine.multihost")

# The environment variables read when a flag is not given (jax itself reads the first).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

LEADER = 0  # the process that serves and broadcasts the commands
MIN_PAYLOAD_BYTES = 1024  # the smallest padded command: most commands fit
HEARTBEAT_SECONDS = 10.0


# ------------------------------------------------------------------- start-up
@dataclasses.dataclass(frozen=True)
class DistributedArgs:
    """Where the coordinator listens (host:port, on process 0's host), how many
    processes there are and which one this is."""

    coordinator_address: str
    num_processes: int
    process_id: int


def distributed_args(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None,
                     environ: Mapping[str, str] = os.environ) -> DistributedArgs | None:
    """The flags, each one missing taken from ``environ`` (``ENV_*``); None when none of
    the three is given anywhere (one process). Raises ValueError naming the fix when only
    some are given, or a number is not one."""
    given = {
        "--coordinator-address": coordinator_address or environ.get(ENV_COORDINATOR) or None,
        "--num-processes": num_processes if num_processes is not None else environ.get(
            ENV_NUM_PROCESSES) or None,
        "--process-id": process_id if process_id is not None else environ.get(
            ENV_PROCESS_ID) or None,
    }
    missing = [flag for flag, value in given.items() if value is None]
    if len(missing) == 3:
        return None
    if missing:
        raise ValueError(
            f"a multi-process run needs --coordinator-address, --num-processes and "
            f"--process-id (or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); "
            f"missing: {', '.join(missing)}")
    address, n, pid = given.values()
    try:
        n, pid = int(n), int(pid)
    except ValueError:
        raise ValueError(f"--num-processes {n!r} and --process-id {pid!r} must be integers")
    if n < 1:
        raise ValueError(f"--num-processes must be at least 1, got {n}")
    if not 0 <= pid < n:
        raise ValueError(f"--process-id {pid} is outside [0, {n}): number the processes "
                         f"0 .. {n - 1}, 0 on the coordinator's host")
    if ":" not in address:
        raise ValueError(f"--coordinator-address {address!r} needs a port: host:port of "
                         f"process 0's host, e.g. 10.0.0.1:1234")
    return DistributedArgs(address, n, pid)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Starts ``jax.distributed`` from the flags or the environment (``distributed_args``)
    before anything else touches jax's devices. Returns whether this is a multi-process
    run (False: no flags, or one process, and nothing started). On a CPU the processes'
    collectives go through gloo (jax's default ``jax_cpu_collectives_implementation``)."""
    args = distributed_args(coordinator_address, num_processes, process_id)
    if args is None or args.num_processes == 1:
        return False
    logger.info("jax.distributed: process %d of %d, coordinator %s", args.process_id,
                args.num_processes, args.coordinator_address)
    jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes,
                               process_id=args.process_id)
    return True


def is_leader() -> bool:
    return jax.process_index() == LEADER


def check_spans_processes(engine: Engine) -> None:
    """Raises ValueError, naming the fix, unless ``engine`` runs on every device of every
    process (a lockstep engine's program must involve every process)."""
    if sorted(d.id for d in engine.devices) != sorted(d.id for d in jax.devices()):
        raise ValueError(
            f"the engine runs on {len(engine.devices)} of the {len(jax.devices())} devices "
            f"of {jax.process_count()} processes; build it with tensor_parallel_size "
            f"{len(jax.devices())} (make_engine)")


# ------------------------------------------------------------------ commands
@dataclasses.dataclass
class Command:
    """What the leader did since its last command, for the followers to repeat.

    ops: ("add", request id, prompt token ids, SamplingParams), ("abort", request id)
      and ("prompt_logprobs", prompt token ids, top n), in the leader's order.
    step: whether to step after the ops.
    step_times: the leader's step-time observations since its last command, (bucket,
      draft length, seconds) each (``LockstepPolicy``).
    policy: the leader's draft policy (the first command: its start-up step times).
    stop: the leader is shutting down; the followers return.
    """

    ops: list[tuple] = dataclasses.field(default_factory=list)
    step: bool = False
    step_times: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    policy: object | None = None
    stop: bool = False


def padded_size(num_bytes: int) -> int:
    """The payload's length padded to a power of two, at least MIN_PAYLOAD_BYTES: every
    length of the broadcast is a compile, so few lengths."""
    return max(MIN_PAYLOAD_BYTES, 1 << max(num_bytes - 1, 0).bit_length())


def encode(command: Command) -> tuple[np.ndarray, int]:
    """[padded_size(n)] uint8, the pickled command zero padded, and n, its length."""
    data = pickle.dumps(command)
    out = np.zeros(padded_size(len(data)), np.uint8)
    out[:len(data)] = np.frombuffer(data, np.uint8)
    return out, len(data)


def decode(payload: np.ndarray, num_bytes: int) -> Command:
    """The command of ``encode``'s ``payload`` whose pickle is ``num_bytes`` long. The
    bytes come from the leader, a process of the same job: pickle is trusted as is."""
    return pickle.loads(np.asarray(payload, np.uint8)[:num_bytes].tobytes())


def broadcast(command: Command | None) -> Command:
    """The leader's ``command`` on every process (followers pass None): its length, then
    its padded bytes, each a ``broadcast_one_to_all``. Every process must call this, in
    the same order as every other collective."""
    from jax.experimental import multihost_utils

    payload, num_bytes = encode(command) if command is not None else (None, 0)
    header = np.array([num_bytes, 0 if payload is None else payload.size], np.int32)
    num_bytes, size = (int(x) for x in multihost_utils.broadcast_one_to_all(header))
    if payload is None:
        payload = np.zeros(size, np.uint8)
    return decode(multihost_utils.broadcast_one_to_all(payload), num_bytes)


# ------------------------------------------------------------- draft policy
class LockstepPolicy:
    """The engine's draft policy with the leader's step times on every process.

    A policy's choice follows measured step times (``draft_policy.AdaptiveDraftLength``),
    which differ between processes; every other input (the accept lengths) is a
    replicated step output. On the leader, the times it observes are also kept for the
    next command (``take_step_times``); on a follower its own are dropped and the
    leader's replayed (``replay``) before the step that the leader's next choice
    precedes, so both choose from the same numbers.
    """

    def __init__(self, policy, leader: bool):
        self.policy = policy
        self.leader = leader
        self._step_times: list[tuple[int, int, float]] = []

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.policy.lengths

    def choose(self, bucket: int) -> int:
        return self.policy.choose(bucket)

    def observe(self, length: int, accept_len: np.ndarray) -> None:
        self.policy.observe(length, accept_len)

    def observe_time(self, bucket: int, length: int, seconds: float) -> None:
        if self.leader:
            self._step_times.append((bucket, length, seconds))
            self.policy.observe_time(bucket, length, seconds)

    def predicted_tokens(self, length: int):
        return self.policy.predicted_tokens(length)

    @property
    def step_seconds(self):
        return self.policy.step_seconds

    def take_step_times(self) -> list[tuple[int, int, float]]:
        """The leader's observations since the last call."""
        times, self._step_times = self._step_times, []
        return times

    def replay(self, step_times: list[tuple[int, int, float]]) -> None:
        for bucket, length, seconds in step_times:
            self.policy.observe_time(bucket, length, seconds)


def apply_ops(engine: Engine, ops: list[tuple]) -> None:
    """Repeats the leader's ``Command.ops`` on ``engine`` (a follower's)."""
    for op, *args in ops:
        if op == "add":
            engine.add_request(*args)
        elif op == "abort":
            engine.abort_request(*args)
        elif op == "prompt_logprobs":
            try:
                engine.prompt_logprobs(*args)
            except ValueError:
                pass  # a bad prompt: the leader raised the same, to its client
        else:
            raise ValueError(f"unknown lockstep op {op!r}")


# ----------------------------------------------------------------- followers
def follow(engine: Engine) -> int:
    """A follower's side (any process but the leader): receives each command of the
    leader, applies it, steps when told, drops the outputs; returns at the leader's stop
    the number of steps run. The engine must be built as the leader's is."""
    check_spans_processes(engine)
    first = broadcast(None)
    policy = LockstepPolicy(first.policy, leader=False)
    engine.draft_policy = policy
    steps = 0
    while not (command := broadcast(None)).stop:
        apply_ops(engine, command.ops)
        policy.replay(command.step_times)
        if command.step:
            try:
                engine.step()
            except Exception:  # the leader's step raised as well; it goes on serving
                logger.exception("lockstep follower: step %d failed", steps)
            steps += 1
    return steps


# -------------------------------------------------------------------- leader
class LockstepEngine(EngineFront):
    """The leader's engine: an ``Engine`` whose every step the followers repeat (module
    docstring). Its model attributes and stats are the engine's. Thread-safe only as far
    as the heartbeat needs: drive it from one thread, as an ``Engine``.

    ``heartbeat_seconds``: an idle leader sends an empty command this often (None: never;
    tests that step without pauses).
    """

    def __init__(self, engine: Engine, heartbeat_seconds: float | None = HEARTBEAT_SECONDS):
        if not is_leader():
            raise ValueError(f"process {jax.process_index()} is a follower: run "
                             f"multihost.follow(engine); process {LEADER} leads")
        check_spans_processes(engine)
        self.engine = engine
        self.policy = LockstepPolicy(engine.draft_policy, leader=True)
        engine.draft_policy = self.policy
        self._ops: list[tuple] = []
        # One command at a time, each with the engine work it precedes: the followers
        # must see the collectives in the leader's order.
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = False
        self._send(Command(policy=self.policy.policy))
        self._heartbeat = None
        if heartbeat_seconds is not None:
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_seconds,),
                                               name="lockstep-heartbeat", daemon=True)
            self._heartbeat.start()

    @property
    def primary(self) -> Engine:
        return self.engine

    def _send(self, command: Command) -> None:
        broadcast(command)
        self._last_sent = time.monotonic()

    def _beat(self, seconds: float) -> None:
        while True:
            time.sleep(seconds / 4)
            with self._lock:
                if self._stopped:
                    return
                if time.monotonic() - self._last_sent >= seconds:
                    self._send(Command())

    def _send_ops(self, **command) -> None:
        """Sends the ops queued since the last command (and ``command``'s fields)."""
        ops, self._ops = self._ops, []
        self._send(Command(ops=ops, step_times=self.policy.take_step_times(), **command))

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """``Engine.add_request`` (its errors, raised here first, so that a request the
        leader refused never reaches the followers)."""
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.add_request(request_id, prompt, params)
        self._ops.append(("add", request_id, prompt, params))

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._ops.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def num_running(self) -> int:
        return self.engine.num_running()

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    def scheduler_stats(self) -> SchedulerStats:
        return self.engine.scheduler_stats()

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """``Engine.add_step_listener`` (the leader's steps)."""
        self.engine.add_step_listener(listener)

    # -------------------------------------------------------------- lockstep
    def step(self) -> list[RequestOutput]:
        """Sends the queued ops and a step to the followers, then steps."""
        with self._lock:
            self._send_ops(step=True)
            return self.engine.step()

    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[TokenLogprob | None]:
        """``Engine.prompt_logprobs``, which every process computes with the leader."""
        ids = [int(t) for t in prompt_token_ids]
        with self._lock:
            self._ops.append(("prompt_logprobs", ids, top_n))
            self._send_ops()
            return self.engine.prompt_logprobs(ids, top_n)

    def shutdown(self) -> None:
        """Tells the followers to return (``follow``); the engine takes no more work."""
        with self._lock:
            if not self._stopped:
                self._send(Command(stop=True))
                self._stopped = True
