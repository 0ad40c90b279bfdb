"""The step governor's pure logic (producers.vllm.governor): the budget it sets is the largest whose worst
case fits, the fast path changes nothing, the cause is the class that costs the bytes, the calibration
follows measured peaks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.contracts.events import OomCause
from kvguard.producers.vllm.governor import (
    F_GOV_NO_FIT,
    F_GOV_SEQS,
    F_GOV_TOKENS,
    Calibration,
    Candidates,
    StepGovernor,
    StepShape,
    never_fits_message,
    worst_case,
)

MiB = 1 << 20


def toy_peak(shape: StepShape) -> int:
    """A monotone plan: activations per token, a sampler row per sequence, logprob rows, LSE rows."""
    rows = shape.num_logits or shape.num_seqs
    return (shape.num_tokens * 64 * 1024 + rows * 2 * MiB + shape.prompt_logprob_tokens * MiB
            + shape.num_seqs * shape.max_seq_len * 256)


candidates = st.builds(Candidates, num_seqs=st.integers(1, 256), decode_only=st.booleans(), running=st.integers(0, 256),
                       prompt_logprob_tokens=st.sampled_from([0, 256, 4096]), max_query_len=st.integers(1, 8192),
                       max_seq_len=st.integers(1, 32768), spec_tokens=st.sampled_from([0, 0, 3]))


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(16, 8192), st.integers(0, 40_000) .map(lambda m: m * MiB))
def test_the_budget_is_the_largest_whose_worst_case_fits(c, budget, room):
    g = StepGovernor(toy_peak, margin_bytes=64 * MiB)
    d = g.govern(c, budget, room, bucket_bytes=1)
    avail = room - 64 * MiB
    if d is None:
        assert toy_peak(worst_case(c, budget)) <= avail
        return
    assert toy_peak(worst_case(c, budget)) > avail and d.predicted_bytes == toy_peak(worst_case(c, budget))
    if d.max_seqs:  # an admission cap alone: the most sequences that fit at the full budget
        assert d.flags == F_GOV_SEQS and d.budget == budget and max(1, c.running) <= d.max_seqs < c.num_seqs
        assert toy_peak(worst_case(replace(c, num_seqs=d.max_seqs), budget)) <= avail
        assert toy_peak(worst_case(replace(c, num_seqs=d.max_seqs + 1), budget)) > avail
    elif d.flags & F_GOV_NO_FIT:
        floor = 1 + c.spec_tokens if c.decode_only else 1
        assert toy_peak(worst_case(c, floor)) > avail
    else:
        assert d.flags & F_GOV_TOKENS and d.budget < budget
        assert toy_peak(worst_case(c, d.budget)) <= avail
        assert toy_peak(worst_case(c, d.budget + 1)) > avail or worst_case(c, d.budget + 1) == worst_case(c, d.budget)
        assert d.tokens_removed == budget - d.budget


def test_decode_rows_shrink_to_fewer_sequences_when_speculative_rows_do_not_fit():
    c = Candidates(num_seqs=256, decode_only=True, max_query_len=4, max_seq_len=2048, spec_tokens=3, running=256)
    g = StepGovernor(toy_peak, margin_bytes=0)
    room = toy_peak(worst_case(c, 400))  # room for 100 rows of 4 tokens
    d = g.govern(c, 2048, room, bucket_bytes=1)
    assert d is not None and d.flags & F_GOV_SEQS and worst_case(c, d.budget).num_seqs == 100
    assert d.cause == int(OomCause.SPEC_DECODE)


def test_the_cause_is_the_class_whose_bytes_the_step_cannot_afford():
    g = StepGovernor(toy_peak, margin_bytes=0)
    lp = Candidates(num_seqs=4, prompt_logprob_tokens=4096, max_query_len=4096, max_seq_len=4096)
    assert g.cause_of(lp, 2048, 0) == int(OomCause.PROMPT_LOGPROBS)
    long = Candidates(num_seqs=200, max_query_len=256, max_seq_len=100_000)
    assert g.cause_of(long, 2048, 0) == int(OomCause.LONG_CONTEXT)
    plain = Candidates(num_seqs=200, max_query_len=256, max_seq_len=256)
    assert g.cause_of(plain, 2048, 0) == int(OomCause.PEAK)


def test_the_fast_path_is_cached_and_changes_nothing():
    calls = []

    def peak(shape):
        calls.append(shape)
        return toy_peak(shape)

    g = StepGovernor(peak, margin_bytes=0)
    c = Candidates(num_seqs=8, max_query_len=100, max_seq_len=1000)
    for _ in range(50):
        assert g.govern(c, 2048, 100 << 30) is None
    assert len(calls) == 1 and g.governed_steps == 0 and g.steps == 50


def test_a_request_that_cannot_fit_alone_is_named_with_its_need_and_the_headroom():
    g = StepGovernor(toy_peak, margin_bytes=256 * MiB)
    need = worst_case(Candidates(1, max_query_len=1, max_seq_len=10_000_000), 1)
    nbytes = g.never_fits(need, 1 << 30)
    assert nbytes == toy_peak(need) and nbytes > (1 << 30) - 256 * MiB
    assert g.never_fits(worst_case(Candidates(1, max_query_len=1, max_seq_len=1000), 1), 1 << 30) is None
    msg = never_fits_message(nbytes, 1 << 30, 256 * MiB, "1 token")
    assert "never fit" in msg and "2.39 GiB" in msg and "0.75 GiB" in msg


def test_the_calibration_learns_a_class_factor_and_the_governor_uses_it():
    cal = Calibration(quantile=0.9, min_samples=4, refresh_every=1)
    shape = StepShape(1024, 8)
    for measured in (120, 125, 130, 128, 131):
        cal.observe(shape, 100, measured)
    assert cal.factor(shape.shape_class) == pytest.approx(1.31)
    assert cal.correct(shape, 1000) == 1310 and len(cal.exceeded) == 5
    other = StepShape(8, 8)  # a class not learned yet takes the largest factor learned
    assert cal.correct(other, 1000) == 1310
    for _ in range(8):
        cal.observe(other, 100, 50)
    assert cal.factor(other.shape_class) == 1.0  # the floor: never below the plan by default
    g = StepGovernor(lambda s: 1000, margin_bytes=0, calibration=cal)
    assert g.peak(shape) == 1310 and g.raw_peak(shape) == 1000
    with pytest.raises(ValueError, match="quantile"):
        Calibration(quantile=0.0)
