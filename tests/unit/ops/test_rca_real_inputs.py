"""`kvguard rca` on what real engines write (issue 27 "Real inputs"): the vLLM plugin's rows at a CUDA OOM
(its OOM observer's figures as an OOM_STEP DEVICE row, the running requests from its lifecycle rows), and
the allocator part from a PyTorch snapshot of the crashing process (`--snapshot`, the public snapshots in
tests/data/torch_snapshots). The recorded Kafka log is tests/integration/test_rca_recorded.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from kvguard.cli import app
from kvguard.contracts.events import EventKind, Outcome
from kvguard.ops import rca
from kvguard.producers.torch_cuda import CudaMemoryObserver
from kvguard.producers.torch_snapshot.figures import snapshot_figures
from kvguard.producers.torch_snapshot.snapshot import load_snapshot
from kvguard.producers.torch_snapshot.to_events import snapshot_to_batches
from kvguard.producers.vllm.translator import ListSink, VllmEventTranslator, geometry_for_blocks
from kvguard.runtime.bootstrap import bootstrap
from kvguard.wire.eventlog import write_event_log

DATA = Path(__file__).resolve().parents[2] / "data" / "torch_snapshots"
GiB, MiB = 1 << 30, 1 << 20
runner = CliRunner()


class _Cuda:
    """What the observer reads of ``torch.cuda`` on a GPU, with the figures of one crash (no GPU here)."""

    def __init__(self, reserved: int, allocated: int):
        self.stats = {"reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated}

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def current_device(self):
        return 0

    def memory_stats(self, device):
        return dict(self.stats)


def _plugin_oom_log():
    clock = iter(range(10**9, 10**12, 10**6))
    sink = ListSink()
    tr = VllmEventTranslator("pod-a/gpu0", geometry_for_blocks(2001, 16, 131072, total_bytes=80 * GiB,
                                                               weights_bytes=16 * GiB, gpu_memory_utilization=0.95),
                             sink, clock_ns=lambda: next(clock), epoch=3)
    for k, (prompt, logprobs) in enumerate([(6000, True), (300, False), (500, False)]):
        tr.on_arrive(f"r{k}", prompt, 64, 0, prompt_logprobs=logprobs)
        tr.on_admit(f"r{k}")
    tr.on_finish("r2", Outcome.COMPLETED, 64)
    tr.on_step(6800, 2)
    torch = SimpleNamespace(cuda=_Cuda(reserved=3 * GiB, allocated=2 * GiB + 512 * MiB), _C=SimpleNamespace())
    obs = CudaMemoryObserver(tr, torch)
    obs._on_oom(0, 2 * GiB, 75 * GiB, 700 * MiB)  # PyTorch's observer: device, requested, total, device free
    return sink.batches


def test_the_plugins_oom_is_explained_from_its_observer_and_lifecycle_rows():
    batches = _plugin_oom_log()
    kinds = [int(k) for b in batches for k in b.events["kind"]]
    assert kinds.index(int(EventKind.OOM_STEP)) == kinds.index(int(EventKind.OOM)) - 1
    core = bootstrap(predictor=None).stream_core(with_predictor=False)
    (r,) = rca.analyse(rca.replay(batches, core))
    ex = r.explanation
    assert r.cause_key == "allocator:peak" and ex["allocator_reason"] == "peak"
    assert (ex["device_free_bytes"], ex["reserved_bytes"], ex["allocated_bytes"]) == (700 * MiB, 3 * GiB,
                                                                                     2 * GiB + 512 * MiB)
    assert ex["reserved_unallocated_bytes"] == 512 * MiB and ex["requested_bytes"] == 2 * GiB
    # r2 finished before the crash: the step's requests are the two still running, with their shapes
    assert [(q["prompt_tokens"], q["prompt_logprobs"]) for q in ex["requests"]] == [(6000, True), (300, False)]
    assert ex["step_source"].startswith("reconstructed")
    util = [p for p in ex["prevention"] if p.startswith("--gpu-memory-utilization")]
    assert util and float(util[0].split()[1]) < 0.95


def test_snapshot_figures_are_the_snapshots_own():
    figs = snapshot_figures(DATA / "cs336_silmont2000_mem_snapshot.pickle")
    assert figs["reserved_bytes"] - figs["allocated_bytes"] == figs["reserved_unallocated_bytes"] > 0
    assert 0 < figs["largest_free_block_bytes"] <= figs["reserved_unallocated_bytes"]
    assert figs["expandable_segments"] is False and figs["requested_bytes"] is None


def test_rca_with_a_snapshot_of_the_crashing_process_reads_its_allocator_figures(tmp_path):
    """The snapshot's OOM entry (PyTorch's trace records the request and device free) on the log the
    snapshot becomes (`kvguard ingest torch-snapshot`); with --snapshot the report takes the largest free
    block and what empty_cache() could return from the snapshot, and a request the cached bytes covered but
    no block did is the allocator's fragmentation, with expandable_segments to prevent it."""
    snapshot = load_snapshot(DATA / "cs336_silmont2000_mem_snapshot.pickle")
    trace = snapshot["device_traces"][0]
    figs0 = snapshot_figures(DATA / "cs336_silmont2000_mem_snapshot.pickle")
    asked = figs0["largest_free_block_bytes"] + 64 * MiB  # more than any free block, less than the cached bytes
    trace.append({"action": "oom", "size": asked, "device_free": 1 * MiB, "stream": 0,
                  "time_us": trace[-1]["time_us"] + 1000})
    batches, _ = snapshot_to_batches(snapshot, "snap/gpu0")
    log = tmp_path / "oom.jsonl.gz"
    write_event_log(log, batches, {"nodes": ["snap/gpu0"]})
    snap_path = tmp_path / "snap.pickle"
    snap_path.write_bytes(pickle.dumps(snapshot))
    plain = runner.invoke(app, ["rca", "--events", str(log), "--no-lstm", "--tick", "100ms", "--json"])
    with_snap = runner.invoke(app, ["rca", "--events", str(log), "--no-lstm", "--tick", "100ms", "--json",
                                    "--snapshot", str(snap_path)])
    assert plain.exit_code == 0 and with_snap.exit_code == 0, with_snap.output
    a, b = json.loads(plain.stdout)["ooms"][0]["explanation"], json.loads(with_snap.stdout)
    ex = b["ooms"][0]["explanation"]
    assert b["snapshot"]["requested_bytes"] == asked and b["snapshot"]["device_free_bytes"] == 1 * MiB
    assert ex["largest_free_block_bytes"] == figs0["largest_free_block_bytes"] < asked
    assert ex["allocator_reason"] == "fragmentation"
    assert any("expandable_segments:True" in p for p in ex["prevention"])
    assert any("empty_cache() could return" in d for d in ex["details"])
    assert not any("empty_cache() could return" in d for d in a["details"])
    bad = runner.invoke(app, ["rca", "--events", str(log), "--no-lstm", "--snapshot", str(log)])
    assert bad.exit_code == 2 and "--snapshot" in bad.output
