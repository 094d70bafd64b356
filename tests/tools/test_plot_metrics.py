"""tools/plot_metrics.py draws a real run's JSONL to a PNG and names what is missing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"
spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
plot_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_metrics)


def _write_run(run_dir: Path) -> None:
    run_dir.mkdir()
    with (run_dir / "metrics.jsonl").open("w") as handle:
        for step in range(1, 6):
            record = {"step": step, "time": 0.0, "train/loss/grpo": 0.1 * step, "train/loss/z_loss": 2.0,
                      "train/reward": 0.2 * step, "train/grpo/clip_ratio/region_mean": 0.05, "train/grpo/entropy": 1.0 / step}
            if step % 2 == 0:
                record["eval/reward"] = 0.1 * step
            handle.write(json.dumps(record) + "\n")


def test_plot_writes_png(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    assert plot_metrics.main([str(run_dir)]) == 0
    png = run_dir / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    found = plot_metrics.series(plot_metrics.read_metrics(run_dir / "metrics.jsonl"), plot_metrics.PANELS["reward"])
    assert found["eval/reward"] == ([2, 4], [pytest.approx(0.2), pytest.approx(0.4)])
    assert len(found["train/reward"][0]) == 5


def test_plot_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plot_metrics.main([str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/step": 1.0, "train/rl/warmup": 0.0}) + "\n")
    assert plot_metrics.main([str(tmp_path)]) == 2
    assert "none of the plotted metrics" in capsys.readouterr().err


def test_panels_cover_dpo_and_rl_with_the_warmup_boundary(tmp_path: Path) -> None:
    """A DPO run gets rewards and accuracy panels; an RL run's warm-up end is found between its phases."""
    dpo = [{"step": s, "train/loss": 0.7 - 0.01 * s, "train/loss/dpo": 0.7 - 0.01 * s, "eval/loss": 0.69,
            "train/dpo/rewards/chosen": 0.01 * s, "train/dpo/rewards/rejected": -0.01 * s,
            "train/dpo/rewards/margins": 0.02 * s, "train/dpo/rewards/accuracies": 0.5 + 0.02 * s} for s in range(1, 9)]
    titles = list(plot_metrics.panels_of(dpo))
    print(titles)
    assert titles[:1] == ["loss"] and not any("train/loss/" in t for t in titles)  # one child is train/loss itself
    assert {"DPO rewards (beta x log-ratio)", "DPO accuracy (chosen > rejected)"} <= set(titles)
    rl = [{"step": s, "train/rl/warmup": float(s <= 3), "train/loss": 1.0, "train/reward": 0.1 * s,
           "train/completions_table": [{"prompt": "1+1=", "completion": "2", "reward": 1.0}]} for s in range(1, 7)]
    assert plot_metrics.warmup_end(rl) == 3.5 and plot_metrics.warmup_end(dpo) is None
    assert "train/completions_table" not in plot_metrics.series(rl, r".*")  # tables are not series
    run_dir = tmp_path / "rl"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl))
    assert plot_metrics.main([str(run_dir)]) == 0 and (run_dir / "metrics.png").stat().st_size > 5000


def _rl_record(step: int) -> dict:
    """One GRPO log record with the keys the code that logs them produces: the rollout, sampler-gap and
    per-function reward metrics from their own functions, the trainer's and the RL trainer's scalars, and a
    loss child's metrics (as the RL objective's metrics assemble them)."""
    import torch

    from fastlm.rl.advantages import rollout_metrics
    from fastlm.rl.consistency import gap_metrics
    from fastlm.rl.rewards import RewardFunction, reward_metrics

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    rollout = rollout_metrics(rewards, rewards - 0.5, torch.tensor([3, 4, 2, 4]), torch.tensor([True, False, True, True]), 2)
    # one gap_statistics row: |gap| sum, tokens, max |gap|, weight sum, min, max, clamped ratio sum and square
    # sum, k3 sum, masked tokens, k1 sum
    gaps = gap_metrics(torch.tensor([[0.1, 4.0, 0.05, 4.1, 0.9, 1.2, 4.1, 4.3, 2e-3, 0.0, 1e-3]], dtype=torch.float64),
                       with_weights=True)
    per_function = reward_metrics(rewards[:, None], [RewardFunction("exact", "mine:exact", lambda **_: [], 1.0)])
    record = {f"train/{key}": value + 0.01 * step for key, value in {**rollout, **gaps, **per_function}.items()}
    record.update({"step": step, "time": 0.0, "train/loss": 1.0 / step, "train/loss/grpo": 0.1, "train/loss/z_loss": 9.0,
                   "train/grpo/kl_old": 1e-3, "train/grpo/entropy": 1.2, "train/grpo/clip_ratio/region_mean": 0.1,
                   "train/grpo/new_logp": -2.0, "train/grpo/ratio": 1.0, "train/z_loss/lse": 5.5, "train/lr": 1e-3,
                   "train/grad_norm": 0.5, "train/tokens_per_second": 900.0 + step, "train/step": float(step),
                   "train/skipped_steps": 0.0, "train/rl/warmup": 0.0, "train/rl/rollouts": float(step),
                   "train/timing/rollout_seconds": 0.2, "train/timing/train_seconds": 0.1})
    return record


def test_every_logged_series_is_drawn(tmp_path: Path) -> None:
    """tokens/s, timing, advantages, lengths and logp_diff get panels of their own (the README promises them);
    every other numeric series is drawn too; only bookkeeping keys are not."""
    records = [_rl_record(step) for step in range(1, 5)]
    panels = plot_metrics.panels_of(records)
    drawn = {key for found in panels.values() for key in found}
    logged = {key for key, value in records[0].items() if isinstance(value, float)}
    print(sorted(panels))
    assert logged - drawn == {"time", "train/step", "train/rl/warmup", "train/rl/rollouts", "train/skipped_steps",
                              "train/rewards/exact/none_count"}
    assert panels["tokens/s"].keys() == {"train/tokens_per_second"}
    assert panels["seconds per step (timing)"].keys() == {"train/timing/rollout_seconds", "train/timing/train_seconds"}
    assert panels["advantages"].keys() == {"train/advantage/std", "train/advantage/min", "train/advantage/max"}
    assert panels["completion length (tokens)"].keys() == {f"train/completions/{k}_length" for k in ("mean", "min", "max")}
    assert panels["sampler vs trainer log-prob gap (logp_diff)"].keys() == {"train/sampling/logp_diff/mean",
                                                                            "train/sampling/logp_diff/max"}
    assert {"train/grpo/new_logp", "train/z_loss/lse"} <= set(panels)  # a child's own metrics: a panel each
    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_metrics.main([str(run_dir)]) == 0 and (run_dir / "metrics.png").stat().st_size > 20000
