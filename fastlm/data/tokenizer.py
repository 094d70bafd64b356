"""The run's tokenizer: one interface, the byte tokenizer as the default, a Hugging Face tokenizer from local files.

Everything that turns text into ids or back (data sets, chat records, rollouts, generation, HF export)
takes a `Tokenizer` object built once per run by `build_tokenizer`; nothing imports special ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# The interface, importable from here too (with the byte tokenizer and the factory, as most callers do)
from fastlm.data.tokenizer_interface import HF_TOKENIZER_FILES, Message, Tokenizer, TokenizerError

if TYPE_CHECKING:
    from fastlm.data.config import TokenizerConfig

__all__ = [
    "BOS", "BYTE_TOKENS", "EOS", "HF_TOKENIZER_FILES", "PAD", "SEP", "SPECIAL_TOKENS", "ByteTokenizer", "Message",
    "Tokenizer", "TokenizerError", "build_tokenizer", "holds_hf_tokenizer",
]

BYTE_TOKENS = 256
BOS = 256
EOS = 257
PAD = 258
SEP = 259
SPECIAL_TOKENS: dict[int, str] = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>", SEP: "<sep>"}


class ByteTokenizer:
    """Ids 0..255 are bytes; BOS/EOS/PAD/SEP follow, giving the default model vocab of 260.

    Its chat format is plain text ("### role\\ncontent\\n" per turn); EOS is appended as a target after a
    conversation's last assistant turn (fastlm/data/chat.py) so a model learns to stop.
    """

    name = "byte"
    bos_id: int = BOS
    eos_id: int = EOS
    pad_id: int = PAD
    sep_id: int = SEP

    @property
    def vocab_size(self) -> int:
        return BYTE_TOKENS + len(SPECIAL_TOKENS)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(f"byte:{self.vocab_size}:{sorted(SPECIAL_TOKENS.items())}".encode()).hexdigest()[:16]

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """UTF-8 bytes of `text`, optionally framed by BOS/EOS."""
        ids = list(text.encode("utf-8"))
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

    def encode_array(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as uint8, without a copy (a read-only view of the encoded bytes)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        return [self.encode(text, bos, eos) for text in texts]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Bytes back to text; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD, never an error."""
        out = bytearray()
        pieces: list[str] = []
        for token in ids:
            token = int(token)
            if 0 <= token < BYTE_TOKENS:
                out.append(token)
            elif token in SPECIAL_TOKENS:
                if not skip_special:
                    pieces.append(out.decode("utf-8", errors="replace"))
                    pieces.append(SPECIAL_TOKENS[token])
                    out = bytearray()
            else:
                raise ValueError(f"token id {token} is outside the byte tokenizer vocab 0..{self.vocab_size - 1}")
        pieces.append(out.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        text = "".join(f"### {m['role']}\n{m['content']}\n" for m in messages)
        return text + ("### assistant\n" if add_generation_prompt else "")

    def save_pretrained(self, directory: str | Path) -> None:
        """Write a `tokenizers` file that transformers loads and that gives the same ids (fastlm/data/byte_export.py)."""
        from fastlm.data.byte_export import save_byte_tokenizer

        save_byte_tokenizer(Path(directory), SPECIAL_TOKENS, self.bos_id, self.eos_id, self.pad_id, self.sep_id)


def holds_hf_tokenizer(directory: str | Path) -> bool:
    """Whether a local directory (e.g. `run.init_path`) carries tokenizer files."""
    path = Path(directory)
    return path.is_dir() and any((path / name).is_file() for name in HF_TOKENIZER_FILES)


def build_tokenizer(config: TokenizerConfig | None, init_path: str | None = None) -> Tokenizer:
    """The run's tokenizer: `data.tokenizer` when set; else the tokenizer saved with `run.init_path`; else bytes."""
    from fastlm.data.config import HuggingFaceTokenizerConfig

    if config is None:
        if init_path is not None and holds_hf_tokenizer(init_path):
            config = HuggingFaceTokenizerConfig(path=str(init_path))
        else:
            return ByteTokenizer()
    if isinstance(config, HuggingFaceTokenizerConfig):
        from fastlm.data.hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer.load(config)
    return ByteTokenizer()
