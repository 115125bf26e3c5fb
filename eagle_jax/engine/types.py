"""Host-side request and output records shared by the engine, LLM and the server."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class TokenLogprob:
    """Logprob of one committed token under the target model, plus its top alternatives.

    Logprobs are of the raw target distribution (log_softmax of the logits, before
    temperature and filters), as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    top: dict[int, float]  # up to SamplingParams.logprobs entries, most likely first


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request.

    ``new_token_ids`` may hold several tokens: every token a speculative step committed
    (already cut at a stop condition). ``text`` is the detokenised text so far when the
    engine has a tokenizer, with stop strings removed.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    new_logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, after this step
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    text: str = ""
    new_text: str = ""
    first_token_time: float | None = None  # time.monotonic() when the first token was ready


@dataclasses.dataclass
class CompletionOutput:
    """The whole result of one request, as LLM.generate returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class SpecDecodeStats:
    """Cumulative speculative-decoding counters (vLLM's spec_decode metric names).

    ``num_drafts``: request-steps that drafted; ``num_draft_tokens``: tokens drafted;
    ``num_accepted_tokens``: draft tokens accepted; ``accepted_per_pos[i]``: draft tokens
    accepted at position i; ``drafted_per_pos[i]``: request-steps that drafted position
    i (all of ``num_drafts`` unless the draft length varies). For draft trees, a
    request-step drafts the tree's nodes and position i is depth i + 1 of the accepted
    path (acceptance per depth). Mean accept length (tokens
    committed per drafting request-step, the bonus token included) is
    ``1 + num_accepted_tokens / num_drafts``.

    ``draft_length_steps[s]``: steps dispatched with draft length s (0: the target's
    step alone). ``forecast_tokens`` / ``forecast_seconds``: what the adaptive policy
    expected of the steps it chose (committed tokens, device seconds); their ratio is
    its goodput estimate, to hold against the realised tokens per second.
    ``num_draft_catch_ups``: extends of the draft over the positions steps of length 0
    left it behind by (before the next step that drafts).
    """

    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_invalid_tokens: int = 0
    num_malformed_draft_probs: int = 0
    num_sampler_fallbacks: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    drafted_per_pos: list[int] = dataclasses.field(default_factory=list)
    draft_length_steps: list[int] = dataclasses.field(default_factory=list)
    forecast_tokens: float = 0.0
    forecast_seconds: float = 0.0
    num_draft_catch_ups: int = 0

    @property
    def mean_accept_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Fraction of the request-steps drafting position i that accepted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def since(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        """These counts less ``earlier``'s (a snapshot of the same counters: the counts
        of the steps in between; a histogram entry it lacks counts from 0)."""
        def less(now, then):
            if isinstance(now, list):
                return [a - (then[i] if i < len(then) else 0) for i, a in enumerate(now)]
            return now - then
        return SpecDecodeStats(**{f.name: less(getattr(self, f.name), getattr(earlier, f.name))
                                  for f in dataclasses.fields(self)})

    @property
    def forecast_goodput(self) -> float | None:
        """The adaptive policy's expected committed tokens per second over its steps."""
        return self.forecast_tokens / self.forecast_seconds if self.forecast_seconds else None


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state now (vLLM's metric names: num_requests_running / waiting,
    kv_cache_usage_perc, num_preemptions_total, prefix_cache_queries / hits_total)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of the KV pool's pages owned by requests
    num_preemptions: int  # cumulative
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative prompt tokens it served


class StepEvent(NamedTuple):
    """A decode step an ``Engine.step()`` call collected, for step listeners
    (``Engine.add_step_listener``): one event per collected step, or one with ``output``
    None for a call that collected none.

    ``output`` is the step's host copy (the engine's ``StepOutput``: tokens [B, W],
    num_tokens, accept_len, num_malformed, num_fallback, ...); ``rows`` maps each slot
    live in that step to its request id (the slots index ``output``'s rows);
    ``outputs`` are the RequestOutputs it gave (the call's first event also carries
    those of the call's prefills): a call's events together carry what it returns.
    """

    step: int  # engine.stats.num_steps once this step is counted
    output: Any
    rows: dict[int, str]
    outputs: list[RequestOutput]


@dataclasses.dataclass(frozen=True)
class CompileProgress:
    """The engine's executables: compiled so far, and queued for compiling in the
    background (``EngineConfig.compile_in_background``) and not compiled yet. An engine
    serves while some are pending, from the compiled ones; with none pending every
    choice is the bucket menu's own."""

    compiled: int
    pending: int

    @property
    def total(self) -> int:
        return self.compiled + self.pending

    @property
    def complete(self) -> bool:
        return self.pending == 0

    def __add__(self, other: "CompileProgress") -> "CompileProgress":
        return CompileProgress(self.compiled + other.compiled, self.pending + other.pending)
