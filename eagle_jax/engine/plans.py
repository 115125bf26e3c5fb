"""The plans the scheduler hands the runner: typed values passed forward, one per forward.

A ``PrefillPlan`` runs prompt chunks in a forward of their own (nothing decodes); a
``StepPlan`` is one decode step and the chunks riding in it. The runner dispatches them;
the scheduler turns their host output into ``RequestOutput``s (``scheduler.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eagle_jax.engine.buckets import StepKey
from eagle_jax.engine.request import Request
from eagle_jax.engine.state import PrefillChunks, SlotUpdates

# (chunk index, the new request whose first token the chunk samples)
FirstToken = tuple[int, Request]


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """Prompt chunks run in a forward of their own (nothing decodes)."""

    chunks: PrefillChunks  # host arrays, [L] / [L, C]
    slot_updates: SlotUpdates  # applied by the prefill itself
    with_logprobs: bool
    firsts: tuple[FirstToken, ...]
    num_positions: int  # prompt positions it runs

    @property
    def shape(self) -> tuple[int, int]:
        """(chunks, positions per chunk)."""
        return self.chunks.tokens.shape


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One decode step: its executable, what the runner applies before it, and the rows
    whose tokens it commits."""

    key: StepKey
    slot_updates: SlotUpdates | None  # dispatched first, when any slot changed
    catch_up: bool  # the draft's catch-up runs before the step
    page_updates: np.ndarray  # [U, 3] the page-table entries the step applies
    chunks: PrefillChunks | None  # prompt chunks riding in the step (key.num_lanes of them)
    rows: dict[int, tuple[Request, int]]  # slot -> (request, its preemptions at dispatch)
    firsts: tuple[tuple[int, Request, int], ...]  # FirstToken + preemptions at dispatch
    # slot -> grammar.RequestGrammar of the rows under structured output (the host state
    # the constrained variant's masks are read from while it runs; empty: none)
    grammars: dict = dataclasses.field(default_factory=dict)

    @property
    def timed(self) -> bool:
        """Whether its cycle is the step's alone (no chunk, no catch-up)."""
        return self.chunks is None and not self.catch_up
