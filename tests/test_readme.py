"""README tells the truth: its settings table and command table match the code, and its shell
examples work as written (run with `bash` against a real gateway process)."""

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
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


ADMIN = "readme-admin-token-0123456789"


@pytest.fixture(scope="module")
def gateway(module_database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    """A gateway as "Tenants and keys" has it: auth on, an admin token; a database of its own,
    so that the examples' tenant name is free."""
    with GatewayProcess(
        database_url=module_database_url,
        upstream_url=upstream.url,
        workers=0,
        auth="on",
        admin_token=ADMIN,
        log_level="warning",
    ) as process:
        yield process


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl to run the examples with")
def test_the_tenant_and_key_examples_work_as_written(gateway: GatewayProcess) -> None:
    section = README.split("### Tenants and keys\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()  # continued lines joined
    commands = [line for line in lines if line.startswith("curl ")]
    assert len(commands) == 2
    answers = []
    for command in commands:
        run = subprocess.run(
            ["bash", "-c", command.replace(":8080", f":{gateway.port}") + " --silent --show-error"],
            env={**os.environ, "ADMIN": ADMIN},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        answer = json.loads(run.stdout)
        assert "error" not in answer, (command, answer)
        answers.append(answer)
    assert answers[0]["name"] == "acme", answers[0]
    assert answers[1]["tenant"] == "acme" and answers[1]["key"].startswith("msk-"), answers[1]
