"""kvguard's SGLang plugin: request, retraction and KV-page events from inside a running SGLang scheduler.

SGLang (0.5.11 and later; the plugin is checked against 0.5.23) loads general plugins in each of its processes (``sglang.srt.plugins.
load_plugins``, entry-point group ``sglang.srt.plugins``; ``SGLANG_PLUGINS=kvguard`` restricts the
set) and calls ``register()`` here, which registers hooks with SGLang's ``HookRegistry``:

- AFTER ``managers.scheduler.Scheduler.__init__``: ``attach(scheduler)`` in the scheduler process;
- AROUND ``Scheduler.get_next_batch_to_run`` (the top of every step, on the scheduler's thread):
  kvguard's pending actions run first, held requests leave ``waiting_queue`` for the call, and after
  it the step's rows are written (``after_step``);
- AROUND ``Scheduler.get_prefill_adder_class``: the adder carries kvguard's admission headroom;
- AROUND ``managers.schedule_batch.ScheduleBatch.retract_decode``: a PREEMPT row per request SGLang
  retracts, with its tokens.

Per step the translator (``producers.vllm.translator``: engine-neutral but for its name) writes
ARRIVE when a request first shows in ``waiting_queue``, ADMIT when it first runs (again after a
retraction), FINISH when it has left every queue (ABORTED when its finish reason is an abort), a
STEP row (prefill tokens or decode batch size), and every ``snapshot_every_s`` a SNAPSHOT of the
pool from SGLang's own state (``page_truth``: the allocator's free pages, the rows of the requests
holding KV, the rest cached in the radix tree), on which the stream's mirror resynchronises; the
unit is one page. Between snapshots the mirror holds the last one: per-page ALLOC/FREE rows are not
hooked (no hook is placed on the allocator's hot path).

Settings (env): ``KVGUARD_SGLANG_PLUGIN=0`` turns it off; ``KVGUARD_SNAPSHOT_EVERY_S`` (default 1);
node id and sinks as for the vLLM plugin (``producers.sinks``: ``KVGUARD_NODE_ID``,
``KVGUARD_BOOTSTRAP``, ``KVGUARD_EVENTS_OUT``). Before 0.5.11 SGLang has no plugin group; see
docs/ENGINES.md for the launch wrapper that works there.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.contracts.events import Outcome
from kvguard.producers.sglang.actions import SglangActions, SglangExecutorEngine
from kvguard.producers.sinks import make_sink, node_id_from_env
from kvguard.producers.vllm.translator import BatchSink, BlockTruth, VllmEventTranslator, geometry_for_blocks

log = logging.getLogger("kvguard.sglang")

ENTRY_POINT_GROUP = "sglang.srt.plugins"
CHECKED_VERSION = "0.5.23"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_OFF = ("0", "false", "no", "off")


@dataclass(slots=True, frozen=True)
class SglangPluginConfig:
    node_id: str | None = None
    bootstrap: str | None = None
    events_out: str | None = None
    snapshot_every_s: float = 1.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SglangPluginConfig:
        env = os.environ if env is None else env
        bootstrap = env.get("KVGUARD_BOOTSTRAP") or env.get("KVGUARD_KAFKA__BOOTSTRAP") or None
        if bootstrap is None and env.get("KVGUARD_CONFIG"):
            bootstrap = "settings"
        return cls(node_id=env.get("KVGUARD_NODE_ID") or env.get("KVGUARD_NODE__NODE_ID") or None, bootstrap=bootstrap,
                   events_out=env.get("KVGUARD_EVENTS_OUT") or None,
                   snapshot_every_s=float(env.get("KVGUARD_SNAPSHOT_EVERY_S", 1.0)))


def _holders(scheduler: Any) -> list:
    """The requests that hold a row of KV now: the running batch, the batch about to run, the chunked one."""
    out, seen = [], set()
    batches = [getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None),
               getattr(scheduler, "cur_batch", None)]
    for req in [r for b in batches if b is not None for r in b.reqs] + [getattr(scheduler, "chunked_req", None)]:
        if req is None or id(req) in seen:
            continue
        kv = getattr(req, "kv", None)
        if kv is not None and getattr(kv, "holds_kv", False) and kv.req_pool_idx is not None:
            seen.add(id(req))
            out.append(req)
    return out


def _free_pages(alloc: Any) -> np.ndarray:
    parts = [alloc.free_pages]
    parts += list(getattr(alloc, "staged_pages", None) or [])
    release = getattr(alloc, "release_pages", None)
    if release is not None and len(release):
        parts.append(release)
    return np.concatenate([np.asarray(p.cpu() if hasattr(p, "cpu") else p, dtype=np.int64) for p in parts])


def page_truth(scheduler: Any) -> BlockTruth:
    """SGLang's pages as they are: free in the allocator, held in a request's row, else cached in the tree."""
    alloc = scheduler.token_to_kv_pool_allocator
    ps = int(alloc.page_size)
    n = int(alloc.size) // ps
    ref_cnt = np.zeros(n, dtype=np.int64)
    tokens = np.zeros(n, dtype=np.int64)
    table = scheduler.req_to_token_pool.req_to_token
    for req in _holders(scheduler):
        length = int(req.kv.kv_committed_len)
        if length <= 0:
            continue
        slots = np.asarray(table[req.kv.req_pool_idx, :length].cpu(), dtype=np.int64)
        pages, counts = np.unique(slots // ps, return_counts=True)
        ref_cnt[pages - 1] += 1
        tokens[pages - 1] = np.maximum(tokens[pages - 1], counts)
    free = np.zeros(n, dtype=bool)
    free[_free_pages(alloc) - 1] = True
    return BlockTruth(ref_cnt=ref_cnt, cached=(ref_cnt == 0) & ~free, tokens=tokens)


def kv_bytes_per_token(scheduler: Any) -> int:
    kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
    try:
        return int(kv.head_num * (kv.head_dim + getattr(kv, "v_head_dim", kv.head_dim)) * kv.layer_num
                   * kv.store_dtype.itemsize)
    except (AttributeError, TypeError):
        return 1


class SglangPlugin:
    """kvguard attached to one SGLang scheduler (module docstring)."""

    def __init__(self, scheduler: Any, *, config: SglangPluginConfig | None = None, sink: BatchSink | None = None,
                 clock_ns: Callable[[], int] = time.time_ns, env: Mapping[str, str] | None = None,
                 torch_module: Any = None) -> None:
        self.config = config or SglangPluginConfig.from_env(env)
        self.scheduler = scheduler
        alloc = scheduler.token_to_kv_pool_allocator
        self.page_size = int(alloc.page_size)
        self.node = self.config.node_id or node_id_from_env(env, None)
        # geometry_for_blocks counts a null block; SGLang's page 0 is its padded slot, never handed out
        self.geometry = geometry_for_blocks(int(alloc.size) // self.page_size + 1, self.page_size,
                                            kv_bytes_per_token(scheduler))
        self.sink = sink if sink is not None else make_sink(self.config.bootstrap, self.config.events_out, self.node,
                                                            source="sglang-plugin")
        self.translator = VllmEventTranslator(self.node, self.geometry, self.sink, clock_ns=clock_ns,
                                              epoch=time.time_ns(), snapshot_every_s=self.config.snapshot_every_s)
        self.actions = SglangActions(scheduler, torch_module=torch_module)
        self.executor_engine = SglangExecutorEngine(self.node, self.actions, self.translator.name_of)
        self._reqs: dict[str, Any] = {}
        self._running: set[str] = set()
        self.steps = 0

    # ---------------------------------------------------------------- the scheduler's calls
    def before_step(self):
        """Run kvguard's pending actions; take held requests out of the queue (what to put back)."""
        self.actions.run_pending()
        return self.actions.waiting_without_held()

    def after_step(self, held, batch: Any) -> None:
        if held is not None:
            self.actions.put_back(held)
        t = self.translator
        s = self.scheduler
        t.now()
        present: dict[str, Any] = {}
        for req in s.waiting_queue:
            present[req.rid] = req
        holders = _holders(s)
        batch_reqs = list(batch.reqs) if batch is not None else []
        for req in holders + batch_reqs:
            present[req.rid] = req
        for rid, req in present.items():
            if rid not in self._reqs:
                self._reqs[rid] = req
                t.on_arrive(rid, len(req.origin_input_ids), int(req.sampling_params.max_new_tokens or 0), 0)
        running_now = {r.rid for r in holders + batch_reqs}
        for rid in sorted(running_now - self._running):
            t.on_admit(rid)
        self._running = running_now
        for rid in [r for r in self._reqs if r not in present]:
            req = self._reqs.pop(rid)
            reason = type(getattr(req, "finished_reason", None)).__name__
            t.on_finish(rid, Outcome.ABORTED if reason == "FINISH_ABORT" else Outcome.COMPLETED, len(req.output_ids))
        if batch is not None:
            extend = int(getattr(batch, "extend_num_tokens", 0) or 0)
            is_extend = bool(getattr(getattr(batch, "forward_mode", None), "is_extend", lambda: False)())
            tokens = extend if is_extend else len(batch_reqs)
            t.on_fill(tokens)
            t.on_step(tokens, 0 if is_extend else len(batch_reqs))
            self.steps += 1
        t.flush(page_truth(s) if t.snapshot_due() or self.steps == 1 else None)

    def on_retracted(self, reqs: list) -> None:
        for req in reqs:
            self._running.discard(req.rid)
            self.translator.on_preempt(req.rid, len(req.origin_input_ids) + len(req.output_ids))

    def close(self) -> None:
        self.translator.flush()
        close = getattr(self.sink, "close", None)
        if close is not None:
            close(5.0)


_plugins: list[SglangPlugin] = []
_by_tree: dict[int, SglangPlugin] = {}


def attach(scheduler: Any, **kwargs: Any) -> SglangPlugin:
    """Attach kvguard to a live SGLang scheduler (the ``Scheduler.__init__`` hook does it)."""
    plugin = SglangPlugin(scheduler, **kwargs)
    scheduler._kvguard_plugin = plugin
    _plugins.append(plugin)
    _by_tree[id(scheduler.tree_cache)] = plugin
    retract = plugin.executor_engine.evict_request

    def evict_and_record(req, now_ns, **kw):
        result = retract(req, now_ns, **kw)
        if result.units_freed or result.pages:
            name = plugin.translator.name_of(req)
            if name is not None and name in plugin._reqs:
                plugin.on_retracted([plugin._reqs[name]])
        return result

    plugin.executor_engine.evict_request = evict_and_record
    atexit.register(plugin.close)
    log.info("kvguard attached to SGLang: node %s, %d pages of %d tokens", plugin.node, plugin.geometry.dynamic_units,
             plugin.page_size)
    return plugin


def attached_plugins() -> list[SglangPlugin]:
    return list(_plugins)


# ---------------------------------------------------------------- the hooks


def _after_init(result, scheduler, *args, **kwargs):
    if getattr(scheduler, "_kvguard_plugin", None) is None:
        try:
            attach(scheduler)
        except Exception:
            log.exception("kvguard: could not attach to SGLang's scheduler; SGLang runs without kvguard")
    return result


def _around_next_batch(original, scheduler, *args, **kwargs):
    plugin = getattr(scheduler, "_kvguard_plugin", None)
    if plugin is None:
        return original(scheduler, *args, **kwargs)
    held = plugin.before_step()
    plan = None
    try:
        plan = original(scheduler, *args, **kwargs)
    finally:
        plugin.after_step(held, getattr(plan, "batch_to_run", None))
    return plan


def _around_adder_class(original, scheduler, *args, **kwargs):
    base = original(scheduler, *args, **kwargs)
    plugin = getattr(scheduler, "_kvguard_plugin", None)
    return plugin.actions.adder_class(base) if plugin is not None else base


def _around_retract(original, batch, *args, **kwargs):
    result = original(batch, *args, **kwargs)
    plugin = _by_tree.get(id(getattr(batch, "tree_cache", None)))
    if plugin is not None:
        plugin.on_retracted(list(result[0]))
    return result


HOOKS = ((f"{SCHEDULER}.__init__", _after_init, "AFTER"),
         (f"{SCHEDULER}.get_next_batch_to_run", _around_next_batch, "AROUND"),
         (f"{SCHEDULER}.get_prefill_adder_class", _around_adder_class, "AROUND"),
         (f"{SCHEDULE_BATCH}.retract_decode", _around_retract, "AROUND"))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (pyproject: ``kvguard = "kvguard.producers.sglang.plugin:register"``);
    SGLang calls it in each process, then applies the hooks."""
    if os.environ.get("KVGUARD_SGLANG_PLUGIN", "").lower() in _OFF:
        log.info("kvguard: SGLang plugin off (KVGUARD_SGLANG_PLUGIN)")
        return
    from sglang import __version__  # sglang: this runs inside SGLang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if __version__.split("+")[0] != CHECKED_VERSION:
        log.warning("kvguard's SGLang plugin was checked against SGLang %s; this is %s: the hooks are registered, "
                    "the request and pool fields it reads may differ", CHECKED_VERSION, __version__)
    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
