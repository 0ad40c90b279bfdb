"""Redis budget ledger: one Lua script per debit, so the idempotency check, the node and
cluster totals, the burn bucket, the exhaustion claim and the expiry happen atomically.

Keys (``P`` = key prefix, ``W`` = ISO week; the week sits in a hash tag so all keys of a week
share one cluster slot and one script may touch them all):

    P budget:{W}:seen:<node>    set    tick ts_ns already debited (idempotency keys)
    P budget:{W}:used           hash   node → milliseconds burned
    P budget:{W}:clusters       hash   cluster → milliseconds burned
    P budget:{W}:node_cluster   hash   node → cluster
    P budget:{W}:burn:<node>    zset   burn bucket start (s) → milliseconds burned in it
    P budget:{W}:alerted        hash   node → "<ts_ns>|<ledger id>": the tick that exhausted it
                                       and the ledger object that sent it (the claim)

Every key's TTL is reset on each counted debit to the retention (weeks + the week itself), so
a week disappears ``retention_weeks`` after its last write.

When Redis is unreachable, ``ResilientRedis`` (shared with the SLO ledger) buffers the script
calls in a bounded ``OutageBuffer`` and replays them, oldest first, when Redis answers again;
the scripts are idempotent, so a call that did reach Redis before the failure is not counted
twice. A call that ran but whose reply was lost comes back as a duplicate; the debit script then
still reports the exhaustion claim when that very debit, from this very ledger object, made it,
so the alert is not lost; the same tick redelivered to another process does not alert again. A
Redis that answers but refuses a write for a while (a replica during failover: READONLY; OOM;
TRYAGAIN; CLUSTERDOWN/MASTERDOWN; BUSY running a script) is treated like an outage: the call is
buffered and retried. Any other refusal (a script or key-type error) cannot be cured by
retrying: it is logged, counted in ``errors`` and reported as failed. The caller never sees an
exception from a write.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvguard.policy.budget import (
    BudgetAlert,
    BudgetConfig,
    BurnInterval,
    Debit,
    DebitResult,
    LedgerFront,
    LedgerStats,
    LedgerUnavailable,
    MemoryBudgetLedger,
    NodeBudget,
    OutageBuffer,
    OutageTracker,
    WeekStatus,
    parse_week,
)

log = logging.getLogger("kvguard.budget")

DEBIT_LUA = """
local node, ts, ms, cluster = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local claim = ts .. '|' .. ARGV[9]
if redis.call('SADD', KEYS[1], ts) == 0 then
  local used = tonumber(redis.call('HGET', KEYS[2], node) or '0')
  if redis.call('HGET', KEYS[6], node) == claim then
    -- this very debit made the claim; its reply may have been lost, so report the claim again
    return {0, used, 1, redis.call('ZREVRANGE', KEYS[5], 0, tonumber(ARGV[8]) - 1, 'WITHSCORES')}
  end
  return {0, used, 0, {}}
end
local used = redis.call('HINCRBY', KEYS[2], node, ms)
redis.call('HINCRBY', KEYS[3], cluster, ms)
redis.call('HSET', KEYS[4], node, cluster)
redis.call('ZINCRBY', KEYS[5], ms, ARGV[5])
local claimed, top = 0, {}
if used >= tonumber(ARGV[6]) and redis.call('HSETNX', KEYS[6], node, claim) == 1 then
  claimed = 1
  top = redis.call('ZREVRANGE', KEYS[5], 0, tonumber(ARGV[8]) - 1, 'WITHSCORES')
end
for i = 1, 6 do redis.call('EXPIRE', KEYS[i], ARGV[7]) end
return {1, used, claimed, top}
"""


def _connection_errors() -> tuple[type[BaseException], ...]:
    return (rex.ConnectionError, rex.TimeoutError, OSError)


def is_transient_refusal(exc: BaseException) -> bool:
    """True for replies with which Redis refuses a write for a while and accepts it later:
    READONLY (a replica, e.g. mid-failover), OOM (maxmemory reached until keys expire or
    memory is raised), TRYAGAIN, CLUSTERDOWN/MASTERDOWN, BUSY (another script running)."""
    if isinstance(exc, (rex.ReadOnlyError, rex.OutOfMemoryError, rex.TryAgainError,
                        rex.ClusterDownError)):
        return True
    return isinstance(exc, rex.ResponseError) and str(exc).startswith(("BUSY ", "OOM ", "READONLY "))


DONE, BUFFERED, FAILED = "done", "buffered", "failed"


@dataclass(slots=True, frozen=True)
class CallOutcome:
    """What ``ResilientRedis.call`` did: DONE with the script's ``value``, BUFFERED (Redis
    unreachable or refusing writes for now; replayed later) or FAILED (refused for good,
    logged and counted; dropped)."""

    status: str
    value: Any = None


class _ReplayRefused(Exception):
    """A replay that Redis refused for now; the refused calls are back in the buffer."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def mask_url(url: str) -> str:
    """The URL with its password replaced, for logs and errors."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def connect(url: str, *, socket_timeout_s: float = 1.0, connect_timeout_s: float = 0.5,
            ssl_ca_certs: str | None = None) -> Any:
    """A redis-py client for ``redis://[:password@]host:port/db`` or ``rediss://`` (TLS).
    No retries inside the client: an unreachable Redis must fail fast so the ledger can
    buffer instead of stalling the policy loop."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis url {mask_url(url)!r}: expected redis://, rediss:// or unix://")
    kwargs: dict[str, Any] = dict(socket_timeout=socket_timeout_s,
                                  socket_connect_timeout=connect_timeout_s,
                                  retry=Retry(NoBackoff(), 0), decode_responses=True)
    if ssl_ca_certs and url.startswith("rediss://"):
        kwargs["ssl_ca_certs"] = ssl_ca_certs
    return redis.Redis.from_url(url, **kwargs)


@dataclass(slots=True, frozen=True)
class ScriptCall:
    """One buffered-or-sent script invocation; ``context`` is the caller's own record of it."""

    script: str
    keys: tuple[str, ...]
    args: tuple[Any, ...]
    context: Any


class ResilientRedis:
    """A Redis client that survives outages for idempotent writes: a failed write goes to a
    bounded buffer; the next write after ``retry_interval_s`` (monotonic clock, injectable)
    first replays the buffer in order, in pipelined chunks. ``on_result(call, result)`` sees
    every result, replayed or direct."""

    def __init__(self, url: str, scripts: dict[str, str], *, label: str, buffer_max: int,
                 on_result: Callable[[ScriptCall, Any], None],
                 retry_interval_s: float = 1.0, socket_timeout_s: float = 1.0,
                 connect_timeout_s: float = 0.5, ssl_ca_certs: str | None = None,
                 clock: Callable[[], float] = time.monotonic, replay_chunk: int = 500) -> None:
        self.url = url
        self.label = label
        self.buffer = OutageBuffer(buffer_max)
        self.tracker = OutageTracker()
        self.replayed = 0
        self.errors = 0
        self._script_sources = scripts
        self._on_result = on_result
        self._retry_interval_s = retry_interval_s
        self._client_kwargs = dict(socket_timeout_s=socket_timeout_s,
                                   connect_timeout_s=connect_timeout_s, ssl_ca_certs=ssl_ca_certs)
        self._clock = clock
        self._replay_chunk = replay_chunk
        self._last_failure = 0.0
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._errors = _connection_errors()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.url, **self._client_kwargs)
            self._scripts = {name: self._client.register_script(src)
                             for name, src in self._script_sources.items()}
        return self._client

    @property
    def retry_due(self) -> bool:
        """False while an outage is on and the retry interval has not passed: callers then
        stay off the network."""
        return not self.tracker.down or self._clock() - self._last_failure >= self._retry_interval_s

    def call(self, call: ScriptCall) -> CallOutcome:
        """Run a script (after replaying the buffer). Never raises for Redis trouble: see
        ``CallOutcome`` for what can happen instead."""
        if not self.retry_due:
            self.buffer.append(call)
            return CallOutcome(BUFFERED)
        try:
            client = self.client
            self._replay()
            result = self._scripts[call.script](keys=call.keys, args=call.args, client=client)
        except self._errors as exc:
            return self._buffer(call, exc)
        except _ReplayRefused as exc:
            return self._buffer(call, exc.cause)
        except rex.RedisError as exc:
            self.errors += 1
            if is_transient_refusal(exc):
                return self._buffer(call, exc)
            log.error("%s: Redis refused %s on %s for good, dropped: %s: %s", self.label,
                      call.script, call.keys[0] if call.keys else "-", type(exc).__name__, exc)
            return CallOutcome(FAILED)
        self._recovered()
        self._on_result(call, result)
        return CallOutcome(DONE, result)

    def flush(self) -> bool:
        """Replay the buffer now, whatever the retry interval; True when it is empty."""
        try:
            self._replay()
        except self._errors as exc:
            self._failed(exc)
            return False
        except _ReplayRefused as exc:
            self._failed(exc.cause)
            return False
        self._recovered()
        return True

    def stats(self, counters: LedgerStats) -> LedgerStats:
        """A copy of the ledger's own counters with this store's outage figures filled in."""
        stats = LedgerStats(**counters.to_dict())
        stats.outage = self.tracker.down
        stats.outages = self.tracker.outages
        stats.buffered = len(self.buffer)
        stats.dropped = self.buffer.dropped
        stats.replayed = self.replayed
        stats.errors = self.errors
        return stats

    def read(self, fn: Callable[[Any], Any]) -> Any:
        """Run a read; raises LedgerUnavailable naming the (masked) URL when Redis is down."""
        try:
            return fn(self.client)
        except self._errors as exc:
            raise LedgerUnavailable(
                f"{self.label}: Redis at {mask_url(self.url)} is unreachable "
                f"({type(exc).__name__}: {exc})") from exc

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _replay(self) -> None:
        while len(self.buffer):
            chunk = self.buffer.peek(self._replay_chunk)
            pipe = self.client.pipeline(transaction=False)
            for call in chunk:
                self._scripts[call.script](keys=call.keys, args=call.args, client=pipe)
            results = pipe.execute(raise_on_error=False)
            self.buffer.commit(len(chunk))
            refused: list[ScriptCall] = []
            cause: BaseException | None = None
            for call, result in zip(chunk, results):
                if isinstance(result, Exception):
                    self.errors += 1
                    if is_transient_refusal(result):
                        refused.append(call)
                        cause = cause or result
                    else:
                        log.error("%s: replayed %s refused for good, dropped: %s: %s",
                                  self.label, call.script, type(result).__name__, result)
                    continue
                self.replayed += 1
                self._on_result(call, result)
            if cause is not None:
                self.buffer.push_front(refused)
                raise _ReplayRefused(cause)

    def _buffer(self, call: ScriptCall, exc: BaseException) -> CallOutcome:
        self._failed(exc)
        self.buffer.append(call)
        return CallOutcome(BUFFERED)

    def _failed(self, exc: BaseException) -> None:
        self._last_failure = self._clock()
        if self.tracker.failed():
            state = "refusing writes" if is_transient_refusal(exc) else "unreachable"
            log.warning("%s: Redis at %s %s (%s: %s); buffering writes in memory "
                        "(at most %d, oldest dropped past that)", self.label, mask_url(self.url),
                        state, type(exc).__name__, exc, self.buffer.max_items)

    def _recovered(self) -> None:
        if self.tracker.succeeded():
            log.info("%s: Redis at %s reachable again; %d buffered writes replayed so far, "
                     "%d dropped", self.label, mask_url(self.url), self.replayed,
                     self.buffer.dropped)


def budget_keys(prefix: str, week: str, node: str) -> tuple[str, ...]:
    """KEYS of the debit script, in its order."""
    base = f"{prefix}budget:{{{week}}}"
    return (f"{base}:seen:{node}", f"{base}:used", f"{base}:clusters",
            f"{base}:node_cluster", f"{base}:burn:{node}", f"{base}:alerted")


class RedisBudgetLedger(LedgerFront):
    """The budget ledger in Redis (see the module docstring for the keys).
    ``remaining`` reads Redis (one HGET) and falls back to the last value this process saw
    plus its buffered debits while Redis is down."""

    def __init__(self, url: str, config: BudgetConfig | None = None, **redis_options: Any) -> None:
        config = config or BudgetConfig()
        super().__init__(config, LedgerStats(backend="redis", buffer_max=config.buffer_max))
        self.store = ResilientRedis(url, {"debit": DEBIT_LUA}, label="budget ledger",
                                    buffer_max=config.buffer_max,
                                    on_result=self._on_result, **redis_options)
        self._known_ms: dict[tuple[str, str], int] = {}
        self.ledger_id = uuid.uuid4().hex[:16]  # marks this object's exhaustion claims

    def apply(self, debit: Debit) -> DebitResult:
        """Record a computed debit (idempotent per node and ts_ns)."""
        outcome = self.store.call(self.script_call(debit))
        if outcome.status == BUFFERED:
            key = (debit.node, debit.week)
            self._known_ms[key] = self._known_ms.get(key, 0) + debit.ms
            return self._result(debit.node, debit.week, counted=False, buffered=True)
        if outcome.status == FAILED:
            return self._result(debit.node, debit.week, counted=False, failed=True)
        return self._result(debit.node, debit.week, counted=bool(outcome.value[0]))

    def script_call(self, debit: Debit) -> ScriptCall:
        """The debit script invocation this ledger sends for ``debit``."""
        return ScriptCall("debit", budget_keys(self.config.key_prefix, debit.week, debit.node),
                          (debit.node, debit.ts_ns, debit.ms, debit.cluster,
                           debit.interval_start_s, self.config.budget_ms,
                           self.config.retention_s, self.config.top_intervals,
                           self.ledger_id), debit)

    def flush(self) -> bool:
        """Replay buffered debits now; True when none are left."""
        return self.store.flush()

    def remaining(self, node: str, week: str) -> float:
        if not self.store.retry_due:
            return max(0.0, (self.config.budget_ms - self._known_ms.get((node, week), 0)) / 1000)
        try:
            used = self.store.read(lambda r: r.hget(budget_keys(self.config.key_prefix, week, node)[1], node))
            used_ms = int(used or 0)
            if not len(self.store.buffer):
                self._remember(node, week, used_ms)
        except LedgerUnavailable:
            used_ms = self._known_ms.get((node, week), 0)
        return max(0.0, (self.config.budget_ms - used_ms) / 1000)

    def status(self, week: str, node: str | None = None) -> WeekStatus:
        parse_week(week)
        keys = budget_keys(self.config.key_prefix, week, "")
        used_key, clusters_key, node_cluster_key, alerted_key = keys[1], keys[2], keys[3], keys[5]

        def read(r: Any) -> tuple[Any, ...]:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(used_key).hgetall(clusters_key).hgetall(node_cluster_key).hgetall(alerted_key)
            used, clusters, node_cluster, alerted = pipe.execute()
            names = sorted(n for n in used if node is None or n == node)
            pipe = r.pipeline(transaction=False)
            for name in names:
                pipe.zrevrange(budget_keys(self.config.key_prefix, week, name)[4], 0,
                               self.config.top_intervals - 1, withscores=True)
            return used, clusters, node_cluster, alerted, names, pipe.execute() if names else []

        used, clusters, node_cluster, alerted, names, tops = self.store.read(read)
        rows = tuple(
            NodeBudget(node=name, cluster=node_cluster.get(name, self.config.cluster), week=week,
                       used_s=int(used[name]) / 1000, budget_s=self.config.budget_s,
                       alerted=name in alerted, top_intervals=_intervals(top))
            for name, top in zip(names, tops))
        return WeekStatus(week=week, budget_s=self.config.budget_s,
                          interval_s=self.config.interval_s, nodes=rows,
                          clusters={c: int(ms) / 1000 for c, ms in clusters.items()})

    def ping(self) -> None:
        """``LedgerUnavailable`` naming the (masked) URL when Redis does not answer."""
        self.store.read(lambda r: r.ping())

    def weeks(self) -> list[str]:
        prefix = re.sub(r"([*?\[\]\\])", r"\\\1", self.config.key_prefix)
        pattern = f"{prefix}budget:{{*}}:used"
        found = self.store.read(lambda r: list(r.scan_iter(match=pattern, count=1000)))
        weeks = {key[key.index("{") + 1: key.index("}")] for key in found}
        return sorted(weeks)

    def stats(self) -> LedgerStats:
        return self.store.stats(self._stats)

    def close(self) -> None:
        self.store.close()

    def _on_result(self, call: ScriptCall, result: Any) -> None:
        debit: Debit = call.context
        new, used_ms, claimed, top = int(result[0]), int(result[1]), int(result[2]), result[3]
        if new:
            self._stats.counted += 1
        else:
            self._stats.duplicates += 1
        if not len(self.store.buffer):
            self._remember(debit.node, debit.week, used_ms)
        if claimed:
            pairs = list(zip(top[::2], top[1::2]))
            self._emit(BudgetAlert(
                node=debit.node, cluster=debit.cluster, week=debit.week, ts_ns=debit.ts_ns,
                used_s=used_ms / 1000, budget_s=self.config.budget_s,
                top_intervals=_intervals(pairs)))

    def _remember(self, node: str, week: str, used_ms: int) -> None:
        if (node, week) not in self._known_ms and len(self._known_ms) > 100_000:
            self._known_ms.clear()
        self._known_ms[(node, week)] = used_ms

    def _used_ms(self, node: str, week: str) -> int:
        return self._known_ms.get((node, week), 0)


def _intervals(pairs: Any) -> tuple[BurnInterval, ...]:
    ranked = sorted(((int(float(start)), float(ms)) for start, ms in pairs),
                    key=lambda item: (-item[1], item[0]))
    return tuple(BurnInterval(start_s=start, burned_s=ms / 1000) for start, ms in ranked)


def open_budget_ledger(redis_url: str | None, config: BudgetConfig | None = None,
                       **redis_options: Any) -> Any:
    """The composition root's choice: the in-memory ledger when no Redis URL is given (the
    embedded default), else the Redis ledger. Nothing connects until the first call."""
    if not redis_url:
        return MemoryBudgetLedger(config)
    return RedisBudgetLedger(redis_url, config, **redis_options)
