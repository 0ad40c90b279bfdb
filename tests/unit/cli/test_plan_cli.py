"""`kvguard plan` as an operator runs it, and the flags and traffic spelling it shares with `kvguard simulate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from kvguard.cli import app, engine_flags
from kvguard.cli.simulate import traffic_mix

LOGS = Path(__file__).resolve().parents[2] / "data" / "vllm_startup_logs"
CONFIGS = Path(__file__).resolve().parents[2] / "data" / "model_configs"
BUNDLED = ["--profile", "llama3-8b-24gb-vllm", "--model-runner", "v1", "--max-num-batched-tokens", "8192"]
JSON_FIELDS = {"consumed_bytes", "peak_activation_bytes", "cudagraph_bytes", "kv_cache_bytes", "num_gpu_blocks",
               "kv_cache_tokens", "max_concurrency", "refused", "classes", "boundary", "what_if", "assumptions"}


def run(*args: str, stdin: str | None = None):
    return CliRunner().invoke(app, ["plan", *args], input=stdin)


def words(text: str) -> str:
    """The output's words, without rich's box drawing."""
    return " ".join(text.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def test_plan_and_simulate_share_every_model_gpu_and_engine_flag():
    """Both commands declare these options with the one declaration in kvguard/cli/engine_flags.py."""
    shared = {name: value for name, value in vars(engine_flags).items() if isinstance(value, typer.models.OptionInfo)}
    flag = lambda option: option.param_decls[0].split("/")[0]  # noqa: E731
    commands = get_command(app).commands
    for command in ("plan", "simulate"):
        names = {opt for p in commands[command].params for opt in p.opts}
        missing = sorted(flag(option) for option in shared.values() if flag(option) not in names)
        assert missing == [], (command, missing)
    assert {"--model-config", "--gpu", "--gpu-memory-gib", "--tensor-parallel-size", "--dtype", "--max-model-len",
            "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs", "--max-num-batched-tokens",
            "--num-speculative-tokens", "--speculative-model-config", "--alloc-conf", "--enforce-eager",
            "--model-runner", "--profile"} <= {flag(option) for option in shared.values()}


def test_help_reads_well():
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    text = words(result.output)
    assert "Size a vLLM server before it starts, and say which requests will crash it." in text
    for part in ("Model and GPU", "vLLM engine flags", "Traffic and output", "--from-log", "--traffic", "--what-if",
                 "--json", "prompt_logprobs", "docs/PLAN.md"):
        assert part in text, part


def test_json_has_the_start_up_budget_and_one_entry_per_request_class():
    result = run(*BUNDLED, "--traffic", "prompt_logprobs:0.05@3000", "--what-if", "0.9,0.95", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert JSON_FIELDS <= out.keys() and out["refused"] is None and out["source"] == "model"
    assert [c["name"] for c in out["classes"]] == ["full_step", "prompt_logprobs", "logprobs", "long_context",
                                                   "spec_decode"]
    pl = next(c for c in out["classes"] if c["name"] == "prompt_logprobs")
    assert pl["declared"] == 3000 and pl["declared_fits"] is True and 3000 <= pl["limit"] < 8192
    assert out["kv_cache_bytes"] > 0 and out["kv_cache_tokens"] > 0 and out["log_lines"]
    b = out["boundary"]
    assert b["lowest_starting_utilization"] < out["gpu_memory_utilization"] <= b["largest_utilization"] \
        < b["highest_starting_utilization"]
    assert [r["startup"]["gpu_memory_utilization"] for r in out["what_if"]] == sorted(
        {0.9, 0.92, 0.95, b["largest_utilization"]})


def test_the_table_says_the_limit_in_the_operators_words():
    result = run(*BUNDLED, "--traffic", "prompt_logprobs:0.05", "--what-if", "none", "--no-search")
    assert result.exit_code == 0, result.output
    text = words(result.output)
    for part in ("What vLLM logs at start-up", "Available KV cache memory:", "start-up budget", "KV token capacity",
                 "Request classes at 0.92", "tokens with prompt_logprobs will OOM at 0.92", "Assumptions",
                 "vLLM followed: 0.33.0"):
        assert part in text, part


def test_a_start_up_vllm_refuses_is_reported_with_vllms_message():
    result = run("--profile", "llama3-8b-24gb-vllm", "--gpu-memory-utilization", "0.83", "--what-if", "none", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["refused"].startswith("To serve at least one request with the model's max seq len (32768)")
    assert out["classes"] == [] and out["boundary"]["lowest_starting_utilization"] > 0.83
    table = run("--profile", "llama3-8b-24gb-vllm", "--gpu-memory-utilization", "0.5", "--what-if", "none")
    assert "vLLM refuses to start: No available memory for the cache blocks." in words(table.output)


def test_from_log_reads_a_real_servers_budget_from_a_file_or_stdin(tmp_path):
    log = (LOGS / "servedeck-boot-097.log").read_text()
    args = ("--model-config", str(CONFIGS / "qwen3-0.6b.json"), "--max-model-len", "4096", "--max-num-seqs", "256",
            "--max-num-batched-tokens", "2048", "--what-if", "none", "--no-search", "--json")
    path = tmp_path / "server.log"
    path.write_text("unrelated line\n" + log)
    for result in (run(*args, "--from-log", str(path)), run(*args, "--from-log", "-", stdin=log)):
        assert result.exit_code == 0, result.output
        out = json.loads(result.stdout)
        assert out["source"] == "log" and out["log_format"] == "vllm-0.33"
        assert round(out["kv_cache_bytes"] / (1 << 30), 2) == 8.64 and out["kv_cache_tokens"] == 315_039


@pytest.mark.parametrize("args, says", [
    (["--traffic", "beam_search"], "unknown request class 'beam_search'"),
    (["--profile", "llama3-8b-24gb-vllm", "--model-config", "x.json"], "either --profile or --model-config"),
    (["--what-if", "0.9,1.5"], "utilizations are in (0, 1]"),
    (["--from-log", "/nonexistent/server.log"], "cannot read /nonexistent/server.log"),
    (["--from-log", str(LOGS / "vllm-21348.log")], "no start-up budget line"),
])
def test_bad_input_is_one_line_naming_the_option(args, says):
    result = run(*args)
    assert result.exit_code == 2
    assert says in words(result.output)


def test_simulate_takes_the_same_traffic_spelling():
    assert traffic_mix("prompt_logprobs:0.05,long_context:0.02@60000", prompt_logprobs_frac=0.0,
                       long_context_frac=0.0, long_context_len=0, speculates=False) == (0.05, 0.02, 60000)
    assert traffic_mix("spec_decode", prompt_logprobs_frac=0.0, long_context_frac=0.0, long_context_len=0,
                       speculates=True) == (0.0, 0.0, 0)
    for text, speculates in (("spec_decode", False), ("logprobs:0.1", False), ("prompt_logprobs", False),
                             ("long_context:0.1", False)):
        with pytest.raises(typer.BadParameter):
            traffic_mix(text, prompt_logprobs_frac=0.0, long_context_frac=0.0, long_context_len=0,
                        speculates=speculates)
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", "--duration", "10s", "--traffic",
                                      "logprobs:0.1"])
    assert result.exit_code == 2 and "does not model logprobs requests" in words(result.output)


def test_simulate_runs_a_traffic_mix():
    result = CliRunner().invoke(app, ["simulate", "--workload", "mixed", "--duration", "20s", "--model-runner", "v1",
                                      "--traffic", "prompt_logprobs:0.5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_logprobs_frac"] == 0.5


def test_help_is_readable_at_80_columns():
    """Every flag whole (rich's table truncated them: `--gpu-memory-uti…`), no line past the terminal,
    the panels kept; a wide terminal keeps the rich panels."""
    narrow = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0
    lines = narrow.output.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in narrow.output
    command = get_command(app).commands["plan"]
    flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    shown = {word.rstrip(",") for line in lines for word in line.split() if word.startswith("-")}
    assert flags <= shown, sorted(flags - shown)
    for panel in ("Model and GPU:", "vLLM engine flags (vLLM 0.33's names and defaults):", "Traffic and output:"):
        assert panel in lines
    assert "CLASS[:SHARE][@SHAPE]" in narrow.output  # not eaten as markup
    wide = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "140"})
    assert "╭─ Model and GPU" in wide.output and "CLASS[:SHARE][@SHAPE]" in wide.output
