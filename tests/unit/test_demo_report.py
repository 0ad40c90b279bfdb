"""The demo's report stays readable at fleet scale: heatmaps past SMALL_FLEET GPUs, lines below (issue 16)."""

from __future__ import annotations

import json

import pytest

from kvguard.ops import demo_report
from kvguard.runtime.embedded import RunResult


def run(label: str, gpus: int, oom_every: int) -> RunResult:
    series, ooms = {}, {}
    for g in range(gpus):
        node = f"sim-0/gpu{g}"
        series[node] = [(t * 10.0, min(1.0, 0.3 + 0.001 * t * (g % 7)), 0.1, 0.5, 0.01 * (t % 50)) for t in range(60)]
        if g % oom_every == 0:
            ooms[node] = [300.0]
    return RunResult(label, {"gpus": gpus, "ooms": len(ooms)}, series=series, oom_times=ooms)


@pytest.mark.parametrize("gpus", [4, 100])
def test_the_report_draws_every_gpu_at_any_fleet_size(tmp_path, monkeypatch, gpus):
    drawn = []
    real_heatmaps = demo_report._heatmaps
    monkeypatch.setattr(demo_report, "_heatmaps", lambda *a: (drawn.append("heatmap"), real_heatmaps(*a)))
    baseline, guarded = run("baseline", gpus, 3), run("guarded", gpus, 50)
    result = {"baseline": baseline.summary, "guarded": guarded.summary, "workload": {"name": "mixed"},
              "arms": {"baseline": {"ooms": 1, "config": "x"}, "kvguard": {"ooms": 0, "config": "y"}}}
    out = demo_report.write_report(tmp_path / "r", result, baseline, guarded)
    assert (out / "timeline.png").stat().st_size > 10_000 and (out / "outcomes.png").exists()
    assert drawn == (["heatmap"] if gpus > demo_report.SMALL_FLEET else [])
    assert json.loads((out / "summary.json").read_text())["arms"]["kvguard"]["ooms"] == 0
    assert "## Arms" in (out / "report.md").read_text()
