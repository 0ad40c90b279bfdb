"""The plugin's step governor on vLLM's real v1 scheduler (CPU, no GPU here): its calibration learns
from each step's measured allocator peak. The peaks are synthetic: a stand-in for ``torch.cuda`` whose
``max_memory_allocated`` after a step reports ``TRUE_FACTOR`` times the plan's figure for the batch the
scheduler really formed (the kernels the plan does not model, as on a real GPU). With the correction on,
steps after the warm-up fit the headroom; with it off (ceiling 1: the raw plan) they exceed it — the test
fails when the correction is off or wrong."""

from __future__ import annotations

import pytest

from kvguard.contracts.events import EventKind
from kvguard.producers.vllm.governor import Calibration, StepGovernor
from kvguard.producers.vllm.plugin_governor import ERROR_BUCKETS
from tests.integration.test_vllm_plugin import Rig
from tests.integration.test_vllm_plugin_guard import add

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

TRUE_FACTOR = 1.5
WARMUP = 8


class SyntheticCuda:
    """A GPU with ``free`` bytes free and nothing cached; each step's peak is TRUE_FACTOR x the plan."""

    def __init__(self, free: int, governor) -> None:
        self.free, self.governor = free, governor
        self.allocated = 1 << 30
        self.peaks: list[tuple[int, int]] = []  # (scheduled tokens, measured peak)
        self.reset = False

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def mem_get_info(self):
        return self.free, 24 << 30

    def memory_stats(self):
        return {"reserved_bytes.all.current": self.allocated, "allocated_bytes.all.current": self.allocated,
                "inactive_split_bytes.all.current": 0}

    def memory_allocated(self):
        return self.allocated

    def empty_cache(self):
        pass

    def reset_peak_memory_stats(self):
        self.reset = True

    def max_memory_allocated(self):
        assert self.reset  # the peak is read only after the step's reset
        self.reset = False
        shape, raw, _ = self.governor._step  # the batch the scheduler formed, as the plan prices it
        peak = int(TRUE_FACTOR * raw)
        self.peaks.append((shape.num_tokens, peak))
        return self.allocated + peak


class Torch:
    def __init__(self, cuda):
        self.cuda = cuda


def run(calibrated: bool) -> tuple[Rig, SyntheticCuda, int]:
    rig = Rig(2000, max_model_len=16384)
    gov = rig.actions.governor
    gov.calibration = Calibration(min_samples=WARMUP, refresh_every=1, ceiling=8.0 if calibrated else 1.0)
    gov.governor = StepGovernor(gov.governor.peak_fn, margin_bytes=0, calibration=gov.calibration)
    full = gov.governor.raw_peak(gov.batch_shape_for_budget(2048))
    free = int(full * 1.2)  # the raw plan of vLLM's budget fits; the real peak (1.5x) does not
    cuda = SyntheticCuda(free, gov)
    rig.actions.torch = gov.torch = Torch(cuda)
    for i in range(10):
        add(rig, f"r{i}", 4000, prompt_logprobs=None)
    for _ in range(40):
        rig.step()
    return rig, cuda, free


def test_the_calibrated_governor_keeps_measured_peaks_within_the_headroom_after_its_warmup():
    rig, cuda, free = run(calibrated=True)
    gov = rig.actions.governor
    assert len(cuda.peaks) >= 20
    after = cuda.peaks[WARMUP:]
    assert all(peak <= free for _, peak in after), after
    assert any(tokens < 2048 for tokens, _ in after)  # it shrank prefill steps to fit
    assert gov.calibration.factor(next(iter(gov.calibration._factor))) == pytest.approx(TRUE_FACTOR, rel=0.01)
    hist = gov.error_histogram()
    assert hist["count"] == len(cuda.peaks) and hist["buckets"]["+Inf"] == hist["count"]
    # the warm-up steps were under-predicted by 50 % (above the 0.25 bucket); every later one within 0
    assert hist["buckets"]["0.25"] == hist["buckets"]["0.0"] == hist["count"] - WARMUP
    assert ERROR_BUCKETS[-1] == 1.0
    assert len(gov.calibration.exceeded) == len(cuda.peaks)  # every step is above the raw plan, and logged
    kinds = rig.kinds()
    assert kinds.get("GOVERN", 0) == rig.actions.logprobs_guard_steps > 0
    assert rig.plugin.status()["governor"]["steps_governed"] == rig.actions.logprobs_guard_steps


def test_without_the_correction_the_same_steps_exceed_the_headroom():
    rig, cuda, free = run(calibrated=False)
    assert sum(peak > free for _, peak in cuda.peaks[WARMUP:]) > 5
    assert int(EventKind.GOVERN) == 28
