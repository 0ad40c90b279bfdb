"""A vLLM server's start-up memory budget, read from its own log lines.

Three formats of the budget line are read, each with its source (the format strings are vLLM's):

- **0.2x-0.33** (``v1/worker/gpu_worker.py compile_or_warm_up_model``, 0.33.0 as installed): "Free memory on
  device (F/T GiB) on startup. Desired GPU memory utilization is (u, R GiB). Actual usage is C GiB for
  consumed memory (weights + non-torch), P GiB for peak activation, and G GiB for CUDAGraph memory. Replace
  ... Current kv cache memory in use is K GiB." Here ``P`` includes the CUDA-graph estimate that was
  subtracted (``peak_activation_memory = transient_peak_headroom + cudagraph_memory_estimate_applied``), so
  ``C + P + K = R`` and ``G`` (the captured pool) is outside ``R``.
- **0.10-0.11** (vllm PR#21489, as PR#25683 prints it): "... Actual usage is W GiB for weight, P GiB for peak
  activation, N GiB for non-torch memory, and G GiB for CUDAGraph memory. ... Current kv cache memory in use
  is K GiB." (or "K bytes"); ``W + P + N + K = R``, ``G`` outside.
- **V0** (``worker/worker.py``, vllm PR#10511 and after): "the current vLLM instance can use total_gpu_memory
  (T GiB) x gpu_memory_utilization (u) = R GiB" and "model weights take W GiB; non_torch_memory takes N GiB;
  PyTorch activation peak memory takes P GiB; the rest of the memory reserved for KV Cache is K GiB", or the
  same figures as PR#10511's "Memory profiling results:" table; the graph pool is captured later, outside
  ``R``, and only "Graph capturing finished in S secs, took G GiB" (V1) says its size.

Besides: "Available KV cache memory: K GiB", "GPU KV cache size: N tokens", "Maximum concurrency for L tokens
per request: Xx" (one line since 0.2x, two before), "# GPU blocks: B" (V0), "Model loading took W GiB",
"CUDA graph pool memory: A GiB (actual), E GiB (estimated)", "Estimated CUDA graph memory: E GiB total",
"Auto-fit max_model_len: reduced from A to B", and vLLM's refusals (``REFUSALS``).

Each figure is read where it stands, so a line split in two still reads; when a figure appears more than
once (several TP ranks, several boots in one file) the last one is taken. GiB figures become bytes as
``round(GiB * 2**30)``, so printing them back with vLLM's two decimals gives the log's figure exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

GiB = 1 << 30
_N = r"(-?\d+(?:\.\d+)?)"
_INT = r"(\d[\d,]*)"

# field -> pattern; the first group is the figure (GiB unless the field says otherwise)
_PATTERNS: dict[str, re.Pattern] = {name: re.compile(p) for name, p in {
    "init_free": rf"Free memory on device \({_N}/{_N} GiB\) on startup\.",
    "desired": rf"Desired GPU memory utilization is \({_N}, {_N} GiB\)",
    "consumed": rf"{_N} GiB for consumed memory \(weights \+ non-torch\)",
    "weight": rf"{_N} GiB for weight\b",
    "peak_activation": rf"{_N} GiB for peak activation",
    "non_torch": rf"{_N} GiB for non-torch memory",
    "cudagraph": rf"{_N} GiB for CUDAGraph memory",
    "kv_in_use": rf"Current kv cache memory in use is {_N} (GiB|bytes)",
    "available_kv": rf"Available KV cache memory: {_N} GiB",
    "v0_total": rf"total_gpu_memory \({_N}\s*GiB\) x gpu_memory_utilization \({_N}\) = {_N}\s*GiB",
    "v0_weights": rf"model weights take\s+{_N}\s*GiB",
    "v0_non_torch": rf"non_torch_memory(?: takes)?\s+{_N}\s*GiB",
    "v0_peak": rf"PyTorch activation peak memory(?: takes)?\s+{_N}\s*GiB",
    "v0_kv": rf"(?:the rest of the memory reserved for KV Cache is|available_kv_cache_memory)\s+{_N}\s*GiB",
    "v0_table_total": rf"total_gpu_memory\s+{_N}\s*GiB",
    "v0_table_utilization": rf"gpu_memory_utilization\s+{_N}\s*$",
    "v0_table_requested": rf"the current vLLM instance can use\s+{_N}\s*GiB",
    "blocks": rf"# (?:GPU|CUDA|cuda|gpu) blocks: {_INT}",
    "kv_tokens": rf"KV cache size: {_INT} tokens",
    "concurrency": rf"Maximum concurrency for {_INT} tokens per request: {_N}x",
    "model_loading": rf"(?:Model loading took|Loading model weights took) {_N} (GiB|GB)",
    "graph_capture": rf"Graph capturing finished in \d+ secs?, took {_N} GiB",
    "graph_pool": rf"CUDA graph pool memory: {_N} GiB \(actual\), {_N} GiB \(estimated\)",
    "graph_estimate": rf"Estimated CUDA graph memory: {_N} GiB total",
    "kv_fixed": rf"Initial free memory {_N} GiB, reserved {_N} GiB memory for KV Cache as specified by "
                r"kv_cache_memory_bytes",
    "auto_fit": r"Auto-fit max_model_len: reduced from (\d+) to (\d+)",
}.items()}

# vLLM's start-up refusals (v1/worker/utils.py, v1/core/kv_cache_planning.py; the V0 one of vllm#11391)
REFUSALS = (
    re.compile(r"Free memory on device (?:\S+ )?\(\d+(?:\.\d+)?/\d+(?:\.\d+)? GiB\) on startup is less than desired "
               r"GPU memory utilization[^\n]*"),
    re.compile(r"No available memory for the cache blocks[^\n]*"),
    re.compile(r"To serve at least one request with the models?'?s?'? max seq len[^\n]*"),
    re.compile(r"The model's max seq len \(\d+\) is larger than the maximum number of tokens that can be stored in KV "
               r"cache[^\n]*"),
    re.compile(r"Cannot auto-fit max_model_len[^\n]*"),
)

FORMATS = ("vllm-0.33", "vllm-0.10", "vllm-v0")


class StartupLogError(ValueError):
    """The text holds no start-up budget line vLLM prints; the message names what it did find."""


def _bytes(gib: float) -> int:
    return round(gib * GiB)


@dataclass(frozen=True, slots=True)
class LogBudget:
    """One server's start-up budget as its log states it (bytes; None: the log does not say)."""

    format: str  # one of FORMATS
    total_bytes: int | None = None
    init_free_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    requested_bytes: int | None = None
    consumed_bytes: int | None = None  # weights + non-torch as vLLM counted them
    weights_bytes: int | None = None
    non_torch_bytes: int | None = None
    peak_activation_bytes: int | None = None  # as printed (0.33: with the graph estimate in it)
    cudagraph_bytes: int | None = None  # the captured pool
    cudagraph_estimate_bytes: int | None = None
    kv_cache_bytes: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    model_loading_bytes: int | None = None
    kv_cache_memory_fixed: bool = False
    refused: str | None = None  # vLLM's refusal, verbatim, when the log has one
    lines: tuple[str, ...] = field(default=())  # the lines read, in order

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"lines": list(self.lines)}

    @property
    def transient_peak_bytes(self) -> int | None:
        """The peak activation without the CUDA-graph estimate (the 0.33 line adds it; the others do not)."""
        if self.peak_activation_bytes is None:
            return None
        if self.format == "vllm-0.33":
            return self.peak_activation_bytes - (self.cudagraph_estimate_bytes or 0)
        return self.peak_activation_bytes


def parse_startup_log(text: str) -> LogBudget:
    """The budget in ``text`` (a whole log, or any of its lines); ``StartupLogError`` if it has none."""
    found: dict[str, tuple[str, ...]] = {}
    read: list[str] = []
    refused = None
    for line in text.splitlines():
        hit = False
        for name, pattern in _PATTERNS.items():
            m = pattern.search(line)
            if m:
                found[name] = m.groups()
                hit = True
        for pattern in REFUSALS:
            m = pattern.search(line)
            if m:
                refused, hit = m.group(0).strip(), True
        if hit:
            read.append(line.strip())
    return _budget(found, refused, tuple(read))


def _g(found: dict, name: str, index: int = 0) -> float | None:
    value = found.get(name)
    return float(value[index]) if value is not None else None


def _budget(found: dict, refused: str | None, lines: tuple[str, ...]) -> LogBudget:
    b = lambda gib: _bytes(gib) if gib is not None else None  # noqa: E731
    common = dict(num_gpu_blocks=int(found["blocks"][0].replace(",", "")) if "blocks" in found else None,
                  kv_cache_tokens=int(found["kv_tokens"][0].replace(",", "")) if "kv_tokens" in found else None,
                  max_concurrency=_g(found, "concurrency", 1),
                  max_model_len=_max_model_len(found), model_loading_bytes=_model_loading(found),
                  cudagraph_estimate_bytes=b(_g(found, "graph_pool", 1) if "graph_pool" in found
                                             else _g(found, "graph_estimate")),
                  refused=refused, lines=lines)
    graphs = _g(found, "cudagraph")
    if graphs is None:
        graphs = _g(found, "graph_pool") if "graph_pool" in found else _g(found, "graph_capture")
    if "desired" in found and ("consumed" in found or "weight" in found):
        consumed = _g(found, "consumed")
        weights, non_torch = _g(found, "weight"), _g(found, "non_torch")
        kv = _kv_in_use(found)
        if kv is None and "available_kv" in found:
            kv = _bytes(_g(found, "available_kv"))
        return LogBudget(
            "vllm-0.33" if consumed is not None else "vllm-0.10",
            total_bytes=b(_g(found, "init_free", 1)), init_free_bytes=b(_g(found, "init_free")),
            gpu_memory_utilization=_g(found, "desired"), requested_bytes=b(_g(found, "desired", 1)),
            consumed_bytes=b(consumed) if consumed is not None else _bytes(weights) + _bytes(non_torch or 0.0),
            weights_bytes=b(weights), non_torch_bytes=b(non_torch), peak_activation_bytes=b(_g(found, "peak_activation")),
            cudagraph_bytes=b(graphs), kv_cache_bytes=kv, **common)
    total = _g(found, "v0_total") if "v0_total" in found else _g(found, "v0_table_total")
    if "v0_weights" in found and total is not None:
        u = _g(found, "v0_total", 1) if "v0_total" in found else _g(found, "v0_table_utilization")
        requested = _g(found, "v0_total", 2) if "v0_total" in found else _g(found, "v0_table_requested")
        weights, non_torch = _g(found, "v0_weights"), _g(found, "v0_non_torch") or 0.0
        return LogBudget(
            "vllm-v0", total_bytes=b(total), gpu_memory_utilization=u, requested_bytes=b(requested),
            consumed_bytes=_bytes(weights) + _bytes(non_torch), weights_bytes=b(weights), non_torch_bytes=b(non_torch),
            peak_activation_bytes=b(_g(found, "v0_peak")), cudagraph_bytes=b(graphs),
            kv_cache_bytes=b(_g(found, "v0_kv")), **common)
    if "kv_fixed" in found:
        raise StartupLogError("the server ran with --kv-cache-memory-bytes (\"reserved "
                              f"{found['kv_fixed'][1]} GiB memory for KV Cache as specified by kv_cache_memory_bytes\"):"
                              " vLLM then logs no budget line; run `kvguard plan --kv-cache-memory-bytes` instead")
    seen = sorted(name for name in found if not name.startswith("v0_table"))
    what = f"it has {', '.join(seen)}" if seen else "nothing vLLM prints about memory was found"
    if refused:
        what += f"; vLLM refused to start: {refused}"
    raise StartupLogError("no start-up budget line (\"Free memory on device ... Actual usage is ...\" or V0's "
                          f"\"model weights take ...\"): {what}")


def _kv_in_use(found: dict) -> int | None:
    value = found.get("kv_in_use")
    if value is None:
        return None
    return int(float(value[0])) if value[1] == "bytes" else _bytes(float(value[0]))


def _max_model_len(found: dict) -> int | None:
    if "auto_fit" in found:
        return int(found["auto_fit"][1])
    if "concurrency" in found:
        return int(found["concurrency"][0].replace(",", ""))
    return None


def _model_loading(found: dict) -> int | None:
    value = found.get("model_loading")
    if value is None:
        return None
    return _bytes(float(value[0]))  # "GB" in V0's "took %.4f GB" is bytes / 2**30 too (model_runner.py)
