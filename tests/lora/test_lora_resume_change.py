"""`--resume` with a changed model section (a LoRA rank): one line naming the field, the checkpoint's value and
this run's, and the fix, exit 2 before anything is built; no 3 KB message repeated per checkpoint with
Python warnings. The trainer's own restore (library use without the command's checks) says the same once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from fastlm.commands.main import main
from fastlm.engine.checkpoint import ModelChangedError
from fastlm.engine.trainer import Trainer
from fastlm.run_config.loader import load_config


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump({
        "run": {"name": "lora", "output_dir": str(tmp_path / "runs")},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16,
                  "lora": {"rank": 4, "alpha": 8.0}},
        "data": {"source": {"type": "generated", "num_documents": 40}, "seq_len": 16, "micro_batch_size": 2},
        "schedule": {"warmup_steps": 0},
        "trainer": {"steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_every": 1, "device": "cpu"},
        "logging": {"wandb": {"enabled": False}, "progress": False}}))
    return path


def test_resume_with_another_rank_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    assert main(["train", str(config)]) == 0  # three checkpoints
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning on the way
        assert main(["train", str(config), "--resume", "model.lora.rank=8", "trainer.steps=4"]) == 2
    err = capsys.readouterr().err
    issue = ("  - model.lora.rank: is 4 in checkpoint step-00000003 (a resume continues its model); got 8. Fix: resume "
             "with model.lora.rank=4, or use the new value in a new run (another run.name, or run.overwrite=true)")
    assert err.splitlines() == ["invalid configuration (1 problem):", issue], err

    trainer = Trainer(load_config(config, ["model.lora.rank=8", "trainer.steps=4"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelChangedError) as caught:
            trainer.resume()
    message = str(caught.value)
    assert message.endswith("step-00000003: model.lora.rank is 8 in this run but 4 in the checkpoint; a resume "
                            "continues the checkpoint's model. Resume with model.lora.rank=4, or keep the new values "
                            "in a new run (another run.name, or run.overwrite=true)"), message
    assert "\n" not in message and len(message) < 400, message


def test_a_field_added_since_the_checkpoint_is_no_change(tmp_path: Path) -> None:
    """A checkpoint of an earlier fastlm lacks fields added since (model.lora.frozen_experts): its defaults are
    this run's, so --resume goes on."""
    config = _config(tmp_path)
    assert main(["train", str(config), "trainer.steps=1"]) == 0
    manifest = tmp_path / "runs" / "checkpoints" / "step-00000001" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["config"]["model"]["lora"]["frozen_experts"]
    manifest.write_text(json.dumps(data))
    assert main(["train", str(config), "--resume", "trainer.steps=2"]) == 0
