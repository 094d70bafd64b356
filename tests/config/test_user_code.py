"""Reward modules named in a config are found next to the config file that names them and in the working
directory (the `fastlm` entry point puts neither on sys.path), and their errors name that file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.rl.rewards import load_reward_functions
from fastlm.run_config.loader import load_config

GRPO = Path(__file__).resolve().parents[2] / "configs" / "grpo.yaml"
REWARD = "def exact(completions, answer, **kwargs):\n    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))


def _user_config(folder: Path, module: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    config = folder / "mine.yaml"
    config.write_text(yaml.safe_dump({"base": str(GRPO), "rl": {"prompts": {"path": "prompts.jsonl"}, "warmup_steps": 0,
                                      "rewards": [{"function": f"{module}:exact"}]}}))
    return config


def test_a_module_next_to_the_config_is_found_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = _user_config(tmp_path / "project", "beside_config_rewards")
    (tmp_path / "project" / "beside_config_rewards.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)  # elsewhere: only the config's folder has the module
    loaded = load_config(config)
    (reward,) = load_reward_functions(loaded.rl.rewards)
    assert reward.function(completions=[" 4", "5"], answer=["4", "4"]) == [1.0, 0.0]
    assert main(["validate", str(config)]) == 0
    assert "1 prompt from" in capsys.readouterr().out


def test_a_module_in_the_working_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _user_config(tmp_path / "project", "working_dir_rewards")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "working_dir_rewards.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path / "work")
    (reward,) = load_reward_functions(load_config(config).rl.rewards)
    assert reward.path == "working_dir_rewards:exact"


def test_an_import_error_names_the_users_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = _user_config(tmp_path / "project", "broken_user_rewards")
    (tmp_path / "project" / "broken_user_rewards.py").write_text("import no_such_dependency_here\n")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "rl.rewards[0].function: cannot import module 'broken_user_rewards'" in err
    assert "No module named 'no_such_dependency_here'" in err
    assert f"from {config}" in err and "grpo.yaml" not in err
    assert f"looked in {tmp_path / 'project'}, {tmp_path} and PYTHONPATH" in err
