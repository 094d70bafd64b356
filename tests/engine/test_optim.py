"""Optimizer groups (no decay on 1-D params) and the warmup + decay schedule."""

from __future__ import annotations

import math

import pytest
import torch

from fastlm.engine.config import OptimizerConfig, ScheduleConfig
from fastlm.engine.optim import build_optimizer, build_scheduler, lr_multiplier
from fastlm.models.config import GPT2Config
from fastlm.models.decoder import build_model


def test_no_weight_decay_on_norms_and_biases() -> None:
    model = build_model(GPT2Config(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=16))
    optimizer = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied counted once


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedule_shape(decay: str) -> None:
    config = ScheduleConfig(warmup_steps=4, decay=decay, min_lr_ratio=0.1)
    values = [lr_multiplier(step, 20, config) for step in range(21)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == 1.0
    expected_end = 1.0 if decay == "constant" else 0.1
    assert math.isclose(values[20], expected_end)
    assert all(a >= b - 1e-12 for a, b in zip(values[4:], values[5:]))
    if decay == "cosine":
        assert math.isclose(values[12], 0.1 + 0.9 * 0.5)  # halfway through the decay


def test_scheduler_drives_optimizer_lr() -> None:
    parameter = torch.nn.Parameter(torch.randn(3, 3))
    optimizer = torch.optim.AdamW([parameter], lr=0.01)
    scheduler = build_scheduler(optimizer, 10, ScheduleConfig(warmup_steps=2, decay="linear", min_lr_ratio=0.0))
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:3] == pytest.approx([0.005, 0.01, 0.01])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
