"""Byte-level tokenizer: every UTF-8 byte is a token, so no vocabulary file is ever needed."""

from __future__ import annotations

from collections.abc import Iterable

BYTE_TOKENS = 256
BOS = 256
EOS = 257
PAD = 258
SEP = 259
SPECIAL_TOKENS: dict[int, str] = {BOS: "<bos>", EOS: "<eos>", PAD: "<pad>", SEP: "<sep>"}


class ByteTokenizer:
    """Ids 0..255 are bytes; BOS/EOS/PAD/SEP follow, giving the default model vocab of 260."""

    bos_id: int = BOS
    eos_id: int = EOS
    pad_id: int = PAD
    sep_id: int = SEP

    @property
    def vocab_size(self) -> int:
        return BYTE_TOKENS + len(SPECIAL_TOKENS)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """UTF-8 bytes of `text`, optionally framed by BOS/EOS."""
        ids = list(text.encode("utf-8"))
        return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

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
