"""The failure classes of notes/oom-classes.md the shadow engine models beyond C2/C5, each in a run built
to show it, with its own OOM cause, and none when its trigger is off (docs/NODE_MEMORY.md "Failure classes"):
C3 long-context attention buffers, C8 speculative decoding, C4 a neighbour process, C7 a leak."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.runtime.simulation import run_simulation
from kvguard.producers.sim.bench_serve import BenchRun, RandomDataset
from kvguard.producers.sim.engine_args import EngineArgs
from kvguard.producers.sim.profiles import ProfileError
from kvguard.producers.sim.vllm.external import GiB, Leak, MiB, Neighbour, ScheduleError

CONFIGS = Path(__file__).resolve().parents[4] / "data" / "model_configs"
LLAMA, QWEN8, QWEN06 = (str(CONFIGS / f"{n}.json") for n in ("llama-3.1-8b-instruct", "qwen3-8b", "qwen3-0.6b"))


def bench(n, input_len, output_len, ratio, rate=float("inf"), special=0, vocab=151936):
    return BenchRun(RandomDataset(num_prompts=n, input_len=input_len, output_len=output_len, range_ratio=ratio,
                                  seed=0, num_special_tokens=special, vocab_size=vocab), request_rate=rate)


def causes(out) -> dict:
    return out["ooms_by_cause"]


# -- C3: attention buffers the profile never measured, sized by the context ----------------------------

C3_TRAFFIC = dict(bench=bench(500, 1500, 600, 0.5, rate=8.0, special=1, vocab=128256))


@pytest.mark.parametrize("lse, long_context, want", [
    ("max_seq_len", 0.02, {"allocator:long_context": 1}),  # padded by the context (club-3090 "Cliff 1")
    ("total_q", 0.02, {}),  # vLLM 0.33's vllm-flash-attn: unpadded, the context does not size it
    ("max_seq_len", 0.0, {}),  # no long prompts: nothing grows
])
def test_a_long_context_prefill_ooms_on_its_attention_buffer_only_when_the_context_sizes_it(lse, long_context, want):
    args = EngineArgs(LLAMA, gpu="h100-80gb", gpu_memory_utilization=0.97, attention_lse=lse)
    out = run_simulation("random", engine_args=args, long_context_frac=long_context, long_context_len=100_000,
                         **C3_TRAFFIC)
    assert causes(out) == want
    if want:
        oom = out["per_gpu"][0]["oom_log"][0]
        assert oom["allocation"] == "lctx:attn_lse" and oom["tried_to_allocate_bytes"] > 1 * GiB


# -- C8: speculative decoding ---------------------------------------------------------------------

def test_speculative_decoding_verification_ooms_with_its_own_cause_and_not_without_drafts():
    traffic = bench(1200, 200, 400, 0.2)
    with_drafts = run_simulation("random", bench=traffic, engine_args=EngineArgs(
        QWEN8, gpu="h100-80gb", gpu_memory_utilization=0.97, speculative_model_config=QWEN06, num_speculative_tokens=7))
    assert causes(with_drafts) == {"allocator:spec_decode": 1}
    assert with_drafts["per_gpu"][0]["oom_log"][0]["allocation"].startswith("spec:")
    assert with_drafts["spec_decode"]["draft_tokens"] > 0
    plain = run_simulation("random", bench=traffic, engine_args=EngineArgs(QWEN8, gpu="h100-80gb",
                                                                            gpu_memory_utilization=0.97))
    assert plain["ooms"] == 0


def test_before_chunked_verification_the_warmup_upcast_is_the_4_12_gib_of_vllm_pr48641():
    """vllm PR#48641: Qwen3-8B with 7 speculative tokens on an H100 "tries to allocate 4.12 GiB and OOMs
    during warmup": warmup_kernels' decode step verifies 910 requests x 8 rows, fp32, in one piece
    (0.33 chunks it at 2**30 bytes). The draft here is a dense Qwen3-0.6B, not DFlash's drafter."""
    from kvguard.producers.sim.profiles import EngineKnobs, profile_from_dict
    from kvguard.producers.sim.registry import apply_knobs

    d = EngineArgs(QWEN8, gpu="h100-80gb", gpu_memory_utilization=0.97, speculative_model_config=QWEN06,
                   num_speculative_tokens=7).profile_dict()
    with pytest.raises(ProfileError, match=r"Tried to allocate 4\.12 GiB"):
        profile_from_dict("pr48641", apply_knobs("pr48641", d, EngineKnobs(rejection_chunk_bytes=0)))
    assert profile_from_dict("chunked", d).memory.warmup_reqs == 910


# -- C4: another process on the GPU -----------------------------------------------------------------

C4_ARGS = EngineArgs(QWEN06, gpu="rtx4090", max_model_len=8192)
C4_TRAFFIC = dict(bench=bench(400, 1500, 300, 0.9, rate=4.0), prompt_logprobs_frac=0.05)


def test_a_neighbour_growing_after_start_up_takes_what_vllm_needs_next_and_blocks_its_restart():
    out = run_simulation("random", engine_args=C4_ARGS, neighbour=Neighbour.parse("0.2GiB:+2GiB/min"), **C4_TRAFFIC)
    assert causes(out) == {"allocator:neighbour": 1}
    oom = out["per_gpu"][0]["oom_log"][0]
    assert oom["neighbour_bytes"] > 1 * GiB
    assert out["startups_refused"] >= 1  # vLLM's free-memory check refuses the restart
    assert run_simulation("random", engine_args=C4_ARGS, **C4_TRAFFIC)["ooms"] == 0


def test_a_neighbour_present_at_start_up_meets_vllms_free_memory_check():
    from kvguard.producers.sim.registry import make_engine
    from kvguard.producers.sim.vllm.engine import VllmEngineConfig
    from kvguard.producers.sim.vllm.memory import StartupRefused

    profile = C4_ARGS.profile()
    with pytest.raises(StartupRefused, match=r"on startup is less than desired GPU memory utilization \(0\.92"):
        make_engine(profile, "n/gpu0", config=VllmEngineConfig(neighbour=Neighbour(2 * GiB)))
    small = make_engine(profile, "n/gpu0", config=VllmEngineConfig(neighbour=Neighbour(512 * MiB)))
    assert small.memory.neighbour_bytes == 512 * MiB  # fits outside vLLM's 0.92 share


# -- C7: memory that is never returned ----------------------------------------------------------------

def test_a_leak_ooms_with_its_cause_and_a_restart_heals_it():
    traffic = bench(900, 1500, 300, 0.9, rate=4.0)
    out = run_simulation("random", engine_args=C4_ARGS, leak=Leak.parse("8MiB/req"), **{"bench": traffic})
    assert set(causes(out)) == {"allocator:leak"} and out["ooms"] >= 2  # the same pattern again after a restart
    log = out["per_gpu"][0]["oom_log"]
    assert all(o["leaked_bytes"] > 1 * GiB for o in log)
    completed_between = [o["t_s"] for o in log]
    assert completed_between[1] - completed_between[0] > 60  # the 60 s restart, then it leaks again from zero
    assert run_simulation("random", engine_args=C4_ARGS, bench=traffic)["ooms"] == 0


def test_schedules_parse_and_bad_ones_say_what_they_expect():
    n = Neighbour.parse("2GiB:+3GiB/h")
    assert n.start_bytes == 2 * GiB and n.rate_bytes_per_s == pytest.approx(3 * GiB / 3600)
    assert n.bytes_at(3600) == pytest.approx(5 * GiB, abs=20 * MiB)
    assert Neighbour.parse("10GiB:-1GiB/min").bytes_at(60) == pytest.approx(9 * GiB, abs=20 * MiB)
    leak = Leak.parse("1GiB/h+4MiB/req")
    assert leak.bytes_per_s == pytest.approx(GiB / 3600) and leak.bytes_per_request == 4 * MiB
    assert Leak.parse("1MiB/step").bytes_per_step == MiB
    for bad in ("2GiB:fast", "lots", "1GiB/week"):
        with pytest.raises(ScheduleError):
            (Neighbour.parse if ":" in bad or bad == "lots" else Leak.parse)(bad)


def test_simulate_says_vllms_reason_when_a_neighbour_leaves_too_little_at_start_up():
    from typer.testing import CliRunner

    from kvguard.cli.app import app

    result = CliRunner().invoke(app, ["simulate", "--model-config", QWEN06, "--gpu", "rtx4090", "--max-model-len",
                                      "8192", "--workload", "mixed", "--duration", "30s", "--neighbour", "3GiB"])
    assert result.exit_code == 2
    assert "is less than desired GPU memory utilization" in " ".join(result.output.split())
