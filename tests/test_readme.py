"""README tells the truth: its settings table and command table match the code."""

import re
from pathlib import Path

from click.testing import CliRunner

from gateway.cli import main
from gateway.settings import Settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _table_rows(heading: str) -> list[list[str]]:
    section = README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]


def test_every_setting_is_documented_and_nothing_else() -> None:
    documented = {row[0].strip("`") for row in _table_rows("Settings")}
    fields = {f"MEMSTRATA_{name.upper()}" for name in Settings.model_fields}
    assert documented == fields


def test_documented_defaults_match_the_code() -> None:
    for row in _table_rows("Settings"):
        name, default = row[0].strip("`")[len("MEMSTRATA_") :].lower(), row[1]
        if default.startswith("*"):
            assert Settings.model_fields[name].default is None, name
            continue
        actual = Settings.model_fields[name].default
        shown = default.strip("`")
        assert str(actual).rstrip("/") == shown.rstrip("/") or (
            isinstance(actual, float) and float(shown) == actual
        ), f"{name}: README says {shown}, code says {actual}"


def test_every_command_is_documented() -> None:
    documented = {
        re.match(r"`memstrata (\w+)", row[0]).group(1)  # type: ignore[union-attr]
        for row in _table_rows("Command line")
    }
    assert documented == set(main.commands)


def test_commands_answer_help() -> None:
    runner = CliRunner()
    for name in main.commands:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, result.output
