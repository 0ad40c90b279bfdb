"""The engine port's contract, run over every engine the registry holds and the vLLM plugin's adapter.

The same cases for every subject (``SUBJECTS``: each kind of ``producers.sim.registry.KINDS`` on the
smallest catalogue profile of that kind, and ``ExecutorEngine`` on vLLM 0.33's real v1 scheduler on
CPU, the rig of tests/integration/test_vllm_plugin.py), through kvguard's own ``Executor``:

- each capability an engine declares works: a hold holds and a release ends it, a cap caps the
  tokens of every step, an abort ends the request (the engine reports it ABORTED), an eviction frees
  the request's units, a headroom holds admissions back, empty_cache returns the bytes its note says
  (or says why it cannot), compaction moves pages and reclaim drops cached ones;
- each capability it does not declare acks NOOP with a reason and changes nothing;
- absurd payloads are refused with the reason and change nothing: statically (a negative hold, a
  headroom of 2^63: the record does not decode, even when validly signed) and against the node (a
  headroom or a target above the engine's pool: REJECTED_PAYLOAD).

Observations go through what every engine exposes: its event rows (FINISH, STEP, SEG_FREE, MIGRATE)
and which requests run or wait. A new engine is covered by registering it (and, for an engine that
runs outside the simulator, by adding its subject here). Needs vllm for the plugin's subject.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable

import numpy as np
import pytest

from kvguard.actuators.actuator import Actuator
from kvguard.actuators.executor import ExecutionResult, Executor
from kvguard.contracts.commands import (
    PAYLOADS,
    AbortPayload,
    AckOutcome,
    Action,
    BatchCapPayload,
    Command,
    CompactPayload,
    EmptyCachePayload,
    EvictPayload,
    HeadroomPayload,
    HoldPayload,
    Mode,
    Payload,
    ReclaimPayload,
    ReleasePayload,
    Target,
    sign,
)
from kvguard.contracts.dimensions import Granularity, HandlingChoice
from kvguard.contracts.engine import ActuationPort, Capabilities, EnginePort
from kvguard.contracts.events import EVENT_DTYPE, EventKind, Outcome
from kvguard.contracts.units import NS_PER_S
from kvguard.producers.sim.profiles import load_profile, profile_names
from kvguard.producers.sim.registry import KINDS, make_engine
from kvguard.producers.sim.workloads import Request
from kvguard.producers.vllm.actions import ExecutorEngine

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SECRET = b"contract-suite-secret-of-32-bytes-or-more"
NODE = "contract/gpu0"
LONG, SHORT = 3000, 300  # prompt tokens: every subject fits both, and a hold at HOLD_CAP tells them apart
HOLD_CAP = 1000
TOKEN_CAP = 1024  # at least every subject's max_num_seqs (vLLM's floor for the budget)


class Subject:
    """One engine under test: the port the executor drives, and how the test feeds and watches it."""

    name: str
    engine: ActuationPort

    def add(self, prompt_tokens: int, max_tokens: int = 400, *, hashes: tuple[int, ...] = ()) -> int:
        """Submit a request; its kvguard request id."""
        raise NotImplementedError

    def step(self) -> int:
        """One engine step; the tokens it scheduled."""
        raise NotImplementedError

    def running(self) -> set[int]:
        raise NotImplementedError

    def waiting(self) -> set[int]:
        raise NotImplementedError

    def now_ns(self) -> int:
        raise NotImplementedError

    def take_events(self) -> np.ndarray:
        """The engine's event rows since the last call."""
        raise NotImplementedError

    def steps(self, n: int) -> list[int]:
        return [self.step() for _ in range(n)]


class SimSubject(Subject):
    """A registered shadow engine, through its ``EnginePort`` only."""

    def __init__(self, kind: str) -> None:
        self.name = kind
        self.profile = smallest_profile(kind)
        self.engine = make_engine(self.profile, NODE)
        self._next = 1
        self._unread: list[np.ndarray] = []  # rows not yet taken by the test
        self._history: list[np.ndarray] = []  # every row, for which requests arrived and finished

    def add(self, prompt_tokens: int, max_tokens: int = 400, *, hashes: tuple[int, ...] = ()) -> int:
        req, self._next = self._next, self._next + 1
        self.engine.submit(Request(req, self.engine.now_ns, prompt_tokens, max_tokens, 5, hashes))
        return req

    def step(self) -> int:
        self.engine.advance(self.engine.now_ns + 1)  # a step that starts before the target runs to its end
        rows = self._pull()
        steps = rows[rows["kind"] == int(EventKind.STEP)]
        return int(steps["size"].max()) if len(steps) else 0

    def running(self) -> set[int]:
        return {v.req for v in self.engine.running_requests()}

    def waiting(self) -> set[int]:
        self._pull()
        rows = np.concatenate(self._history)
        arrived = set(rows["req"][rows["kind"] == int(EventKind.ARRIVE)].tolist())
        finished = set(rows["req"][rows["kind"] == int(EventKind.FINISH)].tolist())
        return arrived - finished - self.running()

    def now_ns(self) -> int:
        return self.engine.now_ns

    def take_events(self) -> np.ndarray:
        self._pull()
        rows, self._unread = np.concatenate(self._unread), []
        return rows

    def _pull(self) -> np.ndarray:
        rows = np.ascontiguousarray(self.engine.take_events(), dtype=EVENT_DTYPE)
        self._unread.append(rows)
        self._history.append(rows)
        return rows


class PluginSubject(Subject):
    """The vLLM plugin's ``ExecutorEngine`` over vLLM's real scheduler (CPU, weightless, fake model step)."""

    name = "vllm-plugin"

    def __init__(self) -> None:
        # vllm costs seconds to import: only when the plugin's subject is built
        from tests.integration.test_vllm_plugin import Rig

        self.rig = Rig(600)
        self.engine = self.rig.plugin.executor_engine
        self._names: dict[int, str] = {}
        self._seen_batches = 0

    def add(self, prompt_tokens: int, max_tokens: int = 400, *, hashes: tuple[int, ...] = ()) -> int:
        name = f"r{len(self._names) + 1}"
        self.rig.add(name, prompt_tokens, max_tokens=max_tokens, keys=hashes)
        req = self.rig.plugin.translator.req(name)
        self._names[req] = name
        return req

    def step(self) -> int:
        return sum(self.rig.step().values())

    def running(self) -> set[int]:
        return {self.rig.plugin.translator.req(n) for n in self.rig.running_ids()}

    def waiting(self) -> set[int]:
        return {self.rig.plugin.translator.req(n) for n in self.rig.waiting_ids()}

    def now_ns(self) -> int:
        return self.rig.plugin.translator.now()

    def take_events(self) -> np.ndarray:
        self.rig.feed()
        batches, self._seen_batches = self.rig.history[self._seen_batches:], len(self.rig.history)
        return np.concatenate([b.events for b in batches]) if batches else np.zeros(0, EVENT_DTYPE)


def smallest_profile(kind: str):
    """The catalogue profile of ``kind`` with the smallest KV region (the quickest to run)."""
    profiles = [p for p in (load_profile(n) for n in profile_names()) if p.engine == kind]
    assert profiles, f"the catalogue has no profile for the registered kind {kind!r}: add one to profiles.json"
    return min(profiles, key=lambda p: p.capacity_tokens)


SUBJECTS: dict[str, Callable[[], Subject]] = {
    **{kind: (lambda kind=kind: SimSubject(kind)) for kind in KINDS},
    "vllm-plugin": PluginSubject,
}
# what each subject declares, known before it is built (so each case runs where it applies)
DECLARED: dict[str, Capabilities] = {**{kind: KINDS[kind].capabilities for kind in KINDS},
                                     "vllm-plugin": ExecutorEngine.capabilities}


def offering(action: Action) -> list[str]:
    return [name for name, caps in DECLARED.items() if caps.offers(action)]


@pytest.fixture(params=list(SUBJECTS))
def subject(request) -> Subject:
    return SUBJECTS[request.param]()


def command(payload: Payload) -> Command:
    return Command(id="contract", node=NODE, payload=payload, reason="contract", mode=Mode.DEFAULT, variant="v",
                   issued_at_ns=0, ttl_ns=30 * NS_PER_S)


def run(s: Subject, payload: Payload) -> ExecutionResult:
    return Executor(s.engine).execute(command(payload), s.now_ns())


def decoding(s: Subject, n: int = 2, prompt: int = SHORT) -> list[int]:
    """``n`` requests past their prefill, decoding."""
    reqs = [s.add(prompt) for _ in range(n)]
    for _ in range(50):
        s.step()
        if set(reqs) <= s.running():
            break
    s.steps(2)
    assert set(reqs) <= s.running(), f"{s.name}: the requests did not start"
    s.take_events()
    return reqs


# -- every subject declares itself ---------------------------------------------------------------


def test_every_registered_kind_and_the_plugin_have_a_subject_and_every_knob_a_subject_that_offers_it():
    assert set(KINDS) <= set(SUBJECTS) == set(DECLARED) and "vllm-plugin" in SUBJECTS
    assert all(offering(action) for action in Action)


def port_members(port: type) -> set[str]:
    """The names a protocol of kvguard.contracts.engine asks for (its own and its bases')."""
    ports = [cls for cls in port.__mro__ if cls in (ActuationPort, EnginePort)]
    return {n for cls in ports for n in [*vars(cls), *getattr(cls, "__annotations__", {})] if not n.startswith("_")}


def test_the_engine_implements_the_port(subject):
    port = EnginePort if isinstance(subject, SimSubject) else ActuationPort
    assert port_members(ActuationPort) >= {"evict_request", "pool_units", "capabilities", "empty_cache"}
    missing = {name for name in port_members(port) if not hasattr(subject.engine, name)}
    assert not missing, f"{subject.name} lacks {sorted(missing)} of {port.__name__}"


def test_the_engine_declares_capabilities_and_its_pool(subject):
    caps = type(subject.engine).capabilities
    assert caps is subject.engine.capabilities and subject.engine.pool_units > 0
    for action in Action:
        assert caps.offers(action) == (caps.lacks(action) is None)


# -- declared capabilities work ----------------------------------------------------------------


@pytest.mark.parametrize("subject", offering(Action.HOLD), indirect=True)
def test_a_hold_keeps_long_prompts_waiting_and_a_release_admits_them(subject):
    decoding(subject, 1)
    assert run(subject, HoldPayload(max_prompt_tokens=HOLD_CAP)).outcome is AckOutcome.EXECUTED
    long, short = subject.add(LONG), subject.add(SHORT)
    subject.steps(5)
    assert short in subject.running() and long in subject.waiting()  # the short one passed the held one
    assert run(subject, ReleasePayload()).outcome is AckOutcome.EXECUTED
    subject.steps(5)
    assert long in subject.running()
    again = run(subject, ReleasePayload())
    assert again.outcome is AckOutcome.NOOP and again.errors == ("release: no hold in place",)


@pytest.mark.parametrize("subject", offering(Action.HOLD), indirect=True)
def test_a_drain_admits_nothing_while_running_requests_go_on(subject):
    running = decoding(subject, 1)
    assert run(subject, HoldPayload(0)).outcome is AckOutcome.EXECUTED
    new = subject.add(SHORT)
    tokens = subject.steps(5)
    assert new in subject.waiting() and set(running) <= subject.running() and all(tokens)


@pytest.mark.parametrize("subject", offering(Action.BATCH_CAP), indirect=True)
def test_a_cap_caps_the_tokens_of_every_step_and_tokens_zero_releases_it(subject):
    assert run(subject, BatchCapPayload(tokens=TOKEN_CAP)).outcome is AckOutcome.EXECUTED
    subject.add(6000, max_tokens=4)  # a long prompt: chunked at the budget
    capped = subject.steps(4)
    assert max(capped) == TOKEN_CAP, capped
    assert run(subject, BatchCapPayload(tokens=0)).outcome is AckOutcome.EXECUTED
    assert subject.step() > TOKEN_CAP  # the rest of the prompt at the engine's own budget


@pytest.mark.parametrize("subject", offering(Action.ABORT), indirect=True)
def test_an_abort_ends_the_request_and_the_engine_reports_it_aborted(subject):
    victim, other = decoding(subject, 2)
    result = run(subject, AbortPayload((victim, 10**9)))
    assert result.outcome is AckOutcome.EXECUTED and (result.targets_done, result.targets_noop) == (1, 1)
    assert result.units_freed > 0 and any("10" in e and "not in the engine" in e for e in result.errors)
    subject.steps(2)
    rows = subject.take_events()
    finish = rows[(rows["kind"] == int(EventKind.FINISH)) & (rows["req"] == victim)]
    assert list(finish["flags"]) == [int(Outcome.ABORTED)]
    assert victim not in subject.running() | subject.waiting() and other in subject.running()


@pytest.mark.parametrize("subject", offering(Action.EVICT), indirect=True)
def test_an_eviction_frees_the_request_s_units_and_takes_it_off_the_running_set(subject):
    victim, other = decoding(subject, 2)
    result = run(subject, EvictPayload((Target(victim),)))
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed > 0
    assert victim not in subject.running() and other in subject.running()
    idle = run(subject, EvictPayload((Target(10**9),)))
    assert idle.outcome is AckOutcome.NOOP and "nothing to free" in idle.errors[0]


def declared(field: str) -> list[tuple[str, object]]:
    """(subject, value) for every value of a set-valued capability a subject declares."""
    return [(name, value) for name, caps in DECLARED.items() for value in sorted(getattr(caps, field))]


@pytest.mark.parametrize("subject, granularity", declared("evict_granularities"), indirect=["subject"])
def test_every_declared_granularity_frees_units_of_its_target(subject, granularity):
    victim, other = decoding(subject, 2, prompt=800)
    result = run(subject, EvictPayload((Target(victim, 8),), granularity=granularity))
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed >= 1, result
    assert other in subject.running()


@pytest.mark.parametrize("subject, handling", declared("evict_handlings"), indirect=["subject"])
def test_every_declared_handling_frees_the_request_s_units_without_a_fallback_note(subject, handling):
    victim, _ = decoding(subject, 2)
    result = run(subject, EvictPayload((Target(victim),), handling=handling))
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed > 0 and result.errors == (), result


@pytest.mark.parametrize("subject", offering(Action.HEADROOM), indirect=True)
def test_a_headroom_of_the_whole_pool_holds_admissions_back_and_zero_releases_it(subject):
    decoding(subject, 1)
    assert run(subject, HeadroomPayload(units=subject.engine.pool_units)).outcome is AckOutcome.EXECUTED
    new = subject.add(SHORT)
    subject.steps(5)
    assert new not in subject.running()
    assert run(subject, HeadroomPayload(units=0)).outcome is AckOutcome.EXECUTED
    subject.steps(5)
    assert new in subject.running()


@pytest.mark.parametrize("subject", offering(Action.EMPTY_CACHE), indirect=True)
def test_empty_cache_returns_the_bytes_its_note_says_or_says_why_it_cannot(subject):
    done = subject.add(LONG, max_tokens=2)  # a long prefill grows the allocator's cache, then finishes
    for _ in range(50):
        subject.step()
        if done not in subject.running() | subject.waiting():
            break
    subject.take_events()
    result = run(subject, EmptyCachePayload())
    freed = subject.take_events()
    returned = int(freed["size"][freed["kind"] == int(EventKind.SEG_FREE)].sum())
    if result.outcome is AckOutcome.EXECUTED:
        assert result.errors == (f"empty_cache: {returned} bytes returned to the device",) and returned > 0
    else:  # a declared knob that cannot act here (no CUDA in this process) says so and changes nothing
        assert result.outcome is AckOutcome.NOOP and "no CUDA" in result.errors[0] and returned == 0


@pytest.mark.parametrize("subject", offering(Action.COMPACT), indirect=True)
def test_compaction_moves_pages_into_the_holes_evictions_left(subject):
    reqs = decoding(subject, 6, prompt=800)
    for req in reqs[1::2]:  # holes between the survivors
        assert run(subject, EvictPayload((Target(req),))).outcome is AckOutcome.EXECUTED
    subject.take_events()
    result = run(subject, CompactPayload(max_moves=1000))
    rows = subject.take_events()
    assert result.outcome is AckOutcome.EXECUTED and result.units_moved > 0
    assert (rows["kind"] == int(EventKind.MIGRATE)).any() and set(reqs[0::2]) <= subject.running()


@pytest.mark.parametrize("subject", offering(Action.RECLAIM), indirect=True)
def test_reclaim_drops_the_cached_prefix_pages_a_finished_request_left(subject):
    done = subject.add(1024, max_tokens=2, hashes=tuple(range(1, 17)))
    for _ in range(50):
        subject.step()
        if done not in subject.running() | subject.waiting():
            break
    result = run(subject, ReclaimPayload(units=subject.engine.pool_units))
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed > 0
    again = run(subject, ReclaimPayload(units=10))
    assert again.outcome is AckOutcome.NOOP and again.errors == ("reclaim: no cached prefix pages to drop",)


# -- undeclared capabilities ack NOOP with a reason -------------------------------------------------

VALID: dict[Action, Callable[[list[int]], Payload]] = {
    Action.EVICT: lambda reqs: EvictPayload((Target(reqs[0]),)),
    Action.COMPACT: lambda reqs: CompactPayload(max_moves=16),
    Action.RECLAIM: lambda reqs: ReclaimPayload(units=16),
    Action.HEADROOM: lambda reqs: HeadroomPayload(units=16),
    Action.BATCH_CAP: lambda reqs: BatchCapPayload(tokens=TOKEN_CAP),
    Action.HOLD: lambda reqs: HoldPayload(HOLD_CAP),
    Action.RELEASE: lambda reqs: ReleasePayload(),
    Action.ABORT: lambda reqs: AbortPayload((reqs[0],)),
    Action.EMPTY_CACHE: lambda reqs: EmptyCachePayload(),
}


def test_every_action_has_a_case():
    assert set(VALID) == set(Action) == set(PAYLOADS)


def lacks_something(caps: Capabilities) -> bool:
    return not all(caps.offers(a) for a in Action) or set(caps.evict_granularities) != set(Granularity)


@pytest.mark.parametrize("subject", [n for n, caps in DECLARED.items() if lacks_something(caps)], indirect=True)
def test_what_the_engine_does_not_declare_acks_noop_with_a_reason_and_changes_nothing(subject):
    caps = subject.engine.capabilities
    reqs = decoding(subject, 2)
    lacking = [VALID[a](reqs) for a in Action if not caps.offers(a)]
    lacking += [EvictPayload((Target(reqs[0]),), granularity=g) for g in Granularity
                if g not in caps.evict_granularities]
    assert lacking
    for payload in lacking:
        result = run(subject, payload)
        assert result.outcome is AckOutcome.NOOP and result.errors and result.errors[0].startswith(
            payload.action.value), (payload, result)
        assert result.units_freed == result.units_moved == result.targets_done == 0
    assert len(subject.take_events()) == 0 and set(reqs) <= subject.running()


@pytest.mark.parametrize("subject", [n for n, caps in DECLARED.items() if set(caps.evict_handlings) != set(HandlingChoice)
                                     and caps.offers(Action.EVICT)], indirect=True)
def test_an_undeclared_handling_is_carried_out_as_recompute_with_a_note(subject):
    missing = [h for h in HandlingChoice if h not in subject.engine.capabilities.evict_handlings]
    victim, _ = decoding(subject, 2)
    result = run(subject, EvictPayload((Target(victim),), handling=missing[0]))
    assert result.outcome is AckOutcome.EXECUTED and result.units_freed > 0
    assert "recomputed instead" in result.errors[0]


# -- absurd payloads are refused -------------------------------------------------------------------


def test_numbers_beyond_the_pool_are_refused_before_anything_changes(subject):
    reqs = decoding(subject, 2)
    pool = subject.engine.pool_units
    for payload in (HeadroomPayload(units=pool + 1), EvictPayload((Target(reqs[0], pool + 1),)),
                    ReclaimPayload(units=pool + 1), CompactPayload(max_moves=pool + 1)):
        result = run(subject, payload)
        assert result.outcome is AckOutcome.REJECTED_PAYLOAD and f"pool of {pool} units" in result.errors[0]
    new = subject.add(SHORT)
    subject.steps(5)
    assert set(reqs) <= subject.running() and new in subject.running()  # no headroom was left behind


def signed_record(payload: dict, action: str) -> bytes:
    """A command record signed with the shared secret, as a holder of the secret could write any record."""
    d = command(ReleasePayload()).to_dict() | {"action": action, "payload": payload, "id": f"absurd-{action}"}
    d.pop("signature")
    digest = hmac.new(SECRET, json.dumps(d, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256)
    return json.dumps(d | {"signature": digest.hexdigest()}).encode()


ABSURD = [("headroom", {"units": 2**63 - 1}), ("hold", {"max_prompt_tokens": -1, "steps": -1}),
          ("batch_cap", {"tokens": -5, "steps": 0}), ("evict", {"targets": [[1, -1]]}),
          ("compact", {"max_moves": 0}), ("abort", {"requests": []}),
          ("hold", {"max_prompt_tokens": 0, "steps": 0, "units_needed": 7})]


def test_validly_signed_absurd_commands_do_not_decode_and_change_nothing(subject):
    reqs = decoding(subject, 2)
    actuator = Actuator(NODE, Executor(subject.engine), SECRET)
    for action, payload in ABSURD:
        assert actuator.handle_record(signed_record(payload, action), subject.now_ns()) is None
    assert actuator.counters.malformed == len(ABSURD) and actuator.counters.executed == 0
    new = subject.add(SHORT)
    subject.steps(5)
    assert set(reqs) <= subject.running() and new in subject.running()  # no hold, no headroom, no cap


def test_a_signed_headroom_above_the_pool_is_acked_rejected_with_the_reason(subject):
    decoding(subject, 1)
    actuator = Actuator(NODE, Executor(subject.engine), SECRET)
    cmd = sign(command(HeadroomPayload(units=subject.engine.pool_units + 1)), SECRET)  # well formed, signed
    ack = actuator.handle(cmd, cmd.issued_at_ns)
    assert ack.outcome is AckOutcome.REJECTED_PAYLOAD and "exceeds this node's pool" in ack.errors[0]
    assert actuator.counters.rejected_payload == 1 and cmd.id not in actuator.journal
    new = subject.add(SHORT)
    subject.steps(5)
    assert new in subject.running()
