"""DEFAULT ⇄ EMERGENCY per node (docs/ARCHITECTURE.md, "Policy").

Escalate to EMERGENCY when DEFAULT is failing on that node:

* an OOM happened (the tick counts one), or
* pressure keeps rising after actions: kvguard acted on the node within ``action_window_s`` and
  U_kv still rose on ``rising_ticks`` consecutive ticks while above ``escalate_u_kv``.

De-escalate back to DEFAULT when pressure has fallen: U_kv below ``deescalate_u_kv`` on
``calm_ticks`` consecutive ticks, no OOM meanwhile, and at least ``min_emergency_s`` spent in
EMERGENCY (hysteresis, so a node does not flap between modes tick by tick).

Pressure here is U_kv, not Ψ: on the shadow engine a busy node sits at Ψ ≥ 1 for long stretches
without an OOM (Ψ's fragmentation factor is deliberately pessimistic), so Ψ would pin every busy
node in EMERGENCY.

Every switch is a ``ModeChange`` value; the service logs it and publishes it on the alerts topic.
Pure: time is the tick's event time.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.contracts.commands import Mode
from kvguard.policy.planner import NodeView


@dataclass(slots=True, frozen=True)
class ModeConfig:
    rising_ticks: int = 3
    rising_epsilon: float = 0.005
    escalate_u_kv: float = 0.90
    action_window_s: float = 120.0
    deescalate_u_kv: float = 0.88
    calm_ticks: int = 12
    min_emergency_s: float = 180.0


@dataclass(slots=True, frozen=True)
class ModeChange:
    node: str
    ts_ns: int
    from_mode: Mode
    to_mode: Mode
    reason: str

    def to_dict(self) -> dict:
        return {"type": "mode_change", "node": self.node, "ts_ns": self.ts_ns,
                "from_mode": self.from_mode.value, "to_mode": self.to_mode.value, "reason": self.reason}


@dataclass(slots=True)
class _NodeMode:
    mode: Mode = Mode.DEFAULT
    since_ns: int = 0
    last_action_ns: int | None = None
    last_u_kv: float | None = None
    rising: int = 0
    calm: int = 0


class ModeTracker:
    """Per-node mode state machine. ``observe`` once per tick, ``note_action`` when acting."""

    def __init__(self, config: ModeConfig | None = None) -> None:
        self.config = config or ModeConfig()
        self._nodes: dict[str, _NodeMode] = {}

    def mode(self, node: str) -> Mode:
        state = self._nodes.get(node)
        return state.mode if state else Mode.DEFAULT

    def forget(self, node: str) -> None:
        """Drop a node's mode state (it restarted: its clock starts over in DEFAULT)."""
        self._nodes.pop(node, None)

    def note_action(self, node: str, ts_ns: int) -> None:
        self._state(node).last_action_ns = ts_ns

    def observe(self, view: NodeView) -> ModeChange | None:
        cfg = self.config
        state = self._state(view.node)
        if state.last_u_kv is not None and view.u_kv > state.last_u_kv + cfg.rising_epsilon:
            state.rising += 1
        elif state.last_u_kv is not None and view.u_kv < state.last_u_kv - cfg.rising_epsilon:
            state.rising = 0
        state.last_u_kv = view.u_kv
        state.calm = state.calm + 1 if view.u_kv < cfg.deescalate_u_kv and view.ooms == 0 else 0
        if state.mode is Mode.DEFAULT:
            reason = self._failing(view, state)
            if reason:
                return self._switch(state, view, Mode.EMERGENCY, reason)
            return None
        in_emergency_s = (view.ts_ns - state.since_ns) / 1e9
        if state.calm >= cfg.calm_ticks and in_emergency_s >= cfg.min_emergency_s:
            reason = (f"pressure fell: u_kv {view.u_kv:.3f} < {cfg.deescalate_u_kv} for "
                      f"{state.calm} ticks after {in_emergency_s:.0f} s in emergency")
            return self._switch(state, view, Mode.DEFAULT, reason)
        if view.ooms:
            state.since_ns = view.ts_ns  # stay, and restart the dwell time
        return None

    def _failing(self, view: NodeView, state: _NodeMode) -> str | None:
        cfg = self.config
        if view.ooms:
            return f"{view.ooms} OOM(s) in the last tick"
        acted_recently = (state.last_action_ns is not None
                          and view.ts_ns - state.last_action_ns <= cfg.action_window_s * 1e9)
        if acted_recently and state.rising >= cfg.rising_ticks and view.u_kv >= cfg.escalate_u_kv:
            return (f"pressure keeps rising after actions: u_kv up {state.rising} ticks in a row "
                    f"to {view.u_kv:.3f}")
        return None

    def _switch(self, state: _NodeMode, view: NodeView, to: Mode, reason: str) -> ModeChange:
        change = ModeChange(view.node, view.ts_ns, state.mode, to, reason)
        state.mode = to
        state.since_ns = view.ts_ns
        state.rising = 0
        state.calm = 0
        return change

    def _state(self, node: str) -> _NodeMode:
        state = self._nodes.get(node)
        if state is None:
            state = self._nodes[node] = _NodeMode()
        return state
