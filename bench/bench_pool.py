"""Benchmark: PagedPool operations per second on the default profile's geometry.

A continuous-batching-like mix: a working set of requests grows by prefill chunks and one decode
token per step, each step allocates and frees a workspace buffer, finished requests release
(half of them with a shared prefix chain, so SHARE/cache/revive paths run), and on exhaustion the
cache is reclaimed and the oldest request is evicted. Prints one JSON object.

    .venv/bin/python bench/bench_pool.py [--ops 200000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvguard.contracts.events import EventKind  # noqa: E402
from kvguard.producers.sim.profiles import load_profile  # noqa: E402
from kvguard.producers.sim.seed.pool import PagedPool, PoolExhausted  # noqa: E402


def run(n_ops: int, seed: int, profile_name: str | None) -> dict:
    profile = load_profile(profile_name)
    geometry = profile.geometry
    pool = PagedPool(geometry, node="bench/gpu0", swap_capacity_units=profile.swap_capacity_units)
    rng = random.Random(seed)
    block = pool.block_tokens
    chains = [tuple(range(k * 100, k * 100 + 8)) for k in range(8)]
    running: dict[int, list] = {}  # req -> [prompt_left, decode_left, chain]
    next_req = 0
    ops = grows = releases = workspace = failures = events = page_allocs = 0
    now = 0
    t0 = time.perf_counter()
    while ops < n_ops:
        now += 20_000_000
        while len(running) < 96 and pool.free_units > geometry.dynamic_units // 5:  # admission watermark
            chain = chains[rng.randrange(len(chains))] if rng.random() < 0.5 else ()
            prompt = rng.choice((block * 2 + 7, 300, 1200, 3000, 50))
            running[next_req] = [prompt, rng.randint(16, 400), chain]
            next_req += 1
        ws = pool.alloc_workspace(profile.workspace_units(2048), now, tokens=2048)
        workspace += 1
        budget = 2048
        for req in list(running):
            prompt_left, decode_left, chain = running[req]
            n = min(prompt_left, budget) if prompt_left else 1
            if prompt_left and n == 0:
                continue
            try:
                pool.grow(req, n, now, block_hashes=chain)
            except PoolExhausted:
                failures += 1
                if not pool.reclaim_cached(64, now):
                    victim = next(iter(running))
                    pool.release(victim, now, cache_prefix=False)
                    del running[victim]
                continue
            finally:
                ops += 1
            grows += 1
            if prompt_left:
                running[req][0] -= n
                budget -= n
            else:
                running[req][1] -= 1
                if running[req][1] <= 0:
                    pool.release(req, now)
                    del running[req]
                    releases += 1
                    ops += 1
        pool.free_workspace(ws, now)
        ops += 2
        rows = pool.take_events()
        events += len(rows)
        page_allocs += int((rows["kind"] == EventKind.ALLOC).sum())
    wall = time.perf_counter() - t0
    m = pool.metrics()
    return {"bench": "pool", "profile": profile.name, "dynamic_units": geometry.dynamic_units,
            "page_classes": list(geometry.page_classes), "ops": ops, "wall_s": round(wall, 3),
            "ops_per_s": round(ops / wall), "grows": grows, "releases": releases, "workspace_pairs": workspace,
            "page_allocs": page_allocs, "alloc_failures": failures, "events": events, "events_per_s": round(events / wall),
            "final_u_kv": round(m.u_kv, 4), "final_f_ext": round(m.f_ext, 4), "final_free_runs": m.n_free_runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    print(json.dumps(run(args.ops, args.seed, args.profile)))


if __name__ == "__main__":
    main()
