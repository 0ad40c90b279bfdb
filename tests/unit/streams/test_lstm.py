"""The OOM LSTM: artifact save/load and validation, batched and stateful inference, the protocol."""

import json

import numpy as np
import pytest
import torch

from kvguard.streams.lstm import (
    LSTMPredictor,
    ModelError,
    ModelFeatureMismatch,
    ModelMetadata,
    Normalisation,
    OOMNet,
    load_model,
    save_model,
)
from kvguard.streams.metrics import FEATURE_NAMES
from kvguard.streams.predictor import Predictor, check_predictor, window_from_history

F = len(FEATURE_NAMES)


def make_model(seed=0, features=FEATURE_NAMES, window=180):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    data = rng.normal(size=(500, len(features))).astype(np.float32)
    meta = ModelMetadata(feature_names=list(features), normalisation=Normalisation.fit(data), threshold=0.3,
                         window_ticks=window, version="test")
    return OOMNet(len(features)), meta


def test_saved_model_loads_with_identical_predictions(tmp_path):
    net, meta = make_model()
    weights, meta_path = save_model(net, meta, tmp_path / "m.pt")
    assert weights.name == "m.pt" and meta_path.name == "m.json"
    loaded = load_model(tmp_path / "m.json", expected_features=list(FEATURE_NAMES))
    windows = np.random.default_rng(1).normal(size=(4, 180, F)).astype(np.float32)
    p1, traj1 = LSTMPredictor(net, meta).predict(windows)
    p2, traj2 = loaded.predict(windows)
    np.testing.assert_allclose(p1, p2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(traj1, traj2, rtol=0, atol=1e-6)
    assert loaded.threshold == 0.3 and loaded.metadata.version == "test"
    assert load_model(tmp_path / "m").metadata.version == "test"  # the stem names it too (--model .../oom_lstm)


def test_directory_path_uses_default_name_and_is_created(tmp_path):
    net, meta = make_model()
    save_model(net, meta, tmp_path / "new")
    assert (tmp_path / "new" / "oom_lstm.pt").exists() and (tmp_path / "new" / "oom_lstm.json").exists()
    assert load_model(tmp_path / "new").window_ticks == 180


def test_feature_mismatch_names_missing_and_extra_features(tmp_path):
    names = list(FEATURE_NAMES[:-1]) + ["gpu_temperature"]
    net, meta = make_model(features=names)
    save_model(net, meta, tmp_path / "m.pt")
    with pytest.raises(ModelFeatureMismatch) as err:
        load_model(tmp_path / "m.pt", expected_features=list(FEATURE_NAMES))
    msg = str(err.value)
    assert "gpu_temperature" in msg and FEATURE_NAMES[-1] in msg and "m.json" in msg


def test_feature_order_mismatch_names_the_position(tmp_path):
    names = list(FEATURE_NAMES)
    names[0], names[1] = names[1], names[0]
    net, meta = make_model(features=names)
    save_model(net, meta, tmp_path / "m.pt")
    with pytest.raises(ModelFeatureMismatch, match=r"another order \(position 0"):
        load_model(tmp_path / "m.pt", expected_features=list(FEATURE_NAMES))


def test_missing_file_and_bad_metadata_name_the_file_and_field(tmp_path):
    with pytest.raises(ModelError, match="nope.pt: model file not found"):
        load_model(tmp_path / "nope.pt")
    with pytest.raises(ModelError, match="oom_lstm.pt: model file not found"):
        load_model(tmp_path)
    net, meta = make_model()
    _, meta_path = save_model(net, meta, tmp_path / "m.pt")
    d = json.loads(meta_path.read_text())
    d["normalisation"]["mean"] = d["normalisation"]["mean"][:-1]
    meta_path.write_text(json.dumps(d))
    with pytest.raises(ModelError, match=rf"m.json: normalisation.mean has {F - 1} entries, feature_names has {F}"):
        load_model(tmp_path / "m.pt")
    d["format"] = "other/9"
    meta_path.write_text(json.dumps(d))
    with pytest.raises(ModelError, match="field 'format'"):
        load_model(tmp_path / "m.pt")


def test_weights_that_do_not_fit_the_metadata_are_refused(tmp_path):
    net, meta = make_model()
    save_model(net, meta, tmp_path / "m.pt")
    meta.hidden_size = 32
    (tmp_path / "m.json").write_text(json.dumps(meta.to_dict()))
    with pytest.raises(ModelError, match="m.pt: weights do not fit the metadata"):
        load_model(tmp_path / "m.pt")


def test_predictor_satisfies_the_stream_protocol():
    net, meta = make_model()
    pred = LSTMPredictor(net, meta)
    assert isinstance(pred, Predictor)
    check_predictor(pred)
    p, traj = pred.predict(np.zeros((3, 180, F), np.float32))
    assert p.shape == (3,) and traj.shape == (3, 30)
    assert np.all((p >= 0) & (p <= 1)) and np.all((traj >= 0) & (traj <= 1))
    p0, traj0 = pred.predict(np.zeros((0, 180, F), np.float32))
    assert p0.shape == (0,) and traj0.shape == (0, 30)
    with pytest.raises(ValueError, match=rf"windows must be \[n, T, {F}\]"):
        pred.predict(np.zeros((3, 180, 5), np.float32))


def test_stateful_step_matches_the_padded_window_for_a_new_node_and_tracks_it_after():
    net, meta = make_model(seed=3)
    pred = LSTMPredictor(net, meta)
    rng = np.random.default_rng(3)
    history = np.cumsum(rng.normal(scale=0.3, size=(220, F)), axis=0).astype(np.float32)
    stepped = [pred.step(["a"], history[t:t + 1])[0][0] for t in range(len(history))]
    windowed = [pred.predict(window_from_history(history[:t + 1], 180)[None])[0][0] for t in range(len(history))]
    assert stepped[0] == pytest.approx(windowed[0], abs=1e-6)
    # later the stateful path has seen more padding/history than the window; it stays close
    assert np.max(np.abs(np.array(stepped) - np.array(windowed))) < 0.05


def test_step_keeps_nodes_apart_and_forget_restarts_a_node():
    net, meta = make_model(seed=4)
    pred = LSTMPredictor(net, meta)
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(2, 30, F)).astype(np.float32)
    both = [pred.step(["a", "b"], np.stack([a[t], b[t]]))[0] for t in range(30)]
    solo = LSTMPredictor(net, meta)
    only_b = [solo.step(["b"], b[t:t + 1])[0][0] for t in range(30)]
    np.testing.assert_allclose([x[1] for x in both], only_b, atol=1e-6)
    pred.forget("a")
    fresh = LSTMPredictor(net, meta).step(["a"], a[:1])[0][0]
    assert pred.step(["a"], a[:1])[0][0] == pytest.approx(fresh, abs=1e-6)


def test_normalisation_ignores_non_finite_values_and_floors_std():
    x = np.ones((10, 2), np.float32)
    x[0, 1] = np.nan
    norm = Normalisation.fit(x)
    assert norm.std[0] == pytest.approx(1e-3)
    out = norm.apply(np.array([[1.0, np.inf]], np.float32))
    assert np.isfinite(out).all()


def test_zero_variance_features_are_neutral_and_z_is_clipped():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    x[:, 1] = 0.0  # e.g. log_evicted_pages in runs without a policy
    norm = Normalisation.fit(x)
    assert norm.active == [True, False, True]
    z = norm.apply(np.array([[1e6, 7.0, -1e6]], np.float32))
    assert z.tolist() == [[10.0, 0.0, -10.0]]  # clipped, and the unseen feature stays 0
    old = Normalisation(log1p=norm.log1p, mean=norm.mean, std=norm.std)  # artifact from before the fields
    assert abs(old.apply(np.array([[0.0, 7.0, 0.0]], np.float32))[0, 1]) > 1000


def test_prime_equals_predict_and_sets_the_state_that_step_continues():
    net, meta = make_model(seed=6)
    rng = np.random.default_rng(6)
    history = rng.normal(size=(200, F)).astype(np.float32)
    pred = LSTMPredictor(net, meta)
    w = window_from_history(history[:190], 180)[None]
    p_prime, traj_prime = pred.prime(["a"], w)
    p_win, traj_win = pred.predict(w)
    np.testing.assert_allclose(p_prime, p_win, atol=1e-6)
    np.testing.assert_allclose(traj_prime, traj_win, atol=1e-6)
    stepped = pred.step(["a"], history[190:191])[0][0]
    # the state after priming is the window's: one more step equals a 181-tick pass from zero
    whole = LSTMPredictor(net, meta)
    meta181 = whole.metadata
    meta181.window_ticks = 181
    assert stepped == pytest.approx(whole.predict(history[10:191][None])[0][0], abs=1e-5)
    with pytest.raises(ValueError, match=r"windows must be \[2, T"):
        pred.prime(["a", "b"], w)


class _Counting(LSTMPredictor):
    def __init__(self, net, meta):
        super().__init__(net, meta)
        self.calls = {"predict": 0, "prime": 0, "step": 0, "forget": 0}

    def predict(self, windows):
        self.calls["predict"] += 1
        return super().predict(windows)

    def prime(self, nodes, windows):
        self.calls["prime"] += 1
        return super().prime(nodes, windows)

    def step(self, nodes, features):
        self.calls["step"] += 1
        return super().step(nodes, features)

    def forget(self, node):
        self.calls["forget"] += 1
        super().forget(node)


def _core_scores(stateful: bool, batches, net, meta):
    from kvguard.streams.core import StreamCore

    pred = _Counting(net, meta)
    core = StreamCore(predictor=pred, stateful=stateful)
    out = {}
    for group in batches:
        ticks, _ = core.process_many(group)
        for t in ticks:
            out[(t.node, t.ts_ns)] = t.p_oom
    return out, pred.calls, core


def test_stream_core_stateful_path_equals_the_window_path():
    """Two nodes, batches of different sizes (several ticks per call), a lost batch (resync): the
    core's prime/step scores match the 180-tick window scores; the window path is not called."""
    from tests.unit.streams.streams_refpool import RefPool, batches_of, small_geometry

    net, meta = make_model(seed=7, window=20)  # short window so the stateful state outlives it
    meta.normalisation = Normalisation.fit(np.random.default_rng(7).normal(size=(500, F)).astype(np.float32))
    groups = []
    per_node = {}
    for node, seed in (("a", 1), ("b", 2)):
        pool = RefPool(small_geometry(128), seed=seed)
        for _ in range(3000):
            pool.random_op(time_step_ns=200_000_000)
        events = pool.events()
        n = len(events)
        cuts = [n // 7, n // 5, n // 3, n // 2, 2 * n // 3, n]
        per_node[node] = batches_of(events, node, pool.g, cuts)
    per_node["b"].pop(3)  # a gap on node b: the core must forget and re-prime it
    for i in range(max(len(v) for v in per_node.values())):
        groups.append([bs[i] for bs in per_node.values() if i < len(bs)])
    window, calls_w, _ = _core_scores(False, groups, net, meta)
    stateful, calls_s, core = _core_scores(True, groups, net, meta)
    assert calls_s["predict"] == 0 and calls_s["step"] > 0 and calls_s["prime"] >= 2
    assert calls_s["forget"] == 1 and core.nodes["b"].gaps == 1
    assert calls_w["predict"] == len(groups) and calls_w["step"] == 0
    assert window.keys() == stateful.keys() and len(window) > 40
    diff = np.abs(np.array([window[k] for k in window]) - np.array([stateful[k] for k in window]))
    assert diff.max() < 0.02, diff.max()


def test_stream_core_refuses_stateful_without_step():
    from kvguard.streams.core import StreamConfigError, StreamCore

    class WindowOnly:
        feature_names = FEATURE_NAMES
        window_ticks = 180

        def predict(self, windows):
            return np.zeros(len(windows)), np.zeros((len(windows), 30))

    assert StreamCore(predictor=WindowOnly()).stateful is False
    with pytest.raises(StreamConfigError, match="stateful"):
        StreamCore(predictor=WindowOnly(), stateful=True)


def test_stream_core_reprimes_a_node_restored_from_its_checkpoint():
    from kvguard.streams.core import NodeState, StreamCore
    from tests.unit.streams.streams_refpool import RefPool, batches_of, small_geometry

    net, meta = make_model(seed=8, window=20)
    pool = RefPool(small_geometry(128), seed=3)
    for _ in range(3000):
        pool.random_op(time_step_ns=200_000_000)
    events = pool.events()
    batches = batches_of(events, "a", pool.g, [len(events) // 3, 2 * len(events) // 3])
    pred = _Counting(net, meta)
    core = StreamCore(predictor=pred)
    core.process(batches[0])
    saved = core.nodes["a"].to_bytes()
    core.process(batches[1])
    core.nodes["a"] = NodeState.from_bytes(saved, core.config, with_predictor=True)  # partition came back
    before = dict(pred.calls)
    ticks, _ = core.process(batches[1])
    assert pred.calls["forget"] == before["forget"] + 1 and pred.calls["prime"] == before["prime"] + 1
    window_core = StreamCore(predictor=_Counting(net, meta), stateful=False)
    window_core.nodes["a"] = NodeState.from_bytes(saved, window_core.config, with_predictor=True)
    expected, _ = window_core.process(batches[1])
    assert ticks and [t.ts_ns for t in ticks] == [t.ts_ns for t in expected]
    np.testing.assert_allclose([t.p_oom for t in ticks], [t.p_oom for t in expected], atol=0.02)
