"""Budget ledger throughput: debits per second into the in-memory ledger and into Redis (one
Lua script call per burning tick), plus the remaining() read. Prints one JSON object.

Redis: $REDIS_URL when set, else a private redis-server on a free port (never the shared one).
Usage: .venv/bin/python bench/bench_budget.py [--ticks 20000] [--nodes 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.contracts.units import NS_PER_S  # noqa: E402
from kvguard.policy.budget import BudgetConfig, MemoryBudgetLedger, week_start_ns  # noqa: E402


def run(ledger, ticks: int, nodes: int) -> dict[str, float]:
    start_ns = week_start_ns("2026-W48")
    t0 = time.perf_counter()
    for i in range(ticks):
        ledger.debit(f"gpu{i % nodes}", start_ns + (i // nodes + 1) * 10 * NS_PER_S, 10.0, 0.9)
    debit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(ticks):  # the same ticks again: all duplicates
        ledger.debit(f"gpu{i % nodes}", start_ns + (i // nodes + 1) * 10 * NS_PER_S, 10.0, 0.9)
    replay_s = time.perf_counter() - t0
    reads = min(ticks, 5000)
    t0 = time.perf_counter()
    for i in range(reads):
        ledger.remaining(f"gpu{i % nodes}", "2026-W48")
    read_s = time.perf_counter() - t0
    stats = ledger.stats()
    if (stats.counted, stats.duplicates, stats.errors, stats.buffered) != (ticks, ticks, 0, 0):
        raise RuntimeError(f"bench_budget: expected {ticks} counted, {ticks} duplicates, no errors "
                           f"and nothing buffered; got {stats}")
    return {"debits_per_s": round(ticks / debit_s), "duplicate_debits_per_s": round(ticks / replay_s),
            "remaining_reads_per_s": round(reads / read_s),
            "debit_mean_us": round(debit_s / ticks * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ticks", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=100)
    args = parser.parse_args()
    config = BudgetConfig(budget_s=1e9, key_prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    result: dict[str, object] = {"bench": "budget", "ticks": args.ticks, "nodes": args.nodes,
                                 "memory": run(MemoryBudgetLedger(config), args.ticks, args.nodes)}
    server = None
    url = os.environ.get("REDIS_URL")
    if not url:
        from kvguard.testing.rigs.redis_server import RedisServer

        server = RedisServer().start()
        url = server.url
    try:
        from kvguard.policy.budget_redis import RedisBudgetLedger

        ledger = RedisBudgetLedger(url, config)
        result["redis"] = run(ledger, args.ticks, args.nodes)
        ledger.close()
    finally:
        if server is not None:
            server.cleanup()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
