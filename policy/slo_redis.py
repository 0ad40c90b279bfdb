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

Canary rollout records (``policy.canary``; ``R`` the rollout id in a hash tag, kept for the
retention after the last write):

    P canary:{R}:state      hash  stage, status, since_ns, reason; candidate, control, mode, stages
    P canary:{R}:history    list  one JSON object per move (promotion or rollback)
    P canary:{R}:hwm        hash  node → epoch:ts_ns of its last counted tick (zero-padded)
    P canary:{R}:counts     hash  stage|arm|field → count (ticks, node_ms, ooms, commands, …)
    P canary:{R}:nodes      set   stage|arm|node of each node seen
    P canary:{R}:evicted    hash  node|req → stage|arm|pending|completed|failed

A record is counted only while the stored state is at its stage (running or promoted); moves
are compare-and-set on (stage, status).

The outcome script reaches from the per-request pointer into the week's hash, so the SLO
ledger needs a single Redis (or a primary), not Redis Cluster; the budget ledger has no such limit.
Writes go through ``ResilientRedis``: buffered while Redis is down, replayed on reconnect.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvguard.policy.budget import LedgerStats, iso_week, parse_week
from kvguard.policy.budget_redis import DONE, ResilientRedis, ScriptCall
from kvguard.policy.canary import COUNT_FIELDS, ArmStats, CanaryReport, CanaryState, history_entry
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

# a canary record counts only at the stored stage, while the rollout runs or is promoted
_CANARY_COUNTING = """
local st = redis.call('HMGET', KEYS[1], 'stage', 'status')
if st[1] ~= ARGV[2] or (st[2] ~= 'running' and st[2] ~= 'promoted') then return 0 end
"""

_CANARY_BEGIN_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

_CANARY_MOVE_LUA = """
local st = redis.call('HMGET', KEYS[1], 'stage', 'status')
if st[1] ~= ARGV[1] or st[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'stage', ARGV[3], 'status', ARGV[4], 'since_ns', ARGV[5], 'reason', ARGV[6])
redis.call('RPUSH', KEYS[2], ARGV[7])
for i = 1, 2 do redis.call('EXPIRE', KEYS[i], ARGV[8]) end
return 1
"""

# ARGV: node, stage, arm, epoch:ts_ns (zero-padded), retention, then field/increment pairs
_CANARY_TICK_LUA = _CANARY_COUNTING + """
local hwm = redis.call('HGET', KEYS[2], ARGV[1])
if hwm and ARGV[4] <= hwm then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
local p = ARGV[2] .. '|' .. ARGV[3] .. '|'
for i = 6, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], p .. ARGV[i], ARGV[i + 1]) end
redis.call('SADD', KEYS[4], p .. ARGV[1])
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[5]) end
return 1
"""

# ARGV: node|req, stage, arm, retention
_CANARY_EVICT_LUA = _CANARY_COUNTING + """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2] .. '|' .. ARGV[3] .. '|pending') == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[2] .. '|' .. ARGV[3] .. '|evictions', 1)
for i = 2, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

_CANARY_OUTCOME_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local stage, arm, state = string.match(v, '^([^|]*)|([^|]*)|([^|]*)$')
if state ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], stage .. '|' .. arm .. '|' .. ARGV[2])
redis.call('HINCRBY', KEYS[2], stage .. '|' .. arm .. '|' .. ARGV[2], 1)
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
            url, {"pred": _PRED_LUA, "oom": _OOM_LUA, "evict": _EVICT_LUA, "outcome": _OUTCOME_LUA,
                  "canary_begin": _CANARY_BEGIN_LUA, "canary_move": _CANARY_MOVE_LUA,
                  "canary_tick": _CANARY_TICK_LUA, "canary_evict": _CANARY_EVICT_LUA,
                  "canary_outcome": _CANARY_OUTCOME_LUA},
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

    def ping(self) -> None:
        """``LedgerUnavailable`` naming the (masked) URL when Redis does not answer."""
        self.store.read(lambda r: r.ping())

    def weeks(self) -> list[str]:
        pattern = f"{_glob_escape(self.config.key_prefix)}slo:{{*}}:*"
        found = self.store.read(lambda r: list(r.scan_iter(match=pattern, count=1000)))
        return sorted({key[key.index("{") + 1: key.index("}")] for key in found})

    # canary rollout (policy.canary) --------------------------------------------------------------

    def _canary(self, rollout: str, name: str) -> str:
        return f"{self.config.key_prefix}canary:{{{rollout}}}:{name}"

    def canary_begin(self, rollout: str, meta: Mapping[str, str]) -> CanaryState | None:
        """Register the rollout at stage 0 unless stored; the stored state (None: unreadable)."""
        pairs: list[Any] = []
        for key, value in {"stage": 0, "status": "running", "since_ns": 0, "reason": "", **meta}.items():
            pairs += [key, value]
        self._canary_call("canary_begin", (self._canary(rollout, "state"),), (self.config.retention_s, *pairs))
        report = self.canary_report(rollout)
        return None if report is None else report.state

    def canary_move(self, rollout: str, old: CanaryState, new: CanaryState) -> bool | None:
        """Compare-and-set on (stage, status); None when buffered (Redis down)."""
        outcome = self.store.call(ScriptCall(
            "canary_move", (self._canary(rollout, "state"), self._canary(rollout, "history")),
            (old.stage, old.status, new.stage, new.status, new.since_ns, new.reason, history_entry(old, new),
             self.config.retention_s), None))
        return bool(outcome.value) if outcome.status == DONE else None

    def record_canary_tick(self, rollout: str, stage: int, arm: str, node: str, epoch: int, ts_ns: int, *,
                           node_ms: int, ooms: int, commands: int, evict_commands: int) -> bool:
        keys = tuple(self._canary(rollout, k) for k in ("state", "hwm", "counts", "nodes"))
        return self._canary_call("canary_tick", keys, (
            node, stage, arm, f"{_ts(epoch)}:{_ts(ts_ns)}", self.config.retention_s, "ticks", 1,
            "node_ms", int(node_ms), "ooms", int(ooms), "commands", int(commands),
            "evict_commands", int(evict_commands)))

    def record_canary_eviction(self, rollout: str, stage: int, arm: str, node: str, req: str) -> bool:
        keys = tuple(self._canary(rollout, k) for k in ("state", "evicted", "counts"))
        return self._canary_call("canary_evict", keys, (f"{node}|{req}", stage, arm, self.config.retention_s))

    def record_canary_outcome(self, rollout: str, node: str, req: str, completed: bool) -> bool:
        keys = (self._canary(rollout, "evicted"), self._canary(rollout, "counts"))
        return self._canary_call("canary_outcome", keys, (f"{node}|{req}", COMPLETED if completed else FAILED))

    def canary_report(self, rollout: str) -> CanaryReport | None:
        """The rollout's state and records; None when it is not stored. Raises LedgerUnavailable."""

        def read(r: Any) -> tuple[Any, ...]:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(self._canary(rollout, "state")).hgetall(self._canary(rollout, "counts"))
            pipe.smembers(self._canary(rollout, "nodes")).lrange(self._canary(rollout, "history"), 0, -1)
            return tuple(pipe.execute())

        state, counts, members, history = self.store.read(read)
        if not state:
            return None
        values: dict[tuple[int, str], dict[str, int]] = {}
        for key, value in counts.items():
            stage, arm, name = key.split("|", 2)
            if name in COUNT_FIELDS:
                values.setdefault((int(stage), arm), {})[name] = int(value)
        nodes: dict[tuple[int, str], int] = {}
        distinct: dict[str, set[str]] = {}
        for member in members:
            stage, arm, node = member.split("|", 2)
            nodes[(int(stage), arm)] = nodes.get((int(stage), arm), 0) + 1
            distinct.setdefault(arm, set()).add(node)
        per_stage = {key: ArmStats(nodes=nodes.get(key, 0), **values.get(key, {}))
                     for key in set(values) | set(nodes)}
        meta = {k: v for k, v in state.items() if k not in ("stage", "status", "since_ns", "reason")}
        current = CanaryState(int(state.get("stage", 0)), state.get("status", "running"),
                              int(state.get("since_ns", 0)), state.get("reason", ""))
        return CanaryReport(rollout, current, meta, per_stage, tuple(json.loads(h) for h in history),
                            {arm: len(found) for arm, found in distinct.items()})

    def canary_rollouts(self) -> list[str]:
        pattern = f"{_glob_escape(self.config.key_prefix)}canary:{{*}}:state"
        found = self.store.read(lambda r: list(r.scan_iter(match=pattern, count=1000)))
        start = len(self.config.key_prefix) + len("canary:{")
        return sorted({key[start: key.rindex("}:state")] for key in found})

    def _canary_call(self, script: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> bool:
        outcome = self.store.call(ScriptCall(script, keys, args, None))
        return outcome.status == DONE and bool(outcome.value)

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
        if call.script.startswith("canary"):  # the ledger's counters are the weekly records'
            return
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
