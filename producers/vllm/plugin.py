"""kvguard's vLLM plugin: KV, scheduler and CUDA-allocator events from inside a running vLLM engine.

Install ``kvguard[vllm]``; vLLM loads general plugins in every process it starts (``vllm.plugins.
load_general_plugins``, entry-point group ``vllm.general_plugins``) and calls ``register()`` here.
``register`` checks the vLLM version (0.33.x; anything else raises ``UnsupportedVllmVersion``
naming it, unless ``KVGUARD_VLLM_ALLOW_UNSUPPORTED=1``) and wraps ``vllm.v1.core.sched.scheduler.
Scheduler.__init__`` so that each scheduler vLLM builds (in the engine-core process; the async
scheduler is a subclass) gets ``attach``-ed. ``KVGUARD_VLLM_PLUGIN=0`` turns the plugin off.

``attach(scheduler)`` builds, per engine:

- the translator (``vllm.translator``) with the hooks (``vllm.hooks``) on the
  scheduler, its KV cache manager and block pool: one ``EventBatch`` per engine step;
- the actions (``vllm.actions``): preempt, abort, admission hold, batch-token cap,
  headroom, ``empty_cache``, drain;
- the CUDA observer (``torch_cuda``): ``memory_stats``, segment snapshots, the OOM
  observer; inactive on CPU or when the workers run in other processes, and it says so;
- the sink the batches go to: Kafka through ``NodePublisher`` on a background thread when
  ``KVGUARD_BOOTSTRAP`` (or ``KVGUARD_KAFKA__BOOTSTRAP``, or a ``KVGUARD_CONFIG`` file) is set; an
  event log when ``KVGUARD_EVENTS_OUT`` names a file (``kvguard metrics/rca --events`` read it);
  otherwise nothing is published (counted, and logged once). The engine thread only appends a batch
  to a deque; encoding and sending happen on the publisher's thread.

Node id: ``KVGUARD_NODE_ID`` (or the setting ``KVGUARD_NODE__NODE_ID``); else ``<host>/gpu<index>`` with host = ``KVGUARD_HOST``, else ``NODE_NAME``
(Kubernetes downward API, ``fieldRef: spec.nodeName``), else the hostname, and index = the first
entry of ``CUDA_VISIBLE_DEVICES`` (the physical GPU), else the current CUDA device, else 0. In a pod,
set ``KVGUARD_NODE_ID: "$(NODE_NAME)/$(POD_NAME)"`` from the downward API (``spec.nodeName``,
``metadata.name``; deploy/k8s/vllm-node.yaml): one id per engine, stable across container restarts
of the pod, new when the pod is rescheduled. Event time is the wall clock (``time.time_ns``), so a
command's ``issued_at`` (the tick time) is on the node's clock.

Other settings (env): ``KVGUARD_SNAPSHOT_EVERY_S`` (SNAPSHOT of vLLM's block pool for resync,
default 60), ``KVGUARD_CUDA_STATS_EVERY_MS`` (100), ``KVGUARD_CUDA_SEGMENTS_EVERY_S`` (5); the rest of
kvguard's settings as usual (``KVGUARD_<SECTION>__<FIELD>``). ``on_attach(callback)`` lets the
runtime start the command consumer (``kvguard.runtime.plugins``) for each attached engine.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.contracts.events import EventKind
from kvguard.producers.sinks import make_sink, node_id_from_env, usable_node_id
from kvguard.producers.torch_cuda import CudaMemoryObserver
from kvguard.producers.vllm.actions import ExecutorEngine, VllmActions
from kvguard.producers.vllm.admission import VllmAdmission, serve_endpoint_series
from kvguard.producers.vllm.hooks import Attachment
from kvguard.producers.vllm.plugin_governor import PluginGovernor
from kvguard.producers.vllm.step_memory import prompt_logprobs_row_bytes
from kvguard.producers.vllm.translator import BatchSink, VllmEventTranslator, geometry_for_blocks

log = logging.getLogger("kvguard.vllm")

SUPPORTED_VLLM_SERIES = ("0.33",)
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "kvguard"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class UnsupportedVllmVersion(RuntimeError):
    def __init__(self, version: str):
        self.version = version
        super().__init__(f"kvguard's vLLM plugin supports vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM_SERIES)}; "
                         f"this is vLLM {version}. Install a supported vLLM, turn the plugin off with "
                         "KVGUARD_VLLM_PLUGIN=0, or set KVGUARD_VLLM_ALLOW_UNSUPPORTED=1 to try it anyway.")


def check_vllm_version(version: str, env: Mapping[str, str] | None = None) -> bool:
    """True when ``version`` is supported; raises ``UnsupportedVllmVersion`` otherwise (a warning
    and False with ``KVGUARD_VLLM_ALLOW_UNSUPPORTED=1``)."""
    env = os.environ if env is None else env
    series = ".".join(str(version).split("+")[0].split(".")[:2])
    if series in SUPPORTED_VLLM_SERIES:
        return True
    if env.get("KVGUARD_VLLM_ALLOW_UNSUPPORTED", "").lower() in _ON:
        log.warning("%s (continuing: KVGUARD_VLLM_ALLOW_UNSUPPORTED is set)", UnsupportedVllmVersion(version))
        return False
    raise UnsupportedVllmVersion(version)


@dataclass(slots=True, frozen=True)
class PluginConfig:
    node_id: str | None = None  # None: from the environment at attach time (the CUDA device is known then)
    bootstrap: str | None = None
    events_out: str | None = None
    snapshot_every_s: float = 60.0
    cuda_stats_every_ms: float = 100.0
    cuda_segments_every_s: float = 5.0
    logprobs_guard: bool = True  # the step governor on (plugin_governor); the logprob guard is one of its cases
    governor_margin_bytes: int = 256 << 20
    endpoint_metrics_port: int = 0  # > 0: serve kvguard's router series on this port (producers.vllm.admission)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        env = os.environ if env is None else env
        bootstrap = env.get("KVGUARD_BOOTSTRAP") or env.get("KVGUARD_KAFKA__BOOTSTRAP") or None
        if bootstrap is None and env.get("KVGUARD_CONFIG"):
            bootstrap = "settings"  # the config file's kafka.bootstrap
        return cls(node_id=env.get("KVGUARD_NODE_ID") or env.get("KVGUARD_NODE__NODE_ID") or None, bootstrap=bootstrap,
                   events_out=env.get("KVGUARD_EVENTS_OUT") or None,
                   snapshot_every_s=float(env.get("KVGUARD_SNAPSHOT_EVERY_S", 60.0)),
                   cuda_stats_every_ms=float(env.get("KVGUARD_CUDA_STATS_EVERY_MS", 100.0)),
                   cuda_segments_every_s=float(env.get("KVGUARD_CUDA_SEGMENTS_EVERY_S", 5.0)),
                   logprobs_guard=all(env.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
                                      for name in ("KVGUARD_GOVERNOR", "KVGUARD_LOGPROBS_GUARD")),
                   governor_margin_bytes=int(env.get("KVGUARD_GOVERNOR_MARGIN_BYTES", 256 << 20)),
                   endpoint_metrics_port=int(env.get("KVGUARD_ENDPOINT_METRICS_PORT", 0) or 0))


# ---------------------------------------------------------------- the plugin per engine


def kv_bytes_per_token(scheduler: Any) -> int:
    """Bytes of KV one token takes in a block (the largest group's layers, page_size_bytes per layer)."""
    try:
        groups = scheduler.kv_cache_config.kv_cache_groups
        per_block = max(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
        return max(1, per_block // scheduler.block_size)
    except (AttributeError, ValueError, TypeError, ZeroDivisionError):
        return 1


def prompt_logprobs_bytes(scheduler: Any) -> int | None:
    """Bytes one prompt position of a prompt-logprobs request allocates in vLLM's model runner: its
    logits row (vocab padded to 64, the model's dtype), its float32 log-softmax row and its token id
    (``producers.vllm.step_memory.prompt_logprobs_bytes_per_token``); None when the config does not say."""
    try:
        model = scheduler.vllm_config.model_config
        vocab = int(model.get_vocab_size())
        itemsize = int(model.dtype.itemsize)
    except (AttributeError, TypeError, ValueError):
        return None
    return prompt_logprobs_row_bytes(vocab, itemsize)


def _import_torch() -> Any:
    try:
        import torch  # heavy: loaded already inside vLLM
    except ImportError:
        return None
    return torch


class VllmPlugin:
    """kvguard attached to one vLLM scheduler (module docstring)."""

    def __init__(self, scheduler: Any, *, config: PluginConfig | None = None, sink: BatchSink | None = None,
                 clock_ns: Callable[[], int] = time.time_ns, torch_module: Any = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.config = config or PluginConfig.from_env(env)
        torch = torch_module if torch_module is not None else _import_torch()
        cuda_ready = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
        device = int(torch.cuda.current_device()) if cuda_ready else None
        # an id every consumer would refuse at decode is refused here, at the engine's start
        self.node = (usable_node_id(self.config.node_id, "KVGUARD_NODE_ID") if self.config.node_id
                     else node_id_from_env(env, device))
        pool = scheduler.kv_cache_manager.block_pool
        total = int(torch.cuda.get_device_properties(device).total_memory) if cuda_ready else 0
        self.geometry = geometry_for_blocks(
            pool.num_gpu_blocks, scheduler.block_size, kv_bytes_per_token(scheduler), total_bytes=total,
            gpu_memory_utilization=float(getattr(scheduler.cache_config, "gpu_memory_utilization", 0.9)))
        self.sink = sink if sink is not None else make_sink(self.config.bootstrap, self.config.events_out, self.node, source="vllm-plugin")
        epoch = time.time_ns()  # a new producer run of this node: the stream starts its state over
        self.translator = VllmEventTranslator(
            self.node, self.geometry, self.sink, clock_ns=clock_ns, epoch=epoch,
            priority_policy=getattr(scheduler.policy, "name", "") == "PRIORITY",
            snapshot_every_s=self.config.snapshot_every_s)
        self.actions = VllmActions(scheduler, self.translator, torch_module=torch)
        if self.config.logprobs_guard:
            self.actions.logprobs_bytes_per_token = prompt_logprobs_bytes(scheduler)
            self.actions.governor = PluginGovernor(scheduler, torch, margin_bytes=self.config.governor_margin_bytes,
                                                   emit=self._govern_row)
        self.memory = CudaMemoryObserver(self.translator, torch, stats_every_ms=self.config.cuda_stats_every_ms,
                                         segments_every_s=self.config.cuda_segments_every_s)
        self.admission = VllmAdmission(scheduler)  # the router series' model (issue 29)
        self.attachment = Attachment(scheduler, self.translator, actions=self.actions, memory=self.memory,
                                     admission=self.admission)
        self.scheduler = scheduler
        self.executor_engine = ExecutorEngine(self.node, self.actions)
        self.closed = False

    def _govern_row(self, d) -> None:
        """The governor's decision as a GOVERN row (kvguard.contracts.events)."""
        self.translator._row(int(EventKind.GOVERN), cls=int(d.cause), flags=int(d.flags), offset=int(d.headroom_bytes),
                             size=int(d.predicted_bytes), tokens=int(d.budget), aux=int(d.tokens_removed))

    def attach(self) -> VllmPlugin:
        self.attachment.attach()
        self.memory.install_oom_observer()
        if self.config.endpoint_metrics_port > 0:
            serve_endpoint_series(self.admission, self.config.endpoint_metrics_port, {"node": self.node})
        log.info("kvguard attached to vLLM: node %s, %d blocks of %d tokens, CUDA observer %s, sink %s",
                 self.node, self.geometry.dynamic_units, self.geometry.unit_tokens, self.memory.reason,
                 type(self.sink).__name__)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        if self.closed:
            return
        self.closed = True
        self.translator.flush()
        self.attachment.detach()
        close = getattr(self.sink, "close", None)
        if close is not None:
            close(timeout_s)

    def status(self) -> dict:
        return {"node": self.node, "epoch": self.translator.epoch, "batches": self.translator.seq,
                "rows": self.translator.rows_total, "steps": self.translator.steps,
                "blocks": self.geometry.dynamic_units, "cuda": self.memory.status(),
                "sink": type(self.sink).__name__,
                "governor": self.actions.governor.summary() if self.actions.governor is not None else None}


_plugins: list[VllmPlugin] = []
_on_attach: list[Callable[[VllmPlugin], None]] = []


def on_attach(callback: Callable[[VllmPlugin], None]) -> None:
    """Call ``callback(plugin)`` for every engine attached from now on (and those attached already)."""
    _on_attach.append(callback)
    for plugin in _plugins:
        callback(plugin)


def attached_plugins() -> list[VllmPlugin]:
    return list(_plugins)


def attach(scheduler: Any, **kwargs: Any) -> VllmPlugin:
    """Attach kvguard to a live vLLM ``Scheduler`` (the entry point does it for every scheduler)."""
    plugin = VllmPlugin(scheduler, **kwargs).attach()
    _plugins.append(plugin)
    atexit.register(plugin.close)
    for callback in _on_attach:
        try:
            callback(plugin)
        except Exception:
            log.exception("kvguard: an on_attach callback failed")
    return plugin


def install_scheduler_hook(**attach_kwargs: Any) -> bool:
    """Wrap ``Scheduler.__init__`` once so that every scheduler vLLM builds is attached (with
    ``attach_kwargs``: a sink, a config; the GPU check passes a list sink). False if it was wrapped
    already."""
    from vllm.v1.core.sched.scheduler import Scheduler  # vllm: optional and heavy; loaded by vLLM already

    if getattr(Scheduler, "_kvguard_hooked", False):
        return False
    original = Scheduler.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "_kvguard_plugin", None) is not None:
            return
        try:
            self._kvguard_plugin = attach(self, **attach_kwargs)
        except Exception:
            log.exception("kvguard: could not attach to vLLM's scheduler; vLLM runs without kvguard")

    Scheduler.__init__ = __init__
    Scheduler._kvguard_hooked = True
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point (pyproject: ``kvguard = "kvguard.producers.vllm.plugin:register"``).
    vLLM calls it in each of its processes; it is idempotent."""
    if os.environ.get("KVGUARD_VLLM_PLUGIN", "").lower() in _OFF:
        log.info("kvguard: vLLM plugin off (KVGUARD_VLLM_PLUGIN)")
        return
    import vllm  # vllm: optional and heavy; this runs inside vLLM, which has imported it

    check_vllm_version(vllm.__version__)
    install_scheduler_hook()
