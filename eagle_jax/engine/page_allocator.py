"""Host-side KV pages: how many the pool has (``plan_pool``) and which request owns which
(``PageAllocator``).

The pool itself (``KVPages``, one per model) lives on the device; the target's and the
draft's pools have the same number of pages, and a request's page i holds the same
positions in both (the draft's KV row j sits at the target's position j), so one
allocator and one page table serve both models.

A request holds a list of page ids; its position j lives in ``pages[j // page_size]``.
Pages are taken as the request grows (``reserve``), never moved, and all returned when
it finishes or is preempted (``free``). Pages past the accepted length (rejected draft
positions, or a step reserved ahead that the request did not need) stay with the
request and are overwritten by its later writes.

The allocator also keeps the page-table updates the device has not seen yet: each page
given out is a (row, index, page) triple that the next compiled step (or prefill)
applies to its page table before running, so the host never uploads a whole table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


class PoolPlan(NamedTuple):
    max_model_len: int
    num_pages: int
    max_pages: int  # the page table's width: pages one request can own


def plan_pool(*, model_limit: int, max_model_len: int | None, num_slots: int, page_size: int,
              step_tokens: int, bytes_per_token: int, budget: int | None,
              unbudgeted_max_model_len: int) -> PoolPlan:
    """The pool's size and the context limit, from a KV budget in bytes.

    A request's pages reach past its length by the step in flight and the step being
    dispatched (async scheduling reserves for both): 2 * step_tokens positions. Without
    a budget (a CPU) the pool holds every slot at max_model_len, which then defaults to
    at most ``unbudgeted_max_model_len``. A pool that cannot hold one request of the
    model's full length caps the default max_model_len; an explicit max_model_len it
    cannot hold, or one past the model's limit, is an error naming the fix.
    """
    if max_model_len is not None and max_model_len > model_limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the target's limit of "
                         f"{model_limit} positions (its max_position_embeddings)")
    served = max_model_len or model_limit
    reach = 2 * step_tokens
    if budget is None:
        served = max_model_len or min(model_limit, unbudgeted_max_model_len)
        num_pages = num_slots * pages_for(served + reach, page_size)
    else:
        num_pages = budget // (bytes_per_token * page_size)
        fits = num_pages * page_size - reach
        if fits < served and max_model_len is not None:
            raise ValueError(
                f"a KV budget of {budget / 2**30:.2f} GiB holds {max(fits, 0)} tokens, "
                f"fewer than one request of max_model_len {max_model_len} "
                f"({bytes_per_token / 2**10:.1f} KiB per token); raise kv_cache_memory / "
                "kv_cache_memory_fraction or lower max_model_len")
        if fits < 2:
            raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB holds no request; "
                             "raise kv_cache_memory / kv_cache_memory_fraction")
        served = min(served, fits)
    return PoolPlan(served, int(num_pages), pages_for(served + reach, page_size))


class OutOfPages(Exception):
    """The pool has fewer free pages than a reservation needs (the scheduler preempts)."""


class PageAllocator:
    """Free list and per-owner page lists of a pool of ``num_pages`` pages.

    Owners are integers (the engine's slots). The free list is a stack: the first pages
    handed out are 0, 1, 2, ..., and the last pages freed are the next ones reused.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_owner: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_owner = max_pages_per_owner
        self._free = list(range(num_pages - 1, -1, -1))  # pop() takes from the end
        self._owned: dict[int, list[int]] = {}
        self._pending: list[tuple[int, int, int]] = []  # (owner, index, page) not yet applied

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's pages owned by requests."""
        return 1.0 - len(self._free) / self.num_pages

    def pages(self, owner: int) -> list[int]:
        return self._owned.get(owner, [])

    def can_reserve(self, owner: int, num_tokens: int) -> bool:
        return self._missing(owner, num_tokens) <= len(self._free)

    def _missing(self, owner: int, num_tokens: int) -> int:
        want = min(pages_for(num_tokens, self.page_size), self.max_pages_per_owner)
        return max(0, want - len(self._owned.get(owner, ())))

    def reserve(self, owner: int, num_tokens: int) -> None:
        """Makes ``owner``'s pages cover positions [0, num_tokens) (capped at the page
        table's width). Raises OutOfPages, taking nothing, when the pool is short."""
        missing = self._missing(owner, num_tokens)
        if missing > len(self._free):
            raise OutOfPages(f"{missing} pages needed, {len(self._free)} free")
        owned = self._owned.setdefault(owner, [])
        for _ in range(missing):
            page = self._free.pop()
            self._pending.append((owner, len(owned), page))
            owned.append(page)

    def free(self, owner: int) -> None:
        """Returns every page of ``owner`` to the pool."""
        pages = self._owned.pop(owner, [])
        self._pending = [u for u in self._pending if u[0] != owner]
        self._free.extend(reversed(pages))

    def page_row(self, owner: int) -> np.ndarray:
        """[max_pages_per_owner] int32: the owner's page table row (0 past its pages:
        never read, the kernel reads only pages below the live length)."""
        row = np.zeros((self.max_pages_per_owner,), np.int32)
        pages = self._owned.get(owner, [])
        row[:len(pages)] = pages
        return row

    def take_updates(self, owner: int | None = None) -> list[tuple[int, int, int]]:
        """The (owner, index, page) assignments not yet applied on the device (of one
        owner, or all), forgotten once taken."""
        if owner is None:
            taken, self._pending = self._pending, []
        else:
            taken = [u for u in self._pending if u[0] == owner]
            self._pending = [u for u in self._pending if u[0] != owner]
        return taken
