"""The tick's groups (kvguard.contracts.tick.TICK_GROUPS): every field in exactly one."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvguard.contracts.tick import TICK_GROUPS, Tick, tick_group


def test_every_tick_field_is_in_exactly_one_group_and_every_grouped_name_is_a_field():
    names = [f.name for f in fields(Tick)]
    grouped = [n for group in TICK_GROUPS.values() for n in group]
    assert sorted(grouped) == sorted(names), (set(names) ^ set(grouped)) or "a field is in two groups"
    assert {"kv", "allocator", "requests", "interval"} <= set(TICK_GROUPS)
    assert tick_group("u_kv") == "kv" and tick_group("alloc_f_ext") == "allocator"


def test_a_field_in_no_group_is_named():
    with pytest.raises(KeyError, match="Tick.nope is in no group"):
        tick_group("nope")


def test_docs_contracts_lists_each_group_with_its_fields():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "CONTRACTS.md").read_text()
    listed = {}
    for line in text.splitlines():
        if line.strip().startswith("- tick group `"):
            group, _, names = line.strip()[len("- tick group `"):].partition("`: ")
            listed[group] = tuple(n.strip("`") for n in names.split(", "))
    assert listed == TICK_GROUPS
