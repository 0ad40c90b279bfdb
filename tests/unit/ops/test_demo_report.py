"""The demo's report stays readable at fleet scale: heatmaps past SMALL_FLEET GPUs, lines below (issue 16)."""

from __future__ import annotations

import json

import pytest

from kvguard.ops import demo_report
from kvguard.runtime.embedded import RunResult


def run(label: str, gpus: int, oom_every: int, command_every: int = 0) -> RunResult:
    series, ooms, commands = {}, {}, {}
    for g in range(gpus):
        node = f"sim-0/gpu{g}"
        series[node] = [(t * 10.0, min(1.0, 0.3 + 0.001 * t * (g % 7)), 0.1, 0.5, 0.01 * (t % 50)) for t in range(60)]
        if g % oom_every == 0:
            ooms[node] = [300.0]
        if command_every and g % command_every == 0:
            commands[node] = [(200.0, "evict"), (250.0, "batch_cap")]
    return RunResult(label, {"gpus": gpus, "ooms": len(ooms)}, series=series, oom_times=ooms, commands=commands)


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


@pytest.mark.parametrize("gpus", [4, 100])
def test_every_executed_command_is_marked_on_its_gpu(tmp_path, monkeypatch, gpus):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    marks = []
    real_plot, real_scatter = Axes.plot, Axes.scatter

    def plot(self, *args, **kwargs):
        if len(args) >= 3 and args[2] == "k|":
            marks.extend(args[0])
        return real_plot(self, *args, **kwargs)

    def scatter(self, x, y, *args, **kwargs):
        if kwargs.get("marker") == "|":
            marks.extend(x)
        return real_scatter(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    monkeypatch.setattr(Axes, "scatter", scatter)
    baseline, guarded = run("baseline", gpus, 3), run("guarded", gpus, 50, command_every=2)
    result = {"baseline": baseline.summary, "guarded": guarded.summary, "workload": {"name": "mixed"}}
    demo_report.write_report(tmp_path / "r", result, baseline, guarded)
    sent = sum(len(v) for v in guarded.commands.values())
    # line plots mark commands on the U_kv row; heatmaps on each of their rows (U_kv and P(OOM))
    rows = 1 if gpus <= demo_report.SMALL_FLEET else 2
    assert len(marks) == sent * rows
    assert sorted(set(marks)) == [200.0 / 60, 250.0 / 60]


def uniform_block_run(label: str, gpus: int = 2) -> RunResult:
    """A vLLM-like run: the KV layer's F_ext is 0 by construction, the caching allocator's is not."""
    series = {f"sim-0/gpu{g}": [(t * 10.0, 0.5, 0.0, 0.55, None, 0.75 + 0.01 * g, (512 + g) << 20, 1 << 30)
                                for t in range(30)] for g in range(gpus)}
    return RunResult(label, {"gpus": gpus, "ooms": 0}, series=series)


def drawn_rows(tmp_path, monkeypatch, baseline, guarded) -> dict[str, set[float]]:
    """Each timeline row's y label and the values drawn on it (first column: the baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    values: dict[int, set[float]] = {}
    labels: dict[int, str] = {}
    real_plot, real_label = Axes.plot, Axes.set_ylabel

    def plot(self, *args, **kwargs):
        if len(args) == 2 and kwargs.get("label"):
            values.setdefault(id(self), set()).update(args[1])
        return real_plot(self, *args, **kwargs)

    def set_ylabel(self, label, *args, **kwargs):
        labels[id(self)] = label
        return real_label(self, label, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    monkeypatch.setattr(Axes, "set_ylabel", set_ylabel)
    result = {"baseline": baseline.summary, "guarded": guarded.summary, "workload": {"name": "mixed"}}
    demo_report.write_report(tmp_path / "r", result, baseline, guarded)
    return {labels[k]: values.get(k, set()) for k in labels}


def test_on_uniform_blocks_the_timeline_draws_the_caching_allocators_fragmentation_labelled(tmp_path, monkeypatch):
    rows = drawn_rows(tmp_path, monkeypatch, uniform_block_run("baseline"), uniform_block_run("guarded"))
    f_ext = [label for label in rows if label.startswith("F_ext")]
    assert len(f_ext) == 1 and "caching allocator" in f_ext[0] and "uniform blocks" in f_ext[0]
    assert rows[f_ext[0]] == {0.75, 0.76}  # the allocator's F_ext, not the KV layer's flat 0
    unallocated = [label for label in rows if "unallocated" in label]
    assert len(unallocated) == 1 and "GiB" in unallocated[0]
    assert rows[unallocated[0]] == {512 / 1024, 513 / 1024}


def test_where_the_kv_layer_fragments_the_timeline_draws_its_f_ext(tmp_path, monkeypatch):
    rows = drawn_rows(tmp_path, monkeypatch, run("baseline", 2, 3), run("guarded", 2, 3))
    assert rows["F_ext (KV layer)"] == {0.1}
    assert not any("allocator" in label for label in rows)
    assert [r.label for r in demo_report.timeline_rows(run("b", 2, 3))] == ["U_kv", "F_ext (KV layer)", "Ψ"]


def test_the_steps_the_governor_shrank_are_marked_on_the_timeline(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    marks = []
    real_plot = Axes.plot

    def plot(self, *args, **kwargs):
        if len(args) >= 3 and args[2] == "g^":
            marks.extend(args[0])
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    baseline, guarded = run("baseline", 2, 3), run("guarded", 2, 50)
    guarded.governed = {"sim-0/gpu1": [60.0, 120.0, 180.0]}
    result = {"baseline": baseline.summary, "guarded": guarded.summary, "workload": {"name": "mixed"},
              "arms": {"baseline": {"ooms": 1, "config": "x"}, "kvguard": {"ooms": 0, "config": "y"}}}
    demo_report.write_report(tmp_path / "r", result, baseline, guarded)
    assert sorted(marks) == [1.0, 2.0, 3.0]  # minutes
