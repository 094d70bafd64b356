"""Real Hugging Face tokenizers for the data tests, trained locally (no hub) on the generated corpus."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fastlm.data.bpe import train_bpe_tokenizer
from fastlm.data.corpus import generate_documents

BPE_VOCAB = 400


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`bpe_dir("llama" | "qwen2")`: a BPE tokenizer folder of 400 ids, trained once per session."""
    made: dict[str, Path] = {}

    def make(style: str = "llama") -> Path:
        if style not in made:
            directory = tmp_path_factory.mktemp(f"bpe_{style}")
            made[style] = train_bpe_tokenizer(generate_documents(400, seed=0), directory, BPE_VOCAB, style)  # type: ignore[arg-type]
        return made[style]

    return make
