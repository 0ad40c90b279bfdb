"""Executors for engines whose state belongs to one thread (an in-engine plugin's scheduler).

``EngineThreadExecutor`` wraps an ``Executor``: ``execute`` called on another thread (the actuator's
consumer) is handed to the engine thread through ``actions.submit`` (run before the engine's next
step) and waited for, at most ``timeout_s``; an idle engine (no step runs) raises ``TimeoutError``,
which the actuator acks FAILED with the reason.
"""

from __future__ import annotations

import threading
from typing import Any


class EngineThreadExecutor:
    """An ``Executor`` whose ``execute`` runs on the engine thread (vLLM's scheduler is not thread-safe)."""

    def __init__(self, executor: Any, actions: Any, timeout_s: float = 2.0) -> None:
        self.executor = executor
        self.actions = actions
        self.timeout_s = timeout_s

    def refusal(self, command: Any) -> str | None:
        """The wrapped executor's bounds check (it reads only the pool's size, safe from any thread)."""
        return self.executor.refusal(command)

    def execute(self, command: Any, now_ns: int) -> Any:
        if threading.get_ident() == self.actions.engine_thread:
            return self.executor.execute(command, now_ns)
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = self.executor.execute(command, now_ns)
            except BaseException as err:  # noqa: BLE001 - re-raised on the consumer's thread
                box["error"] = err
            finally:
                done.set()

        self.actions.submit(run)
        if not done.wait(self.timeout_s):
            raise TimeoutError(f"the engine ran no step for {self.timeout_s:g} s (idle): command not applied")
        if "error" in box:
            raise box["error"]
        return box["result"]
