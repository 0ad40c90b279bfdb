"""Commands from the policy engine to a node's actuator, and the actuator's acks (docs/ARCHITECTURE.md, "Policy").

A command is one action with its own small payload (``HoldPayload(max_prompt_tokens, steps)``,
``BatchCapPayload(tokens, steps)``, ``HeadroomPayload(units)``, ``EvictPayload(targets, …)``, …): each
number means one thing and is bounded where the payload is built, so an out-of-range value is refused
with the field named (``CommandError``), never coerced. Bounds that depend on the node (a headroom or
a target larger than its pool) are the executor's, which knows the pool (``actuators.executor``).

A command is signed with HMAC-SHA256 over a canonical encoding (JSON, sorted keys at every level, no
spaces, every field except ``signature``, the payload as a nested object) with a secret shared by the
policy and the actuators, so an actuator only ever executes what a holder of the secret issued. Its
``id`` is an idempotency key derived from what caused it (node, tick time, action, position), so
re-deciding the same tick after a policy restart reissues the same ids and the actuator applies each
at most once. A command is valid from ``issued_at_ns`` for ``ttl_ns``; an actuator rejects it after
that, because a decision taken on stale pressure can hurt more than it helps. It also carries (signed)
the producer ``epoch`` of the tick it was decided on: a node's clock starts over when it restarts, so
a command of an earlier run could otherwise look fresh on the new clock; the actuator rejects
commands of any other epoch than its node's.

Records are schema ``2.x``. The flat records of schema ``1.x`` (two numbers, ``units_needed`` and
``max_moves``, whose meaning changed per action) are refused with the reason, never read: a 1.x reader
would take a 2.x ``hold`` as a drain of everything, so the change is a major one.

Pure: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import operator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar, Mapping

from kvguard.contracts.dimensions import Granularity, HandlingChoice

COMMAND_SCHEMA = "2.0"
COMMAND_MAJOR = 2
ACK_SCHEMA = "1.0"
# The largest count any command carries (tokens, steps, units, moves): far past any real pool, token
# budget or hold, and small enough that no engine's arithmetic overflows with it.
MAX_COUNT = 2**31 - 1
MAX_REQUEST_ID = 2**63 - 1  # request ids are the events' int64 ``req`` column
MAX_TARGETS = 1024  # requests one evict or abort names


class Action(StrEnum):
    EVICT = "evict"  # free the targets' pages at the payload's granularity and handling
    COMPACT = "compact"  # migrate pages to coalesce free runs (no request loses anything)
    RECLAIM = "reclaim"  # drop cached (unreferenced) prefix pages
    HEADROOM = "headroom"  # hold ``units`` back from admission (0 = release)
    # cap the per-step token budget (vLLM: ``max_num_batched_tokens``) at ``tokens`` for ``steps`` steps
    # (0: until released); ``tokens`` 0 releases. Bounds activation and logits peaks.
    BATCH_CAP = "batch_cap"
    # hold admissions: no waiting (or preempted) request whose prompt is longer than ``max_prompt_tokens``
    # is admitted; 0 holds every admission (a drain: running requests finish); for ``steps`` non-empty
    # steps (0: until a ``release``). Held requests stay queued, nothing fails.
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
    NOOP = "noop"  # valid, but nothing to do here (every target finished; the engine lacks the knob): errors say why
    REJECTED_SIGNATURE = "rejected_signature"
    REJECTED_EXPIRED = "rejected_expired"
    REJECTED_NODE = "rejected_node"  # addressed to another node
    REJECTED_EPOCH = "rejected_epoch"  # decided on another run of the node (another producer epoch)
    REJECTED_FUTURE = "rejected_future"  # issued further ahead of the node's clock than the allowed skew
    REJECTED_TTL = "rejected_ttl"  # valid for longer than the actuator allows
    DUPLICATE = "duplicate"
    FAILED = "failed"
    # well formed, but a number is out of this node's bounds (a headroom or a target above its pool)
    REJECTED_PAYLOAD = "rejected_payload"


class CommandError(ValueError):
    """A command record is malformed; ``field`` names the offending field."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"command.{field}: got {value!r}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected


def _count(field: str, value: Any, low: int, high: int = MAX_COUNT) -> int:
    """``value`` as a bounded int (an integer, not a bool, a float or a string), or ``CommandError``."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or not low <= number <= high:
        raise CommandError(field, value, f"an integer in [{low}, {high}]")
    return number


def _bound(payload: Any, name: str, low: int, high: int = MAX_COUNT, field: str = "") -> None:
    """Check (and store as a plain int) one number of a frozen payload."""
    object.__setattr__(payload, name, _count(field or f"payload.{name}", getattr(payload, name), low, high))


def _member(enum: type[StrEnum], field: str, value: Any):
    try:
        return enum(value)
    except (TypeError, ValueError):
        raise CommandError(field, value, "|".join(m.value for m in enum)) from None


def _fields(payload: str, d: Any, names: tuple[str, ...]) -> Mapping[str, Any]:
    """The payload object ``d``; a key this reader does not know is refused (it might change the meaning)."""
    if not isinstance(d, Mapping):
        raise CommandError("payload", d, f"a JSON object with the {payload} fields {list(names)}")
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise CommandError(f"payload.{unknown[0]}", d[unknown[0]], f"one of the {payload} fields {list(names)}")
    return d


@dataclass(slots=True, frozen=True)
class Target:
    """One victim: free ``units`` units of request ``req`` (0 = all of it)."""

    req: int
    units: int = 0

    def __post_init__(self) -> None:
        _bound(self, "req", 0, MAX_REQUEST_ID, "payload.targets.req")
        _bound(self, "units", 0, field="payload.targets.units")


def _requests(field: str, values: Any, kind: str) -> tuple:
    if not isinstance(values, (tuple, list)) or not 1 <= len(values) <= MAX_TARGETS:
        raise CommandError(field, values, f"1 to {MAX_TARGETS} requests for {kind}")
    return tuple(values)


@dataclass(slots=True, frozen=True)
class EvictPayload:
    """Free each target's pages (``Target.units``, 0: all of it) at ``granularity``, with ``handling``."""

    targets: tuple[Target, ...]
    granularity: Granularity = Granularity.REQUEST
    handling: HandlingChoice = HandlingChoice.RECOMPUTE
    action: ClassVar[Action] = Action.EVICT

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", _requests("payload.targets", self.targets, "evict"))
        if not all(isinstance(t, Target) for t in self.targets):
            raise CommandError("payload.targets", self.targets, "Target values")
        object.__setattr__(self, "granularity", _member(Granularity, "payload.granularity", self.granularity))
        object.__setattr__(self, "handling", _member(HandlingChoice, "payload.handling", self.handling))

    def to_dict(self) -> dict[str, Any]:
        return {"targets": [[t.req, t.units] for t in self.targets], "granularity": self.granularity.value,
                "handling": self.handling.value}

    @classmethod
    def from_dict(cls, d: Any) -> EvictPayload:
        d = _fields("evict", d, ("targets", "granularity", "handling"))
        raw = d.get("targets")
        if not isinstance(raw, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2 for t in raw):
            raise CommandError("payload.targets", raw, "a list of [req, units]")
        return cls(tuple(Target(r, u) for r, u in raw), d.get("granularity", Granularity.REQUEST),
                   d.get("handling", HandlingChoice.RECOMPUTE))


@dataclass(slots=True, frozen=True)
class AbortPayload:
    """End these requests now (their clients see a retryable error)."""

    requests: tuple[int, ...]
    action: ClassVar[Action] = Action.ABORT

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(_count("payload.requests", req, 0, MAX_REQUEST_ID)
                                                   for req in _requests("payload.requests", self.requests, "abort")))

    def to_dict(self) -> dict[str, Any]:
        return {"requests": list(self.requests)}

    @classmethod
    def from_dict(cls, d: Any) -> AbortPayload:
        raw = _fields("abort", d, ("requests",)).get("requests")
        if not isinstance(raw, list):
            raise CommandError("payload.requests", raw, "a list of request ids")
        return cls(tuple(raw))


@dataclass(slots=True, frozen=True)
class CompactPayload:
    """Migrate at most ``max_moves`` pages so that free runs coalesce."""

    max_moves: int
    action: ClassVar[Action] = Action.COMPACT

    def __post_init__(self) -> None:
        _bound(self, "max_moves", 1)

    def to_dict(self) -> dict[str, Any]:
        return {"max_moves": self.max_moves}

    @classmethod
    def from_dict(cls, d: Any) -> CompactPayload:
        return cls(_fields("compact", d, ("max_moves",)).get("max_moves"))


@dataclass(slots=True, frozen=True)
class ReclaimPayload:
    """Drop up to ``units`` units of cached (unreferenced) prefix pages."""

    units: int
    action: ClassVar[Action] = Action.RECLAIM

    def __post_init__(self) -> None:
        _bound(self, "units", 1)

    def to_dict(self) -> dict[str, Any]:
        return {"units": self.units}

    @classmethod
    def from_dict(cls, d: Any) -> ReclaimPayload:
        return cls(_fields("reclaim", d, ("units",)).get("units"))


@dataclass(slots=True, frozen=True)
class HeadroomPayload:
    """Hold ``units`` back from admission on top of the engine's own watermark (0 releases it); a level."""

    units: int
    action: ClassVar[Action] = Action.HEADROOM

    def __post_init__(self) -> None:
        _bound(self, "units", 0)

    def to_dict(self) -> dict[str, Any]:
        return {"units": self.units}

    @classmethod
    def from_dict(cls, d: Any) -> HeadroomPayload:
        return cls(_fields("headroom", d, ("units",)).get("units"))


@dataclass(slots=True, frozen=True)
class BatchCapPayload:
    """At most ``tokens`` scheduled tokens per step (0 releases the cap) for ``steps`` non-empty steps
    (0: until released)."""

    tokens: int
    steps: int = 0
    action: ClassVar[Action] = Action.BATCH_CAP

    def __post_init__(self) -> None:
        _bound(self, "tokens", 0)
        _bound(self, "steps", 0)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: Any) -> BatchCapPayload:
        d = _fields("batch_cap", d, ("tokens", "steps"))
        return cls(d.get("tokens"), d.get("steps", 0))


@dataclass(slots=True, frozen=True)
class HoldPayload:
    """Admit no request whose prompt is longer than ``max_prompt_tokens`` (0: none at all, a drain) for
    ``steps`` non-empty steps (0: until a ``release``)."""

    max_prompt_tokens: int = 0
    steps: int = 0
    action: ClassVar[Action] = Action.HOLD

    def __post_init__(self) -> None:
        _bound(self, "max_prompt_tokens", 0)
        _bound(self, "steps", 0)

    def to_dict(self) -> dict[str, Any]:
        return {"max_prompt_tokens": self.max_prompt_tokens, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: Any) -> HoldPayload:
        d = _fields("hold", d, ("max_prompt_tokens", "steps"))
        return cls(d.get("max_prompt_tokens", 0), d.get("steps", 0))


@dataclass(slots=True, frozen=True)
class ReleasePayload:
    """End a ``hold`` (a drain included)."""

    action: ClassVar[Action] = Action.RELEASE

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: Any) -> ReleasePayload:
        _fields("release", d, ())
        return cls()


@dataclass(slots=True, frozen=True)
class EmptyCachePayload:
    """Return the caching allocator's unused cached segments to the device."""

    action: ClassVar[Action] = Action.EMPTY_CACHE

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: Any) -> EmptyCachePayload:
        _fields("empty_cache", d, ())
        return cls()


Payload = (EvictPayload | AbortPayload | CompactPayload | ReclaimPayload | HeadroomPayload | BatchCapPayload
           | HoldPayload | ReleasePayload | EmptyCachePayload)
# one payload type per action: the registry ``Command.from_dict`` reads payloads through
PAYLOADS: dict[Action, type] = {p.action: p for p in (EvictPayload, AbortPayload, CompactPayload, ReclaimPayload,
                                                     HeadroomPayload, BatchCapPayload, HoldPayload, ReleasePayload,
                                                     EmptyCachePayload)}
FLAT_FIELDS = ("units_needed", "max_moves", "targets", "granularity", "handling")  # schema 1.x


@dataclass(slots=True, frozen=True)
class Command:
    id: str
    node: str
    payload: Payload  # the action's own values; its type names the action
    reason: str
    mode: Mode
    variant: str
    issued_at_ns: int
    ttl_ns: int
    epoch: int = 0  # the producer epoch of the tick it was decided on (signed)
    signature: str = ""

    def __post_init__(self) -> None:
        if type(self.payload) not in PAYLOADS.values():
            raise CommandError("payload", self.payload, f"one of {[p.__name__ for p in PAYLOADS.values()]}")

    @property
    def action(self) -> Action:
        return self.payload.action

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
            "payload": self.payload.to_dict(),
            "reason": self.reason,
            "mode": self.mode.value,
            "variant": self.variant,
            "issued_at_ns": self.issued_at_ns,
            "ttl_ns": self.ttl_ns,
            "epoch": self.epoch,
            "signature": self.signature,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Command:
        """A command record (schema 2.x); a flat 1.x record is refused with the reason."""
        schema = d.get("schema", COMMAND_SCHEMA)
        if "payload" not in d and any(f in d for f in FLAT_FIELDS) or str(schema).split(".")[0] != str(COMMAND_MAJOR):
            raise CommandError("schema", schema, f"{COMMAND_MAJOR}.x with a payload object per action: flat 1.x records "
                                                 "(units_needed, max_moves) are refused, their numbers meant different "
                                                 "things per action; re-issue the command (docs/CONTRACTS.md)")
        action = _enum(Action, d, "action")
        payload = PAYLOADS[action].from_dict(_req(d, "payload"))
        try:
            return cls(
                id=str(_req(d, "id")),
                node=str(_req(d, "node")),
                payload=payload,
                reason=str(d.get("reason", "")),
                mode=_enum(Mode, d, "mode"),
                variant=str(d.get("variant", "")),
                issued_at_ns=int(_req(d, "issued_at_ns")),
                ttl_ns=int(_req(d, "ttl_ns")),
                epoch=int(d.get("epoch", 0)),
                signature=str(d.get("signature", "")),
            )
        except (TypeError, ValueError, OverflowError) as err:
            if isinstance(err, CommandError):
                raise
            raise CommandError("<record>", {k: d.get(k) for k in ("issued_at_ns", "ttl_ns", "epoch")},
                               f"integer times and epoch ({err})") from None

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Command:
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CommandError("<record>", raw[:80], f"a JSON object ({err})") from None
        if not isinstance(d, dict):
            raise CommandError("<record>", d, "a JSON object")
        return cls.from_dict(d)


def canonical_bytes(command: Command) -> bytes:
    """The signed bytes: every field but ``signature``, JSON with sorted keys (the payload's too) and no spaces."""
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
            "schema": ACK_SCHEMA,
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
    def from_dict(cls, d: Mapping[str, Any]) -> Ack:
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
    def from_bytes(cls, raw: bytes) -> Ack:
        return cls.from_dict(json.loads(raw))


def _req(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise CommandError(key, None, "a value (field missing)")
    return d[key]


def _enum(enum: type[StrEnum], d: Mapping[str, Any], key: str):
    raw = _req(d, key)
    try:
        return enum(raw)
    except (TypeError, ValueError):
        raise CommandError(key, raw, "|".join(m.value for m in enum)) from None


__all__ = [
    "PAYLOADS", "AbortPayload", "Ack", "AckOutcome", "Action", "BatchCapPayload", "Command", "CommandError",
    "CompactPayload", "EmptyCachePayload", "EvictPayload", "HeadroomPayload", "HoldPayload", "Mode", "Payload",
    "ReclaimPayload", "ReleasePayload", "Target", "canonical_bytes", "command_id", "sign", "verify",
]
