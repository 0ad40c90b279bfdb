"""Differential test: kvguard's SGLang scheduler against SGLang 0.5.23's own classes, step by step.

Both sides get the same requests (token ids and ``max_new_tokens``), arriving before the same step,
and sample the same tokens (``scheduler.output_token``). The SGLang side runs in a subprocess
(``producers.sim.sglang.reference``, which says what in it is SGLang's and what is the loop that
calls it); the kvguard side is ``producers.sim.sglang.scheduler.Scheduler``.

Compared at every step: the step's kind (prefill, decode or idle); for a prefill batch each
request's id, cached prefix and extend length, in order; the decoding ids in order; the retracted
and aborted ids; the finished ids; the pool's free tokens, the tree's evictable and protected
tokens; ``new_token_ratio`` (to 1e-12); and a checksum of the allocator's free-page list in order,
so every page handed out, freed or evicted is the one SGLang picks. Arrivals: both sides must take
or refuse the same requests.

Token ids: a request's prompt is made of the workload's prefix blocks (``Request.block_hashes``,
``HASH_BLOCK_TOKENS`` tokens each: token ``i`` of a block with key ``h`` is ``mix_hash(h, i)``, so
requests sharing a prefix share those tokens) and then tokens unique to it; ids avoid SGLang's
default EOS (2). Arrivals step by a fixed step duration as in the vLLM check; when both sides are
idle the clock jumps to the next arrival.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.sglang.scheduler import SGLANG_VERSION_FOLLOWED, Scheduler, SchedulerConfig, StepOutcome
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request, mix_hash

VOCAB = 32000
TREES = ("radix", "unified")


def prompt_tokens(request: Request) -> tuple[int, ...]:
    """The token ids of a workload request's prompt (module docstring)."""
    out: list[int] = []
    for h in request.block_hashes:
        out.extend(3 + mix_hash(h, i) % (VOCAB - 3) for i in range(HASH_BLOCK_TOKENS))
        if len(out) >= request.prompt_tokens:
            break
    salt = mix_hash(request.req_id, 0x5EED)
    out.extend(3 + mix_hash(salt, p) % (VOCAB - 3) for p in range(len(out), request.prompt_tokens))
    return tuple(out[:request.prompt_tokens])


@dataclass(slots=True, frozen=True)
class ConformanceRequest:
    rid: int
    arrival_step: int
    tokens: tuple[int, ...]
    max_new_tokens: int

    def to_json(self) -> dict:
        return {"rid": self.rid, "arrival_step": self.arrival_step, "tokens": list(self.tokens),
                "max_new_tokens": self.max_new_tokens}


def conformance_requests(requests: Iterable[Request], step_duration_s: float = 0.025) -> list[ConformanceRequest]:
    out = []
    for r in sorted(requests, key=lambda r: (r.arrival_ns, r.req_id)):
        if r.prompt_tokens <= 0:
            continue
        out.append(ConformanceRequest(r.req_id, int(r.arrival_ns / NS_PER_S / step_duration_s), prompt_tokens(r),
                                      max(1, r.max_output_tokens)))
    return out


def _python() -> list[str]:
    """The interpreter that runs SGLang's side: this one (SGLang is installed in kvguard's venv)."""
    return [sys.executable]


class SglangMissing(ImportError):
    def __init__(self, detail: str):
        super().__init__(f"the SGLang conformance check needs sglang=={SGLANG_VERSION_FOLLOWED} and the packages its "
                         f"scheduler modules import ({detail.strip()[-400:]}); install them with "
                         "scripts/install-sglang-cpu.sh .venv")


def _kvguard_record(s: Scheduler, out: StepOutcome) -> dict:
    return {"kind": out.kind, "prefill": [list(x) for x in out.prefill], "decode": out.decode,
            "retracted": out.retracted, "aborted": out.aborted, "finished": out.finished,
            "available": s.pool.available_size(), "evictable": s.tree.evictable_size(),
            "protected": s.tree.protected_size(), "ratio": s.ratio.current,
            "free_crc": zlib.crc32(json.dumps(list(s.pool.free_pages)).encode())}


EXACT = ("kind", "prefill", "decode", "retracted", "aborted", "finished", "available", "evictable", "protected",
         "free_crc")


def _spec(reqs: list[ConformanceRequest], config: SchedulerConfig, max_steps: int, tree: str) -> dict:
    if tree not in TREES:
        raise ValueError(f"tree: expected one of {TREES}, got {tree!r}")
    return {"config": {"page_size": config.page_size, "max_total_num_tokens": config.max_total_num_tokens,
                       "max_running_requests": config.max_running_requests,
                       "max_prefill_tokens": config.max_prefill_tokens,
                       "chunked_prefill_size": config.chunked_prefill_size,
                       "schedule_conservativeness": config.schedule_conservativeness,
                       "context_len": config.context_len},
            "requests": [r.to_json() for r in reqs], "max_steps": max_steps, "tree": tree}


@dataclass(slots=True)
class SglangTrace:
    """What SGLang's side did for one case: its start record, one record per step, its end record."""

    start: dict
    steps: list[dict]
    end: dict
    wall_s: float


def sglang_traces(cases: list[dict], timeout_s: float = 600.0) -> list[SglangTrace]:
    """Run SGLang's side of each case spec (``_spec``) in one subprocess."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONWARNINGS="ignore", SGLANG_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([*_python(), "-m", "kvguard.producers.sim.sglang.reference"],
                          input=json.dumps({"cases": cases}), capture_output=True, text=True, timeout=timeout_s,
                          env=env)
    wall = (time.perf_counter() - t0) / max(1, len(cases))
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines or lines[0].get("type") != "start":
        if "No module named" in proc.stderr or "sglang" not in proc.stdout:
            raise SglangMissing(proc.stderr or proc.stdout)
        raise RuntimeError(f"the SGLang side failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    out = []
    for case in range(len(cases)):
        mine = [x for x in lines if x.get("case") == case]
        out.append(SglangTrace(next(x for x in mine if x["type"] == "start"), [x for x in mine if x["type"] == "step"],
                               next((x for x in mine if x["type"] == "end"), {}), wall))
    return out


def compare(trace: SglangTrace, reqs: list[ConformanceRequest], config: SchedulerConfig, tree: str) -> dict:
    """kvguard's scheduler over the same arrivals, step for step against ``trace``."""
    t1 = time.perf_counter()
    s = Scheduler(config)
    pending = list(reqs)
    tally = _Tally(trace.start)
    clock = 0
    for theirs in trace.steps:
        if pending and not s.requests:
            clock = max(clock, pending[0].arrival_step)
        arrivals = []
        while pending and pending[0].arrival_step <= clock:
            r = pending.pop(0)
            arrivals.append([r.rid, s.add_request(r.rid, r.tokens, r.max_new_tokens) is None])
        ours = _kvguard_record(s, s.step())
        ours["arrivals"] = arrivals
        tally.compare(theirs, ours)
        clock += 1
    return tally.report(config, tree, len(reqs), trace.end, unfinished=len(s.requests),
                        wall={"sglang_subprocess": round(trace.wall_s, 3),
                              "kvguard": round(time.perf_counter() - t1, 3)})


def run_conformance(requests: Iterable[Request], *, config: SchedulerConfig, max_steps: int = 20_000,
                    step_duration_s: float = 0.025, tree: str = "radix", timeout_s: float = 600.0) -> dict:
    """Drive SGLang's classes (subprocess) and kvguard's scheduler over ``requests``; compare every step."""
    reqs = conformance_requests(requests, step_duration_s)
    (trace,) = sglang_traces([_spec(reqs, config, max_steps, tree)], timeout_s)
    return compare(trace, reqs, config, tree)


class _Tally:
    def __init__(self, start: dict):
        self.start = start
        self.steps = 0
        self.mismatch_steps = 0
        self.mismatch_by_field: dict[str, int] = {}
        self.ratio_max_abs_diff = 0.0
        self.counts = {"retracted": 0, "aborted": 0, "finished": 0, "prefill_steps": 0, "decode_steps": 0,
                       "prefix_hit_tokens": 0, "prefilled_requests": 0}
        self.first_mismatch: dict | None = None
        self.usage_max = 0.0

    def compare(self, theirs: dict, ours: dict) -> None:
        self.steps += 1
        differs = [f for f in EXACT + ("arrivals",) if theirs.get(f) != ours.get(f)]
        diff = abs(theirs["ratio"] - ours["ratio"])
        self.ratio_max_abs_diff = max(self.ratio_max_abs_diff, diff)
        if diff > 1e-12:
            differs.append("ratio")
        for f in differs:
            self.mismatch_by_field[f] = self.mismatch_by_field.get(f, 0) + 1
        if differs:
            self.mismatch_steps += 1
            if self.first_mismatch is None:
                self.first_mismatch = {"step": self.steps, "differs": differs,
                                       "sglang": {f: theirs.get(f) for f in differs},
                                       "kvguard": {f: ours.get(f) for f in differs}}
        self.counts["retracted"] += len(theirs["retracted"])
        self.counts["aborted"] += len(theirs["aborted"])
        self.counts["finished"] += len(theirs["finished"])
        self.counts["prefill_steps"] += theirs["kind"] == "prefill"
        self.counts["decode_steps"] += theirs["kind"] == "decode"
        self.counts["prefix_hit_tokens"] += sum(p for _, p, _ in theirs["prefill"])
        self.counts["prefilled_requests"] += len(theirs["prefill"])

    def report(self, config: SchedulerConfig, tree: str, num_requests: int, end: dict, *, unfinished: int,
               wall: dict) -> dict:
        return {
            "sglang_version": self.start["sglang_version"], "kvguard_follows": SGLANG_VERSION_FOLLOWED,
            "sglang_tree": self.start["tree"], "stood_in": self.start["stood_in"], "tree": tree,
            "config": {f: getattr(config, f) for f in config.__slots__}, "requests": num_requests,
            "steps": self.steps, "sglang_steps": end.get("steps"),
            "drained": end.get("unfinished") == 0 and unfinished == 0,
            "mismatch_steps": self.mismatch_steps, "mismatch_by_field": self.mismatch_by_field,
            "ratio_max_abs_diff": self.ratio_max_abs_diff, **self.counts,
            "first_mismatch": self.first_mismatch, "wall_s": wall,
        }
