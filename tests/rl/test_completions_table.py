"""GRPO logs each rollout's sample prompts, completions and rewards: a wandb table and the JSONL record."""

from __future__ import annotations

import json
from pathlib import Path

from wandb_reader import read_wandb_run

from fastlm.data.tasks import AdditionTask, Problem, score
from fastlm.logging.jsonl import read_metrics
from fastlm.rl.objective import COMPLETIONS_KEY
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_grpo_logs_sample_completions(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=5", "rl.warmup_steps=1", "rl.prompts_per_rollout=4",
        "rl.group_size=4", "rl.eval_prompts=0", "rl.log_completions=3", "trainer.log_every=1", "trainer.grad_accumulation=1",
        "logging.progress=false", "logging.wandb.mode=offline",
    ])
    summary = build_trainer(config).train()
    records = read_metrics(summary.run_dir / "metrics.jsonl")
    tables = {r["step"]: r[COMPLETIONS_KEY] for r in records if COMPLETIONS_KEY in r}
    # 4 RL steps, 2 updates per rollout: rollouts 1 and 2, each logged once, at its first step
    assert sorted(tables) == [2, 4], sorted(tables)
    task, format_reward = AdditionTask(config.rl.task.max_operand), config.rl.format_reward
    for step, rows in tables.items():
        print(step, rows)
        assert len(rows) == 3 and {row["rollout"] for row in rows} == {step // 2}
        for row in rows:
            a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
            expected = score(task, Problem(row["prompt"], str(a + b)), row["completion"], True, format_reward)
            assert row["reward"] in (expected, 0.0)  # 0.0: the completion hit the token budget without stopping

    (run_file,) = (summary.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = read_wandb_run(run_file)  # nested keys come flattened: <key>/_type, <key>/path, ...
    logged = {row["step"]: row for row in history if f"{COMPLETIONS_KEY}/_type" in row}
    assert sorted(logged) == [2, 4]
    for step, row in logged.items():
        assert row[f"{COMPLETIONS_KEY}/_type"] == "table-file" and row[f"{COMPLETIONS_KEY}/nrows"] == 3
        table = json.loads((run_file.parent / "files" / row[f"{COMPLETIONS_KEY}/path"]).read_text(encoding="utf-8"))
        assert [dict(zip(table["columns"], values)) for values in table["data"]] == tables[step]
