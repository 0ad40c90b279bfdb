"""What the long-running service commands share."""

from __future__ import annotations

import asyncio
import signal


def stop_event(max_seconds: float | None = None) -> asyncio.Event:
    """An event set on SIGINT/SIGTERM, or after ``max_seconds`` of wall time; call it inside the
    running loop. Services wait on it and shut down cleanly (commit, flush, close)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if max_seconds is not None:
        loop.call_later(max_seconds, stop.set)
    return stop
