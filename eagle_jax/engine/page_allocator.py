"""Host-side KV pages: how many the pool has (``plan_pool``) and which request owns which
(``PageAllocator``).

The pool itself (``KVPages``, one per model) lives on the device; the target's and the
draft's pools have the same number of pages, and a request's page i holds the same
positions in both (the draft's KV row j sits at the target's position j), so one
allocator and one page table serve both models, but for one page: a prefix hit's
boundary page, which the draft reads from a copy of its own (``PageAllocator``).

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

import collections
import hashlib
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
              unbudgeted_max_model_len: int, max_num_pages: int | None = None) -> PoolPlan:
    """The pool's size and the context limit, from a KV budget in bytes.

    A request's pages reach past its length by the step in flight and the step being
    dispatched (async scheduling reserves for both): 2 * step_tokens positions. Without
    a budget (a CPU) the pool holds every slot at max_model_len, which then defaults to
    at most ``unbudgeted_max_model_len``. ``max_num_pages`` caps the pool whatever the
    budget (the attention kernel's addressing limit). A pool that cannot hold one request
    of the model's full length caps the default max_model_len; an explicit max_model_len
    it cannot hold, or one past the model's limit, is an error naming the fix.
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
    capped = max_num_pages is not None and num_pages > max_num_pages
    if capped:
        num_pages = max_num_pages
    fits = num_pages * page_size - reach
    if fits < served and max_model_len is not None:
        if capped:
            held = (f"a pool of at most {max_num_pages} pages (the attention kernel's limit "
                    "at this page size and head shape)")
            fix = "lower max_model_len"
        else:
            held = f"a KV budget of {budget / 2**30:.2f} GiB"
            fix = "raise kv_cache_memory / kv_cache_memory_fraction or lower max_model_len"
        raise ValueError(
            f"{held} holds {max(fits, 0)} tokens, fewer than one request of max_model_len "
            f"{max_model_len} ({bytes_per_token / 2**10:.1f} KiB per token); {fix}")
    if fits < 2:
        raise ValueError(f"a KV budget of {budget / 2**20:.1f} MiB holds no request; "
                         "raise kv_cache_memory / kv_cache_memory_fraction")
    served = min(served, fits)
    return PoolPlan(served, int(num_pages), pages_for(served + reach, page_size))


class OutOfPages(Exception):
    """The pool has fewer free pages than a reservation needs (the scheduler preempts)."""


def page_hashes(tokens, page_size: int, known: list[bytes] = ()) -> list[bytes]:
    """The chained key of every full page of ``tokens``: page i's key digests page i-1's
    key and the page's tokens, so equal keys mean equal prefixes (a 128-bit BLAKE2b: a
    collision would hand one request another's KV, so no 64-bit ``hash``). ``known``:
    the keys of the first pages, computed before (extended, not recomputed).

    Only the new pages' tokens are converted: a running request extends its keys each
    time it completes a page, and converting all its tokens then cost ~0.25 ms at 8k
    tokens, once per page per request, on the host between steps."""
    keys = list(known)
    parent = keys[-1] if keys else b""
    new = tokens[len(keys) * page_size:len(tokens) // page_size * page_size]
    data = memoryview(np.asarray(new, np.int64).tobytes())  # (one conversion, no copies)
    step = page_size * 8
    for i in range(len(data) // step):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(data[i * step:(i + 1) * step])
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixHit(NamedTuple):
    """``PageAllocator.match``'s answer: the cached pages that begin a sequence, and
    whether the draft's last row of the last of them is stale for it (``boundary``)."""

    pages: list[int]
    boundary: bool = False


class PageAllocator:
    """Free list, per-owner page lists and the prefix cache of a pool of ``num_pages``.

    Owners are integers (the engine's slots). A page is free (on the free stack: the
    first pages handed out are 0, 1, 2, ..., the last freed the next reused), owned by
    one or more owners (a reference count), or cached: a full page whose key is known,
    that no owner holds, kept for a later request with the same prefix and evicted,
    least recently used first, only when the free stack is empty.

    Prefix caching. ``register`` gives a key to each full page whose content is final
    (every position of it is in the pool, and so is the token after it); ``match``
    finds the longest run of keyed pages that begins a token sequence, and ``reserve``
    shares them (``shared=``) instead of taking new ones. A shared page is never
    written: an owner writes only at positions at or past its own length, which lie in
    pages of its own.

    The draft's KV row j is computed from the token at j + 1 (and the target's feature
    at j), so a page's last draft row depends on the first token *after* the page. Each
    keyed page records that token (``next_token``); ``match`` with ``check_next`` stops
    before a last page whose next token differs from the request's, and that page is
    recomputed (at most ``page_size`` extra prefill positions). Inside a run of matched
    pages the next token lies in the following matched page, so it agrees already.
    With ``share_boundary`` such a page is shared all the same where the target's feature
    at its last position was kept (``features_written``): it is then a *boundary* page
    (``PrefixHit.boundary``), and ``reserve`` gives the owner one page more, its draft's
    private copy of it (``draft_copy``), whose last draft row the request recomputes.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_owner: int,
                 prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_owner = max_pages_per_owner
        self.prefix_caching = prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))  # pop() takes from the end
        self._refs = [0] * num_pages
        self._owned: dict[int, list[int]] = {}
        self._pending: list[tuple[int, int, int]] = []  # (owner, index, page) not yet applied
        self._page_of: dict[bytes, int] = {}  # key -> keyed page
        self._key_of: dict[int, bytes] = {}  # keyed page -> key
        self._next_token: dict[int, int] = {}  # keyed page -> the token after it
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._registered: dict[int, int] = {}  # owner -> pages of it already keyed
        self._featured: set[int] = set()  # pages whose last position's feature is kept
        self._draft_copy: dict[int, tuple[int, int]] = {}  # owner -> (index, page)

    @property
    def num_free(self) -> int:
        """Pages a reservation can take: free, or cached and unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Keyed pages (held by a request or not)."""
        return len(self._page_of)

    @property
    def usage(self) -> float:
        """Fraction of the pool's pages held by requests (cached, unheld pages are free)."""
        return 1.0 - self.num_free / self.num_pages

    def pages(self, owner: int) -> list[int]:
        return self._owned.get(owner, [])

    # ------------------------------------------------------------- prefix cache
    def match(self, keys: list[bytes], tokens, max_tokens: int, check_next: bool,
              share_boundary: bool = False) -> PrefixHit:
        """The cached pages that begin a sequence: ``keys`` are its ``page_hashes``,
        ``tokens`` its tokens; at most ``max_tokens`` positions are matched (the engine
        always computes a request's last known position). Takes nothing."""
        if not self.prefix_caching:
            return PrefixHit([])
        hit = []
        for key in keys[:max_tokens // self.page_size]:
            page = self._page_of.get(key)
            if page is None:
                break
            hit.append(page)
        if check_next and hit and (self._next_token[hit[-1]]
                                   != tokens[len(hit) * self.page_size]):
            if share_boundary and hit[-1] in self._featured:
                return PrefixHit(hit, boundary=True)
            hit.pop()
        return PrefixHit(hit)

    def features_written(self, owner: int, start: int, end: int) -> None:
        """Records that the target's feature at the last position of each page that
        positions [start, end) of ``owner`` cover was kept (by the prefill chunk or the
        decode step that computed them)."""
        pages = self._owned.get(owner, [])
        first = (start // self.page_size + 1) * self.page_size - 1
        for last in range(first, end, self.page_size):
            self._featured.add(pages[last // self.page_size])

    def draft_copy(self, owner: int) -> tuple[int, int] | None:
        """(index, page): the owner's boundary page's index in its page list and the page
        its draft reads instead; None without one."""
        return self._draft_copy.get(owner)

    def num_registered(self, owner: int) -> int:
        """The owner's leading pages that ``register`` has seen (keyed, or left private)."""
        return self._registered.get(owner, 0)

    def register(self, owner: int, keys: list[bytes], tokens, num_computed: int) -> None:
        """Keys the owner's full pages whose content is final: positions below
        ``num_computed`` are in the pool, and ``tokens`` (the owner's known tokens; the
        token after a page must be known too) extends ``keys``. A key some other page
        has already leaves this page private."""
        if not self.prefix_caching:
            return
        owned = self._owned.get(owner, [])
        full = min(num_computed, len(tokens) - 1) // self.page_size
        done = self._registered.get(owner, 0)
        end = min(full, len(keys), len(owned))
        for i in range(done, end):
            page = owned[i]
            if page in self._key_of or keys[i] in self._page_of:
                continue
            self._page_of[keys[i]] = page
            self._key_of[page] = keys[i]
            self._next_token[page] = int(tokens[(i + 1) * self.page_size])
        self._registered[owner] = max(done, end)

    # -------------------------------------------------------------- reservation
    def can_reserve(self, owner: int, num_tokens: int, shared: list[int] = (),
                    boundary: bool = False) -> bool:
        revived = sum(1 for p in shared if p in self._evictable)
        return self._missing(owner, num_tokens, len(shared)) + boundary <= (
            self.num_free - revived)

    def _missing(self, owner: int, num_tokens: int, num_shared: int = 0) -> int:
        want = min(pages_for(num_tokens, self.page_size), self.max_pages_per_owner)
        return max(0, want - len(self._owned.get(owner, ())) - num_shared)

    def reserve(self, owner: int, num_tokens: int, shared: list[int] = (),
                boundary: bool = False) -> None:
        """Makes ``owner``'s pages cover positions [0, num_tokens) (capped at the page
        table's width), first sharing ``shared`` (cached pages from ``match``, only for
        an owner with no pages yet; ``boundary``: the last of them is a boundary page,
        and one more page becomes its draft's copy). Raises OutOfPages, taking nothing,
        when the pool is short."""
        if not shared and not self._missing(owner, num_tokens):
            return  # already covered: the common case of a decode step
        if not self.can_reserve(owner, num_tokens, shared, boundary):
            needed = self._missing(owner, num_tokens, len(shared)) + boundary
            raise OutOfPages(f"{needed} pages needed, {self.num_free} free")
        if boundary and not shared:
            raise ValueError("a boundary page is the last of the shared pages")
        owned = self._owned.setdefault(owner, [])
        if shared:
            if owned:
                raise ValueError("shared pages begin an owner's list: reserve them first")
            for page in shared:
                self._evictable.pop(page, None)
                self._refs[page] += 1
                self._pending.append((owner, len(owned), page))
                owned.append(page)
            self._registered[owner] = len(shared)
            if boundary:
                copy = self._take()
                self._refs[copy] = 1
                self._draft_copy[owner] = (len(shared) - 1, copy)
        for _ in range(self._missing(owner, num_tokens)):
            page = self._take()
            self._refs[page] = 1
            self._pending.append((owner, len(owned), page))
            owned.append(page)

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)  # least recently used
            del self._page_of[self._key_of.pop(page)]
            del self._next_token[page]
        self._featured.discard(page)  # its new owner writes it anew
        return page

    def free(self, owner: int) -> None:
        """Drops every page reference of ``owner``: a page no one holds becomes cached
        (keyed, most recently used) or free."""
        pages = self._owned.pop(owner, [])
        if owner in self._draft_copy:
            pages.append(self._draft_copy.pop(owner)[1])
        self._registered.pop(owner, None)
        self._pending = [u for u in self._pending if u[0] != owner]
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def check(self) -> None:
        """Asserts the pool's invariants (tests): every page is exactly one of free,
        cached-unheld, or held, and reference counts equal the owners holding it."""
        held = collections.Counter(p for pages in self._owned.values() for p in pages)
        held.update(page for _, page in self._draft_copy.values())
        assert all(self._refs[p] == held.get(p, 0) for p in range(self.num_pages))
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        assert not (free | evictable) & set(held)
        assert len(free) + len(evictable) + len(held) == self.num_pages
        assert evictable <= set(self._key_of) and not free & set(self._key_of)
        assert all(self._page_of[k] == p for p, k in self._key_of.items())

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
