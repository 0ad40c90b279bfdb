"""One offline HTML page of a replay: the fleet at a glance, then the nodes that matter.

No CDN, no scripts: plots are PNGs embedded as base64, so the page opens from an incident ticket
or a laptop without network. It stays readable at 100+ GPUs: the fleet is a heatmap (one row per
node, U_kv over time, OOMs marked), and per-node timelines are small multiples for the nodes with
the most OOMs and alerts only (``max_panels``). Each panel draws U_kv and F_ext against the alert
thresholds, the allocator's reserved and allocated bytes when the node reports them, P(OOM) when a
predictor ran, alert spans shaded, the policy's commands as ticks and OOMs as red lines.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from kvguard.contracts.tiers import AlertThresholds

GiB = float(1 << 30)


def write_timeline_report(directory: str | Path, result: Any, *, title: str, notes: list[str] | None = None,
                          max_panels: int = 12, thresholds: AlertThresholds | None = None) -> Path:
    """``result``: a ``kvguard.runtime.replay.ReplayResult``. Returns the page's path."""
    # matplotlib takes a second to import: only when a report is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = thresholds or AlertThresholds()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    nodes = sorted(result.nodes.values(), key=lambda n: (-len(n.ooms), -sum(1 for a in n.alerts if a[2] == "firing"),
                                                          n.node))
    figures = [("Fleet: U_kv per node over time (red: OOM)", _fleet_heatmap(plt, nodes))]
    for tl in nodes[:max_panels]:
        figures.append((f"{tl.node}: {len(tl.ooms)} OOM(s), {len(tl.commands)} command(s)", _node_panel(plt, tl, t)))
    summary = result.summary()
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in summary.items())
    body = "".join(f'<h2>{html.escape(caption)}</h2><img alt="{html.escape(caption)}" src="data:image/png;base64,{png}">'
                   for caption, png in figures)
    more = (f"<p>{len(nodes) - max_panels} more node(s) without panels (fewest OOMs and alerts).</p>"
            if len(nodes) > max_panels else "")
    note_html = "".join(f"<li>{html.escape(n)}</li>" for n in (notes or []))
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}img{max-width:100%}"
            "td{padding:2px 8px;border-bottom:1px solid #ddd}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><ul>{note_html}</ul><table>{rows}</table>{body}{more}</body></html>")
    path = out / "index.html"
    path.write_text(page)
    return path


def _png(plt, fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _fleet_heatmap(plt, nodes) -> str:
    # matplotlib takes a second to import: only when a report is drawn
    import numpy as np

    times = sorted({ts for n in nodes for ts in n.ts_s})
    fig, ax = plt.subplots(figsize=(11, max(2.0, 0.18 * len(nodes) + 1.2)))
    if times:
        index = {ts: i for i, ts in enumerate(times)}
        grid = np.full((len(nodes), len(times)), np.nan)
        for row, n in enumerate(nodes):
            for ts, u in zip(n.ts_s, n.u_kv):
                grid[row, index[ts]] = u
        ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=0.0, vmax=1.0, cmap="viridis",
                  extent=(times[0], times[-1], len(nodes) - 0.5, -0.5))
        for row, n in enumerate(nodes):
            if n.ooms:
                ax.scatter(n.ooms, [row] * len(n.ooms), marker="x", color="red", s=30, zorder=3)
    ax.set_yticks(range(len(nodes)))
    ax.set_yticklabels([n.node for n in nodes] if len(nodes) <= 40 else [""] * len(nodes), fontsize=7)
    ax.set_xlabel("event time (s)")
    return _png(plt, fig)


def _node_panel(plt, tl, t: AlertThresholds) -> str:
    fig, ax = plt.subplots(figsize=(11, 2.8))
    ax.plot(tl.ts_s, tl.u_kv, label="U_kv", color="tab:blue")
    uniform = any(tl.alloc_reserved_bytes) and not any(tl.f_ext)  # uniform blocks: KV F_ext 0 by construction
    ax.plot(tl.ts_s, tl.f_ext, label="F_ext (KV, 0 by construction: uniform blocks)" if uniform else "F_ext (KV)",
            color="tab:orange", alpha=0.8)
    if any(tl.alloc_f_ext):
        ax.plot(tl.ts_s, tl.alloc_f_ext, label="F_ext (allocator)", color="tab:brown", alpha=0.8)
    p = [(ts, v) for ts, v in zip(tl.ts_s, tl.p_oom) if v is not None]
    if p:
        ax.plot([ts for ts, _ in p], [v for _, v in p], label="P(OOM)", color="tab:purple", linestyle=":")
    ax.axhline(t.u_kv_critical, color="gray", linestyle="--", linewidth=0.8, label=f"U_kv {t.u_kv_critical}")
    ax.axhline(t.frag_f_ext, color="tab:orange", linestyle=":", linewidth=0.8, label=f"F_ext {t.frag_f_ext}")
    start: dict[str, float] = {}
    for ts, rule, state in tl.alerts:
        if state == "firing":
            start.setdefault(rule, ts)
        elif rule in start:
            ax.axvspan(start.pop(rule), ts, color="gold", alpha=0.15)
    end = tl.ts_s[-1] if tl.ts_s else 0.0
    for s in start.values():
        ax.axvspan(s, end, color="gold", alpha=0.15)
    for ts in tl.ooms:
        ax.axvline(ts, color="red", linewidth=1.2)
    if tl.commands:
        ax.scatter([ts for ts, _ in tl.commands], [1.02] * len(tl.commands), marker="|", color="black", s=40,
                   clip_on=False, label="command")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("event time (s)")
    if any(tl.alloc_reserved_bytes):
        ax2 = ax.twinx()
        ax2.plot(tl.ts_s, [b / GiB for b in tl.alloc_reserved_bytes], color="tab:green", linewidth=0.9,
                 label="reserved GiB")
        ax2.plot(tl.ts_s, [b / GiB for b in tl.alloc_allocated_bytes], color="tab:olive", linewidth=0.9,
                 linestyle="--", label="allocated GiB")
        ax2.plot(tl.ts_s, [(r - a) / GiB for r, a in zip(tl.alloc_reserved_bytes, tl.alloc_allocated_bytes)],
                 color="tab:cyan", linewidth=0.9, linestyle=":", label="reserved-but-unallocated GiB")
        ax2.set_ylabel("allocator GiB")
        ax2.legend(loc="upper right", fontsize=7)
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    return _png(plt, fig)
