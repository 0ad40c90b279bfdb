"""Render SGLang 0.5.23's own /metrics text, as its HTTP server does, for the scrape tests.

Run as a subprocess (SGLang imports publish process-wide state): reads a JSON object on stdin,
``{"constants": {...}, "moments": [{stat: value, ..., "retracted": n}, ...]}``, and prints one JSON
list of exposition texts, one per moment. SGLang's ``SchedulerMetricsCollector``
(``sglang/srt/observability/metrics_collector.py``) is built with the label set the scheduler gives
it; each moment is one ``log_stats(SchedulerStats)`` (and ``increment_retracted_reqs`` for its
retractions, as ``Scheduler.update_running_batch`` calls it); ``emit_constants`` runs once, as at
start-up. The text is what ``add_prometheus_middleware`` serves: ``prometheus_client``'s
``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR`` (``set_prometheus_multiproc_dir``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> int:
    # the stand-ins must be in place before SGLang is imported (producers/sim/sglang/cpu_imports.py)
    from kvguard.producers.sim.sglang import cpu_imports

    cpu_imports.install()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvguard-sglang-prom-")
    spec = json.load(sys.stdin)
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.runtime_context import get_context

    server_args = get_context().override_server_args(enable_metrics=True, device="cpu").install()
    from sglang.srt.observability.metrics_collector import QueueCount, SchedulerMetricsCollector, SchedulerStats

    labels = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0,
              "moe_ep_rank": 0}
    collector = SchedulerMetricsCollector(labels=labels, server_args=server_args)
    c = spec["constants"]
    collector.emit_constants(max_total_num_tokens=c["max_total_num_tokens"], max_total_num_tokens_swa=None,
                             weight_memory_usage_gb=c["weight_memory_usage_gb"],
                             kv_cache_memory_usage_gb=c["kv_cache_memory_usage_gb"], graph_memory_usage_gb={},
                             max_running_requests_under_SLO=None, page_size=c["page_size"],
                             num_pages=c["max_total_num_tokens"] // c["page_size"], context_len=c["context_len"],
                             startup_available_gpu_memory_gb=c["startup_available_gpu_memory_gb"])
    texts = []
    for moment in spec["moments"]:
        stats = SchedulerStats()
        stats.num_running_reqs = QueueCount(total=moment.pop("num_running_reqs"))
        stats.num_queue_reqs = QueueCount(total=moment.pop("num_queue_reqs"))
        retracted = moment.pop("retracted", 0)
        for name, value in moment.items():
            setattr(stats, name, value)
        collector.log_stats(stats)
        if retracted:
            collector.increment_retracted_reqs(num_retracted_reqs=retracted, num_retracted_input_tokens=300 * retracted,
                                               num_retracted_output_tokens=100 * retracted)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        texts.append(generate_latest(registry).decode())
    json.dump(texts, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
