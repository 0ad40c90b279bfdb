"""kvguard's SGLang scheduler against SGLang 0.5.23's own classes, step by step
(producers.sim.sglang.conformance, which runs SGLang in a subprocess on CPU with the stand-ins of
producers.sim.sglang.cpu_imports), with prefix hits, chunked prefill, pages of 1, 4 and 16 tokens,
both radix trees SGLang has (the Python RadixCache and the UnifiedRadixCache with its Rust core that
0.5.23's scheduler builds), and enough KV pressure to retract.

Tolerance: none. Every step must be the same kind, prefill the same requests with the same cached
prefix and extend length in order, decode the same requests, retract, abort and finish the same
ones, leave the same free, evictable and protected token counts, the same new_token_ratio (1e-12),
and the allocator's free-page list in the same order (its checksum). A last test breaks kvguard's
page order on purpose and checks the harness sees it.

Needs sglang (``scripts/install-sglang-cpu.sh .venv``, run by ``make venv``); without it these tests
fail with the install command, they are not skipped. About 15 s a case on 2 cores (~10 s of it
importing SGLang in the subprocess).
"""

from __future__ import annotations

import sys

import pytest

from kvguard.producers.sim.sglang import conformance as sglang_conformance
from kvguard.producers.sim.sglang.conformance import (
    SglangMissing,
    compare,
    conformance_requests,
    run_conformance,
    sglang_traces,
)
from kvguard.producers.sim.sglang.scheduler import SchedulerConfig
from kvguard.producers.sim.sglang.token_pool import TokenPool
from kvguard.producers.sim.workloads import Request, load_workload, mix_hash


def long_outputs(n: int = 90) -> list[Request]:
    """Prompts sharing half their tokens in four families, outputs of 200-1100 tokens: the admission
    budget over-commits as new_token_ratio decays, so decode runs short and retracts."""
    out = []
    for i in range(n):
        h = mix_hash(i, 7)
        prompt = 100 + h % 700
        hashes = tuple(mix_hash(i % 4, k) for k in range(prompt // 128))
        out.append(Request(i + 1, int(i * 0.075e9), prompt, 200 + (h >> 20) % 900, None, hashes))
    return out


CASES = {
    "retractions-page4-radix": (lambda: long_outputs(), {"max_total_num_tokens": 6000, "page_size": 4,
                                                         "chunked_prefill_size": 512},
                                "radix", {"retracted": 3, "prefix_hit_tokens": 10_000}),
    "retractions-page16-unified": (lambda: long_outputs(120), {"max_total_num_tokens": 3008, "page_size": 16,
                                                               "chunked_prefill_size": 1024},
                                   "unified", {"retracted": 1, "prefix_hit_tokens": 1000}),
    "mooncake-chunked-unified": (lambda: load_workload("mooncake-sample", rate_scale=10, window=3).requests,
                                 {"max_total_num_tokens": 8000, "page_size": 4, "chunked_prefill_size": 2048},
                                 "unified", {"retracted": 0, "prefix_hit_tokens": 15_000}),
    "azure-conv-page1-radix": (lambda: load_workload("azure-conv", rate_scale=4, window=10).requests,
                               {"max_total_num_tokens": 6000, "page_size": 1, "chunked_prefill_size": 2048},
                               "radix", {"retracted": 1, "prefix_hit_tokens": 10_000}),
}


def case_inputs(name: str):
    make, settings, tree, _ = CASES[name]
    config = SchedulerConfig(max_running_requests=32, max_prefill_tokens=16384, context_len=8192, **settings)
    return conformance_requests(make()), config, tree


@pytest.fixture(scope="module")
def traces() -> dict:
    """SGLang's side of every case, in one subprocess (one import of SGLang for all)."""
    inputs = {name: case_inputs(name) for name in CASES}
    specs = [sglang_conformance._spec(reqs, config, 3000, tree) for reqs, config, tree in inputs.values()]
    return dict(zip(CASES, zip(sglang_traces(specs), inputs.values())))


@pytest.mark.parametrize("name", list(CASES))
def test_kvguard_schedules_every_step_exactly_as_sglang(traces, name):
    trace, (reqs, config, tree) = traces[name]
    at_least = CASES[name][3]
    r = compare(trace, reqs, config, tree)
    assert r["sglang_version"] == r["kvguard_follows"] == "0.5.23"
    assert r["sglang_tree"] == {"radix": "RadixCache", "unified": "UnifiedRadixCache"}[tree]
    assert r["steps"] == r["sglang_steps"] > 1000, r
    assert r["first_mismatch"] is None, r["first_mismatch"]
    assert r["mismatch_steps"] == 0 and r["ratio_max_abs_diff"] <= 1e-12
    assert r["retracted"] >= at_least["retracted"] and r["prefix_hit_tokens"] >= at_least["prefix_hit_tokens"]
    assert r["prefill_steps"] > 10 and r["decode_steps"] > 500 and r["finished"] > 10
    assert set(r["stood_in"]) >= {"triton", "torchvision", "IPython"}


def test_the_harness_catches_a_pool_that_hands_out_freed_pages_in_another_order(traces, monkeypatch):
    def free_to_the_tail(self, pages):  # SGLang puts freed pages at the head when pages are larger than a token
        self.free_pages.extend(pages)

    monkeypatch.setattr(TokenPool, "free_pages_of", free_to_the_tail)
    trace, (reqs, config, tree) = traces["retractions-page4-radix"]
    r = compare(trace, reqs, config, tree)
    assert r["first_mismatch"] is not None and "free_crc" in r["first_mismatch"]["differs"]


def test_the_harness_catches_admission_that_ignores_new_token_ratio(traces, monkeypatch):
    from kvguard.producers.sim.sglang import scheduler

    original = scheduler._Adder.__init__

    def no_decode_reservation(self, s):
        original(self, s)
        self.total_offset = s.admission_headroom_tokens  # forgets the running requests' future decode tokens

    monkeypatch.setattr(scheduler._Adder, "__init__", no_decode_reservation)
    trace, (reqs, config, tree) = traces["retractions-page4-radix"]
    r = compare(trace, reqs, config, tree)
    assert r["first_mismatch"] is not None and "kind" in r["first_mismatch"]["differs"]


def test_without_sglang_the_harness_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(sglang_conformance, "_python", lambda: [sys.executable, "-S", "-I"])
    config = SchedulerConfig(max_total_num_tokens=608, page_size=1, max_running_requests=4, context_len=1024)
    with pytest.raises(SglangMissing, match="install-sglang-cpu.sh"):
        run_conformance(long_outputs(2), config=config, max_steps=5)


def test_kvguard_conformance_sglang_reports_no_mismatch_and_exits_0():
    from typer.testing import CliRunner

    import kvguard.cli  # noqa: F401 - registers the commands
    from kvguard.cli.app import app

    result = CliRunner().invoke(app, ["conformance", "sglang", "--workload", "azure-conv", "--rate-scale", "4",
                                      "--duration", "10s", "--page-size", "4", "--max-steps", "400", "--json"])
    assert result.exit_code == 0, result.output
    r = [__import__("json").loads(x) for x in result.output.splitlines() if x.startswith("{")][-1]
    assert r["steps"] == 400 and r["mismatch_steps"] == 0 and r["config"]["page_size"] == 4
