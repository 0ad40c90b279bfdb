"""The strategy space (docs/ARCHITECTURE.md, "Policy"): five dimensions, three options each (3⁵ = 243 strategies).

A ``Strategy`` is a validated value: every option is an enum member and every threshold is a
number in range, so a bad configuration fails here, once, with the offending field named
(``StrategyError(field="policy.default.trigger", value="loud", expected="hard|soft|fragmentation")``)
instead of deep inside the planner on the first tick.

Two presets:

* ``DEFAULT``: block granularity (free tail pages, keep the shared prefix), LRU with a priority
  tie-break, async (scan every 30 s), recompute, soft trigger 0.85 plus the prediction (LSTM
  P(OOM) and the forecast U_kv trajectory).
* ``EMERGENCY``: request granularity, cost-aware selection, sync (act on every tick), recompute,
  hard trigger 0.95. ``policy.modes`` switches to it when DEFAULT is failing.

Pure: standard library only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any, Mapping

from kvguard.contracts.dimensions import Granularity, HandlingChoice, Selection, Timing, Trigger


class StrategyError(ValueError):
    """A strategy field has a value outside its domain. ``field`` is the dotted config path."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"{field}: got {value!r}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected


def _check_fraction(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise StrategyError(name, value, "a number in [0, 1]")


def _check_positive(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise StrategyError(name, value, "a positive number")


@dataclass(slots=True, frozen=True)
class Strategy:
    """One point of the strategy space plus the numbers its options need.

    ``threshold`` is the hard and soft triggers' level (U_kv); ``f_ext_trigger`` the fragmentation
    trigger's (F_ext of the layer where fragmentation lives: the KV arena on the seed's profiles, the
    caching allocator on vLLM's uniform blocks; the seed's rule is F_ext > 0.6).
    ``target_psi``/``target_u_kv`` are where the planner brings a node back to once triggered,
    below the threshold so that one action buys headroom instead of firing again next tick
    (Ψ is judged at the fragmentation a compaction leaves, see ``policy.planner``).
    """

    granularity: Granularity = Granularity.BLOCK
    selection: Selection = Selection.LRU
    timing: Timing = Timing.ASYNC
    handling: HandlingChoice = HandlingChoice.RECOMPUTE
    trigger: Trigger = Trigger.SOFT
    threshold: float = 0.85
    use_prediction: bool = True  # soft trigger: the threshold AND the prediction must agree
    p_oom_threshold: float = 0.5
    priority_tie_break: bool = True
    scan_interval_s: float = 30.0
    predictive_horizon_s: float = 150.0
    target_psi: float = 1.0
    target_u_kv: float = 0.78
    fragmentation_threshold: float = 0.5  # F_ext above which compaction is considered at all
    f_ext_trigger: float = 0.6  # the fragmentation trigger fires above this F_ext (the seed's 0.6)
    max_victims: int = 8
    max_compaction_moves: int = 256
    name: str = "custom"

    def __post_init__(self) -> None:
        _check_fraction("threshold", self.threshold)
        _check_fraction("p_oom_threshold", self.p_oom_threshold)
        _check_fraction("target_psi", self.target_psi)
        _check_fraction("target_u_kv", self.target_u_kv)
        _check_fraction("fragmentation_threshold", self.fragmentation_threshold)
        _check_fraction("f_ext_trigger", self.f_ext_trigger)
        _check_positive("scan_interval_s", self.scan_interval_s)
        _check_positive("predictive_horizon_s", self.predictive_horizon_s)
        _check_positive("max_victims", self.max_victims)
        _check_positive("max_compaction_moves", self.max_compaction_moves)

    @property
    def variant(self) -> str:
        """A stable short label of the five choices, e.g. ``block/lru/async/recompute/soft``."""
        return "/".join(str(v) for v in self.key)

    @property
    def key(self) -> tuple[Granularity, Selection, Timing, HandlingChoice, Trigger]:
        return (self.granularity, self.selection, self.timing, self.handling, self.trigger)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), StrEnum) else v)
                for f in fields(self)}


DEFAULT = Strategy(
    granularity=Granularity.BLOCK,
    selection=Selection.LRU,
    timing=Timing.ASYNC,
    handling=HandlingChoice.RECOMPUTE,
    trigger=Trigger.SOFT,
    threshold=0.85,
    use_prediction=True,
    priority_tie_break=True,
    name="default",
)

EMERGENCY = Strategy(
    granularity=Granularity.REQUEST,
    selection=Selection.COST,
    timing=Timing.SYNC,
    handling=HandlingChoice.RECOMPUTE,
    trigger=Trigger.HARD,
    threshold=0.95,
    use_prediction=False,
    priority_tie_break=True,
    target_psi=0.95,
    target_u_kv=0.72,
    name="emergency",
)

PRESETS: dict[str, Strategy] = {"default": DEFAULT, "emergency": EMERGENCY}

_ENUM_FIELDS: dict[str, type[StrEnum]] = {
    "granularity": Granularity,
    "selection": Selection,
    "timing": Timing,
    "handling": HandlingChoice,
    "trigger": Trigger,
}


def all_strategies(base: Strategy = DEFAULT) -> list[Strategy]:
    """The 243 points of the space, each with ``base``'s numbers."""
    return [
        replace(base, granularity=g, selection=s, timing=t, handling=h, trigger=tr, name="custom")
        for g, s, t, h, tr in itertools.product(Granularity, Selection, Timing, HandlingChoice, Trigger)
    ]


def strategy_from_mapping(values: Mapping[str, Any], *, base: Strategy = DEFAULT,
                          field_prefix: str = "policy") -> Strategy:
    """Build a strategy from config values (file or environment strings) on top of ``base``.

    ``preset`` may name a preset to start from. Unknown keys and bad values raise
    ``StrategyError`` naming ``<field_prefix>.<key>``.
    """
    values = dict(values)
    preset = values.pop("preset", None)
    if preset is not None:
        if str(preset).lower() not in PRESETS:
            raise StrategyError(f"{field_prefix}.preset", preset, "|".join(PRESETS))
        base = PRESETS[str(preset).lower()]
    known = {f.name: f for f in fields(Strategy)}
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        path = f"{field_prefix}.{key}"
        if key not in known:
            raise StrategyError(path, raw, "one of " + ", ".join(sorted(known)))
        changes[key] = _coerce(path, key, raw, getattr(base, key))
    try:
        return replace(base, **changes)
    except StrategyError as err:
        raise StrategyError(f"{field_prefix}.{err.field}", err.value, err.expected) from None


def _coerce(path: str, key: str, raw: Any, current: Any) -> Any:
    if key in _ENUM_FIELDS:
        enum = _ENUM_FIELDS[key]
        try:
            return enum(str(raw).strip().lower())
        except ValueError:
            raise StrategyError(path, raw, "|".join(m.value for m in enum)) from None
    if isinstance(current, bool):
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in {"1", "true", "yes", "on"}:
            return True
        if text in {"0", "false", "no", "off"}:
            return False
        raise StrategyError(path, raw, "a boolean (true|false)")
    if isinstance(current, int):
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise StrategyError(path, raw, "an integer") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise StrategyError(path, raw, "a number") from None
    return str(raw)
