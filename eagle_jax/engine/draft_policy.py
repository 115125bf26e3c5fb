"""How many tokens the draft proposes in each step: fixed, or chosen per step for goodput.

Speculation pays when the tokens a step commits grow faster than its time. A step that
drafts s tokens commits, per request, in expectation

    E[s] = 1 + a_1 + a_1 a_2 + ... + a_1 a_2 ... a_s

where a_i is the probability that draft position i is accepted given that every
position before it was (the chain stops at the first rejection; the bonus token is the
1). Its time t(B, s) depends on the batch bucket B and on s: at batch 1 the weights' read
dominates and drafting is almost free, at batch 64+ the verify's FLOPs grow with s + 1
rows per request and plain decoding (s = 0) can win. ``AdaptiveDraftLength`` picks

    s* = argmax_s  E[s] / t(B, s)

over the compiled lengths (ties to the shorter). t starts from a timing of each bucket
and length at start-up (``Engine._time_draft_lengths``, on rows made live at a fixed
context: not the served context nor the host's work between steps) and follows, while
serving, the time between the ends of consecutive steps of the same bucket and length (an exponentially weighted average; a pause of the server, over 4x
the estimate, is ignored). a_i is estimated from the steps' accept lengths: a
per-position count of trials and acceptances over every live row of every step,
decayed per step (an exponentially weighted average over the batch, half-life
``half_life`` steps), shrunk toward the acceptance pooled over all positions. A deep
position is tried only when every position before it was accepted (at a = 0.5, position
5 in one row-step of 16): alone, its estimate would sit at the prior for hundreds of
steps and overstate what long drafts commit; the pooled rate, fed by every trial,
stands in for it until its own trials outweigh ``prior_weight``. Positions past the
chosen length are not observed, so every ``probe_every`` steps that chose less than the
longest length run the next longer one: a draft whose acceptance recovers is found again, at the cost of one step
in ``probe_every`` at a length one notch off.

Any length keeps the engine's state consistent, so switching between steps changes
speed, never output: greedy output is the target's at every length. A step that drafts
s >= 1 extends the draft over the tokens it commits; a step of length 0 is the target's
step alone (the draft does no work, so that length 0 costs what plain decoding does),
and the draft catches up over the positions it skipped, in one forward, before the next
step that drafts or after ``step.MAX_DRAFT_LAG`` such steps in a row. The start-up time
of length 0 includes its share of that catch-up; while serving, a catch-up's time falls
in the measured cycle of the step after it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

def expected_tokens(acceptance: np.ndarray, lengths) -> np.ndarray:
    """E[s] for each s in ``lengths``: committed tokens per request of a step drafting s
    tokens, given the conditional per-position acceptance a_1 .. a_S (``acceptance``)."""
    reach = np.concatenate([[1.0], np.cumprod(np.asarray(acceptance, np.float64))])
    cumulative = np.cumsum(reach)  # cumulative[s] = 1 + a_1 + ... + a_1..a_s
    return cumulative[np.asarray(lengths)]


class FixedDraftLength:
    """Every step drafts ``length`` tokens (``--speculative-policy fixed``)."""

    def __init__(self, length: int):
        self.lengths = (length,)

    def choose(self, bucket: int) -> int:
        del bucket
        return self.lengths[0]

    def observe(self, length: int, accept_len: np.ndarray) -> None:
        del length, accept_len

    def predicted_tokens(self, length: int) -> float | None:
        del length
        return None

    def observe_time(self, bucket: int, length: int, seconds: float) -> None:
        del bucket, length, seconds


@dataclasses.dataclass
class AdaptiveDraftLength:
    """Chooses each step's draft length to maximise expected committed tokens per second.

    Attributes:
      lengths: the compiled draft lengths, ascending (0 = the target's step alone).
      step_seconds: {(bucket, length): seconds} of each compiled step variant.
      prior: the pooled acceptance assumed before any step observed one (optimistic, so
        that drafting is tried first), worth ``prior_weight`` trials; a position's own
        rate is shrunk toward the pooled one by ``prior_weight`` trials too.
      half_life: steps after which an acceptance observation weighs half.
      time_weight: the weight of a new step time in the running estimate.
      probe_every: every this many steps one probe step runs at a neighbour of the
        best length, up and down in turn (where there is one): the next longer length,
        whose positions past the best are otherwise never observed again, and the next
        shorter one (not 0), whose step time is otherwise never measured again (the
        start-up table is a few steps at one context; a shorter length's time read a few
        percent high kept the policy at a length whose rate was ~5% lower on the H200).
        A probe that has no neighbour in its direction takes the other.
      prefer_shorter: the shortest length whose expected rate is within this fraction of
        the best one's is chosen. Lengths of equal expected rate differ in variance: a
        longer draft commits more tokens in some steps and fewer in others, so requests
        progress less evenly (the last request of a batch finishes later; on the H200 at
        a = 0.7, batch 32, lengths 3 and 5 rated within 1% and the batch of length 3
        finished 5% sooner), and it spends more of the device on tokens thrown away.
    """

    lengths: tuple[int, ...]
    step_seconds: dict[tuple[int, int], float]
    prior: float = 0.8
    prior_weight: float = 4.0
    half_life: float = 32.0
    probe_every: int = 16
    time_weight: float = 0.1
    prefer_shorter: float = 0.02

    def __post_init__(self):
        self.lengths = tuple(sorted(set(self.lengths)))
        self.step_seconds = dict(self.step_seconds)
        longest = self.lengths[-1]
        self._trials = np.zeros(longest)
        self._accepted = np.zeros(longest)
        self._pooled = np.array([self.prior * self.prior_weight, self.prior_weight])
        self._decay = 0.5 ** (1.0 / self.half_life)
        self._since_probe = 0
        self._num_probes = 0

    @property
    def acceptance(self) -> np.ndarray:
        """[S] the current estimate of a_1 .. a_S."""
        pooled = self._pooled[0] / self._pooled[1]
        return (self._accepted + self.prior_weight * pooled) / (self._trials + self.prior_weight)

    def set_acceptance(self, acceptance, trials: float) -> None:
        """Sets the estimate of a_1 .. a_S to ``acceptance`` as if observed over
        ``trials`` request-steps at each position (a policy started from a known
        acceptance: tests, benchmarks)."""
        self._trials[:] = trials
        self._accepted[:] = np.asarray(acceptance) * trials

    def goodput(self, bucket: int) -> dict[int, float]:
        """{length: expected committed tokens per request per second} at ``bucket``."""
        tokens = expected_tokens(self.acceptance, self.lengths)
        return {s: float(e) / self.step_seconds[bucket, s] for s, e in zip(self.lengths, tokens)}

    def choose(self, bucket: int) -> int:
        rates = self.goodput(bucket)
        bar = (1.0 - self.prefer_shorter) * max(rates.values())
        best = next(s for s in self.lengths if rates[s] >= bar)
        self._since_probe += 1
        if self._since_probe < self.probe_every:
            return best
        self._since_probe = 0
        i = self.lengths.index(best)
        neighbours = self.lengths[i + 1:i + 2] + tuple(s for s in self.lengths[i - 1:i] if s)
        if not neighbours:
            return best
        self._num_probes += 1
        return neighbours[self._num_probes % len(neighbours)]

    def observe(self, length: int, accept_len: np.ndarray) -> None:
        """Adds one step's accept lengths (one per live row) that drafted ``length``."""
        self._trials *= self._decay
        self._accepted *= self._decay
        self._pooled *= self._decay
        if length == 0 or accept_len.size == 0:
            return
        positions = np.arange(length)
        # Row r tried position i when every position before it was accepted (accept_len
        # >= i) and accepted it when accept_len > i.
        tried = np.sum(accept_len[:, None] >= positions, axis=0)
        accepted = np.sum(accept_len[:, None] > positions, axis=0)
        self._trials[:length] += tried
        self._accepted[:length] += accepted
        self._pooled += (accepted.sum(), tried.sum())

    def observe_time(self, bucket: int, length: int, seconds: float) -> None:
        """Moves the estimate of t(bucket, length) toward a measured step time."""
        old = self.step_seconds.get((bucket, length))
        if old is None or seconds > 4 * old:
            return  # not a compiled variant, or the server paused between steps
        self.step_seconds[bucket, length] = old + self.time_weight * (seconds - old)

    def predicted_tokens(self, length: int) -> float:
        """E[length] per request under the current estimate."""
        return float(expected_tokens(self.acceptance, [length])[0])
