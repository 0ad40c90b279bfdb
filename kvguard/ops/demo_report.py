"""The demo's report on disk: the comparison as JSON and Markdown, and plots.

``write_report(directory, result, baseline, guarded)`` writes

* ``summary.json`` — what ``kvguard demo --json`` prints;
* ``report.md`` — the comparison table, the headline ratios, the workload and what kvguard did;
* ``timeline.png`` — U_kv, F_ext and Ψ per GPU over time, baseline left, closed loop right, with
  every OOM (red x) and every executed command (black |) marked and the tiers' thresholds drawn.
  F_ext is the layer's that fragments (``timeline_rows``): on uniform-block engines (vLLM) the KV
  layer's is 0 by construction, so where the node reports a caching-allocator layer and the KV
  layer's F_ext is 0 throughout, the row draws the allocator's F_ext, and a row below Ψ its
  reserved-but-unallocated bytes, each labelled as such;
  past ``SMALL_FLEET`` GPUs, where lines would be unreadable, heatmaps instead (one row per GPU:
  U_kv, and P(OOM) when the run has a predictor; OOMs and commands marked on each GPU's row, the
  colour bar marks the critical U_kv line);
* ``outcomes.png`` — OOMs, preemptions, goodput and TTFT p99 side by side.

matplotlib is imported inside the function (Agg backend), never at import time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvguard.contracts.tiers import AlertThresholds
from kvguard.contracts.units import NS_PER_S
from kvguard.policy.strategy import Strategy

# the caching allocator's fields of a series point (kvguard.runtime.embedded.SERIES_FIELDS)
ALLOC_F_EXT, ALLOC_UNALLOCATED, ALLOC_RESERVED = 5, 6, 7
SMALL_FLEET = 8  # more GPUs than this: heatmaps, not one line per GPU
U_KV_CRITICAL = AlertThresholds().u_kv_critical  # the threshold tier's line, marked on the colour bar
F_EXT_TRIGGER = Strategy.__dataclass_fields__["f_ext_trigger"].default  # the policy's fragmentation trigger
TABLE_KEYS = ("requests", "completed", "failed", "rejected", "unfinished", "ooms", "preemptions", "ttft_p50_s",
              "ttft_p99_s", "tpot_p99_s", "goodput_tokens_per_s", "downtime_s")


def write_report(directory: str | Path, result: dict, baseline: Any, guarded: Any) -> Path:
    """Write summary.json, report.md and the plots into ``directory``; returns its absolute path."""
    out = Path(directory).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    _timeline(out / "timeline.png", baseline, guarded)
    _outcomes(out / "outcomes.png", result)
    (out / "report.md").write_text(_markdown(result))
    return out


@dataclass(slots=True, frozen=True)
class TimelineRow:
    label: str
    index: int  # of the series point (``SERIES_FIELDS``)
    line: float | None = None  # a threshold drawn across the row
    scale: float = 1.0  # the values are divided by this (bytes to GiB)
    style: str = ":"  # of the threshold line


def _reports_allocator(runs: tuple[Any, ...]) -> bool:
    points = (p for run in runs for pts in run.series.values() for p in pts)
    return any(len(p) > ALLOC_RESERVED and p[ALLOC_RESERVED] for p in points)


def timeline_rows(*runs: Any) -> list[TimelineRow]:
    """The timeline's rows for these runs: U_kv, F_ext of the layer that fragments, Ψ, and (when the
    nodes report a caching-allocator layer) its reserved-but-unallocated bytes. The KV layer's F_ext
    when it is ever above 0; else, with an allocator layer (a uniform-block engine: the KV layer's is 0
    by construction), the caching allocator's."""
    allocator = _reports_allocator(runs)
    kv_flat = all(not p[2] for run in runs for pts in run.series.values() for p in pts)
    if allocator and kv_flat:
        f_ext = TimelineRow("F_ext (caching allocator;\nKV layer 0: uniform blocks)", ALLOC_F_EXT, F_EXT_TRIGGER)
    else:
        f_ext = TimelineRow("F_ext (KV layer)", 2, F_EXT_TRIGGER)
    rows = [TimelineRow("U_kv", 1, U_KV_CRITICAL), f_ext, TimelineRow("Ψ", 3, 1.0, style="--")]
    if allocator:
        rows.append(TimelineRow("allocator reserved,\nunallocated (GiB)", ALLOC_UNALLOCATED, None, float(1 << 30)))
    return rows


def _timeline(path: Path, baseline: Any, guarded: Any) -> None:
    # matplotlib takes a second to import: only when a report is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if max(len(baseline.series), len(guarded.series)) > SMALL_FLEET:
        _heatmaps(plt, path, baseline, guarded)
        return
    rows = timeline_rows(baseline, guarded)
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 2.7 * len(rows)), sharex=True, squeeze=False)
    for col, run in enumerate((baseline, guarded)):
        for row, spec in enumerate(rows):
            ax = axes[row][col]
            for node, points in sorted(run.series.items()):
                ts = [p[0] / 60 for p in points]
                ax.plot(ts, [(p[spec.index] if len(p) > spec.index else 0) / spec.scale for p in points], lw=0.8,
                        label=node.split("/")[-1])
                ooms = run.oom_times.get(node, [])
                if ooms and row == 0:
                    ax.plot([t / 60 for t in ooms], [1.02] * len(ooms), "rx", ms=6)
                commands = _commands(run, node)
                if commands and row == 0:
                    ax.plot([t / 60 for t, _ in commands], [-0.02] * len(commands), "k|", ms=7)
                governed = getattr(run, "governed", {}).get(node, [])
                if governed and row == 0:  # steps the step governor shrank to fit the allocator
                    ax.plot([t / 60 for t in governed], [-0.06] * len(governed), "g^", ms=3)
            if row == 0:
                total = sum(len(v) for v in run.oom_times.values())
                sent = sum(len(v) for v in _all_commands(run))
                shrunk = sum(len(v) for v in getattr(run, "governed", {}).values())
                ax.set_title(f"{'baseline engine' if col == 0 else 'kvguard closed loop'} "
                             f"({total} ticks with an OOM, x; {sent} commands, |"
                             + (f"; {shrunk} steps shrunk, ^" if shrunk else "") + ")", fontsize=10)
                ax.axhline(spec.line, color="red", lw=0.6, ls=":")
            elif spec.line is not None:
                ax.axhline(spec.line, color="grey", lw=0.6, ls=spec.style)
            ax.set_ylabel(spec.label, **({"fontsize": 8} if "\n" in spec.label else {}))
            ax.grid(alpha=0.3)
        axes[-1][col].set_xlabel("simulated minutes")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _heatmaps(plt, path: Path, baseline: Any, guarded: Any) -> None:
    runs = (("baseline engine", baseline), ("kvguard closed loop", guarded))
    with_p = any(p[4] is not None for _, run in runs for pts in run.series.values() for p in pts)
    rows = [("U_kv", 1)] + ([("P(OOM in 5 min)", 4)] if with_p else [])
    nodes = sorted(set(baseline.series) | set(guarded.series))
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 2.5 + 0.05 * len(nodes) * len(rows)), squeeze=False)
    for col, (title, run) in enumerate(runs):
        times = sorted({p[0] for pts in run.series.values() for p in pts})
        index = {t: i for i, t in enumerate(times)}
        for row, (label, k) in enumerate(rows):
            ax = axes[row][col]
            grid = np.full((len(nodes), max(1, len(times))), np.nan)
            for r, node in enumerate(nodes):
                for p in run.series.get(node, []):
                    if p[k] is not None:
                        grid[r, index[p[0]]] = p[k]
            end = (times[-1] if times else 1.0) / 60
            image = ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0.0, vmax=1.0, cmap="viridis",
                              extent=(0.0, end, len(nodes) - 0.5, -0.5))
            bar = fig.colorbar(image, ax=ax, fraction=0.03)
            if k == 1:
                bar.ax.axhline(U_KV_CRITICAL, color="white", lw=1.5)
            for r, node in enumerate(nodes):
                ooms = run.oom_times.get(node, [])
                if ooms:
                    ax.scatter([t / 60 for t in ooms], [r] * len(ooms), marker="x", color="red", s=12, zorder=3)
                commands = _commands(run, node)
                if commands:
                    ax.scatter([t / 60 for t, _ in commands], [r] * len(commands), marker="|", color="white",
                               s=10, lw=0.6, zorder=2)
            total = sum(len(v) for v in run.oom_times.values())
            sent = sum(len(v) for v in _all_commands(run))
            ax.set_title(f"{title}: {label} per GPU ({total} ticks with an OOM, red x; {sent} commands, white |)",
                         fontsize=9)
            ax.set_ylabel(f"{len(nodes)} GPUs")
            ax.set_yticks([])
        axes[-1][col].set_xlabel("simulated minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commands(run: Any, node: str) -> list[tuple[float, str]]:
    return getattr(run, "commands", {}).get(node, [])


def _all_commands(run: Any):
    return getattr(run, "commands", {}).values()


def _outcomes(path: Path, result: dict) -> None:
    # matplotlib takes a second to import: only when a report is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result.get("arms") or {"baseline": result["baseline"], "kvguard": result["guarded"]}
    keys = (("ooms", "OOM crashes"), ("preemptions", "preemptions"), ("slo_attainment", "SLO attainment"),
            ("goodput_tokens_per_s", "goodput (tok/s)"), ("ttft_p99_s", "TTFT p99, served (s)"))
    palette = {"vllm_default": "#8c8c8c", "tuned_static": "#55a868", "baseline": "#c44e52", "kvguard": "#4c72b0"}
    fig, axes = plt.subplots(1, len(keys), figsize=(3.0 * len(keys), 3.4))
    for ax, (key, label) in zip(axes, keys):
        values = [arm.get(key) or 0 for arm in arms.values()]
        bars = ax.bar(list(arms), values, color=[palette.get(n, "#999999") for n in arms])
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" for v in bars.datavalues], fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(result: dict) -> str:
    b, g = result["baseline"], result["guarded"]
    wl = result.get("workload", {})
    lines = [
        "# kvguard demo report",
        "",
        f"Workload `{wl.get('name')}` ×{wl.get('rate_scale')} for {wl.get('duration_s', 0) / 60:.0f} simulated "
        f"minutes ({wl.get('requests')} requests, seed {wl.get('seed')}) on {b.get('gpus')} × "
        f"`{result.get('profile')}`, {result.get('mode', 'embedded')} mode.",
        "",
        "| metric | baseline | kvguard |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {b.get(k)} | {g.get(k)} |" for k in TABLE_KEYS]
    arms = result.get("arms")
    if arms:
        names = list(arms)
        lines += ["", "## Arms (same workload, seed and fleet; every request counted)", "",
                  "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += [f"| {k} | " + " | ".join(str(arms[n].get(k)) for n in names) + " |" for k in ARM_KEYS]
        lines += [f"- `{n}`: {arms[n].get('config')}" for n in names]
    lines += [
        "",
        f"- OOM reduction: {_pct(result.get('oom_reduction'))}",
        f"- preemption reduction: {_pct(result.get('preemption_reduction'))}",
        f"- goodput ratio: {result.get('goodput_ratio')}",
        f"- TTFT p99 ratio: {result.get('ttft_p99_ratio')}",
        "",
    ]
    kv = g.get("kvguard") or {}
    if kv:
        lines += ["## What kvguard did", "", f"- prediction: {kv.get('predictor')}",
                  f"- acks by action and outcome: `{json.dumps(kv.get('acks', {}))}`",
                  f"- policy counters: `{json.dumps(kv.get('policy', {}))}`",
                  f"- actuator counters: `{json.dumps(kv.get('actuators', {}))}`",
                  f"- SLO ledger records: `{json.dumps(kv.get('slo') or {})}`",
                  f"- mode changes: {len(kv.get('mode_changes', []))}"]
        lines += [f"  - {c['node']} at {c['ts_ns'] / NS_PER_S:.0f} s: {c['from_mode']} → {c['to_mode']} ({c['reason']})"
                  for c in kv.get("mode_changes", [])[:20]]
        lines.append("")
    ledger = result.get("ledger") or {}
    if ledger:
        lines += ["## Ledgers", "", f"- backend: {ledger.get('backend')}"
                  + (f", run `{result.get('run_id')}` (nodes {', '.join(result.get('nodes', []))})"
                     if result.get("run_id") else "")]
        lines += [f"- problem: {p}" for p in ledger.get("problems", [])]
        lines.append("")
    lines += ["![timeline](timeline.png)", "", "![outcomes](outcomes.png)", ""]
    return "\n".join(lines)


ARM_KEYS = ("ooms", "preemptions", "failed", "rejected", "slo_attainment", "slo_goodput_tokens_per_s",
            "goodput_tokens_per_s", "ttft_p99_s", "ttft_p99_all_s")


def _pct(x: float | None) -> str:
    return "n/a (the baseline had none)" if x is None else f"{x * 100:.1f} %"
