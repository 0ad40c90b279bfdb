"""The admission model (producers.admission): priority mapping, lengths, predictions, decisions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.producers.admission import (
    AdmissionConfig,
    AdmissionModel,
    Decision,
    LengthModel,
    NodeView,
    Seq,
    kvguard_priority,
    parse_priority_mix,
    priority_for,
    vllm_priority,
)


def step_s(prefill_tokens: int, decode_seqs: int) -> float:
    return 0.01 + 1e-4 * prefill_tokens + 1e-4 * decode_seqs


def view(running=(), waiting=(), num_blocks=1000, policy="priority", max_num_seqs=64) -> NodeView:
    return NodeView(num_blocks=num_blocks, block_size=16, max_num_seqs=max_num_seqs, max_batched_tokens=2048,
                    step_s=step_s, running=list(running), waiting=list(waiting), policy=policy)


def test_priority_mapping_reverses_the_order_and_clamps():
    assert [vllm_priority(p) for p in (10, 9, 5, 1, 0)] == [0, 1, 5, 9, 10]
    assert vllm_priority(42) == 0 and vllm_priority(-3) == 10
    assert all(kvguard_priority(vllm_priority(p)) == p for p in range(11))


def test_vllms_own_priority_queue_serves_the_higher_kvguard_priority_first():
    """vLLM 0.33's PriorityRequestQueue (lower ``priority`` first) with the mapped values."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue
    from vllm.v1.request import Request

    queue = PriorityRequestQueue()
    for i, p in enumerate((1, 9, 5)):  # kvguard priorities, arriving in this order
        queue.add_request(Request(f"r{p}", [1, 2, 3], SamplingParams(max_tokens=4), None, arrival_time=float(i),
                                  priority=vllm_priority(p)))
    assert [queue.pop_request().request_id for _ in range(3)] == ["r9", "r5", "r1"]


def test_length_model_learns_each_class_and_caps_by_max_tokens():
    lengths = LengthModel(min_samples=4)
    assert lengths.expected_output(5, 800) == 800  # nothing seen: the cap
    for _ in range(4):
        lengths.observe(9, 100)
        lengths.observe(1, 500)
    assert lengths.expected_output(9, 800) == 100
    assert lengths.expected_output(1, 800) == 500
    assert lengths.expected_output(1, 200) == 200  # its own cap is lower
    assert lengths.expected_output(5, 800) == 300  # unseen class: all classes together
    assert lengths.expected_output(9, 800, generated=150) == 151  # it already generated more


def test_idle_node_admits_even_a_prompt_that_misses_its_target():
    v = AdmissionModel(AdmissionConfig(ttft_s=0.001)).decide(view(), Seq(5, 8000, 10))
    assert v.decision is Decision.ADMIT and v.delay_s > 0.001


def test_saturation_counts_growth_of_running_and_queued_requests():
    model = AdmissionModel()
    running = [Seq(5, 160, 160, generated=0, blocks=10)]  # holds 10 blocks, will need 20
    assert model.saturation(view(running, num_blocks=100)) == pytest.approx(0.20)
    assert model.saturation(view(running, [Seq(5, 320, 0 + 1)], num_blocks=100)) == pytest.approx(0.41)


def test_full_node_refuses_low_priority_with_a_retry_after_and_admits_high_priority():
    model = AdmissionModel(AdmissionConfig(ttft_s=2.0))
    running = [Seq(5, 1000, 4000, generated=10, blocks=64) for _ in range(10)]  # every block promised
    waiting = [Seq(1, 1000, 1000) for _ in range(20)]
    v = model.decide(view(running, waiting, num_blocks=320), Seq(1, 1000, 500))
    assert v.decision is Decision.REFUSE and v.retry_after_s >= 1.0 and v.saturation == 1.0
    # the same node, with room: a priority-9 request is served before the waiting priority-1 ones
    running = [Seq(5, 100, 100, generated=90, blocks=13) for _ in range(4)]
    v9 = model.decide(view(running, waiting, num_blocks=2000), Seq(9, 500, 100))
    v1 = model.decide(view(running, waiting, num_blocks=2000), Seq(1, 500, 100))
    assert v9.delay_s < v1.delay_s
    assert v9.decision is Decision.ADMIT


def test_fcfs_counts_every_waiting_request_ahead():
    waiting = [Seq(1, 2000, 10) for _ in range(10)]
    running = [Seq(5, 10, 10, generated=1, blocks=1)]
    model = AdmissionModel()
    fcfs = model.delay_s(view(running, waiting, policy="fcfs"), Seq(9, 100, 10))
    prio = model.delay_s(view(running, waiting, policy="priority"), Seq(9, 100, 10))
    assert fcfs > prio


def test_a_held_request_is_refused_once_its_hold_is_spent():
    model = AdmissionModel(AdmissionConfig(ttft_s=2.0, hold_max_s=2.0))
    running = [Seq(5, 1000, 4000, generated=3800, blocks=300) for _ in range(2)]
    v = model.decide(view(running, num_blocks=510), Seq(5, 500, 100))
    assert v.decision is Decision.HOLD
    assert model.decide(view(running, num_blocks=510), Seq(5, 500, 100), held_s=2.5).decision is Decision.REFUSE


def test_seats_are_a_wait_too():
    running = [Seq(5, 10, 1000, generated=1, blocks=1) for _ in range(4)]
    model = AdmissionModel()
    assert model.delay_s(view(running, max_num_seqs=4), Seq(5, 10, 10)) > 10 * step_s(0, 4)
    assert model.delay_s(view(running, max_num_seqs=8), Seq(5, 10, 10)) < step_s(2048, 4) * 2


@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 2000), st.integers(0, 10)), max_size=30),
       st.integers(1, 8000), st.integers(0, 10))
def test_decisions_are_total_and_refusals_always_carry_a_retry_after(reqs, prompt, priority):
    waiting = [Seq(p, pt, mt) for pt, mt, p in reqs]
    v = AdmissionModel().decide(view([], waiting, num_blocks=800), Seq(priority, prompt, 100))
    assert v.decision in (Decision.ADMIT, Decision.HOLD, Decision.REFUSE)
    assert 0.0 <= v.saturation <= 1.0 and v.delay_s >= 0
    if v.decision is Decision.REFUSE:
        assert v.retry_after_s >= 1.0 and math.isfinite(v.retry_after_s)


def test_priority_mix_parses_and_draws_in_proportion():
    mix = parse_priority_mix("9:0.1,5:0.6,1:0.3")
    assert mix == ((9, 0.1), (5, 0.6), (1, 0.3))
    draws = [priority_for(k * 7919 + 13, mix) for k in range(20000)]
    assert abs(draws.count(9) / len(draws) - 0.1) < 0.02
    assert abs(draws.count(1) / len(draws) - 0.3) < 0.02


@pytest.mark.parametrize("bad", ["9:0.5", "11:1", "a:1", "5", "5:0.5,5:0.5", "5:-1,6:2", ""])
def test_priority_mix_refuses_bad_specs(bad):
    with pytest.raises(ValueError, match="--priority-mix"):
        parse_priority_mix(bad)


def test_config_refuses_nonsense():
    with pytest.raises(ValueError, match="ttft_s"):
        AdmissionConfig(ttft_s=0)
    with pytest.raises(ValueError, match="admit_frac"):
        AdmissionConfig(admit_frac=2.0, hold_frac=1.0)
