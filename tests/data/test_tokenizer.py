"""Byte tokenizer: exact round trip, special ids, and lossy-but-safe decoding of cut UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlm.data.tokenizer import BOS, EOS, ByteTokenizer


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_round_trip(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_vocab_and_specials() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 260
    assert tokenizer.decode([104, 105, EOS], skip_special=False) == "hi<eos>"


def test_cut_multibyte_character_is_replaced() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("é")  # two bytes
    assert tokenizer.decode(ids[:1]) == "\ufffd"


def test_out_of_vocab_id_is_an_error() -> None:
    with pytest.raises(ValueError, match="token id 999"):
        ByteTokenizer().decode([999])
