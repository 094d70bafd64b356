"""`fastlm validate` / `train --dry-run` / `train` refuse, with exit 2 and no traceback, what would fail
before the first step (files, checkpoints, devices, world size, data too small), and write nothing."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fastlm.commands.main import main
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.models.decoder import build_model
from fastlm.models.hf import export_hf
from fastlm.run_config.schema import RunConfig

MODEL = {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32}


def _write_config(tmp_path: Path, **sections: Any) -> Path:
    config = {
        "run": {"name": "pre", "output_dir": str(tmp_path / "run")},
        "model": MODEL,
        "data": {"source": {"type": "generated", "num_documents": 60}, "seq_len": 32, "micro_batch_size": 4},
        "trainer": {"steps": 3, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    }
    config.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Path, *overrides: str) -> str:
    """validate, the dry run and train all exit 2 with the same message, no traceback, no run directory."""
    messages = []
    for argv in (["validate"], ["train", "--dry-run"], ["train"]):
        assert main([*argv, str(config), *overrides]) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and "invalid configuration" in err
        messages.append(err)
    assert not (tmp_path / "run").exists(), "a refused start must write nothing"
    assert messages[0] == messages[1] == messages[2]
    print(messages[0])
    return messages[0]


@pytest.mark.parametrize("source", [
    {"type": "text"}, {"type": "jsonl"}, {"type": "offline_rl"}, {"type": "preferences_jsonl"},
])
def test_missing_data_file_of_every_source(tmp_path: Path, capsys: pytest.CaptureFixture[str], source: dict) -> None:
    extra: dict[str, Any] = {}
    if source["type"] == "offline_rl":
        extra = {"model": {**MODEL, "head": {"losses": {"grpo": {"type": "grpo"}}}}}
    if source["type"] == "preferences_jsonl":
        extra = {"model": {**MODEL, "head": {"losses": {"dpo": {"type": "dpo"}}}}}
    # The missing file sits in a short directory: the message's value is cut at 80 characters, and pytest-xdist's
    # tmp_path (.../pytest-N/popen-gwK/test_missing_data_file_of_ever0/) alone is about 75.
    with tempfile.TemporaryDirectory(prefix="fastlm-") as short:
        data = {"source": {**source, "path": str(Path(short) / "absent.jsonl")}, "seq_len": 32, "micro_batch_size": 4}
        err = _refused(tmp_path, capsys, _write_config(tmp_path, data=data, **extra))
    assert "data.source.path: data file not found" in err and "absent.jsonl" in err


def test_data_path_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = {"source": {"type": "text", "path": str(tmp_path)}, "seq_len": 32, "micro_batch_size": 4}
    assert "data.source.path: not a file" in _refused(tmp_path, capsys, _write_config(tmp_path, data=data))


def test_checkpoints_that_do_not_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A teacher folder without a checkpoint, and an init folder whose weights file is damaged."""
    empty = tmp_path / "teacher"
    empty.mkdir()
    hf = export_hf(build_model(RunConfig.model_validate({"model": MODEL}).model), tmp_path / "hf", ByteTokenizer())
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])  # a torn copy: the header no longer parses
    losses = {"distillation": {"type": "distillation", "teacher_path": str(empty)}}
    config = _write_config(tmp_path, model={**MODEL, "head": {"losses": losses}})
    err = _refused(tmp_path, capsys, config, f"run.init_path={hf}")
    assert "teacher_path: no fastlm checkpoint there" in err
    assert "run.init_path:" in err and "not a readable safetensors file" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_triton_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the test suite's CPU interpreter is not a GPU
    err = _refused(tmp_path, capsys, _write_config(tmp_path), "model.head.use_triton=true")
    assert "model.head.use_triton: the fused Triton kernel needs a CUDA GPU" in err


def test_fla_kernel_without_fla_core_or_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """qwen3_5's linear_attention.kernel fla: refused before any work without fla-core, or on CPU."""
    model = {"type": "qwen3_5", "vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "head_dim": 16,
             "layer_types": ["linear_attention", "full_attention"],
             "linear_attention": {"key_heads": 1, "value_heads": 2, "key_head_dim": 8, "value_head_dim": 8,
                                  "kernel": "fla"}}
    err = _refused(tmp_path, capsys, _write_config(tmp_path, model=model), "trainer.device=cpu")
    assert "model.linear_attention.kernel: fla-core" in err


def test_world_size_and_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["distributed.tensor_parallel=2"] + ([] if torch.cuda.is_available() else ["trainer.device=cpu",
                                                                                           "distributed.backend=nccl"])
    err = _refused(tmp_path, capsys, _write_config(tmp_path), *overrides)
    assert "tensor_parallel: must divide the world size, and this is a single process" in err
    assert "torchrun --nproc-per-node 2" in err
    if not torch.cuda.is_available():
        assert "distributed.backend: nccl needs CUDA" in err


def test_micro_batch_larger_than_the_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, _write_config(tmp_path), "data.micro_batch_size=500")
    assert "one micro-batch needs 500 rows" in err and "lower data.micro_batch_size to at most" in err


def test_dry_run_prints_the_data_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dry-run", str(_write_config(tmp_path)), "data.eval_fraction=0.1",
                 "trainer.eval_every=1", "trainer.eval_batches=8", "trainer.grad_accumulation=2"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert re.search(r"\nnote: the eval split packs into \d+ rows and one evaluation reads 32 \(trainer.eval_batches 8 "
                     r"x 4 rows\), so eval/loss counts some rows more than once", out)
    assert "data: train 54 documents" in out and "data: eval 6 documents" in out
    assert "8 rows per step x 3 steps" in out and "epochs of the train split" in out
    assert not (tmp_path / "run").exists()
