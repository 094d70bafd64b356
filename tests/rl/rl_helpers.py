"""Tiny models and float64 references shared by the RL tests."""

from __future__ import annotations

import copy

import torch

from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import DecoderLM, build_model


def tiny_model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=48, init_std=0.2)
    return build_model(config)


def reference_logprobs(model: DecoderLM, sequence: list[int], start: int, scale: float = 1.0,
                       softcap: float | None = None) -> torch.Tensor:
    """float64 log-probs of sequence[start:] given everything before, from one unpacked forward."""
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = model64.logits(torch.tensor([sequence])).squeeze(0) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(sequence[start:])
    return logp[start - 1 : len(sequence) - 1].gather(1, targets[:, None]).squeeze(1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))
