"""Offline RL JSONL: validation names file and line; GRPO on the file moves log-probs the advantages' way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fastlm.data.datasets import DataError
from fastlm.data.offline_rl import load_offline_rl, write_offline_rl
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.rl.checks import rl_issues
from fastlm.rl.packing import pack_policy_samples, policy_logprobs, rows_to_batch
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer, training_kind

GOOD = {"prompt": "2+2=", "completion": "4", "advantage": 1.0, "old_logprobs": [-0.5, -0.1]}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: invalid JSON"),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "advantage"}), "line 2: missing field 'advantage'"),
        (json.dumps({**GOOD, "prompt": 3}), "line 2: field 'prompt' must be a string, got int"),
        (json.dumps({**GOOD, "advantage": "high"}), "line 2: field 'advantage' must be a finite number"),
        (
            json.dumps({**GOOD, "old_logprobs": [-0.5]}),
            r"must be a list of 2 numbers .*1 tokens under the byte tokenizer \+ EOS\), got 1 values",
        ),
        (json.dumps({**GOOD, "old_logprobs": [-0.5, 0.3]}), r"old_logprobs\[1\] = 0.3 is not a finite log-probability"),
        (json.dumps({**GOOD, "old_logprobs": [-0.5, None]}), r"old_logprobs\[1\] = None"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "rl.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message) as error:
        load_offline_rl(path, ByteTokenizer())
    assert str(path) in str(error.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="offline RL data file not found"):
        load_offline_rl(tmp_path / "nope.jsonl", ByteTokenizer())
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "\xe9"}\n')
    with pytest.raises(DataError, match="not valid UTF-8 at byte 12"):
        load_offline_rl(tmp_path / "latin1.jsonl", ByteTokenizer())
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no samples"):
        load_offline_rl(tmp_path / "empty.jsonl", ByteTokenizer())


def _records() -> list[dict]:
    """Right answers with advantage +1, wrong ones with -1; old log-probs near a uniform policy's."""
    records = []
    for a in range(4):
        for b in range(4):
            for completion, advantage in ((str(a + b), 1.0), (str(a + b + 1), -1.0)):
                count = len(completion.encode()) + 1
                records.append({"prompt": f"{a}+{b}=", "completion": completion, "advantage": advantage,
                                "old_logprobs": [-math.log(260.0)] * count})
    return records


def test_offline_grpo_moves_logprobs_with_advantages(tmp_path: Path) -> None:
    path = tmp_path / "rl.jsonl"
    write_offline_rl(path, _records())
    config = RunConfig.model_validate({
        "run": {"name": "offline", "output_dir": str(tmp_path / "{name}"), "seed": 0},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32,
                  "head": {"losses": {"grpo": {"type": "grpo"}, "z_loss": {"type": "z_loss"}}}},
        "data": {"source": {"type": "offline_rl", "path": str(path)}, "seq_len": 32, "micro_batch_size": 2},
        "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 0, "decay": "constant"},
        "trainer": {"steps": 12, "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    })
    assert training_kind(config) == "offline_rl"
    trainer = build_trainer(config)
    samples = load_offline_rl(path, trainer.tokenizer)
    rows = pack_policy_samples(samples, 32, trainer.tokenizer.pad_id)
    batch = rows_to_batch(rows, torch.arange(len(rows)))
    before = policy_logprobs(trainer.model, batch, 1.0, None)
    summary = trainer.train()
    after = policy_logprobs(trainer.model, batch, 1.0, None)
    positive, negative = batch.advantages > 0, batch.advantages < 0
    change_pos = float((after - before)[positive].mean())
    change_neg = float((after - before)[negative].mean())
    print(f"offline GRPO: mean logp change, advantage +1: {change_pos:+.3f}, advantage -1: {change_neg:+.3f}")
    assert change_pos > change_neg
    assert change_pos > 0 > change_neg
    assert summary.rewards == [] and summary.steps == 12


def test_offline_rejects_warmup(tmp_path: Path) -> None:
    path = tmp_path / "rl.jsonl"
    write_offline_rl(path, [GOOD])
    config = RunConfig.model_validate({
        "data": {"source": {"type": "offline_rl", "path": str(path)}},
        "model": {"head": {"losses": {"grpo": {"type": "grpo"}}}},
        "rl": {"warmup_steps": 5},
    })
    assert [issue.path for issue in rl_issues(config)] == ["rl.warmup_steps"]
    assert "needs the online task, not offline_rl data" in rl_issues(config)[0].message
    plain = config.model_copy(update={"model": config.model.model_copy(update={"head": type(config.model.head)()})})
    assert "exactly one policy child" in rl_issues(plain)[0].message


def test_offline_grpo_with_reference_kl_logs_trl_kl(tmp_path: Path) -> None:
    """beta > 0: a frozen copy of the initial policy gives each batch its reference log-probs; the
    head logs TRL's `kl` (k3 to the reference: 0 before the first update, > 0 after) next to `kl_old`."""
    path = tmp_path / "rl.jsonl"
    write_offline_rl(path, _records())
    config = RunConfig.model_validate({
        "run": {"name": "offline-kl", "output_dir": str(tmp_path / "{name}"), "seed": 0},
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32,
                  "head": {"losses": {"grpo": {"type": "grpo", "beta": 0.1, "loss_type": "grpo"}}}},
        "data": {"source": {"type": "offline_rl", "path": str(path)}, "seq_len": 32, "micro_batch_size": 2},
        "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 0, "decay": "constant"},
        "trainer": {"steps": 4, "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    })
    trainer = build_trainer(config)
    assert trainer.objective.reference is not None and not any(p.requires_grad for p in trainer.objective.reference.parameters())
    summary = trainer.train()
    records = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["train/grpo/kl"] for r in records if "train/grpo/kl" in r]
    print(f"reference kl per step: {kl}")
    assert len(kl) == 4 and abs(kl[0]) < 1e-6 and kl[-1] > 1e-6
    assert all("train/grpo/kl_old" in r for r in records if "train/grpo/kl" in r)
