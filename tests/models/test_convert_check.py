"""`fastlm convert --from-hf DIR --check` on the tiny checkpoint `tools/make_tiny_hf.py` makes of every
registered model_type (real transformers models with a trained BPE tokenizer), in process: every check passes,
a wrong weight fails with exit 1 and a FAIL row, a usage mistake exits 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fastlm.engine.parity as parity
from fastlm.commands.main import main
from fastlm.models.registry import hf_model_types

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import make_tiny_hf  # noqa: E402 - after tools/ joins the path

SHORT = ["--check-tokens", "24", "--check-new-tokens", "3"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained tokenizer (with a llama checkpoint beside it) the other checkpoints copy."""
    return make_tiny_hf.tiny_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def test_every_registered_model_type_has_a_tiny_checkpoint() -> None:
    assert set(hf_model_types()) <= set(make_tiny_hf.TINY), "add the model_type's entry to TINY in tools/make_tiny_hf.py"
    assert make_tiny_hf.model_type_of("gemma3") == "gemma3" and make_tiny_hf.model_type_of("qwen3_moe") == "qwen3_moe"


@pytest.mark.parametrize("model_type", hf_model_types())
def test_check_passes_on_each_tiny_checkpoint(model_type: str, tokenizer: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    directory = make_tiny_hf.tiny_hf_checkpoint(tmp_path / model_type, model_type, tokenizer_from=tokenizer)
    code = main(["convert", "--from-hf", str(directory), "--check", *SHORT])
    table = capsys.readouterr().out
    print(table)
    assert code == 0, table
    assert "all checks passed" in table and table.count(" ok ") == 4


def test_a_wrong_weight_fails_the_check(tokenizer: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """One layer's MLP output perturbed after the import: logits and the export's tensors differ, exit 1."""
    real_import = parity.import_hf

    def tampered(directory: Path, device: str) -> torch.nn.Module:
        model = real_import(directory, device)
        with torch.no_grad():
            model.blocks[0].mlp.down_proj.weight.mul_(1.5)
        return model

    monkeypatch.setattr(parity, "import_hf", tampered)
    code = main(["convert", "--from-hf", str(tokenizer), "--check", *SHORT])
    table = capsys.readouterr().out
    print(table)
    assert code == 1
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("  ")}
    assert "FAIL" in rows["logits"] and "FAIL" in rows["export"] and "1 tensors differ" in rows["export"]


@pytest.mark.parametrize("arguments", [["--to", "x"], ["--device", "tpu"]])
def test_check_usage_errors_exit_2(arguments: list[str], tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--from-hf", str(tokenizer), "--check", *arguments]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_unsupported_checkpoint_exits_2_before_any_model_loads(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    assert main(["convert", "--from-hf", str(tmp_path), "--check"]) == 2
    assert "model_type: unsupported architecture" in capsys.readouterr().err
