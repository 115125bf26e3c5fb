"""The engine as its drivers see it: ``EngineClient``.

The server (``server/``), ``LLM``, evaluation (``eval/``) and the comparison tool
(``compare/``) drive an engine through these members and no others. ``Engine`` satisfies
the protocol structurally; ``DataParallelEngine`` and ``multihost.LockstepEngine``, which
front engines of one model, declare it through ``EngineFront``.
``tests/test_engine_protocol.py`` checks all three.

An engine is not thread-safe: one thread drives it (the server's engine thread).
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.types import (
    CompileProgress, RequestOutput, SchedulerStats, SpecDecodeStats, StepEvent, TokenLogprob)
from eagle_jax.sampling import SamplingParams
from eagle_jax.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    """What a driver may read and call on an engine (module docstring)."""

    # ------------------------------------------------------------ the model
    @property
    def config(self) -> EngineConfig:
        """The resolved configuration (backend defaults applied; ``model`` the target's
        directory, ``data_parallel_size`` the number of replicas)."""

    @property
    def model_name(self) -> str:
        """The name served by default: ``served_model_name``, else the model directory's."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; None when its directory has none (prompts are then token
        ids, outputs have no text and stop strings are refused)."""

    @property
    def vocab_size(self) -> int:
        """Token ids in ``[0, vocab_size)`` are valid in a prompt and in an output."""

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt and output) a request may reach."""

    @property
    def num_slots(self) -> int:
        """Requests decoded at once, in all (at most ``config.max_num_seqs`` per
        replica); more wait in the engine's queue."""

    @property
    def num_steps(self) -> int:
        """The longest draft of a step (tokens proposed per request); 0: plain decoding."""

    # ------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queues a request under an id not in use. Raises ValueError naming the problem
        for bad input (empty or too long a prompt, ids outside the vocabulary, ...)."""

    def abort_request(self, request_id: str) -> None:
        """Finishes an unfinished request with reason "abort" at the next ``step()``;
        an unknown id is ignored."""

    def has_unfinished_requests(self) -> bool:
        """Whether a request is running or waiting (``step()`` has work)."""

    def num_running(self) -> int:
        """Requests holding a slot."""

    def num_waiting(self) -> int:
        """Requests queued for a slot."""

    # ----------------------------------------------------------------- work
    def step(self) -> list[RequestOutput]:
        """Runs one step of every running request (admitting waiting ones) and returns
        what each produced; a finished request's output has ``finished`` set."""

    def add_step_listener(self, listener: Callable[[StepEvent], None]) -> None:
        """Calls ``listener`` at the end of every ``step()`` (observers only: it must not
        drive the engine)."""

    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[TokenLogprob | None]:
        """The logprob of every prompt token given its prefix (the first entry None),
        each with its ``top_n`` most likely alternatives. Raises ValueError for a prompt
        the engine cannot score."""

    # ---------------------------------------------------------------- stats
    @property
    def stats(self) -> SpecDecodeStats:
        """Cumulative speculative-decoding counters. It may be the engine's live record:
        copy it to keep a snapshot."""

    def scheduler_stats(self) -> SchedulerStats:
        """The queues, the KV pool's usage and the cumulative cache and preemption
        counts, now."""

    @property
    def compile_progress(self) -> CompileProgress:
        """Executables compiled so far and those still compiling in the background
        (``EngineConfig.compile_in_background``): the engine serves meanwhile, from the
        compiled ones. Safe to read from any thread."""


def _forward(name: str) -> property:
    """A read-only property: ``self.primary``'s ``name``, documented as the protocol's."""
    return property(lambda self: getattr(self.primary, name),
                    doc=getattr(EngineClient, name).__doc__)


class EngineFront(EngineClient):
    """Base of an engine in front of ``Engine``s of one model (``DataParallelEngine``,
    ``multihost.LockstepEngine``): the model's attributes, ``stats`` among them, are
    ``primary``'s, read through rather than copied; a subclass overrides those it
    aggregates. The methods are the subclass's own."""

    @property
    def primary(self) -> EngineClient:
        """The engine whose model attributes this one's are."""
        raise NotImplementedError

    config = _forward("config")
    model_name = _forward("model_name")
    tokenizer = _forward("tokenizer")
    vocab_size = _forward("vocab_size")
    max_model_len = _forward("max_model_len")
    num_slots = _forward("num_slots")
    num_steps = _forward("num_steps")
    stats = _forward("stats")
    compile_progress = _forward("compile_progress")
