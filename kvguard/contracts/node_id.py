"""The node id: what every record names its GPU by, and a label on every series the exporter serves.

A node id is ``<host>/gpu<i>`` or ``<pod>:<dp_rank>`` (docs/ARCHITECTURE.md). The bound:

- at most ``NODE_ID_MAX_CHARS`` = 48 characters, stricter than a Kubernetes label value (63:
  ``LabelValueMaxLength`` in k8s.io/apimachinery/pkg/util/validation/validation.go). The exporter
  writes the id on every per-node series, twice (as ``node`` and inside ``instance``), so the id's
  length is what a node costs on ``/metrics``; 48 keeps a hundred nodes with every per-node series
  under 1 MB (tests/unit/ops/test_exporter.py), where 63 does not. A cloud host name and a GPU
  index fit (``ip-10-0-12-34.us-west-2.compute.internal/gpu3`` is 46); an id built from a GPU
  UUID or from Kubernetes names (``$(NODE_NAME)/$(POD_NAME)``: each may be 253 characters) need
  not, and ``fit_node_id`` shortens such an id the node side derives, deterministically (a prefix
  and a hash of the whole), so a long name never stops an engine from serving;
- the characters of a Kubernetes label value (``[A-Za-z0-9]``, ``-``, ``_``, ``.``) plus the two
  separators kvguard's own ids use, ``/`` and ``:``; first and last a letter or digit. So the set is
  a label value's plus two characters, not a subset of it (a label value cannot hold ``/``); it is
  ASCII, with no whitespace, control, quote, backslash or bidirectional-override character, so an
  id prints as itself in a log line, a label and a terminal.

Every id kvguard builds passes: ``sim-0/gpu0``, ``demo-<run>/gpu<i>``, ``<host>/gpu<i>`` from a DNS
host name, ``<pod>:<rank>``. Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import re

NODE_ID_MAX_CHARS = 48
NODE_ID_CHARACTERS = "letters, digits and - _ . / :"
_NODE_ID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:/-]*[A-Za-z0-9])?")


def node_id_problem(node: object) -> str | None:
    """Why ``node`` is not a node id (a phrase that fits after "node id …"), or None."""
    if not isinstance(node, str):
        return f"must be a string, got {type(node).__name__}"
    if not node:
        return "is empty"
    if len(node) > NODE_ID_MAX_CHARS:
        return f"is {len(node)} characters, at most {NODE_ID_MAX_CHARS}"
    if _NODE_ID.fullmatch(node) is None:
        bad = next((c for c in node if not (c.isascii() and (c.isalnum() or c in "._:/-"))), None)
        what = f"holds {bad!r}" if bad is not None else "must begin and end with a letter or digit"
        return f"{what}: expected {NODE_ID_CHARACTERS}, beginning and ending with a letter or digit"
    return None


def check_node_id(node: object, field: str = "node") -> str:
    """``node`` when it is a node id; ``ValueError`` naming ``field`` and the rule otherwise."""
    problem = node_id_problem(node)
    if problem is not None:
        shown = repr(node[:80]) + ("…" if len(node) > 80 else "") if isinstance(node, str) else repr(node)
        raise ValueError(f"{field} {shown} {problem}")
    return node


def fit_node_id(raw: str) -> str:
    """``raw`` when it is a node id; else the same id made one: characters outside the set become
    ``-``, and an id that is still too long keeps its first characters and ends in ``-`` and the
    first 8 hex digits of SHA-256 of ``raw`` (deterministic: the same node gets the same id after a
    restart; two long names that share a prefix still differ)."""
    if node_id_problem(raw) is None:
        return raw
    cleaned = re.sub(r"[^A-Za-z0-9._:/-]", "-", raw).strip("._:/-") or "node"
    if len(cleaned) <= NODE_ID_MAX_CHARS and node_id_problem(cleaned) is None and cleaned == raw:
        return cleaned
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head = cleaned[:NODE_ID_MAX_CHARS - len(digest) - 1].rstrip("._:/-")
    return check_node_id(f"{head}-{digest}" if head else digest, "node id")
