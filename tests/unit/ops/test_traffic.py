"""The --traffic spelling shared by `kvguard plan` and `kvguard simulate`."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.ops.traffic import CLASSES, TrafficClass, TrafficError, parse_traffic, spell_traffic


def test_the_documented_example_parses():
    assert parse_traffic("prompt_logprobs:0.05,long_context:0.02@60000,spec_decode") == (
        TrafficClass("prompt_logprobs", 0.05), TrafficClass("long_context", 0.02, 60000), TrafficClass("spec_decode"))


def test_shapes_take_vllms_integer_suffixes():
    assert parse_traffic("long_context@60k")[0].shape == 60_000
    assert parse_traffic("long_context@64K")[0].shape == 65_536
    assert parse_traffic("logprobs:0.1@5")[0] == TrafficClass("logprobs", 0.1, 5)


@pytest.mark.parametrize("text, says", [
    ("", r"CLASS\[:SHARE\]\[@SHAPE\]"),
    ("prompt_logprobs,,spec_decode", r"CLASS\[:SHARE\]"),
    ("beam_search:0.1", "unknown request class 'beam_search'"),
    ("prompt_logprobs:1.5", r"SHARE must be in \(0, 1\]"),
    ("prompt_logprobs:0", r"SHARE must be in \(0, 1\]"),
    ("prompt_logprobs:lots", "SHARE must be a number"),
    ("long_context@-5", "SHAPE must be a positive integer"),
    ("long_context@0", "SHAPE must be positive"),
    ("spec_decode,spec_decode", "named twice"),
])
def test_bad_spellings_say_what_is_expected(text, says):
    with pytest.raises(TrafficError, match=says):
        parse_traffic(text)


@given(st.lists(st.tuples(st.sampled_from(sorted(CLASSES)),
                          st.one_of(st.none(), st.floats(0.001, 1.0).map(lambda x: round(x, 3))),
                          st.one_of(st.none(), st.integers(1, 10**6))),
                min_size=1, max_size=4, unique_by=lambda t: t[0]))
def test_spelling_and_parsing_are_inverse(items):
    classes = tuple(TrafficClass(*item) for item in items)
    assert parse_traffic(spell_traffic(classes)) == classes
