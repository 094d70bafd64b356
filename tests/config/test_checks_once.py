"""A start is checked once: `fastlm train` runs the config's cross checks (in the loader) and the machine's and
run directory's checks (in the command) one time each; the trainer it builds runs none of them again."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastlm.commands.train  # noqa: F401 - every module that binds a check is loaded before the counters go in
import fastlm.engine.trainer  # noqa: F401
import fastlm.rl.objective  # noqa: F401
from fastlm.commands.main import main
from fastlm.engine.preflight import preflight_issues, run_dir_issues
from fastlm.run_config.checks import cross_check

ROOT = Path(__file__).resolve().parents[2]
CHECKS: list[Callable[..., Any]] = [cross_check, preflight_issues, run_dir_issues]


def count_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Put a counting wrapper in place of each check wherever a fastlm module has bound it."""
    calls: Counter[str] = Counter()

    def counted(check: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[check.__name__] += 1
            return check(*args, **kwargs)
        return wrapper

    wrappers = {id(check): counted(check) for check in CHECKS}  # by identity: CHECKS keeps the functions alive
    for name, module in list(sys.modules.items()):
        if name.startswith("fastlm"):
            for attribute, value in list(vars(module).items()):
                if id(value) in wrappers:
                    monkeypatch.setattr(module, attribute, wrappers[id(value)])
    return calls


def test_fastlm_train_checks_its_start_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    calls = count_calls(monkeypatch)
    code = main(["train", str(ROOT / "configs/tiny.yaml"), f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=2",
                 "trainer.eval_every=0", "trainer.log_every=1", "schedule.warmup_steps=1", "data.seq_len=32",
                 "data.micro_batch_size=4", "data.source.num_documents=200", "logging.wandb.enabled=false",
                 "logging.progress=false"])
    assert code == 0, capsys.readouterr().err
    assert "done: 2 steps" in capsys.readouterr().err
    assert (tmp_path / "tiny" / "checkpoints" / "latest").exists()  # a real run, trained to the end
    assert calls == {"cross_check": 1, "preflight_issues": 1, "run_dir_issues": 1}
