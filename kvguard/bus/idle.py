"""The idle sweep of a long-running consumer: which nodes have sent nothing for too long.

The stream worker, the stream service and the policy service each hold per-node state that a node
which stops sending (scaled down, renamed, gone) would pin for good. Each notes every node's last
record in wall time here and, every ``every_s``, takes out the nodes silent for more than
``timeout_s`` (``streams.node_idle_timeout_s`` / ``policy.node_idle_timeout_s``), to forget them.

Time is an argument (monotonic seconds from the caller), so the sweep is tested without a clock.
"""

from __future__ import annotations

from collections.abc import Iterator

SWEEP_EVERY_S = 30.0  # how often a consumer looks for idle nodes (wall seconds)


class IdleSweep:
    """Per node the wall time of its last record, oldest first: an insertion-ordered dict in which a
    node seen again moves to the end, so a scan for the silent stops at the first recent node."""

    def __init__(self, timeout_s: float, *, now_s: float, every_s: float = SWEEP_EVERY_S) -> None:
        if not timeout_s > 0 or not every_s > 0:
            raise ValueError(f"timeout_s and every_s must be > 0, got {timeout_s} and {every_s}")
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.seen_at: dict[str, float] = {}
        self.next_sweep_s = now_s + every_s

    def __len__(self) -> int:
        return len(self.seen_at)

    def seen(self, node: str, now_s: float) -> None:
        self.seen_at.pop(node, None)
        self.seen_at[node] = now_s

    def forget(self, node: str) -> None:
        self.seen_at.pop(node, None)

    def over(self, max_nodes: int) -> list[str]:
        """Take out the longest-silent nodes past ``max_nodes``; returns them, oldest first."""
        out = []
        while len(self.seen_at) > max_nodes:
            oldest = next(iter(self.seen_at))
            del self.seen_at[oldest]
            out.append(oldest)
        return out

    def silent_for(self, now_s: float, seconds: float) -> Iterator[str]:
        """The nodes without a record for at least ``seconds`` at ``now_s``, oldest first (kept)."""
        for node, seen in self.seen_at.items():
            if now_s - seen < seconds:
                return
            yield node

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_sweep_s

    def sweep(self, now_s: float) -> list[str]:
        """Take out the nodes silent for more than ``timeout_s`` and schedule the next sweep."""
        self.next_sweep_s = now_s + self.every_s
        idle = [node for node, seen in self.seen_at.items() if now_s - seen > self.timeout_s]
        for node in idle:
            del self.seen_at[node]
        return idle
