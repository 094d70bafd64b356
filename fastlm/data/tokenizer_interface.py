"""What fastlm needs from a tokenizer (`Tokenizer`), its error, and the files that make a folder a Hugging Face
tokenizer. A leaf: the byte tokenizer and the factory (tokenizer.py) and the Hugging Face tokenizer
(hf_tokenizer.py), which the factory builds, import these, so the two tokenizer modules do not import each other."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

Message = dict[str, str]  # {"role": "user" | "assistant" | "system", "content": str}

# Files that make a directory a Hugging Face tokenizer (any one of them).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerError(ValueError):
    """A tokenizer that cannot serve the run (missing files, no EOS); the message names the file and the fix."""


class Tokenizer(Protocol):
    """What fastlm needs from a tokenizer. `bos_id` may be None (Qwen2 has no BOS); `eos_id` never is."""

    name: str
    bos_id: int | None
    eos_id: int
    pad_id: int

    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray:
        """The text's ids (no BOS/EOS) as an array of the narrowest unsigned dtype holding the vocab: what a long
        document is kept as (a list takes 8 bytes or more an id)."""
        ...

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        """`encode` of each text, in one call (a Hugging Face tokenizer encodes a batch in Rust)."""
        ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str: ...
