"""Compact token streams: every window reads the ids it was built from, and packed rows cut from them are the
rows of the full int64 tensors packing used to build (tokens, piece ids, targets), row by row."""

from __future__ import annotations

import random

import numpy as np
import torch

from fastlm.data.datasets import Document, pack_documents
from fastlm.data.token_stream import TokenStream
from fastlm.data.tokenizer import BOS, EOS, PAD


def _random_ids(rng: random.Random, length: int, wide_share: float) -> list[int]:
    return [rng.randrange(256, 300) if rng.random() < wide_share else rng.randrange(256) for _ in range(length)]


def test_windows_read_back_every_id() -> None:
    rng = random.Random(0)
    parts = [TokenStream.framed([BOS], np.frombuffer(bytes(rng.randrange(256) for _ in range(n)), np.uint8), [EOS])
             for n in (0, 1, 5, 40)]
    parts += [TokenStream.of(_random_ids(rng, n, share)) for n, share in ((30, 0.02), (30, 0.5), (1, 1.0))]
    expected = [token for part in parts for token in part]
    stream = TokenStream.concatenate(parts)
    assert len(stream) == len(expected) and list(stream) == expected and stream[-1] == expected[-1]
    for _ in range(300):
        start = rng.randrange(len(expected))
        end = rng.randrange(start, len(expected) + 1)
        assert stream.window(start, end).tolist() == expected[start:end]
        assert stream.window(start, end, np.uint16).dtype == np.uint16


def test_a_list_is_held_one_byte_a_token_while_few_ids_are_wide() -> None:
    rng = random.Random(1)
    few, many = TokenStream.of(_random_ids(rng, 320, 0.0) + [BOS] * 20), TokenStream.of(_random_ids(rng, 300, 0.5))
    assert few.narrow.dtype == np.uint8 and len(few.inserted) == 20
    assert many.narrow.dtype == np.uint16 and len(many.inserted) == 0
    text = TokenStream.framed([BOS], np.frombuffer(b"long text", np.uint8), [EOS])
    assert TokenStream.concatenate([text]) is text  # one document: packed without a copy


def _reference_rows(documents: list[Document], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packing this replaced: full tensors, a new piece at every document start, row start and the padding."""
    tokens = [token for document in documents for token in document.tokens]
    targets = [flag for document in documents for flag in (document.target_mask or [True] * len(document.tokens))]
    starts = [index == 0 for document in documents for index in range(len(document.tokens))]
    padding = -len(tokens) % width
    starts += [True] + [False] * (padding - 1) if padding else []
    tokens, targets = tokens + [PAD] * padding, targets + [False] * padding
    pieces = np.cumsum([start or index % width == 0 for index, start in enumerate(starts)]) - 1
    return (torch.tensor(tokens).view(-1, width), torch.from_numpy(pieces).view(-1, width),
            torch.tensor(targets).view(-1, width))


def test_rows_equal_the_full_tensor_packing() -> None:
    rng = random.Random(2)
    documents = []
    for _ in range(60):
        body = np.frombuffer(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 30))), np.uint8)
        if rng.random() < 0.3:  # a prompted document (a list with its flags; one row at most), some wide ids inside
            ids = [BOS, *body[:3].tolist(), *([EOS] * rng.randrange(3))]
            documents.append(Document(ids, [index >= len(ids) // 2 for index in range(len(ids))]))
        else:
            documents.append(Document(TokenStream.framed([BOS], body, [EOS]), None))
    for width in (7, 16, 33):
        rows = pack_documents(documents, width - 1, PAD)
        expected = _reference_rows(documents, width)
        picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(width))
        for got, want in zip(rows.take(picks), expected):
            assert torch.equal(got, want[picks])
