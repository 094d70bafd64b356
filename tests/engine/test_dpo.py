"""DPO end to end: configs/dpo.yaml on generated pairs lifts accuracy above chance and logs TRL's reward
metrics to JSONL and offline wandb; a step matches float64; pairs pack in the order the loss reads;
accumulation equals one big batch; the reference stays the initial policy across resume; clear errors."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from wandb_reader import read_wandb_run

from fastlm.data.batch import batch_from_rows
from fastlm.data.config import PreferencesJsonlSource
from fastlm.data.datasets import DataError
from fastlm.data.preferences import PreferenceBatch, pack_pairs, read_preference_jsonl
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.run_config.checks import cross_check
from fastlm.run_config.loader import load_config
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import training_kind
from tests.step_helpers import forward_backward, next_batches

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REWARDS = ("chosen", "rejected", "margins", "accuracies")


def _dpo(tmp_path: Path, steps: int, *extra: str) -> RunConfig:
    """configs/dpo.yaml at a tiny size: hidden 64, 1 layer, sums of operands up to 4, seq_len 32."""
    return load_config(CONFIGS / "dpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", f"trainer.steps={steps}", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.eval_batches=2", "model.hidden_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=192", "model.max_seq_len=32", "data.seq_len=32",
        "data.micro_batch_size=8", "data.source.num_pairs=200", "data.source.max_operand=4", "optimizer.lr=3e-3",
        "schedule.warmup_steps=5", "logging.wandb.enabled=false", "logging.progress=false", *extra,
    ])


def test_dpo_config_accuracy_above_chance_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = _dpo(tmp_path, 40, "trainer.eval_every=40", "logging.wandb.enabled=true")
    assert training_kind(config) == "supervised" and config.model.head.frozen_models()[0][1].role == "reference"
    summary = Trainer(config).train()

    records = read_metrics(summary.run_dir / "metrics.jsonl")
    accuracy = [r["train/dpo/rewards/accuracies"] for r in records]
    margins = [r["train/dpo/rewards/margins"] for r in records]
    first, last = statistics.mean(accuracy[:5]), statistics.mean(accuracy[-10:])
    print(f"accuracy {first:.3f} -> {last:.3f}, margin {statistics.mean(margins[-10:]):.4f}, "
          f"loss {records[0]['train/loss']:.4f} -> {records[-1]['train/loss']:.4f}, eval/loss {summary.eval_loss:.4f}")
    assert abs(records[0]["train/loss"] - math.log(2)) < 1e-2  # step 1: policy == reference
    assert last > 0.75 and statistics.mean(margins[-10:]) > 0
    assert summary.eval_loss is not None and summary.eval_loss < math.log(2)  # held-out pairs too
    for r in records:  # a margin is chosen minus rejected reward
        assert math.isclose(r["train/dpo/rewards/margins"], r["train/dpo/rewards/chosen"] - r["train/dpo/rewards/rejected"],
                            rel_tol=1e-4, abs_tol=1e-6)
    expected = {"train/loss", "train/loss/dpo", "train/lr", "train/grad_norm", "train/tokens_per_second", "train/step",
                *(f"train/dpo/rewards/{name}" for name in REWARDS)}
    assert all(expected <= set(r) for r in records)
    assert "eval/loss" in records[-1]

    (run_file,) = (summary.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = read_wandb_run(run_file)
    assert [row["step"] for row in history] == [r["step"] for r in records]
    for row, record in zip(history, records):
        assert expected <= set(row) and all(row[k] == record[k] for k in expected)


def _sequence_sums64(logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Per document, in sorted id order, the summed log-prob of its unmasked labels (a plain loop)."""
    log_probs = torch.log_softmax(logits, -1)
    sums = []
    for document in torch.unique(documents):
        rows = (documents == document) & (labels != IGNORE_INDEX)
        sums.append(log_probs[rows].gather(-1, labels[rows][:, None]).sum())
    return torch.stack(sums)


def test_step_matches_float64(tmp_path: Path) -> None:
    """Reference log-probs, loss, reward metrics and gradients of a two-micro-batch step vs float64."""
    config = _dpo(tmp_path, 1, "data.micro_batch_size=2", "model.head.losses.dpo.beta=0.5")
    trainer = Trainer(config)
    with torch.no_grad():  # move the policy away from the reference so rewards are not all zero
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    batches = next_batches(trainer) + next_batches(trainer)
    result = forward_backward(trainer, batches)

    policy64, reference64 = copy.deepcopy(trainer.model).double(), copy.deepcopy(trainer.objective.reference).double()
    policy64.zero_grad(set_to_none=True)
    losses, rewards, pairs = [], {name: [] for name in REWARDS}, 0
    for batch in map(trainer.objective.prepare, batches):  # with the reference's sequence log-probs
        labels, documents = batch.labels.reshape(-1), batch.document_ids.reshape(-1)
        assert (labels == IGNORE_INDEX).any()
        policy = _sequence_sums64(policy64.logits(batch.input_ids, batch.document_ids).reshape(labels.numel(), -1),
                                  labels, documents)
        with torch.no_grad():
            reference = _sequence_sums64(
                reference64.logits(batch.input_ids, batch.document_ids).reshape(labels.numel(), -1), labels, documents)
        reference_error = float((batch.reference_logps.double() - reference).abs().max() / reference.abs().max())
        print(f"reference log-probs rel err {reference_error:.2e}")
        assert reference_error < 1e-5
        chosen, rejected = 0.5 * (policy[0::2] - reference[0::2]), 0.5 * (policy[1::2] - reference[1::2])
        losses.append(-torch.nn.functional.logsigmoid(chosen - rejected))
        for name, value in zip(REWARDS, (chosen, rejected, chosen - rejected, (chosen > rejected).double())):
            rewards[name].append(value.detach())
        pairs += len(chosen)
    loss = torch.cat(losses).sum() / pairs
    loss.backward()

    loss_error = abs(result.loss - loss.item()) / loss.item()
    metric_errors = {name: abs(result.metrics[f"dpo/rewards/{name}"] - float(torch.cat(v).mean()))
                     / max(abs(float(torch.cat(v).mean())), 1e-3) for name, v in rewards.items()}
    grad_error = max(
        float((a.grad.double() - b.grad).norm() / b.grad.norm())
        for a, b in zip(trainer.model.parameters(), policy64.parameters(), strict=True)
        if b.grad is not None and b.grad.norm() > 0
    )
    print(f"{pairs} pairs: loss rel err {loss_error:.2e}, reward metric rel errs "
          f"{ {k: f'{v:.1e}' for k, v in metric_errors.items()} }, max param-grad rel err {grad_error:.2e}")
    assert loss_error < 1e-5 and max(metric_errors.values()) < 1e-4 and grad_error < 1e-4


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_preference_jsonl_packs_pairs_in_loss_order(tmp_path: Path) -> None:
    pairs = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(7)]
    path = _write(tmp_path / "pairs.jsonl", [json.dumps(p) for p in pairs[:3]] + [""] + [json.dumps(p) for p in pairs[3:]])
    tokenizer = ByteTokenizer()
    rows = pack_pairs(
        read_preference_jsonl(PreferencesJsonlSource(path=str(path)), tokenizer), seq_len=40, pad_id=tokenizer.pad_id
    )
    batch = batch_from_rows(*rows.take(torch.arange(len(rows))))
    assert len(rows) > 1  # pairs spill over rows, whole
    assert batch.padding.any() and torch.equal(batch.padding, batch.input_ids == tokenizer.pad_id)  # the rows' tails
    assert batch.num_documents == 2 * len(pairs)  # padding joins a document, never one of its own
    labels, documents = batch.labels.reshape(-1), batch.document_ids.reshape(-1)
    answers = [tokenizer.decode(labels[(documents == d) & (labels != IGNORE_INDEX)].tolist(), skip_special=False)
               for d in torch.unique(documents)]
    expected = [f"{p[key]}<eos>" for p in pairs for key in ("chosen", "rejected")]
    assert answers == expected  # sequence 2k chosen, 2k+1 rejected, only answers (and EOS) are labels
    preference = PreferenceBatch(batch.input_ids, batch.labels, batch.document_ids,
                                 reference_logps=torch.randn(2 * len(pairs)))
    assert preference.num_documents == len(pairs) and preference.targets().reference_logps is preference.reference_logps
    with pytest.raises(ValueError, match=r"reference_logps has shape \(3,\), expected \(14,\)"):
        PreferenceBatch(batch.input_ids, batch.labels, batch.document_ids, reference_logps=torch.randn(3))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "1+1=", "chosen": "2", "rejected": "3"}', '{"prompt": "1+2="'], r"line 2: invalid JSON"),
        (['{"prompt": "1+1=", "chosen": "2"}'], r"line 1: missing field 'rejected'"),
        (['["a"]'], r"line 1: expected a JSON object, got list"),
        (['{"prompt": "1+1=", "chosen": 2, "rejected": "3"}'], r"line 1: field 'chosen' must be a string"),
        (['{"prompt": "1+1=", "chosen": "2", "rejected": "2"}'], r"line 1: 'chosen' and 'rejected' are equal"),
        ([], r"no preference pairs"),
    ],
)
def test_preference_jsonl_errors_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=rf"bad.jsonl:?.*{message}"):
        read_preference_jsonl(PreferencesJsonlSource(path=str(path)), ByteTokenizer())


def test_pair_longer_than_a_row_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "long.jsonl", ['{"prompt": "' + "x" * 30 + '", "chosen": "a", "rejected": "b"}'])
    pairs = read_preference_jsonl(PreferencesJsonlSource(path=str(path)), ByteTokenizer())
    with pytest.raises(DataError, match=r"long.jsonl line 1: the pair is 66 tokens .* data.seq_len \+ 1 = 33"):
        pack_pairs(pairs, seq_len=32, pad_id=0)


def test_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    """Pairs, not sequences, normalise the step: 2 x 4 rows gives the 1 x 8 update."""
    accumulated = Trainer(_dpo(tmp_path, 1, "run.name=acc", "data.micro_batch_size=4", "trainer.grad_accumulation=2",
                                  "optimizer.grad_clip=null"))
    big = Trainer(_dpo(tmp_path, 1, "run.name=big", "data.micro_batch_size=8", "optimizer.grad_clip=null"))
    with torch.no_grad():  # same policy away from the (shared) reference: a step with a real signal
        for a, b in zip(accumulated.model.parameters(), big.model.parameters(), strict=True):
            a.add_(0.05 * torch.randn_like(a))
            b.copy_(a)
    # Gradients, not weights after AdamW's sign-like first step (which amplifies reordering noise).
    first = forward_backward(accumulated, next_batches(accumulated))
    second = forward_backward(big, next_batches(big))
    loss_error = abs(first.loss - second.loss) / abs(second.loss)
    trained = [(a, b) for a, b in zip(accumulated.model.parameters(), big.model.parameters(), strict=True) if b.grad is not None]
    grad_error = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in trained)
    print(f"dpo accumulation 2x4 vs 1x8: loss rel err {loss_error:.2e}, max grad rel err (per tensor) {grad_error:.2e}")
    assert trained and loss_error < 1e-6 and grad_error < 1e-5


def test_reference_is_the_initial_policy_across_resume_or_a_checkpoint(tmp_path: Path) -> None:
    first = Trainer(_dpo(tmp_path, 3, "trainer.checkpoint_every=2"))
    initial = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.train()
    assert not any(p.requires_grad for p in first.objective.reference.parameters())
    assert all(torch.equal(first.objective.reference.state_dict()[k], v) for k, v in initial.items())  # the policy moved, not it
    resumed = Trainer(_dpo(tmp_path, 4))
    resumed.train(resume=True)
    assert resumed.step == 4
    assert all(torch.equal(resumed.objective.reference.state_dict()[k], v) for k, v in initial.items())

    loaded = Trainer(_dpo(tmp_path, 1, "run.name=other", f"model.head.losses.dpo.reference_path={first.run_dir}"))
    trained = resumed.model.state_dict()  # the run dir's latest checkpoint is the resumed run's step 4
    assert all(torch.equal(loaded.objective.reference.state_dict()[k], trained[k]) for k in trained)


@pytest.mark.parametrize(
    ("sections", "path", "message"),
    [
        ({"model": {"head": {"losses": {"dpo": {}}}}}, "data.source.type", "the dpo loss trains on preference pairs"),
        ({"data": {"source": {"type": "generated_preferences"}}}, "data.source.type", "preference pairs need a dpo loss"),
        ({"model": {"head": {"losses": {"dpo": {"reference_path": "/nonexistent/checkpoints"}}}},
          "data": {"source": {"type": "generated_preferences"}}}, "model.head.losses.dpo.reference_path",
         "checkpoint not found"),
    ],
)
def test_cross_checks_name_the_field(sections: dict, path: str, message: str) -> None:
    issues = cross_check(RunConfig.model_validate(sections))
    assert len(issues) == 1 and issues[0].path == path and message in issues[0].message


def test_tensor_parallel_is_refused_for_a_frozen_reference() -> None:
    config = RunConfig.model_validate({"model": {"head": {"losses": {"dpo": {}}}}, "distributed": {"tensor_parallel": 2},
                                       "data": {"source": {"type": "generated_preferences"}}})
    (issue,) = cross_check(config)
    assert issue.path == "distributed.tensor_parallel" and "model.head.losses.dpo" in issue.message
