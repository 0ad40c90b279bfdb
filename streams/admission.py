"""Admitting one node's batches before anything of them is applied: their order, redeliveries,
impossible contents, epoch jumps and jumps of event time; then the runs that can be applied as one.

Pure (numpy + stdlib), and nothing here changes a node's state: ``admit`` returns what to apply
and what to reject (an ``Admission``), the core applies both.

Each node's batches of one call are put in ``(epoch, seq)`` order and redeliveries dropped, so a
duplicated batch, or batches reordered within one call, give the ticks of the clean stream. A batch
is rejected when it fails ``kvguard.wire.validate``'s checks against the node's region, or when its
epoch jumps more than ``max_epoch_jump`` past the node's (one record with epoch 2^62 would
otherwise make every later batch of the node "older", silencing it for good). A node's epoch counts
as confirmed once a second batch of it arrives: while it is not, a batch of an older epoch is not a
redelivery but a sign the newer one was bogus, and the node starts over at the older epoch
(``epochs_retracted``), so a node's first batch with epoch 2^62 cannot silence it either. A real
restart is taken at its first batch.

Event time is bounded the same way (``clock_verdict``): a batch whose event time runs more than
``max_ts_skew_s`` ahead of the node's clock (its newest event so far), or jumps that far inside the
batch, is rejected (a single batch far in the future would otherwise move the tick clock there, and
every later batch would look "in the past" and tick no more); the next batch continuing from the
jumped time confirms it (a GPU idle that long), and is applied. A node whose batches run more than
``max_ts_skew_s`` behind its clock twice in a row had its clock set by a bogus batch (its first,
say): its tick clock starts over at the second (``clock_rebases``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvguard.contracts.events import EventBatch, Geometry
from kvguard.streams.config import StreamConfig
from kvguard.wire.validate import InvalidRecord, check_geometry, check_state

if TYPE_CHECKING:
    from kvguard.streams.node_state import NodeState

_INT62 = 1 << 62


class OffClock(NamedTuple):
    """A batch whose event time was more than ``max_ts_skew_s`` off its node's clock."""

    ts_ns: int  # its newest event time
    seq: int
    ahead: bool  # True: ahead (rejected); False: behind (applied)


@dataclass(slots=True)
class Admission:
    """One node's batches of a call, sorted out: what to apply and what to reject, with counts."""

    batches: list[EventBatch] = field(default_factory=list)  # to apply, in (epoch, seq) order
    rebase: set[int] = field(default_factory=set)  # ids of batches before which the node's clock starts over
    rejected: list[tuple[EventBatch, str]] = field(default_factory=list)  # (batch, detail), in order
    off_clock: OffClock | None = None  # the node's off-clock mark after these batches
    duplicates: int = 0  # redeliveries dropped
    epoch_jumps: int = 0  # rejected: epoch more than max_epoch_jump past the node's
    ts_jumps: int = 0  # rejected: event time more than max_ts_skew_s ahead, unconfirmed
    clock_rebases: int = 0
    epochs_retracted: int = 0


def admit(st: NodeState, batches: list[EventBatch], config: StreamConfig) -> Admission:
    """The node's batches to apply, in ``(epoch, seq)`` order: redeliveries (at or before the
    node's position, repeated within the call, or of an older epoch than a confirmed one) are
    dropped and counted as duplicates; batches whose geometry or state dump is impossible
    (``kvguard.wire.validate``), whose epoch jumps past ``max_epoch_jump`` or whose event time
    jumps past ``max_ts_skew_s`` unconfirmed are rejected (their events are checked per group,
    when they are applied). ``st`` is read, never changed."""
    if len(batches) > 1:
        batches = sorted(batches, key=lambda b: (b.epoch, b.seq))
    epoch, seq, confirmed, clock, off = st.epoch, st.seq, st.epoch_confirmed, st.max_ts_ns, st.off_clock
    geometry = st.mirror.geometry if st.mirror is not None else None
    out = Admission()
    for b in batches:
        older = epoch is not None and b.epoch < epoch
        if epoch is not None and ((older and confirmed) or (b.epoch == epoch and b.seq <= seq)):
            out.duplicates += 1
            continue
        if epoch is not None and b.epoch - epoch > config.max_epoch_jump:
            out.epoch_jumps += 1
            out.rejected.append((b, (f"epoch {b.epoch} is {b.epoch - epoch} past the node's epoch {epoch}, more "
                                     f"than streams.max_epoch_jump ({config.max_epoch_jump}): not taken as a restart")))
            continue
        region = b.geometry or geometry
        try:
            if b.epoch > _INT62 or b.seq > _INT62:
                raise InvalidRecord(f"epoch/seq: {b.epoch}/{b.seq}, expected at most 2^62")
            if b.geometry is not None:
                check_geometry(b.geometry, config.limits)
            if b.state is not None:
                check_state(b.state, None if region is None else region.dynamic_units, config.limits)
        except InvalidRecord as err:
            out.rejected.append((b, err.detail))
            continue
        if epoch is None or b.epoch != epoch:  # first batch, restart or retraction: a new clock
            clock = off = None
        verdict, newest, off = clock_verdict(b, clock, off, config.max_ts_skew_ns)
        if verdict == "reject":
            out.ts_jumps += 1
            out.rejected.append((b, (f"ts_ns runs to {newest}, more than streams.max_ts_skew_s "
                                     f"({config.max_ts_skew_s:g} s) past the node's clock ({clock} ns) or its own "
                                     "earlier events: a jump of event time, until a later batch going on from it "
                                     "confirms it")))
            continue
        if verdict == "rebase":
            out.clock_rebases += 1
            out.rebase.add(id(b))
            clock = None
        if older:
            out.epochs_retracted += 1
        if newest is not None:
            clock = newest if clock is None else max(clock, newest)
        out.batches.append(b)
        confirmed = epoch is not None and b.epoch == epoch
        epoch, seq, geometry = b.epoch, b.seq, region
    out.off_clock = off
    return out


def clock_verdict(batch: EventBatch, clock: int | None, off: OffClock | None,
                  skew_ns: int) -> tuple[str, int | None, OffClock | None]:
    """Where a batch's event time stands against its node's ``clock`` (newest event time so far):
    ``("ok" | "reject" | "rebase", its newest event time, the node's off-clock mark after it)``.
    Ahead by more than ``skew_ns`` (from the clock or inside the batch): rejected, unless it goes
    on from the last rejected batch (a later seq within ``skew_ns`` of its time). Behind by more
    than ``skew_ns``: applied (its times are clamped to the clock), and a second such batch going
    on from the first rebases the clock. Times outside 0..2^62 are left to ``check_events``."""
    ts = batch.events["ts_ns"]
    if len(ts) == 0 or int(ts.min()) < 0 or int(ts.max()) > _INT62:
        return "ok", None, off
    run = np.maximum.accumulate(ts)
    first, newest = int(run[0]), int(run[-1])
    inner = int(np.diff(run).max()) if len(run) > 1 else 0
    goes_on = off is not None and batch.seq > off.seq and abs(first - off.ts_ns) <= skew_ns and inner <= skew_ns
    if inner > skew_ns or (clock is not None and first - clock > skew_ns):
        if off is not None and off.ahead and goes_on:
            return "ok", newest, None
        return "reject", newest, OffClock(newest, batch.seq, True)
    if clock is not None and clock - newest > skew_ns:
        if off is not None and not off.ahead and goes_on:
            return "rebase", newest, None
        return "ok", newest, OffClock(newest, batch.seq, False)
    return "ok", newest, None


def contiguous_groups(batches: list[EventBatch], geometry: Geometry | None,
                      breaks: set[int] = frozenset()) -> list[list[EventBatch]]:
    """Split one node's batches into runs that can be applied as one: each next batch continues
    the previous (same epoch, seq + 1), brings no new geometry, and no state precedes it.
    A batch whose id is in ``breaks`` starts a run."""
    groups: list[list[EventBatch]] = []
    for b in batches:
        if groups and id(b) not in breaks:
            prev = groups[-1][-1]
            known = (geometry, groups[-1][0].geometry)
            if (b.epoch == prev.epoch and b.seq == prev.seq + 1 and prev.state is None
                    and (b.geometry is None or b.geometry in known)):
                groups[-1].append(b)
                continue
        groups.append([b])
        geometry = b.geometry or geometry
    return groups
