"""The dataset preset on the vLLM-faithful default engine (issue 13: retrained on the new node side)."""

from __future__ import annotations

from kvguard.ml.dataset import HELD_OUT_WORKLOADS, VLLM, RunSpec, preset_vllm, simulate_run


def test_the_vllm_preset_keeps_the_held_out_workloads_out_of_training_and_validation():
    specs = preset_vllm()
    assert {s.profile for s in specs} == {VLLM}
    assert {s.workload for s in specs if s.split == "test"} == set(HELD_OUT_WORKLOADS)
    assert not {s.workload for s in specs if s.split in ("train", "val")} & set(HELD_OUT_WORKLOADS)
    assert len({s.key() for s in specs}) == len(specs)  # every run is a different one
    assert all(s.prompt_logprobs_frac > 0 for s in specs)


def test_a_vllm_run_with_the_operators_knobs_has_allocator_ooms_and_masks_the_restart():
    spec = RunSpec("mixed", rate_scale=2.25, profile=VLLM, seed=0, duration_s=240.0, n_gpus=1,
                   gpu_memory_utilization=0.95, prompt_logprobs_frac=0.05)
    calm = RunSpec("mixed", rate_scale=2.25, profile=VLLM, seed=0, duration_s=240.0, n_gpus=1,
                   prompt_logprobs_frac=0.05)  # vLLM's 0.9 leaves room for the same traffic
    run, quiet = simulate_run(spec), simulate_run(calm)
    assert run.spec.key() != quiet.spec.key()
    assert sum(len(s.oom_ts_ns) for s in run.sequences) > 0
    assert sum(len(s.oom_ts_ns) for s in quiet.sequences) == 0
    assert run.sequences[0].features.shape[1] == quiet.sequences[0].features.shape[1]
    seq = run.sequences[0]
    assert (seq.up_times() - seq.oom_ts_ns >= 60 * 10**9).all()  # the 60 s restart: those ticks are masked
    down, _ = seq.masks()
    assert down.any()
