"""`kvguard budget status` and `kvguard slo report`: read the weekly ledgers in Redis."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any, Optional

import typer

from kvguard.cli.app import app
from kvguard.contracts.units import NS_PER_S

budget_app = typer.Typer(help="Weekly fragmentation budget per node (F_ext above threshold).",
                         no_args_is_help=True)
slo_app = typer.Typer(help="Weekly prediction and prevention SLO.", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
app.add_typer(slo_app, name="slo")

_NODE = typer.Option(None, "--node", help="Only this node id.")
_WEEK = typer.Option(None, "--week", help="ISO week such as 2026-W48 (UTC); default: the latest "
                                          "week with data, else the current week.")
# typer renders help as rich markup, where "[redis]" is a style tag and vanishes: "\[" keeps it
_REDIS = typer.Option(None, "--redis",
                      help="redis://[:password@]host:port/db or rediss:// (TLS); default: redis.url "
                           "when set explicitly (KVGUARD_REDIS__URL or the \\[redis] table of "
                           "$KVGUARD_CONFIG). The built-in default is never used.")
_JSON = typer.Option(False, "--json", help="Print one JSON object for machines.")


def _load_settings() -> Any:
    """kvguard/settings.py's Settings (defaults < $KVGUARD_CONFIG file < KVGUARD_* env)."""
    from kvguard.config.settings import ConfigError, Settings

    try:
        return Settings.load()
    except ConfigError as exc:
        _fail(f"settings: {exc}", code=2)


def _connection(redis_url: Optional[str], settings: Any) -> tuple[str, dict[str, Any]]:
    """--redis as given, else the settings' redis section (url + password + tls + CA file),
    but only when redis.url was set in the file or the environment: the built-in default,
    127.0.0.1:6379, is often a shared server that holds someone else's ledger."""
    from kvguard.runtime.mapping import BootstrapError, check_redis_url, redis_target

    try:
        if redis_url:
            options = {"ssl_ca_certs": settings.redis.ssl_cafile} if settings.redis.ssl_cafile else {}
            return check_redis_url(redis_url, "--redis"), options
        if "url" not in settings.redis.model_fields_set:
            _fail("no Redis to read: pass --redis URL or set redis.url (KVGUARD_REDIS__URL, or "
                  "url in the [redis] table of $KVGUARD_CONFIG); the default "
                  f"{settings.redis.url} is not used here", code=2)
        return redis_target(settings.redis)
    except BootstrapError as exc:
        _fail(str(exc), code=2)


def _fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _check_week(week: Optional[str]) -> Optional[str]:
    """The --week label, checked before anything connects; None when not given."""
    from kvguard.policy.budget import WeekFormatError, parse_week

    if not week:
        return None
    try:
        parse_week(week)
    except WeekFormatError as exc:
        raise typer.BadParameter(str(exc), param_hint="--week") from None
    return week.strip()


def _pick_week(week: Optional[str], ledger: Any) -> tuple[str, str]:
    """(week, why): --week as given ("given"), else the latest week the ledger holds data for
    ("latest"), else the current UTC week ("current", with no data anywhere)."""
    from kvguard.policy.budget import iso_week

    if week:
        return week, "given"
    known = ledger.weeks()
    if known:
        return known[-1], "latest"
    now = _dt.datetime.now(_dt.timezone.utc)
    return iso_week(int(now.timestamp()) * NS_PER_S), "current"


_WEEK_NOTES = {"given": "", "latest": " (latest week with data)",
               "current": " (current week; no week has data)"}


@budget_app.command("status")
def budget_status(node: Optional[str] = _NODE, week: Optional[str] = _WEEK,
                  redis_url: Optional[str] = _REDIS, json_out: bool = _JSON) -> None:
    """Per node: seconds used, budget, remaining, exhausted, the intervals that burned most."""
    from kvguard.policy.budget import BudgetConfigError, LedgerUnavailable
    from kvguard.policy.budget_redis import RedisBudgetLedger
    from kvguard.runtime.mapping import budget_config

    week = _check_week(week)
    settings = _load_settings()
    try:
        config = budget_config(settings)
    except BudgetConfigError as exc:
        _fail(str(exc), code=2)
    url, options = _connection(redis_url, settings)
    ledger = RedisBudgetLedger(url, config, **options)
    try:
        week, why = _pick_week(week, ledger)
        status = ledger.status(week, node)
    except LedgerUnavailable as exc:
        _fail(str(exc))
    finally:
        ledger.close()
    if json_out:
        typer.echo(json.dumps({**status.to_dict(), "week_source": why}, sort_keys=True))
        return
    _print_budget(status, node, _WEEK_NOTES[why])


def _print_budget(status: Any, node: Optional[str], week_note: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"week {status.week}{week_note}")
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
    completion rate of evicted requests; SLO met when recall >= 0.90 and FPR <= 0.05.
    Canary rollouts (over all weeks): stage, status and a section per variant (control and
    candidate: node-hours, OOMs per node-hour, commands, evicted-request completion rate)."""
    from kvguard.policy.budget import LedgerUnavailable
    from kvguard.policy.slo_redis import RedisSloLedger
    from kvguard.runtime.mapping import slo_config

    week = _check_week(week)
    settings = _load_settings()
    config = slo_config(settings)
    url, options = _connection(redis_url, settings)
    ledger = RedisSloLedger(url, config, **options)
    try:
        week, why = _pick_week(week, ledger)
        report = ledger.report(week)
        rollouts = [r for r in map(ledger.canary_report, ledger.canary_rollouts()) if r is not None]
    except LedgerUnavailable as exc:
        _fail(str(exc))
    finally:
        ledger.close()
    if json_out:
        typer.echo(json.dumps({**report.to_dict(), "week_source": why,
                               "canary": [r.to_dict() for r in rollouts]}, sort_keys=True))
        return
    _print_slo(report, _WEEK_NOTES[why])
    _print_canary(rollouts)


def _fmt(value: Optional[float], pattern: str = "{:.3f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def _verdict(met: Optional[bool]) -> str:
    return "[dim]no data[/dim]" if met is None else ("[green]met[/green]" if met else "[red]missed[/red]")


def _print_slo(report: Any, week_note: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"week {report.week}{week_note}")
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


def _print_canary(rollouts: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for rollout in rollouts:
        data = rollout.to_dict()
        console.print(f"canary {data['rollout']}: {data['status']} at stage {data['stage']} "
                      f"({data['percent']}% of nodes on the candidate; stages {data['stages']}, "
                      f"mode {data['mode']})" + (f": {data['reason']}" if data["reason"] else ""))
        table = Table(title=f"Canary {data['rollout']}: outcomes per variant (all stages)")
        for column in ("arm", "variant", "nodes", "node-h", "OOMs", "OOMs/node-h", "commands", "evictions",
                       "completion rate"):
            table.add_column(column, justify="left" if column in ("arm", "variant") else "right")
        for row in data["variants"]:
            evictions = row["evictions"]
            table.add_row(row["arm"], row["variant"], str(row["nodes"]), f"{row['node_hours']:.2f}",
                          str(row["ooms"]), _fmt(row["ooms_per_node_hour"], "{:.4f}"), str(row["commands"]),
                          f"{evictions['requests']} ({evictions['completed']} done, {evictions['failed']} failed)",
                          _fmt(evictions["completion_rate"], "{:.1%}"))
        console.print(table)
        for move in data["history"]:
            console.print(f"  stage {move['from_stage']} -> {move['to_stage']} ({move['status']}): {move['reason']}")
