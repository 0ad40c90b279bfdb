"""SLO ledger in Redis, same records and semantics as ``MemorySloLedger`` (policy/slo.py).

Keys (``P`` prefix, ``W`` ISO week in a hash tag):

    P slo:{W}:pred          hash  tp/fp/tn/fn → count
    P slo:{W}:pred_hwm      hash  node → last counted ts_ns (zero-padded, compared as strings:
                                  ns timestamps exceed a Lua double's exact range)
    P slo:{W}:ooms          set   node|ts_ns of each OOM
    P slo:{W}:tiers         set   tiers that reported a lead time this week
    P slo:{W}:lead:<tier>   zset  node|ts_ns → lead time (s), 0 = missed
    P slo:{W}:evictions     set   node|req|ts_ns of each eviction
    P slo:{W}:evicted       hash  node|req → pending | completed | failed
    P slo:evreq:<node>|<req>  string  week of the request's first eviction (so the outcome,
                                  which comes later and without a week, finds its week)

The outcome script reaches from the per-request pointer into the week's hash, so the SLO
ledger needs a single Redis (or a primary), not Redis Cluster; the budget ledger has no such limit.
Writes go through ``ResilientRedis``: buffered while Redis is down, replayed on reconnect.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvguard.policy.budget import LedgerStats, iso_week, parse_week
from kvguard.policy.budget_redis import DONE, ResilientRedis, ScriptCall
from kvguard.policy.slo import (
    COMPLETED,
    FAILED,
    MemorySloLedger,
    SloConfig,
    SloReport,
    TierLeads,
    check_tier,
    order_tiers,
    outcome_field,
)

_PRED_LUA = """
local hwm = redis.call('HGET', KEYS[2], ARGV[1])
if hwm and ARGV[2] <= hwm then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""

_OOM_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[2])
for i = 3, #KEYS do
  local tier, lead = ARGV[2 * i - 3], ARGV[2 * i - 2]
  redis.call('SADD', KEYS[2], tier)
  redis.call('ZADD', KEYS[i], lead, ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

_EVICT_LUA = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSETNX', KEYS[2], ARGV[2], 'pending')
redis.call('SET', KEYS[3], ARGV[3], 'NX', 'EX', ARGV[4])
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

_OUTCOME_LUA = """
local week = redis.call('GET', KEYS[1])
if not week then return 0 end
local key = ARGV[1] .. 'slo:{' .. week .. '}:evicted'
if redis.call('HGET', key, ARGV[2]) ~= 'pending' then return 0 end
redis.call('HSET', key, ARGV[2], ARGV[3])
return 1
"""


def _ts(ts_ns: int) -> str:
    if ts_ns < 0:
        raise ValueError(f"ts_ns={ts_ns}: expected ns since the epoch, >= 0")
    return f"{int(ts_ns):020d}"


class RedisSloLedger:
    """Record methods return True when counted, False for a duplicate, when buffered or when
    Redis refused the record for good (``stats()`` ``buffered`` and ``errors`` tell which)."""

    def __init__(self, url: str, config: SloConfig | None = None, **redis_options: Any) -> None:
        self.config = config or SloConfig()
        self.store = ResilientRedis(
            url, {"pred": _PRED_LUA, "oom": _OOM_LUA, "evict": _EVICT_LUA, "outcome": _OUTCOME_LUA},
            label="slo ledger", buffer_max=self.config.buffer_max, on_result=self._on_result,
            **redis_options)
        self._stats = LedgerStats(backend="redis", buffer_max=self.config.buffer_max)

    def _base(self, week: str) -> str:
        return f"{self.config.key_prefix}slo:{{{week}}}"

    def record_prediction(self, node: str, ts_ns: int, predicted: bool, actual: bool) -> bool:
        base = self._base(iso_week(ts_ns))
        return self._call("pred", (f"{base}:pred", f"{base}:pred_hwm"),
                          (node, _ts(ts_ns), outcome_field(predicted, actual),
                           self.config.retention_s))

    def record_oom(self, node: str, ts_ns: int, lead_s_by_tier: Mapping[str, float]) -> bool:
        base = self._base(iso_week(ts_ns))
        tiers = [check_tier(t) for t in lead_s_by_tier]
        keys = (f"{base}:ooms", f"{base}:tiers", *(f"{base}:lead:{t}" for t in tiers))
        args: list[Any] = [f"{node}|{_ts(ts_ns)}", self.config.retention_s]
        for tier in tiers:
            args += [tier, max(0.0, float(lead_s_by_tier[tier]))]
        return self._call("oom", keys, tuple(args))

    def record_eviction(self, node: str, req: str, ts_ns: int) -> bool:
        week = iso_week(ts_ns)
        base = self._base(week)
        return self._call("evict", (f"{base}:evictions", f"{base}:evicted",
                                    self._pointer(node, req)),
                          (f"{node}|{req}|{_ts(ts_ns)}", f"{node}|{req}", week,
                           self.config.retention_s))

    def record_eviction_outcome(self, node: str, req: str, completed: bool) -> bool:
        return self._call("outcome", (self._pointer(node, req),),
                          (self.config.key_prefix, f"{node}|{req}",
                           COMPLETED if completed else FAILED))

    def flush(self) -> bool:
        return self.store.flush()

    def report(self, week: str) -> SloReport:
        parse_week(week)
        base = self._base(week)

        def read(r: Any) -> tuple[Any, ...]:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(f"{base}:pred").scard(f"{base}:ooms").smembers(f"{base}:tiers")
            pipe.scard(f"{base}:evictions").hvals(f"{base}:evicted")
            counts, ooms, tiers, evictions, states = pipe.execute()
            tiers = order_tiers(tiers)
            pipe = r.pipeline(transaction=False)
            for tier in tiers:
                pipe.zrange(f"{base}:lead:{tier}", 0, -1, withscores=True)
            leads = pipe.execute() if tiers else []
            return counts, ooms, tiers, leads, evictions, states

        counts, ooms, tiers, leads, evictions, states = self.store.read(read)
        tier_leads = tuple(TierLeads(t, tuple(score for _, score in sorted(pairs)))
                           for t, pairs in zip(tiers, leads))
        return SloReport(week=week, **{k: int(counts.get(k, 0)) for k in ("tp", "fp", "tn", "fn")},
                         ooms=int(ooms), tiers=tier_leads, evictions=int(evictions),
                         evicted_requests=len(states), completed=states.count(COMPLETED),
                         failed=states.count(FAILED), recall_target=self.config.recall_target,
                         fpr_target=self.config.fpr_target)

    def weeks(self) -> list[str]:
        pattern = f"{_glob_escape(self.config.key_prefix)}slo:{{*}}:*"
        found = self.store.read(lambda r: list(r.scan_iter(match=pattern, count=1000)))
        return sorted({key[key.index("{") + 1: key.index("}")] for key in found})

    def stats(self) -> LedgerStats:
        return self.store.stats(self._stats)

    def close(self) -> None:
        self.store.close()

    def _pointer(self, node: str, req: str) -> str:
        return f"{self.config.key_prefix}slo:evreq:{node}|{req}"

    def _call(self, script: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> bool:
        self._stats.debits += 1
        outcome = self.store.call(ScriptCall(script, keys, args, None))
        return outcome.status == DONE and bool(outcome.value)

    def _on_result(self, call: ScriptCall, result: Any) -> None:
        if int(result):
            self._stats.counted += 1
        else:
            self._stats.duplicates += 1


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def open_slo_ledger(redis_url: str | None, config: SloConfig | None = None,
                    **redis_options: Any) -> Any:
    """In-memory SLO ledger without a Redis URL (embedded), else the Redis one."""
    if not redis_url:
        return MemorySloLedger(config)
    return RedisSloLedger(redis_url, config, **redis_options)
