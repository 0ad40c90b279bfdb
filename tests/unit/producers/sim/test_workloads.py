import gzip

import numpy as np
import pytest

from kvguard.producers.sim.workloads import (
    HASH_BLOCK_TOKENS,
    SCENARIOS,
    WorkloadError,
    chain_hashes,
    load_trace,
    load_workload,
    make_scenario,
)


def test_bundled_azure_conv_loads_every_row_sorted_from_zero():
    wl = load_workload("azure-conv")
    assert len(wl) == 19366
    arrivals = np.array([r.arrival_ns for r in wl.requests])
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    assert 3400 < wl.duration_s() < 3510
    first = wl.requests[0]
    assert (first.prompt_tokens, first.max_output_tokens, first.priority) == (374, 44, None)


def test_rate_scale_compresses_inter_arrival_times_and_window_cuts():
    base = load_workload("azure-conv", window=600)
    fast = load_workload("azure-conv", rate_scale=2.0, window=300)
    assert len(fast) == len(base)
    assert fast.requests[10].arrival_ns == int(base.requests[10].arrival_ns / 2.0)
    assert all(r.arrival_ns < 300 * 10**9 for r in fast.requests)
    assert [r.req_id for r in fast.requests] == list(range(len(fast)))


def test_mooncake_hash_ids_become_shared_chained_block_hashes(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}\n'
                    '{"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 10]}\n')
    wl = load_trace(path)
    a, b = wl.requests
    assert len(a.block_hashes) == 1100 // HASH_BLOCK_TOKENS
    assert len(b.block_hashes) == 600 // HASH_BLOCK_TOKENS
    # first 512-token block (8 hash blocks) shared, then they diverge
    assert a.block_hashes[:8] == b.block_hashes[:8]
    assert a.block_hashes[8] != b.block_hashes[8]
    assert b.arrival_ns == 1_500_000_000


def test_sharegpt_lengths_get_seeded_poisson_arrivals():
    a = load_workload("sharegpt-sample", seed=1)
    b = load_workload("sharegpt-sample", seed=1)
    c = load_workload("sharegpt-sample", seed=2)
    assert [r.arrival_ns for r in a.requests] == [r.arrival_ns for r in b.requests]
    assert [r.arrival_ns for r in a.requests] != [r.arrival_ns for r in c.requests]
    assert any("Poisson" in n for n in a.notes)
    assert 1.5 < len(a) / a.duration_s() < 2.5


def test_gzip_and_plain_files_load_the_same(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109"
    (tmp_path / "a.csv").write_text(text)
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(text.encode()))
    plain, zipped = load_trace(tmp_path / "a.csv"), load_trace(tmp_path / "a.csv.gz")
    assert [(r.arrival_ns, r.prompt_tokens) for r in plain.requests] == \
           [(r.arrival_ns, r.prompt_tokens) for r in zipped.requests]
    assert plain.requests[1].arrival_ns == 4_314_579_000


@pytest.mark.parametrize("content, line, words", [
    ("foo;bar\n1;2\n", 1, "CSV header"),
    ("a,b,c\n1,2,3\n", 1, "CSV header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.0,x,44\n", 3,
     "integer ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n", 2, "TIMESTAMP"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n', 2, "JSON object"),
    ('{"time": 0}\n', 1, "Mooncake"),
    ("", 1, "empty file"),
])
def test_unreadable_trace_names_file_line_and_expectation(tmp_path, content, line, words):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert info.value.path == str(path) and info.value.line == line
    assert words in info.value.expected and str(path) in str(info.value)


def test_missing_file_or_unknown_scenario_is_a_workload_error(tmp_path):
    with pytest.raises(WorkloadError, match="readable"):
        load_workload(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError):
        make_scenario("bogus")


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenarios_are_deterministic_and_sorted(name):
    a = load_workload(name, window=900, seed=3)
    b = load_workload(name, window=900, seed=3)
    assert len(a) > 50
    assert [(r.arrival_ns, r.prompt_tokens, r.block_hashes) for r in a.requests] == \
           [(r.arrival_ns, r.prompt_tokens, r.block_hashes) for r in b.requests]
    arrivals = [r.arrival_ns for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 900 * 10**9


def test_drill_has_100_long_prompts_in_ten_minutes_and_caps_them_when_asked():
    wl = load_workload("drill", window=1800, seed=0)
    big = [r for r in wl.requests if r.prompt_tokens == 32768]
    assert len(big) == 100
    span = (big[-1].arrival_ns - big[0].arrival_ns) / 1e9
    assert span <= 600
    assert len(wl) > 100  # background load too
    capped = load_workload("drill", window=1800, seed=0, max_prompt_tokens=20000)
    assert sum(r.prompt_tokens == 20000 for r in capped.requests) >= 100
    assert any("capped" in n for n in capped.notes)


def test_sessions_share_prefixes_across_turns_and_rag_shares_system_prompts():
    sessions = load_workload("sessions", window=600, seed=1).requests
    hashes = {r.block_hashes[0] for r in sessions if r.block_hashes}
    assert len(hashes) < sum(1 for r in sessions if r.block_hashes)
    rag = load_workload("rag", window=600, seed=1).requests
    assert len({r.block_hashes[0] for r in rag}) <= 8


def test_mixed_leaves_some_priorities_missing():
    wl = load_workload("mixed", window=600)
    missing = sum(r.priority is None for r in wl.requests)
    assert 0 < missing < len(wl)
    assert all(r.priority is None or 0 <= r.priority <= 10 for r in wl.requests)


def test_chain_hash_names_the_whole_prefix():
    a = chain_hashes([1, 2], 128, 64)
    b = chain_hashes([3, 2], 128, 64)
    assert a[1] != b[1]  # same block content, different prefix
    assert chain_hashes([1, 2], 100, 64) == a[:1]  # partial last block has no hash
