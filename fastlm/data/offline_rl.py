"""Offline RL data: prompts, completions, advantages and old log-probs produced elsewhere (PipelineRL style).

One JSON object per line:

    {"prompt": "3+4=", "completion": "7", "advantage": 0.8, "old_logprobs": [-0.1, -0.02]}

Tokens follow the run's tokenizer: the prompt is BOS + its tokens (never a target); the completion is
its tokens + EOS, and `old_logprobs` has one entry per completion token, EOS included (with the byte
tokenizer: len(completion.encode("utf-8")) + 1 values), each the log-prob the sampling policy gave that token.
Every problem is reported with the file and line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastlm.data.datasets import DataError, jsonl_records
from fastlm.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PolicySample:
    """One prompt + completion with its advantage; `old_logp` per completion token (None: recompute it).

    `completion_mask` (None: all) flags the completion tokens that are targets: a multi-turn episode's
    policy tokens, not the environment's replies between them."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    advantage: float
    old_logp: list[float] | None = None
    completion_mask: list[bool] | None = None
    routing: torch.Tensor | None = None  # (prompt + completion, M, k) int16: the sampler's experts (routing replay)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise DataError(f"{where}: missing field '{name}' (keys: {sorted(record)})")
    return record[name]


def parse_record(record: Any, where: str, tokenizer: Tokenizer) -> PolicySample:
    """One JSON value -> PolicySample; `where` ("file line N") prefixes every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt, completion = _field(record, "prompt", where), _field(record, "completion", where)
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    advantage = _field(record, "advantage", where)
    if not _number(advantage):
        raise DataError(f"{where}: field 'advantage' must be a finite number, got {advantage!r}")
    logprobs = _field(record, "old_logprobs", where)
    completion_tokens = tokenizer.encode(completion, eos=True)
    if not isinstance(logprobs, list) or len(logprobs) != len(completion_tokens):
        got = f"{len(logprobs)} values" if isinstance(logprobs, list) else type(logprobs).__name__
        raise DataError(
            f"{where}: field 'old_logprobs' must be a list of {len(completion_tokens)} numbers (the completion's "
            f"{len(completion_tokens) - 1} tokens under the {tokenizer.name} tokenizer + EOS), got {got}"
        )
    for index, value in enumerate(logprobs):
        if not _number(value) or value > 0:
            raise DataError(f"{where}: old_logprobs[{index}] = {value!r} is not a finite log-probability (<= 0)")
    return PolicySample(tokenizer.encode(prompt, bos=True), completion_tokens, float(advantage), [float(v) for v in logprobs])


def load_offline_rl(path: str | Path, tokenizer: Tokenizer) -> list[PolicySample]:
    """Every sample of the file, in order; a clear `DataError` naming file and line on the first problem."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: offline RL data file not found")
    samples = [parse_record(record, f"{path} line {number}", tokenizer) for number, record in jsonl_records(path)]
    if not samples:
        raise DataError(f"{path}: no samples (the file is empty)")
    return samples


def write_offline_rl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """The inverse, for producers and tests: one JSON object per line."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
