"""Escalation to EMERGENCY when DEFAULT is failing, and back when pressure falls."""

from dataclasses import replace

from policy.commands import Mode
from policy.modes import ModeConfig, ModeTracker
from policy.planner import NodeView

S = 1_000_000_000


def view(ts_s, u_kv, ooms=0):
    return NodeView(node="n", ts_ns=int(ts_s * S), u_kv=u_kv, f_ext=0.1, f_int=0.0, psi=u_kv * 1.3,
                    dynamic_units=1000, free_units=100, largest_free_run_units=100, ooms=ooms)


def test_an_oom_escalates_immediately():
    tracker = ModeTracker()
    assert tracker.observe(view(10, 0.5)) is None
    change = tracker.observe(view(20, 0.5, ooms=1))
    assert change and change.to_mode is Mode.EMERGENCY and "OOM" in change.reason
    assert tracker.mode("n") is Mode.EMERGENCY


def test_rising_pressure_after_actions_escalates():
    tracker = ModeTracker(ModeConfig(rising_ticks=3, escalate_u_kv=0.9))
    tracker.observe(view(0, 0.90))
    tracker.note_action("n", 0)
    changes = [tracker.observe(view(10 * i, 0.90 + 0.02 * i)) for i in range(1, 4)]
    assert changes[:2] == [None, None]
    assert changes[2] and "rising" in changes[2].reason


def test_rising_pressure_without_actions_does_not_escalate():
    tracker = ModeTracker(ModeConfig(rising_ticks=3, escalate_u_kv=0.9))
    assert all(tracker.observe(view(10 * i, 0.90 + 0.01 * i)) is None for i in range(6))


def test_deescalates_after_calm_ticks_and_minimum_dwell():
    cfg = ModeConfig(calm_ticks=3, deescalate_u_kv=0.7, min_emergency_s=60)
    tracker = ModeTracker(cfg)
    tracker.observe(view(0, 0.5, ooms=1))
    # calm at once, but the dwell time holds the mode until 60 s
    results = [tracker.observe(view(10 * i, 0.5)) for i in range(1, 6)]
    assert all(r is None for r in results)
    change = tracker.observe(view(60, 0.5))
    assert change and change.to_mode is Mode.DEFAULT
    assert tracker.mode("n") is Mode.DEFAULT


def test_pressure_above_deescalation_line_keeps_emergency():
    tracker = ModeTracker(replace(ModeConfig(), calm_ticks=2, min_emergency_s=0))
    tracker.observe(view(0, 0.5, ooms=1))
    assert all(tracker.observe(view(10 * i, 0.9)) is None for i in range(1, 10))
    assert tracker.mode("n") is Mode.EMERGENCY


def test_modes_are_per_node():
    tracker = ModeTracker()
    tracker.observe(view(0, 0.5, ooms=1))
    assert tracker.mode("n") is Mode.EMERGENCY and tracker.mode("other") is Mode.DEFAULT


def test_mode_changes_are_published_as_alerts_by_the_service():
    import asyncio

    import orjson

    from kvguard.bus.inproc import InprocBus
    from kvguard.settings import Settings
    from policy.budget import BudgetConfig, MemoryBudgetLedger, tick_week
    from policy.engine import EngineConfig, PolicyEngine
    from policy.service import MODE_ALERT, PolicyService

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), b"k"), settings, bus=bus,
                            ledger=MemoryBudgetLedger(BudgetConfig()))

    async def run():
        for i, ooms in enumerate([0, 1]):
            tick = {"node": "n", "ts_ns": (i + 1) * 10 * S, "tick_s": 10.0, "u_kv": 0.6, "f_ext": 0.7,
                    "f_int": 0.0, "psi": 0.9, "free_units": 300, "largest_free_run_units": 100, "ooms": ooms}
            await service.publish(service.handle_tick(tick))
        sub = bus.subscribe([settings.topics.name("alerts")], "t")
        return [orjson.loads(r.value) for r in await sub.getmany(timeout_s=0)]

    alerts = asyncio.run(run())
    assert [(a["name"], a["status"], a["labels"]["mode"]) for a in alerts] == [(MODE_ALERT, "firing", "emergency")]
    assert "OOM" in alerts[0]["summary"]
    assert service.ledger.remaining("n", tick_week(10 * S)) < 3600, "F_ext 0.7 ticks were debited"
