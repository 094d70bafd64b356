"""GRPO on 2 gloo dp ranks: each rank samples its own prompts and completions, advantages and logged rollout
statistics are those of the global rollout, and a mid-rollout checkpoint resumes each rank exactly.

Rewards are re-scored here from the tokens each rank trained on (decoded from its packed micro-batches),
independently of the loader's bookkeeping.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fastlm.data.batch import Batch
from fastlm.data.tasks import AdditionTask, Problem, score
from fastlm.data.tokenizer import EOS, ByteTokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.objective import TrainingParts
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.rl.objective import OnlineRLObjective
from fastlm.run_config.schema import RunConfig
from tests.distributed.dist_helpers import run_config, spawn

WARMUP, RL_STEPS, GROUP, PROMPTS, OPERAND = 12, 4, 4, 3, 4
TOKENIZER = ByteTokenizer()
FORMAT_REWARD = 0.1


def grpo_config(directory: Path, name: str, steps: int = WARMUP + RL_STEPS - 1) -> dict[str, Any]:
    """A tiny GRPO run on 0..4 addition: a short high-lr warm-up so the rewards are not all zero."""
    return run_config(
        directory, name,
        model={"max_seq_len": 32, "head": {"losses": {"grpo": {"type": "grpo"}}}},
        data={"seq_len": 32, "micro_batch_size": 2},
        optimizer={"lr": 2e-2},
        trainer={"steps": steps, "grad_accumulation": 2},
        rl={"task": {"max_operand": OPERAND}, "group_size": GROUP, "prompts_per_rollout": PROMPTS, "updates_per_rollout": 2,
            "max_new_tokens": 3, "warmup_steps": WARMUP, "warmup_demonstrations": 64, "eval_prompts": 0,
            "scale_rewards": "batch", "format_reward": FORMAT_REWARD, "lr_scale": 0.5},
    )


class RecordingObjective(OnlineRLObjective):
    """Keeps every micro-batch it trained on, to re-score them outside the loader."""

    def __init__(self, parts: TrainingParts):
        super().__init__(parts)
        self.seen: list[list[Batch]] = []

    def batches(self, step: int) -> list[Batch]:
        batches = super().batches(step)
        self.seen.append([Batch(**{k: v.clone() for k, v in vars(b).items() if v is not None}) for b in batches])
        return batches


def run_rank(config: dict[str, Any], resume: bool = False) -> dict[str, Any]:
    trainer = Trainer(RunConfig.model_validate(config), objective=RecordingObjective)
    summary = trainer.train(resume=resume)
    return {"steps": [[vars(b) for b in step] for step in trainer.objective.seen], "losses": summary.losses,
            "rewards": summary.rewards}


def run_then_resume(config: dict[str, Any], copy_to: Path) -> dict[str, Any]:
    """On every rank: train to the mid-rollout step, keep a copy of the run (for a resume at another world
    size), resume one more step in a fresh trainer."""
    first = run_rank(config)
    if dist.get_rank() == 0:
        shutil.copytree(RunConfig.model_validate(config).run.directory, copy_to)
    dist.barrier()
    return {"first": first, "resumed": run_rank(longer(config), resume=True)}


def longer(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "trainer": {**config["trainer"], "steps": config["trainer"]["steps"] + 1}}


def documents(batches: list[dict[str, torch.Tensor]]) -> list[tuple[str, list[int], float]]:
    """(prompt text, completion tokens, advantage) of every trained document of one step's micro-batches."""
    found = []
    for batch in batches:
        for row in range(batch["labels"].shape[0]):
            ids, labels = batch["document_ids"][row], batch["labels"][row]
            for doc in ids.unique().tolist():
                where = ids == doc
                target = labels[where] != IGNORE_INDEX
                if not target.any():  # padding
                    continue
                first = int(target.nonzero()[0])  # its input is the prompt's last token
                prompt = TOKENIZER.decode(batch["input_ids"][row][where][1 : first + 1].tolist())
                completion = labels[where][target]
                advantage = float(batch["advantages"][row][where][target][0])
                found.append((prompt, completion.tolist(), advantage))
    return found


def rescore(prompt: str, completion: list[int]) -> float:
    a, b = prompt.rstrip("=").split("+")
    stopped = completion[-1] == EOS
    text = TOKENIZER.decode(completion[:-1] if stopped else completion, skip_special=False)
    return score(AdditionTask(OPERAND), Problem(prompt, str(int(a) + int(b))), text, stopped, FORMAT_REWARD)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """2 ranks: the warm-up and three RL steps (the last is the first update of rollout 2), then a resume."""
    directory = tmp_path_factory.mktemp("rl_dp")
    return directory, spawn(run_then_resume, grpo_config(directory, "dp2"), directory / "single")


def test_ranks_sample_their_own_share_and_log_global_means(two_ranks: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    directory, runs = two_ranks
    ranks = {rank: run["first"] for rank, run in runs.items()}
    records = {r["step"]: r for r in read_metrics(directory / "dp2" / "metrics.jsonl")}
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["rewards"] == ranks[1]["rewards"]
    # warm-up: rank-strided demonstrations (together the single-process batch of 2 * micro_batch_size rows)
    assert not torch.equal(ranks[0]["steps"][0][0]["input_ids"], ranks[1]["steps"][0][0]["input_ids"])
    nonzero, checked, worst = 0, 0, 0.0
    for rollout in range(RL_STEPS // 2):
        step = WARMUP + 2 * rollout  # first update on this rollout (0-based index into the steps)
        docs = {rank: documents(ranks[rank]["steps"][step]) for rank in (0, 1)}
        assert all(len(d) == PROMPTS * GROUP for d in docs.values())
        # the second update trains on the same rollout (rollout 1's second update is the resumed step)
        again = {rank: ranks[rank]["steps"][step + 1] if rollout == 0 else runs[rank]["resumed"]["steps"][0]
                 for rank in (0, 1)}
        assert all(documents(again[rank]) == docs[rank] for rank in (0, 1))
        prompts = {rank: sorted(p for p, _, _ in d) for rank, d in docs.items()}
        assert prompts[0] != prompts[1] and [c for _, c, _ in docs[0]] != [c for _, c, _ in docs[1]]
        rewards = {rank: [rescore(p, c) for p, c, _ in d] for rank, d in docs.items()}
        every = rewards[0] + rewards[1]
        nonzero += sum(r > 0 for r in every)
        expected = sum(every) / len(every)
        logged = [records[step + 1]["train/reward"], ranks[0]["rewards"][rollout]]
        print(f"rollout {rollout}: rank rewards {sum(rewards[0]) / len(rewards[0]):.3f} / "
              f"{sum(rewards[1]) / len(rewards[1]):.3f}, "
              f"global {expected:.4f}, logged {logged}")
        assert logged == pytest.approx([expected] * 2, abs=1e-12)
        lengths = [len(c) for d in docs.values() for _, c, _ in d]
        assert records[step + 1]["train/completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert records[step + 1]["train/completions/max_length"] == max(lengths)
        # scale_rewards: batch divides by the std of the global rollout, not the rank's (groups are found
        # by prompt where a prompt was drawn once: packing may reorder documents)
        std = float(torch.tensor(every, dtype=torch.float64).std())
        for rank, d in docs.items():
            drawn = Counter(p for p, _, _ in d)
            for prompt in (p for p, n in drawn.items() if n == GROUP):
                group = [(a, r) for (p, _, a), r in zip(d, rewards[rank]) if p == prompt]
                mean = sum(r for _, r in group) / GROUP
                worst = max(worst, *(abs(a - (r - mean) / (std + 1e-4)) for a, r in group))
                checked += 1
    print(f"advantages vs global-std reference ({checked} groups): max abs err {worst:.2e}; "
          f"{nonzero} rewarded completions")
    assert nonzero > 0 and checked > 0 and worst < 1e-5


def test_mid_rollout_checkpoint_resumes_every_rank(two_ranks: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    """The 2-rank checkpoint after the first update of a rollout holds both ranks' rollouts and sampling
    generators; resuming at 2 ranks gives each rank its own rollout back (checked above), resuming at
    1 rank drops them and draws a fresh rollout of prompts_per_rollout prompts."""
    directory, runs = two_ranks
    state = load_latest_checkpoint(directory / "single" / "checkpoints").trainer_state["data"]
    assert len(state["ranks"]) == 2 and state["position"] == 2  # one of two updates served
    assert not torch.equal(state["ranks"][0]["generator"], state["ranks"][1]["generator"])
    assert runs[0]["resumed"]["losses"] == runs[1]["resumed"]["losses"]
    config = grpo_config(directory, "single")
    single = run_rank(longer(config), resume=True)
    assert len(single["steps"]) == 1 and len(documents(single["steps"][0])) == PROMPTS * GROUP
    assert len(single["rewards"]) == RL_STEPS // 2 + 1
