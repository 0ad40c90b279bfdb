"""A deliberately simple reference mirror of the pool, rebuilt only from its events (tests only).

It keeps one numpy array with a state per unit of D and a dict of occupied regions, and recomputes
free runs by scanning the whole array: slow and obviously right, so it can judge the fast pool.
Every row is checked against what the mirror knows (a FREE of a page nobody holds, an ALLOC over
occupied units, ...) and a violation raises ReplayError naming the row.
"""

from __future__ import annotations

import numpy as np

from kvguard.contracts import pressure
from kvguard.contracts.events import F_TO_CACHE, EventKind, Handling, free_runs_checksum

FREE, LIVE, CACHED, RETAINED, WORKSPACE = 0, 1, 2, 3, 4


class ReplayError(AssertionError):
    pass


class ReplayMirror:
    def __init__(self, dynamic_units: int, unit_tokens: int, reserved_frac: float = 0.05):
        self.dynamic_units = dynamic_units
        self.unit_tokens = unit_tokens
        self.reserved_frac = reserved_frac
        self.reset()

    def reset(self) -> None:
        self.unit_state = np.zeros(self.dynamic_units, dtype=np.int8)
        self.regions: dict[int, dict] = {}  # offset -> {size, state, holders, tokens}
        self.tokens_stored = 0
        self.snapshots_checked = 0

    # ---- replay ------------------------------------------------------------------------------
    def apply(self, events: np.ndarray) -> None:
        for i, row in enumerate(events):
            try:
                self._apply_row(row)
            except ReplayError as exc:
                raise ReplayError(f"row {i} ({EventKind(int(row['kind'])).name}): {exc}") from None

    def _apply_row(self, row) -> None:
        kind = EventKind(int(row["kind"]))
        req, offset, size, tokens = int(row["req"]), int(row["offset"]), int(row["size"]), int(row["tokens"])
        flags = int(row["flags"])
        if kind in (EventKind.ALLOC, EventKind.SWAP_IN):
            self._occupy(offset, size, LIVE, [req], tokens)
            self.tokens_stored += tokens
        elif kind == EventKind.SHARE:
            r = self._region(offset, size, (LIVE, CACHED))
            if r["state"] == CACHED:
                self._set(offset, r, LIVE)
                r["holders"] = [req]
                self.tokens_stored += tokens
            else:
                if req in r["holders"]:
                    raise ReplayError(f"request {req} already holds page {offset}")
                r["holders"].append(req)
        elif kind in (EventKind.FREE, EventKind.EVICT):
            r = self._region(offset, size, (LIVE,))
            if req not in r["holders"]:
                raise ReplayError(f"request {req} does not hold page {offset}")
            r["holders"].remove(req)
            if not r["holders"]:
                self.tokens_stored -= tokens
                if kind == EventKind.FREE and flags & F_TO_CACHE:
                    self._set(offset, r, CACHED)
                elif kind == EventKind.EVICT and flags == Handling.RETAIN:
                    self._set(offset, r, RETAINED)
                else:
                    self._release(offset)
        elif kind == EventKind.FILL:
            self.tokens_stored += tokens
        elif kind == EventKind.RECLAIM:
            self._region(offset, size, (CACHED,))
            self._release(offset)
        elif kind == EventKind.REMAP:
            r = self._region(offset, size, (RETAINED,))
            self._set(offset, r, LIVE)
            r["holders"] = [req]
            self.tokens_stored += tokens
        elif kind == EventKind.EXPIRE:
            self._region(offset, size, (RETAINED,))
            self._release(offset)
        elif kind == EventKind.MIGRATE:
            r = self._region(offset, size, (LIVE, CACHED, RETAINED))
            self._release(offset)
            self._occupy(int(row["aux"]), size, r["state"], r["holders"], r["tokens"])
        elif kind == EventKind.WS_ALLOC:
            self._occupy(offset, size, WORKSPACE, [], 0)
        elif kind == EventKind.WS_FREE:
            self._region(offset, size, (WORKSPACE,))
            self._release(offset)
        elif kind == EventKind.RESET:
            self.reset()
        elif kind == EventKind.SNAPSHOT:
            self._check_snapshot(row)
        # ARRIVE, ADMIT, FINISH, PREEMPT, ALLOC_FAIL, OOM, STEP, SWAP_OUT(unused): no memory change

    def _occupy(self, offset, size, state, holders, tokens) -> None:
        if offset < 0 or offset + size > self.dynamic_units or size <= 0:
            raise ReplayError(f"run [{offset}, {offset + size}) outside D={self.dynamic_units}")
        if self.unit_state[offset:offset + size].any():
            raise ReplayError(f"run [{offset}, {offset + size}) overlaps occupied units")
        self.unit_state[offset:offset + size] = state
        self.regions[offset] = {"size": size, "state": state, "holders": list(holders), "tokens": tokens}

    def _region(self, offset, size, states) -> dict:
        r = self.regions.get(offset)
        if r is None or r["size"] != size:
            raise ReplayError(f"no region of {size} units at {offset}")
        if r["state"] not in states:
            raise ReplayError(f"region at {offset} is in state {r['state']}, expected one of {states}")
        return r

    def _set(self, offset, r, state) -> None:
        r["state"] = state
        self.unit_state[offset:offset + r["size"]] = state

    def _release(self, offset) -> None:
        r = self.regions.pop(offset)
        self.unit_state[offset:offset + r["size"]] = FREE

    def _check_snapshot(self, row) -> None:
        offsets, sizes = self.free_runs()
        got = (int(row["offset"]), int(row["size"]), int(row["tokens"]), int(row["aux"]))
        want = (int(sizes.max()) if len(sizes) else 0, len(sizes), self.tokens_stored,
                free_runs_checksum(offsets, sizes))
        if got != want:
            raise ReplayError(f"SNAPSHOT (largest, runs, tokens, checksum) {got} != mirror {want}")
        self.snapshots_checked += 1

    # ---- queries -------------------------------------------------------------------------------
    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        free = np.concatenate(([False], self.unit_state == FREE, [False]))
        edges = np.flatnonzero(np.diff(free.astype(np.int8)))
        starts, ends = edges[0::2], edges[1::2]
        return starts.astype(np.int64), (ends - starts).astype(np.int64)

    def units(self, state: int) -> int:
        return int((self.unit_state == state).sum())

    def metrics(self) -> dict:
        _, sizes = self.free_runs()
        free = int(sizes.sum())
        largest = int(sizes.max()) if len(sizes) else 0
        live = self.units(LIVE)
        f_ext = pressure.f_ext(free, largest)
        f_int = pressure.f_int(self.tokens_stored, live, self.unit_tokens)
        return {"live_units": live, "cached_units": self.units(CACHED), "retained_units": self.units(RETAINED),
                "workspace_units": self.units(WORKSPACE), "free_units": free, "largest_free_run": largest,
                "tokens_stored": self.tokens_stored, "u_kv": live / self.dynamic_units, "f_ext": f_ext,
                "f_int": f_int,
                "psi": pressure.psi(live, self.units(WORKSPACE), self.dynamic_units, f_ext, f_int,
                                    self.reserved_frac)}
