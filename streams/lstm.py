"""The tier-3 OOM predictor: a 2-layer LSTM over a 30-minute window of tick features.

Two heads read the last hidden state: P(OOM within 5 min) (one logit) and the next 5 minutes of
U_kv (``traj_steps`` values, one per tick). The model emits both at every step of a sequence, so
training on a 180-tick chunk teaches it every window length from 1 to 180 ticks at once and a
node with only a few minutes of history needs no padding.

An artifact is two files side by side: ``<name>.pt`` (the state dict) and ``<name>.json``
(``ModelMetadata``: feature list, normalisation, operating threshold, training data, held-out
metrics). Loading checks the feature list against the caller's (the stream's ``FEATURE_NAMES``)
and fails with ``ModelFeatureMismatch`` naming what differs, because a model fed columns in the
wrong order predicts confidently and wrongly.

``LSTMPredictor`` implements ``streams.predictor.Predictor``: ``predict(windows)`` for a batch of
windows ``[n, T, F]``, plus ``step(nodes, features)``, which keeps each node's hidden state and
advances it by one tick (the cheap path: one LSTM step per node per tick instead of 180).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvguard.streams.predictor import ModelError, ModelFeatureMismatch

MODEL_FORMAT = "kvguard-oom-lstm/1"
DEFAULT_MODEL_DIR = Path(__file__).with_name("models")
DEFAULT_MODEL_NAME = "oom_lstm"


Z_CLIP = 10.0  # |z| beyond this is out of the training range: clipped, never extrapolated
MIN_STD = 1e-3  # a feature whose training std is below this carried no information: fed as 0


@dataclass(slots=True)
class Normalisation:
    """x' = clip((f(x) - mean) / std, -z_clip, z_clip) per feature, where f is log1p for heavy-tailed
    counts, else identity. Features constant in training (std < ``MIN_STD``) are ``inactive``: always
    0, so a value never seen in training (an eviction in a guarded run) cannot become a z of 1000s."""

    log1p: list[bool]
    mean: list[float]
    std: list[float]
    active: list[bool] | None = None  # None (older artifacts): every feature active
    z_clip: float | None = None  # None (older artifacts): no clipping

    @classmethod
    def fit(cls, features: np.ndarray) -> "Normalisation":
        x = np.asarray(features, dtype=np.float64)
        x = np.where(np.isfinite(x), x, 0.0)
        # counts and rates spanning orders of magnitude are compressed; fractions are left alone
        log1p = [bool(col.min() >= 0 and np.percentile(col, 99) > 1000.0) for col in x.T]
        xt = np.where(np.array(log1p), np.log1p(np.maximum(x, 0.0)), x)
        mean = xt.mean(axis=0)
        raw_std = xt.std(axis=0)
        std = np.maximum(raw_std, MIN_STD)
        return cls(log1p=log1p, mean=mean.tolist(), std=std.tolist(), active=(raw_std >= MIN_STD).tolist(),
                   z_clip=Z_CLIP)

    def apply(self, features: np.ndarray) -> np.ndarray:
        x = np.asarray(features, dtype=np.float32)
        x = np.where(np.isfinite(x), x, 0.0)
        mask = np.asarray(self.log1p, dtype=bool)
        x = np.where(mask, np.log1p(np.maximum(x, 0.0)), x)
        z = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if self.z_clip is not None:
            z = np.clip(z, -self.z_clip, self.z_clip)
        if self.active is not None:
            z = np.where(np.asarray(self.active, dtype=bool), z, 0.0)
        return z.astype(np.float32)


@dataclass(slots=True)
class ModelMetadata:
    feature_names: list[str]
    normalisation: Normalisation
    threshold: float = 0.5  # the tier-3 rule fires when P(OOM in 5 min) >= threshold
    resolve_after_s: float = 60.0  # hysteresis assumed by the offline metrics (AlertThresholds')
    window_ticks: int = 180
    tick_s: float = 10.0
    horizon_s: float = 300.0
    traj_steps: int = 30
    hidden_size: int = 64
    num_layers: int = 2
    u_kv_feature: str = "u_kv"  # the trajectory head predicts U_kv(t+k) - U_kv(t) from this column
    format: str = MODEL_FORMAT
    version: str = ""
    created_by: str = ""
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, path: str = "<metadata>") -> "ModelMetadata":
        if d.get("format") != MODEL_FORMAT:
            raise ModelError(f"{path}: field 'format' is {d.get('format')!r}, expected {MODEL_FORMAT!r}")
        try:
            norm = Normalisation(**d["normalisation"])
            fields = {k: v for k, v in d.items() if k != "normalisation"}
            meta = cls(normalisation=norm, **fields)
        except (KeyError, TypeError) as exc:
            raise ModelError(f"{path}: malformed metadata: {exc}") from exc
        n = len(meta.feature_names)
        for name in ("log1p", "mean", "std", "active"):
            if getattr(norm, name) is not None and len(getattr(norm, name)) != n:
                raise ModelError(f"{path}: normalisation.{name} has {len(getattr(norm, name))} entries, "
                                 f"feature_names has {n}")
        if not 0.0 <= meta.threshold <= 1.0:
            raise ModelError(f"{path}: field 'threshold' must be in [0, 1], got {meta.threshold}")
        return meta


class OOMNet(nn.Module):
    """LSTM(F -> hidden, num_layers) with a P(OOM) logit head and a U_kv trajectory head, per step."""

    def __init__(self, n_features: int, hidden_size: int = 64, num_layers: int = 2, traj_steps: int = 30,
                 dropout: float = 0.1):
        super().__init__()
        self.lstm = nn.LSTM(n_features, hidden_size, num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.oom_head = nn.Linear(hidden_size, 1)
        self.traj_head = nn.Linear(hidden_size, traj_steps)

    def forward(self, x: torch.Tensor, state=None):
        """x [B, T, F] normalised -> (logits [B, T], traj [B, T, H], (h, c))."""
        out, state = self.lstm(x, state)
        return self.oom_head(out).squeeze(-1), self.traj_head(out), state


def _paths(path: str | Path) -> tuple[Path, Path]:
    """A path ending in .pt/.json names the artifact; anything else is a directory holding ``oom_lstm.*``."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in (".pt", ".json") else p / DEFAULT_MODEL_NAME
    return stem.with_suffix(".pt"), stem.with_suffix(".json")


def save_model(net: OOMNet, metadata: ModelMetadata, path: str | Path) -> tuple[Path, Path]:
    """Write the weights and metadata: ``x.pt``/``x.json`` for a path ending in .pt or .json, else
    ``<path>/oom_lstm.pt`` and ``<path>/oom_lstm.json``."""
    weights, meta_path = _paths(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
    torch.save(state, weights)
    meta_path.write_text(json.dumps(metadata.to_dict(), indent=1) + "\n")
    return weights, meta_path


def load_model(path: str | Path | None = None, *, expected_features: list[str] | None = None,
               threads: int | None = 1) -> "LSTMPredictor":
    """Load an LSTM artifact (default: the committed one, streams/models/oom_lstm) and check its features
    against ``expected_features``. ``streams.loader.load_predictor`` loads whichever model an artifact is.

    ``threads`` sets torch's (process-wide) CPU thread count: inference is small and the cores are shared.
    """
    target = path if path is not None else DEFAULT_MODEL_DIR
    if Path(target).suffix == "" and not Path(target).is_dir() and Path(f"{target}.pt").exists():
        target = f"{target}.pt"  # a stem (streams/models/oom_lstm) names the artifact too
    weights, meta_path = _paths(target)
    for p in (weights, meta_path):
        if not p.exists():
            raise ModelError(f"{p}: model file not found (build the shipped one with "
                             f"`kvguard train --preset shipped`)")
    try:
        meta = ModelMetadata.from_dict(json.loads(meta_path.read_text()), str(meta_path))
    except json.JSONDecodeError as exc:
        raise ModelError(f"{meta_path}: not JSON: line {exc.lineno}: {exc.msg}") from exc
    if expected_features is not None and list(expected_features) != list(meta.feature_names):
        raise ModelFeatureMismatch(str(meta_path), list(meta.feature_names), list(expected_features))
    net = OOMNet(len(meta.feature_names), meta.hidden_size, meta.num_layers, meta.traj_steps)
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    except (RuntimeError, KeyError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ModelError(f"{weights}: weights do not fit the metadata in {meta_path.name}: {exc}") from exc
    return LSTMPredictor(net, meta, threads=threads)


class LSTMPredictor:
    """Batched inference for the stream (``streams.predictor.Predictor``).

    ``predict(windows)`` takes raw (un-normalised) tick features ``[n, T, F]``, the protocol's path.
    ``step(nodes, features)`` is the stateful fast path: one LSTM step per node per tick.
    """

    def __init__(self, net: OOMNet, metadata: ModelMetadata, *, threads: int | None = 1):
        if threads:
            torch.set_num_threads(threads)
        self.net = net.eval()
        self.metadata = metadata
        names = list(metadata.feature_names)
        self._u_col = names.index(metadata.u_kv_feature) if metadata.u_kv_feature in names else 0
        self._states: dict[str, int] = {}
        self._h = torch.zeros(metadata.num_layers, 0, metadata.hidden_size)
        self._c = torch.zeros(metadata.num_layers, 0, metadata.hidden_size)
        self._ages = np.zeros(0, dtype=np.int64)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.metadata.feature_names)

    @property
    def window_ticks(self) -> int:
        return self.metadata.window_ticks

    @property
    def horizon_ticks(self) -> int:
        return self.metadata.traj_steps

    @property
    def threshold(self) -> float:
        return self.metadata.threshold

    def _outputs(self, logits: torch.Tensor, delta: torch.Tensor, u_now: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = torch.sigmoid(logits).numpy().astype(np.float32)
        return p, np.clip(u_now[:, None] + delta.numpy(), 0.0, 1.0).astype(np.float32)

    def predict(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """windows [n, T, F] raw features, oldest first, left-padded by the caller (``streams.predictor.
        window_from_history``) -> (p_oom [n], u_kv trajectory [n, traj_steps]), all nodes in one pass."""
        w = np.asarray(windows, dtype=np.float32)
        if w.ndim != 3 or w.shape[2] != len(self.metadata.feature_names):
            raise ValueError(f"windows must be [n, T, {len(self.metadata.feature_names)}], got {list(w.shape)}")
        if w.shape[0] == 0:
            return np.zeros(0, np.float32), np.zeros((0, self.horizon_ticks), np.float32)
        x = torch.from_numpy(self.metadata.normalisation.apply(w[:, -self.window_ticks:]))
        with torch.inference_mode():
            logits, traj, _ = self.net(x)
        return self._outputs(logits[:, -1], traj[:, -1], w[:, -1, self._u_col])

    def prime(self, nodes: list[str], windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Set each node's state from a full window [n, T, F] (what ``predict`` scores, from a zero
        state) and return ``predict``'s outputs; later ticks go through ``step``. The stream core
        primes a node it has no state for (first tick, restored from the changelog, after a resync)."""
        w = np.asarray(windows, dtype=np.float32)
        if w.ndim != 3 or w.shape[0] != len(nodes) or w.shape[2] != len(self.metadata.feature_names):
            raise ValueError(f"windows must be [{len(nodes)}, T, {len(self.metadata.feature_names)}], "
                             f"got {list(w.shape)}")
        if not nodes:
            return np.zeros(0, np.float32), np.zeros((0, self.horizon_ticks), np.float32)
        w = w[:, -self.window_ticks:]
        rows = self._rows_for(nodes)
        idx = torch.from_numpy(rows)
        with torch.inference_mode():
            logits, traj, (h, c) = self.net(torch.from_numpy(self.metadata.normalisation.apply(w)))
            self._h[:, idx] = h
            self._c[:, idx] = c
        self._ages[rows] = w.shape[1]
        return self._outputs(logits[:, -1], traj[:, -1], w[:, -1, self._u_col])

    def step(self, nodes: list[str], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Advance each node's LSTM state by one tick of raw features [n, F]; returns like ``predict``.

        A node seen for the first time (or after ``forget``) is primed with a full window of copies of
        its first tick, exactly what ``predict`` sees for a one-tick history. Later the state is never
        truncated, so the model sees more than 30 minutes; the bench compares this with ``predict``.
        """
        f = np.asarray(features, dtype=np.float32)
        if f.ndim != 2 or f.shape != (len(nodes), len(self.metadata.feature_names)):
            raise ValueError(f"features must be [{len(nodes)}, {len(self.metadata.feature_names)}], "
                             f"got {list(f.shape)}")
        rows = self._rows_for(nodes)
        fresh = self._ages[rows] == 0
        x = self.metadata.normalisation.apply(f)[:, None, :]
        idx = torch.from_numpy(rows)
        with torch.inference_mode():
            if fresh.any():
                prime = torch.from_numpy(np.repeat(x[fresh], self.window_ticks - 1, axis=1))
                _, _, (h0, c0) = self.net(prime)
                fresh_idx = idx[torch.from_numpy(fresh)]
                self._h[:, fresh_idx] = h0
                self._c[:, fresh_idx] = c0
            logits, traj, (h, c) = self.net(torch.from_numpy(x), (self._h[:, idx], self._c[:, idx]))
            self._h[:, idx] = h
            self._c[:, idx] = c
        self._ages[rows] += 1
        return self._outputs(logits[:, -1], traj[:, -1], f[:, self._u_col])

    def _rows_for(self, nodes: list[str]) -> np.ndarray:
        new = [n for n in dict.fromkeys(nodes) if n not in self._states]
        if new:
            base = len(self._states)
            for i, node in enumerate(new):
                self._states[node] = base + i
            layers, hidden = self.metadata.num_layers, self.metadata.hidden_size
            self._h = torch.cat([self._h, torch.zeros(layers, len(new), hidden)], dim=1)
            self._c = torch.cat([self._c, torch.zeros(layers, len(new), hidden)], dim=1)
            self._ages = np.concatenate([self._ages, np.zeros(len(new), np.int64)])
        return np.fromiter((self._states[n] for n in nodes), dtype=np.int64, count=len(nodes))

    def forget(self, node: str) -> None:
        """Reset a node's state (its GPU restarted, or its history was lost)."""
        row = self._states.get(node)
        if row is not None:
            self._h[:, row] = 0.0
            self._c[:, row] = 0.0
            self._ages[row] = 0


def describe(meta: ModelMetadata) -> dict:
    """A one-screen summary of a model for `kvguard train`/`eval` output."""
    return {"format": meta.format, "version": meta.version, "features": len(meta.feature_names),
            "window_ticks": meta.window_ticks, "threshold": round(meta.threshold, 4),
            "resolve_after_s": meta.resolve_after_s, "metrics": meta.metrics}


def count_parameters(net: nn.Module) -> int:
    return int(sum(p.numel() for p in net.parameters()))

