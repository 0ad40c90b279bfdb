"""The node actuator: verify each command, apply it at most once, execute it, ack it.

Checks, in order, each counted and acked with its reason (never an exception, never a retry loop):

1. addressed to this node (``rejected_node``);
2. HMAC signature with the shared secret (``rejected_signature``): a forged or altered command
   is never executed;
3. decided on this run of the node (``rejected_epoch``): the command's signed producer epoch is
   the node's (when the actuator knows it). A restarted node's clock starts over, so without this
   a command of its previous run could look fresh;
4. not applied before (``duplicate``): the id is looked up in the applied-id journal;
5. not expired (``rejected_expired``): ``now > issued_at + ttl`` on the node's clock;
6. not from the future (``rejected_future``): ``issued_at`` at most ``max_skew_ns`` ahead of
   the node's clock, and not valid for longer than ``max_ttl_ns`` (``rejected_ttl``): together
   they bound how long any signed command can stay usable;
7. within this node's bounds (``rejected_payload``, ``Executor.refusal``): no headroom, target,
   reclaim or compaction larger than the engine's pool. Refused before it is journaled: nothing
   changed, and a corrected command may use the same id.

A record whose payload breaks the static bounds (a negative hold, a headroom of 2^63) is not a
command at all: it fails to decode (``CommandError``), is counted ``malformed`` and dead-lettered
with the reason by ``run_actuators``, and nothing runs.

Delivery is at-least-once (a consumer restart re-delivers what was not committed), so effects
must be applied at most once per id. The id is written to the journal — a small append-only file
per node, fsynced — *before* the command executes: if the process dies mid-command, the restarted
actuator finds the id and acks the redelivered copy as a duplicate instead of applying it a
second time. (If it died before the effect happened, the effect is lost; the next tick's
decision issues a fresh command with a fresh id, which is the safe direction for memory actions.)
If ``execute`` raises, the command is acked FAILED with the error and the loop goes on; its id
stays journaled (the effect may be partly applied), so at-most-once application still holds.
Journal entries are dropped once their command's TTL has passed: an older redelivery is rejected
as expired anyway, so the journal stays small.

``Actuator`` is synchronous and takes the node's time as an argument; ``run_actuators`` is the
thin async shell over a bus. The shell isolates records: a command whose handling raises (the
journal's disk is full, say) is dead-lettered with the reason, counted and logged, and the loop
goes on.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from kvguard.actuators.executor import Executor
from kvguard.bus.deliver import deliver_all
from kvguard.bus.dlq import RecordDecoder
from kvguard.contracts.commands import Ack, AckOutcome, Command, CommandError, verify
from kvguard.contracts.units import NS_PER_S
from kvguard.wire.schemas import make_headers

log = logging.getLogger(__name__)


class AppliedJournal:
    """Ids of applied commands with their expiry (event-time ns); optionally persisted to ``path``.

    File format: one ``<id> <expires_at_ns>`` line per applied command. A torn last line (the
    process died while writing it) is ignored on load.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, compact_every: int = 1024) -> None:
        self.path = Path(path) if path is not None else None
        self.compact_every = compact_every
        self._expires: dict[str, int] = {}
        self._appended = 0
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def __contains__(self, command_id: str) -> bool:
        return command_id in self._expires

    def __len__(self) -> int:
        return len(self._expires)

    def record(self, command_id: str, expires_at_ns: int) -> None:
        self._expires[command_id] = expires_at_ns
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="ascii") as fh:
            fh.write(f"{command_id} {expires_at_ns}\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._appended += 1

    def prune(self, now_ns: int) -> int:
        """Forget ids whose command expired before ``now_ns``; rewrite the file now and then."""
        stale = [cid for cid, exp in self._expires.items() if exp < now_ns]
        for cid in stale:
            del self._expires[cid]
        if self.path is not None and self._appended >= self.compact_every:
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text("".join(f"{cid} {exp}\n" for cid, exp in self._expires.items()), encoding="ascii")
            os.replace(tmp, self.path)
            self._appended = 0
        return len(stale)

    def _load(self, path: Path) -> None:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in _bounded_lines(fh, JOURNAL_LINE_CHARS):
                self._load_line(line)

    def _load_line(self, line: str) -> None:
        parts = line.split()
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            return  # a torn write at the end of the file
        self._expires[parts[0]] = int(parts[1])


# a journal line is "<command id> <expires_at_ns>"; no command id comes near this, so a longer line is
# damage (skipped like a torn one), and reading stops at the bound instead of holding the whole line
JOURNAL_LINE_CHARS = 64 * 1024


def _bounded_lines(fh, limit: int):
    """The lines of ``fh`` of at most ``limit`` characters; longer ones are skipped, read in pieces."""
    while line := fh.readline(limit + 1):
        if len(line) <= limit:
            yield line
            continue
        while line and not line.endswith("\n"):
            line = fh.readline(limit + 1)


@dataclass(slots=True)
class ActuatorCounters:
    received: int = 0
    executed: int = 0
    noop: int = 0
    failed: int = 0
    duplicate: int = 0
    rejected_signature: int = 0
    rejected_expired: int = 0
    rejected_node: int = 0
    malformed: int = 0
    units_freed: int = 0
    units_moved: int = 0
    rejected_epoch: int = 0
    rejected_future: int = 0
    rejected_ttl: int = 0
    errors: int = 0  # records whose handling raised (dead-lettered by run_actuators)
    rejected_payload: int = 0  # numbers beyond this node's bounds (the executor refused before acting)

    def as_dict(self) -> dict[str, int]:
        """Every counter; those after ``units_moved`` only when non-zero, so summaries keep the
        keys they had before these checks existed."""
        base = self.__slots__[:self.__slots__.index("units_moved") + 1]
        return {name: getattr(self, name) for name in self.__slots__
                if name in base or getattr(self, name)}


DEFAULT_MAX_SKEW_NS = 60 * NS_PER_S  # node.command_max_skew_s
DEFAULT_MAX_TTL_NS = 3600 * NS_PER_S  # node.command_max_ttl_s


class Actuator:
    def __init__(self, node: str, executor: Executor, secret: bytes, *,
                 journal: AppliedJournal | None = None,
                 clock_ns: Callable[[], int] = time.perf_counter_ns, epoch: int | None = None,
                 max_skew_ns: int = DEFAULT_MAX_SKEW_NS, max_ttl_ns: int = DEFAULT_MAX_TTL_NS) -> None:
        """``epoch``: the producer epoch of the node's current run (None: not checked, for an
        in-process loop whose policy sees only this run)."""
        self.node = node
        self.executor = executor
        self.secret = secret
        self.journal = journal if journal is not None else AppliedJournal()
        self.clock_ns = clock_ns  # wall clock, only for the execution latency in acks
        self.epoch = epoch
        self.max_skew_ns = max_skew_ns
        self.max_ttl_ns = max_ttl_ns
        self.counters = ActuatorCounters()

    def handle(self, command: Command, now_ns: int) -> Ack:
        """Verify and apply one command at the node's time ``now_ns``; always returns an ack."""
        started = self.clock_ns()
        self.counters.received += 1
        if command.node != self.node:
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_NODE,
                                f"addressed to {command.node!r}, this is {self.node!r}")
        if not verify(command, self.secret):
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_SIGNATURE,
                                "HMAC signature does not match (forged, altered, or another secret)")
        if self.epoch is not None and command.epoch != self.epoch:
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_EPOCH,
                                f"decided on epoch {command.epoch}, this node runs epoch {self.epoch} "
                                "(a command of an earlier run)")
        if command.id in self.journal:
            return self._reject(command, now_ns, started, AckOutcome.DUPLICATE,
                                f"command {command.id} was applied already")
        if command.is_expired(now_ns):
            late_s = (now_ns - command.expires_at_ns()) / NS_PER_S
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_EXPIRED,
                                f"expired {late_s:.3f} s ago (ttl {command.ttl_ns / NS_PER_S:g} s)")
        if command.issued_at_ns - now_ns > self.max_skew_ns:
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_FUTURE,
                                f"issued {(command.issued_at_ns - now_ns) / NS_PER_S:.3f} s ahead of the node's clock "
                                f"(at most {self.max_skew_ns / NS_PER_S:g} s: node.command_max_skew_s)")
        if command.ttl_ns > self.max_ttl_ns:
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_TTL,
                                f"ttl {command.ttl_ns / NS_PER_S:g} s is longer than {self.max_ttl_ns / NS_PER_S:g} s "
                                "(node.command_max_ttl_s)")
        refused = self.executor.refusal(command)
        if refused is not None:
            return self._reject(command, now_ns, started, AckOutcome.REJECTED_PAYLOAD, refused)
        self.journal.record(command.id, command.expires_at_ns())
        try:
            result = self.executor.execute(command, now_ns)
        except Exception as err:  # noqa: BLE001 - an executor bug must not stop the node's actuator
            # the id stays journaled: the effect may be partly applied, so a redelivered copy is a
            # duplicate, never a second application (at most once); the policy's next tick decides anew
            self.journal.prune(now_ns)
            self.counters.failed += 1
            log.exception("actuator %s: command %s (%s) raised while executing", self.node, command.id,
                          command.action.value)
            return self._ack(command, now_ns, started, AckOutcome.FAILED,
                             errors=(f"execute raised {type(err).__name__}: {err}",))
        self.journal.prune(now_ns)
        if result.outcome is AckOutcome.EXECUTED:
            self.counters.executed += 1
        elif result.outcome is AckOutcome.NOOP:
            self.counters.noop += 1
        elif result.outcome is AckOutcome.REJECTED_PAYLOAD:
            self.counters.rejected_payload += 1
        else:
            self.counters.failed += 1
        self.counters.units_freed += result.units_freed
        self.counters.units_moved += result.units_moved
        return self._ack(command, now_ns, started, result.outcome, units_freed=result.units_freed,
                         units_moved=result.units_moved, targets_done=result.targets_done,
                         targets_noop=result.targets_noop, errors=result.errors)

    def handle_record(self, value: Mapping[str, Any] | bytes | None, now_ns: int) -> Ack | None:
        """Decode and handle; a malformed command (a tombstone's None included) is counted and
        logged (None: nothing to ack)."""
        if value is None:
            self.counters.malformed += 1
            log.warning("actuator %s: a command record with a null value (a tombstone): skipped", self.node)
            return None
        try:
            command = Command.from_bytes(value) if isinstance(value, (bytes, bytearray)) else Command.from_dict(value)
        except CommandError as err:
            self.counters.malformed += 1
            log.warning("actuator %s: malformed command: %s", self.node, err)
            return None
        return self.handle(command, now_ns)

    def _reject(self, command: Command, now_ns: int, started: int, outcome: AckOutcome, why: str) -> Ack:
        setattr(self.counters, outcome.value, getattr(self.counters, outcome.value) + 1)
        log.info("actuator %s: %s command %s: %s", self.node, outcome.value, command.id, why)
        return self._ack(command, now_ns, started, outcome, errors=(why,))

    def _ack(self, command: Command, now_ns: int, started: int, outcome: AckOutcome, **fields: Any) -> Ack:
        return Ack(command_id=command.id, node=self.node, outcome=outcome, executed_at_ns=now_ns,
                   latency_ns=max(0, self.clock_ns() - started), issued_at_ns=command.issued_at_ns,
                   action=command.action.value, variant=command.variant, mode=command.mode.value, **fields)


async def run_actuators(bus: Any, settings: Any, actuators: Mapping[str, Actuator], *,
                        node_time_ns: Callable[[str], int], group: str,
                        stop: Any = None, on_ack: Callable[[Ack], None] | None = None,
                        poll_s: float = 0.05) -> None:
    """Consume ``kvguard.commands`` for the given nodes until ``stop`` (an asyncio.Event) is set.

    Commands for nodes this process does not run are skipped (committed, not acked: they belong
    to another node process). Acks go to ``kvguard.acks`` keyed by node.
    """
    commands_topic = settings.topics.name("commands")
    acks_topic = settings.topics.name("acks")
    decoder = RecordDecoder(bus, settings.topics.name("dlq"), component="actuator", group=group)
    subscription = bus.subscribe([commands_topic], group)
    try:
        while stop is None or not stop.is_set():
            records = await subscription.getmany(max_records=256, timeout_s=poll_s)
            pending: list = []
            for record in records:
                model = await decoder.decode("commands", record)
                if model is None:
                    continue
                actuator = actuators.get(str(getattr(model, "node", "")))
                if actuator is None:
                    continue
                try:
                    command = Command.from_dict(model.model_dump())
                except CommandError as err:  # an action or mode this actuator does not know
                    actuator.counters.malformed += 1
                    await decoder.dead_letter(record, "invalid", str(err))
                    continue
                try:
                    ack = actuator.handle(command, node_time_ns(actuator.node))
                except Exception as err:  # noqa: BLE001 - one poison command must not stop the node's actuators
                    actuator.counters.errors += 1
                    await decoder.handler_failed(record, err)
                    continue
                pending.append((acks_topic, ack.node, ack.to_bytes(),
                                make_headers("acks", ack.node, record_id=ack.command_id)))
                if on_ack is not None:
                    on_ack(ack)
            # acks delivered (retried through an outage) before the commands are committed; a
            # redelivered command after a crash here is acked as a duplicate (journal), not re-applied
            if not await deliver_all(bus, pending, stop=stop, label=f"actuator acks ({group})"):
                break
            if records:
                await subscription.commit()
    finally:
        await subscription.close()
