import pytest

from kvguard.bus.idle import IdleSweep


def test_a_sweep_takes_out_only_the_nodes_silent_past_the_timeout():
    sweep = IdleSweep(60.0, now_s=0.0)
    sweep.seen("a", 0.0)
    sweep.seen("b", 50.0)
    assert sweep.sweep(60.0) == []  # silent for exactly the timeout: kept
    assert sweep.sweep(61.0) == ["a"]
    assert list(sweep.seen_at) == ["b"]
    assert sweep.sweep(200.0) == ["b"] and len(sweep) == 0


def test_the_sweep_is_due_every_interval_from_its_last_run():
    sweep = IdleSweep(60.0, now_s=100.0, every_s=30.0)
    assert not sweep.due(129.0) and sweep.due(130.0)
    sweep.sweep(135.0)
    assert not sweep.due(164.0) and sweep.due(165.0)


def test_a_node_seen_again_moves_behind_the_others():
    sweep = IdleSweep(60.0, now_s=0.0)
    for node, t in (("a", 0.0), ("b", 1.0), ("a", 2.0)):
        sweep.seen(node, t)
    assert list(sweep.seen_at) == ["b", "a"]
    assert list(sweep.silent_for(10.0, 8.5)) == ["b"]  # a (2 s) is too recent; the scan stops at it
    assert list(sweep.silent_for(10.0, 8.0)) == ["b", "a"]


def test_past_the_cap_the_longest_silent_go_first():
    sweep = IdleSweep(60.0, now_s=0.0)
    for i, node in enumerate("abcde"):
        sweep.seen(node, float(i))
    assert sweep.over(3) == ["a", "b"] and list(sweep.seen_at) == ["c", "d", "e"]
    sweep.forget("d")
    assert list(sweep.seen_at) == ["c", "e"] and sweep.over(3) == []


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        IdleSweep(0.0, now_s=0.0)
