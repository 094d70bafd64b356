"""Distillation end to end: a tiny teacher trained in a tmp dir, configs/distill.yaml's student learns from it
(KL falls, metrics in JSONL and offline wandb), the step's loss and gradients match float64, and bad
teacher settings fail with the field and the fix."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from wandb_reader import read_wandb_run

from fastlm.config.errors import ConfigError
from fastlm.engine.preflight import preflight_issues
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.run_config.loader import load_config
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import training_kind
from tests.step_helpers import forward_backward, next_batches

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TEACHER_FIELD = "model.head.losses.distillation.teacher_path"


def _small(tmp_path: Path, steps: int) -> list[str]:
    """Overrides that keep a config's architecture but make its run tiny (data, steps, no wandb)."""
    return [
        f"run.output_dir={tmp_path}/{{name}}", f"trainer.steps={steps}", "trainer.log_every=5", "trainer.eval_every=0",
        "trainer.eval_batches=2", "data.source.num_documents=300", "data.seq_len=32", "data.micro_batch_size=8",
        "schedule.warmup_steps=5", "logging.wandb.enabled=false", "logging.progress=false",
    ]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny.yaml (hidden 128, 2 layers) trained 30 steps: the teacher every test here distils from."""
    root = tmp_path_factory.mktemp("teacher")
    summary = Trainer(load_config(CONFIGS / "tiny.yaml", _small(root, 30))).train()
    assert summary.last_loss is not None and summary.first_loss is not None
    assert summary.last_loss < summary.first_loss - 2.0  # a teacher worth copying
    return summary.run_dir / "checkpoints" / "latest"


def _student(tmp_path: Path, teacher: Path, steps: int, *extra: str) -> RunConfig:
    return load_config(CONFIGS / "distill.yaml", [*_small(tmp_path, steps), f"{TEACHER_FIELD}={teacher}", *extra])


def test_distill_config_kl_falls_and_logs(teacher_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = _student(tmp_path, teacher_dir, 25, "trainer.eval_every=25", "logging.wandb.enabled=true")
    assert training_kind(config) == "supervised" and config.model.head.frozen_models()[0][1].role == "teacher"
    trainer = Trainer(config)
    assert config.model.hidden_size < trainer.objective.teacher.config.hidden_size  # the student is the smaller model
    assert not any(p.requires_grad for p in trainer.objective.teacher.parameters()) and not trainer.objective.teacher.training
    teacher_before = {k: v.clone() for k, v in trainer.objective.teacher.state_dict().items()}
    summary = trainer.train()

    records = read_metrics(summary.run_dir / "metrics.jsonl")
    kl = [r["train/loss/distillation"] for r in records]
    print(f"distillation KL per log: {[round(v, 4) for v in kl]}")
    assert kl[-1] < 0.5 * kl[0]
    assert all(torch.equal(teacher_before[k], v) for k, v in trainer.objective.teacher.state_dict().items())  # frozen
    expected = {"train/loss", "train/loss/distillation", "train/loss/cross_entropy", "train/lr", "train/grad_norm",
                "train/tokens_per_second", "train/step"}
    assert all(expected <= set(r) for r in records)
    assert "eval/loss" in records[-1]

    (run_file,) = (summary.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = read_wandb_run(run_file)
    assert [row["step"] for row in history] == [r["step"] for r in records]
    for row, record in zip(history, records):
        assert expected <= set(row)
        assert all(row[k] == record[k] for k in expected)


def _kl64(student: torch.Tensor, teacher: torch.Tensor, temperature: float, reverse: bool) -> torch.Tensor:
    p, q = torch.log_softmax(student, -1), torch.log_softmax(teacher / temperature, -1)
    return (p.exp() * (p - q)).sum(-1) if reverse else (q.exp() * (q - p)).sum(-1)


@pytest.mark.parametrize(("kl", "budget"), [("forward", 0.0), ("reverse", 0.0), ("forward", 0.01), ("reverse", 0.01)],
                         ids=["forward-full", "reverse-full", "forward-chunked", "reverse-chunked"])
def test_step_matches_float64(teacher_dir: Path, tmp_path: Path, kl: str, budget: float) -> None:
    """One step through the trainer (teacher logits, masking, normaliser, CE mix) vs float64 autograd:
    the full-logits head with the teacher's logits, and the chunked head (0.01 MiB: 5 of 64 tokens a
    chunk) with the teacher's hidden states and head weight."""
    config = _student(tmp_path, teacher_dir, 1, f"model.head.losses.distillation.kl={kl}",
                      "model.head.losses.distillation.temperature=2.0", "data.micro_batch_size=2",
                      f"model.head.logits_memory_mib={budget}")
    trainer = Trainer(config)
    batches = next_batches(trainer) + next_batches(trainer)  # two micro-batches share one normaliser
    prepared = trainer.objective.prepare(batches[0])
    assert (prepared.teacher_head is not None, prepared.teacher_logits is not None) == (budget > 0, budget == 0)
    labels = torch.cat([b.labels for b in batches])
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()
    result = forward_backward(trainer, batches)

    student64, teacher64 = copy.deepcopy(trainer.model).double(), copy.deepcopy(trainer.objective.teacher).double()
    student64.zero_grad(set_to_none=True)
    mask = labels.reshape(-1) != IGNORE_INDEX
    ids = torch.cat([b.input_ids for b in batches])
    docs = torch.cat([b.document_ids + i * 10_000 for i, b in enumerate(batches)])  # rows stay separate documents
    z_student = student64.logits(ids, docs).reshape(-1, config.model.vocab_size)
    with torch.no_grad():
        z_teacher = teacher64.logits(ids, docs).reshape(-1, config.model.vocab_size)
    tokens = mask.sum()
    kd = (_kl64(z_student, z_teacher, 2.0, kl == "reverse") * mask).sum() / tokens
    ce = torch.nn.functional.cross_entropy(z_student, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum") / tokens
    total = kd + 0.1 * ce
    total.backward()

    kd_error = abs(result.losses["distillation"] - kd.item()) / kd.item()
    total_error = abs(result.loss - total.item()) / total.item()
    grad_error = max(
        float((a.grad.double() - b.grad).norm() / b.grad.norm())
        for a, b in zip(trainer.model.parameters(), student64.parameters(), strict=True)
        if b.grad is not None and b.grad.norm() > 0
    )
    print(f"{kl} KL T=2: kd rel err {kd_error:.2e}, total rel err {total_error:.2e}, max param-grad rel err {grad_error:.2e}")
    assert kd_error < 1e-5 and total_error < 1e-5 and grad_error < 1e-4


def test_teacher_path_errors(teacher_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "checkpoints" / "latest"
    with pytest.raises(ConfigError) as caught:
        _student(tmp_path, missing, 1)
    text = str(caught.value)
    print(text)
    assert TEACHER_FIELD in text and str(missing) in text and "fastlm train configs/tiny.yaml" in text

    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS / "distill.yaml", [*_small(tmp_path, 1), f"{TEACHER_FIELD}=null"])
    assert caught.value.issues[0].path == TEACHER_FIELD and "no data source brings teacher logits" in str(caught.value)

    other_vocab = Trainer(load_config(CONFIGS / "tiny.yaml", [*_small(tmp_path, 1), "run.name=wide", "model.vocab_size=272"]))
    other_vocab.train()
    # Found by the start's checks (`train` and `validate` run them), before any model is built.
    (issue,) = preflight_issues(_student(tmp_path, other_vocab.run_dir, 1))
    assert re.search(rf"{TEACHER_FIELD}: .*vocab_size is 272.*260", str(issue))

    empty = tmp_path / "empty"
    empty.mkdir()
    (issue,) = preflight_issues(_student(tmp_path, empty, 1))
    assert str(issue).startswith(f"{TEACHER_FIELD}: no fastlm checkpoint there")


def test_teacher_path_forms(teacher_dir: Path, tmp_path: Path) -> None:
    """The `latest` pointer, the checkpoints/ dir, the run dir and a step-* dir all name the same teacher."""
    checkpoints = teacher_dir.parent
    step_dir = checkpoints / teacher_dir.read_text().strip()
    states = [
        Trainer(_student(tmp_path, path, 1)).objective.teacher.state_dict()
        for path in (teacher_dir, checkpoints, checkpoints.parent, step_dir)
    ]
    for state in states[1:]:
        assert all(torch.equal(state[k], states[0][k]) for k in states[0])
