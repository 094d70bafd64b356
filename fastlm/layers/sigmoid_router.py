"""DeepSeek-V3's router (`noaux_tc`) on the dropless experts of `MoEMLP`: sigmoid scores; the choice adds a
per-expert correction bias (`e_score_correction_bias`, balancing without an auxiliary loss: a buffer, kept
as loaded here, not updated by training) and is limited to the `topk_group` best of `n_group` expert groups
(a group's score: the sum of its two best biased scores); the chosen experts' weights are their unbiased
scores, renormalised (`normalize_top_k`) and times `routed_scaling_factor`. As transformers'
`DeepseekV3TopkRouter`, operation for operation, in fp32 (fp64 for fp64 inputs)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fastlm.layers.moe import MoEMLP, Routing, replayed


class SigmoidRouterMoE(MoEMLP):
    """`MoEMLP` routed by sigmoid scores, the correction bias and group-limited top-k (see the module docstring)."""

    def __init__(self, *args: Any, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{self.num_experts} experts do not split into {n_group} groups of which {topk_group} "
                             "are kept")
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)

    def route(self, flat: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        dtype = torch.promote_types(flat.dtype, torch.float32)
        with torch.autocast(flat.device.type, enabled=False):
            logits = F.linear(flat.to(dtype), self.router.weight.to(dtype))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.to(dtype)
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
        expert_mask = group_mask.unsqueeze(-1).expand_as(groups).reshape(-1, self.num_experts)
        experts = torch.topk(choice.masked_fill(~expert_mask.bool(), float("-inf")), k=self.top_k, dim=-1,
                             sorted=False)[1]
        experts = replayed(experts, replay)  # routing replay: the recorded selection, the current scores
        weights = scores.gather(1, experts)
        if self.normalize_top_k:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(logits, scores, weights * self.routed_scaling_factor, experts)

    def reset_parameters(self, std: float, residual_std: float) -> None:
        super().reset_parameters(std, residual_std)
        torch.nn.init.zeros_(self.e_score_correction_bias)
