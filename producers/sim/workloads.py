"""Workloads: real traces and named synthetic scenarios, as requests sorted by arrival.

Formats are detected from the file's first line (plain or gzip):

- Azure LLM inference trace 2023 (Splitwise, ISCA'24): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``.
- vidur/sarathi processed traces: CSV ``arrived_at,num_prefill_tokens,num_decode_tokens`` (seconds).
- Mooncake FAST'25 JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
  (512-token prefix blocks; equal leading ids = shareable KV).
- ShareGPT length statistics CSV ``num_prefill_tokens,num_decode_tokens,...`` (no arrivals: Poisson
  arrivals at ``poisson_rate_per_s`` are drawn from the seed).

Prefix identity travels as ``Request.block_hashes``: one chained 63-bit hash per full
``HASH_BLOCK_TOKENS``-token block of the prompt (a hash names the whole prefix up to its block, as
vLLM's block-hash chain does), so any page size that divides the block can share them.

Rate scaling multiplies the arrival rate by compressing inter-arrival times; the window keeps
requests arriving in ``[0, window_s)`` after scaling. Pure: standard library + numpy, no clock.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.admission import priority_for

HASH_BLOCK_TOKENS = 64
MOONCAKE_BLOCK_TOKENS = 512
SCENARIOS = ("mixed", "sessions", "rag", "drill")
_DATA_DIR = Path(__file__).with_name("data")
TRACE_ALIASES = {
    "azure-conv": "azure_llm_2023_conv.csv.gz",
    "azure-code": "azure_llm_2023_code.csv.gz",
    "mooncake-sample": "mooncake_fast25_synthetic_head500.jsonl.gz",
    "sharegpt-sample": "sharegpt_8k_stats_head3000.csv.gz",
}


class WorkloadError(ValueError):
    """A trace could not be read: names the file, the 1-based line and what was expected there."""

    def __init__(self, path: str, line: int, expected: str):
        self.path, self.line, self.expected = str(path), line, expected
        super().__init__(f"{path}:{line}: expected {expected}")


@dataclass(slots=True)
class Request:
    req_id: int
    arrival_ns: int
    prompt_tokens: int
    max_output_tokens: int
    priority: int | None = None
    block_hashes: tuple[int, ...] = ()


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def duration_s(self) -> float:
        return self.requests[-1].arrival_ns / NS_PER_S if self.requests else 0.0

    def describe(self) -> dict:
        prompts = np.array([r.prompt_tokens for r in self.requests] or [0])
        outputs = np.array([r.max_output_tokens for r in self.requests] or [0])
        dur = self.duration_s()
        return {
            "name": self.name,
            "requests": len(self.requests),
            "duration_s": round(dur, 3),
            "rate_per_s": round(len(self.requests) / dur, 3) if dur > 0 else None,
            "prompt_tokens_p50": int(np.percentile(prompts, 50)),
            "prompt_tokens_p99": int(np.percentile(prompts, 99)),
            "output_tokens_p50": int(np.percentile(outputs, 50)),
            "priority_missing": sum(r.priority is None for r in self.requests),
            "with_prefix_hashes": sum(bool(r.block_hashes) for r in self.requests),
            "notes": list(self.notes),
        }


def mix_hash(a: int, b: int) -> int:
    """A 63-bit splitmix-style hash of two ints: deterministic across processes (unlike ``hash`` of str)."""
    x = (a * 0x9E3779B97F4A7C15 + b * 0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 31
    return x & 0x7FFF_FFFF_FFFF_FFFF


def chain_hashes(content_ids: list[int], prompt_tokens: int, content_block_tokens: int) -> tuple[int, ...]:
    """Chained hashes per full ``HASH_BLOCK_TOKENS`` block for a prompt whose content is named by
    ``content_ids`` per ``content_block_tokens`` tokens (a multiple of HASH_BLOCK_TOKENS)."""
    sub = content_block_tokens // HASH_BLOCK_TOKENS
    n_full = prompt_tokens // HASH_BLOCK_TOKENS
    out = []
    h = 0
    for i in range(min(n_full, len(content_ids) * sub)):
        h = mix_hash(h, mix_hash(content_ids[i // sub], i % sub))
        out.append(h)
    return tuple(out)


# ---------------------------------------------------------------- file loaders


def _open_lines(path: Path):
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise WorkloadError(str(path), 0, f"a readable trace file ({e.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise WorkloadError(str(path), 0, f"a valid gzip stream ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(str(path), raw[: e.start].count(b"\n") + 1, "UTF-8 text") from None
    return text.splitlines()


def _azure_ns(path: str, line_no: int, ts: str, day_cache: dict) -> int:
    # "2023-11-16 18:15:46.6805900": parsed by hand into integer ns (strptime cannot take 7
    # fractional digits, and float seconds since year 1 would lose the 0.1 us resolution)
    try:
        day, clock = ts.split(" ")
        if day not in day_cache:
            day_cache[day] = date.fromisoformat(day).toordinal() * 86400 * NS_PER_S
        hh, mm, ss = clock.split(":")
        whole, _, frac = ss.partition(".")
        frac_ns = int((frac + "000000000")[:9]) if frac else 0
        if not (whole.isdigit() and (not frac or frac.isdigit())):
            raise ValueError(ss)
        return day_cache[day] + (int(hh) * 3600 + int(mm) * 60 + int(whole)) * NS_PER_S + frac_ns
    except ValueError:
        raise WorkloadError(path, line_no, f"TIMESTAMP like 'YYYY-MM-DD HH:MM:SS.fffffff', got {ts!r}") from None


def _int_field(path: str, line_no: int, name: str, value, minimum: int = 0) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise WorkloadError(path, line_no, f"integer {name}, got {value!r}") from None
    if v < minimum:
        raise WorkloadError(path, line_no, f"{name} >= {minimum}, got {v}")
    return v


def _load_csv(path: str, lines: list[str], header: list[str], rng, poisson_rate_per_s: float) -> list[tuple]:
    cols = {name.strip(): i for i, name in enumerate(header)}
    rows: list[tuple] = []  # (arrival_ns, prompt, output, hashes)
    day_cache: dict = {}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= cols.keys():
        kind = "azure"
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    elif {"arrived_at", "num_prefill_tokens", "num_decode_tokens"} <= cols.keys():
        kind = "vidur"
        need = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
    elif {"num_prefill_tokens", "num_decode_tokens"} <= cols.keys():
        kind = "lengths"
        need = ("num_prefill_tokens", "num_decode_tokens")
    else:
        raise WorkloadError(path, 1, "a CSV header with TIMESTAMP,ContextTokens,GeneratedTokens (Azure) or "
                                     f"num_prefill_tokens,num_decode_tokens (ShareGPT/vidur), got {header!r}")
    idx = [cols[n] for n in need]
    width = max(idx) + 1
    for line_no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = line.split(",")
        if len(parts) < width:
            raise WorkloadError(path, line_no, f"{len(header)} comma-separated fields ({','.join(need)})")
        if kind == "azure":
            t = _azure_ns(path, line_no, parts[idx[0]].strip(), day_cache)
            p, o = parts[idx[1]], parts[idx[2]]
        elif kind == "vidur":
            try:
                t = int(round(float(parts[idx[0]]) * NS_PER_S))
            except ValueError:
                raise WorkloadError(path, line_no, f"float arrived_at seconds, got {parts[idx[0]]!r}") from None
            p, o = parts[idx[1]], parts[idx[2]]
        else:
            t = None
            p, o = parts[idx[0]], parts[idx[1]]
        rows.append((t, _int_field(path, line_no, need[-2], p.strip(), 1),
                     _int_field(path, line_no, need[-1], o.strip(), 1), ()))
    if kind == "lengths":
        gaps = rng.exponential(1.0 / poisson_rate_per_s, size=len(rows))
        arrivals = np.cumsum(gaps) - gaps[0]
        rows = [(int(round(a * NS_PER_S)), p, o, h) for a, (_, p, o, h) in zip(arrivals, rows)]
    return rows


def _load_jsonl(path: str, lines: list[str]) -> list[tuple]:
    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(path, line_no, f"a JSON object ({e.msg})") from None
        if not isinstance(rec, dict) or not {"timestamp", "input_length", "output_length"} <= rec.keys():
            raise WorkloadError(path, line_no, "a JSON object with timestamp, input_length, output_length (Mooncake)")
        try:
            t = int(round(float(rec["timestamp"]) * 1_000_000))
        except (TypeError, ValueError, OverflowError):
            raise WorkloadError(path, line_no, f"numeric timestamp in ms, got {rec['timestamp']!r}") from None
        p = _int_field(path, line_no, "input_length", rec["input_length"], 1)
        o = _int_field(path, line_no, "output_length", rec["output_length"], 1)
        ids = rec.get("hash_ids") or []
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            raise WorkloadError(path, line_no, "hash_ids as a list of integers")
        rows.append((t, p, o, chain_hashes(ids, p, MOONCAKE_BLOCK_TOKENS)))
    return rows


def load_trace(path: str | Path, *, seed: int = 0, poisson_rate_per_s: float = 2.0) -> Workload:
    """Read one trace file (format detected from its first line); arrivals start at 0."""
    path = Path(path)
    lines = _open_lines(path)
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise WorkloadError(str(path), 1, "a CSV header or a JSON line, got an empty file")
    head = lines[first].lstrip()
    rng = np.random.default_rng(seed)
    if head.startswith("{"):
        rows = _load_jsonl(str(path), lines)
        fmt = "mooncake-jsonl"
    elif "," in head:
        rows = _load_csv(str(path), lines[first:], head.split(","), rng, poisson_rate_per_s)
        fmt = "csv"
    else:
        raise WorkloadError(str(path), first + 1, "a CSV header (Azure/ShareGPT/vidur) or a JSON line (Mooncake)")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0
    requests = [Request(i, t - t0, p, o, None, h) for i, (t, p, o, h) in enumerate(rows)]
    notes = [f"trace {path.name} ({fmt}), {len(requests)} requests"]
    if fmt == "csv" and "arrived_at" not in head and "TIMESTAMP" not in head:
        notes.append(f"no arrival times in the file: Poisson arrivals at {poisson_rate_per_s}/s (seed {seed})")
    return Workload(path.name, requests, notes)


# ---------------------------------------------------------------- scenarios


def _lognormal_int(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(np.int64)


def _poisson_times(rng, rate_per_s: float, duration_s: float) -> np.ndarray:
    n = max(1, int(rate_per_s * duration_s * 1.2) + 10)
    t = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    return t[t < duration_s]


def _unique_ids(rng, n: int) -> list[int]:
    return [int(x) for x in rng.integers(1 << 40, 1 << 62, n)]


def _scenario_mixed(rng, duration_s: float, rate_per_s: float) -> list[tuple]:
    """80 % short chat (median 600 prompt / 180 output), 20 % long documents (median 6K / 300)."""
    times = _poisson_times(rng, rate_per_s, duration_s)
    n = len(times)
    long_ = rng.random(n) < 0.2
    prompt = np.where(long_, _lognormal_int(rng, 6000, 0.5, 1024, 16000, n), _lognormal_int(rng, 600, 0.8, 16, 4000, n))
    out = np.where(long_, _lognormal_int(rng, 300, 0.6, 8, 1500, n), _lognormal_int(rng, 180, 0.8, 4, 1200, n))
    prio = rng.integers(0, 11, n)
    missing = rng.random(n) < 0.5
    return [(float(t), int(p), int(o), None if m else int(q), ())
            for t, p, o, q, m in zip(times, prompt, out, prio, missing)]


def _scenario_sessions(rng, duration_s: float, rate_per_s: float) -> list[tuple]:
    """Multi-turn chats: each turn's prompt is the whole history (previous prompt + answer) plus a new
    message, so consecutive turns share their prefix blocks; think time between turns ~ Exp(20 s)."""
    rows = []
    session_rate = rate_per_s / 4.0  # ~4 turns per session on average
    for start in _poisson_times(rng, session_rate, duration_s):
        turns = int(rng.integers(2, 8))
        content = _unique_ids(rng, 1)  # one id per HASH_BLOCK of history, extended per turn
        history = int(_lognormal_int(rng, 300, 0.6, 32, 3000, 1)[0])
        t = float(start)
        prio = int(rng.integers(4, 9))
        for _ in range(turns):
            out = int(_lognormal_int(rng, 200, 0.7, 8, 1200, 1)[0])
            need = -(-history // HASH_BLOCK_TOKENS)
            if need > len(content):
                content += _unique_ids(rng, need - len(content))
            rows.append((t, history, out, prio, chain_hashes(content, history, HASH_BLOCK_TOKENS)))
            history += out + int(_lognormal_int(rng, 120, 0.7, 4, 2000, 1)[0])
            t += float(rng.exponential(20.0)) + 2.0
            if t >= duration_s:
                break
    return rows


def _scenario_rag(rng, duration_s: float, rate_per_s: float) -> list[tuple]:
    """RAG: one of 8 shared system prompts + retrieved passages (1-3K tokens, shared across a topic)
    + a short question: long shared prefixes, short unique tails."""
    systems = [(_unique_ids(rng, 64), int(x)) for x in rng.integers(512, 2048, 8)]
    rows = []
    for t in _poisson_times(rng, rate_per_s, duration_s):
        ids, sys_tokens = systems[int(rng.integers(0, 8))]
        question = int(_lognormal_int(rng, 1500, 0.5, 64, 6000, 1)[0])
        prompt = sys_tokens + question
        shared_blocks = sys_tokens // HASH_BLOCK_TOKENS
        content = ids[:shared_blocks] + _unique_ids(rng, -(-prompt // HASH_BLOCK_TOKENS) - shared_blocks + 1)
        out = int(_lognormal_int(rng, 250, 0.6, 8, 1200, 1)[0])
        rows.append((float(t), prompt, out, int(rng.integers(3, 8)), chain_hashes(content, prompt, HASH_BLOCK_TOKENS)))
    return rows


DRILL_PROMPTS = 100
DRILL_PROMPT_TOKENS = 32768
DRILL_WINDOW_S = 600.0


def _scenario_drill(rng, duration_s: float, rate_per_s: float, max_prompt_tokens: int | None) -> tuple[list, list]:
    """Background ``mixed`` load plus the drill: 100 x 32K-token prompts arriving uniformly within
    10 minutes, starting after 2 minutes of warm-up (or at 0 for shorter windows)."""
    rows = _scenario_mixed(rng, duration_s, rate_per_s)
    prompt = DRILL_PROMPT_TOKENS
    notes = []
    if max_prompt_tokens is not None and max_prompt_tokens < prompt:
        prompt = max_prompt_tokens
        notes.append(f"drill prompts capped from {DRILL_PROMPT_TOKENS} to {prompt} tokens to fit the profile")
    start = 120.0 if duration_s > DRILL_WINDOW_S + 120.0 else 0.0
    window = min(DRILL_WINDOW_S, max(duration_s - start, 1.0))
    for t in np.sort(rng.uniform(start, start + window, DRILL_PROMPTS)):
        rows.append((float(t), prompt, int(rng.integers(64, 512)), 2, ()))
    notes.append(f"drill: {DRILL_PROMPTS} x {prompt}-token prompts in [{start:.0f}, {start + window:.0f}) s")
    return rows, notes


def make_scenario(name: str, *, duration_s: float = 3600.0, rate_per_s: float | None = None, seed: int = 0,
                  max_prompt_tokens: int | None = None) -> Workload:
    rng = np.random.default_rng([seed, SCENARIOS.index(name) if name in SCENARIOS else 99])
    notes: list[str] = []
    defaults = {"mixed": 2.0, "sessions": 2.0, "rag": 2.0, "drill": 1.0}
    if name not in defaults:
        raise WorkloadError(name, 0, f"a trace file or a scenario in {list(SCENARIOS)}")
    rate = rate_per_s if rate_per_s is not None else defaults[name]
    if name == "mixed":
        rows = _scenario_mixed(rng, duration_s, rate)
    elif name == "sessions":
        rows = _scenario_sessions(rng, duration_s, rate)
    elif name == "rag":
        rows = _scenario_rag(rng, duration_s, rate)
    else:
        rows, notes = _scenario_drill(rng, duration_s, rate, max_prompt_tokens)
    rows.sort(key=lambda r: r[0])
    requests = [Request(i, int(round(t * NS_PER_S)), p, o, q, h) for i, (t, p, o, q, h) in enumerate(rows)]
    notes.insert(0, f"scenario {name}: {rate} req/s base rate, seed {seed}")
    return Workload(name, requests, notes)


# ---------------------------------------------------------------- entry point


def resolve_trace_path(spec: str) -> Path | None:
    if spec in TRACE_ALIASES:
        return _DATA_DIR / TRACE_ALIASES[spec]
    p = Path(spec)
    return p if p.exists() or spec not in SCENARIOS else None


def load_workload(path_or_scenario: str | Path, *, rate_scale: float = 1.0, window: float | None = None,
                  seed: int = 0, poisson_rate_per_s: float = 2.0, max_prompt_tokens: int | None = None,
                  max_output_tokens: int | None = None) -> Workload:
    """A trace file, a bundled trace alias (``azure-conv`` …) or a scenario (``mixed``, ``sessions``,
    ``rag``, ``drill``), rate-scaled by ``rate_scale`` (x k arrivals = inter-arrival times / k) and cut
    to arrivals in ``[0, window)`` seconds after scaling. Prompts above ``max_prompt_tokens`` are capped
    (and counted in ``notes``), so a profile's context limit is respected."""
    if not rate_scale > 0:
        raise WorkloadError(str(path_or_scenario), 0, f"rate_scale > 0, got {rate_scale}")
    spec = str(path_or_scenario)
    if spec in SCENARIOS:
        horizon = (window if window is not None else 3600.0) * rate_scale
        wl = make_scenario(spec, duration_s=horizon, seed=seed, max_prompt_tokens=max_prompt_tokens)
    else:
        path = resolve_trace_path(spec)
        if path is None or not path.exists():
            raise WorkloadError(spec, 0, f"a scenario ({', '.join(SCENARIOS)}), a bundled trace "
                                         f"({', '.join(TRACE_ALIASES)}) or a readable trace file; no file {spec!r}")
        wl = load_trace(path, seed=seed, poisson_rate_per_s=poisson_rate_per_s)
    return _reshape(wl, rate_scale, window, max_prompt_tokens, max_output_tokens)


def _reshape(wl: Workload, rate_scale: float, window: float | None, max_prompt: int | None,
             max_output: int | None) -> Workload:
    out, capped = [], 0
    limit_ns = None if window is None else int(window * NS_PER_S)
    for r in wl.requests:
        t = int(r.arrival_ns / rate_scale)
        if limit_ns is not None and t >= limit_ns:
            break
        p, o, h = r.prompt_tokens, r.max_output_tokens, r.block_hashes
        if max_prompt is not None and p > max_prompt:
            p, capped = max_prompt, capped + 1
            h = h[: p // HASH_BLOCK_TOKENS]
        if max_output is not None and o > max_output:
            o = max_output
        out.append(Request(len(out), t, p, o, r.priority, h))
    notes = list(wl.notes)
    if rate_scale != 1.0:
        notes.append(f"rate scaled x{rate_scale:g} (inter-arrival times / {rate_scale:g})")
    if window is not None:
        notes.append(f"window [0, {window:g}) s")
    if capped:
        notes.append(f"{capped} prompts capped to {max_prompt} tokens")
    return Workload(wl.name, out, notes)


def with_long_context(wl: Workload, frac: float, prompt_tokens: int, seed: int = 0) -> Workload:
    """A share ``frac`` of the requests (chosen by a hash of the id and ``seed``) gets a prompt of
    ``prompt_tokens`` tokens with no shared prefix: the long-context shape of class C3 mixed into any
    workload."""
    if not 0.0 <= frac <= 1.0:
        raise WorkloadError(wl.name, 0, f"a long-context share in [0, 1], got {frac}")
    if frac and prompt_tokens < 1:
        raise WorkloadError(wl.name, 0, f"a long-context length >= 1 token, got {prompt_tokens}")
    out, chosen = [], 0
    for r in wl.requests:
        if frac and mix_hash(r.req_id, seed ^ 0x10C7) % 1_000_000 < frac * 1_000_000:
            r = Request(r.req_id, r.arrival_ns, prompt_tokens, r.max_output_tokens, r.priority, ())
            chosen += 1
        out.append(r)
    notes = list(wl.notes) + ([f"{chosen} prompts made {prompt_tokens} tokens long (long-context share {frac:g})"]
                              if frac else [])
    return Workload(wl.name, out, notes)


def with_priority_mix(wl: Workload, mix, seed: int = 0) -> Workload:
    """``wl`` with each request's priority drawn from ``mix`` (``producers.admission.parse_priority_mix``:
    ((priority, share), ...)), deterministically per (request id, seed); a request whose trace gave it a
    priority keeps it (the trace's own field wins)."""
    out = [r if r.priority is not None else Request(r.req_id, r.arrival_ns, r.prompt_tokens, r.max_output_tokens,
                                                    priority_for(mix_hash(r.req_id, seed), mix), r.block_hashes)
           for r in wl.requests]
    kept = sum(r.priority is not None for r in wl.requests)
    mix_text = ",".join(f"{p}:{s:g}" for p, s in mix)
    note = f"priority mix {mix_text}" + (f" ({kept} requests kept the trace's own priority)" if kept else "")
    return Workload(wl.name, out, [*wl.notes, note])
