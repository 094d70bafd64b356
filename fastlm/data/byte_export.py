"""The byte tokenizer as a Hugging Face tokenizer folder, so an exported byte model loads with AutoTokenizer.

A byte-level BPE without merges maps each UTF-8 byte to one token: with vocab {byte char of b: b} and
the special tokens at 256..259 the ids equal `ByteTokenizer`'s exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


def save_byte_tokenizer(directory: Path, special_tokens: Mapping[int, str], bos_id: int, eos_id: int, pad_id: int,
                        sep_id: int) -> None:
    """`ByteTokenizer.save_pretrained`: its special tokens (id -> text) and the ids of each role."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _gpt2_byte_table().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([special_tokens[i] for i in sorted(special_tokens)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special_tokens[bos_id], eos_token=special_tokens[eos_id],
        pad_token=special_tokens[pad_id], sep_token=special_tokens[sep_id],
    )
    wrapped.chat_template = BYTE_CHAT_TEMPLATE
    wrapped.save_pretrained(str(directory))


def _gpt2_byte_table() -> dict[int, str]:
    """GPT-2's byte -> printable char table (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars
