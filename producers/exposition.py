"""Prometheus text exposition (format 0.0.4) parsed into samples, and ``histogram_quantile``. Pure: stdlib only.

Shared by the scrapers of each engine's ``/metrics`` (``producers.vllm.metrics``,
``producers.sglang.metrics``, ``producers.trtllm.metrics``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


class MetricsParseError(ValueError):
    def __init__(self, line_no: int, line: str, expected: str):
        super().__init__(f"line {line_no}: expected {expected}, got {line[:120]!r}")
        self.line_no = line_no


@dataclass(slots=True, frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str, default: str = "") -> str:
        return dict(self.labels).get(key, default)


def _unescape(text: str) -> str:
    return text.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")


def value_of(text: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(text)  # "NaN" parses too


def parse_exposition(text: str) -> list[Sample]:
    """Prometheus text format 0.0.4 → samples (comments skipped, timestamps dropped)."""
    out = []
    for line_no, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise MetricsParseError(line_no, line, "name{labels} value [timestamp]")
        labels = []
        raw = m.group("labels") or ""
        pos = 0
        while pos < len(raw):
            lm = _LABEL.match(raw, pos)
            if lm is None:
                raise MetricsParseError(line_no, line, 'labels name="value", ...')
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        try:
            value = value_of(m.group("value"))
        except ValueError:
            raise MetricsParseError(line_no, line, "a number") from None
        out.append(Sample(m.group("name"), tuple(sorted(labels)), value))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` buckets (linear within a
    bucket; the +Inf bucket answers its lower bound). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le
