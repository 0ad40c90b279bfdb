"""The drain-and-restart guard's decisions over ticks (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from kvguard.contracts.tick import Tick
from kvguard.policy.drain_guard import (DRAIN, DRAINING, IDLE, RESTART, RESTARTING, UNDRAIN, DrainRestartConfig,
                                        DrainRestartGuard)

S = 1_000_000_000


def tick(node="a", ts_s=0.0, p=0.0, reserved=0.01, running=5, waiting=0, ooms=0, u_kv=0.5, arrivals=1):
    values = {f.name: 0 for f in dataclasses.fields(Tick) if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}
    values.update(node=node, ts_ns=int(ts_s * S), tick_s=10.0, synced=True, p_oom=p, util_activation=reserved,
                  util_reserved_unused=0.0, requests_running=running, requests_waiting=waiting, ooms=ooms, u_kv=u_kv,
                  arrivals=arrivals)
    return Tick(**values)


def leaking(guard, node, t0, t1, p_from, *, step=10.0, rate=1e-5):
    """Ticks of a node whose reserved share grows at ``rate`` per s; P(OOM) 0.9 from ``p_from``."""
    out = []
    t = t0
    while t < t1:
        out += guard.observe(tick(node, t, p=0.9 if t >= p_from else 0.05, reserved=0.01 + rate * t))
        t += step
    return out


def test_drains_a_growing_node_then_restarts_it_once_drained():
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, confirm_ticks=3, min_up_s=600))
    acts = leaking(g, "a", 0, 1500, p_from=1200)
    assert [a.kind for a in acts] == [DRAIN]
    assert acts[0].ts_ns == 1220 * S  # the third hot tick in a row
    assert g.state("a") == DRAINING
    assert g.observe(tick("a", 1510, p=0.9, reserved=0.03, running=2)) == []  # still running: wait
    (act,) = g.observe(tick("a", 1520, p=0.9, reserved=0.03, running=0, waiting=0))
    assert act.kind == RESTART
    g.restarted("a", 1520 * S, ok=True)
    assert g.state("a") == RESTARTING and g.counters.restarts == 1
    g.observe(tick("a", 1590, running=0, u_kv=0.0, arrivals=0))  # down
    assert g.state("a") == RESTARTING
    g.observe(tick("a", 1600, running=1, reserved=0.01))  # serving again
    assert g.state("a") == IDLE
    # just restarted: a high P(OOM) does not drain it again before min_up_s
    assert leaking(g, "a", 1610, 1700, p_from=1610) == []


def test_no_drain_without_growth_of_the_engines_own_memory():
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, min_up_s=0))
    acts = leaking(g, "a", 0, 1500, p_from=600, rate=0.0)  # P(OOM) high but flat memory (a neighbour)
    assert acts == []
    assert g.counters.not_growth > 0 and g.counters.drains == 0


def test_at_most_max_draining_nodes_out_at_once():
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, min_up_s=0, max_draining=1))
    kinds = {}
    for t in range(0, 1500, 10):
        for node in ("a", "b"):
            for act in g.observe(tick(node, t, p=0.9 if t >= 1000 else 0.0, reserved=0.01 + 1e-5 * t)):
                kinds.setdefault(node, []).append(act.kind)
    assert kinds == {"a": [DRAIN]}
    assert g.counters.held_by_fleet > 0


def test_a_drain_that_never_empties_is_given_up():
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, min_up_s=0, drain_timeout_s=100))
    acts = leaking(g, "a", 0, 1300, p_from=1000)
    assert [a.kind for a in acts] == [DRAIN, UNDRAIN, DRAIN]
    assert g.counters.given_up == 1
    assert acts[1].ts_ns - acts[0].ts_ns == 100 * S  # given up after drain_timeout_s
    assert acts[2].ts_ns - acts[1].ts_ns >= 100 * S  # and not tried again for as long


def test_refused_restart_is_counted_and_retried():
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, min_up_s=0))
    leaking(g, "a", 0, 1100, p_from=1000)
    (act,) = g.observe(tick("a", 1100, p=0.9, running=0, waiting=0, reserved=0.03))
    g.restarted("a", act.ts_ns, ok=False)
    assert g.counters.restart_refused == 1 and g.state("a") == DRAINING
    assert g.observe(tick("a", 1110, p=0.9, running=0, waiting=0, reserved=0.03))[0].kind == RESTART


def test_config_refuses_nonsense():
    with pytest.raises(ValueError, match="p_threshold"):
        DrainRestartConfig(p_threshold=0.0)


def test_with_a_capacity_it_drains_as_late_as_is_safe():
    # reserved share 0.01 + 1e-5/s: reaches 0.03 at t = 2000 s; drain_tte_s 180 -> not before ~1820 s
    g = DrainRestartGuard(DrainRestartConfig(p_threshold=0.5, min_up_s=0, capacity=0.03, drain_tte_s=180))
    acts = leaking(g, "a", 0, 2000, p_from=1000)
    assert [a.kind for a in acts] == [DRAIN]
    assert 1810 * S <= acts[0].ts_ns <= 1830 * S
    assert g.counters.not_yet > 0
