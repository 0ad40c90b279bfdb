"""The TREND failure classes as data: slow growth (C7), a neighbour growing on the GPU (C4) and a
KV-demand storm from a ramping arrival rate (C6), from ``/work/shared/notes/oom-classes.md``.

A TREND run is a ``kvguard.ml.dataset.RunSpec`` with ``leak`` (``--leak`` text, ``sim.vllm.external.Leak``),
``neighbour`` (``--neighbour`` SIZE[:RATE], ``sim.vllm.external.Neighbour``) or ``ramp`` (the arrival
rate rises linearly from the workload's to ``ramp`` times it by the end of the run) on the
vLLM-faithful engine. These are the failures a telemetry trend can see coming: the bytes
outside vLLM's budget grow at a rate, unlike the STEP class (one request's logits) that the
governor prevents instead.

Presets split runs by workload *and* seed: the test runs' workloads (azure-conv, mooncake-sample)
and seeds (7, 8) are in neither the train nor the val runs, and val (which calibrates thresholds)
shares neither with test. Each GPU leaks or is crowded at its own rate in a run only through
the router's load; growth rates vary across runs so a model cannot learn one time-to-OOM.

Pure: numpy and the standard library (workloads come from ``producers.sim.workloads``).
"""

from __future__ import annotations

import math

from kvguard.producers.sim.workloads import Request, Workload, load_workload

VLLM_PROFILE = "llama3-8b-24gb-vllm"


def ramp_time(u_s: float, ramp: float, duration_s: float) -> float:
    """Where base-time ``u_s`` lands when the rate rises linearly from 1x (t = 0) to ``ramp`` x at
    ``duration_s``: the inverse of the cumulative rate Λ(t) = t + (ramp − 1) t² / (2 T)."""
    if ramp == 1.0:
        return u_s
    a = (ramp - 1.0) / (2.0 * duration_s)
    return (-1.0 + math.sqrt(max(0.0, 1.0 + 4.0 * a * u_s))) / (2.0 * a)


def trend_workload(spec, *, max_prompt_tokens: int | None = None) -> Workload:
    """The run's workload; with ``spec.ramp`` != 1 the arrivals of Λ(T) base seconds are warped into
    ``spec.duration_s`` so the instantaneous rate ends at ``ramp`` times the start's."""
    if spec.ramp == 1.0:
        return load_workload(spec.workload, rate_scale=spec.rate_scale, window=spec.duration_s, seed=spec.seed,
                             max_prompt_tokens=max_prompt_tokens)
    if not spec.ramp > 0:
        raise ValueError(f"ramp: expected a rate multiplier > 0, got {spec.ramp}")
    base_window = spec.duration_s * (1.0 + spec.ramp) / 2.0
    wl = load_workload(spec.workload, rate_scale=spec.rate_scale, window=base_window, seed=spec.seed,
                       max_prompt_tokens=max_prompt_tokens)
    out = [Request(r.req_id, int(ramp_time(r.arrival_ns / 1e9, spec.ramp, spec.duration_s) * 1e9),
                   r.prompt_tokens, r.max_output_tokens, r.priority, r.block_hashes) for r in wl.requests]
    return Workload(wl.name, out, list(wl.notes) + [f"arrival rate ramped 1x -> {spec.ramp:g}x over "
                                                    f"{spec.duration_s:g} s"])


def external_config(spec) -> dict:
    """The vLLM engine config's ``leak``/``neighbour`` for the run (``{}`` when it has neither)."""
    # the vLLM engine's schedules, only for runs that have one
    from kvguard.producers.sim.vllm.external import Leak, Neighbour

    out = {}
    if spec.leak:
        out["leak"] = Leak.parse(spec.leak)
    if spec.neighbour:
        out["neighbour"] = Neighbour.parse(spec.neighbour)
    return out


# -- presets: (workload, rate scale per GPU, seeds, leak, neighbour, ramp) -------------------------------
# Rates are ~a quarter of the vLLM preset's 4-GPU rates (a calm, loaded GPU). Leak rates put the first
# growth OOM 15-45 simulated minutes in; neighbours start at 1 GiB and grow 3-8 GiB/h; ramps end at 3-8x.
# Calm runs (no growth, no ramp) are what the false alarms per GPU-hour are counted on.
TRAIN_WORKLOADS = {"sharegpt-sample": 0.25, "mixed": 0.45, "sessions": 0.4, "azure-code": 0.3}
VAL_WORKLOADS = {"rag": 0.5}
TEST_WORKLOADS = {"azure-conv": 0.3, "mooncake-sample": 0.0125}
POISSON_WORKLOADS = ("sharegpt-sample", "mixed", "sessions", "rag")
TRAIN_SEEDS, VAL_SEEDS, TEST_SEEDS = (0, 1), (3,), (7,)
LEAKS = ("4GiB/h", "6GiB/h", "9GiB/h", "2MiB/req")
NEIGHBOURS = ("1GiB:+4GiB/h", "1GiB:+8GiB/h")
RAMPS = (4.0, 8.0)


def _runs(workloads: dict, seeds: tuple, split: str, duration_s: float, leaks=LEAKS, neighbours=NEIGHBOURS,
          ramps=RAMPS, calm: int = 1) -> list:
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.dataset import RunSpec

    out = []
    for w, rate in workloads.items():
        # a trace workload replays the same arrivals for every seed (dataset.build_dataset drops the copy)
        for s in (seeds if w in POISSON_WORKLOADS else seeds[:1]):
            base = dict(workload=w, rate_scale=rate, profile=VLLM_PROFILE, seed=s, duration_s=duration_s,
                        n_gpus=1, split=split)
            out += [RunSpec(**base, leak=x) for x in leaks]
            out += [RunSpec(**base, neighbour=x) for x in neighbours]
            out += [RunSpec(**base, ramp=x) for x in ramps]
            out += [RunSpec(**dict(base, rate_scale=rate * (1 + 0.3 * k))) for k in range(calm)]
    return out


def preset_trend(duration_s: float = 2700.0) -> list:
    """TREND runs of the vLLM-faithful engine: train on 4 workloads x 2 seeds, calibrate on another
    workload and seed, test on two held-out workloads at a held-out seed."""
    return (_runs(TRAIN_WORKLOADS, TRAIN_SEEDS, "train", duration_s)
            + _runs(VAL_WORKLOADS, VAL_SEEDS, "val", duration_s, calm=2)
            + _runs(TEST_WORKLOADS, TEST_SEEDS, "test", duration_s, calm=2))


def preset_trend_tiny() -> list:
    """Seconds of work: one leak run per split (tests)."""
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.dataset import RunSpec

    return [RunSpec("sharegpt-sample", 0.25, VLLM_PROFILE, 0, 1200.0, split="train", leak="12GiB/h"),
            RunSpec("rag", 0.5, VLLM_PROFILE, 3, 1200.0, split="val", leak="12GiB/h"),
            RunSpec("azure-conv", 0.3, VLLM_PROFILE, 7, 1200.0, split="test", leak="12GiB/h")]


# -- preemption storms (C6) ------------------------------------------------------------------------------
# A storm is a stretch where the GPU preempts at >= STORM_PER_MIN per minute over a trailing minute.
# Why that rate: SGLang's tuning docs call about one retraction a minute "okay"; inference-sim#963's
# instrumented vLLM (7.4 % of 19,801 requests preempted, 98.5 % of preempting steps with one) is the
# healthy pattern, whose rate per GPU stays in single digits a minute; vllm PR#37307's collapse
# (throughput 100 -> 1.5 tok/s) is a recompute loop, tens a minute. Ten a minute sustained is an order
# of magnitude above the "okay" rate: requests are recomputed faster than they finish. Storms closer
# than STORM_MERGE_S are one (a storm flickering around the threshold is one event, as an OOM cascade is).
STORM_PER_MIN = 10.0
STORM_WINDOW_S = 60.0
STORM_MERGE_S = 300.0


def storm_episodes(ts_ns, preemptions, *, per_min: float = STORM_PER_MIN, window_s: float = STORM_WINDOW_S,
                   merge_s: float = STORM_MERGE_S, tick_s: float = 10.0):
    """(onset_ns, end_ns) arrays of one node's storms from its per-tick preemption counts: onset is the
    first tick whose trailing ``window_s`` count reaches ``per_min`` x ``window_s`` / 60, end the first
    tick after it below that again; episodes closer than ``merge_s`` are merged."""
    # only this path needs it (keeps the module light to import)
    import numpy as np

    ts = np.asarray(ts_ns, dtype=np.int64)
    p = np.asarray(preemptions, dtype=np.float64)
    k = max(1, int(round(window_s / tick_s)))
    c = np.cumsum(np.r_[0.0, p])
    trailing = c[1:] - c[np.maximum(0, np.arange(1, len(p) + 1) - k)]
    hot = trailing >= per_min * window_s / 60.0
    onsets, ends = [], []
    i = 0
    while i < len(hot):
        if not hot[i]:
            i += 1
            continue
        j = i
        while j < len(hot) and hot[j]:
            j += 1
        start, end = int(ts[i]), int(ts[j]) if j < len(ts) else int(ts[-1]) + int(tick_s * 1e9)
        if onsets and start - ends[-1] < merge_s * 1e9:
            ends[-1] = end
        else:
            onsets.append(start)
            ends.append(end)
        i = j
    return np.asarray(onsets, np.int64), np.asarray(ends, np.int64)


def storm_dataset(ds, *, per_min: float = STORM_PER_MIN):
    """The dataset with each sequence's events replaced by its preemption storms: label = a storm
    begins within the horizon; ticks inside a storm are masked (down), as a GPU down after an OOM.
    The preemption count per tick is read back from ``log_preemptions`` (log1p of the count)."""
    # only this path needs it (keeps the module light to import)
    import numpy as np

    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.dataset import Sequence, assemble

    col = ds.feature_names.index("log_preemptions")
    runs: dict[int, list] = {}
    for s in range(ds.n_sequences):
        seq = ds.sequence(s)
        pre = np.rint(np.expm1(seq.features[:, col].astype(np.float64)))
        on, end = storm_episodes(seq.ts_ns, pre, per_min=per_min, tick_s=ds.tick_s)
        runs.setdefault(int(ds.seq_run[s]), []).append(
            Sequence(node=seq.node, ts_ns=seq.ts_ns, features=seq.features, oom_ts_ns=on - 1, oom_up_ts_ns=end,
                     end_ns=seq.end_ns, firing=seq.firing))
    kept = [(dict(ds.runs[r], target="storm"), seqs) for r, seqs in sorted(runs.items())]
    return assemble(ds.feature_names, kept, horizon_s=ds.horizon_s, tick_s=ds.tick_s, inputs=ds.inputs,
                    duplicates=ds.duplicates)
