"""The speculative-decoding counters (``SpecDecodeStats``), counted from plans and outputs."""

from __future__ import annotations

import numpy as np

from eagle_jax.engine.plans import StepPlan
from eagle_jax.engine.types import SpecDecodeStats


class StatsCounter:
    def __init__(self, *, num_steps: int, drafted_per_step: int | None, vocab_size: int):
        """``drafted_per_step``: the tokens a drafting row proposes, a tree's nodes; None
        for a chain (its draft length)."""
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * num_steps,
                                     drafted_per_pos=[0] * num_steps,
                                     draft_length_steps=[0] * (num_steps + 1))
        self.num_steps = num_steps
        self.drafted_per_step = drafted_per_step
        self.vocab_size = vocab_size

    def count_plan(self, plan: StepPlan, policy) -> None:
        """Counts a dispatched step's draft length, its catch-up, and the policy's
        forecast: the tokens its rows should commit and the time its executable takes."""
        s, key = self.stats, plan.key
        s.num_draft_catch_ups += plan.catch_up
        if not self.num_steps:
            return
        s.draft_length_steps[key.draft_length] += 1
        expected = policy.predicted_tokens(key.draft_length)
        if expected is not None:
            s.forecast_tokens += expected * len(plan.rows)
            s.forecast_seconds += policy.step_seconds[key.batch, key.draft_length]

    def count_step(self, out, live: dict[int, str], length: int, policy) -> None:
        """Adds the live rows of a step that drafted ``length`` tokens (``out``: its host
        StepOutput) to the counters and to the policy's acceptance estimate (vectorised
        over the rows: this runs on the host between steps, at every batch size)."""
        s = self.stats
        s.num_steps += 1
        if not live:
            return
        rows = np.fromiter(live, np.int64, len(live))
        n = out.num_tokens[rows]
        tokens = out.tokens[rows]
        committed = np.arange(tokens.shape[1])[None] < n[:, None]
        s.num_emitted_tokens += int(n.sum())
        s.num_invalid_tokens += int(np.sum(committed & ((tokens < 0) |
                                                        (tokens >= self.vocab_size))))
        if not length:
            return
        accept = out.accept_len[rows]
        policy.observe(length, accept)
        s.num_drafts += len(rows)
        s.num_draft_tokens += (self.drafted_per_step or length) * len(rows)
        s.num_accepted_tokens += int(accept.sum())
        # Position i (a tree's depth i + 1) drafted in every row of the step, accepted in
        # every row whose accept length exceeds i.
        for i, count in enumerate(np.sum(accept[:, None] > np.arange(length),
                                         axis=0).tolist()):
            s.accepted_per_pos[i] += count
            s.drafted_per_pos[i] += len(rows)
        s.num_malformed_draft_probs += int(out.num_malformed[rows].sum())
        s.num_sampler_fallbacks += int(out.num_fallback[rows].sum())
