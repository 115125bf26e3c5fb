"""A per-request-step record of what every decode step did, from the engine's step events.

``StepRecorder(engine)`` subscribes to the engine's public step listener
(``Engine.add_step_listener``) and keeps, read-only:

* one :class:`StepRecord` per live request of every collected decode step: the request
  id, ``accept_len``, the tokens the step committed (before stop-condition cuts), and
  the sampler's malformed-q / fallback counters;
* each request's first-token time (the engine's ``RequestOutput.first_token_time``) and
  the time ``step()`` returned its finished output.

Per-request TPOT is then ``(finish_time - first_token_time) / (num_output_tokens - 1)``
with both times on the engine's ``time.monotonic`` clock.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eagle_jax.engine.protocol import EngineClient
from eagle_jax.engine.types import StepEvent


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one decode step did for one request (host values)."""

    step: int  # engine.stats.num_steps after this step (1-based step index)
    request_id: str
    accept_len: int  # draft tokens accepted (0 for plain decoding)
    draft_length: int  # draft tokens the step proposed (0: the target's step alone)
    tokens: tuple[int, ...]  # committed by the step, before stop cuts (accept_len + 1)
    num_malformed: int  # draft-probability entries that were not probabilities
    num_fallback: int  # residual draws that fell back to p
    num_invalid: int  # committed ids outside [0, vocab_size)


class StepRecorder:
    """Records every request-step of ``engine`` (see the module docstring)."""

    def __init__(self, engine: EngineClient):
        self.vocab_size = engine.vocab_size
        self.speculative = engine.num_steps > 0
        self.step_records: list[StepRecord] = []
        self.first_token_time: dict[str, float] = {}
        self.finish_time: dict[str, float] = {}
        engine.add_step_listener(self)

    def reset(self) -> None:
        self.step_records.clear()
        self.first_token_time.clear()
        self.finish_time.clear()

    def __call__(self, event: StepEvent) -> None:
        out = event.output
        if out is not None:
            for slot, request_id in event.rows.items():
                n = int(out.num_tokens[slot])
                toks = tuple(int(t) for t in np.asarray(out.tokens[slot, :n]))
                self.step_records.append(StepRecord(
                    step=event.step, request_id=request_id,
                    accept_len=int(out.accept_len[slot]) if self.speculative else 0,
                    draft_length=out.tokens.shape[1] - 1 if self.speculative else 0,
                    tokens=toks,
                    num_malformed=int(out.num_malformed[slot]),
                    num_fallback=int(out.num_fallback[slot]),
                    num_invalid=sum(1 for t in toks if not 0 <= t < self.vocab_size)))
        now = time.monotonic()
        for o in event.outputs:
            if o.first_token_time is not None:
                self.first_token_time.setdefault(o.request_id, o.first_token_time)
            if o.finished:
                self.finish_time.setdefault(o.request_id, now)
