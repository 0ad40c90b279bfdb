"""Is a text fit to be the HMAC secret that the policy, the actuators and `kvguard command` share?

``secret_problem(text)`` says why not, or None. A secret is refused when it is a known placeholder,
shorter than ``MIN_SECRET_BYTES`` (RFC 2104 §3: a key shorter than the hash output, 32 bytes for
SHA-256, weakens it), or when its estimated entropy is under ``MIN_SECRET_BITS`` = 128 (NIST SP
800-57 Part 1 Rev. 5, Table 2: 128-bit security strength for keys used past 2030).

The estimate (``estimated_bits``) follows the idea of zxcvbn (D. L. Wheeler, "zxcvbn: Low-Budget
Password Strength Estimation", USENIX Security 2016): a guesser tries patterns before brute
force, so text made of repeats and runs is worth only its first pieces. Each character is
either a *literal* or explained by a pattern: part of a repeat of three or more characters seen
earlier (the repeat as a whole costs one literal), or the continuation of a run with a constant
step of at most 2 (``0123``, ``aceg``, ``zzz``). The estimate is the literals times log2 of the
brute-force alphabet (26 for lowercase, 26 uppercase, 10 digits, 33 ASCII symbols, 100 for any
other character, summed over the classes the text uses). Distinct characters alone cannot tell:
``0123`` ten times and ``password`` four times use 4 and 7 of them but are worth about 10 and 40
bits. Random text keeps nearly every character a literal: ``secrets.token_hex(32)`` estimates at
about 300 bits, ``secrets.token_urlsafe(32)`` at about 250. Pure: the standard library only.
"""

from __future__ import annotations

import math
import string

MIN_SECRET_BYTES = 32
MIN_SECRET_BITS = 128
# placeholders seen in examples, compose files and manifests (compared case-insensitively)
PLACEHOLDER_SECRETS = frozenset({
    "x", "xx", "xxx", "secret", "changeme", "change-me", "change_me", "change-me-dev-only", "replace-me",
    "replace_me", "replaceme", "dev", "test", "password", "hmac", "hmac-secret", "kvguard", "default",
    "example", "todo", "...", "…",
})
_CLASSES: tuple[tuple[frozenset[str], int], ...] = (
    (frozenset(string.ascii_lowercase), 26),
    (frozenset(string.ascii_uppercase), 26),
    (frozenset(string.digits), 10),
    (frozenset(string.punctuation + " "), 33),
)
_OTHER_CLASS = 100  # any character outside printable ASCII (zxcvbn's figure for unicode)
_MIN_REPEAT = 3
_MAX_RUN_STEP = 2


def secret_problem(text: str) -> str | None:
    """Why ``text`` is no HMAC secret to share between processes, or None."""
    if text.strip().lower() in PLACEHOLDER_SECRETS:
        return f"is a placeholder ({text!r})"
    if len(text.encode()) < MIN_SECRET_BYTES:
        return f"is {len(text.encode())} bytes, shorter than {MIN_SECRET_BYTES}"
    bits = estimated_bits(text)
    if bits < MIN_SECRET_BITS:
        return (f"has about {bits:.0f} bits of entropy (estimated from its repeats and runs), fewer than "
                f"{MIN_SECRET_BITS}: it is not random enough")
    return None


def estimated_bits(text: str) -> float:
    """Entropy of ``text`` in bits as a pattern-first guesser sees it (module docstring)."""
    if not text:
        return 0.0
    return literal_count(text) * math.log2(alphabet_size(text))


def alphabet_size(text: str) -> int:
    """The brute-force alphabet: the sizes of the character classes ``text`` uses, summed."""
    chars = set(text)
    size = sum(n for members, n in _CLASSES if chars & members)
    if any(not any(c in members for members, _ in _CLASSES) for c in chars):
        size += _OTHER_CLASS
    return max(size, 2)


def literal_count(text: str) -> int:
    """Characters not explained by a repeat or a run (each repeat counts as one)."""
    literals = 0
    i = 0
    while i < len(text):
        repeat = _longest_repeat(text, i)
        if repeat >= _MIN_REPEAT:
            literals += 1
            i += repeat
            continue
        if not _continues_run(text, i):
            literals += 1
        i += 1
    return literals


def _longest_repeat(text: str, i: int) -> int:
    """Length of the longest match of ``text[i:]`` starting before ``i`` (it may overlap ``i``)."""
    best = 0
    for j in range(i):
        n = 0
        while i + n < len(text) and text[j + n] == text[i + n]:
            n += 1
        best = max(best, n)
    return best


def _continues_run(text: str, i: int) -> bool:
    if i < 2:
        return False
    step = ord(text[i]) - ord(text[i - 1])
    return abs(step) <= _MAX_RUN_STEP and step == ord(text[i - 1]) - ord(text[i - 2])
