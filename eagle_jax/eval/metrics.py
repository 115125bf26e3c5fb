"""Figures computed from per-request-step records (``eagle_jax.eval.recording``).

Definitions (shared by ``evaluate.py`` and ``compare_replay.py``):

* *request-step*: one request in one speculative decode step that drafted (vLLM's
  "draft"; under the adaptive policy a step may draft 0 tokens: it is no draft).
* *accept length*: tokens a request-step commits, ``accept_len + 1`` (the accepted
  draft tokens plus the target's correction / bonus token), in [1, S + 1]. Its mean is
  ``1 + accepted / drafts``, ``SpecDecodeStats.mean_accept_length``.
* *acceptance at position i* (0-based): the share of the request-steps that drafted
  position i that accepted at least i + 1 draft tokens (``accepted_per_pos[i] /
  drafted_per_pos[i]``; every request-step drafts every position at a fixed length).
  A draft tree of depth S counts as a chain of S: its request-steps draft positions
  (depths) 0 .. S - 1 and accept the depth of the path the verifier took.
* *TPOT* of a request: ``(finish time - first token time) / (output tokens - 1)``;
  requests with a single output token have none. The mean is over requests.
* *token agreement* of two outputs of one request: the length of their common prefix
  over the longer length (after the first difference the two runs condition on
  different contexts, so later positions are not compared).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from eagle_jax.eval.recording import StepRecord


def accept_summary(records: Sequence[StepRecord], num_steps: int,
                   tree_nodes: int | None = None) -> dict:
    """Accept-length figures of a set of request-steps of one speculative run (S =
    ``num_steps``, the longest draft length; ``tree_nodes``: a draft tree's nodes, the
    tokens each of its steps drafted)."""
    hist = [0] * (num_steps + 1)  # hist[k]: request-steps that committed k + 1 tokens
    per_pos = [0] * num_steps
    drafted = [0] * num_steps
    lengths = [0] * (num_steps + 1)  # lengths[s]: request-steps that drafted s tokens
    accepted = drafts = draft_tokens = 0
    for r in records:
        lengths[r.draft_length] += 1
        if not r.draft_length:
            continue
        a = r.accept_len
        drafts += 1
        draft_tokens += r.draft_length if tree_nodes is None else tree_nodes
        hist[min(a, num_steps)] += 1
        accepted += a
        for i in range(r.draft_length):
            drafted[i] += 1
            per_pos[i] += i < a
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "draft_length_histogram": {str(s): n for s, n in enumerate(lengths)},
        "num_accepted_tokens": accepted,
        "mean_accept_length": 1.0 + accepted / drafts if drafts else 0.0,
        "accept_length_histogram": {str(k + 1): hist[k] for k in range(num_steps + 1)},
        "accept_length_distribution": {
            str(k + 1): hist[k] / drafts if drafts else 0.0 for k in range(num_steps + 1)},
        "accepted_per_position": per_pos,
        "acceptance_per_position": [c / d if d else 0.0 for c, d in zip(per_pos, drafted)],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
    }


def per_request_accept_length(records: Iterable[StepRecord]) -> dict[str, float]:
    """request id -> mean accept length of its request-steps."""
    sums: dict[str, list[int]] = {}
    for r in records:
        s = sums.setdefault(r.request_id, [0, 0])
        s[0] += r.accept_len + 1
        s[1] += 1
    return {rid: tot / n for rid, (tot, n) in sums.items()}


def counters(records: Iterable[StepRecord]) -> dict:
    malformed = fallback = invalid = emitted = 0
    for r in records:
        malformed += r.num_malformed
        fallback += r.num_fallback
        invalid += r.num_invalid
        emitted += len(r.tokens)
    return {"num_emitted_tokens": emitted, "num_invalid_tokens": invalid,
            "num_malformed_draft_probs": malformed, "num_sampler_fallbacks": fallback}


def tpot(first: float | None, finish: float | None, num_tokens: int) -> float | None:
    if first is None or finish is None or num_tokens < 2:
        return None
    return (finish - first) / (num_tokens - 1)


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else common_prefix(a, b) / longest


def stats_delta(after, before) -> dict:
    """Difference of two ``SpecDecodeStats`` snapshots (``dataclasses.asdict``)."""
    out = {}
    for k, v in after.items():
        if isinstance(v, list):
            b = before.get(k) or [0] * len(v)
            out[k] = [x - y for x, y in zip(v, b)]
        else:
            out[k] = v - before.get(k, 0)
    return out


def perplexity(logprobs: Sequence[float]) -> float | None:
    if not logprobs:
        return None
    return math.exp(-sum(logprobs) / len(logprobs))
