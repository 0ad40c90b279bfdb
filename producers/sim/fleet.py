"""Several simulated GPUs behind a router: one engine per GPU, node ids ``sim-0/gpu0`` … . The
profile names the engine kind (``Profile.engine``) and the registry builds it (``producers.sim.registry``:
the vLLM-faithful engine, or the seed's engine over its paged pool); the fleet drives it through the
engine port (``kvguard.contracts.engine.EnginePort``). Requests are routed when they arrive (least
outstanding tokens by default, ties to the lowest GPU index, so runs are deterministic). The router health-checks: a GPU that is restarting
after an OOM crash gets no new work while another is up; only when every GPU is down does a request
go to a down one, which refuses it (FINISH REJECTED). Every node's events are drained as
``EventBatch``es with increasing ``seq``, one ``epoch`` per run, the geometry on the first batch and on
every snapshot batch, and a SNAPSHOT + ``PoolState`` every ``snapshot_every_s`` of event time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from kvguard.contracts.events import EVENT_DTYPE, EventBatch
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import Profile
from kvguard.producers.sim.routing import LlmdUtilizationRouter, route_by_admission
from kvguard.producers.sim.run import DEFAULT_SLO, RunSummary, SloTargets, slo_fields
from kvguard.producers.sim.registry import SimEngine as Engine
from kvguard.producers.sim.registry import make_engine
from kvguard.producers.sim.workloads import Request, Workload


def _up(engines: list[Engine], request: Request) -> list[int]:
    """Indexes of the GPUs that would accept ``request`` (the load balancer's health check)."""
    return [i for i, e in enumerate(engines) if e.is_up(request.arrival_ns)]


def _route_least_loaded(engines: list[Engine], request: Request) -> int:
    # least loaded among the GPUs that are up; all down: least loaded of all (it refuses the request)
    candidates = _up(engines, request) or range(len(engines))
    return min(candidates, key=lambda i: engines[i].outstanding_tokens())  # ties: the lowest index


def _route_round_robin(engines: list[Engine], request: Request) -> int:
    # the request's turn, or the next GPU after it that is up
    n = len(engines)
    first = request.req_id % n
    for k in range(n):
        i = (first + k) % n
        if engines[i].is_up(request.arrival_ns):
            return i
    return first


ROUTERS: dict[str, Callable[[list[Engine], Request], int]] = {
    "least_loaded": _route_least_loaded,
    "round_robin": _route_round_robin,
    "kvguard": route_by_admission,  # the router series kvguard exports (producers.sim.routing)
    "llmd_utilization": LlmdUtilizationRouter(),  # llm-d-router's utilization detector (the baseline)
}


class Fleet:
    def __init__(self, n_gpus: int, profile: Profile, *, seed: int = 0, router: str = "least_loaded",
                 config=None, snapshot_every_s: float = 60.0, host: str = "sim-0"):
        if n_gpus < 1:
            raise ValueError(f"n_gpus: expected >= 1, got {n_gpus}")
        if router not in ROUTERS:
            raise ValueError(f"router: expected one of {sorted(ROUTERS)}, got {router!r}")
        self.profile = profile
        self.seed = seed
        self.epoch = seed
        self.router = ROUTERS[router]
        self.snapshot_every_ns = int(snapshot_every_s * NS_PER_S)
        self.engines = [make_engine(profile, f"{host}/gpu{i}", seed=seed, config=config) for i in range(n_gpus)]
        self.nodes = [e.node for e in self.engines]
        self.now_ns = 0
        self._pending: list[Request] = []
        self._next = 0
        self._seq = [0] * n_gpus
        self._next_snapshot_ns = [0] * n_gpus
        self._last_ts = [0] * n_gpus
        self.routed = [0] * n_gpus
        self.shed = 0  # refused at the router (the llm-d-style baseline sheds there; counted as refused)
        self.shed_by_priority: dict[int, int] = {}

    def submit_workload(self, workload: Workload | Iterable[Request]) -> None:
        """Queue requests; each is routed to a GPU when the fleet clock reaches its arrival."""
        requests = workload.requests if isinstance(workload, Workload) else list(workload)
        self._pending = sorted(self._pending[self._next:] + list(requests), key=lambda r: (r.arrival_ns, r.req_id))
        self._next = 0

    @property
    def pending(self) -> int:
        return len(self._pending) - self._next

    def advance(self, until_ns: int) -> None:
        """Route arrivals up to ``until_ns`` (each with the engines advanced to its arrival time)
        and run every engine up to ``until_ns``."""
        while self._next < len(self._pending) and self._pending[self._next].arrival_ns <= until_ns:
            r = self._pending[self._next]
            self._next += 1
            for e in self.engines:
                e.advance(r.arrival_ns)
            i = self.router(self.engines, r)
            if i < 0:  # the router shed it: a retryable refusal (429), answered at the router
                self.shed += 1
                p = 5 if r.priority is None else min(10, max(0, int(r.priority)))
                self.shed_by_priority[p] = self.shed_by_priority.get(p, 0) + 1
                continue
            self.routed[i] += 1
            self.engines[i].submit(r)
        for e in self.engines:
            e.advance(until_ns)
        self.now_ns = max(self.now_ns, until_ns)

    def take_batches(self, now_ns: int) -> list[EventBatch]:
        """One batch per node with new events (or a due snapshot), in node order."""
        out = []
        for i, e in enumerate(self.engines):
            events = e.take_events()
            if len(events):
                self._last_ts[i] = max(self._last_ts[i], int(events["ts_ns"].max()))
            state = None
            if now_ns >= self._next_snapshot_ns[i]:
                ts = max(now_ns, self._last_ts[i])
                state = e.pool.snapshot(ts)
                tail = e.take_events()
                events = np.concatenate([events, tail]) if len(events) else tail
                self._next_snapshot_ns[i] = now_ns + self.snapshot_every_ns
            if not len(events) and state is None:
                continue
            first = self._seq[i] == 0
            out.append(EventBatch(node=e.node, seq=self._seq[i], events=np.ascontiguousarray(events, dtype=EVENT_DTYPE),
                                  epoch=self.epoch, geometry=self.profile.geometry if (first or state is not None) else None,
                                  state=state))
            self._seq[i] += 1
        return out

    def idle(self) -> bool:
        """Nothing left to route, and no GPU holds a running, waiting or swapped request."""
        if self.pending:
            return False
        for e in self.engines:
            q = e.queue_lengths()
            if q["running"] or q["waiting"] or q["swapped"]:
                return False
        return True

    def steps(self, end_ns: int, *, step_ns: int, clamp: bool = False, drain: bool = False,
              drain_cap_ns: int | None = None) -> Iterator[tuple[int, list[EventBatch]]]:
        """The run loop every driver of the fleet shares (the embedded closed loop, the dataset
        builder, ``kvguard simulate``): advance in steps of ``step_ns`` from the fleet's clock and
        yield ``(now_ns, batches)`` after each, the step's event batches; the caller processes them
        before the next step is taken. With ``clamp`` the step that crosses ``end_ns`` ends there,
        else it is a whole step (past ``end_ns`` when that is no multiple of it). With ``drain`` the steps go on
        past ``end_ns`` until the fleet is idle or ``drain_cap_ns`` (default ``end_ns``) is reached."""
        if self.now_ns >= end_ns and not drain:
            return
        cap_ns = drain_cap_ns if drain_cap_ns is not None else end_ns
        now_ns = self.now_ns
        while True:
            now_ns = min(now_ns + step_ns, end_ns) if clamp and now_ns < end_ns else now_ns + step_ns
            self.advance(now_ns)
            yield now_ns, self.take_batches(now_ns)
            if now_ns >= end_ns and (not drain or now_ns >= cap_ns or self.idle()):
                return

    def summary(self, slo: SloTargets = DEFAULT_SLO) -> RunSummary:
        """Fleet-wide outcomes; percentiles over every GPU's requests; SLO attainment against ``slo``."""
        sims = [e.summary() for e in self.engines]
        ttft = np.concatenate([np.asarray(e._ttft_ns, dtype=np.float64) for e in self.engines])
        tpot = np.concatenate([np.asarray(e._tpot_ns, dtype=np.float64) for e in self.engines])

        def pct(values, q):
            return round(float(np.percentile(values, q)) / NS_PER_S, 6) if len(values) else None

        sim_s = max(e.now_ns for e in self.engines) / NS_PER_S
        return RunSummary(
            requests=sum(s.requests for s in sims) + self.shed, completed=sum(s.completed for s in sims),
            failed=sum(s.failed for s in sims), rejected=sum(s.rejected for s in sims),
            unfinished=sum(s.unfinished for s in sims), ooms=sum(s.ooms for s in sims),
            preemptions=sum(s.preemptions for s in sims), ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
            tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
            goodput_tokens_per_s=round(sum(e.goodput_tokens for e in self.engines) / sim_s, 3) if sim_s > 0 else 0.0,
            downtime_s=round(sum(s.downtime_s for s in sims), 3), sim_seconds=round(sim_s, 3),
            events=sum(s.events for s in sims), refused=sum(s.refused for s in sims) + self.shed,
            # every request routed counts, also one an engine had not taken in when the run ended
            **slo_fields([r for e in self.engines for r in e.served],
                         max(sum(s.requests for s in sims), sum(self.routed)) + self.shed, sim_s, slo,
                         priorities=self._priorities()),
        )

    def _priorities(self):
        """(priority per served entry, arrivals per priority) over every GPU and the router's sheds,
        or None when an engine does not keep them."""
        if not all(hasattr(e, "served_priority") for e in self.engines):
            return None
        served = [p for e in self.engines for p in e.served_priority]
        arrivals: dict[int, int] = dict(self.shed_by_priority)
        for e in self.engines:
            for p, n in e.requests_by_priority.items():
                arrivals[p] = arrivals.get(p, 0) + n
        return served, arrivals

    def per_gpu(self) -> list[dict]:
        out = []
        for i, e in enumerate(self.engines):
            d = e.summary().to_dict()
            d["node"] = e.node
            d["routed"] = self.routed[i]
            d["priority_defaulted"] = e.priority_defaulted
            d["steps"] = e.steps
            d["ooms_by_cause"] = ooms_by_cause(e)
            d["rejected_by_reason"] = dict(e.rejected_by_reason)
            d["allocator"] = e.allocator_summary() if e.capabilities.caching_allocator else None
            out.append(d)
        return out

    def ooms_by_cause(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for e in self.engines:
            for cause, n in ooms_by_cause(e).items():
                total[cause] = total.get(cause, 0) + n
        return dict(sorted(total.items()))

    def rejected_by_reason(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for e in self.engines:
            for reason, n in e.rejected_by_reason.items():
                total[reason] = total.get(reason, 0) + n
        return dict(sorted(total.items()))


def ooms_by_cause(engine) -> dict[str, int]:
    """OOMs of one engine by ``layer:cause`` (e.g. ``allocator:fragmentation``, ``kv_arena:peak``)."""
    return dict(sorted(engine.ooms_by_cause.items()))
