"""Commands: canonical signing, TTL, idempotency ids, wire round trip."""

from dataclasses import replace

import pytest

from kvguard.contracts.commands import (
    Ack,
    AckOutcome,
    Action,
    Command,
    CommandError,
    Mode,
    Target,
    canonical_bytes,
    command_id,
    sign,
    verify,
)
from kvguard.policy.strategy import Granularity, HandlingChoice

SECRET = b"test-secret"


def make_command(**changes) -> Command:
    cmd = Command(id=command_id("n0/gpu0", 10_000_000_000, Action.EVICT, 0), node="n0/gpu0",
                  action=Action.EVICT, targets=(Target(7, 32), Target(9, 0)), granularity=Granularity.BLOCK,
                  handling=HandlingChoice.RECOMPUTE, reason="u_kv 0.9 > 0.85", mode=Mode.DEFAULT,
                  variant="block/lru/async/recompute/soft", issued_at_ns=10_000_000_000, ttl_ns=30_000_000_000,
                  units_needed=48)
    return replace(cmd, **changes)


def test_signed_command_verifies_and_round_trips_through_bytes():
    cmd = sign(make_command(), SECRET)
    assert verify(cmd, SECRET)
    back = Command.from_bytes(cmd.to_bytes())
    assert back == cmd
    assert verify(back, SECRET)


def test_forged_or_altered_command_fails_verification():
    cmd = sign(make_command(), SECRET)
    assert not verify(cmd, b"other-secret")
    assert not verify(replace(cmd, targets=(Target(8, 0),)), SECRET)
    assert not verify(replace(cmd, ttl_ns=10**15), SECRET)
    assert not verify(replace(cmd, signature=""), SECRET)


def test_canonical_encoding_ignores_signature_and_is_key_sorted():
    cmd = make_command()
    assert canonical_bytes(cmd) == canonical_bytes(replace(cmd, signature="abc"))
    assert b'"action":"evict"' in canonical_bytes(cmd)


def test_signing_without_a_secret_is_refused():
    with pytest.raises(CommandError, match="secret"):
        sign(make_command(), b"")


def test_ttl_expiry_is_strictly_after_issue_plus_ttl():
    cmd = make_command()
    assert not cmd.is_expired(cmd.issued_at_ns + cmd.ttl_ns)
    assert cmd.is_expired(cmd.issued_at_ns + cmd.ttl_ns + 1)


def test_command_ids_are_deterministic_and_distinct_per_position():
    a = command_id("n", 1, Action.EVICT, 0)
    assert a == command_id("n", 1, Action.EVICT, 0)
    assert len({a, command_id("n", 1, Action.EVICT, 1), command_id("n", 2, Action.EVICT, 0),
                command_id("m", 1, Action.EVICT, 0), command_id("n", 1, Action.COMPACT, 0)}) == 5


def test_malformed_record_names_the_field():
    d = make_command().to_dict()
    d["action"] = "explode"
    with pytest.raises(CommandError) as info:
        Command.from_dict(d)
    assert info.value.field == "action"
    del d["action"]
    with pytest.raises(CommandError, match="action"):
        Command.from_dict(d)
    with pytest.raises(CommandError, match="JSON"):
        Command.from_bytes(b"\xff not json")


def test_ack_round_trip():
    ack = Ack(command_id="x", node="n", outcome=AckOutcome.DUPLICATE, executed_at_ns=5, units_freed=3,
              errors=("already applied",))
    assert Ack.from_bytes(ack.to_bytes()) == ack
