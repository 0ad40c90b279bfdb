"""Property-based tests of the paged pool: random operation sequences keep its invariants, and its
events replayed into the independent reference mirror (pool_replay.py) reproduce it exactly.

Profiles: ``ci`` (default, a few seconds) and ``thorough``; pick with KVGUARD_HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvguard.contracts.events import Geometry, Handling
from kvguard.producers.sim.seed.pool import (
    CheckpointMissing,
    PagedPool,
    PageState,
    PoolExhausted,
    SwapFull,
    UnknownPage,
    UnknownRequest,
)
from tests.unit.producers.sim.seed.pool_replay import ReplayMirror

settings.register_profile("ci", max_examples=60, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("KVGUARD_HYPOTHESIS_PROFILE", "ci"))

REQS = st.integers(0, 7)
CHAINS = [(), (1, 2, 3), (1, 2, 4), (1, 9), (5, 6, 7, 8)]
HANDLINGS = st.sampled_from(list(Handling))


class PoolMachine(RuleBasedStateMachine):
    classes: tuple[int, ...] = (1, 8)
    units = 96
    unit_tokens = 2

    @initialize(fit=st.sampled_from(["best", "first"]))
    def setup(self, fit):
        g = Geometry(total_bytes=1 << 30, weights_bytes=1 << 29, context_bytes=0, gpu_memory_utilization=0.9,
                     unit_tokens=self.unit_tokens, kv_bytes_per_token=64, dynamic_units=self.units,
                     page_classes=self.classes)
        self.pool = PagedPool(g, node="prop", swap_capacity_units=24, retain_ttl_ns=50, fit=fit)
        self.mirror = ReplayMirror(self.units, self.unit_tokens)
        self.now = 0
        self.chain_of: dict[int, tuple] = {}
        self.workspace: list[int] = []

    def tick(self) -> int:
        self.now += 10
        return self.now

    def fingerprint(self, req=None):
        runs = tuple(map(tuple, self.pool.free_runs()))
        pages = None
        if req is not None and self.pool.has_request(req):
            pages = tuple(self.pool.request_pages(req))
        return runs, self.pool.metrics(), pages, self.pool.requests()

    # ---------------------------------------------------------------- rules
    @rule(req=REQS, n_tokens=st.integers(1, 60), chain=st.sampled_from(CHAINS))
    def grow(self, req, n_tokens, chain):
        chain = self.chain_of.setdefault(req, chain)
        can = self.pool.can_grow(req, n_tokens, chain)
        before = self.fingerprint(req)
        try:
            self.pool.grow(req, n_tokens, self.tick(), block_hashes=chain)
        except PoolExhausted as exc:
            assert not can
            assert self.fingerprint(req) == before
            assert exc.largest_free_run == self.pool.largest_free_run
        else:
            assert can

    @rule(req=REQS, cache_prefix=st.booleans())
    def release(self, req, cache_prefix):
        table = self.pool._tables.get(req)
        pages = [e for e in table.entries if type(e).__name__ == "_Page"] if table else []
        users_before = [len(p.holders) for p in pages]
        registered = [p.registered for p in pages]
        freed = self.pool.release(req, self.tick(), cache_prefix=cache_prefix)
        self.chain_of.pop(req, None)
        for page, users, was_registered in zip(pages, users_before, registered):
            if users > 1:  # others still use it: stays live, one reference fewer
                assert page.state == PageState.LIVE and len(page.holders) == users - 1 and req not in page.holders
            elif cache_prefix and was_registered:
                assert page.state == PageState.CACHED
            else:
                assert page.state == PageState.FREED
        assert freed >= sum(p.size for p in pages if p.state == PageState.FREED)

    @rule(req=REQS, handling=HANDLINGS, how=st.sampled_from(["all", "tail", "offsets"]), data=st.data())
    def evict(self, req, handling, how, data):
        pages = None
        if how == "tail":
            pages = data.draw(st.integers(0, 4))
        elif how == "offsets" and self.pool.has_request(req):
            live = [p.offset for p in self.pool.request_pages(req) if p.state == PageState.LIVE]
            pages = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3)) if live else []
        before = self.fingerprint(req)
        try:
            result = self.pool.evict(req, self.tick(), pages=pages, handling=handling)
        except (UnknownRequest, SwapFull):
            assert self.fingerprint(req) == before
        else:
            assert result.units_freed + result.units_retained <= sum(
                p.size for p in (before[2] or ()) if p.state == PageState.LIVE)

    @rule(req=REQS)
    def swap_in(self, req):
        before = self.fingerprint(req)
        try:
            self.pool.swap_in(req, self.tick())
        except (UnknownRequest, PoolExhausted, CheckpointMissing):
            assert self.fingerprint(req) == before

    @rule(req=REQS)
    def remap(self, req):
        try:
            self.pool.remap(req, self.tick())
        except UnknownRequest:
            pass

    @rule(advance=st.integers(0, 80))
    def expire(self, advance):
        self.now += advance
        self.pool.expire(self.now)

    @rule(units=st.integers(1, 40))
    def reclaim(self, units):
        cached = self.pool.metrics().cached_units
        freed = self.pool.reclaim_cached(units, self.tick())
        assert freed >= min(units, cached) or freed == cached

    @rule(units=st.integers(1, 30))
    def alloc_workspace(self, units):
        try:
            self.workspace.append(self.pool.alloc_workspace(units, self.tick(), tokens=units))
        except PoolExhausted:
            assert self.pool.largest_free_run < units

    @precondition(lambda self: self.workspace)
    @rule(data=st.data())
    def free_workspace(self, data):
        offset = data.draw(st.sampled_from(self.workspace))
        self.workspace.remove(offset)
        self.pool.free_workspace(offset, self.tick())

    @rule(data=st.data())
    def migrate(self, data):
        offsets = sorted(self.pool._pages)
        if not offsets:
            with pytest.raises(UnknownPage):
                self.pool.migrate(0, self.tick())
            return
        offset = data.draw(st.sampled_from(offsets))
        before, squares_before = self.pool.metrics(), self.squared_runs()
        new = self.pool.migrate(offset, self.tick())
        after, squares_after = self.pool.metrics(), self.squared_runs()
        if new is None:
            assert squares_after == squares_before and after == before
        else:  # fewer free runs, or as many with the free space more concentrated
            assert after.n_free_runs < before.n_free_runs or (
                after.n_free_runs == before.n_free_runs and squares_after > squares_before)
        assert after.tokens_stored == before.tokens_stored and after.live_units == before.live_units

    def squared_runs(self) -> int:
        return int((self.pool.free_runs()[1] ** 2).sum())

    @rule(max_moves=st.integers(1, 6))
    def compact(self, max_moves):
        before = self.pool.metrics()
        self.pool.compact(self.tick(), max_moves)
        after = self.pool.metrics()
        assert after.n_free_runs <= before.n_free_runs and after.tokens_stored == before.tokens_stored

    @rule()
    def snapshot(self):
        state = self.pool.snapshot(self.tick())
        assert int(state.size.sum()) + self.pool.free_units == self.units

    @rule()
    def reset(self):
        self.pool.reset(self.tick())
        self.workspace.clear()
        self.chain_of.clear()

    # ---------------------------------------------------------------- invariants
    @invariant()
    def units_are_conserved(self):
        m = self.pool.metrics()
        assert m.free_units + m.live_units + m.cached_units + m.retained_units + m.workspace_units == self.units

    @invariant()
    def occupied_runs_never_overlap_and_cover_what_is_not_free(self):
        spans = [(p.offset, p.size) for p in self.pool._pages.values()]
        spans += list(self.pool._workspace.items())
        spans += list(zip(*map(list, self.pool.free_runs())))
        spans.sort()
        position = 0
        for offset, size in spans:
            assert offset == position, f"gap or overlap at unit {position}: next span starts at {offset}"
            position = offset + size
        assert position == self.units

    @invariant()
    def free_runs_are_never_adjacent(self):
        offsets, sizes = self.pool.free_runs()
        ends = offsets + sizes
        assert not set(ends.tolist()) & set(offsets.tolist())

    @invariant()
    def reference_counts_match_the_page_tables(self):
        refs: dict[int, list[int]] = {}
        for req, table in self.pool._tables.items():
            for entry in table.entries:
                if type(entry).__name__ == "_Page":
                    refs.setdefault(id(entry), []).append(req)
        live_units = tokens = 0
        for page in self.pool._pages.values():
            if page.state == PageState.LIVE:
                assert page.holders, "a live page without holders"
                assert sorted(page.holders) == sorted(refs.pop(id(page), [])), "holders differ from tables"
                live_units += page.size
                tokens += page.tokens
            else:
                assert not page.holders, f"a {page.state.name} page keeps holders"
        assert not refs, "a page table points at a page that holds no units"
        m = self.pool.metrics()
        assert (m.live_units, m.tokens_stored) == (live_units, tokens)
        assert m.cached_units == sum(p.size for p in self.pool._lru)

    @invariant()
    def cached_pages_are_exactly_the_revivable_unheld_pages(self):
        for key, page in self.pool._by_key.items():
            assert page.registered and page.key == key and page.state in (PageState.LIVE, PageState.CACHED)
        assert all(page.registered and page.state == PageState.CACHED for page in self.pool._lru)

    @invariant()
    def replayed_events_reproduce_the_pool(self):
        self.mirror.apply(self.pool.take_events())
        offsets, sizes = self.pool.free_runs()
        m_offsets, m_sizes = self.mirror.free_runs()
        assert offsets.tolist() == m_offsets.tolist() and sizes.tolist() == m_sizes.tolist()
        m = self.pool.metrics()
        for name, value in self.mirror.metrics().items():
            assert getattr(m, name) == value, name


class SingleClassPoolMachine(PoolMachine):
    classes = (4,)
    units = 80


TestPoolDualClass = PoolMachine.TestCase
TestPoolDualClass.settings = PROFILE
TestPoolSingleClass = SingleClassPoolMachine.TestCase
TestPoolSingleClass.settings = PROFILE
