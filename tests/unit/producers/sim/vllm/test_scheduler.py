"""The vLLM-v1 scheduler (producers.sim.vllm.scheduler): budgets, chunked prefill, admission gates, preemption
order, rejection at arrival, finishing. The step-by-step comparison with vLLM itself is
tests/integration/test_vllm_conformance.py."""

from __future__ import annotations

import pytest

from kvguard.producers.sim.vllm.scheduler import (
    BadModelOutput,
    DuplicateRequest,
    RejectReason,
    Scheduler,
    SchedulerConfig,
    SeqStatus,
)


def make(num_gpu_blocks=65, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(num_gpu_blocks=num_gpu_blocks, **kw))


def add(s: Scheduler, rid, prompt, max_tokens=4, **kw):
    kw.setdefault("prompt_token_ids", [hash((rid, i)) % 1000 for i in range(prompt)])
    return s.add_request(rid, num_prompt_tokens=prompt, max_tokens=max_tokens, **kw)


def step(s: Scheduler):
    """One engine step with a fake model that samples token 7 for every sampling request."""
    out = s.schedule()
    finished = s.update_from_output(out, {rid: 7 for rid in out.sampling_ids})
    return out, finished


def test_prompts_that_leave_no_room_for_output_are_rejected_at_arrival_and_counted():
    s = make()
    assert add(s, "long", 300) is RejectReason.PROMPT_TOO_LONG
    assert add(s, "exact", 256) is RejectReason.NO_ROOM_FOR_OUTPUT
    assert s.add_request("empty", num_prompt_tokens=0, max_tokens=1) is RejectReason.EMPTY_PROMPT
    assert add(s, "ok", 255) is None
    assert s.rejected == {RejectReason.PROMPT_TOO_LONG: 1, RejectReason.NO_ROOM_FOR_OUTPUT: 1,
                          RejectReason.EMPTY_PROMPT: 1}
    assert list(s.requests) == ["ok"]
    with pytest.raises(DuplicateRequest):
        add(s, "ok", 10)


def test_a_pool_too_small_for_one_max_model_len_request_is_refused_like_vllm_at_startup():
    with pytest.raises(ValueError, match="cannot hold one request"):
        SchedulerConfig(num_gpu_blocks=16, max_model_len=256)  # 15 usable blocks < 16 needed


def test_chunked_prefill_splits_a_long_prompt_over_steps_within_the_token_budget():
    s = make()
    add(s, "a", 150)
    sizes = []
    while "a" not in (out := step(s)[0]).sampling_ids:
        sizes.append(out.num_scheduled_tokens["a"])
    sizes.append(out.num_scheduled_tokens["a"])
    assert sizes == [64, 64, 22]
    assert s.requests["a"].num_output_tokens == 1


def test_running_requests_go_first_then_waiting_ones_fill_the_budget():
    s = make()
    add(s, "a", 40)
    step(s)
    add(s, "b", 100)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 63)]
    assert out.sampling_ids == ("a",)


def test_long_prefill_threshold_applies_only_when_another_request_is_there():
    s = make(long_prefill_token_threshold=16)
    add(s, "a", 40)
    assert step(s)[0].num_scheduled_tokens == {"a": 40}  # alone: the cap does not apply
    add(s, "b", 40)
    add(s, "c", 40)
    assert step(s)[0].num_scheduled_tokens == {"a": 1, "b": 16, "c": 16}


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for rid in "abc":
        add(s, rid, 8)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"] and s.num_waiting == 1


def test_full_sequence_gate_keeps_a_prompt_waiting_until_all_its_blocks_fit():
    for gate in (True, False):
        s = make(num_gpu_blocks=17, max_model_len=160, scheduler_reserve_full_isl=gate)  # 16 usable blocks
        add(s, "a", 100, max_tokens=50)  # 7 blocks, prefilled in two steps
        step(s)
        step(s)
        add(s, "b", 150)  # 10 blocks in all > 9 free, although a 63-token first chunk (4 blocks) fits
        out, _ = step(s)
        if gate:
            assert "b" not in out.num_scheduled_tokens and s.requests["b"].status is SeqStatus.WAITING
        else:
            assert out.num_scheduled_tokens["b"] == 63  # first-chunk-only admission lets it in


def test_fcfs_preempts_the_last_running_request_and_puts_it_at_the_front_of_waiting():
    s = make(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=128)  # 8 usable blocks
    for rid in "abc":
        add(s, rid, 32, max_tokens=40)  # 2 blocks each; the first decode token needs a 3rd
    add(s, "d", 16, max_tokens=40)
    step(s)
    assert s.kv.num_free_blocks == 1
    out, _ = step(s)  # a takes the last block; b preempts d; c finds nothing left and preempts itself
    assert out.preempted_ids == ("d", "c") and list(out.num_scheduled_tokens) == ["a", "b"]
    assert [s.waiting.pop().request_id for _ in range(2)] == ["c", "d"]  # the latest preempted in front
    assert s.requests["d"].status is SeqStatus.PREEMPTED
    assert s.requests["d"].num_computed_tokens == 0 and s.requests["d"].num_output_tokens == 1


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    s = make(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=128)
    for rid in "abc":
        add(s, rid, 32, max_tokens=40)
    add(s, "d", 16, max_tokens=40)
    step(s)
    add(s, "tiny", 1)
    out, _ = step(s)
    assert out.preempted_ids and "tiny" not in out.num_scheduled_tokens


def test_priority_preempts_the_least_important_then_the_latest_arrival():
    s = make(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=128, policy="priority")
    add(s, "a", 32, max_tokens=40, priority=1, arrival_ns=3)
    add(s, "b", 32, max_tokens=40, priority=5, arrival_ns=1)
    add(s, "c", 32, max_tokens=40, priority=5, arrival_ns=2)
    add(s, "d", 16, max_tokens=40, priority=0, arrival_ns=4)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["d", "a", "b", "c"]  # the heap admits by (priority, arrival)
    out, _ = step(s)  # d takes the last block; a needs one: the victim is c, (5, 2) > (5, 1)
    assert out.preempted_ids == ("c",)
    assert list(out.num_scheduled_tokens) == ["d", "a", "b"]


def test_a_priority_victim_already_scheduled_this_step_gives_its_tokens_back():
    s = make(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=128, policy="priority")
    add(s, "low", 32, max_tokens=40, priority=9, arrival_ns=0)
    step(s)
    add(s, "hi", 80, max_tokens=40, priority=0, arrival_ns=1)
    step(s)  # low takes its 3rd block, hi its 5: the pool is full
    assert s.kv.num_free_blocks == 0 and [q.request_id for q in s.running] == ["low", "hi"]
    out, _ = step(s)  # low is scheduled first (1 token), then hi needs a 6th block: low is the victim
    assert out.preempted_ids == ("low",)
    assert out.num_scheduled_tokens == {"hi": 1} and set(out.block_ids) == {"hi"}


def test_a_preempted_request_hits_its_own_cached_blocks_when_it_comes_back():
    s = make(num_gpu_blocks=9, max_model_len=128, max_num_batched_tokens=128)
    add(s, "a", 32, max_tokens=40)  # 2 blocks
    add(s, "b", 40, max_tokens=40)  # 3 blocks
    add(s, "c", 48, max_tokens=40)  # 3 blocks, all full and cached: the pool is full
    step(s)
    out, _ = step(s)  # a needs a block: c is preempted; its blocks go to the tail, its last block first
    assert out.preempted_ids == ("c",)
    hit = s.kv.get_computed_blocks(s.requests["c"])
    assert hit.num_tokens == 32  # a reused c's tail block; c's first two blocks are still cached


def test_requests_finish_after_max_tokens_and_free_their_blocks_reported_next_step():
    s = make()
    add(s, "a", 10, max_tokens=3)
    finished = []
    for _ in range(3):
        finished += step(s)[1]
    assert finished == ["a"] and not s.requests and s.kv.num_free_blocks == 64 and s.num_finished == 1
    assert s.schedule().finished_ids == ("a",)


def test_a_request_reaching_max_model_len_finishes_length_capped():
    s = make(max_model_len=32, num_gpu_blocks=5)
    add(s, "a", 30, max_tokens=100)
    done = []
    for _ in range(5):
        done += step(s)[1]
    assert done == ["a"]


def test_the_model_output_must_match_the_sampling_requests():
    s = make()
    add(s, "a", 100)
    out = s.schedule()  # a 64-token chunk: no token is sampled
    with pytest.raises(BadModelOutput):
        s.update_from_output(out, {"a": 1})
    s.update_from_output(out, {})
    out = s.schedule()
    with pytest.raises(BadModelOutput):
        s.update_from_output(out, {})


def test_requests_sharing_workload_prefix_keys_share_blocks_without_token_ids():
    s = make()
    keys = (11, 12, 13)
    s.add_request("a", num_prompt_tokens=60, max_tokens=9, prompt_block_keys=keys)
    s.add_request("b", num_prompt_tokens=60, max_tokens=9, prompt_block_keys=keys)
    s.add_request("c", num_prompt_tokens=60, max_tokens=9, prompt_block_keys=(11, 99, 13))
    step(s)
    step(s)
    assert s.kv.block_ids("b")[:3] == s.kv.block_ids("a")[:3]
    assert s.kv.block_ids("c")[:1] == s.kv.block_ids("a")[:1] and s.kv.block_ids("c")[1] != s.kv.block_ids("a")[1]
    assert s.kv.prefix_hit_tokens == 48 + 16
