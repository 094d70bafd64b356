"""fastlm/commands/errors.py's `exit_status` is the one way a command ends on an expected error: the message (a
ConfigError's issues, else `<command>: <error>`), printed once under torchrun, and the status."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fastlm.commands.errors import BAD_INPUT, RUN_TIME, exit_status
from fastlm.commands.main import main
from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.system.run_dir import RunDirError

COMMANDS = Path(__file__).resolve().parents[2] / "fastlm" / "commands"


def test_a_config_error_prints_its_issues_and_others_one_line(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    error = ConfigError(ConfigIssue("trainer.steps", "must be positive", 0))
    assert exit_status(error) == BAD_INPUT == 2
    assert capsys.readouterr().err == error.render() + "\n"
    assert exit_status(RunDirError("runs/x is held by pid 7"), RUN_TIME, "fastlm prepare") == RUN_TIME == 1
    assert capsys.readouterr().err == "fastlm prepare: runs/x is held by pid 7\n"
    monkeypatch.setenv("RANK", "1")  # another rank of a torchrun job: rank 0 says it
    assert exit_status("the same error on every rank") == 2
    assert capsys.readouterr().err == ""


def test_commands_end_through_exit_status(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """No command returns an error status of its own making (a literal 1 or 2); each goes through exit_status."""
    literal = [f"{path.name}:{node.lineno}" for path in sorted(COMMANDS.glob("*.py")) if path.name != "errors.py"
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Return)
               and isinstance(node.value, ast.Constant) and node.value.value in (1, 2)]
    assert literal == []
    (tmp_path / "taken.yaml").write_text("")
    assert main(["init", str(tmp_path / "taken.yaml")]) == 2
    taken = tmp_path / "taken.yaml"
    assert capsys.readouterr().err == f"fastlm init: {taken} is a file, not a folder; name a new or existing folder\n"


def test_a_long_value_keeps_its_end() -> None:
    """A long path is cut in its middle: the issue still names the file (was: cut at 80 characters)."""
    path = "/tmp/pytest-of-user/pytest-12/popen-gw1/test_missing_data_file_of_every_0/some/deeper/folder/absent.jsonl"
    text = str(ConfigIssue("data.source.path", "file not found", path))
    print(text)
    assert "absent.jsonl" in text and "..." in text and path not in text
