"""Sampler-vs-trainer log-prob consistency: the gap between the sampler's own log-probs and the training
forward's, and TRL's truncated importance-sampling correction for what remains of it.

Training trains the sampling distribution (the head's transform divided by the temperature, see
`tempered_transform`), so the remaining gap is top-k/top-p truncation plus numerics (bf16 replica and
cache vs the packed training forward). The correction weights every token's loss by
w = min(exp(train_logp - sampler_logp), cap), per token or with the completion's summed log-ratio; since the
GRPO/GSPO token loss is linear in the advantage for w > 0, the weight is folded into the advantages.
"""

from __future__ import annotations

import torch

from fastlm.data.batch import Batch
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.rl.config import ImportanceSamplingConfig


def tempered_transform(logit_scale: float, softcap: float | None, temperature: float) -> tuple[float, float | None]:
    """(scale, softcap) whose transform equals the head's transform divided by `temperature`:
    c*tanh(s*z/c) / T = (c/T) * tanh((s/T)*z / (c/T)). Temperature 0 (greedy) leaves it as is."""
    if temperature in (0.0, 1.0):
        return logit_scale, softcap
    return logit_scale / temperature, None if softcap is None else softcap / temperature


def importance_weights(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                       config: ImportanceSamplingConfig) -> torch.Tensor | None:
    """(B, S) truncated importance weights on the labels (1 elsewhere), or None when the mode is 'none'."""
    if config.mode == "none":
        return None
    mask = batch.labels != IGNORE_INDEX
    log_ratio = (train_logp - sampler_logp).masked_fill(~mask, 0.0).double()
    if config.mode == "sequence_truncate":
        documents = batch.document_ids.reshape(-1)
        sums = torch.zeros(int(documents.max()) + 1, dtype=torch.float64).index_add_(0, documents, log_ratio.reshape(-1))
        log_ratio = sums[documents].reshape(log_ratio.shape)
    weights = log_ratio.exp().clamp_max(config.cap).float()
    return torch.where(mask, weights, torch.ones_like(weights))


def gap_statistics(batch: Batch, train_logp: torch.Tensor, sampler_logp: torch.Tensor,
                   weights: torch.Tensor | None) -> torch.Tensor:
    """[sum |gap|, token count, max |gap|, sum w, min w, max w] over this batch's labels (float64)."""
    mask = batch.labels != IGNORE_INDEX
    gap = (train_logp - sampler_logp)[mask].abs().double()
    picked = weights[mask].double() if weights is not None else torch.ones_like(gap)
    if not gap.numel():
        return torch.tensor([0.0, 0.0, 0.0, 0.0, float("inf"), 0.0], dtype=torch.float64)
    return torch.stack([gap.sum(), torch.tensor(float(gap.numel()), dtype=torch.float64), gap.max(),
                        picked.sum(), picked.min(), picked.max()])


def gap_metrics(statistics: torch.Tensor, with_weights: bool) -> dict[str, float]:
    """(n, 6) `gap_statistics` rows (batches, all dp ranks) -> sampling/* metrics (without the train/ prefix)."""
    count = float(statistics[:, 1].sum())
    metrics = {
        "sampling/logp_diff/mean": float(statistics[:, 0].sum()) / max(count, 1.0),
        "sampling/logp_diff/max": float(statistics[:, 2].max()),
    }
    if with_weights:
        metrics["sampling/importance_ratio/mean"] = float(statistics[:, 3].sum()) / max(count, 1.0)
        metrics["sampling/importance_ratio/min"] = float(statistics[:, 4].min())
        metrics["sampling/importance_ratio/max"] = float(statistics[:, 5].max())
    return metrics
