"""`kvguard export`: options that make no sense are refused before anything connects."""

from typer.testing import CliRunner

from kvguard.cli import app


def test_max_nodes_zero_is_refused_naming_the_option():
    result = CliRunner().invoke(app, ["export", "--max-nodes", "0", "--bus", "kafka://127.0.0.1:1"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--max-nodes" in result.output and "no Kafka broker" not in result.output
