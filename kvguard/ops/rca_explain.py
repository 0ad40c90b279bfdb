"""Why an OOM happened, per cause, from what the event log holds (``kvguard rca``).

``kvguard.ops.rca`` replays the log and gathers, for each OOM row, an ``OomContext``: the OOM_STEP rows
written right before it (the crashing step, ``kvguard.contracts.events``), the allocator layer's state
rebuilt from the SEG_*/BLK_* rows up to the OOM, the requests the crash took down (FINISH FAILED_OOM
rows with their ARRIVE shapes), the node's geometry and, when given, a PyTorch snapshot's figures.
``explain`` turns that into one ``Explanation``:

- the allocator picture, in bytes: the allocation requested against device free, reserved,
  allocated and reserved-but-unallocated (PyTorch's OOM message's figures, ``c10/cuda/CUDACachingAllocator.cpp``);
- the step that asked: its tokens, its sequences, and the requests in it with their shapes (prompt
  length, prompt logprobs, speculative tokens, context length) — from the OOM_STEP rows, or, in a log
  without them (the vLLM plugin's, an older shadow engine's), reconstructed from ARRIVE/ADMIT/FINISH
  rows as the requests running at the crash (the step's own split is then not known);
- the headroom start-up left (device free + reserved-but-unallocated once the engine was up);
- the cause in words, one per failure class (docs/NODE_MEMORY.md "Failure classes",
  notes/oom-classes.md), and what would have prevented it: the logprob guard's cap for that step,
  a ``--max-num-batched-tokens`` that fits, a ``--gpu-memory-utilization`` that fits, ``expandable_segments``
  for a fragmentation OOM, the neighbour's or the leak's bytes. Caps scale the failing allocation
  linearly with the step's tokens: an estimate from the failure, labelled as such.

For a KV-arena OOM (the seed engine's alternative profiles) the KV layer's language is kept: units,
the largest free run, capacity or fragmentation. Pure: the standard library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvguard.contracts.events import F_PROMPT_LOGPROBS, OomCause, OomLayer

GIB = 1 << 30
MIB = 1 << 20
# kvguard's logprob guard keeps this margin (VllmEngineConfig.logprobs_guard_margin_bytes, the plugin's default)
GUARD_MARGIN_BYTES = 256 * MIB
# vLLM's Model Runner V2 computes prompt logprobs this many positions at a time (vllm PR#52054)
V2_PROMPT_LOGPROBS_CHUNK = 1024

CAUSE_NAMES = {OomCause.OTHER: "other", OomCause.PEAK: "peak", OomCause.FRAGMENTATION: "fragmentation",
               OomCause.PROMPT_LOGPROBS: "prompt_logprobs", OomCause.LONG_CONTEXT: "long_context",
               OomCause.SPEC_DECODE: "spec_decode", OomCause.NEIGHBOUR: "neighbour", OomCause.LEAK: "leak"}
CAUSE_TITLES = {
    "peak": "allocator peak: the step needed more than the device had left",
    "fragmentation": "allocator fragmentation: reserved-but-unallocated bytes would have covered it, no cached "
                     "block was large enough",
    "prompt_logprobs": "prompt logprobs (C2): the logits of every prompt position, which the profiling run never made",
    "long_context": "long context (C3): attention buffers sized by the context, above the profiled peak",
    "spec_decode": "speculative decoding (C5/C8): verification logits rows of (1 + k) per request, not budgeted",
    "neighbour": "another process (C4): it took device memory after start-up",
    "leak": "a leak (C7): memory held and never returned",
    "other": "an allocation the log does not attribute",
    "capacity": "KV arena capacity: fewer free units than requested",
    "kv_fragmentation": "KV arena fragmentation: enough free units, no run large enough",
}


def gib(n: int | float | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.2f} GiB ({int(n):,} bytes)"


@dataclass(slots=True)
class StepRequest:
    req: int
    tokens: int | None  # scheduled in the crashing step (None: reconstructed, not known)
    prompt_tokens: int | None
    context_tokens: int | None  # its sequence once the step is done (reconstructed: prompt + generated)
    spec_tokens: int | None
    prompt_logprobs: bool


@dataclass(slots=True)
class OomContext:
    """What the replay gathered for one OOM row (``kvguard.ops.rca``)."""

    layer: int
    cause: int
    requested: int  # bytes (allocator) or units (KV arena)
    aux: int  # reserved-but-unallocated bytes (allocator) or the largest free run (KV arena)
    kv_free_units: int | None = None
    step_rows: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)  # (cls, flags, req, offset, size, tokens, aux)
    lost: list[StepRequest] = field(default_factory=list)  # FAILED_OOM requests with their ARRIVE shapes
    mirror_reserved: int | None = None  # the allocator layer at the last step boundary before the OOM
    mirror_allocated: int | None = None
    mirror_largest_free_block: int | None = None
    total_bytes: int | None = None
    context_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    snapshot: dict | None = None  # a PyTorch snapshot's figures (``kvguard rca --snapshot``)


@dataclass(slots=True)
class Explanation:
    layer: str  # "allocator" | "kv_arena"
    cause: str  # a CAUSE_NAMES value, or capacity / kv_fragmentation for the KV arena
    allocator_reason: str | None  # "peak" | "fragmentation" as PyTorch's allocator sees it
    title: str
    requested_bytes: int | None = None
    tried_to_allocate_bytes: int | None = None
    device_free_bytes: int | None = None
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    largest_free_block_bytes: int | None = None
    shortfall_bytes: int | None = None  # requested - (device free + reserved-but-unallocated), when > 0
    picture_source: str = ""
    step_tokens: int | None = None
    step_sequences: int | None = None
    step_prompt_logprob_positions: int | None = None
    requests: list[StepRequest] = field(default_factory=list)
    step_source: str = ""
    startup_headroom_bytes: int | None = None
    neighbour_bytes: int | None = None
    neighbour_start_bytes: int | None = None
    leaked_bytes: int | None = None
    details: list[str] = field(default_factory=list)
    prevention: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def explain(ctx: OomContext) -> Explanation:
    if ctx.layer != int(OomLayer.ALLOCATOR):
        return _kv_arena(ctx)
    return _allocator(ctx)


def _kv_arena(ctx: OomContext) -> Explanation:
    free = ctx.kv_free_units
    frag = free is not None and free >= ctx.requested and ctx.aux < ctx.requested
    cause = "kv_fragmentation" if frag else "capacity"
    ex = Explanation(layer="kv_arena", cause=cause, allocator_reason=None, title=CAUSE_TITLES[cause],
                     picture_source="the OOM row and the KV mirror (units of the KV arena)")
    ex.details.append(f"requested {ctx.requested} units of the KV arena; largest free run {ctx.aux} units; "
                      f"free units {free if free is not None else 'unknown'}")
    if frag:
        ex.prevention.append("compaction (the policy's compact command) or a smaller page class: the free units "
                             "sufficed, only a contiguous run was missing")
    else:
        ex.prevention.append("fewer concurrent requests or shorter prompts (admission), or preempting before the "
                             "arena fills")
    return ex


def _allocator(ctx: OomContext) -> Explanation:
    by_cls: dict[int, list[tuple]] = {}
    for row in ctx.step_rows:
        by_cls.setdefault(row[0], []).append(row)
    cause = CAUSE_NAMES.get(OomCause(ctx.cause) if ctx.cause in OomCause._value2member_map_ else OomCause.OTHER,
                            "other")
    ex = Explanation(layer="allocator", cause=cause, allocator_reason=None, title=CAUSE_TITLES[cause],
                     requested_bytes=ctx.requested, reserved_unallocated_bytes=ctx.aux)
    device = by_cls.get(0)
    if device:
        _, _, _, reserved, free, allocated, tried = device[0]
        ex.device_free_bytes, ex.reserved_bytes, ex.allocated_bytes = free, reserved, allocated
        ex.tried_to_allocate_bytes = tried
        ex.picture_source = "the OOM's own figures (PyTorch's OOM message, OOM_STEP rows)"
    elif ctx.snapshot is not None:
        s = ctx.snapshot
        ex.reserved_bytes, ex.allocated_bytes = s.get("reserved_bytes"), s.get("allocated_bytes")
        ex.device_free_bytes = s.get("device_free_bytes")
        ex.largest_free_block_bytes = s.get("largest_free_block_bytes")
        ex.picture_source = f"the PyTorch snapshot {s.get('path', '')}".rstrip()
    elif ctx.mirror_reserved is not None:
        ex.reserved_bytes, ex.allocated_bytes = ctx.mirror_reserved, ctx.mirror_allocated
        ex.largest_free_block_bytes = ctx.mirror_largest_free_block
        if ctx.total_bytes:
            ex.device_free_bytes = max(0, ctx.total_bytes - (ctx.context_bytes or 0) - ctx.mirror_reserved)
        ex.picture_source = ("the allocator rows up to the OOM (reserved and allocated at the last step boundary: the "
                             "crashing step's transients are not in them); device free = total - CUDA context - "
                             "reserved, other processes not known")
    else:
        ex.picture_source = "the OOM row only (requested, reserved-but-unallocated)"
    if ctx.snapshot is not None and device:
        ex.largest_free_block_bytes = ctx.snapshot.get("largest_free_block_bytes")
    if ex.largest_free_block_bytes is None and ctx.mirror_largest_free_block is not None:
        ex.largest_free_block_bytes = ctx.mirror_largest_free_block
    asked = ex.tried_to_allocate_bytes or ctx.requested
    ex.allocator_reason = "fragmentation" if ctx.aux >= ctx.requested else "peak"
    snap = ctx.snapshot
    if snap is not None and not device and not snap.get("expandable_segments") and \
            (snap.get("reserved_unallocated_bytes") or 0) >= asked > (snap.get("largest_free_block_bytes") or 0):
        ex.allocator_reason = "fragmentation"  # the snapshot shows the cached bytes were there, split
    if ex.device_free_bytes is not None:
        short = asked - (ex.device_free_bytes + ctx.aux)
        ex.shortfall_bytes = short if short > 0 else None
    step = by_cls.get(1)
    if step:
        _, _, _, positions, tokens, seqs, headroom = step[0]
        ex.step_tokens, ex.step_sequences, ex.step_prompt_logprob_positions = tokens, seqs, positions
        ex.startup_headroom_bytes = headroom or None
        ex.requests = [StepRequest(req, n, prompt, context, drafts, bool(flags & F_PROMPT_LOGPROBS))
                       for _, flags, req, prompt, context, n, drafts in by_cls.get(2, [])]
        ex.step_source = "the crashing step (OOM_STEP rows)"
    else:
        ex.requests = list(ctx.lost)
        ex.step_sequences = len(ctx.lost) or None
        ex.step_source = ("reconstructed from ARRIVE/ADMIT/FINISH rows: the requests running when the engine crashed "
                          "(the log has no OOM_STEP rows: the step's own tokens are not known)") if ctx.lost else \
            "not in the log (no OOM_STEP rows, no request running)"
    external = by_cls.get(3)
    if external:
        _, _, _, start, now, leaked, _ = external[0]
        ex.neighbour_bytes, ex.neighbour_start_bytes, ex.leaked_bytes = now, start, leaked
    _details(ex, ctx)
    _prevention(ex, ctx)
    return ex


def _details(ex: Explanation, ctx: OomContext) -> None:
    d = ex.details
    d.append(f"requested {gib(ex.requested_bytes)}"
             + (f" (the allocator tried to get {gib(ex.tried_to_allocate_bytes)} from the device)"
                if ex.tried_to_allocate_bytes and ex.tried_to_allocate_bytes != ex.requested_bytes else ""))
    d.append(f"device free {gib(ex.device_free_bytes)}; reserved by the caching allocator {gib(ex.reserved_bytes)}, of which "
             f"allocated {gib(ex.allocated_bytes)} and reserved-but-unallocated {gib(ex.reserved_unallocated_bytes)}"
             + (f"; largest cached free block at the last step boundary {gib(ex.largest_free_block_bytes)}"
                if ex.largest_free_block_bytes is not None else ""))
    if ex.allocator_reason == "fragmentation":
        d.append("the allocator's reason: fragmentation — the reserved-but-unallocated bytes exceed the request, "
                 "but they are split across cached blocks, none of them large enough")
    else:
        d.append("the allocator's reason: peak — the reserved-but-unallocated bytes are less than the request, and "
                 "the device's free memory plus the cached segments the allocator could release (those with no "
                 "allocated block left) did not cover it"
                 + (f": {gib(ex.shortfall_bytes)} short even counting every cached byte" if ex.shortfall_bytes else ""))
    if ex.startup_headroom_bytes is not None:
        d.append(f"start-up left {gib(ex.startup_headroom_bytes)} of headroom for a step's transients (device free + "
                 "reserved-but-unallocated once the engine was up); the step asked for "
                 f"{ex.requested_bytes / ex.startup_headroom_bytes:.0%} of it in one allocation")
    pl = [r for r in ex.requests if r.prompt_logprobs]
    if ex.step_tokens is not None:
        d.append(f"the step: {ex.step_tokens:,} tokens over {ex.step_sequences} sequence(s)"
                 + (f", {ex.step_prompt_logprob_positions:,} of them prompt positions whose logprobs were asked for"
                    if ex.step_prompt_logprob_positions else ""))
    if ex.step_tokens is not None:  # the step is known: the requests computing prompt positions in it
        pl = [r for r in pl if _positions(r) > 0] or pl
    if ex.cause == "prompt_logprobs" and pl:
        d.append("asking for prompt logprobs: " + ", ".join(
            f"request {r.req} (prompt {r.prompt_tokens:,} tokens" + (f", {_positions(r):,} prompt positions in this step"
                                                                      if _positions(r) else "") + ")"
            for r in pl[:5]) + (f" and {len(pl) - 5} more" if len(pl) > 5 else ""))
    if ex.cause == "long_context":
        longest = max((r.context_tokens or 0 for r in ex.requests), default=0)
        d.append(f"the longest context in the step: {longest:,} tokens")
    if ex.cause == "spec_decode":
        drafts = sum(r.spec_tokens or 0 for r in ex.requests)
        d.append(f"{drafts:,} speculative tokens in the step over {len(ex.requests)} request(s)")
    if ex.neighbour_bytes is not None and (ex.neighbour_bytes or ex.neighbour_start_bytes):
        d.append(f"another process holds {gib(ex.neighbour_bytes)} (it held {gib(ex.neighbour_start_bytes)} at "
                 f"start-up: +{gib(ex.neighbour_bytes - (ex.neighbour_start_bytes or 0))})")
    if ex.leaked_bytes:
        d.append(f"leaked since the engine started: {gib(ex.leaked_bytes)}")
    snap = ctx.snapshot
    if snap is not None:
        d.append(f"the PyTorch snapshot {snap.get('path', '')}: reserved {gib(snap.get('reserved_bytes'))}, allocated "
                 f"{gib(snap.get('allocated_bytes'))}, reserved-but-unallocated "
                 f"{gib(snap.get('reserved_unallocated_bytes'))} in {snap.get('segments')} segment(s), largest free "
                 f"block {gib(snap.get('largest_free_block_bytes'))}; empty_cache() could return "
                 f"{gib(snap.get('releasable_bytes'))}, {gib(snap.get('pinned_free_bytes'))} free is pinned by an "
                 "allocated block in its segment" + ("; expandable segments on" if snap.get("expandable_segments")
                                                     else ""))


def _prevention(ex: Explanation, ctx: OomContext) -> None:
    p = ex.prevention
    room = None if ex.device_free_bytes is None else ex.device_free_bytes + (ex.reserved_unallocated_bytes or 0)
    asked = ex.requested_bytes or 0
    if ex.allocator_reason == "fragmentation" or ex.cause == "fragmentation":
        p.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the cached bytes were enough, split across "
                 "blocks; expandable segments map pages into one growing range, so they would have served it")
    if ex.cause == "prompt_logprobs":
        positions = max((_positions(r) for r in ex.requests), default=0) or ex.step_prompt_logprob_positions or 0
        if room is not None and positions:
            row = max(1, asked // positions)  # bytes of one position's logits row (the failing tensor / its rows)
            cap = max(1, (room - GUARD_MARGIN_BYTES) // (2 * row))
            p.append(f"kvguard's logprob guard (--logprobs-guard; the plugin's step governor) caps such a step at "
                     f"about {cap:,} tokens while a prompt-logprob request prefills (estimate: "
                     f"{gib(room)} of room at the failure, less a {GUARD_MARGIN_BYTES // MIB} MiB margin, over two "
                     f"logits rows of {row:,} bytes per position)")
        p.append(f"vLLM's Model Runner V2 (0.33's default) computes prompt logprobs {V2_PROMPT_LOGPROBS_CHUNK} "
                 "positions at a time; or refuse/limit prompt_logprobs at the API gateway")
    if ex.cause in ("peak", "long_context", "spec_decode", "other") and ex.step_tokens and room is not None and asked:
        cap = int(ex.step_tokens * room / asked)
        if 0 < cap < ex.step_tokens:
            p.append(f"a step of at most about {cap:,} tokens would have fit (--max-num-batched-tokens, or the step "
                     "governor's cap; estimate: the failing allocation scaled linearly with the step's tokens)")
    if ex.cause == "long_context":
        p.append("cap the context the server accepts (--max-model-len) or the tokens of a long prefill's chunk "
                 "(--long-prefill-token-threshold), or an attention kernel whose buffers the context does not size")
    if ex.cause == "spec_decode":
        p.append("fewer speculative tokens (--num-speculative-tokens), or budget the verification rows "
                 "(num_reqs x (1 + k) logits) with a lower --gpu-memory-utilization")
    if ex.cause == "neighbour":
        p.append("keep other processes off the GPU (or account for them: a --gpu-memory-utilization that leaves "
                 "their growth outside vLLM's share)")
    if ex.cause == "leak":
        p.append("a scheduled restart before the leak reaches the headroom, or find the leak (its rate: the "
                 "leaked bytes over the engine's uptime)")
    # a utilization whose smaller KV cache leaves the whole allocation free on the device (no cache release needed)
    tried = ex.tried_to_allocate_bytes or asked
    short = None if ex.device_free_bytes is None else tried - ex.device_free_bytes
    if short and short > 0 and ctx.total_bytes and ctx.gpu_memory_utilization and ex.cause != "fragmentation":
        util = int((ctx.gpu_memory_utilization - short / ctx.total_bytes) * 100) / 100
        if util > 0:
            p.append(f"--gpu-memory-utilization {util:.2f} (from {ctx.gpu_memory_utilization:g}): a KV cache "
                     f"{gib(short)} smaller leaves the whole allocation free on the device")
    if not p:
        p.append("nothing the log shows would have prevented it")


def _positions(r: StepRequest) -> int:
    """Prompt positions of ``r`` the crashing step computed (those whose logits prompt logprobs need)."""
    if not r.prompt_logprobs or r.tokens is None or r.prompt_tokens is None or r.context_tokens is None:
        return 0
    start = r.context_tokens - r.tokens
    return max(0, min(r.tokens, r.prompt_tokens - start))
