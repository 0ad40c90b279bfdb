"""Commands: canonical signing, TTL, idempotency ids, wire round trip."""

from dataclasses import replace

import pytest

from kvguard.contracts.commands import (
    MAX_COUNT,
    PAYLOADS,
    AbortPayload,
    Ack,
    AckOutcome,
    Action,
    BatchCapPayload,
    Command,
    CommandError,
    CompactPayload,
    EmptyCachePayload,
    EvictPayload,
    HeadroomPayload,
    HoldPayload,
    Mode,
    ReclaimPayload,
    ReleasePayload,
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
                  payload=EvictPayload((Target(7, 32), Target(9, 0)), Granularity.BLOCK, HandlingChoice.RECOMPUTE),
                  reason="u_kv 0.9 > 0.85", mode=Mode.DEFAULT, variant="block/lru/async/recompute/soft",
                  issued_at_ns=10_000_000_000, ttl_ns=30_000_000_000)
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
    assert not verify(replace(cmd, payload=EvictPayload((Target(8, 0),), Granularity.BLOCK)), SECRET)
    assert not verify(replace(cmd, payload=HoldPayload(0, 0)), SECRET)  # another action, same numbers
    assert not verify(replace(cmd, ttl_ns=10**15), SECRET)
    assert not verify(replace(cmd, signature=""), SECRET)


def test_canonical_encoding_ignores_signature_and_is_key_sorted():
    cmd = make_command()
    assert canonical_bytes(cmd) == canonical_bytes(replace(cmd, signature="abc"))
    assert b'"action":"evict"' in canonical_bytes(cmd)
    assert b'"payload":{"granularity":"block","handling":"recompute","targets":[[7,32],[9,0]]}' in canonical_bytes(cmd)


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


EVERY_PAYLOAD = [EvictPayload((Target(3, 5),), Granularity.TOKEN, HandlingChoice.SWAP), AbortPayload((4, 5)),
                 CompactPayload(7), ReclaimPayload(8), HeadroomPayload(9), BatchCapPayload(1024, 3), HoldPayload(512, 4),
                 ReleasePayload(), EmptyCachePayload()]


def test_every_action_has_one_payload_type_and_each_round_trips_signed():
    assert {p.action for p in EVERY_PAYLOAD} == set(Action) == set(PAYLOADS)
    for payload in EVERY_PAYLOAD:
        cmd = sign(make_command(payload=payload), SECRET)
        back = Command.from_bytes(cmd.to_bytes())
        assert back == cmd and back.action is payload.action and verify(back, SECRET)
        assert canonical_bytes(back) == canonical_bytes(cmd)  # deterministic over the payload


@pytest.mark.parametrize("build, field", [
    (lambda: HoldPayload(-1, -1), "payload.max_prompt_tokens"),  # not a drain of everything
    (lambda: HoldPayload(0, -1), "payload.steps"),
    (lambda: BatchCapPayload(-5), "payload.tokens"),  # not "release the cap"
    (lambda: BatchCapPayload(64, MAX_COUNT + 1), "payload.steps"),
    (lambda: HeadroomPayload(2**63 - 1), "payload.units"),  # not "stop every admission"
    (lambda: HeadroomPayload(-1), "payload.units"),
    (lambda: ReclaimPayload(0), "payload.units"),
    (lambda: CompactPayload(0), "payload.max_moves"),
    (lambda: HoldPayload(True), "payload.max_prompt_tokens"),  # a bool is no count
    (lambda: BatchCapPayload(1.5), "payload.tokens"),
    (lambda: Target(-1), "payload.targets.req"),
    (lambda: Target(1, -8), "payload.targets.units"),
    (lambda: EvictPayload(()), "payload.targets"),
    (lambda: EvictPayload((Target(1),), granularity="page"), "payload.granularity"),
    (lambda: AbortPayload(()), "payload.requests"),
    (lambda: AbortPayload(tuple(range(2000))), "payload.requests"),
])
def test_out_of_bounds_payloads_are_refused_with_the_field_named(build, field):
    with pytest.raises(CommandError) as info:
        build()
    assert info.value.field == field


def test_a_record_with_an_absurd_or_unknown_payload_value_is_refused_at_decoding():
    d = make_command(payload=HeadroomPayload(10)).to_dict()
    d["payload"]["units"] = 2**63 - 1
    with pytest.raises(CommandError, match="payload.units"):
        Command.from_dict(d)
    d["payload"] = {"units": 10, "steps": 3}  # a field headroom does not have: its meaning is unknown
    with pytest.raises(CommandError, match="payload.steps"):
        Command.from_dict(d)
    d["payload"] = [10]
    with pytest.raises(CommandError, match="payload"):
        Command.from_dict(d)


def test_a_flat_schema_1_record_is_refused_with_the_reason():
    flat = {"schema": "1.0", "id": "c", "node": "n", "action": "hold", "targets": [], "granularity": "request",
            "handling": "recompute", "mode": "default", "issued_at_ns": 1, "ttl_ns": 10, "units_needed": 0,
            "max_moves": 0}
    with pytest.raises(CommandError) as info:
        Command.from_dict(flat)
    assert info.value.field == "schema" and "flat 1.x records" in str(info.value)
    del flat["schema"]
    with pytest.raises(CommandError, match="flat 1.x records"):
        Command.from_dict(flat)
