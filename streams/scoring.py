"""Tier 3 over the ticks of one core call: each tick's window, the predictor's calls, and a fault
of the predictor kept to the ticks it is in.

Pure (numpy + stdlib). Each tick's window is taken by its ``NodeState`` when the tick is made (the
node's last ``window_ticks`` feature vectors, ending at that tick; a younger node's left-padded, as
the models were trained), so a call that makes many ticks of one node (a GPU back after being down,
a restart, a gap) scores each on its own history. The predictor is called once for every tick of
the call; when that call raises or answers out of shape, the ticks are scored node by node and a
failing node's tick by tick, and a P(OOM) that is not a fraction in [0, 1] (or a forecast that is
not finite) is dropped: such a tick goes out with ``p_oom`` None (the core counts it in
``CoreCounters.ticks_unscored``; logged here), and no other tick or node is affected.

A stateful predictor (``prime``/``step``/``forget``: one LSTM step per node per tick) is driven in
rounds, so each node advances once per call of the predictor, in tick order. A node is primed from
its full window when the predictor holds no state of its current ``NodeState`` and reset count (a
gap, a new epoch or geometry, a state restored from a checkpoint, none yet); a call that raises is
retried node by node, each primed afresh (the failed call may have left any of them half-advanced),
and a node whose own call fails is primed again at its next tick.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvguard.contracts.tick import Tick
from kvguard.streams.predictor import Predictor

if TYPE_CHECKING:
    from kvguard.streams.node_state import NodeState

log = logging.getLogger(__name__)


class TickWindow(NamedTuple):
    """A tick's predictor input, taken when the tick was made."""

    features: np.ndarray | None  # [window_ticks, F]; None: no history to score (no P(OOM) for the tick)
    resets: int  # the node's ``resets`` then: a change since the predictor's state was primed means "prime again"


class Prediction(NamedTuple):
    """The predictor's answer for one tick, inside the tick's contract."""

    p_oom: float
    u_kv_forecast: list[float]


class Scoring(NamedTuple):
    """A tick waiting for its P(OOM): its node's state, the tick and its window (None: no predictor)."""

    state: NodeState
    tick: Tick
    window: TickWindow | None


class Scorer:
    """The predictor's side of a ``StreamCore``: which node's state it holds, and the calls."""

    def __init__(self, predictor: Predictor, *, stateful: bool):
        self.predictor = predictor
        self.stateful = stateful
        # node -> (its NodeState, its resets) when the predictor's state was primed: a NodeState replaced
        # (restored from the changelog, partition moved back) or a reset since then means "prime again"
        self._primed: dict[str, tuple[NodeState, int]] = {}

    def pair(self, st: NodeState, ticks: list[Tick]) -> list[Scoring]:
        """The node's new ticks with the windows taken when they were made."""
        windows = st.take_windows()
        if len(windows) != len(ticks):  # a tick made without its window: score none of them rather than guess
            log.error("node %s: %d ticks but %d feature windows: no P(OOM) for them", st.node, len(ticks),
                      len(windows))
            windows = [TickWindow(None, st.resets)] * len(ticks)
        return [Scoring(st, tick, window) for tick, window in zip(ticks, windows)]

    def score(self, produced: list[Scoring]) -> list[Prediction | None]:
        """One answer per tick of ``produced``, None where it gets no P(OOM)."""
        return self._score_stateful(produced) if self.stateful else self._score_windows(produced)

    def forget(self, node: str) -> None:
        """The node's state is gone from the core: drop the predictor's too, if it holds one."""
        if self._primed.pop(node, None) is not None:
            self.predictor.forget(node)

    def _score_windows(self, produced: list[Scoring]) -> list[Prediction | None]:
        """``predict`` over every scorable tick of the call at once (``_score_rows``)."""
        scores: list[Prediction | None] = [None] * len(produced)
        rows = [i for i, item in enumerate(produced) if item.window.features is not None]
        self._log_windowless(produced, rows)
        if rows:
            self._score_rows(rows, produced, scores)
        return scores

    def _score_rows(self, rows: list[int], produced: list[Scoring], scores: list[Prediction | None]) -> None:
        """Score ``rows`` in one call; when it raises or answers out of shape, node by node, and a
        failing node tick by tick, so a fault costs only the ticks it is in."""
        try:
            out = self._predict(rows, produced)
        except Exception as err:  # noqa: BLE001 - a fault of the predictor must not stop the stream
            parts = list(_by_node(produced, rows).values())
            if len(parts) == 1:
                parts = [[i] for i in rows] if len(rows) > 1 else []
            if not parts:
                self._scoring_failed(produced[rows[0]].state.node, 1, err)
                return
            log.warning("predictor raised %s: %s on %d windows; scoring them in %d parts", type(err).__name__,
                        err, len(rows), len(parts))
            for part in parts:
                self._score_rows(part, produced, scores)
            return
        for i, score in zip(rows, out):
            scores[i] = score

    def _predict(self, rows: list[int], produced: list[Scoring]) -> list[Prediction | None]:
        window_ticks = self.predictor.window_ticks
        x = np.stack([produced[i].window.features[-window_ticks:] for i in rows])
        p, traj = self.predictor.predict(x)
        return self._predictions(rows, produced, p, traj)

    def _score_stateful(self, produced: list[Scoring]) -> list[Prediction | None]:
        """Prime/step in rounds so each node advances once per call of the predictor, in tick order.
        A node is primed (from its full window) when it has no predictor state of this NodeState
        and reset count; a call that raises is retried node by node, each primed afresh (the
        failed call may have left any of them half-advanced), and a node whose own call raises
        gets no P(OOM) for that tick and is primed again at its next."""
        scores: list[Prediction | None] = [None] * len(produced)
        scorable = [i for i, item in enumerate(produced) if item.window.features is not None]
        self._log_windowless(produced, scorable)
        for item in produced:
            if item.window.features is None:  # a tick the predictor's state did not see: start it over
                self._primed.pop(item.state.node, None)
        rounds: list[list[int]] = []
        seen: dict[str, int] = {}
        for i in scorable:
            node = produced[i].state.node
            k = seen.get(node, 0)
            seen[node] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(i)
        for members in rounds:
            primes = {i for i in members if self._needs_prime(produced[i])}
            steps = [i for i in members if i not in primes]
            for how, idx in (("prime", sorted(primes)), ("step", steps)):
                if idx:
                    self._stateful_call(how, idx, produced, scores)
        return scores

    def _needs_prime(self, item: Scoring) -> bool:
        """Whether the predictor's state of the node must start over for this tick (lost events: a
        gap, a new epoch or geometry; a NodeState restored from its checkpoint; none yet)."""
        st, resets = item.state, item.window.resets
        primed = self._primed.get(st.node)
        if primed is not None and primed[0] is st and primed[1] == resets:
            return False
        if primed is not None:
            self._forget_predictor_state(st.node)
        self._primed[st.node] = (st, resets)
        return True

    def _stateful_call(self, how: str, idx: list[int], produced: list[Scoring],
                       scores: list[Prediction | None]) -> None:
        try:
            out = self._advance(how, idx, produced)
        except Exception as err:  # noqa: BLE001 - a fault of the predictor must not stop the stream
            log.warning("predictor %s raised %s: %s for %d nodes; priming them one by one", how,
                        type(err).__name__, err, len(idx))
            for i in idx:
                node = produced[i].state.node
                self._forget_predictor_state(node)
                try:
                    (scores[i],) = self._advance("prime", [i], produced)
                except Exception as node_err:  # noqa: BLE001 - this node's tick stays without P(OOM)
                    self._primed.pop(node, None)
                    self._forget_predictor_state(node)
                    self._scoring_failed(node, 1, node_err)
            return
        for i, score in zip(idx, out):
            scores[i] = score
            if score is None:  # a value outside the contract: its state is suspect, start it over
                self._primed.pop(produced[i].state.node, None)

    def _advance(self, how: str, idx: list[int], produced: list[Scoring]) -> list[Prediction | None]:
        nodes = [produced[i].state.node for i in idx]
        if how == "prime":
            window_ticks = self.predictor.window_ticks
            x = np.stack([produced[i].window.features[-window_ticks:] for i in idx])
            p, traj = self.predictor.prime(nodes, x)
        else:
            x = np.stack([produced[i].window.features[-1] for i in idx])
            p, traj = self.predictor.step(nodes, x)
        return self._predictions(idx, produced, p, traj)

    def _forget_predictor_state(self, node: str) -> None:
        try:
            self.predictor.forget(node)
        except Exception as err:  # noqa: BLE001 - the node is primed afresh anyway
            log.warning("node %s: predictor forget raised %s: %s", node, type(err).__name__, err)

    def _predictions(self, rows: list[int], produced: list[Scoring], p, traj) -> list[Prediction | None]:
        """The predictor's answers for ``rows``, each checked against the tick's contract: P(OOM)
        a finite fraction, the forecast finite. An answer out of shape raises (the call failed);
        a value outside the contract leaves that tick without P(OOM)."""
        p = np.asarray(p, dtype=np.float64).reshape(-1)
        if len(p) != len(rows) or len(traj) != len(rows):
            raise ValueError(f"predictor answered {len(p)} probabilities and {len(traj)} forecasts "
                             f"for {len(rows)} windows")
        out: list[Prediction | None] = []
        for i, p_oom, forecast in zip(rows, p.tolist(), traj):
            values = np.asarray(forecast, dtype=np.float64).ravel()
            if not 0.0 <= p_oom <= 1.0 or not np.isfinite(values).all():
                self._scoring_failed(produced[i].state.node, 1,
                                     ValueError(f"P(OOM) {p_oom!r} or its forecast outside the tick's contract"))
                out.append(None)
                continue
            out.append(Prediction(float(p_oom), [float(x) for x in values]))
        return out

    def _scoring_failed(self, node: str, n_ticks: int, err: Exception) -> None:
        log.error("node %s: scoring %d tick(s) failed (%s: %s): no P(OOM) for them", node, n_ticks,
                  type(err).__name__, err)

    def _log_windowless(self, produced: list[Scoring], scorable: list[int]) -> None:
        if len(scorable) < len(produced):
            nodes = sorted({item.state.node for item in produced if item.window.features is None})
            log.warning("%d tick(s) without a feature window get no P(OOM) (nodes %s)",
                        len(produced) - len(scorable), ", ".join(nodes))


def _by_node(produced: list[Scoring], rows: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i in rows:
        out.setdefault(produced[i].state.node, []).append(i)
    return out
