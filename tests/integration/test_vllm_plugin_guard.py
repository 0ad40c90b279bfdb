"""The logprob guard inside vLLM (issue 12): on vLLM's real v1 scheduler, with the plugin attached, a
request asking for prompt logprobs is prefilled in steps whose logits fit the CUDA headroom; other
traffic keeps vLLM's budget. There is no GPU here: the CUDA headroom comes from a stand-in for the
four ``torch.cuda`` calls the guard reads (mem_get_info, memory_reserved, memory_allocated), with
the sizes of a 24 GB GPU run near its limit."""

from __future__ import annotations

import pytest

from kvguard.producers.sim.vllm.conformance import synth_prompt_token_ids
from kvguard.producers.vllm.plugin import PluginConfig, prompt_logprobs_bytes
from tests.integration.test_vllm_plugin import BLOCK, Rig

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

MiB = 1 << 20


class CudaHeadroom:
    """What torch.cuda reports on a GPU with ``free`` bytes free and ``cached`` bytes reserved but unallocated."""

    def __init__(self, free: int, cached: int) -> None:
        self.free, self.cached = free, cached

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, 24 << 30

    def memory_reserved(self) -> int:
        return 20 << 30

    def memory_allocated(self) -> int:
        return (20 << 30) - self.cached

    def memory_stats(self) -> dict:
        return {"reserved_bytes.all.current": self.memory_reserved(),
                "allocated_bytes.all.current": self.memory_allocated(), "inactive_split_bytes.all.current": 0}

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self) -> None:
        pass

    def max_memory_allocated(self) -> int:
        return self.memory_allocated()


class FakeTorch:
    def __init__(self, free: int, cached: int) -> None:
        self.cuda = CudaHeadroom(free, cached)


def add(rig: Rig, request_id: str, prompt_tokens: int, *, prompt_logprobs: int | None) -> None:
    v = rig.side.v
    salt = hash(request_id) & 0xFFFF_FFFF
    params = v.SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    rig.sched.add_request(v.Request(request_id=request_id,
                                    prompt_token_ids=synth_prompt_token_ids(prompt_tokens, (), salt, BLOCK),
                                    sampling_params=params, pooling_params=None, arrival_time=0.0, priority=0,
                                    block_hasher=rig.side.block_hasher))
    rig.side.salts[request_id] = salt


def guarded_rig(free: int, cached: int) -> Rig:
    rig = Rig(600)
    rig.actions.torch = rig.actions.governor.torch = FakeTorch(free, cached)
    return rig


def test_the_plugin_knows_what_a_prompt_logprob_position_costs_for_the_served_model():
    rig = Rig(600)
    per_token = prompt_logprobs_bytes(rig.sched)
    model = rig.sched.vllm_config.model_config
    vocab = model.get_vocab_size()
    assert per_token == -(-vocab // 64) * 64 * model.dtype.itemsize + vocab * 4 + 8
    assert rig.actions.logprobs_bytes_per_token == per_token  # on by default
    off = PluginConfig.from_env({"KVGUARD_LOGPROBS_GUARD": "0"})
    assert off.logprobs_guard is False and PluginConfig.from_env({}).logprobs_guard is True


def test_a_prompt_logprob_request_prefills_in_steps_that_fit_the_headroom_and_vllms_budget_comes_back():
    """The guard is the step governor's prompt-logprob case: each chunk's planned peak (step_memory's plan
    for the served model) fits the headroom less the margin, and vLLM's budget is back outside schedule()."""
    from kvguard.producers.vllm.governor import StepShape

    rig = guarded_rig(free=400 * MiB, cached=200 * MiB)
    gov = rig.actions.governor
    avail = 600 * MiB - gov.governor.margin_bytes
    add(rig, "eval", 3000, prompt_logprobs=1)
    steps = []
    while "eval" in rig.sched.requests and rig.sched.requests["eval"].num_computed_tokens < 3000:
        steps.append(rig.step().get("eval", 0))
        assert rig.sched.max_num_scheduled_tokens == 2048  # vLLM's own budget outside schedule()
    assert steps and max(steps) < 2048 and sum(steps) == 3000
    assert all(gov.governor.raw_peak(StepShape(n, 1, n, n, 3000)) <= avail for n in steps)
    assert gov.governor.raw_peak(StepShape(2048, 1, 2048, 2048, 3000)) > avail  # vLLM's budget would not fit
    assert rig.actions.logprobs_guard_steps == 1  # the first chunk; the rest fits vLLM's budget as it is
    off = PluginConfig.from_env({"KVGUARD_GOVERNOR": "0"})
    assert off.logprobs_guard is False
    rig.check_equal()


def test_other_traffic_keeps_vllms_budget_and_without_cuda_the_guard_is_inert():
    rig = guarded_rig(free=400 * MiB, cached=200 * MiB)
    add(rig, "chat", 3000, prompt_logprobs=None)
    assert rig.step()["chat"] == 2048 and rig.actions.logprobs_guard_steps == 0
    cpu = Rig(600)  # the real torch here: no CUDA
    add(cpu, "eval", 3000, prompt_logprobs=1)
    assert cpu.step()["eval"] == 2048 and cpu.actions.logprobs_guard_steps == 0


def test_the_plugin_flags_a_prompt_logprob_request_on_its_arrive_row():
    from kvguard.contracts.events import F_PROMPT_LOGPROBS

    rig = Rig(600)
    add(rig, "eval", 300, prompt_logprobs=1)
    add(rig, "chat", 300, prompt_logprobs=None)
    rig.step()
    table = rig.mirror.request_table()
    flags = {int(r): int(f) for r, f in zip(table.req, table.arrive_flags)}
    assert flags[rig.plugin.translator.req("eval")] & F_PROMPT_LOGPROBS
    assert not flags[rig.plugin.translator.req("chat")] & F_PROMPT_LOGPROBS
