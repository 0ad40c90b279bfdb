"""Commands from the policy engine to a node's actuator, and the actuator's acks (docs/ARCHITECTURE.md, "Policy").

A command is signed with HMAC-SHA256 over a canonical encoding (JSON, sorted keys, no spaces,
every field except ``signature``) with a secret shared by the policy and the actuators, so an
actuator only ever executes what a holder of the secret issued. Its ``id`` is an idempotency
key derived from what caused it (node, tick time, action, position), so re-deciding the same
tick after a policy restart reissues the same ids and the actuator applies each at most once.
A command is valid from ``issued_at_ns`` for ``ttl_ns``; an actuator rejects it after that,
because a decision taken on stale pressure can hurt more than it helps. It also carries (signed)
the producer ``epoch`` of the tick it was decided on: a node's clock starts over when it restarts,
so a command of an earlier run could otherwise look fresh on the new clock; the actuator rejects
commands of any other epoch than its node's.

Pure: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Mapping

from kvguard.contracts.dimensions import Granularity, HandlingChoice

COMMAND_SCHEMA = "1.0"


class Action(StrEnum):
    EVICT = "evict"  # free the targets' pages at the command's granularity and handling
    COMPACT = "compact"  # migrate pages to coalesce free runs (no request loses anything)
    RECLAIM = "reclaim"  # drop cached (unreferenced) prefix pages
    HEADROOM = "headroom"  # hold ``units_needed`` units back from admission (0 = release)
    # cap the per-step token budget (vLLM: ``max_num_batched_tokens``) at ``units_needed`` tokens for
    # ``max_moves`` steps (0: until released); ``units_needed`` 0 releases. Bounds activation and logits peaks.
    BATCH_CAP = "batch_cap"
    # hold admissions: no waiting (or preempted) request whose prompt is longer than ``units_needed``
    # tokens is admitted; ``units_needed`` 0 holds every admission (a drain: running requests finish);
    # for ``max_moves`` non-empty steps (0: until a ``release``). Held requests stay queued, nothing fails.
    HOLD = "hold"
    RELEASE = "release"  # end a ``hold`` (a drain included)
    # end the targets' requests now with an error their clients see (vLLM: finish_reason "error",
    # retryable); their blocks are freed. A request that already finished is a no-op.
    ABORT = "abort"
    # return cached allocator segments that hold no allocation to the device (torch.cuda.empty_cache()).
    # PyTorch already does this itself before it raises an OOM (a failed cudaMalloc frees the cached
    # blocks and retries), so it does not prevent an allocator OOM; it gives memory back to other users
    # of the device (NCCL, cuBLAS workspaces, another process).
    EMPTY_CACHE = "empty_cache"


class Mode(StrEnum):
    DEFAULT = "default"
    EMERGENCY = "emergency"


class AckOutcome(StrEnum):
    EXECUTED = "executed"
    NOOP = "noop"  # valid, but nothing to do (e.g. every target already finished)
    REJECTED_SIGNATURE = "rejected_signature"
    REJECTED_EXPIRED = "rejected_expired"
    REJECTED_NODE = "rejected_node"  # addressed to another node
    REJECTED_EPOCH = "rejected_epoch"  # decided on another run of the node (another producer epoch)
    REJECTED_FUTURE = "rejected_future"  # issued further ahead of the node's clock than the allowed skew
    REJECTED_TTL = "rejected_ttl"  # valid for longer than the actuator allows
    DUPLICATE = "duplicate"
    FAILED = "failed"


class CommandError(ValueError):
    """A command record is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"command.{field}: got {value!r}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected


@dataclass(slots=True, frozen=True)
class Target:
    """One victim: free ``units`` units of request ``req`` (0 = all of it)."""

    req: int
    units: int = 0


@dataclass(slots=True, frozen=True)
class Command:
    id: str
    node: str
    action: Action
    targets: tuple[Target, ...]
    granularity: Granularity
    handling: HandlingChoice
    reason: str
    mode: Mode
    variant: str
    issued_at_ns: int
    ttl_ns: int
    units_needed: int = 0
    max_moves: int = 0
    epoch: int = 0  # the producer epoch of the tick it was decided on (signed)
    signature: str = ""

    def expires_at_ns(self) -> int:
        return self.issued_at_ns + self.ttl_ns

    def is_expired(self, now_ns: int) -> bool:
        return now_ns > self.expires_at_ns()

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": COMMAND_SCHEMA,
            "id": self.id,
            "node": self.node,
            "action": self.action.value,
            "targets": [[t.req, t.units] for t in self.targets],
            "granularity": self.granularity.value,
            "handling": self.handling.value,
            "reason": self.reason,
            "mode": self.mode.value,
            "variant": self.variant,
            "issued_at_ns": self.issued_at_ns,
            "ttl_ns": self.ttl_ns,
            "units_needed": self.units_needed,
            "max_moves": self.max_moves,
            "epoch": self.epoch,
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Command":
        try:
            return cls(
                id=str(_req(d, "id")),
                node=str(_req(d, "node")),
                action=_enum(Action, d, "action"),
                targets=tuple(Target(int(r), int(u)) for r, u in _req(d, "targets")),
                granularity=_enum(Granularity, d, "granularity"),
                handling=_enum(HandlingChoice, d, "handling"),
                reason=str(d.get("reason", "")),
                mode=_enum(Mode, d, "mode"),
                variant=str(d.get("variant", "")),
                issued_at_ns=int(_req(d, "issued_at_ns")),
                ttl_ns=int(_req(d, "ttl_ns")),
                units_needed=int(d.get("units_needed", 0)),
                max_moves=int(d.get("max_moves", 0)),
                epoch=int(d.get("epoch", 0)),
                signature=str(d.get("signature", "")),
            )
        except (TypeError, ValueError, OverflowError) as err:
            if isinstance(err, CommandError):
                raise
            raise CommandError("targets", d.get("targets"), f"a list of [req, units] ({err})") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Command":
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CommandError("<record>", raw[:80], f"a JSON object ({err})") from None
        if not isinstance(d, dict):
            raise CommandError("<record>", d, "a JSON object")
        return cls.from_dict(d)


def canonical_bytes(command: Command) -> bytes:
    """The signed bytes: every field but ``signature``, JSON with sorted keys and no spaces."""
    d = command.to_dict()
    del d["signature"]
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def sign(command: Command, secret: bytes) -> Command:
    if not secret:
        raise CommandError("signature", "", "a non-empty shared secret (settings: hmac_secret)")
    digest = hmac.new(secret, canonical_bytes(command), hashlib.sha256).hexdigest()
    return replace(command, signature=digest)


def verify(command: Command, secret: bytes) -> bool:
    if not secret or not command.signature:
        return False
    expected = hmac.new(secret, canonical_bytes(command), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, command.signature)


def command_id(node: str, ts_ns: int, action: Action | str, position: int) -> str:
    """Idempotency id: the same decision (node, tick time, action, position) gets the same id."""
    text = f"{node}|{ts_ns}|{action}|{position}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(slots=True, frozen=True)
class Ack:
    command_id: str
    node: str
    outcome: AckOutcome
    executed_at_ns: int
    units_freed: int = 0
    units_moved: int = 0
    latency_ns: int = 0  # receipt of the command to the end of its execution, on the node's clock
    issued_at_ns: int = 0  # copied from the command, so latency from decision to effect is computable
    action: str = ""
    variant: str = ""
    mode: str = ""
    targets_done: int = 0
    targets_noop: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": COMMAND_SCHEMA,
            "command_id": self.command_id,
            "node": self.node,
            "outcome": self.outcome.value,
            "executed_at_ns": self.executed_at_ns,
            "units_freed": self.units_freed,
            "units_moved": self.units_moved,
            "latency_ns": self.latency_ns,
            "issued_at_ns": self.issued_at_ns,
            "action": self.action,
            "variant": self.variant,
            "mode": self.mode,
            "targets_done": self.targets_done,
            "targets_noop": self.targets_noop,
            "errors": list(self.errors),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Ack":
        return cls(
            command_id=str(_req(d, "command_id")),
            node=str(_req(d, "node")),
            outcome=_enum(AckOutcome, d, "outcome"),
            executed_at_ns=int(_req(d, "executed_at_ns")),
            units_freed=int(d.get("units_freed", 0)),
            units_moved=int(d.get("units_moved", 0)),
            latency_ns=int(d.get("latency_ns", 0)),
            issued_at_ns=int(d.get("issued_at_ns", 0)),
            action=str(d.get("action", "")),
            variant=str(d.get("variant", "")),
            mode=str(d.get("mode", "")),
            targets_done=int(d.get("targets_done", 0)),
            targets_noop=int(d.get("targets_noop", 0)),
            errors=tuple(str(e) for e in d.get("errors", ())),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Ack":
        return cls.from_dict(json.loads(raw))


def _req(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise CommandError(key, None, "a value (field missing)")
    return d[key]


def _enum(enum: type[StrEnum], d: Mapping[str, Any], key: str):
    raw = _req(d, key)
    try:
        return enum(raw)
    except ValueError:
        raise CommandError(key, raw, "|".join(m.value for m in enum)) from None


__all__ = [
    "Ack", "AckOutcome", "Action", "Command", "CommandError", "Mode", "Target",
    "canonical_bytes", "command_id", "sign", "verify",
]
