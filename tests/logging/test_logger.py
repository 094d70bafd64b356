"""MetricLogger: JSONL records, wandb offline run matching the JSONL, disabled wandb, rank gating, mode rules."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from wandb_reader import read_wandb_run

from fastlm.logging.config import LoggingConfig, WandbConfig
from fastlm.logging.jsonl import read_metrics
from fastlm.logging.logger import MetricLogger
from fastlm.logging.progress import ProgressLine
from fastlm.logging.wandb_sink import resolve_mode

STEPS = [{"train/loss": 5.5 - i, "train/lr": 1e-3 * (i + 1), "train/tokens_per_second": 100.0 * i} for i in range(3)]


def _log_all(logger: MetricLogger) -> None:
    with logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(step, metrics)


def test_jsonl_and_wandb_offline_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = LoggingConfig(wandb=WandbConfig(project="t", tags=["a"]), progress=False)
    logger = MetricLogger(config, tmp_path, "unit", total_steps=3, run_config={"loss_implementation": "x"}, rank=0)
    assert logger.wandb is not None and logger.wandb.mode == "offline"
    _log_all(logger)

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(isinstance(r["time"], float) for r in records)
    assert [{k: r[k] for k in STEPS[0]} for r in records] == STEPS

    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    history, wandb_config = read_wandb_run(run_files[0])
    assert [{k: r[k] for k in STEPS[0]} | {"step": r["step"]} for r in history] == [
        {k: r[k] for k in STEPS[0]} | {"step": r["step"]} for r in records
    ]
    assert wandb_config["loss_implementation"] == "x"


def test_wandb_disabled_writes_no_wandb_dir(tmp_path: Path) -> None:
    config = LoggingConfig(wandb=WandbConfig(enabled=False), progress=False)
    _log_all(MetricLogger(config, tmp_path, "unit", total_steps=3, rank=0))
    assert not (tmp_path / "wandb").exists()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    config = LoggingConfig(wandb=WandbConfig(enabled=False), progress=False)
    _log_all(MetricLogger(config, tmp_path, "unit", total_steps=3, rank=1))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_init_failure_keeps_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # wandb rejects it at init
    config = LoggingConfig(progress=False)
    with pytest.warns(RuntimeWarning, match="wandb init failed"):
        logger = MetricLogger(config, tmp_path, "unit", total_steps=3, rank=0)
    _log_all(logger)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_nonfinite_values_stay_strict_json(tmp_path: Path) -> None:
    config = LoggingConfig(wandb=WandbConfig(enabled=False), progress=False)
    with MetricLogger(config, tmp_path, "unit", total_steps=1, rank=0) as logger:
        logger.log(1, {"train/loss": math.nan})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line)["train/loss"] is None


def test_nonfinite_values_in_a_table_stay_strict_json_and_reach_wandb(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward function that returns None gives a NaN reward in the completions table: the JSONL row holds
    null (as a scalar does), wandb's table gets the NaN as wandb writes it, and the run goes on."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = LoggingConfig(wandb=WandbConfig(project="t"), progress=False)
    rows = [{"completion": "a", "reward": math.nan, "advantage": 0.0}, {"completion": "b", "reward": math.inf,
                                                                           "advantage": -math.inf}]
    with MetricLogger(config, tmp_path, "unit", total_steps=2, rank=0) as logger:
        logger.log(1, {"train/reward": math.inf, "train/completions_table": rows})
        logger.log(2, {"train/reward": 1.0})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["train/reward"] is None and records[1]["train/reward"] == 1.0
    assert records[0]["train/completions_table"] == [{"completion": "a", "reward": None, "advantage": 0.0},
                                                     {"completion": "b", "reward": None, "advantage": None}]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = read_wandb_run(run_file)
    (logged,) = [row for row in history if "train/completions_table/path" in row]
    table = json.loads((run_file.parent / "files" / logged["train/completions_table/path"]).read_text())
    assert table["data"][0][0] == "a" and math.isnan(table["data"][0][1])
    assert table["data"][1][1:] == [math.inf, -math.inf]


def test_mode_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    auto = WandbConfig()
    assert resolve_mode(auto) == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert resolve_mode(auto) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode(auto) == "disabled"
    assert resolve_mode(WandbConfig(mode="offline")) == "offline"


def test_progress_line_plain_stream() -> None:
    stream = io.StringIO()
    progress = ProgressLine(total_steps=3, stream=stream)
    progress.log(2, {"train/loss": 1.23456, "train/lr": 0.001, "train/tokens_per_second": 1234.0})
    progress.log(3, {"other": 1.0})  # nothing to show: no line
    progress.close()
    assert stream.getvalue() == "step 2/3 | loss 1.2346 | lr 1.00e-03 | tok/s 1,234\n"


def test_wandb_log_failure_warns_once_and_keeps_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricLogger(LoggingConfig(progress=False), tmp_path, "unit", total_steps=3, rank=0)
    assert logger.wandb is not None and logger.wandb.active
    logger.wandb._run.finish()  # the run dies under us: wandb refuses further logs
    with pytest.warns(RuntimeWarning, match="wandb log failed") as caught:
        _log_all(logger)
    assert len([w for w in caught if "wandb" in str(w.message)]) == 1
    assert not logger.wandb.active
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3


class _Terminal(io.StringIO):
    """An in-memory stream that reports itself as a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_line_redraws_in_place_on_a_terminal() -> None:
    stream = _Terminal()
    progress = ProgressLine(total_steps=2, stream=stream)
    progress.log(1, {"train/loss": 10.0})
    progress.log(2, {"train/loss": 2.0})
    progress.close()
    assert stream.getvalue() == "\rstep 1/2 | loss 10.0000\rstep 2/2 | loss 2.0000 \n"


def test_progress_line_times_the_run_from_its_first_step() -> None:
    """Elapsed time and ETA from this process's pace: a resume at step 10 of 30 that took 20 s for 10 steps
    has 20 s left (the steps before the resume are not counted in the pace)."""
    stream = io.StringIO()
    now = iter([100.0, 120.0, 3820.0])
    progress = ProgressLine(total_steps=30, stream=stream, timing=True, start_step=10, clock=lambda: next(now))
    progress.log(20, {"train/loss": 1.0, "train/tokens_per_second": 12345.6})
    progress.log(30, {"train/loss": 0.5})
    assert stream.getvalue().splitlines() == [
        "step 20/30 | loss 1.0000 | tok/s 12,346 | 0:20 elapsed, ETA 0:20",
        "step 30/30 | loss 0.5000 | 1:02:00 elapsed, ETA 0:00",
    ]
