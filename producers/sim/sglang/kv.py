"""The SGLang engine's KV pages as kvguard events, and the pool view the fleet and the actuators read.

One unit per page of the token pool (page ``p`` is offset ``p - 1``: SGLang's page 0 is the padded
slot, never handed out), so the geometry has ``max_total_num_tokens // page_size`` units of
``page_size`` tokens. A page is LIVE while a request's row holds it, CACHED while only the radix
tree does (unlocked: SGLang's evictable tokens), free otherwise; so the mirror's ``u_kv`` is the
share of pages requests hold, SGLang's ``token_usage`` at page granularity.

Rows, from the scheduler's ``KvListener`` calls (``producers.sim.sglang.scheduler``):

- ``admitted``: ADMIT, a SHARE per page of the cached prefix (``page_size`` tokens when the page
  was held by no request: a cached page revived), an ALLOC per new page;
- ``allocated``: ALLOC per page a chunk or a decode step adds;
- ``swapped`` (a checkpoint found the request's pages already cached): FREE of each duplicate
  page, back to the pool, and SHARE of the tree's page that replaces it;
- ``released``: FREE per page of the row, with ``F_TO_CACHE`` for pages the tree keeps, carrying
  the tokens the request computed in it;
- ``reclaimed``: RECLAIM per page the tree evicts (cached to free);
- ``retracted``: PREEMPT after its FREE rows.

Tokens: every computed token is reported by one FILL per step; so the mirror's ``tokens_stored``
follows the tokens in live pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvguard.contracts.events import F_TO_CACHE, EventKind, PoolState, RegionState, free_runs_checksum
from kvguard.contracts.pool_types import PageInfo, PageState, UnknownRequest
from kvguard.producers.sim.sglang.scheduler import KvListener, Req, Scheduler
from kvguard.producers.sim.vllm.kv import EventRecorder

_ADMIT, _ALLOC, _SHARE, _FREE = int(EventKind.ADMIT), int(EventKind.ALLOC), int(EventKind.SHARE), int(EventKind.FREE)
_RECLAIM, _PREEMPT, _SNAPSHOT = int(EventKind.RECLAIM), int(EventKind.PREEMPT), int(EventKind.SNAPSHOT)


class RecordingListener(KvListener):
    """Writes the rows of the module docstring; keeps how many requests hold each page."""

    def __init__(self, recorder: EventRecorder, page_size: int):
        self.recorder = recorder
        self.page_size = page_size
        self.holders: Counter[int] = Counter()

    def _share(self, rid: int, page: int) -> None:
        rec = self.recorder
        revived = self.holders[page] == 0
        self.holders[page] += 1
        rec.row(_SHARE, rec.now_ns, rid, offset=page - 1, size=1, tokens=self.page_size if revived else 0)

    def _alloc(self, rid: int, pages: Sequence[int]) -> None:
        rec = self.recorder
        for page in pages:
            self.holders[page] += 1
            rec.row(_ALLOC, rec.now_ns, rid, offset=page - 1, size=1)

    def _drop(self, page: int) -> None:
        left = self.holders[page] - 1
        if left > 0:
            self.holders[page] = left
        else:
            del self.holders[page]

    def admitted(self, req: Req, shared: Sequence[int], new: Sequence[int]) -> None:
        rec = self.recorder
        rec.row(_ADMIT, rec.now_ns, req.rid)
        for page in shared:
            self._share(req.rid, page)
        self._alloc(req.rid, new)

    def allocated(self, req: Req, pages: Sequence[int]) -> None:
        self._alloc(req.rid, pages)

    def swapped(self, req: Req, dropped: Sequence[int], shared: Sequence[int]) -> None:
        rec = self.recorder
        for page in dropped:
            self._drop(page)
            rec.row(_FREE, rec.now_ns, req.rid, offset=page - 1, size=1, tokens=self.page_size)
        for page in shared:
            self._share(req.rid, page)

    def released(self, req: Req, pages: Sequence[int], cached: Sequence[bool]) -> None:
        rec = self.recorder
        ps = self.page_size
        for index in range(len(pages) - 1, -1, -1):
            page = pages[index]
            tokens = max(0, min(ps, req.committed - index * ps))
            self._drop(page)
            rec.row(_FREE, rec.now_ns, req.rid, flags=F_TO_CACHE if cached[index] else 0, offset=page - 1, size=1,
                    tokens=tokens)

    def reclaimed(self, pages: Sequence[int]) -> None:
        rec = self.recorder
        for page in pages:
            rec.row(_RECLAIM, rec.now_ns, offset=page - 1, size=1)

    def retracted(self, req: Req) -> None:
        rec = self.recorder
        rec.row(_PREEMPT, rec.now_ns, req.rid, tokens=len(req.origin) + len(req.output))


class PagePoolView:
    """What the fleet and the actuators read of the engine's pages (the seed's ``PagedPool`` names).
    ``compact`` moves nothing (pages are uniform); ``reclaim_cached`` evicts unlocked tree pages, as
    SGLang's own eviction does, least recently used first."""

    def __init__(self, engine):
        self._engine = engine

    @property
    def _sched(self) -> Scheduler:
        return self._engine.scheduler

    @property
    def block_tokens(self) -> int:
        return self._sched.page_size

    def take_events(self) -> np.ndarray:
        return self._engine.recorder.take()

    def reclaim_cached(self, units_needed: int, now_ns: int) -> int:
        return self._engine.reclaim_cached(units_needed, now_ns)

    def compact(self, now_ns: int, max_moves: int) -> int:
        return 0

    def has_request(self, req: int) -> bool:
        r = self._sched.requests.get(req)
        return r is not None and r.holds_row

    def requests(self) -> list[int]:
        return [rid for rid, r in self._sched.requests.items() if r.holds_row]

    def request_pages(self, req: int) -> list[PageInfo]:
        r = self._sched.requests.get(req)
        if r is None or not r.holds_row:
            raise UnknownRequest(req)
        ps = self._sched.page_size
        holders = self._engine.listener.holders
        return [PageInfo(p - 1, 1, 0, max(0, min(ps, r.committed - i * ps)), PageState.LIVE, holders[p],
                         i * ps < r.protected) for i, p in enumerate(r.pages)]

    def request_units(self, req: int) -> int:
        r = self._sched.requests.get(req)
        return len(r.pages) if r is not None else 0

    def _states(self):
        s = self._sched
        n = s.pool.num_pages
        state = np.zeros(n, dtype=np.int8)
        tokens = np.zeros(n, dtype=np.int64)
        holders: dict[int, list[int]] = {}
        ps = s.page_size
        for rid, r in s.requests.items():
            if not r.holds_row:
                continue
            for i, page in enumerate(r.pages):
                unit = page - 1
                state[unit] = 1
                tokens[unit] = max(tokens[unit], min(ps, max(0, r.committed - i * ps)))
                holders.setdefault(unit, []).append(rid)
        stack = [s.tree.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for page in node.pages:
                if state[page - 1] == 0:
                    state[page - 1] = 2
        return state, tokens, holders

    def counts(self) -> dict:
        state, tokens, _ = self._states()
        return {"live_units": int((state == 1).sum()), "cached_units": int((state == 2).sum()),
                "free_units": int((state == 0).sum()), "tokens_stored": int(tokens.sum())}

    def snapshot(self, now_ns: int) -> PoolState:
        state, tokens, holders = self._states()
        free = np.concatenate(([False], state == 0, [False]))
        edges = np.flatnonzero(free[1:] != free[:-1])
        offsets, sizes = edges[0::2].astype(np.int64), (edges[1::2] - edges[0::2]).astype(np.int64)
        stored = int(tokens.sum())
        self._engine.recorder.row(_SNAPSHOT, now_ns, offset=int(sizes.max()) if sizes.size else 0, size=int(sizes.size),
                                  tokens=stored, aux=free_runs_checksum(offsets, sizes))
        occupied = np.flatnonzero(state)
        kinds = np.where(state[occupied] == 1, int(RegionState.LIVE), int(RegionState.CACHED)).astype(np.int64)
        refs = [tuple(holders.get(int(u), ())) for u in occupied.tolist()]
        return PoolState(occupied.astype(np.int64), np.ones(occupied.size, dtype=np.int64), kinds,
                         np.zeros(occupied.size, dtype=np.int64), np.where(state[occupied] == 1, tokens[occupied], 0),
                         refs, stored)
