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
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/tokens_per_second": 900.0}) + "\n")
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
