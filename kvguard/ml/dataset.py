"""Training and evaluation data for the OOM predictor: tick feature sequences with labels.

One *sequence* is one node's ticks in one run, in order; one *run* is a shadow-engine run of one
workload at one rate scale, profile and seed (or one event log). Splits are made per run and
whole workloads are held out, so no run's ticks are ever split between train and test.

Labels follow docs/ARCHITECTURE.md "Alerts and prediction": tick t is positive iff an ``oom`` event happens in (t, t + 300 s]. The
dataset also keeps each sequence's OOM times and the threshold/slope tiers' firing per tick, as
the stream core computed them, so evaluation needs no second simulation.

Two kinds of tick carry no label (``TickDataset.scored`` is False; training and evaluation skip
them, the LSTM still reads them as history): *down* ticks, while the GPU restarts after an OOM
(from the OOM to the time the engine is up again, ``oom_up_ts_ns``), and *censored* ticks, whose
5-minute horizon reaches past the end of the run (``seq_end_ns``), where no one saw whether an
OOM followed. Runs whose ticks and OOMs are identical to an earlier run's (a trace workload
replays the same arrivals for every seed) are kept once and listed under ``duplicates``.

A dataset is a compressed ``.npz`` plus a ``.json`` manifest (feature names, run specs, splits,
input file hashes, counts). Building is deterministic: same specs, same bytes.
Pure: numpy and the standard library (the simulation is imported inside ``simulate_run``).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvguard.contracts.events import EventKind
from kvguard.contracts.units import NS_PER_S
from kvguard.ml.evaluation import DEFAULT_HORIZON_S, censored_mask, down_mask, labels_for_ticks
from kvguard.producers.sim.fleet import Fleet
from kvguard.producers.sim.profiles import EngineKnobs, load_profile, prompt_cap_tokens
from kvguard.producers.sim.registry import engine_kind
from kvguard.producers.sim.workloads import SCENARIOS, load_workload, resolve_trace_path
from kvguard.streams.alerts import FIRING
from kvguard.streams.core import StreamConfig, StreamCore
from kvguard.streams.loader import with_model_threshold
from kvguard.streams.metrics import FEATURE_NAMES, tick_features
from kvguard.wire.eventlog import read_event_log

DATASET_FORMAT = "kvguard-tick-dataset/2"
TIERS_STORED = ("threshold", "slope")
SPLITS = ("train", "val", "test")


class DatasetError(ValueError):
    """A dataset file or spec is malformed; names the file and the field."""


@dataclass(slots=True, frozen=True)
class RunSpec:
    """One shadow-engine run: which workload, how hard, on which GPU profile, with which seed."""

    workload: str
    rate_scale: float = 1.0
    profile: str = "llama3-8b-24gb"
    seed: int = 0
    duration_s: float = 3600.0
    n_gpus: int = 1
    split: str = "train"
    # vLLM-engine profiles: the operator's --gpu-memory-utilization (None: the profile's) and the share of
    # requests asking for prompt logprobs (eval traffic, whose logits vLLM's profiling run does not count)
    gpu_memory_utilization: float | None = None
    prompt_logprobs_frac: float = 0.0
    # TREND classes (kvguard.ml.trend): a leak (``--leak`` text, C7), a neighbour process
    # (``--neighbour`` SIZE[:RATE], C4) and an arrival rate ramping to ``ramp`` x the base by the end (C6)
    leak: str = ""
    neighbour: str = ""
    ramp: float = 1.0

    def key(self) -> str:
        knobs = ""
        if self.gpu_memory_utilization is not None or self.prompt_logprobs_frac:
            knobs = f"/u{self.gpu_memory_utilization}/plp{self.prompt_logprobs_frac:g}"
        if self.leak or self.neighbour or self.ramp != 1.0:
            knobs += f"/leak={self.leak}/nb={self.neighbour}/ramp{self.ramp:g}"
        return (f"{self.workload}@x{self.rate_scale:g}/{self.profile}{knobs}/s{self.seed}/{self.duration_s:g}s/"
                f"{self.n_gpus}g")


@dataclass(slots=True)
class Sequence:
    """One node's ticks in one run."""

    node: str
    ts_ns: np.ndarray  # [L] int64, ascending
    features: np.ndarray  # [L, F] float32
    oom_ts_ns: np.ndarray  # [K] int64
    firing: dict[str, np.ndarray] = field(default_factory=dict)  # tier -> [L] bool
    p_oom: np.ndarray | None = None  # [L] the stream's tier-3 score, when a predictor ran
    oom_up_ts_ns: np.ndarray | None = None  # [K] when the GPU was up again after each OOM; None: at once
    end_ns: int | None = None  # end of what was observed (labels past it are censored); None: never

    def up_times(self) -> np.ndarray:
        return np.asarray(self.oom_ts_ns if self.oom_up_ts_ns is None else self.oom_up_ts_ns, dtype=np.int64)

    def masks(self, horizon_s: float = DEFAULT_HORIZON_S) -> tuple[np.ndarray, np.ndarray]:
        """(down, censored) per tick."""
        return (down_mask(self.ts_ns, self.oom_ts_ns, self.up_times()),
                censored_mask(self.ts_ns, self.end_ns, horizon_s))


@dataclass(slots=True)
class TickDataset:
    feature_names: list[str]
    features: np.ndarray  # [N, F] float32, all sequences concatenated
    labels: np.ndarray  # [N] uint8
    ts_ns: np.ndarray  # [N] int64
    seq_offsets: np.ndarray  # [S + 1] int64: sequence s is rows seq_offsets[s]:seq_offsets[s+1]
    seq_run: np.ndarray  # [S] int32: index into runs
    seq_node: list[str]
    oom_ts_ns: np.ndarray  # [K] int64, all sequences concatenated
    oom_offsets: np.ndarray  # [S + 1] int64
    firing: dict[str, np.ndarray]  # tier -> [N] bool
    runs: list[dict]  # RunSpec fields + split + input hashes + counts
    horizon_s: float = DEFAULT_HORIZON_S
    tick_s: float = 10.0
    inputs: dict = field(default_factory=dict)  # file -> sha256
    oom_up_ts_ns: np.ndarray | None = None  # [K] int64 aligned with oom_ts_ns; None: no downtime known
    seq_end_ns: np.ndarray | None = None  # [S] int64, -1: observed forever; None: all -1
    duplicates: list[dict] = field(default_factory=list)  # runs dropped as identical to a kept one
    down: np.ndarray = field(init=False, repr=False)  # [N] bool, derived
    censored: np.ndarray = field(init=False, repr=False)  # [N] bool, derived

    def __post_init__(self) -> None:
        if self.oom_up_ts_ns is None:
            self.oom_up_ts_ns = self.oom_ts_ns.copy()
        if self.seq_end_ns is None:
            self.seq_end_ns = np.full(self.n_sequences, -1, np.int64)
        down, censored = [], []
        for s in range(self.n_sequences):
            d, c = self.sequence(s).masks(self.horizon_s)
            down.append(d)
            censored.append(c)
        self.down = np.concatenate(down) if down else np.zeros(0, bool)
        self.censored = np.concatenate(censored) if censored else np.zeros(0, bool)

    @property
    def n_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def scored(self) -> np.ndarray:
        """[N] bool: ticks with a label (the GPU was up and the horizon was observed)."""
        return ~(self.down | self.censored)

    def sequence(self, s: int) -> Sequence:
        a, b = int(self.seq_offsets[s]), int(self.seq_offsets[s + 1])
        oa, ob = int(self.oom_offsets[s]), int(self.oom_offsets[s + 1])
        end = int(self.seq_end_ns[s])
        return Sequence(node=self.seq_node[s], ts_ns=self.ts_ns[a:b], features=self.features[a:b],
                        oom_ts_ns=self.oom_ts_ns[oa:ob], firing={k: v[a:b] for k, v in self.firing.items()},
                        oom_up_ts_ns=self.oom_up_ts_ns[oa:ob], end_ns=None if end < 0 else end)

    def split_of(self, s: int) -> str:
        return self.runs[int(self.seq_run[s])]["split"]

    def sequences_in(self, split: str) -> list[int]:
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}; expected one of {SPLITS}")
        return [s for s in range(self.n_sequences) if self.split_of(s) == split]

    def rows_in(self, split: str) -> np.ndarray:
        return np.concatenate([np.arange(self.seq_offsets[s], self.seq_offsets[s + 1])
                               for s in self.sequences_in(split)] or [np.zeros(0, np.int64)])

    def scored_rows_in(self, split: str) -> np.ndarray:
        """The rows of ``split`` that carry a label (neither down nor censored)."""
        rows = self.rows_in(split)
        return rows[self.scored[rows]]

    def summary(self) -> dict:
        """Counts per split; a split's ``ticks`` and ``positive_ticks`` are over scored ticks, the
        masked ones are under ``masked_ticks`` (the top-level ``ticks`` counts every tick)."""
        out = {"sequences": self.n_sequences, "ticks": int(len(self.labels)), "features": len(self.feature_names),
               "masked_ticks": {}, "duplicate_runs": len(self.duplicates)}
        for split in SPLITS:
            seqs = self.sequences_in(split)
            all_rows = self.rows_in(split)
            rows = self.scored_rows_in(split)
            out[split] = {
                "runs": len({int(self.seq_run[s]) for s in seqs}),
                "sequences": len(seqs),
                "ticks": int(len(rows)),
                "positive_ticks": int(self.labels[rows].sum()) if len(rows) else 0,
                "ooms": int(sum(self.oom_offsets[s + 1] - self.oom_offsets[s] for s in seqs)),
                "workloads": sorted({self.runs[int(self.seq_run[s])]["workload"] for s in seqs}),
            }
            out["masked_ticks"][split] = {"down": int(self.down[all_rows].sum()),
                                          "censored": int((self.censored[all_rows] & ~self.down[all_rows]).sum())}
        return out

    def manifest(self) -> dict:
        return {"format": DATASET_FORMAT, "feature_names": list(self.feature_names), "horizon_s": self.horizon_s,
                "tick_s": self.tick_s, "inputs": dict(self.inputs), "runs": self.runs,
                "duplicates": list(self.duplicates), "summary": self.summary()}

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write ``<path>.npz`` and ``<path>.json``; returns both paths."""
        npz = Path(path).with_suffix(".npz")
        npz.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"features": self.features, "labels": self.labels, "ts_ns": self.ts_ns,
                  "seq_offsets": self.seq_offsets, "seq_run": self.seq_run,
                  "seq_node": np.asarray(self.seq_node, dtype=np.str_),
                  "oom_ts_ns": self.oom_ts_ns, "oom_offsets": self.oom_offsets,
                  "oom_up_ts_ns": self.oom_up_ts_ns, "seq_end_ns": self.seq_end_ns}
        arrays.update({f"firing_{k}": v.astype(np.uint8) for k, v in self.firing.items()})
        with open(npz, "wb") as fh:
            np.savez_compressed(fh, **arrays)
        manifest = npz.with_suffix(".json")
        manifest.write_text(json.dumps(self.manifest(), indent=1) + "\n")
        return npz, manifest

    @classmethod
    def load(cls, path: str | Path) -> "TickDataset":
        npz = Path(path).with_suffix(".npz")
        manifest_path = npz.with_suffix(".json")
        for p in (npz, manifest_path):
            if not p.exists():
                raise DatasetError(f"{p}: dataset file not found (build one with `kvguard dataset`)")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != DATASET_FORMAT:
            raise DatasetError(f"{manifest_path}: field 'format' is {manifest.get('format')!r}, "
                               f"expected {DATASET_FORMAT!r} (rebuild it with `kvguard dataset`)")
        with np.load(npz, allow_pickle=False) as z:
            missing = {"features", "labels", "ts_ns", "seq_offsets", "seq_run", "seq_node", "oom_ts_ns",
                       "oom_offsets", "oom_up_ts_ns", "seq_end_ns"} - set(z.files)
            if missing:
                raise DatasetError(f"{npz}: arrays missing: {sorted(missing)}")
            firing = {k[len("firing_"):]: z[k].astype(bool) for k in z.files if k.startswith("firing_")}
            ds = cls(feature_names=list(manifest["feature_names"]), features=z["features"], labels=z["labels"],
                     ts_ns=z["ts_ns"], seq_offsets=z["seq_offsets"], seq_run=z["seq_run"],
                     seq_node=[str(x) for x in z["seq_node"]], oom_ts_ns=z["oom_ts_ns"],
                     oom_offsets=z["oom_offsets"], firing=firing, runs=list(manifest["runs"]),
                     horizon_s=float(manifest["horizon_s"]), tick_s=float(manifest["tick_s"]),
                     inputs=dict(manifest.get("inputs", {})), oom_up_ts_ns=z["oom_up_ts_ns"],
                     seq_end_ns=z["seq_end_ns"], duplicates=list(manifest.get("duplicates", [])))
        if ds.features.shape[1] != len(ds.feature_names):
            raise DatasetError(f"{npz}: features has {ds.features.shape[1]} columns, manifest lists "
                               f"{len(ds.feature_names)} feature_names")
        return ds


def assemble(feature_names: list[str], runs: list[tuple[dict, list[Sequence]]], *,
             horizon_s: float = DEFAULT_HORIZON_S, tick_s: float = 10.0, inputs: dict | None = None,
             duplicates: list[dict] | None = None) -> TickDataset:
    """Concatenate runs of sequences into one dataset, labelling every tick (docs/ARCHITECTURE.md,
    "Alerts and prediction"); run counts are over scored ticks."""
    feats, labels, ts, ooms, ups, ends, seq_run, seq_node = [], [], [], [], [], [], [], []
    firing: dict[str, list[np.ndarray]] = {t: [] for t in TIERS_STORED}
    seq_lengths, oom_counts, run_rows = [], [], []
    for r, (run_info, seqs) in enumerate(runs):
        if run_info.get("split") not in SPLITS:
            raise DatasetError(f"run {r} ({run_info.get('workload')}): split {run_info.get('split')!r} "
                               f"not in {SPLITS}")
        n_ticks = n_ooms = n_pos = 0
        for seq in seqs:
            if seq.features.ndim != 2 or seq.features.shape[1] != len(feature_names):
                raise DatasetError(f"run {r} node {seq.node}: features shape {seq.features.shape}, "
                                   f"expected [L, {len(feature_names)}]")
            y = labels_for_ticks(seq.ts_ns, seq.oom_ts_ns, horizon_s)
            down, censored = seq.masks(horizon_s)
            scored = ~(down | censored)
            feats.append(seq.features.astype(np.float32))
            labels.append(y)
            ts.append(seq.ts_ns.astype(np.int64))
            order = np.argsort(seq.oom_ts_ns, kind="mergesort")
            ooms.append(np.asarray(seq.oom_ts_ns, np.int64)[order])
            ups.append(seq.up_times()[order])
            ends.append(-1 if seq.end_ns is None else int(seq.end_ns))
            for tier in TIERS_STORED:
                firing[tier].append(np.asarray(seq.firing.get(tier, np.zeros(len(y), bool)), dtype=bool))
            seq_run.append(r)
            seq_node.append(seq.node)
            seq_lengths.append(len(y))
            oom_counts.append(len(seq.oom_ts_ns))
            n_ticks += int(scored.sum())
            n_ooms += len(seq.oom_ts_ns)
            n_pos += int(y[scored].sum())
        run_rows.append(dict(run_info, ticks=n_ticks, ooms=n_ooms, positive_ticks=n_pos))
    n_features = len(feature_names)
    return TickDataset(
        feature_names=list(feature_names),
        features=np.concatenate(feats) if feats else np.zeros((0, n_features), np.float32),
        labels=np.concatenate(labels) if labels else np.zeros(0, np.uint8),
        ts_ns=np.concatenate(ts) if ts else np.zeros(0, np.int64),
        seq_offsets=np.r_[0, np.cumsum(seq_lengths)].astype(np.int64),
        seq_run=np.asarray(seq_run, dtype=np.int32),
        seq_node=seq_node,
        oom_ts_ns=np.concatenate(ooms) if ooms else np.zeros(0, np.int64),
        oom_offsets=np.r_[0, np.cumsum(oom_counts)].astype(np.int64),
        firing={t: (np.concatenate(v) if v else np.zeros(0, bool)) for t, v in firing.items()},
        runs=run_rows, horizon_s=horizon_s, tick_s=tick_s, inputs=dict(inputs or {}),
        oom_up_ts_ns=np.concatenate(ups) if ups else np.zeros(0, np.int64),
        seq_end_ns=np.asarray(ends, dtype=np.int64), duplicates=list(duplicates or []))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def synthetic_sequences(n_sequences: int, length: int, feature_names: list[str], *, seed: int = 0,
                        tick_s: float = 10.0, oom_rate_per_hour: float = 1.5) -> list[Sequence]:
    """Toy sequences where U_kv climbs for a few minutes before each OOM, for tests of the learning
    machinery only (no engine). Column ``u_kv`` (if present) carries the signal; others are noise
    plus a weak copy of it, so a model has something to learn and something to ignore."""
    rng = np.random.default_rng(seed)
    tick_ns = int(tick_s * NS_PER_S)
    u_col = feature_names.index("u_kv") if "u_kv" in feature_names else 0
    out = []
    for s in range(n_sequences):
        ts = np.arange(length, dtype=np.int64) * tick_ns
        u = 0.45 + 0.05 * rng.standard_normal(length)
        n_ooms = rng.poisson(oom_rate_per_hour * length * tick_s / 3600.0)
        ooms = np.sort(rng.choice(np.arange(60, length), size=min(n_ooms, length // 90), replace=False)) \
            if length > 60 and n_ooms else np.zeros(0, np.int64)
        kept = []
        for k in ooms:
            if kept and k - kept[-1] < 80:
                continue
            kept.append(int(k))
            ramp = int(rng.integers(30, 55))  # 5-9 minutes of climbing
            a = max(0, k - ramp)
            u[a:k] = np.linspace(0.5, 0.99, k - a) + 0.01 * rng.standard_normal(k - a)
            u[k:k + 6] = 0.0  # the engine is down, then restarts empty
        feats = rng.standard_normal((length, len(feature_names))).astype(np.float32)
        feats[:, u_col] = np.clip(u, 0, 1)
        if len(feature_names) > 1:
            feats[:, (u_col + 1) % len(feature_names)] += 2.0 * np.clip(u, 0, 1)
        oom_ts = np.asarray(kept, dtype=np.int64) * tick_ns - tick_ns // 2  # between ticks k-1 and k
        up_ts = (np.asarray(kept, dtype=np.int64) + 5) * tick_ns  # ticks k .. k+5 are down
        out.append(Sequence(node=f"synthetic-{seed}/gpu{s}", ts_ns=ts, features=feats, oom_ts_ns=oom_ts,
                            firing={"threshold": u > 0.9, "slope": np.r_[False, np.diff(u) > 0.01]},
                            oom_up_ts_ns=up_ts, end_ns=int(ts[-1]) if length else None))
    return out


# Rates are per single GPU of the default profile, around each workload's tipping point (from no OOM
# to a crash loop), so the data holds calm hours, sporadic OOMs and crash loops. Trace workloads
# with recorded arrivals (Azure, Mooncake) replay identically for every seed, so they vary by rate
# instead; Poisson-arrival workloads (ShareGPT lengths, scenarios) vary by seed too.
BIG = "llama3-70b-tp8-80gb"
SMALL = "llama3-8b-24gb"
TRAIN_RUNS = [  # (workload, rate scales, seeds, profile[, GPUs per fleet])
    ("azure-code", (0.22, 0.25, 0.28, 0.31, 0.34, 0.37, 0.4, 0.45), (0,), SMALL),
    ("sharegpt-sample", (0.12, 0.15, 0.2), (0, 1, 2), SMALL),
    ("mixed", (0.22, 0.25, 0.3), (0, 1, 2), SMALL),
    ("sessions", (0.05, 0.07, 0.1), (0, 1, 2), SMALL),
    ("rag", (0.02, 0.03, 0.05), (0, 1, 2), SMALL),
    ("sessions", (1.0, 1.5), (0, 1), BIG),
    ("rag", (0.5, 0.8), (0, 1), BIG),
    ("mixed", (1.5,), (0,), BIG),
    # a 4-GPU fleet behind the router near its edge: OOMs are rarer, separate events
    ("azure-code", (1.0, 1.1, 1.2, 1.3), (0,), SMALL, 4),
]
VAL_RUNS = [
    ("azure-code", (0.265, 0.33, 0.42), (0,), SMALL),
    ("sharegpt-sample", (0.15, 0.2), (3,), SMALL),
    ("mixed", (0.25, 0.3), (3,), SMALL),
    ("sessions", (0.07,), (3,), SMALL),
    ("rag", (0.03,), (3,), SMALL),
    ("sessions", (1.2,), (3,), BIG),
    ("rag", (0.6,), (3,), BIG),
    ("azure-code", (1.15,), (0,), SMALL, 4),
]
# Held out of training and validation entirely: another Azure service (conversation) and Mooncake's
# long prompts with prefix reuse.
TEST_RUNS = [
    ("azure-conv", (0.4, 0.43), (0,), SMALL),
    ("azure-conv", (1.5, 1.6), (0,), SMALL, 4),
    ("mooncake-sample", (0.01,), (0,), SMALL),
    ("mooncake-sample", (0.06, 0.1), (0,), BIG),
]
HELD_OUT_WORKLOADS = ("azure-conv", "mooncake-sample")


def _grid(runs: list, split: str, duration_s: float) -> list[RunSpec]:
    return [RunSpec(w, rate_scale=r, profile=p, seed=s, duration_s=duration_s, n_gpus=rest[0] if rest else 1,
                    split=split)
            for w, rates, seeds, p, *rest in runs for r in rates for s in seeds]


def preset_shipped() -> list[RunSpec]:
    """The shipped model's data: one simulated hour per run; ``val`` calibrates the threshold."""
    return _grid(TRAIN_RUNS, "train", 3600.0) + _grid(VAL_RUNS, "val", 3600.0) + _grid(TEST_RUNS, "test", 3600.0)


def preset_small() -> list[RunSpec]:
    """The same runs at 30 minutes each, for trying changes quickly."""
    return _grid(TRAIN_RUNS, "train", 1800.0) + _grid(VAL_RUNS, "val", 1800.0) + _grid(TEST_RUNS, "test", 1800.0)


def preset_tiny() -> list[RunSpec]:
    """Seconds of work: the integration test's data."""
    return [RunSpec("azure-code", 0.4, seed=0, duration_s=900, split="train"),
            RunSpec("sharegpt-sample", 0.3, seed=1, duration_s=900, split="train"),
            RunSpec("azure-code", 0.35, seed=0, duration_s=900, split="val"),
            RunSpec("azure-conv", 0.5, seed=0, duration_s=900, split="test")]


VLLM = "llama3-8b-24gb-vllm"
# The vLLM-faithful engine OOMs only outside vLLM's defaults: (workload, rate scales, seeds, utilization,
# prompt-logprob shares[, GPUs]); the share sets how often a GPU crashes (0.5 % sporadic, 2 % often), 0.9
# runs are calm hours. Same workload split as the seed preset: azure-conv and Mooncake held out.
VLLM_TRAIN_RUNS = [
    ("azure-code", (1.0, 1.5), (0,), (0.95,), (0.005, 0.02), 4),
    ("sharegpt-sample", (1.0,), (0, 1), (0.95,), (0.005, 0.02), 4),
    ("mixed", (1.5, 2.25), (0, 1), (0.95,), (0.01,), 4),
    ("sessions", (1.5,), (0, 1), (0.95,), (0.01, 0.02), 4),
    ("rag", (2.0,), (0,), (0.95,), (0.01,), 4),
    ("mixed", (2.25,), (2,), (0.9,), (0.05,), 4),
]
VLLM_VAL_RUNS = [
    ("azure-code", (1.25,), (0,), (0.95,), (0.01,), 4),
    ("sharegpt-sample", (1.0,), (3,), (0.95,), (0.01,), 4),
    ("mixed", (2.0,), (3,), (0.95,), (0.01,), 4),
    ("sessions", (1.5,), (3,), (0.95,), (0.005,), 4),
]
VLLM_TEST_RUNS = [
    ("azure-conv", (1.0, 1.5), (0,), (0.95,), (0.005, 0.01), 4),
    ("mooncake-sample", (0.05,), (0, 1), (0.95,), (0.02,), 4),
]


def _vllm_grid(runs: list, split: str, duration_s: float) -> list[RunSpec]:
    return [RunSpec(w, rate_scale=r, profile=VLLM, seed=s, duration_s=duration_s, n_gpus=gpus, split=split,
                    gpu_memory_utilization=u, prompt_logprobs_frac=f)
            for w, rates, seeds, utils, fracs, gpus in runs for r in rates for s in seeds for u in utils for f in fracs]


def preset_vllm() -> list[RunSpec]:
    """The vLLM-faithful default engine under the operator's knobs: 30 simulated minutes per run."""
    return (_vllm_grid(VLLM_TRAIN_RUNS, "train", 1800.0) + _vllm_grid(VLLM_VAL_RUNS, "val", 1800.0)
            + _vllm_grid(VLLM_TEST_RUNS, "test", 1800.0))


def preset_trend() -> list[RunSpec]:
    """TREND classes (leak, neighbour, ramping demand) on the vLLM-faithful engine (``kvguard.ml.trend``)."""
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.trend import preset_trend as trend

    return trend()


def preset_trend_tiny() -> list[RunSpec]:
    # kvguard.ml.dataset imports this module's hooks: imported here to avoid the cycle
    from kvguard.ml.trend import preset_trend_tiny as tiny

    return tiny()


PRESETS = {"shipped": preset_shipped, "small": preset_small, "tiny": preset_tiny, "vllm": preset_vllm,
           "trend": preset_trend, "trend-tiny": preset_trend_tiny}


def spec_dict(spec: RunSpec) -> dict:
    return asdict(spec)


def run_fingerprint(sequences: list[Sequence]) -> str:
    """sha256 over every node's tick times, features and OOM times: equal for identical runs."""
    h = hashlib.sha256()
    for seq in sequences:
        for array in (seq.ts_ns, seq.features, seq.oom_ts_ns):
            h.update(np.ascontiguousarray(array).tobytes())
        h.update(seq.node.encode())
    return h.hexdigest()


TIER_OF_RULE_TIER = {1: "threshold", 2: "slope", 3: "lstm"}


@dataclass(slots=True)
class RunRecord:
    """Everything one simulated run produced that training and evaluation use."""

    spec: RunSpec
    sequences: list[Sequence]
    ticks: dict[str, list] = field(default_factory=dict)  # node -> Tick objects (only if keep_ticks)
    summary: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    seconds: float = 0.0


def firing_by_tier(ts_ns: np.ndarray, transitions: list[tuple[int, str, int, bool]]) -> dict[str, np.ndarray]:
    """Per tier, whether any of its rules was firing at each tick, from one node's alert transitions
    (ts_ns, rule, tier, firing) in emission order; an alert emitted at a tick counts at that tick."""
    out = {name: np.zeros(len(ts_ns), dtype=bool) for name in TIER_OF_RULE_TIER.values()}
    rules: dict[str, tuple[int, list[tuple[int, bool]]]] = {}
    for ts, rule, tier, firing in transitions:
        rules.setdefault(rule, (tier, []))[1].append((ts, firing))
    for tier, changes in rules.values():
        times = np.array([t for t, _ in changes], dtype=np.int64)
        states = np.array([f for _, f in changes], dtype=bool)
        k = np.searchsorted(times, ts_ns, side="right") - 1
        out[TIER_OF_RULE_TIER[tier]] |= np.where(k >= 0, states[np.maximum(k, 0)], False)
    return out


def simulate_run(spec: RunSpec, *, tick_s: float = 10.0, predictor=None, keep_ticks: bool = False,
                 flush_every_s: float = 1.0, stream_config: StreamConfig | None = None) -> RunRecord:
    """Run a workload through the shadow engine (baseline: no policy) and the stream core, tick by tick.

    Returns per node the tick features (``streams.metrics.tick_features``), OOM times (from the
    ``oom`` events themselves) and each tier's firing, as the alert rules decided it. With a
    ``predictor`` the core also runs tier 3 (``kvguard eval``); without one it is tiers 1-2 only.
    ``stream_config``: the core's, as the commands take it from the composition root
    (``Graph.stream_config``); default: the core's defaults at ``tick_s``, tier 3 at the model's
    calibrated threshold.
    """

    started = time.monotonic()
    # vLLM-engine runs keep the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): its unchunked prompt
    # logprobs are the OOM regime these presets and the shipped models were built on; 0.33's default
    # runner computes them 1024 positions at a time and rarely OOMs there (docs/NODE_MEMORY.md)
    runner = "v1" if engine_kind(load_profile(spec.profile)).takes_knobs else None
    knobs = EngineKnobs(gpu_memory_utilization=spec.gpu_memory_utilization, model_runner=runner)
    profile = load_profile(spec.profile, knobs=knobs)
    from kvguard.ml.trend import external_config, trend_workload  # the TREND classes' hooks

    workload = trend_workload(spec, max_prompt_tokens=prompt_cap_tokens(profile)) if spec.ramp != 1.0 else \
        load_workload(spec.workload, rate_scale=spec.rate_scale, window=spec.duration_s, seed=spec.seed,
                      max_prompt_tokens=prompt_cap_tokens(profile))
    kind = engine_kind(profile)
    engine_config = kind.node_config(prompt_logprobs_frac=spec.prompt_logprobs_frac, **external_config(spec)) \
        if kind.capabilities.prompt_logprobs else None
    fleet = Fleet(spec.n_gpus, profile, seed=spec.seed, config=engine_config)
    fleet.submit_workload(workload)
    config = stream_config
    if config is None:
        config = StreamConfig(tick_s=tick_s)
        if getattr(predictor, "threshold", None) is not None:  # the model's calibrated operating point
            config = with_model_threshold(config, predictor)
    core = StreamCore(config, predictor=predictor)
    feats: dict[str, list[np.ndarray]] = {n: [] for n in fleet.nodes}
    times: dict[str, list[int]] = {n: [] for n in fleet.nodes}
    ooms: dict[str, list[int]] = {n: [] for n in fleet.nodes}
    ups: dict[str, list[int]] = {n: [] for n in fleet.nodes}
    engine_of = {e.node: e for e in fleet.engines}
    transitions: dict[str, list] = {n: [] for n in fleet.nodes}
    scores: dict[str, list[float]] = {n: [] for n in fleet.nodes}
    kept: dict[str, list] = {n: [] for n in fleet.nodes}

    def absorb(ticks, alerts):
        for tick in ticks:
            feats[tick.node].append(tick_features(tick))
            times[tick.node].append(tick.ts_ns)
            scores[tick.node].append(np.nan if tick.p_oom is None else tick.p_oom)
            if keep_ticks:
                kept[tick.node].append(tick)
        for alert in alerts:
            transitions[alert.node].append((alert.ts_ns, alert.rule, alert.tier, alert.state == FIRING))

    end_ns = int(spec.duration_s * NS_PER_S)
    step_ns = int(flush_every_s * NS_PER_S)
    for _, batches in fleet.steps(end_ns, step_ns=step_ns):
        for b in batches:
            oom_rows = b.events["kind"] == EventKind.OOM
            if oom_rows.any():
                ooms[b.node].extend(int(t) for t in b.events["ts_ns"][oom_rows])
                # the engine is down until then (an OOM restarts it; two OOMs of one GPU are
                # further apart than one flush step, so this is the latest OOM's restart)
                ups[b.node].extend([int(engine_of[b.node].down_until_ns)] * int(oom_rows.sum()))
        absorb(*core.process_many(batches))
    absorb(*core.flush(end_ns))
    sequences = []
    for node in fleet.nodes:
        ts = np.asarray(times[node], dtype=np.int64)
        features = np.stack(feats[node]) if feats[node] else np.zeros((0, len(FEATURE_NAMES)), np.float32)
        sequences.append(Sequence(node=node, ts_ns=ts, features=features.astype(np.float32),
                                  oom_ts_ns=np.asarray(ooms[node], dtype=np.int64),
                                  oom_up_ts_ns=np.asarray(ups[node], dtype=np.int64), end_ns=end_ns,
                                  firing=firing_by_tier(ts, transitions[node]),
                                  p_oom=np.asarray(scores[node], dtype=np.float64) if predictor else None))
    return RunRecord(spec=spec, sequences=sequences, ticks=kept if keep_ticks else {},
                     summary=fleet.summary().to_dict(), workload=workload.describe(),
                     seconds=time.monotonic() - started)



def workload_inputs(workload: str) -> dict[str, str]:
    """{source: sha256} for a trace workload (file or bundled alias); {} for a named scenario."""
    if workload in SCENARIOS:
        return {}
    path = resolve_trace_path(workload)
    if path is None or not Path(path).exists():
        raise DatasetError(f"workload {workload!r}: no such trace file, alias or scenario")
    return {str(Path(path).name): file_sha256(path)}


def build_dataset(specs: list[RunSpec], *, tick_s: float = 10.0, progress=None,
                  stream_config: StreamConfig | None = None) -> TickDataset:
    """Simulate every run and assemble the dataset. ``progress(i, n, spec, record)`` after each run;
    ``stream_config``: the stream core's (default: its defaults at ``tick_s``).

    A run identical to an earlier one (``run_fingerprint``; a trace workload ignores the seed) is
    not kept twice: it would count the same OOMs twice, or put one run in two splits."""
    inputs: dict[str, str] = {}
    runs = []
    kept: dict[str, str] = {}  # fingerprint -> key of the run kept
    duplicates = []
    for i, spec in enumerate(specs):
        if spec.split not in SPLITS:
            raise DatasetError(f"run {i} ({spec.key()}): split {spec.split!r} not in {SPLITS}")
        inputs.update(workload_inputs(spec.workload))
        record = simulate_run(spec, tick_s=tick_s, stream_config=stream_config)
        fingerprint = run_fingerprint(record.sequences)
        if fingerprint in kept:
            duplicates.append({"key": spec.key(), "split": spec.split, "same_as": kept[fingerprint]})
        else:
            kept[fingerprint] = spec.key()
            info = dict(spec_dict(spec), key=spec.key(), engine=record.summary,
                        requests=record.workload.get("requests", None))
            runs.append((info, record.sequences))
        if progress:
            progress(i + 1, len(specs), spec, record)
    return assemble(list(FEATURE_NAMES), runs, tick_s=tick_s, inputs=inputs, duplicates=duplicates)


# -- datasets from recorded event logs ----------------------------------------------------------------

_UP_KINDS = np.array([int(EventKind.ADMIT), int(EventKind.STEP)], dtype=np.int64)


@dataclass(slots=True)
class LogRecord:
    """What one event log gives a dataset: its header, per-node sequences and where it ends."""

    path: str
    meta: dict
    sequences: list[Sequence]
    end_ns: int
    batches: int = 0
    events: int = 0


def sequences_from_log(path: str | Path, *, tick_s: float = 10.0, chunk_batches: int = 256,
                       progress=None, stream_config: StreamConfig | None = None) -> LogRecord:
    """One node sequence per node of a recorded event log (``kvguard simulate --events-out`` or
    ``kvguard record``), computed by the same stream core as a simulated run.

    OOM times are the log's ``oom`` rows. A log does not say when a restarted GPU was up again, so the
    GPU counts as down from each OOM to its next scheduled step (an ``admit`` or ``step`` row), or past
    the end of the log when none follows: an upper bound of the true downtime, so down ticks are never
    labelled. The log is observed to the later of its last event and the header's ``duration_s``
    (``end_ns``); ticks whose horizon reaches past it are censored, as in a simulated run."""
    meta, batches = read_event_log(path)
    core = StreamCore(stream_config if stream_config is not None else StreamConfig(tick_s=tick_s))
    feats: dict[str, list[np.ndarray]] = {}
    times: dict[str, list[int]] = {}
    transitions: dict[str, list] = {}
    ooms: dict[str, list[int]] = {}
    up_rows: dict[str, list[np.ndarray]] = {}  # node -> ts of rows that show the engine scheduling
    record = LogRecord(path=str(path), meta=meta, sequences=[], end_ns=0)

    def absorb(ticks, alerts) -> None:
        for tick in ticks:
            feats.setdefault(tick.node, []).append(tick_features(tick))
            times.setdefault(tick.node, []).append(tick.ts_ns)
        for alert in alerts:
            transitions.setdefault(alert.node, []).append((alert.ts_ns, alert.rule, alert.tier, alert.state == FIRING))

    chunk: list = []
    last_ns = 0
    for batch in batches:
        record.batches += 1
        ev = batch.events
        record.events += len(ev)
        ooms.setdefault(batch.node, [])
        if len(ev):
            kinds, ts = ev["kind"].astype(np.int64), ev["ts_ns"].astype(np.int64)
            last_ns = max(last_ns, int(ts.max()))
            oom_rows = kinds == int(EventKind.OOM)
            if oom_rows.any():
                ooms[batch.node].extend(int(t) for t in ts[oom_rows])
            up = np.isin(kinds, _UP_KINDS)
            if up.any():
                up_rows.setdefault(batch.node, []).append(ts[up])
        chunk.append(batch)
        if len(chunk) >= chunk_batches:
            absorb(*core.process_many(chunk))
            chunk = []
            if progress:
                progress(record.batches)
    if chunk:
        absorb(*core.process_many(chunk))
    duration_s = meta.get("duration_s")
    end_ns = max(last_ns, int(float(duration_s) * NS_PER_S) if isinstance(duration_s, (int, float)) else 0)
    absorb(*core.flush(end_ns))
    record.end_ns = end_ns
    for node in sorted(set(times) | set(ooms)):
        ts = np.asarray(times.get(node, []), dtype=np.int64)
        features = (np.stack(feats[node]) if feats.get(node) else np.zeros((0, len(FEATURE_NAMES)))).astype(np.float32)
        oom_ts = np.sort(np.asarray(ooms.get(node, []), dtype=np.int64))
        scheduled = np.sort(np.concatenate(up_rows[node])) if up_rows.get(node) else np.zeros(0, np.int64)
        k = np.searchsorted(scheduled, oom_ts, side="right")  # first scheduling row after each OOM
        up_ts = np.where(k < len(scheduled), scheduled[np.minimum(k, max(len(scheduled) - 1, 0))], end_ns + 1)
        record.sequences.append(Sequence(node=node, ts_ns=ts, features=features, oom_ts_ns=oom_ts,
                                         oom_up_ts_ns=np.maximum(up_ts, oom_ts).astype(np.int64), end_ns=end_ns,
                                         firing=firing_by_tier(ts, transitions.get(node, []))))
    return record


def log_run_info(record: LogRecord, split: str) -> dict:
    """A run row for a log: the header's workload (else the file name) so that leave-one-workload-out
    and the split rules treat it like a simulated run."""
    meta = record.meta
    workload = str(meta.get("workload") or Path(record.path).name)
    return {"workload": workload, "rate_scale": meta.get("rate_scale"), "profile": meta.get("profile"),
            "seed": meta.get("seed"), "n_gpus": len(record.sequences), "split": split, "source": "events",
            "events_file": Path(record.path).name, "key": f"events:{Path(record.path).name}",
            "batches": record.batches, "events": record.events}


def dataset_from_logs(paths: list[str | Path], splits: list[str], *, tick_s: float = 10.0,
                      progress=None, stream_config: StreamConfig | None = None) -> TickDataset:
    """A dataset from recorded event logs, one run per log; ``splits`` holds one split for all or one
    per log. ``progress(i, n, path, record)`` after each log. Identical logs are kept once.
    ``stream_config``: the stream core's (default: its defaults at ``tick_s``)."""
    if len(splits) not in (1, len(paths)):
        raise DatasetError(f"--split: give one split for all logs or one per log ({len(paths)}), got {len(splits)}")
    runs, inputs, kept, duplicates = [], {}, {}, []
    for i, path in enumerate(paths):
        split = splits[0] if len(splits) == 1 else splits[i]
        if split not in SPLITS:
            raise DatasetError(f"--split {split!r}: expected one of {SPLITS}")
        record = sequences_from_log(path, tick_s=tick_s, stream_config=stream_config)
        inputs[Path(path).name] = file_sha256(path)
        fingerprint = run_fingerprint(record.sequences)
        info = log_run_info(record, split)
        if fingerprint in kept:
            duplicates.append({"key": info["key"], "split": split, "same_as": kept[fingerprint]})
        else:
            kept[fingerprint] = info["key"]
            runs.append((info, record.sequences))
        if progress:
            progress(i + 1, len(paths), path, record)
    return assemble(list(FEATURE_NAMES), runs, tick_s=tick_s, inputs=inputs, duplicates=duplicates)
