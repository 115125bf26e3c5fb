"""An Engine that keeps a per-request-step record of what every decode step did.

``RecordingEngine`` is the served ``Engine`` with two read-only additions, both made by
overriding methods (no engine file changes):

* ``_record_stats(out, live)`` -- the engine calls it once per decode step with the
  host copy of the step's ``StepOutput`` and the step's live ``{slot: request}``, right
  after the one device read of the step. The override calls the engine's own bookkeeping first (so
  ``engine.stats`` is unchanged), then appends one :class:`StepRecord` per live slot:
  the request id, ``accept_len``, the tokens the step committed (before stop-condition
  cuts), and the sampler's malformed-q / fallback counters. It also notes the request's
  first-token time (``_Request.first_token_time``, set by the engine right after prefill).
* ``step()`` -- stamps the time at which each request's ``finished`` output is returned.

Per-request TPOT is then ``(finish_time - first_token_time) / (num_output_tokens - 1)``
with both times on the engine's ``time.monotonic`` clock.

The mixin form (``RecordingMixin``) lets ``eagle_jax.compare`` stack it on an engine
whose step functions run op by op.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from eagle_jax.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one decode step did for one request (host values)."""

    step: int  # engine.stats.num_steps after this step (1-based step index)
    request_id: str
    accept_len: int  # draft tokens accepted (0 for plain decoding)
    tokens: tuple[int, ...]  # committed by the step, before stop cuts (accept_len + 1)
    num_malformed: int  # draft-probability entries that were not probabilities
    num_fallback: int  # residual draws that fell back to p
    num_invalid: int  # committed ids outside [0, vocab_size)


class RecordingMixin:
    """Mix into an ``Engine`` subclass (before ``Engine`` in the bases)."""

    def __init__(self, *args, **kwargs):
        if not callable(getattr(super(), "_record_stats", None)):
            raise TypeError("RecordingMixin needs Engine._record_stats(out, live), the "
                            "engine's per-step bookkeeping hook; the engine no longer has it")
        self.step_records: list[StepRecord] = []
        self.first_token_time: dict[str, float] = {}
        self.finish_time: dict[str, float] = {}
        super().__init__(*args, **kwargs)

    def reset_records(self) -> None:
        self.step_records.clear()
        self.first_token_time.clear()
        self.finish_time.clear()

    def _record_stats(self, out, live, *args, **kwargs):
        """``live``: the engine's {slot: request} of the step (or a list of slots)."""
        super()._record_stats(out, live, *args, **kwargs)
        step = self.stats.num_steps
        items = (live.items() if isinstance(live, dict)
                 else ((slot, self._slots[slot]) for slot in live))
        for slot, req in items:
            n = int(out.num_tokens[slot])
            toks = tuple(int(t) for t in np.asarray(out.tokens[slot, :n]))
            if req.first_token_time is not None:
                self.first_token_time.setdefault(req.request_id, req.first_token_time)
            self.step_records.append(StepRecord(
                step=step, request_id=req.request_id,
                accept_len=int(out.accept_len[slot]) if self.num_steps else 0,
                tokens=toks,
                num_malformed=int(out.num_malformed[slot]),
                num_fallback=int(out.num_fallback[slot]),
                num_invalid=sum(1 for t in toks if not 0 <= t < self.vocab_size)))

    def step(self):
        outputs = super().step()
        now = time.monotonic()
        for o in outputs:
            if o.finished:
                self.finish_time.setdefault(o.request_id, now)
        return outputs


class RecordingEngine(RecordingMixin, Engine):
    """The served engine (jitted steps), recording every request-step."""
