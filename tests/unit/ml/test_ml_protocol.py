"""The prediction pipeline's protocol (issue 13): masked ticks (GPU down, right-censored), features
free of crash history and relative to the GPU, identical runs kept once, one prompt cap, a
threshold chosen without the held-out workload, and the evaluation's bands, event bootstrap,
cascade merging, false alarms per GPU-hour and baselines."""

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.contracts.units import NS_PER_S
from kvguard.ml import evaluation as ev
from kvguard.ml.dataset import (
    RunSpec,
    Sequence,
    TickDataset,
    assemble,
    build_dataset,
    run_fingerprint,
    synthetic_sequences,
)
from kvguard.producers.sim.profiles import prompt_cap_tokens
from kvguard.streams.metrics import FEATURE_NAMES, tick_features
from tests.unit.streams.test_alerts import tick

NAMES = ["u_kv", "f_ext"]
TICK_NS = 10 * NS_PER_S


def seq(n, ooms_s, ups_s=None, end_s=None, node="n0"):
    ts = np.arange(n, dtype=np.int64) * TICK_NS
    return Sequence(node=node, ts_ns=ts, features=np.zeros((n, len(NAMES)), np.float32),
                    oom_ts_ns=np.array(ooms_s, np.int64) * NS_PER_S,
                    oom_up_ts_ns=None if ups_s is None else np.array(ups_s, np.int64) * NS_PER_S,
                    end_ns=None if end_s is None else end_s * NS_PER_S)


# ---------------------------------------------------------------- masks


def test_ticks_while_the_gpu_restarts_are_masked_not_labelled():
    ds = assemble(NAMES, [({"workload": "a", "split": "train"}, [seq(100, [505, 800], ups_s=[565, 860])])])
    t_s = ds.ts_ns // NS_PER_S
    assert t_s[ds.down].tolist() == [510, 520, 530, 540, 550, 560, 810, 820, 830, 840, 850, 860]
    # the old dataset labelled them: the next OOM (800) is within 300 s of 510..560
    assert ds.labels[ds.down][:6].tolist() == [1] * 6
    assert not ds.scored[ds.down].any()
    assert ds.summary()["train"]["ticks"] == 100 - 12
    assert ds.summary()["masked_ticks"]["train"] == {"down": 12, "censored": 0}


def test_ticks_whose_horizon_runs_past_the_end_are_censored():
    ds = assemble(NAMES, [({"workload": "a", "split": "train"}, [seq(60, [], end_s=590)])])
    t_s = ds.ts_ns // NS_PER_S
    assert t_s[ds.censored].min() == 300  # 300 + 300 > 590; 290 + 300 = 590 is still observed
    assert ds.summary()["train"]["ticks"] == 30  # 0 .. 290 s


def test_masks_survive_save_and_load(tmp_path):
    ds = assemble(NAMES, [({"workload": "a", "split": "test"}, [seq(100, [505], ups_s=[565], end_s=990)])])
    ds.save(tmp_path / "d")
    back = TickDataset.load(tmp_path / "d.npz")
    np.testing.assert_array_equal(back.down, ds.down)
    np.testing.assert_array_equal(back.censored, ds.censored)
    assert back.down.any() and back.censored.any()


def test_training_puts_no_loss_on_masked_ticks():
    from kvguard.ml.training import _prepared
    from kvguard.streams.lstm import Normalisation

    ds = assemble(NAMES, [({"workload": "a", "split": "train"}, [seq(100, [505], ups_s=[565], end_s=990)])])
    norm = Normalisation.fit(ds.features)
    (x, y, _, _, real, _), = _prepared(ds, [0], norm, steps=3, window=5)
    np.testing.assert_array_equal(real[4:], ds.scored)  # 4 rows of left padding, then one per tick


def test_evaluation_ignores_scores_on_masked_ticks():
    ts = np.arange(100, dtype=np.int64) * TICK_NS
    ooms = np.array([505, 800]) * NS_PER_S
    labels = ev.labels_for_ticks(ts, ooms)
    down = ev.down_mask(ts, ooms, ooms + 60 * NS_PER_S)
    censored = ev.censored_mask(ts, int(ts[-1]))
    p = labels.astype(float)  # perfect on every tick that has a label ...
    p[down] = 1.0 - labels[down]  # ... and wrong on every down tick
    p[censored] = 1.0  # ... and on the censored ones, which the old protocol called negatives
    trace = ev.NodeTrace("n", ts, p, {"lstm": p > 0.5}, ooms, down=down, censored=censored)
    result = ev.evaluate_traces([trace], tiers=("lstm",), bootstrap_draws=0)
    assert result.auc == 1.0
    unmasked = ev.evaluate_traces([dataclasses.replace(trace, down=None, censored=None)], tiers=("lstm",),
                                  bootstrap_draws=0)
    assert unmasked.auc < 0.9
    assert result.to_dict()["masked_ticks"] == {"down": int(down.sum()), "censored": int((censored & ~down).sum())}


def test_false_alarms_exclude_masked_ticks_and_divide_by_scored_gpu_hours():
    ts = np.arange(360, dtype=np.int64) * TICK_NS
    oom = np.array([1005]) * NS_PER_S
    down = ev.down_mask(ts, oom, oom + 60 * NS_PER_S)
    fire = down.copy()  # the tier fires only while the GPU is down: never a warning, never an alarm
    trace = ev.NodeTrace("n", ts, fire.astype(float), {"t": fire}, oom, down=down)
    out = ev.evaluate_traces([trace], tiers=("t",), bootstrap_draws=0).to_dict()
    assert out["false_alarms_per_gpu_hour"]["t"] == 0.0 and out["alarm_episodes"]["t"] == 0
    assert out["lead_time_median_s"]["t"] == 0.0
    late = ev.NodeTrace("n", ts, fire.astype(float), {"t": ts >= 3000 * NS_PER_S}, oom, down=down)
    out = ev.evaluate_traces([late], tiers=("t",), bootstrap_draws=0).to_dict()
    scored_hours = (360 - down.sum()) * 10 / 3600
    assert out["false_alarms_per_gpu_hour"]["t"] == pytest.approx(1 / scored_hours, abs=1e-4)


# ---------------------------------------------------------------- features


def test_crash_history_is_not_a_feature():
    assert "since_oom_frac" not in FEATURE_NAMES and "ooms" not in FEATURE_NAMES
    calm = tick(0, u_kv=0.7)
    crashed = dataclasses.replace(calm, ooms=1, s_since_oom=12.0)
    np.testing.assert_array_equal(tick_features(calm), tick_features(crashed))


def test_features_read_a_gpu_k_times_larger_alike():
    small = dataclasses.replace(
        tick(0, u_kv=0.6, f_ext=0.2, psi=0.7), tick_s=10.0, dynamic_units=1000, live_units=600, free_units=300,
        cached_units=50, workspace_units=50, largest_free_run_units=100, tokens_stored=2400, tokens_per_s=800.0,
        decode_tokens_per_s=200.0, pages_per_request_p50=20.0, pages_per_request_p99=200.0, requests_running=8)
    k = 30
    big = dataclasses.replace(
        small, dynamic_units=1000 * k, live_units=600 * k, free_units=300 * k, cached_units=50 * k,
        workspace_units=50 * k, largest_free_run_units=100 * k, tokens_stored=2400 * k, tokens_per_s=800.0 * k,
        decode_tokens_per_s=200.0 * k, pages_per_request_p50=20.0 * k, pages_per_request_p99=200.0 * k)
    np.testing.assert_allclose(tick_features(small), tick_features(big), rtol=1e-6)
    f = tick_features(small)
    assert f[FEATURE_NAMES.index("token_turnover")] == pytest.approx(8000 / (8000 + 2400))
    assert f[FEATURE_NAMES.index("decode_token_frac")] == pytest.approx(0.25)


# ---------------------------------------------------------------- dataset building


def test_identical_runs_of_a_trace_workload_are_kept_once():
    specs = [RunSpec("azure-code", 0.4, seed=0, duration_s=240, split="train"),
             RunSpec("azure-code", 0.4, seed=1, duration_s=240, split="val")]
    ds = build_dataset(specs)
    assert len(ds.runs) == 1 and ds.runs[0]["seed"] == 0
    assert ds.duplicates == [{"key": specs[1].key(), "split": "val", "same_as": specs[0].key()}]
    assert ds.summary()["duplicate_runs"] == 1 and ds.summary()["val"]["runs"] == 0


def test_run_fingerprint_tells_runs_apart():
    a = synthetic_sequences(2, 100, NAMES, seed=0)
    b = synthetic_sequences(2, 100, NAMES, seed=0)
    assert run_fingerprint(a) == run_fingerprint(b)
    b[1].features[7, 0] += 1e-3
    assert run_fingerprint(a) != run_fingerprint(b)


def test_dataset_caps_prompts_as_simulate_does(monkeypatch):
    from kvguard.ml import dataset
    from kvguard.producers.sim.profiles import load_profile, profile_names

    for name in profile_names():
        profile = load_profile(name)
        want = None if profile.engine in ("vllm", "sglang") else min(profile.max_model_len - 1024,
                                                         int(profile.capacity_tokens * 0.6))
        assert prompt_cap_tokens(profile) == want, name
    seen = {}

    def fake_load_workload(name, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(dataset, "load_workload", fake_load_workload)
    with pytest.raises(RuntimeError, match="stop"):
        dataset.simulate_run(RunSpec("azure-code", profile="llama3-8b-24gb", duration_s=60))
    assert seen["max_prompt_tokens"] == prompt_cap_tokens(load_profile("llama3-8b-24gb")) == 27732


# ---------------------------------------------------------------- threshold calibration


def synthetic_dataset(test_shift=0.0):
    runs = []
    for i in range(6):
        split = "train" if i < 3 else ("val" if i < 5 else "test")
        seqs = synthetic_sequences(2, 300, NAMES, seed=i, oom_rate_per_hour=2.0)
        if split == "test":
            for s in seqs:
                s.features = s.features + test_shift
        runs.append(({"workload": "held-out" if split == "test" else "w", "split": split, "key": f"r{i}"}, seqs))
    return assemble(NAMES, runs)


def test_operating_threshold_is_chosen_without_the_held_out_runs():
    from kvguard.ml.training import TrainConfig, train

    config = TrainConfig(epochs=1, hidden_size=8, num_layers=1, traj_steps=3, threads=1)
    a = train(synthetic_dataset(), config).metadata
    b = train(synthetic_dataset(test_shift=5.0), config).metadata
    assert a.threshold == b.threshold
    assert a.metrics["held_out"]["auc_valid"] is not None
    calibration = a.metrics["threshold_calibration"]
    assert calibration["split"] == "val" and "held-out" not in calibration["workloads"]


# ---------------------------------------------------------------- evaluation protocol


def test_cascades_of_one_fleet_merge_into_one_event():
    t = np.array([0, 20, 50, 100, 1000, 30]) * NS_PER_S
    fleet = np.array(["f", "f", "f", "f", "f", "g"])
    ids = ev.merge_cascades(t, fleet, cascade_s=60)
    assert ids[0] == ids[1] == ids[2] == ids[3]  # each within 60 s of the previous: one wave
    assert len({ids[0], ids[4], ids[5]}) == 3


def test_weighted_auc_equals_auc_of_repeated_ticks():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = np.round(rng.random(200), 1) + 0.3 * y
    w = rng.integers(0, 4, 200)
    assert ev.weighted_auc(y, s, w) == pytest.approx(ev.auc(np.repeat(y, w), np.repeat(s, w)))


def fleet_traces(n_waves, seed=0):
    """Four GPUs behind one router; each wave crashes all four within 30 s, and the score rises
    only in the last 30 s before a GPU's crash."""
    rng = np.random.default_rng(seed)
    n = 360 * max(n_waves, 1)
    ts = np.arange(n, dtype=np.int64) * TICK_NS
    traces = []
    for g in range(4):
        ooms = (np.arange(n_waves) * 3600 + 1800 + 10 * g + 5) * NS_PER_S
        lead = ev.lead_to_next_oom_s(ts, ooms)
        p = np.where(lead <= 30, 0.9, 0.1) + 0.05 * rng.random(n)
        traces.append(ev.NodeTrace(f"gpu{g}", ts, p, {"lstm": p > 0.5}, ooms,
                                   down=ev.down_mask(ts, ooms, ooms + 60 * NS_PER_S), fleet="fleet"))
    return traces


def test_bands_separate_the_last_seconds_from_minutes_ahead():
    out = ev.evaluate_traces(fleet_traces(20), tiers=("lstm",), bootstrap_draws=50).to_dict()
    first, middle, last = out["bands"]
    assert [b["band_s"] for b in out["bands"]] == [[0.0, 30.0], [30.0, 120.0], [120.0, 300.0]]
    assert first["auc"] == 1.0 and first["recall_at_fpr_5pct"] == 1.0
    assert last["auc"] < 0.6 and last["recall_at_fpr_5pct"] < 0.2
    assert sum(b["positives"] for b in out["bands"]) == out["positive_ticks"]
    assert out["events"] == 20 and out["ooms"] == 80


def test_event_bootstrap_interval_widens_when_few_events_carry_the_result():
    few = ev.evaluate_traces(fleet_traces(3), tiers=("lstm",), bootstrap_draws=100)
    many = ev.evaluate_traces(fleet_traces(15), tiers=("lstm",), bootstrap_draws=100)
    assert few.events == 3 and many.events == 15
    for r in (few, many):
        low, high = r.auc_ci
        assert low <= r.auc <= high
    assert (few.auc_ci[1] - few.auc_ci[0]) > (many.auc_ci[1] - many.auc_ci[0])


def test_one_event_gives_no_interval():
    y = np.r_[np.zeros(50), np.ones(40)].astype(bool)
    clusters = np.r_[np.arange(50) // 10 + 1, np.zeros(40, int)]
    assert ev.bootstrap_auc_ci(y, np.r_[np.zeros(50), np.ones(40)], clusters) is None


def test_eval_json_has_bands_intervals_events_and_every_baseline(tmp_path):
    from kvguard.cli import app
    from kvguard.ml.training import TrainConfig, train
    from kvguard.streams.lstm import save_model

    names = list(FEATURE_NAMES)
    runs = [({"workload": ("w", "w", "w", "w", "held-out", "held-out-2")[i],
              "split": ("train", "train", "train", "val", "test", "test")[i], "key": f"r{i}"},
             synthetic_sequences(2, 360, names, seed=i, oom_rate_per_hour=3.0)) for i in range(6)]
    ds = assemble(names, runs)
    ds.save(tmp_path / "d")
    result = train(ds, TrainConfig(epochs=1, hidden_size=8, num_layers=1, traj_steps=3, threads=1))
    save_model(result.net, result.metadata, tmp_path / "m")
    cli = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.npz"),
                                   "--bootstrap", "20", "--report", str(tmp_path / "report"), "--json"])
    assert cli.exit_code == 0, cli.output
    out = json.loads(cli.stdout.strip().splitlines()[-1])
    assert [b["band_s"] for b in out["bands"]] == [[0.0, 30.0], [30.0, 120.0], [120.0, 300.0]]
    assert {"auc", "recall_at_fpr_5pct", "positives"} <= set(out["bands"][0])
    assert out["events"] >= 1 and "false_alarms_per_gpu_hour" in out and "auc_ci" in out
    assert {"threshold", "slope", "logistic", "boosting", "lstm"} <= set(out["baselines"])
    for row in (out["baselines"][k] for k in ("threshold", "slope", "logistic", "boosting", "lstm")):
        assert {"auc", "recall_at_fpr_5pct", "lead_time_median_s"} <= set(row)
    assert out["baselines"]["logistic"]["auc"] > 0.7  # the synthetic signal is in u_kv, one tick
    assert sorted(out["by_workload"]) == ["held-out", "held-out-2"]
    assert out["by_workload"]["held-out"]["lstm"]["auc"] != out["by_workload"]["held-out-2"]["lstm"]["auc"]
    lines = (tmp_path / "report" / "bands.md").read_text().splitlines()
    start = lines.index(next(x for x in lines if x.startswith("| model")))
    table = lines[start:lines.index("", start)]
    assert "0-30 s" in table[0] and [row.split(" | ")[0] for row in table[2:]] == [
        "| threshold", "| slope", "| logistic", "| boosting", "| lstm"]


def test_leave_one_workload_out_never_fits_on_the_workload_it_scores():
    from kvguard.ml.baselines import fold, leave_one_workload_out

    runs = [({"workload": w, "split": sp, "key": f"{w}{i}"}, synthetic_sequences(1, 300, NAMES, seed=10 * j + i))
            for j, w in enumerate(("a", "b", "c")) for i, sp in enumerate(("train", "val", "test"))]
    ds = assemble(NAMES, runs)
    f = fold(ds, "b")
    assert f.summary()["test"]["workloads"] == ["b"] and f.summary()["test"]["runs"] == 3
    assert "b" not in f.summary()["train"]["workloads"] + f.summary()["val"]["workloads"]
    out = leave_one_workload_out(ds, horizon_s=300.0, bootstrap_draws=0)
    assert sorted(out) == ["a", "b", "c"]
    assert {"threshold", "slope", "logistic", "boosting"} <= set(out["a"])
    assert out["a"]["ooms"] == sum(len(s.oom_ts_ns) for (info, seqs) in runs if info["workload"] == "a"
                                   for s in seqs)
