"""An operator's command to one node (`kvguard command`): signed like the policy's, acked like them.

What an SRE does by hand at 3 a.m. — hold long prompts on a node, drain it, release it, abort a
request, return cached memory — goes through the same path as the policy's commands: a signed
``kvguard.commands`` record for the node's actuator (the vLLM plugin's, or ``kvguard node``'s), which
checks the signature, the TTL, the node and the producer epoch, executes it once, and answers on
``kvguard.acks``.

A command must carry the node's current producer epoch and be issued on the node's clock (an
actuator refuses commands of another run of the node, and ones issued further ahead of its clock than
``node.command_max_skew_s``). Both come from the node's newest tick on ``kvguard.metrics``, read with a
throwaway consumer group from the start of the topic (``NodeClock``); ``--epoch`` / ``--at-ns`` skip
that read. The command's id starts with ``operator/`` and its variant is ``operator``, so acks,
`kvguard slo report` and the exporter's counters tell it from the policy's.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvguard.contracts.commands import (
    AbortPayload,
    Ack,
    Action,
    BatchCapPayload,
    Command,
    CommandError,
    EmptyCachePayload,
    HoldPayload,
    Mode,
    Payload,
    ReleasePayload,
    sign,
)
from kvguard.contracts.units import NS_PER_S
from kvguard.wire.schemas import DecodeError, decode, make_headers

OPERATOR_ACTIONS = (Action.HOLD, Action.RELEASE, Action.ABORT, Action.EMPTY_CACHE, Action.BATCH_CAP,
                    Action.HEADROOM, Action.EVICT)


class OperatorError(ValueError):
    """The command cannot be sent as asked; says what to change."""


@dataclass(slots=True, frozen=True)
class OperatorArgs:
    """What an operator gives on the command line (``kvguard command``), before it is a payload."""

    max_prompt_tokens: int = 0
    tokens: int = 0
    steps: int = 0
    requests: tuple[int, ...] = ()


# ``kvguard command``'s verbs: each builds its action's payload from the flags it takes
OPERATOR_VERBS: dict[str, Callable[[OperatorArgs], Payload]] = {
    "hold": lambda a: HoldPayload(max_prompt_tokens=a.max_prompt_tokens, steps=a.steps),
    "drain": lambda a: HoldPayload(max_prompt_tokens=0, steps=a.steps),
    "release": lambda a: ReleasePayload(),
    "abort": lambda a: AbortPayload(requests=a.requests),
    "empty-cache": lambda a: EmptyCachePayload(),
    "batch-cap": lambda a: BatchCapPayload(tokens=a.tokens, steps=a.steps),
}
# the flag each payload field comes from, for the error an operator sees
_FLAGS = {"payload.max_prompt_tokens": "--max-prompt-tokens", "payload.tokens": "--tokens",
          "payload.steps": "--steps", "payload.requests": "--req"}


def operator_payload(verb: str, args: OperatorArgs) -> Payload:
    """The payload of ``kvguard command <verb>``; ``OperatorError`` naming the flag when a value is out
    of bounds (the same bounds every actuator applies)."""
    if verb not in OPERATOR_VERBS:
        raise OperatorError(f"action {verb!r}: expected one of {', '.join(OPERATOR_VERBS)}")
    try:
        return OPERATOR_VERBS[verb](args)
    except CommandError as err:
        flag = _FLAGS.get(err.field, err.field)
        needs = f"{verb} needs the requests to act on ({flag})" if flag == "--req" else f"{flag}: {err.expected}"
        raise OperatorError(f"{needs}, got {err.value!r}") from None


@dataclass(slots=True, frozen=True)
class NodeClock:
    """The node's producer epoch and event time of its newest tick on the metrics topic."""

    node: str
    epoch: int
    ts_ns: int


async def node_clock(bus: Any, settings: Any, node: str, *, idle_timeout_s: float = 2.0,
                     max_wall_s: float = 30.0) -> NodeClock | None:
    """The newest tick of ``node`` on ``kvguard.metrics`` (newest epoch, then event time), or None."""
    sub = bus.subscribe([settings.topics.name("metrics")], f"kvguard-operator-{secrets.token_hex(4)}")
    best: NodeClock | None = None
    started = idle_since = time.monotonic()
    try:
        while time.monotonic() - started < max_wall_s:
            records = await sub.getmany(1000, 0.3)
            now = time.monotonic()
            if not records:
                if now - idle_since >= idle_timeout_s:
                    break
                continue
            idle_since = now
            for record in records:
                if record.key is not None and bytes(record.key).decode(errors="replace") != node:
                    continue
                try:
                    tick = decode("metrics", record.value, record.headers)
                except DecodeError:
                    continue
                if tick.node != node:
                    continue
                seen = NodeClock(node, int(tick.epoch), int(tick.ts_ns))
                if best is None or (seen.epoch, seen.ts_ns) > (best.epoch, best.ts_ns):
                    best = seen
    finally:
        await sub.close()
    return best


def operator_command(node: str, payload: Payload, clock: NodeClock, secret: bytes, *, reason: str = "",
                     ttl_s: float = 60.0) -> Command:
    """The signed command, issued at the node's clock."""
    if payload.action not in OPERATOR_ACTIONS:
        raise OperatorError(f"action {payload.action.value!r}: expected one of {[a.value for a in OPERATOR_ACTIONS]}")
    return sign(Command(id=f"operator/{node}/{payload.action.value}/{secrets.token_hex(6)}", node=node,
                        payload=payload, reason=f"operator: {reason}" if reason else "operator",
                        mode=Mode.DEFAULT, variant="operator", issued_at_ns=clock.ts_ns,
                        ttl_ns=int(ttl_s * NS_PER_S), epoch=clock.epoch), secret)


async def send_and_wait(bus: Any, settings: Any, command: Command, *, wait_s: float = 10.0) -> Ack | None:
    """Publish ``command`` and wait for its ack (None: none within ``wait_s``)."""
    acks = bus.subscribe([settings.topics.name("acks")], f"kvguard-operator-{secrets.token_hex(4)}")
    try:
        await acks.getmany(1000, 0.0)  # join before publishing (a new group of the in-process bus reads all)
        delivery = await bus.publish(settings.topics.name("commands"), command.node, command.to_bytes(),
                                     make_headers("commands", command.node, record_id=command.id))
        await delivery
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for record in await acks.getmany(1000, 0.3):
                try:
                    ack = Ack.from_bytes(bytes(record.value))
                except (ValueError, KeyError, TypeError):
                    continue
                if ack.command_id == command.id:
                    return ack
            await asyncio.sleep(0)
        return None
    finally:
        await acks.close()
