"""The admission gate on the shadow vLLM engine (issue 29): ``producers.admission``'s model over the
engine's scheduler, with the hold queue and the ADMISSION rows.

The engine calls three hooks: ``offer`` for each arrival that vLLM itself would take (after the
restart and ``--max-num-queued-*`` checks), ``release`` at each scheduling point (held requests are
re-decided highest priority first), and ``observe_output`` at each completion (the length model).
Admitting is the engine's own ``_take_in`` (vLLM's ``add_request``); refusing is the engine's
``_refuse`` (FINISH ``Outcome.REFUSED``, counted, retryable with ``Retry-After``).

ADMISSION rows (``kvguard.contracts.events``): ``cls`` = ``Decision`` (HOLD, REFUSE, RELEASE),
``tokens`` = prompt tokens, ``size`` = predicted saturation in 1/1000, ``aux`` = predicted queueing
delay in ms (capped), ``offset`` = Retry-After in ms for a refusal.
"""

from __future__ import annotations

import math

from kvguard.contracts.events import EventKind
from kvguard.contracts.units import DEFAULT_PRIORITY, NS_PER_S
from kvguard.producers.admission import (
    AdmissionConfig,
    AdmissionModel,
    AdmissionStats,
    Decision,
    Held,
    HoldQueue,
    NodeView,
    Seq,
    Verdict,
)

_ADMISSION = int(EventKind.ADMISSION)
_DELAY_CAP_MS = 86_400_000
STATE_EVERY_NS = NS_PER_S  # an endpoint state row (req -1) at most once per second of event time


class ShadowGate:
    """One engine's gate; see the module docstring."""

    def __init__(self, engine, config: AdmissionConfig):
        self.engine = engine
        self.model = AdmissionModel(config)
        self.held = HoldQueue()
        self.stats = AdmissionStats()
        self._prompt_sum = self._prompt_n = 0
        self.last: Verdict | None = None
        self._state_ns = -STATE_EVERY_NS

    # ---- the engine's view ---------------------------------------------------------------------
    def view(self) -> NodeView:
        e = self.engine
        sched, p = e.scheduler, e.profile
        reqs = e._reqs
        running, waiting = [], []
        for seq in sched.running:
            info = reqs[seq.request_id]
            running.append(Seq(info.priority, seq.num_prompt_tokens, seq.max_tokens, len(seq.output_token_ids),
                               len(sched.kv.req_to_blocks.get(seq.request_id, ()))))
        for seq in sched.waiting:
            info = reqs[seq.request_id]
            waiting.append(Seq(info.priority, seq.num_prompt_tokens, seq.max_tokens, len(seq.output_token_ids)))
        return NodeView(num_blocks=p.memory.num_gpu_blocks - 1, block_size=e.block_size, max_num_seqs=p.max_num_seqs,
                        max_batched_tokens=sched.max_num_scheduled_tokens, step_s=p.step_seconds, running=running,
                        waiting=waiting, policy=e.spec.policy, watermark_blocks=sched.kv.watermark_blocks)

    def endpoint_state(self) -> Verdict:
        """What the node would do now with a typical request (priority 5, the mean prompt seen): the
        router series ``kvguard_endpoint_admit`` / saturation / expected queueing delay."""
        prompt = self._prompt_sum // self._prompt_n if self._prompt_n else 512
        probe = Seq(DEFAULT_PRIORITY, max(1, prompt), 256)
        if len(self.held):
            v = self.model.decide(self.view(), probe)
            return Verdict(Decision.HOLD if v.decision is Decision.ADMIT else v.decision, v.delay_s, v.saturation,
                           v.retry_after_s)
        return self.model.decide(self.view(), probe)

    # ---- hooks ---------------------------------------------------------------------------------
    def offer(self, request, ts: int, priority: int, wants_logprobs: bool) -> None:
        """A new arrival vLLM would take: admit it into the scheduler, hold it, or refuse it."""
        self._prompt_sum += request.prompt_tokens
        self._prompt_n += 1
        seq = Seq(priority, request.prompt_tokens, max(1, request.max_output_tokens))
        if len(self.held) and any(h.seq.priority >= priority for h in self.held):
            verdict = self.model.decide(self.view(), seq)  # those held before it go first: never admit past them
            if verdict.decision is Decision.ADMIT:
                verdict = Verdict(Decision.HOLD, verdict.delay_s, verdict.saturation)
        else:
            verdict = self.model.decide(self.view(), seq)
        self.last = verdict
        if verdict.decision is Decision.ADMIT:
            self.engine._take_in(request, ts, priority, wants_logprobs)
        elif verdict.decision is Decision.HOLD:
            self.stats.held += 1
            self.held.add(Held(request.req_id, seq, ts, (request, wants_logprobs)))
            self._row(ts, request, Decision.HOLD, verdict)
        else:
            self._refuse(ts, request, priority, verdict)

    def release(self, now: int, *, down: bool = False) -> None:
        """Re-decide the held requests (highest priority, then oldest, first); at most once per
        ``STATE_EVERY_NS`` write the endpoint state row the router series come from."""
        if now - self._state_ns >= STATE_EVERY_NS:
            self._state_ns = now
            v = self.endpoint_state()
            delay_ms = _DELAY_CAP_MS if not math.isfinite(v.delay_s) else min(_DELAY_CAP_MS, int(v.delay_s * 1000))
            self.engine.recorder.row(_ADMISSION, now, -1, cls=int(v.decision), size=int(round(v.saturation * 1000)),
                                     aux=delay_ms)
        if not len(self.held):
            return
        for h in self.held:
            held_s = (now - h.since_ns) / NS_PER_S
            request, wants_logprobs = h.payload
            if down:
                if held_s >= self.model.config.hold_limit_s:
                    self.held.remove(h)
                    self._refuse(now, request, h.seq.priority, Verdict(Decision.REFUSE, math.inf, 1.0,
                                                                       self.model.config.min_retry_after_s))
                continue
            verdict = self.model.decide(self.view(), h.seq, held_s=held_s)
            if verdict.decision is Decision.ADMIT:
                self.held.remove(h)
                self.stats.released += 1
                self._row(now, request, Decision.RELEASE, verdict)
                self.engine._take_in(request, now, h.seq.priority, wants_logprobs)
            elif verdict.decision is Decision.REFUSE:
                self.held.remove(h)
                self._refuse(now, request, h.seq.priority, verdict)

    def observe_output(self, priority: int, output_tokens: int) -> None:
        self.model.lengths.observe(priority, output_tokens)

    # ---- rows ----------------------------------------------------------------------------------
    def _refuse(self, ts: int, request, priority: int, verdict: Verdict) -> None:
        self.stats.count_refused(priority, verdict.retry_after_s)
        self._row(ts, request, Decision.REFUSE, verdict)
        self.engine._refuse(request, ts)

    def _row(self, ts: int, request, decision: Decision, verdict: Verdict) -> None:
        delay_ms = _DELAY_CAP_MS if not math.isfinite(verdict.delay_s) else min(_DELAY_CAP_MS,
                                                                                int(verdict.delay_s * 1000))
        self.engine.recorder.row(_ADMISSION, ts, request.req_id, cls=int(decision), tokens=request.prompt_tokens,
                                 size=int(round(verdict.saturation * 1000)), aux=delay_ms,
                                 offset=int(verdict.retry_after_s * 1000))


def admission_totals(gates, shed_at_router: int = 0) -> dict:
    """The gates' counts over a fleet (the summary's ``admission`` block)."""
    total = AdmissionStats()
    for g in gates:
        s = g.stats
        total.held += s.held
        total.released += s.released
        total.refused += s.refused
        for p, n in s.refused_by_priority.items():
            total.refused_by_priority[p] = total.refused_by_priority.get(p, 0) + n
        total.retry_after_s.extend(s.retry_after_s)
    out = total.to_dict()
    out["refused_at_router"] = shed_at_router
    out["answer"] = "HTTP 503 with Retry-After (vLLM's own queue caps answer 503 without one)"
    return out
