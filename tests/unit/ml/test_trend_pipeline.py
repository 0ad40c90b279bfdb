"""One short leak run end to end: it OOMs from the leak, the trend trees learn it, `kvguard eval`
scores them per target beside predict_linear, and refuses a bad --leak."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvguard.cli.app import app
from kvguard.ml.dataset import RunSpec, assemble, simulate_run
from kvguard.ml.trend_eval import train_trend_model
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.trend_model import save_trend_model


@pytest.fixture(scope="module")
def leak_ds():
    spec = RunSpec("sharegpt-sample", 0.25, "llama3-8b-24gb-vllm", seed=0, duration_s=900.0, leak="20GiB/h")
    record = simulate_run(spec)
    assert record.summary["ooms"] >= 1
    assert set(record.summary.get("ooms_by_cause", {"allocator:leak": 1})) <= {"allocator:leak"}
    # the same run under three workload names, one per split: the protocol's plumbing, not a held-out figure
    runs = [({"workload": w, "split": split, "key": f"{w}/{split}", "leak": spec.leak}, record.sequences)
            for w, split in (("a", "train"), ("b", "val"), ("c", "test"))]
    return assemble(list(FEATURE_NAMES), runs)


def test_the_leak_is_seen_growing_before_the_oom(leak_ds):
    seq = leak_ds.sequence(0)
    col = list(FEATURE_NAMES).index("util_activation")
    first = int(np.searchsorted(seq.ts_ns, seq.oom_ts_ns[0])) - 1
    assert seq.features[first, col] > seq.features[0, col] + 0.02  # the allocator layer sees it grow


def test_trend_trees_train_export_and_eval_per_target(leak_ds, tmp_path):
    model = train_trend_model(leak_ds, target="oom", seed=0)
    assert 0 < model.threshold < 1
    save_trend_model(model.trees, model.metadata, tmp_path / "m" / "oom_trees")
    leak_ds.save(tmp_path / "d")
    res = CliRunner().invoke(app, ["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.npz"),
                                   "--split", "test", "--bootstrap", "0", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for key in ("auc", "auc_ci", "recall_at_fpr_5pct", "lead_time_median_s", "bands", "baselines", "ooms"):
        assert key in out
    oom = out["targets"]["oom"]
    assert oom["shipped"]["ooms"] == leak_ds.summary()["test"]["ooms"]
    assert {"predict_linear_nonkv_reserved_5m", "predict_linear_u_kv_30m", "kalman_nonkv_reserved",
            "threshold", "slope"} <= set(oom)
    assert [b["band_s"] for b in oom["shipped"]["bands"]] == [[0.0, 30.0], [30.0, 120.0], [120.0, 300.0]]
    assert "false_alarms_per_gpu_hour" in oom["shipped"]


def test_eval_refuses_a_bad_leak_flag():
    res = CliRunner().invoke(app, ["eval", "--workload", "sharegpt-sample", "--profile", "llama3-8b-24gb-vllm",
                                   "--leak", "lots", "--duration", "60s", "--json"])
    assert res.exit_code == 2
    assert "--leak" in res.output
