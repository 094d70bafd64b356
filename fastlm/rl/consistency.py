"""Sampler-vs-trainer log-prob consistency: the gap between the sampler's own log-probs and the training
forward's, the rollout corrections for what remains of it, and their diagnostics.

Training trains the sampling distribution (the head's transform divided by the temperature, see
`tempered_transform`), so the remaining gap is top-k/top-p truncation plus numerics (bf16 replica and
cache vs the packed training forward). With d_t = train_logp_t - sampler_logp_t on a completion token,
r_t = exp(d_t), a completion's R = exp(sum_t d_t) and G = exp(mean_t d_t), `rl.importance_sampling.mode`
weighs every token's loss by (docs/losses.md, "Rollout corrections", gives the sources), with c = `cap` and
b = `cap_min` (TRL's vllm_importance_sampling_clip_min; unset: no lower bound, 1/c for the two-sided modes):

    token_truncate       w_t = clamp(r_t, b, c)                 (TRL token_truncate, verl token/truncate)
    sequence_truncate    w_t = clamp(R, b, c)                   (TRL sequence_truncate)
    token_mask           w_t = r_t if b <= r_t <= c else 0      (TRL token_mask: masked IS)
    sequence_mask        w_t = R if b <= R <= c else 0          (TRL sequence_mask)
    icepop               w_t = r_t if b <= r_t <= c else 0      (IcePop's [alpha, beta]; verl token/mask)
    sequence_geometric   w_t = G if b <= G <= c else 0          (verl geometric/mask)

The weight is computed before the head from the first update's old log-probs (the training forward of the
packed rollout). Every policy child's token loss is linear in the advantage for w >= 0, so w is folded into
the advantages and goes through whichever head path runs (chunked, compiled, Triton) unchanged. Masked
tokens keep their place in the loss normaliser (TRL and prime-rl do the same).

`mismatch_kl_coeff` k adds prime-rl's k * (new_logp - sampler_logp)^2 per token. Its gradient is
2k (new - sampler) d new; the policy term's is -A r d new (r = exp(new - old), unclipped at r = 1). On the
first update of a rollout new = old (the same weights computed old_logp), r = 1 and no clip is active,
so the KL is exactly an advantage shift A' = w A - 2k (old - sampler) / s, folded here before the head,
where s is the policy term's slope per unit of advantage at r = 1 (`PolicyConfig.first_update_slope`: 1,
or CISPO's min(1, eps_high), which multiplies the whole folded advantage). On a later update new != old
and the two differ (the KL keeps pulling toward the sampler with its own slope, and acts on clipped
tokens too): the option therefore needs rl.updates_per_rollout: 1 and a token-level policy child (grpo or
cispo; GSPO mixes tokens through its sequence ratio) that trains every token (`top_entropy_quantile` < 1
zeroes the policy term, and with it the folded KL, on the tokens it leaves out), all checked at validation.
"""

from __future__ import annotations

import torch

from fastlm.data.batch import Batch
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.rl.config import ImportanceSamplingConfig

SEQUENCE_MODES = ("sequence_truncate", "sequence_mask", "sequence_geometric")


def tempered_transform(logit_scale: float, softcap: float | None, temperature: float) -> tuple[float, float | None]:
    """(scale, softcap) whose transform equals the head's transform divided by `temperature`:
    c*tanh(s*z/c) / T = (c/T) * tanh((s/T)*z / (c/T)). Temperature 0 (greedy) leaves it as is."""
    if temperature in (0.0, 1.0):
        return logit_scale, softcap
    return logit_scale / temperature, None if softcap is None else softcap / temperature


def _per_document(values: torch.Tensor, documents: torch.Tensor, mean_over: torch.Tensor | None) -> torch.Tensor:
    """Each token's document sum of `values` (or mean over the `mean_over` tokens), broadcast back (float64)."""
    flat = documents.reshape(-1)
    size = int(flat.max()) + 1
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, values.reshape(-1))
    if mean_over is not None:
        counts = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, mean_over.reshape(-1).double())
        sums = sums / counts.clamp_min(1.0)
    return sums[flat].reshape(values.shape)


def mode_ratio(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
               config: ImportanceSamplingConfig) -> torch.Tensor:
    """(B, S) float64 ratio the mode bounds, per token: r_t, its completion's R, or G (1 on masked tokens)."""
    mask = batch.labels != IGNORE_INDEX
    log_ratio = (train_logp.double() - sampler_logp.double()).masked_fill(~mask, 0.0)
    if config.mode in SEQUENCE_MODES:
        log_ratio = _per_document(log_ratio, batch.document_ids, mask if config.mode == "sequence_geometric" else None)
    return log_ratio.exp()


def importance_weights(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                       config: ImportanceSamplingConfig) -> torch.Tensor | None:
    """(B, S) correction weights on the labels (1 elsewhere), or None when the mode is 'none'."""
    if config.mode == "none":
        return None
    mask = batch.labels != IGNORE_INDEX
    ratio = mode_ratio(batch, train_logp, sampler_logp, config)
    low, cap = config.bounds()
    if config.mode.endswith("_truncate"):
        weights = ratio.clamp(min=low, max=cap)
    else:
        keep = ratio <= cap
        if low is not None:
            keep &= ratio >= low
        weights = torch.where(keep, ratio, torch.zeros_like(ratio))  # an inf ratio is masked, never inf * 0
    return torch.where(mask, weights, torch.ones_like(weights)).float()


def corrected_advantages(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                         config: ImportanceSamplingConfig, weights: torch.Tensor | None,
                         policy_slope: float = 1.0) -> torch.Tensor:
    """The advantages the head trains on: w * A, minus 2k (train - sampler) / `policy_slope` with the
    mismatch KL (the policy child's `first_update_slope`; see the module docstring for why that is the KL's
    exact gradient on the only update it is allowed with)."""
    assert batch.advantages is not None
    advantages = batch.advantages if weights is None else batch.advantages * weights
    if config.mismatch_kl_coeff > 0:
        mask = batch.labels != IGNORE_INDEX
        gap = (train_logp - sampler_logp).masked_fill(~mask, 0.0)
        advantages = advantages - (2.0 * config.mismatch_kl_coeff / policy_slope) * gap
    return advantages


def gap_statistics(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                   weights: torch.Tensor | None, config: ImportanceSamplingConfig) -> torch.Tensor:
    """[sum |d|, tokens, max |d|, sum w, min w, max w, sum e, sum e^2, sum k3, masked tokens, sum k1] over
    this batch's labels (float64); d = train - sampler, k3 = e^d - d - 1 and k1 = -d (the mismatch KL
    estimates of KL(sampler || train)), w the applied weights (1 without), e the mode's ratio clamped to
    [1/cap, cap] (verl's weights of its effective sample size; 1 without a mode)."""
    mask = batch.labels != IGNORE_INDEX
    gap = (train_logp - sampler_logp)[mask].double()
    if not gap.numel():
        return torch.tensor([0.0, 0.0, 0.0, 0.0, float("inf"), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    picked = weights[mask].double() if weights is not None else torch.ones_like(gap)
    ess = torch.ones_like(gap)
    if config.mode != "none":
        ess = mode_ratio(batch, train_logp, sampler_logp, config)[mask].clamp(1.0 / config.cap, config.cap)
    count = torch.tensor(float(gap.numel()), dtype=torch.float64)
    return torch.stack([gap.abs().sum(), count, gap.abs().max(), picked.sum(), picked.min(), picked.max(),
                        ess.sum(), ess.square().sum(), (torch.expm1(gap) - gap).sum(), (picked == 0).sum().double(),
                        -gap.sum()])


def gap_metrics(statistics: torch.Tensor, with_weights: bool) -> dict[str, float]:
    """(n, 11) `gap_statistics` rows (batches, all dp ranks) -> sampling/* metrics (without the train/ prefix).

    Under verl's names and definitions (its rollout-correction metrics, over the completion tokens):
    mismatch_kl is k1, the mean of sampler_logp - train_logp, and mismatch_k3_kl the mean of k3; ess is
    rollout_is_eff_sample_size, (sum e)^2 / (N sum e^2) in (0, 1] of the mode's ratios clamped to [1/cap, cap]
    before any masking (so not of the applied weights, whose masked zeros it leaves out). importance_ratio/*
    are of the applied weights, masked_fraction the share of tokens a mask mode zeroed."""
    count = max(float(statistics[:, 1].sum()), 1.0)
    metrics = {
        "sampling/logp_diff/mean": float(statistics[:, 0].sum()) / count,
        "sampling/logp_diff/max": float(statistics[:, 2].max()),
        "sampling/mismatch_kl": float(statistics[:, 10].sum()) / count,
        "sampling/mismatch_k3_kl": float(statistics[:, 8].sum()) / count,
    }
    if with_weights:
        total, clamped, squares = (float(statistics[:, column].sum()) for column in (3, 6, 7))
        metrics["sampling/importance_ratio/mean"] = total / count
        metrics["sampling/importance_ratio/min"] = float(statistics[:, 4].min())
        metrics["sampling/importance_ratio/max"] = float(statistics[:, 5].max())
        metrics["sampling/ess"] = clamped * clamped / (count * squares) if squares > 0 else 0.0
        metrics["sampling/masked_fraction"] = float(statistics[:, 9].sum()) / count
    return metrics
