"""`kvguard worker` refuses to start without the tier 3 it was asked for, before it connects."""

from typer.testing import CliRunner

from kvguard.cli import app

UNREACHABLE = ["--bootstrap", "127.0.0.1:1"]


def test_a_model_that_does_not_load_stops_the_worker_naming_where_it_came_from(tmp_path):
    result = CliRunner().invoke(app, ["worker", "--model", str(tmp_path / "none"), *UNREACHABLE])
    assert result.exit_code == 2 and "--model:" in result.output and "not found" in result.output
    result = CliRunner().invoke(app, ["worker", *UNREACHABLE],
                                env={"KVGUARD_PREDICTOR__MODEL_PATH": str(tmp_path / "none")})
    assert result.exit_code == 2 and "predictor.model_path:" in result.output


def test_model_and_no_predictor_together_are_refused():
    result = CliRunner().invoke(app, ["worker", "--model", "x", "--no-predictor", *UNREACHABLE])
    assert result.exit_code == 2 and "not both" in result.output
