"""`kvguard budget status` and `kvguard slo report`: read the weekly ledgers in Redis."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Optional

import typer

from kvguard.cli.app import app

budget_app = typer.Typer(help="Weekly fragmentation budget per node (F_ext above threshold).",
                         no_args_is_help=True)
slo_app = typer.Typer(help="Weekly prediction and prevention SLO.", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
app.add_typer(slo_app, name="slo")

_NODE = typer.Option(None, "--node", help="Only this node id.")
_WEEK = typer.Option(None, "--week", help="ISO week such as 2026-W48 (UTC); default: the latest "
                                          "week with data, else the current week.")
_REDIS = typer.Option(None, "--redis", help="redis://[:password@]host:port/db or rediss:// (TLS); "
                                            "default: settings redis.url (KVGUARD_REDIS__URL).")
_JSON = typer.Option(False, "--json", help="Print one JSON object for machines.")


def _load_settings() -> Any:
    """kvguard/settings.py's Settings (defaults < $KVGUARD_CONFIG file < KVGUARD_* env)."""
    from kvguard.settings import ConfigError, Settings

    try:
        return Settings.load()
    except ConfigError as exc:
        _fail(f"settings: {exc}", code=2)


def _connection(redis_url: Optional[str], settings: Any) -> tuple[str, dict[str, Any]]:
    """--redis as given, else the settings' redis section (url + password + tls + CA file)."""
    from policy.budget_redis import url_from_settings

    url, options = url_from_settings(settings.redis)
    return (redis_url, options) if redis_url else (url, options)


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _pick_week(week: Optional[str], known: list[str]) -> str:
    from policy.budget import WeekFormatError, iso_week, parse_week

    if week:
        try:
            parse_week(week)
        except WeekFormatError as exc:
            raise typer.BadParameter(str(exc), param_hint="--week") from None
        return week.strip()
    if known:
        return known[-1]
    now = _dt.datetime.now(_dt.timezone.utc)
    return iso_week(int(now.timestamp()) * 1_000_000_000)


@budget_app.command("status")
def budget_status(node: Optional[str] = _NODE, week: Optional[str] = _WEEK,
                  redis_url: Optional[str] = _REDIS, json_out: bool = _JSON) -> None:
    """Per node: seconds used, budget, remaining, exhausted, the intervals that burned most."""
    from policy.budget import BudgetConfig, BudgetConfigError, LedgerUnavailable
    from policy.budget_redis import RedisBudgetLedger

    settings = _load_settings()
    try:
        config = BudgetConfig.from_settings(settings)
    except BudgetConfigError as exc:
        _fail(str(exc), code=2)
    url, options = _connection(redis_url, settings)
    ledger = RedisBudgetLedger(url, config, **options)
    try:
        status = ledger.status(_pick_week(week, [] if week else ledger.weeks()), node)
    except LedgerUnavailable as exc:
        _fail(str(exc))
    finally:
        ledger.close()
    if json_out:
        typer.echo(json.dumps(status.to_dict(), sort_keys=True))
        return
    _print_budget(status, node)


def _print_budget(status: Any, node: Optional[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"Fragmentation budget {status.week} "
                        f"(budget {status.budget_s / 60:.0f} min/node)")
    for column in ("node", "cluster", "used min", "remaining min", "state", "top intervals"):
        table.add_column(column, justify="right" if "min" in column else "left")
    for row in status.nodes:
        state = "[red]EXHAUSTED[/red]" if row.exhausted else "[green]ok[/green]"
        if row.alerted:
            state += " · RCA alert"
        intervals = ", ".join(f"{i.label(status.interval_s)} {i.burned_s / 60:.1f} min"
                              for i in row.top_intervals[:3])
        table.add_row(row.node, row.cluster, f"{row.used_s / 60:.1f}",
                      f"{row.remaining_s / 60:.1f}", state, intervals)
    if not status.nodes:
        console.print(f"No node burned budget in {status.week}"
                      + (f" matching {node!r}." if node else "."))
    else:
        console.print(table)
    for cluster, used_s in sorted(status.clusters.items()):
        count = sum(1 for n in status.nodes if n.cluster == cluster)
        console.print(f"cluster {cluster}: {used_s / 60:.1f} min burned"
                      + (f" across {count} node(s)" if node is None else ""))


@slo_app.command("report")
def slo_report(week: Optional[str] = _WEEK, redis_url: Optional[str] = _REDIS,
               json_out: bool = _JSON) -> None:
    """Precision, recall and FPR at the operating threshold, OOM lead times per tier,
    completion rate of evicted requests; SLO met when recall >= 0.90 and FPR <= 0.05."""
    from policy.budget import LedgerUnavailable
    from policy.slo import SloConfig
    from policy.slo_redis import RedisSloLedger

    settings = _load_settings()
    config = SloConfig.from_settings(settings)
    url, options = _connection(redis_url, settings)
    ledger = RedisSloLedger(url, config, **options)
    try:
        report = ledger.report(_pick_week(week, [] if week else ledger.weeks()))
    except LedgerUnavailable as exc:
        _fail(str(exc))
    finally:
        ledger.close()
    if json_out:
        typer.echo(json.dumps(report.to_dict(), sort_keys=True))
        return
    _print_slo(report)


def _fmt(value: Optional[float], pattern: str = "{:.3f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def _verdict(met: Optional[bool]) -> str:
    return "[dim]no data[/dim]" if met is None else ("[green]met[/green]" if met else "[red]missed[/red]")


def _print_slo(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    predictions = Table(title=f"Prediction SLO {report.week} (operating threshold)")
    for column in ("TP", "FP", "TN", "FN", "precision", "recall", "FPR"):
        predictions.add_column(column, justify="right")
    predictions.add_row(str(report.tp), str(report.fp), str(report.tn), str(report.fn),
                        _fmt(report.precision), _fmt(report.recall), _fmt(report.fpr))
    console.print(predictions)
    console.print(f"recall >= {report.recall_target:.2f}: {_verdict(report.recall_met)}   "
                  f"FPR <= {report.fpr_target:.2f}: {_verdict(report.fpr_met)}   "
                  f"SLO: {_verdict(report.slo_met)}")
    tiers = Table(title=f"OOMs: {report.ooms}; lead time per tier")
    for column in ("tier", "OOMs", "detected", "median lead min"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for tier in report.tiers:
        tiers.add_row(tier.tier, str(len(tier.lead_times_s)), str(tier.detected),
                      _fmt(None if tier.median_lead_s is None else tier.median_lead_s / 60, "{:.2f}"))
    console.print(tiers)
    console.print(f"evictions: {report.evictions} events, {report.evicted_requests} requests; "
                  f"completed {report.completed}, failed {report.failed}, pending {report.pending}; "
                  f"completion rate {_fmt(report.completion_rate, '{:.1%}')}")
