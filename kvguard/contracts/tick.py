"""The tick: one GPU's metrics at a tick boundary, the one type between the stream and the policy.

The stream core builds it (``kvguard.streams.core``), the policy decides on it
(``kvguard.policy``), and on the bus it travels as the pydantic wire model
``kvguard.wire.schemas.MetricTick`` (``MetricTick.to_tick()`` turns a validated record back into
this dataclass, so a consumer over Kafka and the embedded loop hand the policy the same value).
Frozen: a tick is a fact about the past; the predictor's outputs are added with ``with_prediction``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S

SINCE_OOM_CAP_S = 1800.0  # "time since the last OOM" saturates here (also: no OOM seen yet)


@dataclass(slots=True, frozen=True)
class Candidate:
    """A request the node could give memory back from, carried on its tick (the stream picks them,
    the policy chooses among them).

    ``units`` counts every page it references; ``shared_units`` the part other requests also
    reference (not freed by evicting it). ``tokens`` is the KV token capacity of its pages (an upper
    bound of the tokens it holds, exact to within one page). ``priority`` None or negative: the
    request gave none. ``generated_tokens`` None: not known to the sender; ``decoded_tokens``
    then takes the tokens beyond the prompt.
    """

    req: int
    priority: int | None
    units: int
    tokens: int
    last_ts_ns: int
    shared_units: int = 0
    prompt_tokens: int = 0
    pages: int = 0
    generated_tokens: int | None = None

    @property
    def priority_given(self) -> bool:
        return self.priority is not None and self.priority >= 0

    @property
    def effective_priority(self) -> int:
        return int(self.priority) if self.priority_given else DEFAULT_PRIORITY

    @property
    def freeable_units(self) -> int:
        """Units that would actually become free: pages shared with others stay."""
        return max(0, self.units - self.shared_units)

    @property
    def decoded_tokens(self) -> int:
        return self.generated_tokens if self.generated_tokens is not None else max(0, self.tokens - self.prompt_tokens)


@dataclass(slots=True, frozen=True)
class Tick:
    """One GPU's metrics at ``ts_ns`` (a tick boundary), covering events in [ts_ns - tick, ts_ns).

    Levels (u_kv … free_units) are the state right before ``ts_ns``; counts and rates cover the
    interval. ``util_*`` split the device memory M (fractions of M; they sum to 1):
    weights+context, KV live, KV cached (cached + retained pages), workspace, free units of D,
    and the headroom outside D (M·(1−u)). ``reserved_frac`` is the share of D Ψ treats as reserved
    (``util_reserved`` the same as a fraction of M; it overlaps the free units, not in the sum).
    ``synced`` is False while the mirror may have missed events (values are best effort then, the
    fractions u_kv, f_ext and f_int kept within [0, 1]).
    On uniform-block KV pools (one unit per block, no workspace in the arena) F_ext of the KV layer
    is 0: any free block serves any request; fragmentation lives in the allocator (``alloc_*``).
    """

    node: str
    ts_ns: int
    tick_s: float
    synced: bool
    u_kv: float
    f_ext: float
    f_int: float
    psi: float
    slope_per_min: float
    live_units: int
    cached_units: int
    retained_units: int
    workspace_units: int
    free_units: int
    largest_free_run_units: int
    n_free_runs: int
    dynamic_units: int
    tokens_stored: int
    util_weights: float
    util_kv_live: float
    util_kv_cached: float
    util_workspace: float
    util_free: float
    util_headroom: float
    util_reserved: float
    reserved_frac: float
    pages_per_request_p50: float
    pages_per_request_p95: float
    pages_per_request_p99: float
    requests_running: int
    requests_holding_pages: int
    arrivals: int
    finished: int
    alloc_failures: int
    alloc_fail_per_s: float
    evicted_pages: int
    evicted_requests: int
    evicted_tokens: int
    preemptions: int
    ooms: int
    tokens_per_s: float
    decode_tokens_per_s: float
    events: int
    p_oom: float | None = None
    u_kv_forecast: list[float] | None = None
    candidates: list[Candidate] = field(default_factory=list)
    requests_waiting: int = 0  # arrived, not admitted (or preempted back), not finished, at ts_ns
    s_since_oom: float = SINCE_OOM_CAP_S  # seconds since the node's last OOM before ts_ns, capped
    epoch: int = 0  # the producer run the tick belongs to: ts_ns orders ticks only within one epoch
    # the caching-allocator layer (PyTorch's names; bytes), on nodes that report it (0 elsewhere)
    alloc_reserved_bytes: int = 0
    alloc_allocated_bytes: int = 0
    alloc_inactive_split_bytes: int = 0  # free blocks in segments that still hold an allocated block
    alloc_largest_free_block_bytes: int = 0
    alloc_f_ext: float = 0.0  # 1 - largest cached free block / cached free bytes
    alloc_segments: int = 0
    alloc_retries: int = 0  # in the interval: cached blocks were released and a malloc retried
    governed: int = 0  # in the interval: GOVERN rows (steps the step governor shrank, requests it refused)
    never_fits: int = 0  # in the interval: requests refused at arrival as never fitting (Outcome.NEVER_FITS)
    # the seed's utilization split, fractions of M: weights (util_weights), activation (allocated
    # non-KV bytes), kv (util_kv_live + util_kv_cached), reserved_but_unused (reserved - allocated)
    util_activation: float = 0.0
    util_reserved_unused: float = 0.0
    partial: bool = False  # the input ended inside this tick's interval (rates cover less than tick_s)
    unit_bytes: int = 0  # bytes of one KV unit (Geometry.unit_bytes): *_units fields times this are bytes
    # requests asking for prompt logprobs (ARRIVE F_PROMPT_LOGPROBS) with prompt positions still to
    # compute, and how many positions: logits outside vLLM's profiled peak (issue 13's admission input)
    logprob_requests_pending: int = 0
    logprob_prompt_tokens_pending: int = 0
    # events of the interval that ran more than streams.max_ts_backwards_s behind the node's clock (its
    # newest event time before them): applied in order all the same, so counted in this tick, not theirs
    late_events: int = 0
    # the node's admission gate (issue 29; None: it has none): whether it admits a typical request now,
    # its predicted KV saturation in [0, 1] and expected queueing delay (the newest ADMISSION state row)
    endpoint_admit: int | None = None
    endpoint_saturation: float | None = None
    endpoint_queue_delay_s: float | None = None

    @property
    def ts_s(self) -> float:
        return self.ts_ns / NS_PER_S

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ts_s"] = self.ts_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Tick":
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["candidates"] = [Candidate(**c) for c in d.get("candidates", [])]
        if values.get("u_kv_forecast") is not None:
            values["u_kv_forecast"] = [float(x) for x in values["u_kv_forecast"]]
        return cls(**values)

    def with_prediction(self, p_oom: float, u_kv_forecast: list[float]) -> "Tick":
        return replace(self, p_oom=p_oom, u_kv_forecast=u_kv_forecast)


# The tick's groups: every field in exactly one (tests/unit/contracts/test_tick_groups.py). The tick
# stays one flat record (``tick.u_kv`` is read everywhere); the groups are metadata, carried into the
# wire model's JSON schema (``kvguard.wire.schemas.MetricTick``) and used to document and plot a layer.
TICK_GROUPS: dict[str, tuple[str, ...]] = {
    # which node, which interval, how complete
    "interval": ("node", "ts_ns", "tick_s", "synced", "epoch", "partial", "events", "late_events"),
    # the KV layer: the engine's pages (units of ``unit_bytes``), its fragmentation, its failures
    "kv": ("u_kv", "f_ext", "f_int", "psi", "slope_per_min", "live_units", "cached_units", "retained_units",
           "workspace_units", "free_units", "largest_free_run_units", "n_free_runs", "dynamic_units",
           "tokens_stored", "reserved_frac", "unit_bytes", "pages_per_request_p50", "pages_per_request_p95",
           "pages_per_request_p99", "alloc_failures", "alloc_fail_per_s"),
    # the caching-allocator layer (PyTorch's names; bytes): where fragmentation lives on uniform blocks
    "allocator": ("alloc_reserved_bytes", "alloc_allocated_bytes", "alloc_inactive_split_bytes",
                  "alloc_largest_free_block_bytes", "alloc_f_ext", "alloc_segments", "alloc_retries"),
    # the device memory split (fractions of M)
    "memory": ("util_weights", "util_kv_live", "util_kv_cached", "util_workspace", "util_free", "util_headroom",
               "util_reserved", "util_activation", "util_reserved_unused"),
    # the requests of the interval
    "requests": ("requests_running", "requests_holding_pages", "requests_waiting", "arrivals", "finished",
                 "evicted_pages", "evicted_requests", "evicted_tokens", "preemptions", "ooms", "s_since_oom",
                 "tokens_per_s", "decode_tokens_per_s", "candidates", "logprob_requests_pending",
                 "logprob_prompt_tokens_pending", "governed", "never_fits"),
    # the predictor's outputs (``with_prediction``)
    "prediction": ("p_oom", "u_kv_forecast"),
    # the node's admission gate (issue 29): the router series; None without a gate
    "admission": ("endpoint_admit", "endpoint_saturation", "endpoint_queue_delay_s"),
}
_GROUP_OF = {name: group for group, names in TICK_GROUPS.items() for name in names}


def tick_group(name: str) -> str:
    """The group of the Tick field ``name`` (KeyError names the table when it is in none)."""
    try:
        return _GROUP_OF[name]
    except KeyError:
        raise KeyError(f"Tick.{name} is in no group: add it to TICK_GROUPS in kvguard/contracts/tick.py") from None

