"""A tiny, fast run config factory shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fastlm.run_config.schema import RunConfig


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


@pytest.fixture
def tiny_config(tmp_path: Path) -> Callable[..., RunConfig]:
    """`tiny_config(name, **sections)`: 1-layer hidden-32 llama on 200 generated docs, seq_len 32, no wandb."""

    def make(name: str = "tiny", **sections: dict[str, Any]) -> RunConfig:
        base = {
            "run": {"name": name, "output_dir": str(tmp_path / "{name}"), "seed": 0},
            "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32},
            "data": {"source": {"type": "generated", "num_documents": 200}, "seq_len": 32, "micro_batch_size": 4},
            "optimizer": {"lr": 1e-2},
            "schedule": {"warmup_steps": 2},
            "trainer": {"steps": 6, "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "eval_batches": 2},
            "logging": {"wandb": {"enabled": False}, "progress": False},
        }
        return RunConfig.model_validate(_merge(base, sections))

    return make
