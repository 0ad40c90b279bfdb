"""Fused decode for ``VllmEngine``: k decode-only steps applied at once, exactly as k scheduler steps.

A stretch of steps is decode-only when every running request has exactly one token to compute, no
request is admitted and none is preempted. The engine enters fusion only after a "quiet" step (one
that scheduled every running request with one token, admitted nothing, preempted nothing, and left
nothing newly admissible: no request finished while others wait). From there, until the next arrival,
the caller's horizon, the first finish while requests wait, or the point where the blocks the
stretch needs would exceed the free ones, vLLM's scheduler would do this, step by step in running
order (``KVCacheManager._extend``): a request at ``c`` computed tokens pops one block from the head of
the free queue when ``c % block_size == 0`` (a cached block popped loses its hash: lazy eviction), and
caches its newly full block when ``(c + 1) % block_size == 0``; after the step each sampling request
appends a token, and those at ``max_tokens`` or ``max_model_len`` are freed in running order.

Why the waiting queue cannot move during the stretch: the waiting head was refused (or not tried for
lack of budget or seats) in the quiet step, after that step's running allocations; decode-only steps
only take blocks from the free queue and only evict hashes (never add a hit a waiting prompt could
use, up to 63-bit hash collisions), so the head's need never falls and the free count never rises
until a request finishes, and the stretch ends at the first finish when anything waits.

So the stretch is computed per request, not per (step, request): the pops and caches happen at steps
given by ``c`` modulo the block size, the finishes at ``min(max_tokens - output, max_model_len -
num_tokens)``; they are applied in (step, running order) order through vLLM's own block pool and
cache manager, so the free-queue order, the prefix-cache map and the block tables end as k calls of
``schedule()`` + ``update_from_output()`` would leave them (tests/unit/producers/sim/vllm/test_vllm_engine.py replays
the same workload with fusion off and compares every row and the final state). The step's allocator
replays run first, step by step (each with its own time stamp); a CUDA OOM at step j applies the j
complete steps and the scheduling of step j, then crashes there, as the step-by-step engine would.

Rows: one STEP row for the stretch (``size``/``tokens``: the stretch's tokens, ``aux``: its duration,
as the seed engine's fused blocks), ALLOC / RECLAIM rows at the start time of the step that popped the
block, allocator rows of a step after that step's block rows, FREE and FINISH rows at the end of the
finishing step, and one FILL for the stretch's tokens.
"""

from __future__ import annotations

from kvguard.contracts.events import EventKind
from kvguard.producers.sim.vllm.memory import StepOOM
from kvguard.producers.sim.vllm.oom_step import write_crashing_decode
from kvguard.producers.sim.vllm.scheduler import SeqStatus

_ALLOC, _FILL, _STEP = int(EventKind.ALLOC), int(EventKind.FILL), int(EventKind.STEP)
_POP, _CACHE, _TWIN, _FINISH = 0, 1, 2, 3


def _timeline(engine, running, computed, remaining, until_ns):
    """Start times and batch sizes of the steps the stretch may take (see the module docstring)."""
    sched = engine.scheduler
    bs = sched.kv.block_size
    nxt = engine._next_arrival_ns()
    horizon = until_ns if nxt is None else min(until_ns, nxt)
    waiting = len(sched.waiting) > 0 or engine.finish_listeners_waiting()
    bucket = [0] * bs
    for c in computed:
        bucket[c % bs] += 1
    finish_at: dict[int, list[int]] = {}
    for i, r in enumerate(remaining):
        finish_at.setdefault(r - 1, []).append(i)
    free = sched.kv.pool.free_queue.num_free_blocks
    starts, sizes = [], []
    used, alive, t, j = 0, len(running), engine.now_ns, 0
    while j < engine.config.max_fused_steps:
        if j and t >= horizon:
            break
        need = bucket[-j % bs]
        if used + need > free:
            break
        used += need
        starts.append(t)
        sizes.append(alive)
        t += engine.step_ns(0, alive)
        done = finish_at.get(j)
        j += 1
        if done:
            for i in done:
                bucket[computed[i] % bs] -= 1
            alive -= len(done)
            if waiting or not alive:
                break
    return starts, sizes, t


def _longest(computed: list[int], remaining: list[int], j: int) -> int:
    """The longest sequence in step ``j`` of the stretch: requests still running then, each one token
    longer per step."""
    return max((c + j + 1 for c, r in zip(computed, remaining) if r > j), default=1)


def _note_stretch_tokens(engine, running, remaining, ends, k_full) -> None:
    """Inter-token gaps of the stretch (``VllmEngine._note_tokens``): each request's first gap from its
    last token before the stretch, then one per step for every request still running in it."""
    if not k_full:
        return
    values, counts, reqs = engine._itl_values, engine._itl_counts, engine._reqs
    alive = [0] * k_full
    for seq, r in zip(running, remaining):
        steps = min(r, k_full)
        info = reqs.get(seq.request_id)
        if info is not None and info.last_token_ns >= 0:
            values.append(ends[0] - info.last_token_ns)
            counts.append(1)
        if info is not None:
            info.last_token_ns = ends[steps - 1]
        if steps > 1:
            alive[steps - 1] += 1
    still = 0
    for j in range(k_full - 1, 0, -1):  # requests with at least j + 1 tokens in the stretch
        still += alive[j]
        if still:
            values.append(ends[j] - ends[j - 1])
            counts.append(still)


def _report(engine, unreported: list) -> None:
    """FINISH rows after the frees of one step, as ``update_from_output`` frees before the engine reports."""
    for rid, end in unreported:
        engine._complete(rid, end)
    unreported.clear()


def fused_decode(engine, until_ns: int) -> bool:
    """Run a decode-only stretch of at least two steps; False (nothing done) when none is possible."""
    sched = engine.scheduler
    kv, rec = sched.kv, engine.recorder
    running = list(sched.running)
    if not running:
        return False
    bs, max_len = kv.block_size, sched.config.max_model_len
    computed = [s.num_computed_tokens for s in running]
    remaining = [min(s.max_tokens - len(s.output_token_ids), max_len - s.num_tokens) for s in running]
    starts, sizes, end = _timeline(engine, running, computed, remaining, until_ns)
    if len(starts) < 2:
        return False
    # the allocator first, step by step, each step's rows kept apart to be placed in order
    saved, twin_rows, oom = rec._rows, {}, None
    memory = engine.memory
    eager_from = memory.largest_graph
    for j, (t, n) in enumerate(zip(starts, sizes)):
        rec._rows = bytearray()
        try:
            if memory.v2 and n > eager_from:  # an eager decode: the attention's splits follow the context
                memory.run_step(n, n, t, max_query_len=1, max_seq_len=_longest(computed, remaining, j))
            else:
                memory.run_step(n, n, t)
        except StepOOM as e:
            oom = e
        if rec._rows:
            twin_rows[j] = bytes(rec._rows)
        if oom is not None:
            break
    rec._rows = saved
    k_full = j if oom is not None else len(starts)
    ends = starts[1:k_full + 1] + ([end] if k_full == len(starts) else [])
    n_req = len(running)
    _note_stretch_tokens(engine, running, remaining, ends, k_full)

    events = []
    caching = kv.enable_caching
    appended = 0
    for i, seq in enumerate(running):
        c, rid = computed[i], seq.request_id
        m = min(k_full, remaining[i])
        scheduled = m + (1 if oom is not None and remaining[i] > k_full else 0)
        events.extend((j, i, _POP) for j in range(-c % bs, scheduled, bs))
        if caching and scheduled:
            if (c + 1) // bs > kv.num_cached_block.get(rid, 0):
                events.append((0, i, _CACHE))
            first = (-c - 1) % bs or bs
            events.extend((j, i, _CACHE) for j in range(first, scheduled, bs))
        if remaining[i] <= k_full:
            events.append((remaining[i] - 1, n_req + 1 + i, _FINISH))
        if m:
            seq.output_token_ids.extend([rid] * m)
            seq.num_tokens += m
            seq.update_block_hashes()
            seq.num_computed_tokens = c + m
            appended += m
    events.extend((j, n_req, _TWIN) for j in twin_rows)
    events.sort()

    if k_full:
        rec.row(_STEP, starts[0], size=appended, tokens=appended, aux=ends[k_full - 1] - starts[0])
    get_new_blocks, tables, finished = kv.pool.get_new_blocks, kv.req_to_blocks, {}
    unreported: list[tuple[int, int]] = []  # (request, end) freed, FINISH row not yet written
    for j, key, kind in events:
        if unreported and (kind != _FINISH or unreported[-1][1] != ends[j]):
            _report(engine, unreported)
        if kind == _POP:
            seq = running[key]
            rec.now_ns = starts[j]
            block = get_new_blocks(1)[0]
            tables[seq.request_id].append(block)
            rec.row(_ALLOC, starts[j], seq.request_id, offset=block.block_id - 1, size=1)
        elif kind == _CACHE:
            kv._cache_blocks(running[key], computed[key] + j + 1)
        elif kind == _TWIN:
            rec._rows += twin_rows[j]
        else:
            seq = running[key - n_req - 1]
            rid = seq.request_id
            rec.now_ns = ends[j]
            seq.status = SeqStatus.FINISHED_LENGTH
            kv.free(rid)
            del sched.requests[rid]
            unreported.append((rid, ends[j]))
            finished.setdefault(j, []).append(rid)
    if unreported:
        _report(engine, unreported)
    if appended:
        rec.row(_FILL, starts[k_full] if oom is not None else ends[-1], tokens=appended)
    sched.step += k_full + (1 if oom is not None else 0)
    if finished:
        sched.running = [s for s in sched.running if s.status is SeqStatus.RUNNING]
        sched.num_finished += sum(len(v) for v in finished.values())
        engine._quiet = not len(sched.waiting)
    sched._finished_since_schedule = list(finished.get(k_full - 1, ()))
    engine.steps += k_full
    engine._count_capped_steps(k_full)
    if oom is not None:
        m = engine.memory
        write_crashing_decode(rec, starts[k_full], [s for i, s in enumerate(running) if remaining[i] > k_full],
                              engine._prompt_logprobs, oom.error, startup_headroom=engine.startup_headroom_bytes,
                              neighbour_bytes=m.neighbour_bytes, neighbour_start_bytes=m.neighbour_start_bytes,
                              leaked_bytes=m.leaked_bytes)
        engine._crash(starts[k_full], oom)
        return True
    engine.now_ns = engine.last_step_ns = ends[-1]
    return True
