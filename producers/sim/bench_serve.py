"""``vllm bench serve`` against the shadow engine: its random dataset, its client, its metrics.

Followed: vLLM 0.33.0 ``vllm/benchmarks/serve.py`` and ``vllm/benchmarks/datasets/{datasets,utils}.py``
(installed package), so a benchmark someone ran with ``vllm bench serve`` reruns here by changing the
program name:

- **Dataset** ``--dataset-name random`` (``RandomDataset.sample``, ``get_sampling_params``): with
  ``real = max(0, input_len - num_special_tokens)`` (the tokenizer's BOS the server adds back),
  input lengths are integers uniform on ``[floor(real (1 - r)), ceil(real (1 + r))]`` and output
  lengths on ``[max(floor(out (1 - r)), 1), max(ceil(out (1 + r)), 1)]``, drawn with
  ``np.random.default_rng(seed)`` in that order (inputs, outputs, then vocabulary offsets). A
  ``--random-prefix-len`` prefix, one for all requests, is added to every prompt. With
  ``--ignore-eos`` every request generates exactly its output length (the engine never stops early
  either way: no EOS is modelled, so without it the same happens; the flag is accepted for fidelity).
- **Arrivals** (``get_request``): ``--request-rate inf`` sends everything at once; otherwise gamma
  inter-arrivals ``shape = burstiness, scale = 1 / (rate * burstiness)`` from ``np.random`` seeded with
  ``--seed`` (``main``: ``np.random.seed(seed)``), cumulated and rescaled so the last send is at exactly
  ``N / rate``.
- **Client** (``benchmark``): ``--max-concurrency N`` is an ``asyncio.Semaphore(N)``: a request is sent
  at its arrival time or when a slot frees, whichever is later; a failed request (an engine crash, a
  503) frees its slot at once.
- **Metrics** (``calculate_metrics``): duration from the first send to the last response; completed
  and failed; request / output / total-token throughput; TTFT (first token - send), TPOT
  (``(latency - ttft) / (output - 1)`` for outputs over one token), ITL (gaps between streamed chunks:
  one chunk per engine step that gives the request tokens), E2EL; mean, median and p99 in ms
  (``np.percentile``), plus the peak number of requests in flight.

The initial test request ``vllm bench serve`` sends before the benchmark (not counted) is not sent.
Prompt token ids are not modelled; a shared prefix is shared in whole 64-token hash blocks.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.workloads import HASH_BLOCK_TOKENS, Request, Workload, chain_hashes, mix_hash

DEFAULT_NUM_PROMPTS = 1000  # vllm/benchmarks/datasets/datasets.py
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 1024, 128


class BenchArgsError(ValueError):
    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


@dataclass(frozen=True, slots=True)
class RandomDataset:
    """``--dataset-name random`` (module docstring)."""

    num_prompts: int = DEFAULT_NUM_PROMPTS
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int = DEFAULT_OUTPUT_LEN
    range_ratio: float = 0.0
    prefix_len: int = 0
    seed: int = 0
    num_special_tokens: int = 1  # tokenizer.num_special_tokens_to_add(): Llama-3 adds BOS; Qwen adds none
    vocab_size: int = 128256

    def __post_init__(self) -> None:
        if not 0.0 <= self.range_ratio < 1.0:
            raise BenchArgsError("--random-range-ratio", "input_range_ratio must be in [0, 1).")
        if self.num_prompts < 1:
            raise BenchArgsError("--num-prompts", f"expected at least 1, got {self.num_prompts}")
        if self.prefix_len < 0 or self.input_len < 0 or self.output_len < 0:
            raise BenchArgsError("--random-input-len", "lengths must be >= 0")
        real = max(0, self.input_len - self.num_special_tokens)
        if self.prefix_len + math.floor(real * (1 - self.range_ratio)) < 1:
            raise BenchArgsError("--random-input-len", (
                f"--random-input-len is too small: with tokenizer special tokens {self.num_special_tokens} and "
                f"input range ratio {self.range_ratio}, the minimum possible total input tokens (prefix + sampled) is "
                f"{self.prefix_len + math.floor(real * (1 - self.range_ratio))}. Increase --random-input-len and/or "
                "--random-prefix-len, or decrease the input range ratio so that prefix_len + floor(max(0, "
                "random_input_len - num_special)) * (1 - input_range_ratio) >= 1."))

    def bounds(self) -> tuple[int, int, int, int]:
        real = max(0, self.input_len - self.num_special_tokens)
        r = self.range_ratio
        return (math.floor(real * (1 - r)), math.ceil(real * (1 + r)),
                max(math.floor(self.output_len * (1 - r)), 1), max(math.ceil(self.output_len * (1 + r)), 1))

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(prompt tokens as the server counts them, output tokens) per request, in order."""
        in_low, in_high, out_low, out_high = self.bounds()
        rng = np.random.default_rng(self.seed)
        inputs = rng.integers(in_low, in_high + 1, size=self.num_prompts)
        outputs = rng.integers(out_low, out_high + 1, size=self.num_prompts)
        return inputs + self.prefix_len + self.num_special_tokens, outputs


def send_times_s(num_requests: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """``get_request``'s schedule (module docstring), seconds from the benchmark start."""
    if not burstiness > 0:
        raise BenchArgsError("--burstiness", f"A positive burstiness factor is expected, but given {burstiness}.")
    if not request_rate > 0:
        raise BenchArgsError("--request-rate", f"Obtained non-positive request rate {request_rate}.")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        delays = np.full(num_requests, 1.0 / request_rate)
    else:
        delays = np.random.RandomState(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                                                   size=num_requests)
    times = np.cumsum(delays)
    if times[-1] != 0:
        times *= (num_requests / request_rate) / times[-1]
    return times


def random_workload(dataset: RandomDataset, *, request_rate: float = math.inf, burstiness: float = 1.0) -> Workload:
    """The requests and their send times (a closed loop may send them later)."""
    prompts, outputs = dataset.lengths()
    times = send_times_s(dataset.num_prompts, request_rate, burstiness, dataset.seed)
    shared = [mix_hash(dataset.seed, 0xBE7C)] * (dataset.prefix_len // HASH_BLOCK_TOKENS)
    requests = []
    for i, (p, o, t) in enumerate(zip(prompts.tolist(), outputs.tolist(), times.tolist())):
        unique = [mix_hash(mix_hash(dataset.seed, i), k) for k in range(-(-int(p) // HASH_BLOCK_TOKENS))]
        hashes = chain_hashes(shared + unique, int(p), HASH_BLOCK_TOKENS) if shared else ()
        requests.append(Request(i, int(round(t * NS_PER_S)), int(p), int(o), None, hashes))
    in_low, in_high, out_low, out_high = dataset.bounds()
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}"
    notes = [f"vllm bench serve --dataset-name random: {dataset.num_prompts} prompts, input sampled from "
             f"[{in_low}, {in_high}] (+{dataset.num_special_tokens} special, +{dataset.prefix_len} prefix), output "
             f"from [{out_low}, {out_high}], request rate {rate}, burstiness {burstiness:g}, seed {dataset.seed}"]
    return Workload("random", requests, notes)


class ClosedLoopClient:
    """``vllm bench serve``'s client over a ``Fleet``: sends each request at its time, at most
    ``max_concurrency`` in flight, and records what the benchmark measures (module docstring).

    It advances the engines itself: to the next send while a slot is free, else the engine that is
    furthest behind by one step until a request ends. ``waiting`` tells a fused decode stretch to stop
    at its first finish (a finish sends the next request)."""

    def __init__(self, fleet, workload: Workload, max_concurrency: int | None = None):
        if max_concurrency is not None and max_concurrency <= 0:
            raise BenchArgsError("--max-concurrency", "--max-concurrency must be greater than 0")
        self.fleet = fleet
        self.limit = max_concurrency
        self.pending = deque(sorted(workload.requests, key=lambda r: (r.arrival_ns, r.req_id)))
        self.sent: dict[int, int] = {}  # request -> send time
        self.done: dict[int, tuple[int, bool]] = {}  # request -> (end, completed)
        self.in_flight = 0
        self.max_in_flight = 0
        self._freed: list[int] = []  # heap: times at which slots came free, not yet taken again
        for engine in fleet.engines:
            engine.finish_listeners.append(self)

    @property
    def waiting(self) -> bool:
        return bool(self.pending) and self.limit is not None and self.in_flight >= self.limit

    def __call__(self, rid: int, end: int, completed: bool) -> None:
        if rid in self.sent and rid not in self.done:
            self.done[rid] = (end, completed)
            self.in_flight -= 1
            if self.limit is not None:
                heapq.heappush(self._freed, end)

    def _send(self, request: Request, at_ns: int) -> None:
        fleet = self.fleet
        sent = Request(request.req_id, at_ns, request.prompt_tokens, request.max_output_tokens, request.priority,
                       request.block_hashes)
        i = fleet.router(fleet.engines, sent)
        fleet.routed[i] += 1
        self.sent[request.req_id] = at_ns
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        fleet.engines[i].submit(sent)

    def run(self, *, cap_ns: int, on_batches=None, flush_ns: int = 10 * NS_PER_S) -> None:
        """Until every request has ended (or ``cap_ns`` of simulated time)."""
        fleet, engines = self.fleet, self.fleet.engines
        next_flush = flush_ns
        while self.pending or self.in_flight:
            if self.pending and (self.limit is None or self.in_flight < self.limit):
                request = self.pending.popleft()
                # the slot this request takes came free then (the first max_concurrency are free from 0)
                slot = heapq.heappop(self._freed) if self._freed else 0
                at = max(request.arrival_ns, slot)
                if at >= cap_ns:
                    break
                for e in engines:
                    e.advance(at)
                self._send(request, at)
                continue
            busy = [e for e in engines if e.scheduler.requests or e._arrivals or e.now_ns < e.down_until_ns]
            if not busy:
                break
            engine = min(busy, key=lambda e: e.now_ns)
            if engine.now_ns >= cap_ns:
                break
            engine.advance(max(engine.now_ns + 1, engine.down_until_ns))
            t = max(e.now_ns for e in engines)
            if on_batches is not None and t >= next_flush:
                on_batches(fleet.take_batches(t))
                next_flush = t + flush_ns
        fleet.now_ns = max(e.now_ns for e in engines)
        if on_batches is not None:
            on_batches(fleet.take_batches(fleet.now_ns))

    def metrics(self, percentiles=(99,)) -> dict:
        """``calculate_metrics`` over what the engines recorded (module docstring)."""
        records = [r for e in self.fleet.engines for r in e.records]
        ttft, tpot, e2el, inputs, outputs = [], [], [], 0, 0
        for rid, arrival, first, end, prompt, generated in records:
            send = self.sent.get(rid, arrival)  # the client's clock: a request sent mid-step waits for the next
            ttft.append(first - send if first >= 0 else end - send)
            e2el.append(end - send)
            if generated > 1 and first >= 0:
                tpot.append((end - first) / (generated - 1))
            inputs += prompt
            outputs += generated
        values = np.concatenate([np.asarray(e._itl_values, dtype=np.float64) for e in self.fleet.engines])
        counts = np.concatenate([np.asarray(e._itl_counts, dtype=np.int64) for e in self.fleet.engines])
        starts = list(self.sent.values())
        ends = [end for end, _ in self.done.values()]
        duration = (max(ends) - min(starts)) / NS_PER_S if starts and ends else 0.0
        completed = sum(1 for _, ok in self.done.values() if ok)
        out = {"duration": round(duration, 3), "completed": completed, "failed": len(self.done) - completed,
               "total_input_tokens": inputs, "total_output_tokens": outputs,
               "request_throughput": round(completed / duration, 4) if duration else None,
               "output_throughput": round(outputs / duration, 2) if duration else None,
               "total_token_throughput": round((inputs + outputs) / duration, 2) if duration else None,
               "max_concurrent_requests": self.max_in_flight}
        for name, data in (("ttft", (np.asarray(ttft, dtype=np.float64), None)),
                           ("tpot", (np.asarray(tpot, dtype=np.float64), None)), ("itl", (values, counts)),
                           ("e2el", (np.asarray(e2el, dtype=np.float64), None))):
            out.update(_stats(name, *data, percentiles))
        return out


def _stats(name: str, values: np.ndarray, weights: np.ndarray | None, percentiles) -> dict:
    """mean, median, std and the percentiles of ``values`` (ns) in ms; ``weights`` repeats each value."""
    if weights is not None and len(values):
        values = np.repeat(values, weights)
    ms = values / 1e6
    out = {f"mean_{name}_ms": round(float(np.mean(ms)), 3) if len(ms) else 0.0,
           f"median_{name}_ms": round(float(np.median(ms)), 3) if len(ms) else 0.0,
           f"std_{name}_ms": round(float(np.std(ms)), 3) if len(ms) else 0.0}
    for p in percentiles:
        label = str(int(p)) if float(p).is_integer() else str(p)
        out[f"p{label}_{name}_ms"] = round(float(np.percentile(ms, p)), 3) if len(ms) else 0.0
    return out


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One ``vllm bench serve`` invocation: the dataset, the arrival schedule and the client's cap."""

    dataset: RandomDataset
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise BenchArgsError("--max-concurrency", "--max-concurrency must be greater than 0")
        send_times_s(1, self.request_rate, self.burstiness, 0)  # validates rate and burstiness

    def workload(self) -> Workload:
        return random_workload(self.dataset, request_rate=self.request_rate, burstiness=self.burstiness)

    def describe(self) -> dict:
        d = self.dataset
        return {"dataset_name": "random", "num_prompts": d.num_prompts, "random_input_len": d.input_len,
                "random_output_len": d.output_len, "random_range_ratio": d.range_ratio,
                "random_prefix_len": d.prefix_len, "seed": d.seed, "ignore_eos": self.ignore_eos,
                "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
                "burstiness": self.burstiness}
