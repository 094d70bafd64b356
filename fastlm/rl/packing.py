"""Prompt + completion samples -> packed rows -> Batches with old log-probs and advantages per label.

Each sample is one document (BOS + prompt + completion + EOS) and is never split across rows, so a
GSPO sequence ratio always covers a whole completion. Labels are -100 on the prompt (and on a multi-turn
episode's environment tokens: `PolicySample.completion_mask`); old_logp and the advantage sit on the completion's labels
(the advantage is constant over a completion). Rows hold
seq_len + 1 tokens, shifted into seq_len inputs and labels like every other batch; `batch_from_rows`
renumbers document ids so they are unique across the flattened batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastlm.data.batch import Batch, batch_from_rows
from fastlm.data.datasets import PackedRows
from fastlm.data.loader import BatchLoader
from fastlm.data.offline_rl import PolicySample
from fastlm.losses.chunked_head import chunking
from fastlm.losses.config import DEFAULT_LOGITS_MEMORY_MIB
from fastlm.losses.spec import IGNORE_INDEX, label_logp
from fastlm.models.decoder import DecoderLM
from fastlm.system.device import autocast


@dataclass(frozen=True)
class PolicyRows(PackedRows):
    """PackedRows plus token-aligned floats: entry j is the value for token j as a target (0 elsewhere)."""

    old_logp: torch.Tensor
    advantages: torch.Tensor
    routing: torch.Tensor | None = None  # (rows, seq_len + 1, M, k) int16 experts per token, -1 unrecorded


def _routing_rows(samples: list[PolicySample], layout: list[list[int]], width: int) -> torch.Tensor | None:
    """The samples' recorded experts (routing replay) at their tokens' places in the rows, -1 elsewhere; None
    when no sample carries any."""
    first = next((s.routing for s in samples if s.routing is not None), None)
    if first is None:
        return None
    routing = torch.full((len(layout), width, *first.shape[1:]), -1, dtype=torch.int16)
    for row, members in enumerate(layout):
        start = 0
        for index in members:
            sample = samples[index]
            length = len(sample.prompt_tokens) + len(sample.completion_tokens)
            if sample.routing is not None:
                routing[row, start:start + length] = sample.routing
            start += length
    return routing


def _first_fit_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sample indices per row, in order: a sample goes into the first row with room (no splitting)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if length > width:
            raise ValueError(
                f"sample {index} has {length} tokens (BOS + prompt + completion + EOS) but rows hold "
                f"data.seq_len + 1 = {width}; raise data.seq_len or shorten the prompt / max_new_tokens"
            )
        slot = next((r for r, free in enumerate(room) if free >= length), None)
        if slot is None:
            rows.append([])
            room.append(width)
            slot = len(rows) - 1
        rows[slot].append(index)
        room[slot] -= length
    return rows


def _spread(layout: list[list[int]], rows: int) -> list[list[int]]:
    """At least `rows` rows (at most one per sample): the fullest row's last sample moves to a row of its own
    until there are enough, so short completions still fill every micro-batch of the step."""
    layout = [list(members) for members in layout]
    while len(layout) < rows:
        fullest = max(range(len(layout)), key=lambda r: len(layout[r]))
        if len(layout[fullest]) < 2:
            break
        layout.append([layout[fullest].pop()])
    return layout


def pack_policy_samples(samples: list[PolicySample], seq_len: int, pad_id: int, min_rows: int = 1) -> PolicyRows:
    """Pack whole documents into rows of seq_len + 1 tokens, at least `min_rows` of them while there are samples
    to spread; padding is its own document, never a target."""
    if not samples:
        raise ValueError("pack_policy_samples needs at least one sample")
    width = seq_len + 1
    layout = _spread(_first_fit_rows([len(s.prompt_tokens) + len(s.completion_tokens) for s in samples], width),
                     min_rows)
    shape = (len(layout), width)
    tokens = torch.full(shape, pad_id, dtype=torch.int64)
    document_ids = torch.zeros(shape, dtype=torch.int64)
    target_mask = torch.zeros(shape, dtype=torch.bool)
    padding = torch.zeros(shape, dtype=torch.bool)
    old_logp = torch.zeros(shape, dtype=torch.float32)
    advantages = torch.zeros(shape, dtype=torch.float32)
    for row, members in enumerate(layout):
        start = 0
        for doc, index in enumerate(members):
            sample = samples[index]
            prompt, completion = len(sample.prompt_tokens), len(sample.completion_tokens)
            begin, end = start + prompt, start + prompt + completion
            tokens[row, start:end] = torch.tensor(sample.prompt_tokens + sample.completion_tokens)
            document_ids[row, start:end] = doc
            target_mask[row, begin:end] = True if sample.completion_mask is None else torch.tensor(sample.completion_mask)
            advantages[row, begin:end] = sample.advantage
            if sample.old_logp is not None:
                old_logp[row, begin:end] = torch.tensor(sample.old_logp)
            start = end
        document_ids[row, start:] = len(members)  # padding
        padding[row, start:] = True
    return PolicyRows(tokens, document_ids, target_mask, padding, old_logp, advantages,
                      _routing_rows(samples, layout, width))


def rows_to_batch(rows: PolicyRows, picks: torch.Tensor) -> Batch:
    """The Batch of the picked rows; the floats shift with the labels (label t is token t+1)."""
    batch = batch_from_rows(*rows.take(picks))
    masked = batch.labels == IGNORE_INDEX
    batch.old_logp = rows.old_logp[picks][:, 1:].masked_fill(masked, 0.0).contiguous()
    batch.advantages = rows.advantages[picks][:, 1:].masked_fill(masked, 0.0).contiguous()
    if rows.routing is not None:  # each input token's experts: the rows' first seq_len tokens
        batch.routed_experts = rows.routing[picks][:, :-1].contiguous()
    return batch


def split_into_batches(rows: PolicyRows, parts: int) -> list[Batch]:
    """All rows in order, as `parts` micro-batches of near-equal row counts (one optimizer step's worth)."""
    if len(rows) < parts:  # pack_policy_samples(min_rows=parts) and rl_issues' sample count rule this out
        raise ValueError(f"{len(rows)} rows cannot fill {parts} micro-batches")
    return [rows_to_batch(rows, picks) for picks in torch.arange(len(rows)).tensor_split(parts)]


class PolicyBatchLoader(BatchLoader):
    """BatchLoader over PolicyRows: same seeded epochs and exact-resume state, Batches carry old_logp/advantages."""

    rows: PolicyRows

    def next_batch(self) -> Batch:
        return rows_to_batch(self.rows, torch.tensor([self.next_index() for _ in range(self.batch_size)]))


@torch.no_grad()
def policy_logprobs(model: DecoderLM, batch: Batch, logit_scale: float, softcap: float | None,
                    amp_dtype: torch.dtype | None = None, budget_mib: float = DEFAULT_LOGITS_MEMORY_MIB) -> torch.Tensor:
    """(B, S) log-prob of every label under the model (0 where masked): old_logp for the first update.

    The same forward as training (document ids, autocast, the head's logit transform, the replayed routing of
    `batch.routed_experts`), so the first
    update's ratio is 1 up to float rounding of the loss path's own log-softmax. Like the training head it
    never holds the whole batch's logits: the head runs over token chunks whose logits, their fp32 copy and
    log-softmax fit `budget_mib` (the head's `logits_memory_mib`; 0: one chunk), which matters at a 150k vocab.
    """
    device = model.output_weight.device
    routed = None if batch.routed_experts is None else batch.routed_experts.to(device)
    with autocast(device, amp_dtype):
        hidden = model.hidden_states(batch.input_ids.to(device), batch.document_ids.to(device), routed_experts=routed)
    return hidden_logprobs(model, hidden, batch.labels, logit_scale, softcap, amp_dtype, budget_mib)


def hidden_logprobs(model: DecoderLM, hidden: torch.Tensor, labels: torch.Tensor, logit_scale: float,
                    softcap: float | None, amp_dtype: torch.dtype | None = None,
                    budget_mib: float = DEFAULT_LOGITS_MEMORY_MIB) -> torch.Tensor:
    """`policy_logprobs` from the model's final hidden states (B, S, H) of the batch: its head over token chunks."""
    device = model.output_weight.device
    shape = labels.shape
    labels = labels.to(device).reshape(-1)
    hidden = hidden.reshape(labels.numel(), -1)
    element_bytes = (amp_dtype or hidden.dtype).itemsize + 8  # the logits, their fp32 copy and log-softmax
    size = chunking(labels.numel(), model.config.vocab_size, element_bytes, budget_mib).tokens if budget_mib \
        else max(labels.numel(), 1)
    parts = []
    for start in range(0, labels.numel(), size):
        rows = slice(start, start + size)
        with autocast(device, amp_dtype):
            logits = model.head_logits(hidden[rows])
        parts.append(label_logp(logits.float(), labels[rows], logit_scale, softcap))
    return torch.cat(parts).view(shape).cpu()
