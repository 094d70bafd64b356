"""The `fastlm` command: validate / dry-run write nothing and name bad fields; print-config resolves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.run_config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").glob("*.yaml"))


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*")}


@pytest.mark.parametrize("config", SHIPPED, ids=str)
def test_every_shipped_config_validates(config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loaded = yaml.safe_load((ROOT / config).read_text())
    needs_rl_teacher = "teacher" in loaded.get("rl", {}) and not (ROOT / "runs/grpo").exists()
    needs_teacher = "distillation" in str(loaded) and not (ROOT / "runs/tiny/checkpoints/latest").exists()
    needs_hf_model = loaded.get("base") in ("../hf_model.yaml", "sft_hf.yaml") and not (ROOT / "hf_model.yaml").exists()
    code = main(["validate", str(ROOT / config)])
    if needs_rl_teacher:  # opd.yaml, gkd.yaml: the GRPO run (configs/grpo.yaml) is their teacher
        assert code == 2 and "rl.teacher.path: no such folder" in capsys.readouterr().err
        return
    if needs_teacher:  # the shipped distillation config names the tiny run as its teacher
        assert code == 2 and "train that model first: fastlm train configs/tiny.yaml" in capsys.readouterr().err
        return
    if needs_hf_model:  # sft_hf.yaml bases what `fastlm convert --from-hf` writes (tests/data/test_finetune_hf_e2e.py)
        assert code == 2 and "config file not found" in capsys.readouterr().err
        return
    assert code == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "loss:" in out and "config OK" in out
    assert not any(tmp_path.iterdir()), "validate must write nothing"


def test_dry_run_reports_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["train", str(ROOT / "configs/tiny.yaml"), "--dry-run", "model.hidden_size=64", "--set",
                 "trainer.steps=3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "hidden_size: 64" in out and "steps: 3" in out and "compiled PyTorch path" in out
    assert "dry run" in out
    assert not any(tmp_path.iterdir())


def test_broken_config_exits_nonzero_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"base": str(ROOT / "configs/tiny.yaml"), "model": {"num_kv_heads": 3},
                                   "optimizer": {"lrr": 0.1}}))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "optimizer.lrr: unknown key" in err and "did you mean 'lr'" in err
    assert str(bad) in err
    assert not (tmp_path / "runs").exists()


def test_model_level_rule_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(ROOT / "configs/tiny.yaml"), "model.num_kv_heads=3"]) == 2
    err = capsys.readouterr().err
    assert "num_heads 4 is not a multiple of num_kv_heads 3" in err and "override `model.num_kv_heads=3`" in err


def test_print_config_is_the_resolved_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", str(ROOT / "configs/tiny.yaml"), "trainer.steps=11"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["steps"] == 11
    assert printed == load_config(ROOT / "configs/tiny.yaml", ["trainer.steps=11"]).model_dump(mode="json")


def test_console_script_and_module_entry_points(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "fastlm", "validate", str(ROOT / "configs/tiny.yaml"),
                             "model.type=gpt3"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2
    assert "model.type: unknown type; got 'gpt3'" in result.stderr
    assert "Traceback" not in result.stderr
