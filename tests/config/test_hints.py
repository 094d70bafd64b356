"""The small things that cost a newcomer time: each bad input names its fix, print-config explains itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.run_config.loader import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["validate", *argv]) == 2
    err = capsys.readouterr().err
    print(err)
    return err


def test_a_missing_base_suggests_the_nearest_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny-llama.yaml").write_text("model: {type: llama}\n")
    (tmp_path / "tiny.yaml").write_text("trainer: {steps: 3}\n")
    child = tmp_path / "mine.yaml"
    child.write_text("base: tinny.yaml\n")
    assert "base: config file not found" in (err := _error(capsys, str(child)))
    assert "Fix: did you mean base: tiny.yaml?" in err and str(child) in err
    child.write_text("base: presets/tiny-lama.yaml\n")
    assert "did you mean base: presets/tiny-llama.yaml?" in _error(capsys, str(child))


def test_keys_named_as_other_trainers_name_them(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, str(CONFIGS / "tiny.yaml"), "optimizer.learning_rate=1e-3", "trainer.max_steps=5",
                 "trainer.gradient_accumulation_steps=2")
    assert "optimizer.learning_rate: unknown key" in err and "Fix: did you mean 'lr'?" in err
    assert "Fix: did you mean 'steps'?" in err and "Fix: did you mean 'grad_accumulation'?" in err


def test_a_float_for_an_int_field_gets_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, str(CONFIGS / "tiny.yaml"), "trainer.steps=10.5", "trainer.log_every=1e3")
    assert "trainer.steps:" in err and "Fix: this key counts things: give a whole number, e.g. 10" in err
    assert "trainer.log_every:" in err and "Fix: write it as a whole number: 1000" in err


def test_print_config_describe_loads_back_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", str(CONFIGS / "grpo.yaml"), "--describe"]) == 0
    described = capsys.readouterr().out
    assert "  seed: 0  # Seeds torch, python and the data order" in described
    assert "logits_memory_mib: 1408.0  # The head without full logits" in described
    assert main(["print-config", str(CONFIGS / "grpo.yaml")]) == 0
    plain = yaml.safe_load(capsys.readouterr().out)
    assert yaml.safe_load(described) == plain  # comments only: the same config
    assert plain["model"]["head"]["logits_memory_mib"] == 1408.0  # the effective budget, not null
    assert load_config(CONFIGS / "tiny.yaml", ["model.head.logits_memory_mib=null"]).model.head.logits_memory_mib is None
