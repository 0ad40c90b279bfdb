"""kvguard's admission model inside a running vLLM engine (issue 29): the node's predicted state read
from vLLM 0.33's own ``Scheduler`` and the router series served for llm-d-router's scrape.

``node_view(scheduler, step_s)`` reads what ``producers.admission`` needs from the real scheduler:
``scheduler.running`` / ``scheduler.waiting`` (``vllm.v1.request.Request``: ``priority`` is vLLM's,
lower first, turned back into kvguard's 0-10 with ``kvguard_priority``; ``num_prompt_tokens``,
``max_tokens``, ``num_output_tokens``), each running request's blocks from
``kv_cache_manager.get_block_ids``, ``block_pool.num_gpu_blocks`` less the null block,
``max_num_running_reqs`` (``--max-num-seqs``), ``max_num_scheduled_tokens`` (the step budget, an
actuator's cap included), ``policy`` and the KV manager's ``watermark_blocks``. The shadow engine's gate
builds the same view from its scheduler (``producers.sim.vllm.admission_gate``); a test checks the two
agree request for request.

``StepTimer`` learns the step-time model ``a + b * prefill_tokens + c * decode_seqs`` from the steps the
engine runs (least squares over a window), so the delay predictions use this GPU's speed.

``EndpointCollector`` serves ``kvguard_endpoint_admit``, ``kvguard_endpoint_saturation`` and
``kvguard_endpoint_queue_delay_seconds`` (the exporter's names, ``kvguard.ops.exporter.TICK_GAUGES``) as a
prometheus_client collector, so a router scraping the pod reads them (deploy/llm-d/epp-config.yaml).

Served with ``KVGUARD_ENDPOINT_METRICS_PORT`` set (``producers.vllm.plugin``); the plugin's hooks feed the
step timer (the time from ``schedule()`` returning to ``update_from_output``: the model step) and the
length model (each completed request's output tokens, by priority).

What this does not do on a real vLLM: refuse. vLLM's own refusals (``--max-num-queued-reqs`` ->
``QueueOverflowError``, 503) are raised in the API server's ``AsyncLLM.check_admission``, a process the
engine-core plugin does not run in; the refusal with Retry-After is the router's (llm-d flow control
answers 429 when a request cannot be dispatched) or the front end's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvguard.contracts.units import DEFAULT_PRIORITY
from kvguard.producers.admission import AdmissionModel, Decision, NodeView, Seq, Verdict, kvguard_priority

ENDPOINT_SERIES = ("kvguard_endpoint_admit", "kvguard_endpoint_saturation", "kvguard_endpoint_queue_delay_seconds")


def _blocks(scheduler: Any, request_id: str) -> int:
    try:
        ids = scheduler.kv_cache_manager.get_block_ids(request_id)
    except (KeyError, AttributeError):
        return 0
    return len(ids[0]) if ids else 0


def _seq(request: Any, blocks: int = 0) -> Seq:
    return Seq(kvguard_priority(request.priority), int(request.num_prompt_tokens), int(request.max_tokens),
               int(request.num_output_tokens), blocks)


def node_view(scheduler: Any, step_s: Callable[[int, int], float]) -> NodeView:
    """The admission model's view of vLLM's ``Scheduler`` (see the module docstring)."""
    kv = scheduler.kv_cache_manager
    policy = getattr(scheduler.policy, "value", str(scheduler.policy))
    return NodeView(num_blocks=int(kv.block_pool.num_gpu_blocks) - 1, block_size=int(scheduler.block_size),
                    max_num_seqs=int(scheduler.max_num_running_reqs),
                    max_batched_tokens=int(scheduler.max_num_scheduled_tokens), step_s=step_s,
                    running=[_seq(r, _blocks(scheduler, r.request_id)) for r in scheduler.running],
                    waiting=[_seq(r) for r in scheduler.waiting], policy=policy,
                    watermark_blocks=int(getattr(kv, "watermark_blocks", 0)))


class StepTimer:
    """Least-squares step-time model over the last ``window`` steps; ``prior`` until it has enough."""

    def __init__(self, prior: tuple[float, float, float] = (0.015, 1.2e-4, 2e-4), window: int = 256):
        self.coef = prior
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        self._rows.append((prefill_tokens, decode_seqs, seconds))
        if len(self._rows) >= 16 and len(self._rows) % 8 == 0:
            x = np.array([(1.0, p, d) for p, d, _ in self._rows])
            y = np.array([s for _, _, s in self._rows])
            coef, *_ = np.linalg.lstsq(x, y, rcond=None)
            self.coef = tuple(float(max(0.0, c)) for c in coef)

    def __call__(self, prefill_tokens: int, decode_seqs: int) -> float:
        a, b, c = self.coef
        return a + b * prefill_tokens + c * decode_seqs


class VllmAdmission:
    """The model over one attached vLLM scheduler: ``state()`` is what the router series show."""

    def __init__(self, scheduler: Any, model: AdmissionModel | None = None, timer: StepTimer | None = None):
        self.scheduler = scheduler
        self.model = model or AdmissionModel()
        self.timer = timer or StepTimer()
        self._prompt_sum = self._prompt_n = 0

    def observe_arrival(self, prompt_tokens: int) -> None:
        self._prompt_sum += int(prompt_tokens)
        self._prompt_n += 1

    def observe_finished(self, request: Any) -> None:
        self.model.lengths.observe(kvguard_priority(request.priority), int(request.num_output_tokens))

    def decide(self, request: Any) -> Verdict:
        return self.model.decide(node_view(self.scheduler, self.timer), _seq(request))

    def state(self) -> Verdict:
        prompt = self._prompt_sum // self._prompt_n if self._prompt_n else 512
        return self.model.decide(node_view(self.scheduler, self.timer), Seq(DEFAULT_PRIORITY, max(1, prompt), 256))


class EndpointCollector:
    """A prometheus_client custom collector over ``VllmAdmission.state()`` (read at scrape time)."""

    def __init__(self, admission: VllmAdmission, labels: dict[str, str] | None = None):
        self.admission = admission
        self.labels = dict(labels or {})

    def collect(self):
        from prometheus_client.metrics_core import GaugeMetricFamily  # only when scraped: the engine may never be

        v = self.admission.state()
        keys = sorted(self.labels)
        values = [self.labels[k] for k in keys]
        delay = v.delay_s if np.isfinite(v.delay_s) else 86_400.0
        for name, value, text in ((ENDPOINT_SERIES[0], 1.0 if v.decision is Decision.ADMIT else 0.0,
                                   "1 while kvguard's gate admits a typical request (priority 5)."),
                                  (ENDPOINT_SERIES[1], v.saturation, "Predicted KV saturation in [0, 1]."),
                                  (ENDPOINT_SERIES[2], delay, "Expected queueing delay of a request now (s).")):
            family = GaugeMetricFamily(name, text, labels=keys)
            family.add_metric(values, float(value))
            yield family


def serve_endpoint_series(admission: VllmAdmission, port: int, labels: dict[str, str] | None = None) -> Any:
    """Serve the router series on ``port`` (``/metrics``, a daemon thread), in a registry of their own."""
    from prometheus_client import CollectorRegistry, start_http_server  # only when a port is asked for

    registry = CollectorRegistry()
    registry.register(EndpointCollector(admission, labels))
    return start_http_server(port, registry=registry)
