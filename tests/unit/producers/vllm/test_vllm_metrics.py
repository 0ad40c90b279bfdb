"""The /metrics parser and interval arithmetic of ``producers.vllm.metrics`` on hand-made edge cases
(the real vLLM exposition is tested in tests/integration/test_scrape.py)."""

from __future__ import annotations

import math

import pytest

from kvguard.producers.vllm.metrics import (
    MetricsParseError,
    histogram_quantile,
    interval,
    parse_exposition,
    vllm_engines,
)


def test_labels_with_escapes_inf_and_timestamps_parse():
    samples = parse_exposition('# HELP x y\nm{a="q\\"uo\\\\te",b="n\\nl"} +Inf 1700000000000\nplain 3e-2\n')
    assert samples[0].labels == (("a", 'q"uo\\te'), ("b", "n\nl")) and math.isinf(samples[0].value)
    assert samples[1].name == "plain" and samples[1].value == 0.03


def test_a_broken_line_names_its_number():
    with pytest.raises(MetricsParseError, match="line 2"):
        parse_exposition("ok 1\nnot a sample line at all\n")


def test_histogram_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_a_counter_that_went_down_is_a_reset_not_a_negative_rate():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} {p}\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} {g}\n')
    before = vllm_engines(parse_exposition(text.replace("{p}", "10").replace("{g}", "1000")))[("m", "0")]
    after = vllm_engines(parse_exposition(text.replace("{p}", "2").replace("{g}", "50")))[("m", "0")]
    iv = interval(after, before, 5.0)
    assert iv.reset and iv.preemptions is None and iv.decode_tokens_per_s is None
    again = vllm_engines(parse_exposition(text.replace("{p}", "7").replace("{g}", "550")))[("m", "0")]
    iv = interval(again, after, 5.0)
    assert not iv.reset and iv.preemptions == 5 and iv.decode_tokens_per_s == 100.0


def test_engines_are_told_apart_by_their_labels():
    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.1\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.9\n')
    engines = vllm_engines(parse_exposition(text))
    assert {k: e.kv_cache_usage for k, e in engines.items()} == {("a", "0"): 0.1, ("a", "1"): 0.9}
