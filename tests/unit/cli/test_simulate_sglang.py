"""`kvguard simulate --engine sglang`: the catalogue's SGLang profile through the registry; under KV
pressure its engine retracts (counted as preemptions) and never OOMs; a profile of another engine is
refused with the field named."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import kvguard.cli  # noqa: F401 - registers the commands
from kvguard.cli.app import app


def test_simulate_runs_the_sglang_engine_and_it_retracts_under_kv_pressure():
    result = CliRunner().invoke(app, ["simulate", "--engine", "sglang", "--workload", "azure-conv", "--duration",
                                      "60s", "--rate-scale", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["engine"] == "sglang" and out["profile"] == "llama3-8b-24gb-sglang"
    assert out["preemptions"] > 0 and out["ooms"] == 0 and out["completed"] == out["requests"] > 500
    assert out["kv_blocks"] == 15427  # the pool mem_fraction_static 0.72 leaves on a 24 GB GPU, in 1-token pages


def test_an_engine_that_does_not_match_the_profile_is_an_error_naming_the_field():
    result = CliRunner().invoke(app, ["simulate", "--engine", "sglang", "--profile", "llama3-8b-24gb-vllm",
                                      "--workload", "azure-conv", "--duration", "5s"])
    assert result.exit_code == 2 and "'engine'" in result.output and "sglang" in result.output
