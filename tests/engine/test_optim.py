"""Optimizer groups (no decay on 1-D params) and the warmup + decay schedule."""

from __future__ import annotations

import math

import pytest
import torch

from fastlm.engine.config import OptimizerConfig, ScheduleConfig
from fastlm.engine.optim import build_optimizer, build_scheduler, clip_divisor, lr_multiplier, step_unless
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


def _adamw(parameters: list[torch.nn.Parameter], fused: bool | None) -> torch.optim.AdamW:
    return torch.optim.AdamW(parameters, lr=0.05, weight_decay=0.1, fused=fused)


def test_fused_update_clips_and_skips_like_the_float64_reference() -> None:
    """`step_unless` with a clip divisor (the fused kernel divides the gradients) against float64 AdamW after
    torch's clip_grad_norm_, three steps, clipping active; a skipped step leaves weights, moments and the
    step count as they were."""
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    fast = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.double()) for t in start]
    fused, slow = _adamw(fast, fused=True), _adamw(reference, fused=False)
    for _ in range(3):
        grads = [10 * torch.randn_like(t) for t in start]
        for p, g in zip(fast, grads):
            p.grad = g.clone()
        for p, g in zip(reference, grads):
            p.grad = g.double()
        norm = torch.nn.utils.get_total_norm([p.grad for p in fast])
        step_unless(fused, torch.tensor(False), clip_divisor(norm, 1.0))
        expected_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
        slow.step()
        assert expected_norm > 1.0  # clipping is active
    error = max(float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max()) for a, b in zip(fast, reference))
    print(f"fused clipped AdamW vs float64 reference after 3 steps: max rel err {error:.1e}")
    assert error < 1e-5
    before = [p.detach().clone() for p in fast]
    moments = [fused.state[p]["exp_avg"].clone() for p in fast]
    for p in fast:
        p.grad = torch.randn_like(p)
    step_unless(fused, torch.tensor(True), clip_divisor(torch.tensor(5.0), 1.0))
    assert all(torch.equal(a, b) for a, b in zip(fast, before))
    assert all(torch.equal(fused.state[p]["exp_avg"], m) for p, m in zip(fast, moments))
    assert all(float(fused.state[p]["step"]) == 3 for p in fast)
    assert not hasattr(fused, "found_inf") and not hasattr(fused, "grad_scale")


def test_unfused_update_reads_the_skip_flag_and_takes_no_divisor() -> None:
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = _adamw([parameter], fused=False)
    parameter.grad = torch.ones(3)
    step_unless(optimizer, torch.tensor(True))
    assert torch.equal(parameter, torch.ones(3)) and not optimizer.state
    step_unless(optimizer, torch.tensor(False))
    assert not torch.equal(parameter, torch.ones(3))
    with pytest.raises(ValueError, match="only fused AdamW divides the gradients"):
        step_unless(optimizer, torch.tensor(False), torch.tensor(2.0))
