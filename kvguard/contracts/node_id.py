"""The node id: what every record names its GPU by, and a label on every series the exporter serves.

A node id is ``<host>/gpu<i>`` or ``<pod>:<dp_rank>`` (docs/ARCHITECTURE.md). The bound:

- at most ``NODE_ID_MAX_CHARS`` = 48 characters, stricter than a Kubernetes label value (63:
  ``LabelValueMaxLength`` in k8s.io/apimachinery/pkg/util/validation/validation.go). The exporter
  writes the id on every per-node series, twice (as ``node`` and inside ``instance``), so the id's
  length is what a node costs on ``/metrics``; 48 keeps a hundred nodes with every per-node series
  under 1 MB (tests/unit/ops/test_exporter.py), where 63 does not. A cloud host name and a GPU
  index fit (``ip-10-0-12-34.us-west-2.compute.internal/gpu3`` is 46); an id built from a GPU
  UUID does not, and the node says to set ``KVGUARD_NODE_ID``;
- the characters of a Kubernetes label value (``[A-Za-z0-9]``, ``-``, ``_``, ``.``) plus the two
  separators kvguard's own ids use, ``/`` and ``:``; first and last a letter or digit. So the set is
  a label value's plus two characters, not a subset of it (a label value cannot hold ``/``); it is
  ASCII, with no whitespace, control, quote, backslash or bidirectional-override character, so an
  id prints as itself in a log line, a label and a terminal.

Every id kvguard builds passes: ``sim-0/gpu0``, ``demo-<run>/gpu<i>``, ``<host>/gpu<i>`` from a DNS
host name, ``<pod>:<rank>``. Pure: the standard library only.
"""

from __future__ import annotations

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
