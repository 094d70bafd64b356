"""Token and position embeddings, and the position ids of packed documents."""

from __future__ import annotations

import torch
from torch import nn


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document, (B, S) int64.

    A document is a contiguous run of equal ids in a row (how packing lays them out); a new run
    restarts the count at 0, even if the id value was used earlier in the row.
    """
    batch, seq_len = document_ids.shape
    index = torch.arange(seq_len, device=document_ids.device).expand(batch, seq_len)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - run_start


class Embeddings(nn.Module):
    """Token embedding, plus a learned position embedding when `max_positions` is given (GPT-2); `scale`
    multiplies the token embedding (Gemma: sqrt(hidden), rounded to the weight's dtype as Gemma does)."""

    def __init__(self, vocab_size: int, hidden_size: int, max_positions: int | None, dropout: float,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden_size)
        self.positions = nn.Embedding(max_positions, hidden_size) if max_positions else None
        self.dropout = nn.Dropout(dropout)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S), positions (B or 1, S) -> (B, S, H)."""
        hidden = self.tokens(input_ids)
        if self.scale != 1.0:
            hidden = hidden * torch.tensor(self.scale, dtype=hidden.dtype)
        if self.positions is not None:
            limit = self.positions.num_embeddings
            if positions.shape[-1] > limit:
                raise ValueError(
                    f"input_ids has sequence length {positions.shape[-1]} but the learned position embedding "
                    f"covers max_seq_len={limit}; raise model.max_seq_len or shorten data.seq_len"
                )
            hidden = hidden + self.positions(positions)
        return self.dropout(hidden)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.tokens.weight, mean=0.0, std=std)
        if self.positions is not None:
            nn.init.normal_(self.positions.weight, mean=0.0, std=std)
