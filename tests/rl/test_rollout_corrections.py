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
# case: (mode, cap, cap_min); a cap_min of None is the mode's default (none, or 1/cap for the two-sided ones)
MODES = {"token_truncate": ("token_truncate", 1.3, None), "sequence_truncate": ("sequence_truncate", 1.5, None),
         "token_mask": ("token_mask", 1.3, None), "sequence_mask": ("sequence_mask", 1.5, None),
         "icepop": ("icepop", 1.3, None), "sequence_geometric": ("sequence_geometric", 1.08, None),
         # both bounds given (IcePop's alpha and beta; TRL's clip_min and clip_max): masked and clipped below
         "icepop [0.85, 1.1]": ("icepop", 1.1, 0.85), "token_truncate [0.8, 1.3]": ("token_truncate", 1.3, 0.8)}
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


def formula_weights(mode: str, cap: float, batch, old: torch.Tensor, sampler: torch.Tensor,
                    cap_min: float | None = None) -> torch.Tensor:
    """The mode's w_t straight from its definition (docs/losses.md), in float64, 1 on masked tokens."""
    low = cap_min if cap_min is not None else (1 / cap if mode in ("icepop", "sequence_geometric") else 0.0)
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
            "token_truncate": min(max(token, low), cap),
            "sequence_truncate": min(max(sequence, low), cap),
            "token_mask": token if low <= token <= cap else 0.0,
            "sequence_mask": sequence if low <= sequence <= cap else 0.0,
            "icepop": token if low <= token <= cap else 0.0,
            "sequence_geometric": geometric if low <= geometric <= cap else 0.0,
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


@pytest.mark.parametrize("name", list(MODES))
def test_mode_matches_its_formula_on_every_path(name: str) -> None:
    mode, cap, cap_min = MODES[name]
    batch, logits, old, sampler = _case(len(mode))
    config = ImportanceSamplingConfig(mode=mode, cap=cap, cap_min=cap_min)
    weights = importance_weights(batch, old, sampler, config)
    want = formula_weights(mode, cap, batch, old, sampler, cap_min)
    assert _rel(weights.reshape(-1), want) < 1e-6
    mask = batch.labels.reshape(-1) != IGNORE_INDEX
    if mode.endswith("mask") or mode in ("icepop", "sequence_geometric"):
        assert 0 < int((want[mask] == 0).sum()) < int(mask.sum()), "the case should mask some tokens, not all"
    if cap_min is not None:  # the lower bound acts: some ratio under it is masked or raised
        ratios = formula_weights(mode.replace("mask", "truncate"), math.inf, batch, old, sampler, 0.0)
        assert bool((ratios[mask] < cap_min).any()), "the case should have ratios under cap_min"
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
        print(f"{name} / {path}: loss {errors[0]:.1e}, grad {errors[1]:.1e}")
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


def _verl_ess(ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> float:
    """verl's rollout_is_eff_sample_size (compute_is_metrics), written out: the unmasked ratios clamped to
    [1/cap, cap], normalised by their masked mean, 1 / the masked mean of their squares (its 1e-8 guard left
    out: the mean is at least 1/cap)."""
    clamped = ratio.clamp(min=1.0 / cap, max=cap)
    mean = (clamped * mask).sum() / mask.sum()
    return float(1.0 / (((clamped / mean).square() * mask).sum() / mask.sum()))


@pytest.mark.parametrize("mode", ["icepop", "sequence_mask", "token_truncate"])
def test_diagnostics_follow_verls_definitions(mode: str) -> None:
    """mismatch_kl is verl's k1 (mean sampler - train), mismatch_k3_kl its k3, ess verl's effective sample
    size of the mode's ratios clamped to [1/cap, cap] before masking; two micro-batches reduced like two
    dp ranks, masked prompt tokens included."""
    batch, _, old, sampler = _case(3)
    config = ImportanceSamplingConfig(mode=mode, cap=1.3)
    weights = importance_weights(batch, old, sampler, config)
    halves = [slice(0, 1), slice(1, 2)]
    rows = torch.stack([gap_statistics(_rows(batch, part), old[part], sampler[part], weights[part], config)
                        for part in halves])
    metrics = gap_metrics(rows, with_weights=True)
    mask = batch.labels != IGNORE_INDEX
    gap, w = (old - sampler)[mask].double(), weights[mask].double()
    ratio = formula_weights(mode.replace("mask", "truncate"), math.inf, batch, old, sampler, 0.0)  # the raw ratios
    want_ess = _verl_ess(ratio.view_as(mask), mask.double(), config.cap)
    print(f"{mode}: ess {metrics['sampling/ess']:.6f} (verl {want_ess:.6f}; of the applied weights "
          f"{float(w.sum() ** 2 / (w.numel() * w.square().sum())):.6f}), mismatch_kl {metrics['sampling/mismatch_kl']:.2e}")
    assert metrics["sampling/mismatch_kl"] == pytest.approx(float((sampler.double() - old.double())[mask].mean()), rel=1e-9)
    assert metrics["sampling/mismatch_k3_kl"] == pytest.approx(float((gap.exp() - gap - 1).mean()), rel=1e-9)
    assert metrics["sampling/ess"] == pytest.approx(want_ess, rel=1e-9)
    assert metrics["sampling/masked_fraction"] == pytest.approx(float((w == 0).double().mean()))
    assert metrics["sampling/logp_diff/max"] == pytest.approx(float(gap.abs().max()))
    assert 0.0 < metrics["sampling/ess"] < 1.0


def _rows(batch, part: slice):
    from fastlm.data.batch import Batch

    return Batch(batch.input_ids[part], batch.labels[part], batch.document_ids[part])


def test_config_rejects_what_would_be_wrong() -> None:
    from pydantic import ValidationError

    from fastlm.rl.config import RLConfig

    with pytest.raises(ValidationError, match="cap must be > 1"):
        ImportanceSamplingConfig(mode="icepop", cap=0.8)
    assert ImportanceSamplingConfig(mode="icepop", cap=5.0, cap_min=0.5).bounds() == (0.5, 5.0)  # IcePop's alpha, beta
    assert ImportanceSamplingConfig(mode="icepop", cap=4.0).bounds() == (0.25, 4.0)
    assert ImportanceSamplingConfig(mode="token_mask", cap=4.0).bounds() == (None, 4.0)
    for bad in ({"cap_min": 2.0, "cap": 2.0}, {"cap_min": 0.0}, {"cap_min": float("nan")}, {"cap": float("inf")}):
        with pytest.raises(ValidationError):
            ImportanceSamplingConfig(mode="icepop", **bad)
    with pytest.raises(ValidationError, match="updates_per_rollout: 1"):
        RLConfig(importance_sampling={"mismatch_kl_coeff": 0.1}, updates_per_rollout=2)
    assert RLConfig(importance_sampling={"mismatch_kl_coeff": 0.1}, updates_per_rollout=1)
