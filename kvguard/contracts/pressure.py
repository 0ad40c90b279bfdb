"""The pressure formulas (docs/ARCHITECTURE.md, "Metrics"), in one place: the pool, the mirror and the policy all call these.

Pure: numpy only. Inputs are in allocator units; D is the dynamic region.
"""

from __future__ import annotations

import numpy as np

ALPHA = 2.0
BETA = 1.0


def f_ext(free_units, largest_free_run):
    """1 - largest free run / total free; 0 when nothing is free. Works on scalars and arrays."""
    free = np.asarray(free_units, dtype=np.float64)
    largest = np.asarray(largest_free_run, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(free > 0, 1.0 - largest / np.where(free > 0, free, 1.0), 0.0)
    return out if out.ndim else float(out)


def f_int(tokens_stored, live_units, unit_tokens):
    """1 - tokens stored / token capacity of live pages; 0 when no page is live."""
    tokens = np.asarray(tokens_stored, dtype=np.float64)
    cap = np.asarray(live_units, dtype=np.float64) * unit_tokens
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(cap > 0, 1.0 - tokens / np.where(cap > 0, cap, 1.0), 0.0)
    return out if out.ndim else float(out)


def psi(live_units, workspace_units, dynamic_units, f_ext_value, f_int_value,
        reserved_frac=0.05, alpha=ALPHA, beta=BETA):
    """Ψ = (KV live + workspace + reserved) / D · (1 + α·F_ext + β·F_int). Ψ ≥ 1 ⇒ OOM unavoidable."""
    used = (np.asarray(live_units, dtype=np.float64) + np.asarray(workspace_units, dtype=np.float64)
            + reserved_frac * np.asarray(dynamic_units, dtype=np.float64))
    out = used / np.asarray(dynamic_units, dtype=np.float64) * (
        1.0 + alpha * np.asarray(f_ext_value, dtype=np.float64) + beta * np.asarray(f_int_value, dtype=np.float64))
    return out if np.ndim(out) else float(out)
