"""kvguard's SGLang plugin inside SGLang 0.5.23's own scheduler parts, for tests/integration/test_sglang_plugin.py.

Run as a subprocess. SGLang's real ``load_plugins()`` finds kvguard's ``sglang.srt.plugins`` entry
point (``SGLANG_PLUGINS=kvguard``) and applies its hooks with SGLang's ``HookRegistry``: the script
reports which of SGLang's methods are now wrapped. ``Scheduler`` itself cannot be built on CPU (it
needs a model worker), so the plugin is attached to a facade over the conformance harness's real
components (``producers.sim.sglang.reference.Reference``: SGLang's allocator, radix cache,
``PrefillAdder``, ``ScheduleBatch``), and the script calls around each step what the
``get_next_batch_to_run`` hook calls (``before_step`` / ``after_step``). ``retract_decode`` is
SGLang's, hooked for real. Mid-run, kvguard's engine-port adapter retracts one request, holds long
prompts, and sets a headroom.

Prints one JSON object: the hooks, SGLang's own figures at every snapshot, what kvguard's mirror
rebuilt from the plugin's batches at the same moments, and the actions' outcomes.
"""

from __future__ import annotations

import json
import os
import sys


class Facade:
    """The attributes of ``Scheduler`` the plugin reads and writes, over ``Reference``."""

    def __init__(self, ref):
        self.ref = ref
        self.token_to_kv_pool_allocator = ref.alloc
        self.tree_cache = ref.tree
        self.req_to_token_pool = ref.rows
        self.last_batch = None

    running_batch = property(lambda self: self.ref.running)
    chunked_req = property(lambda self: self.ref.chunked)
    waiting_queue = property(lambda self: self.ref.waiting, lambda self, v: setattr(self.ref, "waiting", v))
    chunked_prefill_size = property(lambda self: self.ref.chunked_prefill_size,
                                    lambda self, v: setattr(self.ref, "chunked_prefill_size", v))
    max_prefill_tokens = property(lambda self: self.ref.max_prefill_tokens,
                                  lambda self, v: setattr(self.ref, "max_prefill_tokens", v))

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        self.ref.waiting.append(req)


def main() -> int:
    # the stand-ins must be in place before SGLang is imported (producers/sim/sglang/cpu_imports.py)
    from kvguard.producers.sim.sglang import cpu_imports

    cpu_imports.install()
    os.environ["SGLANG_PLUGINS"] = "kvguard"
    import logging

    logging.disable(logging.WARNING)
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    targets = ((Scheduler, "__init__"), (Scheduler, "get_next_batch_to_run"), (Scheduler, "get_prefill_adder_class"),
               (ScheduleBatch, "retract_decode"))
    before = {name: getattr(cls, name) for cls, name in targets}
    load_plugins()
    from kvguard.producers.sglang.plugin import HOOKS

    ours = {hook for _, hook, _ in HOOKS}
    registered = {target.rsplit(".", 1)[-1] for target, hooks in HookRegistry._hooks.items()
                  if any(h in ours for _, h, _ in hooks)}
    # a method is hooked when SGLang's registry replaced it after kvguard registered a hook on it
    hooked = {name: getattr(cls, name) is not before[name] and name in registered for cls, name in targets}

    from kvguard.contracts.events import EventKind
    from kvguard.producers.sglang import plugin as sglang_plugin
    from kvguard.producers.sglang.plugin import SglangPluginConfig
    from kvguard.producers.sim.sglang.conformance import conformance_requests
    from kvguard.producers.sim.sglang.reference import Reference
    from kvguard.producers.vllm.translator import ListSink
    from kvguard.streams.mirror import AllocatorMirror
    from tests.integration.test_sglang_conformance import long_outputs

    config = {"page_size": 1, "max_total_num_tokens": 4000, "max_running_requests": 32, "max_prefill_tokens": 16384,
              "chunked_prefill_size": 512, "schedule_conservativeness": 1.0, "context_len": 8192}
    ref = Reference(config)
    facade = Facade(ref)
    sink = ListSink()
    clock = {"ns": 0}
    plugin = sglang_plugin.attach(facade, config=SglangPluginConfig(node_id="cpu/sglang0", snapshot_every_s=0.25),
                                  sink=sink, clock_ns=lambda: clock["ns"])
    ref.adder_class = plugin.actions.adder_class(ref.adder_class)
    mirror = AllocatorMirror(plugin.geometry)
    applied = 0
    pending = list(conformance_requests(long_outputs(60)))
    snapshots, actions, retracted_by_sglang = [], {}, 0
    step = 0
    held_seen = 0
    while step < 2500 and (pending or ref.unfinished):
        while pending and pending[0].arrival_step <= step:
            ref.add(pending.pop(0).to_json())
        clock["ns"] += 25_000_000
        held = plugin.before_step()
        out = ref.step()
        batch = ref.last if out["kind"] == "prefill" else (ref.running if out["kind"] == "decode" else None)
        facade.last_batch = ref.last
        plugin.after_step(held, batch)
        retracted_by_sglang += len(out["retracted"])
        for b in sink.batches[applied:]:
            mirror.apply(b.events, b.state)
            if b.state is not None:
                m = mirror.metrics()
                used = ref.pool_tokens - ref.alloc.available_size() - ref.tree.evictable_size()
                snapshots.append({"step": step, "mirror_live": m.live_units, "mirror_cached": m.cached_units,
                                  "mirror_free": m.free_units, "sglang_used": used,
                                  "sglang_evictable": ref.tree.evictable_size(),
                                  "sglang_available": ref.alloc.available_size()})
        applied = len(sink.batches)
        engine = plugin.executor_engine
        if step == 300 and ref.running.reqs:
            victim = ref.running.reqs[0].rid
            result = engine.evict_request(plugin.translator.req(victim), clock["ns"])
            actions["evict"] = {"rid": victim, "units_freed": result.units_freed,
                                "requeued": any(r.rid == victim for r in ref.waiting)}
        if step == 320:
            engine.hold_admissions(200)
        if 320 < step < 400:
            held_seen = max(held_seen, sum(1 for r in ref.waiting if len(r.origin_input_ids) > 200))
            admitted_long = [p for p in out["prefill"] if len(ref_by_rid(ref, p[0])) > 200]
            actions.setdefault("long_admitted_while_held", 0)
            actions["long_admitted_while_held"] += len(admitted_long)
        if step == 400:
            actions["release"] = engine.release_admissions()
        step += 1
    plugin.translator.flush()
    rows = sink.events()
    kinds = {k.name: int((rows["kind"] == int(k)).sum()) for k in (EventKind.ARRIVE, EventKind.ADMIT, EventKind.FINISH,
                                                                  EventKind.PREEMPT, EventKind.STEP, EventKind.SNAPSHOT)}
    print(json.dumps({"hooked": hooked, "snapshots": snapshots, "kinds": kinds, "actions": actions,
                      "held_seen": held_seen, "retracted_by_sglang": retracted_by_sglang,
                      "drift": mirror.drift_count, "synced": mirror.synced, "unfinished": len(ref.unfinished), "steps": step}))
    return 0


_TOKENS: dict = {}


def ref_by_rid(ref, rid) -> tuple:
    """The prompt of request ``rid`` (remembered at first sight: finished requests leave the harness)."""
    key = str(rid)
    if key not in _TOKENS:
        req = next((r for r in [*ref.waiting, *ref.running.reqs, *(ref.last.reqs if ref.last else [])]
                    if r.rid == key), None)
        _TOKENS[key] = tuple(req.origin_input_ids) if req is not None else ()
    return _TOKENS[key]


if __name__ == "__main__":
    sys.exit(main())
