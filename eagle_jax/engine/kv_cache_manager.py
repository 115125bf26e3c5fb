"""The KV cache in requests: prefix matching, allocation, caching and freeing of a
request's pages, over the page allocator (``page_allocator.py``), which knows only owners
(slots) and pages.

A request's slot owns its pages. Admission matches its known tokens against the prefix
cache and reserves the pages of its prompt (the cached ones shared); before each step a
running request is given the pages the step may write; its full, final pages are offered
to the cache as it grows; leaving, it returns them. The page-table entries that these
add are collected here and travel with the next step (``page_updates``).
"""

from __future__ import annotations

import numpy as np

from eagle_jax.engine.page_allocator import OutOfPages, PageAllocator, pages_for
from eagle_jax.engine.request import Request

PageClaim = tuple[bytes, "int | None"]


def max_page_updates(num_slots: int, step_tokens: int, page_size: int) -> int:
    """Page-table entries a step may add: each running request grows by at most one
    step's tokens, which straddle at most cdiv(step_tokens, page_size) + 1 pages."""
    return num_slots * (pages_for(step_tokens, page_size) + 1)


def pad_page_updates(updates: list[tuple[int, int, int]], most: int,
                     num_slots: int) -> np.ndarray:
    """A step's [most, 3] (slot, index, page) rows; padding rows name slot B_max."""
    if len(updates) > most:
        raise RuntimeError(f"{len(updates)} page-table updates in one step, more than "
                           f"the {most} a step carries")
    rows = np.zeros((most, 3), np.int32)
    rows[:, 0] = num_slots
    if updates:
        rows[:len(updates)] = updates
    return rows


class KVCacheManager:
    def __init__(self, *, num_pages: int, page_size: int, max_pages: int, num_slots: int,
                 step_tokens: int, prefix_caching: bool, check_next: bool,
                 share_boundary: bool):
        """``check_next``: a page's hit needs the token after it too (with a draft, a
        page's last draft row depends on it). ``share_boundary``: a page whose next token
        differs is still shared, the draft recomputing its last row in a copy
        (``PageAllocator.match``), and the target features kept per page are tracked."""
        self.allocator = PageAllocator(num_pages, page_size, max_pages,
                                       prefix_caching=prefix_caching)
        self.page_size, self.num_slots, self.step_tokens = page_size, num_slots, step_tokens
        self.prefix_caching = prefix_caching
        self.check_next, self.share_boundary = check_next, share_boundary
        self.max_page_updates = max_page_updates(num_slots, step_tokens, page_size)
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which served from it

    @property
    def usage(self) -> float:
        return self.allocator.usage

    def claims(self, req: Request, start: int, stop: int | None = None) -> list[PageClaim]:
        """What another request must share for each full page [start, stop) of ``req`` to
        be its prefix-cache hit: the page's key and, with ``check_next``, the token after
        it (None where it is not known)."""
        keys = req.full_page_keys(self.page_size)[start:stop]
        if not self.check_next:
            return [(key, None) for key in keys]
        return [(key, req.known_token((i + 1) * self.page_size))
                for i, key in enumerate(keys, start)]

    def allocate_prompt(self, req: Request, slot: int, computing: set[PageClaim]
                        ) -> int | None:
        """Gives ``slot`` the pages of the request's known tokens, the cached pages of its
        prefix shared, if the pool has pages for them and its first step, and its first
        page not in the cache is not among ``computing`` (claims of pages about to be
        computed: it waits to share them). Returns the positions the cache served, or
        None (nothing reserved)."""
        tokens = req.known_tokens()
        known = req.prefill_len
        keys = req.full_page_keys(self.page_size)
        # The last known position is always computed: its logits (a new request's first
        # token) and its draft row (the draft's state) come from it.
        hit, boundary = self.allocator.match(keys, tokens, known - 1,
                                             check_next=self.check_next,
                                             share_boundary=self.share_boundary)
        if len(hit) < (known - 1) // self.page_size and self.claims(
                req, len(hit), len(hit) + 1)[0] in computing:
            return None
        if not self.allocator.can_reserve(slot, known + self.step_tokens, hit, boundary):
            return None
        self.allocator.reserve(slot, known, shared=hit, boundary=boundary)
        self.allocator.take_updates(slot)  # the prefill writes the slot's whole row
        cached = len(hit) * self.page_size
        self.prefix_cache_queries += known
        self.prefix_cache_hits += cached
        return cached

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Gives the request's slot the pages of its first ``num_tokens`` positions;
        False (nothing taken) when the pool is short."""
        try:
            self.allocator.reserve(req.slot, num_tokens)
        except OutOfPages:
            return False
        return True

    def cache_pages(self, req: Request) -> None:
        """Offers the request's full, final pages to the prefix cache (host work only
        when it completed a page: a step's bookkeeping stays O(batch), not O(tokens))."""
        # Positions the draft lags behind are not final yet (their draft rows are not in
        # the pool): a request that finishes behind keeps those pages out of the cache.
        computed = req.seq_len - req.draft_lag
        full = min(computed, len(req.prompt) + len(req.output) - 1) // self.page_size
        if not self.prefix_caching or full <= self.allocator.num_registered(req.slot):
            return
        tokens = req.known_tokens()
        self.allocator.register(req.slot, req.full_page_keys(self.page_size, tokens),
                                tokens, computed)

    def free(self, req: Request) -> None:
        """Returns the pages of the request's slot, its final ones cached first (they may
        serve its own recompute after a preemption)."""
        self.cache_pages(req)
        self.allocator.free(req.slot)

    def features_written(self, slot: int, start: int, end: int) -> None:
        """Positions [start, end) of the slot had their target features kept (a prefill
        chunk or a step computed them)."""
        if self.share_boundary:
            self.allocator.features_written(slot, start, end)

    def page_row(self, slot: int) -> np.ndarray:
        return self.allocator.page_row(slot)

    def draft_copy(self, slot: int) -> tuple[int, int]:
        """(column, page) of the slot's boundary page's draft copy; (-1, 0): none."""
        return self.allocator.draft_copy(slot) or (-1, 0)

    def page_updates(self) -> np.ndarray:
        """The page-table entries added since the last call, as a step's rows."""
        return pad_page_updates(self.allocator.take_updates(), self.max_page_updates,
                                self.num_slots)
