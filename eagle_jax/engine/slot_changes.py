"""The slots admitted and released since the last executable, as the host collects them.

Admissions and releases happen on the host between steps; the device learns of them all
at once, from the next executable (``step.update_slots``): a prefill applies them itself,
a step after one dispatch of their own. Each dispatch is host time whatever its work (a
dispatch per admission and per release cost ~0.5 and ~0.2 ms a request on the H200
machine: docs/history/2026-12-02-issue-14-prefix-caching.md, second session), so
changes are gathered here, the latest of each slot kept.
"""

from __future__ import annotations

import numpy as np

from eagle_jax.engine.state import SlotUpdates
from eagle_jax.sampling import SamplingRows


class SlotChanges:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # slot -> (sampling row [1] each, PRNG key [2]) of its new request, or None (released)
        self._changes: dict[int, tuple[SamplingRows, np.ndarray] | None] = {}

    def __bool__(self) -> bool:
        return bool(self._changes)

    def assign(self, slot: int, sampling: SamplingRows, key: np.ndarray) -> None:
        """``slot`` takes a new request's sampling row and PRNG key."""
        self._changes[slot] = (sampling, key)

    def release(self, slot: int) -> None:
        """``slot`` is free (its request left)."""
        self._changes[slot] = None

    def take(self) -> SlotUpdates:
        """The changes as host arrays (the latest change of each slot), cleared here: the
        executable they are given to applies them."""
        n = self.num_slots
        updates = SlotUpdates(
            assign=np.zeros((n,), bool), release=np.zeros((n,), bool),
            sampling=SamplingRows.padded(n), key=np.zeros((n, 2), np.uint32))
        for slot, change in self._changes.items():
            if change is None:
                updates.release[slot] = True
                continue
            sampling, key = change
            updates.assign[slot] = True
            updates.key[slot] = key
            for rows, row in zip(updates.sampling, sampling):
                rows[slot] = row[0]
        self._changes.clear()
        return updates
