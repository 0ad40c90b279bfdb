"""A deliberately simple, per-event reference allocator for the streams tests.

It performs random but consistent operations (one Python object per page, a boolean array per
unit), records the EVENT_DTYPE rows the event contract prescribes, and knows the exact metrics at
every point. The vectorised mirror must agree with it; the two share no code.
"""

from __future__ import annotations

import random

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import (
    EVENT_DTYPE,
    F_TO_CACHE,
    EventBatch,
    Geometry,
    Handling,
    Outcome,
    PoolState,
    RegionState,
    free_runs_checksum,
)
from kvguard.contracts.events import (
    EventKind as K,
)


def small_geometry(units: int = 256, unit_tokens: int = 4, classes=(1, 16)) -> Geometry:
    kv = 1024
    return Geometry(total_bytes=units * unit_tokens * kv * 2, weights_bytes=units * unit_tokens * kv // 2,
                    context_bytes=0, gpu_memory_utilization=0.75, unit_tokens=unit_tokens,
                    kv_bytes_per_token=kv, dynamic_units=units, page_classes=tuple(classes))


class Page:
    __slots__ = ("size", "cls", "state", "refs", "tokens")

    def __init__(self, size, cls, state, refs, tokens):
        self.size, self.cls, self.state, self.refs, self.tokens = size, cls, state, refs, tokens


class RefPool:
    def __init__(self, geometry: Geometry, seed: int = 0):
        self.g = geometry
        self.D = geometry.dynamic_units
        self.rng = random.Random(seed)
        self.used = np.zeros(self.D, dtype=bool)
        self.pages: dict[int, Page] = {}  # offset -> page (live/cached/retained)
        self.ws: dict[int, int] = {}
        self.rows: list[tuple] = []
        self.now = 1_000_000_000
        self.next_req = 1
        self.requests: dict[int, dict] = {}  # req -> {"priority", "prompt", "running"}
        self.swapped: list[tuple[int, int, int]] = []  # (req, cls, tokens)

    # ------------------------------------------------------------ recording
    def emit(self, kind, req=0, offset=0, size=0, tokens=0, cls=0, flags=0, aux=0):
        self.rows.append((self.now, int(kind), cls, flags, req, offset, size, tokens, aux))

    def events(self, start=0, stop=None) -> np.ndarray:
        return np.array(self.rows[start:stop], dtype=EVENT_DTYPE)

    # ------------------------------------------------------------ exact state
    def free_runs(self):
        free = ~self.used
        edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        return starts, ends - starts

    def metrics(self) -> dict:
        live = sum(p.size for p in self.pages.values() if p.state == RegionState.LIVE)
        cached = sum(p.size for p in self.pages.values() if p.state == RegionState.CACHED)
        retained = sum(p.size for p in self.pages.values() if p.state == RegionState.RETAINED)
        ws = sum(self.ws.values())
        _, sizes = self.free_runs()
        free = int(sizes.sum())
        largest = int(sizes.max()) if sizes.size else 0
        tokens = sum(p.tokens for p in self.pages.values() if p.state == RegionState.LIVE)
        fe = pressure.f_ext(free, largest)
        fi = pressure.f_int(tokens, live, self.g.unit_tokens)
        return dict(live_units=live, cached_units=cached, retained_units=retained, workspace_units=ws,
                    free_units=free, largest_free_run=largest, n_free_runs=int(sizes.size),
                    tokens_stored=tokens, u_kv=live / self.D, f_ext=fe, f_int=fi,
                    psi=pressure.psi(live, ws, self.D, fe, fi, self.g.reserved_frac))

    def request_pages(self) -> dict[int, tuple[int, int, int]]:
        """req -> (pages, units, shared_units)."""
        out: dict[int, list[int]] = {}
        for p in self.pages.values():
            for r in p.refs:
                e = out.setdefault(r, [0, 0, 0])
                e[0] += 1
                e[1] += p.size
                e[2] += p.size if len(p.refs) > 1 else 0
        return {r: tuple(v) for r, v in out.items()}

    def state(self) -> PoolState:
        items = sorted([(o, p.size, int(p.state), p.cls, p.tokens, tuple(sorted(p.refs)))
                        for o, p in self.pages.items()]
                       + [(o, s, int(RegionState.WORKSPACE), 0, 0, ()) for o, s in self.ws.items()])
        cols = list(zip(*items)) if items else [()] * 6
        return PoolState(offset=np.array(cols[0], dtype=np.int64), size=np.array(cols[1], dtype=np.int64),
                         state=np.array(cols[2], dtype=np.int64), cls=np.array(cols[3], dtype=np.int64),
                         tokens=np.array(cols[4], dtype=np.int64), refs=list(cols[5]),
                         tokens_stored=self.metrics()["tokens_stored"])

    # ------------------------------------------------------------ operations
    def _place(self, size: int, exclude: int | None = None) -> int | None:
        for off in range(0, self.D - size + 1, size):
            if off != exclude and not self.used[off:off + size].any():
                return off
        return None

    def _occupy(self, off, size, flag=True):
        self.used[off:off + size] = flag

    def _live(self):
        return [o for o, p in self.pages.items() if p.state == RegionState.LIVE]

    def _of_state(self, state):
        return [o for o, p in self.pages.items() if p.state == state]

    def arrive(self):
        req = self.next_req
        self.next_req += 1
        prio = self.rng.randint(0, 10)
        prompt = self.rng.randint(1, 200)
        self.requests[req] = {"priority": prio, "prompt": prompt, "running": False}
        self.emit(K.ARRIVE, req=req, tokens=prompt, cls=prio, aux=50)
        return req

    def admit(self):
        waiting = [r for r, v in self.requests.items() if not v["running"]]
        if waiting:
            r = self.rng.choice(waiting)
            self.requests[r]["running"] = True
            self.emit(K.ADMIT, req=r)

    def finish(self):
        running = [r for r, v in self.requests.items() if v["running"]]
        if not running:
            return
        r = self.rng.choice(running)
        for o in [o for o, p in self.pages.items() if r in p.refs]:
            self.free(r, o, to_cache=self.rng.random() < 0.5)
        del self.requests[r]
        self.emit(K.FINISH, req=r, tokens=3, flags=Outcome.COMPLETED)

    def preempt(self):
        running = [r for r, v in self.requests.items() if v["running"]]
        if not running:
            return
        r = self.rng.choice(running)
        for o in [o for o, p in self.pages.items() if r in p.refs]:
            self.free(r, o, to_cache=False)
        self.requests[r]["running"] = False
        self.emit(K.PREEMPT, req=r, tokens=10)

    def alloc(self, kind=K.ALLOC):
        running = [r for r, v in self.requests.items() if v["running"]]
        if not running:
            return
        r = self.rng.choice(running)
        cls = self.rng.randrange(len(self.g.page_classes))
        size = self.g.page_classes[cls]
        off = self._place(size)
        if off is None:
            self.emit(K.ALLOC_FAIL, req=r, size=size, cls=cls, aux=int(self.free_runs()[1].max(initial=0)))
            return
        tokens = self.rng.randint(1, size * self.g.unit_tokens)
        self._occupy(off, size)
        self.pages[off] = Page(size, cls, RegionState.LIVE, {r}, tokens)
        self.emit(kind, req=r, offset=off, size=size, tokens=tokens, cls=cls)

    def share(self):
        running = [r for r, v in self.requests.items() if v["running"]]
        targets = self._live() + self._of_state(RegionState.CACHED)
        if not running or not targets:
            return
        r = self.rng.choice(running)
        off = self.rng.choice(targets)
        p = self.pages[off]
        if r in p.refs:
            return
        p.refs.add(r)
        p.state = RegionState.LIVE
        self.emit(K.SHARE, req=r, offset=off, size=p.size, tokens=p.tokens, cls=p.cls)

    def fill(self):
        total = 0
        for off in self._live():
            p = self.pages[off]
            room = p.size * self.g.unit_tokens - p.tokens
            if room > 0 and self.rng.random() < 0.5:
                add = self.rng.randint(1, room)
                p.tokens += add
                total += add
        if total:
            self.emit(K.FILL, tokens=total)

    def free(self, r, off, to_cache):
        p = self.pages[off]
        p.refs.discard(r)
        self.emit(K.FREE, req=r, offset=off, size=p.size, tokens=p.tokens, cls=p.cls,
                  flags=F_TO_CACHE if to_cache else 0)
        if not p.refs:
            if to_cache:
                p.state = RegionState.CACHED
            else:
                self._occupy(off, p.size, False)
                del self.pages[off]

    def free_one(self):
        live = self._live()
        if live:
            off = self.rng.choice(live)
            self.free(self.rng.choice(sorted(self.pages[off].refs)), off, self.rng.random() < 0.5)

    def evict(self):
        live = self._live()
        if not live:
            return
        off = self.rng.choice(live)
        p = self.pages[off]
        r = self.rng.choice(sorted(p.refs))
        handling = self.rng.choice(list(Handling))
        p.refs.discard(r)
        self.emit(K.EVICT, req=r, offset=off, size=p.size, tokens=p.tokens, cls=p.cls, flags=handling)
        if not p.refs:
            if handling == Handling.RETAIN:
                p.state = RegionState.RETAINED
            else:
                self._occupy(off, p.size, False)
                del self.pages[off]

    def swap_out(self):
        exclusive = [o for o in self._live() if len(self.pages[o].refs) == 1]
        if not exclusive:
            return
        off = self.rng.choice(exclusive)
        p = self.pages.pop(off)
        (r,) = p.refs
        self._occupy(off, p.size, False)
        self.swapped.append((r, p.cls, p.tokens))
        self.emit(K.SWAP_OUT, req=r, offset=off, size=p.size, tokens=p.tokens, cls=p.cls)

    def swap_in(self):
        if not self.swapped:
            return
        r, cls, tokens = self.swapped.pop(0)
        size = self.g.page_classes[cls]
        off = self._place(size)
        if off is None:
            self.swapped.append((r, cls, tokens))
            return
        self._occupy(off, size)
        self.pages[off] = Page(size, cls, RegionState.LIVE, {r}, tokens)
        self.emit(K.SWAP_IN, req=r, offset=off, size=size, tokens=tokens, cls=cls)

    def remap(self):
        retained = self._of_state(RegionState.RETAINED)
        if not retained:
            return
        off = self.rng.choice(retained)
        p = self.pages[off]
        r = self.arrive()
        p.refs = {r}
        p.state = RegionState.LIVE
        self.emit(K.REMAP, req=r, offset=off, size=p.size, tokens=p.tokens, cls=p.cls)

    def expire(self):
        retained = self._of_state(RegionState.RETAINED)
        if retained:
            off = self.rng.choice(retained)
            p = self.pages.pop(off)
            self._occupy(off, p.size, False)
            self.emit(K.EXPIRE, offset=off, size=p.size, cls=p.cls)

    def reclaim(self):
        cached = self._of_state(RegionState.CACHED)
        if cached:
            off = self.rng.choice(cached)
            p = self.pages.pop(off)
            self._occupy(off, p.size, False)
            self.emit(K.RECLAIM, offset=off, size=p.size, cls=p.cls)

    def migrate(self):
        if not self.pages:
            return
        off = self.rng.choice(sorted(self.pages))
        p = self.pages[off]
        new = self._place(p.size, exclude=off)
        if new is None:
            return
        self._occupy(off, p.size, False)
        self._occupy(new, p.size)
        self.pages[new] = self.pages.pop(off)
        self.emit(K.MIGRATE, req=min(p.refs, default=0), offset=off, size=p.size, tokens=p.tokens,
                  cls=p.cls, aux=new)

    def ws_alloc(self):
        size = self.rng.choice((1, 2, 3, 5, 8))
        for off in range(0, self.D - size + 1):
            if not self.used[off:off + size].any():
                self._occupy(off, size)
                self.ws[off] = size
                self.emit(K.WS_ALLOC, offset=off, size=size, tokens=size * 3)
                return

    def ws_free(self):
        if self.ws:
            off = self.rng.choice(sorted(self.ws))
            size = self.ws.pop(off)
            self._occupy(off, size, False)
            self.emit(K.WS_FREE, offset=off, size=size)

    def step(self):
        self.emit(K.STEP, size=self.rng.randint(1, 100), tokens=self.rng.randint(0, 30), aux=30_000_000)

    def reset(self):
        self.used[:] = False
        self.pages.clear()
        self.ws.clear()
        self.swapped.clear()
        self.emit(K.RESET)
        self.emit(K.OOM, size=16, aux=0)
        for r in [r for r, v in self.requests.items() if v["running"]]:
            del self.requests[r]
            self.emit(K.FINISH, req=r, flags=Outcome.FAILED_OOM)

    def snapshot(self) -> PoolState:
        offs, sizes = self.free_runs()
        m = self.metrics()
        self.emit(K.SNAPSHOT, offset=m["largest_free_run"], size=m["n_free_runs"],
                  tokens=m["tokens_stored"], aux=free_runs_checksum(offs, sizes))
        return self.state()

    OPS = (("arrive", 6), ("admit", 6), ("alloc", 30), ("share", 8), ("fill", 8), ("free_one", 8),
           ("finish", 3), ("preempt", 1), ("evict", 6), ("swap_out", 2), ("swap_in", 2), ("remap", 2),
           ("expire", 2), ("reclaim", 3), ("migrate", 4), ("ws_alloc", 4), ("ws_free", 4), ("step", 5),
           ("reset", 0.2))

    def random_op(self, time_step_ns: int = 10_000_000) -> None:
        self.now += self.rng.randint(0, time_step_ns)
        names, weights = zip(*self.OPS)
        getattr(self, self.rng.choices(names, weights)[0])()


def batches_of(pool_rows: np.ndarray, node: str, geometry: Geometry, cuts: list[int], epoch: int = 0,
               states: dict[int, PoolState] | None = None) -> list[EventBatch]:
    """Split rows at ``cuts`` into EventBatches with seq 0, 1, …; geometry on the first."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(pool_rows))), len(pool_rows)]
    out = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        state = None
        if states:
            inside = [s for s in states if a <= s < b]
            state = states[max(inside)] if inside else None
        out.append(EventBatch(node=node, seq=i, epoch=epoch, events=pool_rows[a:b],
                              geometry=geometry if i == 0 or state is not None else None, state=state))
    return out
