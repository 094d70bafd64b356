"""Packing: document ids, label masking at boundaries, split documents, SFT prompt masking, resume."""

from __future__ import annotations

import torch

from fastlm.data.batch import batch_from_rows
from fastlm.data.config import DataConfig, GeneratedSource
from fastlm.data.corpus import generate_documents
from fastlm.data.datasets import Document, pack_documents, split_documents
from fastlm.data.eval_source import build_loaders
from fastlm.data.loader import BatchLoader
from fastlm.data.summary import split_size
from fastlm.data.tokenizer import BOS, EOS, PAD, ByteTokenizer
from fastlm.losses.spec import IGNORE_INDEX


def _docs(*texts: str) -> list[Document]:
    tokenizer = ByteTokenizer()
    return [Document(tokenizer.encode(t, bos=True, eos=True), [True] * (len(t.encode()) + 2)) for t in texts]


def _rows_batch(documents: list[Document], seq_len: int):
    rows = pack_documents(documents, seq_len, PAD)
    return rows, batch_from_rows(*rows.take(torch.arange(len(rows))))


def test_boundaries_split_and_padding() -> None:
    # "ab" -> 4 tokens, "cdefgh" -> 8 tokens; rows of 6 tokens: [B a b E B c] [d e f g h E]
    rows, batch = _rows_batch(_docs("ab", "cdefgh"), seq_len=5)
    assert rows.tokens.tolist() == [[BOS, 97, 98, EOS, BOS, 99], [100, 101, 102, 103, 104, EOS]]
    # document 1 is split across rows: its two pieces get distinct ids
    assert rows.document_ids.tolist() == [[0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, 2]]
    # EOS of doc 0 must not predict doc 1's BOS; the last token of a row predicts the row's extra token
    assert batch.labels.tolist() == [[97, 98, EOS, IGNORE_INDEX, 99], [101, 102, 103, 104, EOS]]
    assert batch.num_tokens == 9 and batch.num_documents == 3
    assert not batch.padding.any() and batch.num_positions == 10

    rows, batch = _rows_batch(_docs("abc"), seq_len=7)  # 5 tokens padded to 8
    assert rows.tokens[0, 5:].tolist() == [PAD] * 3
    assert batch.labels[0].tolist() == [97, 98, 99, EOS] + [IGNORE_INDEX] * 3
    assert batch.padding.tolist() == [[False] * 5 + [True] * 2] and batch.num_positions == 5  # flags of the inputs


def test_prompt_tokens_are_never_labels() -> None:
    tokenizer = ByteTokenizer()
    head, tail = tokenizer.encode("Q", bos=True), tokenizer.encode("A", eos=True)
    document = Document(head + tail, [False] * len(head) + [True] * len(tail))
    _, batch = _rows_batch([document], seq_len=3)
    # input: BOS Q A ; labels: Q masked, A predicted from Q, EOS predicted from A
    assert batch.labels.tolist() == [[IGNORE_INDEX, ord("A"), EOS]]


def test_batch_ids_unique_across_rows_when_a_row_repeats() -> None:
    rows = pack_documents(_docs("abcdef"), seq_len=7, pad_id=PAD)  # exactly one row of 8, no padding
    loader = BatchLoader(rows, batch_size=3, seed=0)
    batch = loader.next_batch()  # one row, drawn three times
    assert batch.num_documents == 3
    assert batch.targets().document_ids.tolist() == [0] * 7 + [1] * 7 + [2] * 7


def test_generated_corpus_is_deterministic_and_split() -> None:
    assert generate_documents(20, seed=3) == generate_documents(20, seed=3)
    assert generate_documents(20, seed=3) != generate_documents(20, seed=4)
    train, held = split_documents(_docs(*"abcdefghij"), eval_fraction=0.2, seed=0)
    assert len(train) == 8 and len(held) == 2
    assert {d.tokens[1] for d in train}.isdisjoint({d.tokens[1] for d in held})


def test_loader_resume_continues_exactly() -> None:
    config = DataConfig(source=GeneratedSource(num_documents=4, seed=1), seq_len=16, micro_batch_size=4)
    loader, _ = build_loaders(config, seed=5, tokenizer=ByteTokenizer())
    for _ in range(7):  # 28 rows drawn from fewer than 28: crosses an epoch boundary
        loader.next_batch()
    state = loader.state_dict()
    assert state["epoch"] >= 1 and len(loader.rows) < 28
    expected = [loader.next_batch().input_ids for _ in range(5)]
    resumed, _ = build_loaders(config, seed=5, tokenizer=ByteTokenizer())
    resumed.load_state_dict(state)
    for want in expected:
        assert torch.equal(resumed.next_batch().input_ids, want)


def test_data_summary_counts_real_tokens_by_padding_not_by_pad_id() -> None:
    """A tokenizer whose pad id is also a real token (Qwen's end-of-text): the dry run's summary counts the
    real occurrences and leaves out only the row's padding."""
    documents = [Document([BOS, 97, EOS, 98, EOS], [True] * 5)]
    rows = pack_documents(documents, seq_len=7, pad_id=EOS)  # 5 tokens, then 3 of padding that are EOS too
    size = split_size(rows, bos_id=BOS)
    print(size.describe())
    assert (size.rows, size.tokens, size.documents) == (1, 5, 1)
