"""User code cannot hang, crash or fool a run: reward argument names are reserved, each function gets its own
copies, a value must be finite as a float and once weighted, a reward function or environment that does not
return (sleeping, or holding the GIL) is killed after `rl.reward_timeout_s` or at SIGTERM with a checkpoint
and one line. Reward functions and environments are real modules on disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from crash_harness import ROOT

from fastlm.data.datasets import DataError
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.rl.config import JsonlPromptsConfig, RewardConfig
from fastlm.rl.environments.base import EnvironmentFactory, EnvironmentFailure, load_environment
from fastlm.rl.environments.config import EnvironmentConfig
from fastlm.rl.prompts import JsonlPrompts, PromptRecord
from fastlm.rl.rewards import RESERVED_ARGUMENTS, RewardError, load_reward_functions, score_completions, total_reward
from fastlm.system.signals import StopRequest

MODULE = '''
import os, time

def clears(completions, completion_ids, **kwargs):
    values = [1.0] * len(completions)
    completions.clear()
    completion_ids.clear()
    return values

def counts(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def huge(completions, **kwargs):
    return [1e308 for _ in completions]

def _started():
    with open(os.environ["SLEEP_MARKER"], "w") as marker:
        marker.write(str(os.getpid()))

def regex(completions, **kwargs):  # catastrophic backtracking: one C call that holds the GIL for hours
    import re
    _started()
    re.match(r"(a+)+$", "a" * 64 + "b")
    return [0.0 for _ in completions]

def power(completions, **kwargs):  # one bigint operation that holds the GIL for minutes
    _started()
    return [float(7 ** (10 ** 9) % 2) for _ in completions]

def beyond_float(completions, **kwargs):
    return [10 ** 400 for _ in completions]

def exits(completions, **kwargs):
    os._exit(3)

class Spins:
    def reset(self, record):
        return [{"role": "user", "content": record.text}]

    def step(self, messages, completion):
        _started()
        while True:
            pass

class BeyondFloat(Spins):
    def step(self, messages, completion):
        return None, 10 ** 400, {}

def sleeps(completions, **kwargs):
    when = os.environ.get("SLEEP_WHEN")  # a file: sleep once it exists (no file named: always)
    if when is None or os.path.exists(when):
        open(os.environ["SLEEP_MARKER"], "w").close()
        time.sleep(120)
    return [0.0 for _ in completions]
'''


@pytest.fixture()
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "hostile_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("hostile_rewards", None)


def _functions(*specs: tuple[str, float], timeout_s: float = 60.0):
    return load_reward_functions([RewardConfig(function=f"hostile_rewards:{name}", weight=weight)
                                  for name, weight in specs], timeout_s)


def _arguments() -> dict[str, list]:
    completions = ["12", "3", "456", "7"]
    return {"prompts": ["1+1="] * 4, "completions": completions, "completion_ids": [list(c.encode()) for c in completions],
            "stopped": [True] * 4}


@pytest.mark.parametrize("column", RESERVED_ARGUMENTS)
def test_a_prompt_column_with_a_reserved_name_is_refused(tmp_path: Path, column: str) -> None:
    """The red team's forged `completions` column (reward 1.0 on every completion) is refused at load."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}+1=", column: "forged", "answer": "x"}) + "\n" for i in range(3)))
    with pytest.raises(DataError, match=f"column '{column}' has the name of a reward function argument"):
        JsonlPrompts(JsonlPromptsConfig(path=str(path), prompt_field="text"), ByteTokenizer(), 100)


def test_each_function_gets_its_own_copies(user_module: Path) -> None:
    arguments = _arguments()
    scores = score_completions(_functions(("clears", 1.0), ("counts", 1.0)), arguments, group_size=2)
    assert scores[:, 1].tolist() == [2.0, 1.0, 3.0, 1.0]  # `clears` emptied only its own copies
    assert arguments == _arguments()


def test_a_weighted_reward_that_overflows_names_the_function(user_module: Path) -> None:
    functions = _functions(("huge", 10.0))
    with pytest.raises(RewardError, match=r"reward function 'huge' .*1e\+308 x weight 10 is not a finite number"):
        total_reward(score_completions(functions, _arguments(), group_size=2), functions)


def test_a_reward_that_does_not_return_is_abandoned_after_the_timeout(user_module: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEEP_MARKER", str(tmp_path / "sleeping"))
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"'sleeps' .*did not return within rl.reward_timeout_s = 0.3 s"):
        score_completions(_functions(("sleeps", 1.0), timeout_s=0.3), _arguments(), group_size=2)
    assert time.monotonic() - started < 5


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a parent that may never reap it, as in a container)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.is_file() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z"


@pytest.mark.parametrize("name", ["regex", "power"])
def test_a_reward_that_holds_the_gil_is_killed_at_the_timeout(user_module: Path, tmp_path: Path, name: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread waiting on such code never ran again (the run hung); the user-code process is killed."""
    monkeypatch.setenv("SLEEP_MARKER", str(tmp_path / "pid"))
    started = time.monotonic()
    with pytest.raises(RewardError, match=rf"'{name}' .*did not return within rl.reward_timeout_s = 1 s; it was "
                                          "abandoned"):
        score_completions(_functions((name, 1.0), timeout_s=1.0), _arguments(), group_size=2)
    assert time.monotonic() - started < 1.0 + 5
    assert _gone(int((tmp_path / "pid").read_text()))


def test_user_code_dies_with_a_killed_trainer(user_module: Path, tmp_path: Path) -> None:
    """A SIGKILLed trainer leaves no user-code process spinning behind it (the kernel kills it with its parent)."""
    script = ("import sys; from fastlm.rl.user_code import UserCodeProcess; "
              "UserCodeProcess().call('call', 'hostile_rewards:power', {'completions': ['1']}, timeout_s=600)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{user_module}", "SLEEP_MARKER": str(tmp_path / "pid")}
    trainer = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").is_file() or not (tmp_path / "pid").read_text():
        assert trainer.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "pid").read_text())
    trainer.kill()
    trainer.wait()
    while not _gone(child):
        assert time.monotonic() < deadline, f"user-code process {child} outlived its trainer"
        time.sleep(0.05)


def _environment(name: str, timeout_s: float = 60.0) -> tuple[EnvironmentFactory, int]:
    factory = load_environment(EnvironmentConfig(name=f"hostile_rewards:{name}"), 0.1, timeout_s)
    environment = factory.new(0)
    factory.reset(environment, PromptRecord("1+1="), 0)
    return factory, environment


def test_an_environment_step_that_never_returns_is_killed_at_the_timeout(user_module: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """rl.reward_timeout_s did not apply to environments: a spinning step() hung the run."""
    monkeypatch.setenv("SLEEP_MARKER", str(tmp_path / "pid"))
    factory, environment = _environment("Spins", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=r"environment 'hostile_rewards:Spins' step did not return within "
                                                 r"rl.reward_timeout_s = 1 s; it was abandoned .*\(prompt index 3 "):
        factory.step(environment, [{"role": "assistant", "content": "2"}], "2", 3)
    assert time.monotonic() - started < 1.0 + 5
    assert _gone(int((tmp_path / "pid").read_text()))


def test_sigterm_stops_a_spinning_environment_step(user_module: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEEP_MARKER", str(tmp_path / "pid"))
    factory, environment = _environment("Spins")
    with StopRequest():
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        with pytest.raises(EnvironmentFailure, match=r"'hostile_rewards:Spins' step was still running when SIGTERM "
                                                     "arrived; it was abandoned"):
            factory.step(environment, [{"role": "assistant", "content": "2"}], "2", 0)
    assert time.monotonic() - started < 5


def test_a_reward_past_the_float_range_is_one_error(user_module: Path) -> None:
    """10**400 gave an OverflowError traceback (float(10**400)) and no checkpoint; now it is a RewardError,
    which the trainer turns into a checkpoint and one line."""
    with pytest.raises(RewardError, match=r"'beyond_float' .*prompt index 0 \(completion 0\): returned an integer "
                                          "of 1329 bits, past the float range, expected a float or None"):
        score_completions(_functions(("beyond_float", 1.0)), _arguments(), group_size=2)
    factory, environment = _environment("BeyondFloat")
    with pytest.raises(EnvironmentFailure, match=r"'hostile_rewards:BeyondFloat' step returned an integer of 1329 "
                                                 "bits, past the float range as the reward"):
        factory.step(environment, [{"role": "assistant", "content": "2"}], "2", 0)


def test_a_reward_that_ends_its_process_is_named_and_the_next_call_starts_a_fresh_one(user_module: Path) -> None:
    exits, counts = _functions(("exits", 1.0), ("counts", 1.0))
    with pytest.raises(RewardError, match=r"'exits' \(hostile_rewards:exits\) ended its process \(exit status 3\)"):
        score_completions([exits], _arguments(), group_size=2)
    assert score_completions([counts], _arguments(), group_size=2)[:, 0].tolist() == [2.0, 1.0, 3.0, 1.0]


def test_sigterm_during_a_sleeping_reward_checkpoints_and_exits_in_one_line(user_module: Path, tmp_path: Path) -> None:
    """A real GRPO run whose reward starts sleeping at a later rollout: the first SIGTERM abandons it, the
    checkpoint of the last finished step is written, and the run exits 1 with one line."""
    records = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = [f"run.output_dir={tmp_path}/run", "trainer.steps=50", "rl.warmup_steps=0", "rl.prompts_per_rollout=4",
                 "rl.updates_per_rollout=1", "trainer.checkpoint_every=1", "logging.progress=false",
                 "logging.wandb.enabled=false", "rl.eval_prompts=0",
                 f"rl.prompts={{type: jsonl, path: {tmp_path}/prompts.jsonl, prompt_field: text}}",
                 "rl.rewards=[{function: 'hostile_rewards:sleeps', weight: 1.0}]"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "OMP_NUM_THREADS": "1",
           "SLEEP_WHEN": str(tmp_path / "go"), "SLEEP_MARKER": str(tmp_path / "sleeping")}
    process = subprocess.Popen([sys.executable, "-m", "fastlm", "train", str(ROOT / "configs" / "grpo.yaml"),
                                *overrides], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    for ready in (checkpoints / "latest", tmp_path / "sleeping"):  # a step done; then the reward sleeps
        while not ready.is_file():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        (tmp_path / "go").touch()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    last = stderr.strip().splitlines()[-1]
    assert process.returncode == 1 and "Traceback" not in stderr, stderr
    assert "'sleeps' (hostile_rewards:sleeps) was still running when SIGTERM arrived" in last, stderr
    step = load_latest_checkpoint(checkpoints).step
    assert f"checkpoint of step {step} saved" in last


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real BPE tokenizer folder; each case writes its own chat_template.jinja into a copy."""
    from fastlm.data.bpe import train_bpe_tokenizer
    from fastlm.data.corpus import generate_documents

    return train_bpe_tokenizer(generate_documents(200, seed=0), tmp_path_factory.mktemp("bpe"), 300, "llama")


HOSTILE_TEMPLATES = {
    "nested range loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                          "rendering took longer than 1 s"),
    "10 GB string": ("{{ 'x' * 10**10 }}", "'*' would build a value of 10,000,000,000 items"),
    "huge power": ("{{ 2 ** 100000000 }}", "'**' would build an integer of about"),
    "output past the limit": ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "the rendering passed"),
    "raise_exception": ("{{ raise_exception('no system messages, please') }}", "no system messages, please"),
    "syntax error": ("{% for m in messages %}", "TemplateSyntaxError"),
    "undefined call": ("{{ nothing() }}", "UndefinedError"),
    "deep recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_line_naming_its_file(template_dir: Path, tmp_path: Path, name: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    import fastlm.data.chat_template as chat_template
    from fastlm.data.config import HuggingFaceTokenizerConfig
    from fastlm.data.tokenizer import TokenizerError, build_tokenizer

    monkeypatch.setattr(chat_template, "TIME_LIMIT_S", 1.0)
    folder = shutil.copytree(template_dir, tmp_path / "tok")
    source, message = HOSTILE_TEMPLATES[name]
    (folder / "chat_template.jinja").write_text(source)
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(folder)))
    started = time.monotonic()
    with pytest.raises(TokenizerError) as caught:
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    text = str(caught.value)
    assert text.startswith(f"{folder / 'chat_template.jinja'}: chat template: ") and message in text, text
    assert "\n" not in text and time.monotonic() - started < 10


def test_prepare_with_a_raising_template_is_one_line(template_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    import yaml

    from fastlm.commands.main import main

    folder = shutil.copytree(template_dir, tmp_path / "tok")
    (folder / "chat_template.jinja").write_text("{{ raise_exception('x') }}")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                                                  {"role": "assistant", "content": "b"}]}) + "\n")
    config = tmp_path / "prepare.yaml"
    config.write_text(yaml.safe_dump({"input_path": str(tmp_path / "chat.jsonl"), "output_path": str(tmp_path / "out"),
                                      "messages_field": "messages",
                                      "tokenizer": {"type": "huggingface", "path": str(folder)}}))
    assert main(["prepare", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "chat_template.jinja: chat template: TemplateError: x" in err, err
    assert not (tmp_path / "out").exists()
