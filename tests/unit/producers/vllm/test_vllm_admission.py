"""The admission model reads vLLM 0.33's real Scheduler as the shadow gate reads the shadow one
(issue 29): the same requests give the same view, the same verdicts and the series a router scrapes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.producers.admission import AdmissionModel, Seq, vllm_priority
from kvguard.producers.sim.vllm.conformance import ConformanceRequest, synth_prompt_token_ids
from kvguard.producers.sim.vllm.scheduler import Scheduler, SchedulerConfig
from kvguard.producers.vllm.admission import ENDPOINT_SERIES, EndpointCollector, VllmAdmission, node_view

BLOCK = 16


def step_s(prefill: int, decode: int) -> float:
    return 0.01 + 1e-4 * prefill + 2e-4 * decode


@pytest.fixture(scope="module")
def sides():
    pytest.importorskip("vllm")
    from kvguard.producers.sim.vllm.conformance import VllmSide

    config = SchedulerConfig(num_gpu_blocks=120, max_model_len=1024, block_size=BLOCK, max_num_seqs=4,
                             max_num_batched_tokens=512, policy="priority")
    real, shadow = VllmSide(config), Scheduler(config)
    requests = [(f"r{i}", 100 + 37 * i, 60 + 11 * i, (9, 5, 1)[i % 3]) for i in range(8)]
    for rid, prompt, out, prio in requests:
        salt = hash(rid) & 0xFFFF
        real.add(ConformanceRequest(rid, 0, 0, vllm_priority(prio), out, salt,
                                    synth_prompt_token_ids(prompt, (), salt, BLOCK), ()))
        shadow.add_request(rid, num_prompt_tokens=prompt, max_tokens=out, priority=vllm_priority(prio),
                           salt=salt)
    for _ in range(6):
        real.step()
        out = shadow.schedule()
        shadow.update_from_output(out, {rid: 1 for rid in out.sampling_ids})
    return real.scheduler, shadow


def _shadow_view(shadow: Scheduler):
    from kvguard.producers.admission import NodeView, kvguard_priority

    def seq(s, blocks=0):
        return Seq(kvguard_priority(s.priority), s.num_prompt_tokens, s.max_tokens, len(s.output_token_ids), blocks)

    return NodeView(num_blocks=shadow.config.num_gpu_blocks - 1, block_size=BLOCK, max_num_seqs=4,
                    max_batched_tokens=shadow.max_num_scheduled_tokens, step_s=step_s,
                    running=[seq(s, len(shadow.kv.req_to_blocks.get(s.request_id, ()))) for s in shadow.running],
                    waiting=[seq(s) for s in shadow.waiting], policy="priority",
                    watermark_blocks=shadow.kv.watermark_blocks)


def test_the_view_of_vllms_scheduler_equals_the_shadow_gates(sides):
    real, shadow = sides
    v, s = node_view(real, step_s), _shadow_view(shadow)
    assert v.running and v.waiting  # the fixture overloads 4 seats
    assert sorted(v.running, key=repr) == sorted(s.running, key=repr)
    assert sorted(v.waiting, key=repr) == sorted(s.waiting, key=repr)
    assert (v.num_blocks, v.max_num_seqs, v.max_batched_tokens, v.policy) == \
        (s.num_blocks, s.max_num_seqs, s.max_batched_tokens, s.policy)
    model = AdmissionModel()
    for new in (Seq(9, 300, 50), Seq(1, 300, 50)):
        assert model.decide(v, new) == model.decide(s, new)


def test_the_router_series_are_served_with_the_exporters_names(sides):
    real, _ = sides
    registry = CollectorRegistry()
    registry.register(EndpointCollector(VllmAdmission(real), {"node": "pod-a/gpu0"}))
    samples = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples}
    assert set(samples) == set(ENDPOINT_SERIES)
    assert samples["kvguard_endpoint_admit"] in (0.0, 1.0)
    assert 0.0 < samples["kvguard_endpoint_saturation"] <= 1.0
    assert samples["kvguard_endpoint_queue_delay_seconds"] > 0.0
