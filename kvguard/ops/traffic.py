"""The traffic mix an operator declares: which request classes reach the server, how often, in what shape.

One spelling for ``kvguard plan --traffic`` and ``kvguard simulate --traffic``::

    CLASS[:SHARE][@SHAPE][,CLASS[:SHARE][@SHAPE]...]
    prompt_logprobs:0.05,long_context:0.02@60000,spec_decode

``SHARE`` is the fraction of requests in the class, in (0, 1] (absent: the class is present, share not
said). ``SHAPE`` is one positive integer whose meaning is the class's (``CLASSES``); ``60k`` is 60,000
and ``64K`` is 65,536, as vLLM reads its integer flags. A class is named at most once.

The classes are the failure classes a single step decides (notes/oom-classes.md, C2, C3, C8); each one's
shape is the size that grows its step's peak, so a plan can say how large it may be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class TrafficError(ValueError):
    """A ``--traffic`` value that does not parse; the message says what was expected."""


@dataclass(frozen=True, slots=True)
class ClassInfo:
    """What a class is and what its ``@SHAPE`` counts."""

    summary: str
    shape: str  # what @SHAPE means
    shape_default: str  # what plan assumes without one


CLASSES: dict[str, ClassInfo] = {
    "prompt_logprobs": ClassInfo("requests asking for prompt logprobs (echo + logprobs, as eval harnesses send; "
                                 "vllm#5907)", "the longest such prompt, in tokens",
                                 "any prompt vLLM accepts (max_model_len - 1)"),
    "logprobs": ClassInfo("requests asking for logprobs=N of each sampled token", "N (at most --max-logprobs, 20)",
                          "20, vLLM's --max-logprobs"),
    "long_context": ClassInfo("long prompts, whose last prefill chunk attends over the whole context (class C3)",
                              "the prompt length, in tokens", "max_model_len - 1"),
    "spec_decode": ClassInfo("decodes verified with the server's speculative tokens (class C8; needs "
                             "--num-speculative-tokens)", "the concurrent decoding sequences",
                             "max_num_seqs (as many as the token budget allows)"),
}

_ITEM = re.compile(r"(?P<name>[a-z_]+)(?::(?P<share>[^@]+))?(?:@(?P<shape>.+))?")
_SUFFIX = re.compile(r"(\d+)([kKmM]?)")


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    share: float | None = None
    shape: int | None = None

    def spelled(self) -> str:
        share = f":{self.share:g}" if self.share is not None else ""
        shape = f"@{self.shape}" if self.shape is not None else ""
        return f"{self.name}{share}{shape}"


def _shape(text: str, item: str) -> int:
    m = _SUFFIX.fullmatch(text.strip())
    if not m:
        raise TrafficError(f"{item!r}: @SHAPE must be a positive integer (60000, 60k or 64K), got {text!r}")
    number, suffix = int(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}[suffix]
    if number * scale <= 0:
        raise TrafficError(f"{item!r}: @SHAPE must be positive, got {text!r}")
    return number * scale


def parse_traffic(text: str) -> tuple[TrafficClass, ...]:
    """The classes of a ``--traffic`` value, in the order written (module docstring)."""
    items = [part.strip() for part in text.split(",")]
    if not text.strip() or not all(items):
        raise TrafficError(f"expected CLASS[:SHARE][@SHAPE] items separated by commas, got {text!r}")
    out: list[TrafficClass] = []
    for item in items:
        m = _ITEM.fullmatch(item)
        if m is None or m.group("name") not in CLASSES:
            name = m.group("name") if m else item
            raise TrafficError(f"unknown request class {name!r} in {item!r}; the classes are {', '.join(CLASSES)}")
        share = None
        if m.group("share") is not None:
            try:
                share = float(m.group("share"))
            except ValueError:
                raise TrafficError(f"{item!r}: SHARE must be a number in (0, 1], got {m.group('share')!r}") from None
            if not 0.0 < share <= 1.0:
                raise TrafficError(f"{item!r}: SHARE must be in (0, 1], got {share:g}")
        shape = _shape(m.group("shape"), item) if m.group("shape") is not None else None
        if any(c.name == m.group("name") for c in out):
            raise TrafficError(f"class {m.group('name')!r} is named twice in {text!r}")
        out.append(TrafficClass(m.group("name"), share, shape))
    return tuple(out)


def spell_traffic(classes: tuple[TrafficClass, ...]) -> str:
    """The ``--traffic`` text of ``classes`` (``parse_traffic``'s inverse)."""
    return ",".join(c.spelled() for c in classes)
