"""Rollout corrections against their float64 formulas, on the compiled path and the fused Triton kernel.

Each mode's weight is written here from its formula (a Python loop over tokens and completions), the head's
float64 reference (autograd) gets A * w, and both fast paths get the advantages `corrected_advantages`
builds: loss and gradient must agree. The mismatch KL is checked the same way on its only allowed update
(new = old): the reference adds k * w_t * (new - sampler)^2 by autograd, the fast paths see the shifted
advantages, and the gradients agree. Without CUDA the kernel runs on Triton's interpreter (tiny shapes).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from fastlm.data.batch import batch_from_rows
from fastlm.losses.children import GRPO, CISPOConfig, GRPOConfig
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.reference import reference_loss
from fastlm.losses.spec import (
    IGNORE_INDEX,
    LossNormalizers,
    LossSpec,
    LossTargets,
    label_logp,
)
from fastlm.losses.triton import triton_loss
from fastlm.rl.config import ImportanceSamplingConfig
from fastlm.rl.consistency import (
    corrected_advantages,
    gap_metrics,
    gap_statistics,
    importance_weights,
)

VOCAB = 29
MODES = {"token_truncate": 1.3, "sequence_truncate": 1.5, "token_mask": 1.3, "sequence_mask": 1.5, "icepop": 1.3,
         "sequence_geometric": 1.08}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(seed: int):
    """Two packed rows of three completions each (prompts masked), logits, old and sampler log-probs."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB, (2, 15), generator=generator)
    documents = torch.tensor([[0] * 3 + [1] * 6 + [2] * 6, [0] * 5 + [1] * 5 + [2] * 5])
    targets = torch.ones_like(rows, dtype=torch.bool)
    targets[:, [0, 1, 3, 4, 9, 10]] = False  # each document's first tokens are its prompt
    batch = batch_from_rows(rows, documents, targets)
    logits = torch.randn(batch.labels.numel(), VOCAB, generator=generator, dtype=torch.float64).mul(2.0).float()
    labels = batch.labels.reshape(-1)
    new = label_logp(logits.double(), labels, 1.0, None)
    old = (new + 0.15 * torch.randn(new.shape, generator=generator, dtype=torch.float64)).float()
    sampler = (old.double() + 0.35 * torch.randn(new.shape, generator=generator, dtype=torch.float64)).float()
    mask = labels != IGNORE_INDEX
    old, sampler = old.masked_fill(~mask, 0.0), sampler.masked_fill(~mask, 0.0)
    batch.advantages = torch.randn(batch.labels.shape, generator=generator).masked_fill(~mask.view_as(batch.labels), 0.0)
    return batch, logits, old.view_as(batch.labels), sampler.view_as(batch.labels)


def formula_weights(mode: str, cap: float, batch, old: torch.Tensor, sampler: torch.Tensor) -> torch.Tensor:
    """The mode's w_t straight from its definition (docs/losses.md), in float64, 1 on masked tokens."""
    labels, docs = batch.labels.reshape(-1).tolist(), batch.document_ids.reshape(-1).tolist()
    gaps = (old.double() - sampler.double()).reshape(-1).tolist()
    per_doc: dict[int, list[float]] = {}
    for label, doc, gap in zip(labels, docs, gaps):
        if label != IGNORE_INDEX:
            per_doc.setdefault(doc, []).append(gap)
    weights = []
    for label, doc, gap in zip(labels, docs, gaps):
        if label == IGNORE_INDEX:
            weights.append(1.0)
            continue
        token, sequence = math.exp(gap), math.exp(sum(per_doc[doc]))
        geometric = math.exp(sum(per_doc[doc]) / len(per_doc[doc]))
        weights.append({
            "token_truncate": min(token, cap),
            "sequence_truncate": min(sequence, cap),
            "token_mask": token if token <= cap else 0.0,
            "sequence_mask": sequence if sequence <= cap else 0.0,
            "icepop": token if 1 / cap <= token <= cap else 0.0,
            "sequence_geometric": geometric if 1 / cap <= geometric <= cap else 0.0,
        }[mode])
    return torch.tensor(weights, dtype=torch.float64)


def _targets(batch, old: torch.Tensor, advantages: torch.Tensor) -> LossTargets:
    return LossTargets(batch.labels.reshape(-1), old.reshape(-1), advantages.reshape(-1), batch.document_ids.reshape(-1))


def _normalizers(batch) -> LossNormalizers:
    mask = batch.labels != IGNORE_INDEX
    return LossNormalizers(float(mask.sum()), float(batch.document_ids[mask].unique().numel()))


def _fast_paths(logits, targets, normalizers, spec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    runs = {"compiled": compiled_loss(logits, targets, normalizers, spec)}
    on = LossTargets(*(t.to(DEVICE) for t in (targets.labels, targets.old_logp, targets.advantages,
                                               targets.document_ids)))
    for name, block in (("triton single", 64), ("triton looped", 16)):
        runs[name] = triton_loss(logits.to(DEVICE), on, normalizers, spec, max_block=block)
    return {path: (result.loss.detach().cpu(), grad.cpu()) for path, (result, grad) in runs.items()}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-12))


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_its_formula_on_every_path(mode: str) -> None:
    batch, logits, old, sampler = _case(len(mode))
    config = ImportanceSamplingConfig(mode=mode, cap=MODES[mode])
    weights = importance_weights(batch, old, sampler, config)
    want = formula_weights(mode, config.cap, batch, old, sampler)
    assert _rel(weights.reshape(-1), want) < 1e-6
    mask = batch.labels.reshape(-1) != IGNORE_INDEX
    if mode.endswith("mask") or mode in ("icepop", "sequence_geometric"):
        assert 0 < int((want[mask] == 0).sum()) < int(mask.sum()), "the case should mask some tokens, not all"
    spec = LossSpec((GRPO("grpo", 1.0, eps_low=0.2, eps_high=0.25),))
    normalizers = _normalizers(batch)
    leaf = logits.double().requires_grad_(True)
    reference = reference_loss(leaf, LossTargets(batch.labels.reshape(-1), old.reshape(-1).double(),
                                                 batch.advantages.reshape(-1).double() * want,
                                                 batch.document_ids.reshape(-1)), normalizers, spec).loss
    reference.backward()
    advantages = corrected_advantages(batch, old, sampler, config, weights)
    for path, (loss, grad) in _fast_paths(logits, _targets(batch, old, advantages), normalizers, spec).items():
        errors = (_rel(loss, reference.detach()), _rel(grad, leaf.grad))
        print(f"{mode} / {path}: loss {errors[0]:.1e}, grad {errors[1]:.1e}")
        assert max(errors) < 1e-5, (path, errors)


POLICIES = {"grpo": GRPOConfig(eps_low=0.2, eps_high=0.25), "cispo": CISPOConfig(eps_high=1.3),
            "cispo cap below 1": CISPOConfig(eps_high=0.8)}  # min(r, cap) = cap at r = 1: the fold divides by it


@pytest.mark.parametrize("child", list(POLICIES))
def test_mismatch_kl_is_the_log_square_gradient_on_the_first_update(child: str) -> None:
    batch, logits, _, sampler = _case(7)
    labels = batch.labels.reshape(-1)
    new = label_logp(logits.double(), labels, 1.0, None).masked_fill(labels == IGNORE_INDEX, 0.0)
    old = new.float().view_as(batch.labels)  # the first update: the weights that computed old_logp
    config = ImportanceSamplingConfig(mode="icepop", cap=1.3, mismatch_kl_coeff=0.3)
    weights = importance_weights(batch, old, sampler, config)
    spec = LossSpec((POLICIES[child].to_child(child),))
    normalizers = _normalizers(batch)
    mask = labels != IGNORE_INDEX
    leaf = logits.double().requires_grad_(True)
    w = formula_weights("icepop", 1.3, batch, old, sampler)
    policy_loss = reference_loss(leaf, LossTargets(labels, old.reshape(-1).double(), batch.advantages.reshape(-1).double()
                                                   * w, batch.document_ids.reshape(-1)), normalizers, spec).loss
    new_logp = torch.log_softmax(leaf, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    log_ratio = (new_logp - sampler.reshape(-1).double())[mask]
    (policy_loss + config.mismatch_kl_coeff * log_ratio.square().sum() / normalizers.tokens).backward()
    advantages = corrected_advantages(batch, old, sampler, config, weights, POLICIES[child].first_update_slope())
    for path, (_, grad) in _fast_paths(logits, _targets(batch, old, advantages), normalizers, spec).items():
        error = _rel(grad, leaf.grad)
        print(f"mismatch kl {child} / {path}: grad {error:.1e}")
        assert error < 1e-5, (path, error)


def test_diagnostics_follow_their_definitions() -> None:
    batch, _, old, sampler = _case(3)
    config = ImportanceSamplingConfig(mode="icepop", cap=1.3)
    weights = importance_weights(batch, old, sampler, config)
    halves = [slice(0, 1), slice(1, 2)]  # two micro-batches, reduced like two dp ranks
    rows = torch.stack([gap_statistics(_rows(batch, part), old[part], sampler[part], weights[part]) for part in halves])
    metrics = gap_metrics(rows, with_weights=True)
    mask = batch.labels != IGNORE_INDEX
    gap, w = (old - sampler)[mask].double(), weights[mask].double()
    assert metrics["sampling/mismatch_kl"] == pytest.approx(float((gap.exp() - gap - 1).mean()), rel=1e-9)
    assert metrics["sampling/ess"] == pytest.approx(float(w.sum() ** 2 / (w.numel() * w.square().sum())), rel=1e-9)
    assert metrics["sampling/masked_fraction"] == pytest.approx(float((w == 0).double().mean()))
    assert metrics["sampling/logp_diff/max"] == pytest.approx(float(gap.abs().max()))
    assert 0.0 < metrics["sampling/ess"] < 1.0 and metrics["sampling/masked_fraction"] > 0


def _rows(batch, part: slice):
    from fastlm.data.batch import Batch

    return Batch(batch.input_ids[part], batch.labels[part], batch.document_ids[part])


def test_config_rejects_what_would_be_wrong() -> None:
    from pydantic import ValidationError

    from fastlm.rl.config import RLConfig

    with pytest.raises(ValidationError, match="cap must be > 1"):
        ImportanceSamplingConfig(mode="icepop", cap=0.8)
    with pytest.raises(ValidationError, match="updates_per_rollout: 1"):
        RLConfig(importance_sampling={"mismatch_kl_coeff": 0.1}, updates_per_rollout=2)
    assert RLConfig(importance_sampling={"mismatch_kl_coeff": 0.1}, updates_per_rollout=1)
