"""The shape menu: every compiled shape the engine may run, and the choice among them.

A forward's shapes are compiled, so they come from a small set. The scheduler picks
from this menu, and precompile compiles exactly it (``BucketMenu.executables``).

- A decode step runs the smallest batch bucket that covers every occupied slot, for one
  of the compiled draft lengths.
- A prefill alone runs L requests' chunks padded to C positions each
  (``prefill_shapes``, L a power of two up to max_num_partial_prefills).
- A decode step carries prompt chunks in lanes of STEP_LANE positions, a power-of-two
  count of them within its token budget (``step_lane_counts``): a request's chunk takes
  as many lanes as it needs (each lane one query block, attending to the lanes before
  it, whose keys the forward wrote first), so short chunks pad to at most one lane, not
  to the budget.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

# Positions of a lane that a decode step carries prompt chunks in (rounded up to whole rows
# of the step's width): a few hundred positions of a forward cost about its weight read
# on a GPU, so a short chunk (a prefix-cache hit's tail) pads to one lane, while a long
# one spans several, each lane reading the chunk's prefix from the pool once.
STEP_LANE = 64


def powers_of_two(most: int) -> tuple[int, ...]:
    """1, 2, 4, .. up to ``most``."""
    return tuple(1 << i for i in range(most.bit_length()))


# An executable's key: what it is built from. Frozen dataclasses, so keys of different
# kinds never compare equal; ``name`` is what ``CompileFn`` is told.
@dataclasses.dataclass(frozen=True)
class StepKey:
    """A decode step: its batch bucket, whether it computes logprobs, the prompt-chunk
    lanes it carries (0: none), its draft length, and whether it masks its rows by their
    grammars (structured output: compiled on first use, never precompiled; its masks
    come from the host while it runs, ``grammar_masks.host_masks``)."""

    name: ClassVar[str] = "step"
    batch: int
    with_logprobs: bool
    num_lanes: int
    draft_length: int
    constrained: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillKey:
    """A prefill alone: ``num`` chunks of ``size`` positions."""

    name: ClassVar[str] = "prefill"
    num: int
    size: int
    with_logprobs: bool


@dataclasses.dataclass(frozen=True)
class CatchUpKey:
    """The draft's catch-up over the positions steps of draft length 0 skipped."""

    name: ClassVar[str] = "catch_up"
    batch: int


@dataclasses.dataclass(frozen=True)
class UpdateSlotsKey:
    """The slot changes' own executable (before a step)."""

    name: ClassVar[str] = "update_slots"


@dataclasses.dataclass(frozen=True)
class ScoreKey:
    """Prompt scoring (``Engine.prompt_logprobs``) of ``bucket`` positions."""

    name: ClassVar[str] = "score"
    bucket: int


ExecutableKey = StepKey | PrefillKey | CatchUpKey | UpdateSlotsKey | ScoreKey


@dataclasses.dataclass(frozen=True)
class BucketMenu:
    batch_buckets: tuple[int, ...]  # ascending; the largest is the slot count
    prefill_buckets: tuple[int, ...]  # ascending
    draft_lengths: tuple[int, ...]  # the lengths a plain step may draft
    num_steps: int  # the draft length of a step that carries prompt chunks
    verify_width: int  # positions a step verifies per request (its rows' width)
    max_num_batched_tokens: int
    max_num_partial_prefills: int
    catch_up: bool  # the draft may lag (length 0 is a draft length)

    @property
    def chunk_len(self) -> int:
        """Longer prompts are prefilled in chunks of this many positions."""
        return self.prefill_buckets[-1]

    def batch_for(self, max_slot: int) -> int:
        """The smallest batch bucket whose rows include slot ``max_slot``."""
        return next(b for b in self.batch_buckets if b > max_slot)

    def chunk_counts(self) -> tuple[int, ...]:
        return powers_of_two(self.max_num_partial_prefills)

    def step_lane_len(self, batch: int) -> int:
        """Positions of a lane of a decode step of bucket ``batch``: STEP_LANE in whole
        rows of verify_width, within the step's token budget less its own rows (at least
        one row)."""
        width = self.verify_width
        room = self.max_num_batched_tokens - batch * width
        return max(width, min(-(-STEP_LANE // width) * width, room // width * width))

    def step_lane_counts(self, batch: int) -> tuple[int, ...]:
        """Lane counts a step of bucket ``batch`` is compiled for: up to the lanes its
        budget holds, or that max_num_partial_prefills chunks of chunk_len can fill if
        fewer (no executable whose lanes could never all be used)."""
        lane = self.step_lane_len(batch)
        room = self.max_num_batched_tokens - batch * self.verify_width
        usable = self.max_num_partial_prefills * -(-self.chunk_len // lane)
        return powers_of_two(max(1, min(room // lane, usable)))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """The (chunks, positions) shapes of the prefill executables: one chunk of every
        prefill bucket, and for more chunks the longest bucket that keeps them within
        max_num_batched_tokens (no shape for a count none keeps within it)."""
        budget, buckets = self.max_num_batched_tokens, self.prefill_buckets
        shapes = [(1, c) for c in buckets]
        for n in self.chunk_counts()[1:]:
            fitting = [c for c in buckets if n * c <= budget]
            if fitting:
                shapes.append((n, fitting[-1]))
        return shapes

    def step_lane_shapes(self, batch: int) -> list[tuple[int, int]]:
        """The (lanes, positions) shapes of a step of bucket ``batch`` that carries chunks."""
        lane = self.step_lane_len(batch)
        return [(n, lane) for n in self.step_lane_counts(batch)]

    def executables(self, with_logprobs: bool = False) -> list[ExecutableKey]:
        """Every executable serving may run: what precompile compiles."""
        keys: list[ExecutableKey] = [PrefillKey(n, c, with_logprobs)
                                  for n, c in self.prefill_shapes()]
        keys += [StepKey(b, with_logprobs, 0, s)
                 for b in self.batch_buckets for s in self.draft_lengths]
        keys += [StepKey(b, with_logprobs, n, self.num_steps)
                 for b in self.batch_buckets for n in self.step_lane_counts(b)]
        keys.append(UpdateSlotsKey())
        if self.catch_up:
            keys += [CatchUpKey(b) for b in self.batch_buckets]
        return keys

    def ready_set(self) -> list[ExecutableKey]:
        """The executables that serve any request alone, compiled before the rest with
        ``compile_in_background``: the largest batch bucket's step drafting num_steps
        (every occupancy fits its rows, a fixed policy's length), the one-chunk prefill
        of the longest bucket (it takes any chunk; prompt chunks run as prefills of their
        own until a step with lanes is compiled) and the slot changes. No catch-up: the
        draft lags only under the adaptive policy, which starts once all are compiled."""
        return [StepKey(self.batch_buckets[-1], False, 0, self.num_steps),
                PrefillKey(1, self.chunk_len, False), UpdateSlotsKey()]


def chunk_shape(shapes: list[tuple[int, int]], remaining: list[int], split: bool = False
                ) -> tuple[int, int]:
    """The (chunks, positions) shape among ``shapes`` that prefills the most of
    ``remaining`` (each request's positions to prefill now, in the order they are
    served), the fewest computed positions among equals. ``split``: a request's
    positions may span several chunks (a step's lanes)."""
    def score(shape):
        num, size = shape
        run = 0
        for r in remaining:
            if num <= 0:
                break
            lanes = min(-(-r // size), num) if split else 1
            run += min(r, lanes * size)
            num -= lanes
        return run, -shape[0] * size

    return max(shapes, key=score)
