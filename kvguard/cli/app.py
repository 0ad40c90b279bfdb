"""The root Typer app. Command modules import ``app`` and register on it; heavy imports
(torch, faust, aiokafka, redis) happen inside the command functions, never at import time."""

import typer

app = typer.Typer(
    name="kvguard",
    help=("Keep LLM inference servers from CUDA OOMs and preemption storms: watch the KV cache and the "
          "allocator, size each step, act through the engine's knobs."),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def root() -> None:
    """kvguard: watch GPU KV-cache allocators, predict OOMs minutes ahead, and prevent them.

    Start with `kvguard demo` (embedded, no Kafka or Redis needed).
    """


@app.command()
def version() -> None:
    """Print kvguard's version."""
    from kvguard import __version__

    typer.echo(__version__)
