"""The core's Tick and the wire's MetricTick do not drift (issue 20): the wire model is derived from the
dataclass, and this check fails when a field is dropped from either (its own test below)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

import pytest
from pydantic import BaseModel, create_model

from kvguard.contracts.tick import Candidate as TickCandidate
from kvguard.contracts.tick import Tick
from kvguard.wire.schemas import Candidate, MetricTick, WireModel, _derived_tick_fields, _MetricTickDeclared

WIRE_ONLY = {"schema_version", "utilization"}  # the record's schema, and the utilization split as one map
DECLARED = set(_MetricTickDeclared.model_fields)  # their wire types differ on purpose (bounds, the wire Candidate)


def parity_problems(model: type[BaseModel], core: type, *, wire_only: set[str] = frozenset(),
                    declared: set[str] = frozenset()) -> list[str]:
    """What differs between a dataclass and its wire model: a field in one only, or (for a field
    the wire does not declare itself) another type."""
    core_names = [f.name for f in fields(core)]
    problems = [f"{core.__name__}.{n} is not on the wire ({model.__name__})" for n in core_names
                if n not in model.model_fields]
    problems += [f"{model.__name__}.{n} is not in {core.__name__}" for n in model.model_fields
                 if n not in core_names and n not in wire_only]
    hints = get_type_hints(core)
    problems += [f"{model.__name__}.{n}: {model.model_fields[n].annotation!r}, {core.__name__} has {hints[n]!r}"
                 for n in core_names if n in model.model_fields and n not in declared
                 and model.model_fields[n].annotation != hints[n]]
    return problems


def test_the_wire_tick_carries_every_tick_field_with_its_type():
    assert parity_problems(MetricTick, Tick, wire_only=WIRE_ONLY, declared=DECLARED) == []


def test_the_wire_candidate_carries_every_candidate_field():
    assert parity_problems(Candidate, TickCandidate, declared=set(Candidate.model_fields)) == []


def _without(model: type[BaseModel], name: str) -> type[BaseModel]:
    kept = {n: (f.annotation, f) for n, f in model.model_fields.items() if n != name}
    return create_model(f"{model.__name__}Without", __base__=WireModel if issubclass(model, WireModel) else BaseModel,
                        **kept)


@pytest.mark.parametrize("dropped", ["alloc_f_ext", "u_kv", "late_events", "candidates"])
def test_the_check_fails_when_the_wire_model_drops_a_field(dropped):
    broken = _without(MetricTick, dropped)
    assert dropped not in broken.model_fields and len(broken.model_fields) == len(MetricTick.model_fields) - 1
    assert parity_problems(broken, Tick, wire_only=WIRE_ONLY, declared=DECLARED) == [
        f"Tick.{dropped} is not on the wire ({broken.__name__})"]


def test_the_check_fails_when_the_tick_drops_a_field_or_a_type_differs():
    kept = [(f.name, f.type, f) for f in fields(Tick) if f.name != "alloc_retries"]
    smaller = make_dataclass("Tick", [(n, t, f) for n, t, f in kept], namespace={"Candidate": TickCandidate})
    assert parity_problems(MetricTick, smaller, wire_only=WIRE_ONLY, declared=DECLARED) == [
        "MetricTick.alloc_retries is not in Tick"]
    retyped = create_model("Retyped", __base__=WireModel,
                           **{n: (f.annotation, f) for n, f in MetricTick.model_fields.items() if n != "tick_s"},
                           tick_s=(int, 0))
    assert parity_problems(retyped, Tick, wire_only=WIRE_ONLY, declared=DECLARED) == [
        "Retyped.tick_s: <class 'int'>, Tick has <class 'float'>"]
    dropped = _without(Candidate, "generated_tokens")
    assert parity_problems(dropped, TickCandidate, declared=set(Candidate.model_fields)) == [
        "Candidate.generated_tokens is not on the wire (CandidateWithout)"]


def test_a_field_added_to_the_tick_is_derived_onto_the_wire_or_refused_by_name():
    @dataclass(frozen=True)
    class Grown:
        node: str
        tick_s: float
        ooms: int
        p_oom: float | None = None
        candidates: list[Any] = field(default_factory=list)

    derived = _derived_tick_fields(_MetricTickDeclared, Grown)
    assert set(derived) == {"tick_s", "ooms", "p_oom"}  # node, candidates: the wire declares them
    assert derived["tick_s"][1].default == 0.0 and derived["ooms"][1].default == 0
    assert derived["ooms"][1].json_schema_extra == {"group": "requests"}

    @dataclass(frozen=True)
    class Ungrouped:
        brand_new_metric: int

    with pytest.raises(KeyError, match="TICK_GROUPS"):
        _derived_tick_fields(_MetricTickDeclared, Ungrouped)

    @dataclass(frozen=True)
    class NoZero:
        ooms: bytes

    with pytest.raises(TypeError, match="Tick.ooms: no wire default"):
        _derived_tick_fields(_MetricTickDeclared, NoZero)


def test_a_tick_round_trips_through_the_wire_model_field_by_field():
    values = {f.name: i + 1 for i, f in enumerate(fields(Tick))}
    floats = {n for n, t in get_type_hints(Tick).items() if t in (float, float | None)}
    tick = Tick(**(values | {n: 0.5 for n in floats} | {"node": "n/gpu0", "synced": False, "partial": True,
                                                          "u_kv_forecast": [0.25], "endpoint_admit": 1,
                                                          "candidates": [TickCandidate(7, 3, 4, 16, 9, 1, 8, 4, 2)]}))
    assert MetricTick.model_validate(tick.to_dict() | {"schema": "1.0"}).to_tick() == tick
