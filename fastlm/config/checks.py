"""Checks that span several sections (each section validates itself; these need the whole run)."""

from __future__ import annotations

from fastlm.config.errors import ConfigIssue
from fastlm.config.schema import RunConfig

BYTE_VOCAB_SIZE = 260


def cross_check(config: RunConfig) -> list[ConfigIssue]:
    """Problems that no single section can see; each names the field to change."""
    issues: list[ConfigIssue] = []
    model = config.model
    if model.vocab_size < BYTE_VOCAB_SIZE:
        issues.append(ConfigIssue("model.vocab_size", f"smaller than the byte tokenizer's {BYTE_VOCAB_SIZE} ids",
                                  model.vocab_size, hint=f"use at least {BYTE_VOCAB_SIZE}"))
    if config.data.seq_len > model.max_seq_len:
        issues.append(ConfigIssue("data.seq_len", f"longer than model.max_seq_len ({model.max_seq_len})",
                                  config.data.seq_len, hint="lower data.seq_len or raise model.max_seq_len"))
    tp = config.distributed.tensor_parallel
    if model.vocab_size % tp:
        issues.append(ConfigIssue("distributed.tensor_parallel", f"does not divide model.vocab_size ({model.vocab_size})",
                                  tp, hint="pick a tensor_parallel that divides the vocab (pad the vocab if needed)"))
    return issues
