"""Reward and environment modules named in a config are found next to the config file that names them and in the
working directory (the `fastlm` entry point puts neither on sys.path), and their errors name that file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.logging.jsonl import read_metrics
from fastlm.rl.rewards import load_reward_functions
from fastlm.run_config.loader import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GRPO = CONFIGS / "grpo.yaml"
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


ENVIRONMENT = """
class Countdown:
    \"\"\"One turn: the reward is the completion's length (the base config's options are taken and unused).\"\"\"

    def __init__(self, **options):
        self.options = options

    def reset(self, record):
        return [{"role": "user", "content": record.text}]

    def step(self, messages, completion):
        return None, float(len(completion)), {}
"""


def test_an_environment_module_next_to_the_config_validates_and_trains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """rl.environment's class is found in the YAML's folder from another working directory, as rewards are: by
    `fastlm validate`, by `fastlm train` (one step), and by the child process that runs the episodes; the
    environment scores the prompts of a JSONL beside it (no rl.rewards)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "beside_config_envs.py").write_text(ENVIRONMENT)
    (project / "prompts.jsonl").write_text('{"prompt": "2+2="}\n{"prompt": "3+3="}\n')
    config = project / "envs.yaml"
    config.write_text(yaml.safe_dump({
        "base": str(CONFIGS / "grpo_tools.yaml"), "run": {"output_dir": str(tmp_path / "run")},
        "trainer": {"steps": 1, "eval_every": 0, "log_every": 1}, "logging": {"progress": False, "wandb": {"enabled": False}},
        "rl": {"environment": {"name": "beside_config_envs:Countdown", "max_turns": 1},
               "prompts": {"path": "prompts.jsonl"}, "warmup_steps": 0, "eval_prompts": 0, "group_size": 2,
               "prompts_per_rollout": 2, "updates_per_rollout": 1, "max_new_tokens": 4}}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["validate", str(config)]) == 0, capsys.readouterr().err
    assert main(["train", str(config)]) == 0, capsys.readouterr().err
    (metrics,) = (tmp_path / "run").rglob("metrics.jsonl")
    rewards = [record["train/reward"] for record in read_metrics(metrics) if "train/reward" in record]
    assert len(rewards) == 1 and rewards[0] >= 0.0  # the environment scored the step's episodes
    sys.modules.pop("beside_config_envs", None)


def test_an_environment_import_error_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = _user_config(tmp_path / "project", "unused")
    config.write_text(yaml.safe_dump({"base": str(CONFIGS / "grpo_tools.yaml"), "rl": {
        "environment": {"name": "missing_user_envs:Game"}, "warmup_steps": 0}}))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "rl.environment.name: cannot import module 'missing_user_envs'" in err
    # the folders of the files that set the section (the base's too), then the working directory
    assert f"looked in {CONFIGS}, {tmp_path / 'project'}, {tmp_path} and PYTHONPATH" in err
