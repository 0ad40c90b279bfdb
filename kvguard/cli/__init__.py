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
    app()
