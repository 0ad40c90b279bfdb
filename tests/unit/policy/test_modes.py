"""Escalation to EMERGENCY when DEFAULT is failing, and back when pressure falls."""

from dataclasses import replace

from kvguard.contracts.commands import Mode
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.modes import ModeConfig, ModeTracker
from kvguard.policy.planner import NodeView
from kvguard.wire.schemas import MetricTick

S = NS_PER_S


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
    from kvguard.config.settings import Settings
    from kvguard.policy.budget import BudgetConfig, MemoryBudgetLedger, tick_week
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import MODE_ALERT, PolicyService

    settings = Settings()
    bus = InprocBus.from_settings(settings)
    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), b"k"), settings, bus=bus,
                            ledger=MemoryBudgetLedger(BudgetConfig()))

    async def run():
        for i, ooms in enumerate([0, 1]):
            tick = {"node": "n", "ts_ns": (i + 1) * 10 * S, "tick_s": 10.0, "u_kv": 0.6, "f_ext": 0.7,
                    "f_int": 0.0, "psi": 0.9, "free_units": 300, "largest_free_run_units": 100, "ooms": ooms}
            await service.publish(service.handle_tick(MetricTick.model_validate(tick).to_tick()))
        sub = bus.subscribe([settings.topics.name("alerts")], "t")
        return [orjson.loads(r.value) for r in await sub.getmany(timeout_s=0)]

    alerts = asyncio.run(run())
    assert [(a["name"], a["status"], a["labels"]["mode"]) for a in alerts] == [(MODE_ALERT, "firing", "emergency")]
    assert "OOM" in alerts[0]["summary"]
    assert service.ledger.remaining("n", tick_week(10 * S)) < 3600, "F_ext 0.7 ticks were debited"


def test_replayed_older_ticks_are_skipped_and_do_not_move_the_mode_clock():
    """Faust redelivers on recovery: an older or duplicate tick must not rewind since_ns, count a
    rise twice, or run the scan clock backwards."""
    from kvguard.policy.engine import EngineConfig, PolicyEngine

    engine = PolicyEngine(EngineConfig(dynamic_units=1000), b"k")
    engine.decide(view(10, 0.5, ooms=1))  # escalates at t=10
    assert engine.modes.mode("n") is Mode.EMERGENCY
    for t in range(20, 190, 10):  # 17 calm ticks, 170 s in emergency
        engine.decide(view(t, 0.5))
    ticks = engine.counters.ticks
    replayed = [engine.decide(view(t, 0.5, ooms=1)) for t in (180, 150, 20)]  # a duplicate and two older
    assert all(d.stale and d.commands == [] for d in replayed)
    assert engine.counters.stale_ticks == 3 and engine.counters.ticks == ticks
    # the replayed OOM ticks did not restart the dwell: 180 s after t=10 the node de-escalates on time
    assert engine.modes.mode("n") is Mode.EMERGENCY
    change = engine.decide(view(190, 0.5)).mode_change
    assert change is not None and change.to_mode is Mode.DEFAULT


async def test_policy_service_delivers_through_a_broker_outage_before_committing():
    """A refused publish (SendBufferFull) and a failed delivery are retried; the tick's offset is
    committed only after the command was delivered, and the service does not die."""
    import asyncio

    import orjson

    from kvguard.bus.inproc import InprocBus
    from kvguard.config.settings import Settings
    from kvguard.policy.engine import EngineConfig, PolicyEngine
    from kvguard.policy.service import PolicyService
    from tests.unit.actuators.test_actuator import FlakyBus

    settings = Settings()
    inner = InprocBus.from_settings(settings)
    service = PolicyService(PolicyEngine(EngineConfig(dynamic_units=1000), b"k"), settings,
                            bus=FlakyBus(inner, refuse=2, fail=2))
    tick = {"schema": "1.0", "node": "n", "ts_ns": 10 * S, "tick_s": 10.0, "u_kv": 0.7, "f_ext": 0.2,
            "f_int": 0.0, "psi": 0.9, "free_units": 300, "largest_free_run_units": 300, "ooms": 0}
    await inner.publish(settings.topics.name("metrics"), "n", orjson.dumps(tick))
    stop = asyncio.Event()

    async def until_delivered():
        reader = inner.subscribe([settings.topics.name("commands")], "reader")
        while not await reader.getmany(timeout_s=0.05):
            pass
        stop.set()

    await asyncio.wait_for(asyncio.gather(service.run(group="p", stop=stop, poll_s=0.01), until_delivered()),
                           timeout=10)
    commands = await inner.subscribe([settings.topics.name("commands")], "r2").getmany(timeout_s=0)
    assert [orjson.loads(r.value)["action"] for r in commands] == ["headroom"]
    assert service.ticks == 1


def test_slo_recorder_writes_predictions_oom_lead_times_evictions_and_their_outcomes():
    from types import SimpleNamespace

    import numpy as np

    from kvguard.contracts.commands import Ack, AckOutcome, Command, EvictPayload, Target
    from kvguard.contracts.events import EVENT_DTYPE, EventKind, Outcome
    from kvguard.policy.budget import iso_week
    from kvguard.policy.service import SloRecorder
    from kvguard.policy.slo import MemorySloLedger

    ledger = MemorySloLedger()
    slo = SloRecorder(ledger, threshold=0.5, horizon_s=30.0, confirm_with_acks=True)

    def tick(t, u_kv, p_oom, ooms=0, f_ext=0.1, slope=0.0):
        return MetricTick.model_validate({"node": "n", "ts_ns": t * S, "u_kv": u_kv, "psi": u_kv, "f_ext": f_ext,
                                          "f_int": 0.0, "slope_per_min": slope, "p_oom": p_oom,
                                          "ooms": ooms}).to_tick()

    for t, u, p in ((10, 0.5, 0.1), (20, 0.95, 0.7), (30, 0.97, 0.9)):
        slo.observe_tick(tick(t, u, p, slope=0.2 if t >= 30 else 0.0))
    slo.observe_tick(tick(40, 0.2, 0.1, ooms=1))
    slo.observe_tick(tick(40, 0.2, 0.1, ooms=1))  # a redelivered tick counts once
    slo.observe_tick(tick(100, 0.2, 0.1))
    cmd = Command(id="c1", node="n", payload=EvictPayload((Target(7), Target(8))), reason="t",
                  mode=Mode.DEFAULT, variant="v", issued_at_ns=100 * S, ttl_ns=30 * S)
    slo.observe_decision(SimpleNamespace(commands=[cmd]))
    slo.observe_ack(Ack(command_id="c1", node="n", outcome=AckOutcome.EXECUTED, executed_at_ns=101 * S))
    rows = np.zeros(2, dtype=EVENT_DTYPE)
    rows["kind"], rows["req"] = int(EventKind.FINISH), (7, 8)
    rows["flags"] = (int(Outcome.COMPLETED), int(Outcome.FAILED_OOM))
    slo.observe_batches([SimpleNamespace(node="n", events=rows)])

    report = ledger.report(iso_week(10 * S))
    # ticks 10..40 are labelled by t=100 (OOM at 40, horizon (t, t+30]): 10 missed it (FN), 20 and 30
    # saw it (TP), 40 is the OOM's own tick (TN)
    assert (report.tp, report.fp, report.tn, report.fn) == (2, 0, 1, 1)
    leads = {t.tier: t.lead_times_s for t in report.tiers}
    assert leads == {"threshold": (20.0,), "slope": (10.0,), "fragmentation": (0.0,), "lstm": (20.0,)}
    assert (report.ooms, report.evictions, report.completed, report.failed) == (1, 2, 1, 1)
    assert slo.counters.ooms == 1 and slo.counters.outcomes == 2
