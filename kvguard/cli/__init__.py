"""Command-line entry point: ``kvguard --help``."""

from kvguard.cli.app import app
from kvguard.cli import (  # noqa: F401  (each module registers its commands on ``app``)
    budget,
    command,
    conformance,
    dataset,
    demo,
    evaluate,
    export,
    ingest,
    inspect,
    metrics,
    node,
    plan,
    policy,
    rca,
    record,
    replay,
    scrape,
    simulate,
    topics,
    train,
    worker,
)


def main() -> None:
    """``kvguard``: the commands; a heavy dependency that is not installed (an optional extra) ends
    the command with one line naming the extra, not a traceback."""
    import sys

    from kvguard.config.extras import missing_extra

    try:
        app()
    except ImportError as err:
        hint = missing_extra(err)
        if hint is None:
            raise
        command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "")
        print(f"error: kvguard {command} {hint}".replace("  ", " "), file=sys.stderr)
        raise SystemExit(2) from None
