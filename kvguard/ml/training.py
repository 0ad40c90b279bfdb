"""Training the OOM LSTM on a ``TickDataset``, calibrating its threshold, scoring held-out runs.

The stream scores tick t with one LSTM pass from a zero state over the 180-tick window ending at
t, left-padded with copies of the node's first tick when the node is younger
(``streams.predictor.window_from_history``). Training approximates that at a fraction of the cost:
each sequence is left-padded the same way, cut into chunks of ``chunk_ticks`` (240), and the loss
is put on every step after ``burn_in_ticks`` (120), so each target is predicted from 120-240 ticks
of history around the stream's 180 — one chunk yields 120 targets instead of one. Scoring
(validation, test, ``kvguard eval`` offline) uses the exact windows.

The P(OOM) head uses a class-weighted BCE (positives are rare) over the scored ticks only (a tick
while the GPU restarts, or whose horizon runs past the end of its run, has no label: it is read as
history, never a target), the U_kv head an MSE on the next ``traj_steps`` ticks (masked past the
end of a sequence). The operating threshold is the lowest whose false-positive rate on the scored
ticks of the validation runs is <= 5 %: runs of the training workloads at other rates and seeds,
never a held-out (test) run, so the held-out figures measure a threshold chosen without them
(``metrics.threshold_calibration`` names the runs it came from). Offline lead times assume the alert
engine's hysteresis: the rule fires at p >= threshold and resolves after ``resolve_after_s`` clear.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from kvguard import __version__
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.dataset import TickDataset
from kvguard.ml.evaluation import NodeTrace, evaluate_traces, isolated_ooms, threshold_for_fpr
from kvguard.streams.lstm import ModelMetadata, Normalisation, OOMNet


@dataclass(slots=True)
class TrainConfig:
    epochs: int = 20
    batch_size: int = 16
    window_ticks: int = 180
    chunk_ticks: int = 240
    burn_in_ticks: int = 120
    learning_rate: float = 2e-3
    traj_weight: float = 0.5  # 2.0 gave lower validation recall (0.66 vs 0.72, seeds 0 and 1)
    max_pos_weight: float = 30.0
    isolated_weight: float = 1.0  # extra loss weight before isolated OOMs (first crash after calm); 3.0 did worse on validation
    hidden_size: int = 64
    num_layers: int = 2
    traj_steps: int = 30
    dropout: float = 0.1
    max_fpr: float = 0.05
    resolve_after_s: float = 60.0
    seed: int = 0
    threads: int = 1
    score_mode: str = "window"  # how validation/test ticks are scored: "window" (180-tick) or "stateful"


@dataclass(slots=True)
class TrainResult:
    net: OOMNet
    metadata: ModelMetadata
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def hysteresis(ts_ns: np.ndarray, p: np.ndarray, threshold: float, resolve_after_s: float) -> np.ndarray:
    """Firing per tick as ``streams.alerts`` runs the tier-3 rule: fires on the first tick with
    p >= threshold, resolves once p has stayed below it for ``resolve_after_s``."""
    firing = np.zeros(len(p), dtype=bool)
    on, clear_since = False, None
    hold_ns = int(resolve_after_s * NS_PER_S)
    for i, (t, v) in enumerate(zip(np.asarray(ts_ns, np.int64).tolist(), np.asarray(p, np.float64).tolist())):
        if v >= threshold:
            on, clear_since = True, None
        elif on:
            clear_since = t if clear_since is None else clear_since
            if t - clear_since >= hold_ns:
                on, clear_since = False, None
        firing[i] = on
    return firing


def future_targets(u_kv: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(targets [L, steps], mask [L, steps]): U_kv(t+k) - U_kv(t) for k = 1..steps (the trajectory
    head predicts the change from now), masked past the sequence end."""
    n = len(u_kv)
    idx = np.arange(n)[:, None] + np.arange(1, steps + 1)[None, :]
    mask = idx < n
    u = np.asarray(u_kv, np.float32)
    targets = u[np.minimum(idx, n - 1)] - u[:, None] if n else np.zeros((0, steps), np.float32)
    return targets.astype(np.float32), mask


def _chunks(lengths: list[int], chunk: int, burn_in: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(sequence, start) pairs over padded sequences so that the scored steps (after the burn-in)
    tile each sequence once, at a random phase per epoch."""
    stride = chunk - burn_in
    out = []
    for s, n in enumerate(lengths):
        phase = int(rng.integers(0, stride))
        out.extend((s, a) for a in range(-phase, max(n - burn_in, 1), stride) if a + chunk > burn_in)
    return out


def _batch(seqs, chunk_list, chunk: int, burn_in: int, steps: int, n_features: int):
    b = len(chunk_list)
    x = np.zeros((b, chunk, n_features), np.float32)
    y = np.zeros((b, chunk), np.float32)
    m = np.zeros((b, chunk), np.float32)
    tt = np.zeros((b, chunk, steps), np.float32)
    tm = np.zeros((b, chunk, steps), np.float32)
    for i, (s, a) in enumerate(chunk_list):
        xs, ys, ts, tms, real, weight = seqs[s]
        start = max(a, 0)
        e = min(a + chunk, len(ys))
        k = e - start
        x[i, :k], y[i, :k], tt[i, :k] = xs[start:e], ys[start:e], ts[start:e]
        keep = real[start:e].astype(np.float32)
        keep[: max(burn_in - (start - a), 0)] = 0.0  # steps inside the burn-in carry no loss
        m[i, :k], tm[i, :k] = keep * weight[start:e], tms[start:e] * keep[:, None]
    return (torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(m), torch.from_numpy(tt),
            torch.from_numpy(tm))


def pad_left(x: np.ndarray, n: int) -> np.ndarray:
    """``n`` copies of the first row, then ``x`` (the stream's padding for a young node)."""
    return np.concatenate([np.repeat(x[:1], n, axis=0), x]) if len(x) and n > 0 else x


def first_crash_weights(ts_ns: np.ndarray, oom_ts_ns: np.ndarray, horizon_s: float, weight: float) -> np.ndarray:
    """Loss weight per tick: ``weight`` on the positive ticks before an isolated OOM (the first crash
    after a calm spell, where an early warning is worth most and data is scarcest), else 1."""
    w = np.ones(len(ts_ns), np.float32)
    if weight == 1.0 or len(oom_ts_ns) == 0:
        return w
    ooms = np.sort(oom_ts_ns)
    for t_oom in ooms[isolated_ooms(ooms)]:
        w[(ts_ns < t_oom) & (ts_ns >= t_oom - int(horizon_s * NS_PER_S))] = weight
    return w


def _prepared(ds: TickDataset, seq_ids: list[int], norm: Normalisation, steps: int, window: int,
              isolated_weight: float = 1.0):
    """Per sequence, left-padded by window-1 rows: (x, labels, traj targets, traj mask, real-tick
    mask, loss weight)."""
    u_col = ds.feature_names.index("u_kv")
    pad = window - 1
    out = []
    for s in seq_ids:
        a, b = int(ds.seq_offsets[s]), int(ds.seq_offsets[s + 1])
        targets, mask = future_targets(ds.features[a:b, u_col], steps)
        real = np.r_[np.zeros(pad, bool), ds.scored[a:b]]  # masked ticks carry no P(OOM) loss
        seq = ds.sequence(s)
        weight = first_crash_weights(seq.ts_ns, seq.oom_ts_ns, ds.horizon_s, isolated_weight)
        out.append((pad_left(norm.apply(ds.features[a:b]), pad), pad_left(ds.labels[a:b].astype(np.float32), pad),
                    pad_left(targets, pad), pad_left(mask.astype(np.float32), pad), real, pad_left(weight, pad)))
    return out


def score_sequence(net: OOMNet, x: np.ndarray, window: int, mode: str = "window",
                   batch: int = 512) -> np.ndarray:
    """P(OOM) per tick of one normalised sequence [L, F], as the stream would score it.

    ``window``: tick t reads the ``window`` ticks ending at t, left-padded with the first tick
    (exactly ``streams.predictor.window_from_history``), each from a zero state. ``stateful``: the
    ``LSTMPredictor.step`` path, one pass over the padded sequence.
    """
    n = len(x)
    if n == 0:
        return np.zeros(0, np.float32)
    xt = torch.from_numpy(np.ascontiguousarray(pad_left(x, window - 1), dtype=np.float32))
    with torch.inference_mode():
        if mode == "stateful":
            logits, _, _ = net(xt[None])
            return torch.sigmoid(logits[0, window - 1:]).numpy().astype(np.float32)
        if mode != "window":
            raise ValueError(f"mode must be 'window' or 'stateful', got {mode!r}")
        windows = xt.unfold(0, window, 1).permute(0, 2, 1)  # [n, window, F], window i ends at tick i
        p = []
        for a in range(0, n, batch):
            lg, _, _ = net(windows[a:a + batch].contiguous())
            p.append(torch.sigmoid(lg[:, -1]).numpy())
    return np.concatenate(p).astype(np.float32)


def score_dataset(net: OOMNet, ds: TickDataset, seq_ids: list[int], norm: Normalisation, window: int,
                  mode: str = "window") -> list[np.ndarray]:
    net.eval()
    return [score_sequence(net, norm.apply(ds.features[ds.seq_offsets[s]:ds.seq_offsets[s + 1]]), window, mode)
            for s in seq_ids]


def traces_for(ds: TickDataset, seq_ids: list[int], scores: list[np.ndarray], threshold: float,
               resolve_after_s: float, tier: str = "lstm") -> list[NodeTrace]:
    """Node traces of ``seq_ids`` scored by ``scores``, with the stored threshold/slope firing and
    ``tier`` firing at ``threshold`` (with hysteresis); masks and fleets come from the dataset."""
    traces = []
    for s, p in zip(seq_ids, scores):
        seq = ds.sequence(s)
        a, b = int(ds.seq_offsets[s]), int(ds.seq_offsets[s + 1])
        firing = {name: seq.firing.get(name, np.zeros(len(p), bool)) for name in ("threshold", "slope")}
        firing[tier] = hysteresis(seq.ts_ns, p, threshold, resolve_after_s)
        run = ds.runs[int(ds.seq_run[s])]
        traces.append(NodeTrace(node=seq.node, ts_ns=seq.ts_ns, p_oom=p, firing=firing,
                                oom_ts_ns=seq.oom_ts_ns, tick_s=ds.tick_s, down=ds.down[a:b],
                                censored=ds.censored[a:b], fleet=str(run.get("key", f"run{int(ds.seq_run[s])}")),
                                features=ds.features[a:b]))
    return traces


def train(ds: TickDataset, config: TrainConfig = TrainConfig(), *,
          progress: Callable[[int, int, dict], None] | None = None) -> TrainResult:
    """Fit the model on the ``train`` runs, calibrate on ``val``, report on ``test``.

    ``progress(done_batches, total_batches, info)`` is called after every batch (for a progress bar).
    """
    started = time.monotonic()
    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    rng = np.random.default_rng(config.seed)
    train_ids, val_ids, test_ids = (ds.sequences_in(s) for s in ("train", "val", "test"))
    if not train_ids:
        raise ValueError("dataset has no 'train' runs")
    norm = Normalisation.fit(ds.features[ds.rows_in("train")])
    train_rows = ds.scored_rows_in("train")
    n_pos = float(ds.labels[train_rows].sum())
    pos_weight = min(config.max_pos_weight, (len(train_rows) - n_pos) / max(n_pos, 1.0))
    seqs = _prepared(ds, train_ids, norm, config.traj_steps, config.window_ticks, config.isolated_weight)
    net = OOMNet(len(ds.feature_names), config.hidden_size, config.num_layers, config.traj_steps, config.dropout)
    optimiser = torch.optim.Adam(net.parameters(), lr=config.learning_rate)
    bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight), reduction="none")
    lengths = [len(s[1]) for s in seqs]
    epoch_chunks = [_chunks(lengths, config.chunk_ticks, config.burn_in_ticks, rng) for _ in range(config.epochs)]
    total = sum(-(-len(c) // config.batch_size) for c in epoch_chunks)
    done = 0
    history = []
    for epoch, chunk_list in enumerate(epoch_chunks):
        net.train()
        order = rng.permutation(len(chunk_list))
        losses = []
        for a in range(0, len(order), config.batch_size):
            picked = [chunk_list[i] for i in order[a:a + config.batch_size]]
            x, y, m, tt, tm = _batch(seqs, picked, config.chunk_ticks, config.burn_in_ticks, config.traj_steps,
                                     len(ds.feature_names))
            logits, traj, _ = net(x)
            loss_p = (bce(logits, y) * m).sum() / (m > 0).sum().clamp(min=1)
            loss_u = (((traj - tt) ** 2) * tm).sum() / tm.sum().clamp(min=1.0)
            loss = loss_p + config.traj_weight * loss_u
            optimiser.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimiser.step()
            losses.append((loss_p.item(), loss_u.item()))
            done += 1
            if progress:
                progress(done, total, {"epoch": epoch + 1, "loss": loss.item()})
        mean = np.mean(losses, axis=0)
        history.append({"epoch": epoch + 1, "bce": round(float(mean[0]), 5), "traj_mse": round(float(mean[1]), 6)})
    net.eval()
    calib_ids = val_ids or train_ids
    calib_scores = score_dataset(net, ds, calib_ids, norm, config.window_ticks, config.score_mode)
    calib_scored = np.concatenate([ds.scored[ds.seq_offsets[s]:ds.seq_offsets[s + 1]] for s in calib_ids])
    calib_labels = np.concatenate([ds.labels[ds.seq_offsets[s]:ds.seq_offsets[s + 1]] for s in calib_ids])
    calib_labels = calib_labels[calib_scored]
    scores_flat = np.concatenate(calib_scores)[calib_scored]
    if 0 < calib_labels.sum() < len(calib_labels):
        threshold = threshold_for_fpr(calib_labels, scores_flat, config.max_fpr)
    else:
        threshold = 0.5
    threshold = float(min(max(threshold, 1e-4), 1.0))
    metrics = {"pos_weight": round(pos_weight, 3),
               "threshold_calibration": {
                   "split": "val" if val_ids else "train", "max_fpr": config.max_fpr,
                   "workloads": sorted({ds.runs[int(ds.seq_run[s])]["workload"] for s in calib_ids}),
                   "runs": sorted({ds.runs[int(ds.seq_run[s])].get("key", "") for s in calib_ids}),
                   "scored_ticks": int(len(calib_labels))}}
    for name, ids, scores in (("validation", calib_ids, calib_scores),
                              ("held_out", test_ids, score_dataset(net, ds, test_ids, norm, config.window_ticks,
                                                                   config.score_mode) if test_ids else [])):
        if ids:
            result = evaluate_traces(traces_for(ds, ids, scores, threshold, config.resolve_after_s),
                                     horizon_s=ds.horizon_s, threshold=threshold)
            metrics[name] = result.to_dict()
            metrics[name]["workloads"] = sorted({ds.runs[int(ds.seq_run[s])]["workload"] for s in ids})

    metadata = ModelMetadata(
        feature_names=list(ds.feature_names), normalisation=norm, threshold=threshold,
        resolve_after_s=config.resolve_after_s, window_ticks=config.window_ticks, tick_s=ds.tick_s, horizon_s=ds.horizon_s, traj_steps=config.traj_steps,
        hidden_size=config.hidden_size, num_layers=config.num_layers, version=__version__,
        created_by="kvguard train",
        training={"config": {k: getattr(config, k) for k in config.__slots__}, "history": history,
                  "dataset": ds.summary(), "inputs": dict(ds.inputs),
                  "runs": [{k: r[k] for k in ("workload", "rate_scale", "profile", "seed", "duration_s", "split")
                            if k in r} for r in ds.runs]},
        metrics=metrics)
    return TrainResult(net=net, metadata=metadata, history=history, seconds=time.monotonic() - started)

