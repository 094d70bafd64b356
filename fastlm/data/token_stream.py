"""Token ids held compactly in memory, and the packed rows cut from them.

A byte tokenizer's document is its text's UTF-8 bytes framed by BOS and EOS (ids 256, 257): held as
int64 (or even uint16) it takes 8 (2) bytes a byte of text. `TokenStream` keeps the ids in a narrow array
(`narrow`: one byte a token here) and splices the few ids that do not fit it in at their positions, so a
document costs about its text's size and the text's encoded bytes are used as they are, without a copy.
`StreamRows` lays documents end to end and cuts rows of seq_len + 1 tokens; a row becomes int64 tensors
only when a batch takes it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import DTypeLike

NARROW_SHARE = 16  # a list of ids is held one byte a token while at most one id in 16 is 256 or more


def smallest_unsigned(largest: int) -> np.dtype:
    """The narrowest unsigned dtype that holds 0..largest."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


@dataclass(frozen=True)
class TokenStream:
    """Ids: `narrow` with `inserted[i]` spliced in at stream position `inserted_at[i]` (sorted)."""

    narrow: np.ndarray
    inserted_at: np.ndarray  # int64
    inserted: np.ndarray  # int64

    @classmethod
    def framed(cls, head: Sequence[int], body: np.ndarray, tail: Sequence[int]) -> TokenStream:
        """head + body + tail, with `body` held as it is (no copy): a document of its tokenizer's BOS, ids, EOS."""
        at = [*range(len(head)), *range(len(head) + len(body), len(head) + len(body) + len(tail))]
        return cls(body, np.asarray(at, dtype=np.int64), np.asarray([*head, *tail], dtype=np.int64))

    @classmethod
    def of(cls, ids: Sequence[int]) -> TokenStream:
        """A list of ids: one byte a token where few are 256 or more, else the dtype that holds the largest."""
        values = np.asarray(ids, dtype=np.int64)
        wide = values > np.iinfo(np.uint8).max
        count = int(wide.sum())
        if count * NARROW_SHARE > len(values):
            return cls(values.astype(smallest_unsigned(int(values.max()))), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return cls(values[~wide].astype(np.uint8), np.flatnonzero(wide).astype(np.int64), values[wide])

    @classmethod
    def concatenate(cls, parts: Sequence[TokenStream]) -> TokenStream:
        """The streams end to end (a single stream is returned as it is, not copied)."""
        if len(parts) == 1:
            return parts[0]
        starts = np.cumsum([0] + [len(part) for part in parts[:-1]])
        return cls(np.concatenate([part.narrow for part in parts]),
                   np.concatenate([part.inserted_at + start for part, start in zip(parts, starts)]),
                   np.concatenate([part.inserted for part in parts]))

    def __len__(self) -> int:
        return len(self.narrow) + len(self.inserted)

    def window(self, start: int, end: int, dtype: DTypeLike = np.int64) -> np.ndarray:
        """The ids at stream positions start..end-1, as `dtype`."""
        first, last = np.searchsorted(self.inserted_at, [start, end])
        begin = start - int(first)  # narrow index of the first position at or after `start` that is not spliced in
        narrow = self.narrow[begin : begin + end - start - int(last - first)]
        if first == last:
            return narrow.astype(dtype)
        out = np.empty(end - start, dtype=dtype)
        spliced = self.inserted_at[first:last] - start
        kept = np.ones(end - start, dtype=bool)
        kept[spliced] = False
        out[kept] = narrow
        out[spliced] = self.inserted[first:last]
        return out

    def __getitem__(self, index: int) -> int:
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(f"token {index} of a stream of {len(self)}")
        return int(self.window(index, index + 1)[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self.window(0, len(self)).tolist())


class StreamRows:
    """A token stream (documents end to end; `offsets` their starts and the end) cut into rows of `width` tokens;
    the last row is padded with `pad_id`, never a target. `targets` (None: every token is one) flags each token.

    Piece ids are global and increasing: a new piece starts at every document start, every row start and the
    padding (attention and labels never cross a piece boundary)."""

    def __init__(self, stream: TokenStream, offsets: np.ndarray, targets: np.ndarray | None, width: int,
                 pad_id: int) -> None:
        self.stream, self.targets, self.width, self.pad_id = stream, targets, width, pad_id
        total = len(stream)
        self.rows = -(-total // width)
        self.piece_starts = offsets if total % width else offsets[:-1]  # documents, and the padding if any
        self.aligned = self.piece_starts[self.piece_starts % width == 0]  # those that are also row starts

    def __len__(self) -> int:
        return self.rows

    def take(self, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, piece ids, target flags, padding flags) of rows `picks`, each (len(picks), width)."""
        rows = picks.numpy().astype(np.int64)
        width, total = self.width, len(self.stream)
        positions = rows[:, None] * width + np.arange(width)
        tokens = np.full(positions.shape, self.pad_id, dtype=np.int64)
        targets = np.zeros(positions.shape, dtype=bool)
        padding = positions >= total
        for out, row in enumerate(rows.tolist()):
            start, end = row * width, min(row * width + width, total)
            tokens[out, : end - start] = self.stream.window(start, end)
            targets[out, : end - start] = True if self.targets is None else self.targets[start:end]
        pieces = (np.searchsorted(self.piece_starts, positions, side="right") + rows[:, None]
                  - np.searchsorted(self.aligned, rows * width, side="right")[:, None])
        return torch.from_numpy(tokens), torch.from_numpy(pieces), torch.from_numpy(targets), torch.from_numpy(padding)

    @property
    def tokens(self) -> torch.Tensor:
        """Every row's tokens, (rows, width) int64 (as `take` gives them; for inspecting small data)."""
        return self.take(torch.arange(self.rows))[0]

    @property
    def document_ids(self) -> torch.Tensor:
        return self.take(torch.arange(self.rows))[1]

    @property
    def target_mask(self) -> torch.Tensor:
        return self.take(torch.arange(self.rows))[2]
