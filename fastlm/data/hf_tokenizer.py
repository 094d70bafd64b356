"""A Hugging Face tokenizer behind fastlm's `Tokenizer` interface, loaded from local files only (never the hub).

fastlm frames documents itself (BOS/EOS), so text is encoded without the tokenizer's own special-token
post-processing; chat records are rendered by the tokenizer's chat template and encoded as they are.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastlm.data.chat_template import TemplateError, render_template
from fastlm.data.config import HuggingFaceTokenizerConfig
from fastlm.data.token_stream import smallest_unsigned
from fastlm.data.tokenizer_interface import HF_TOKENIZER_FILES, Message, TokenizerError

_INSTALL_HINT = 'reinstall fastlm with its dependencies: pip install -e .'


def _load_backend(config: HuggingFaceTokenizerConfig) -> Any:
    """transformers' tokenizer for a directory or a tokenizer.json file; errors name the path and the fix."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError as error:
        raise TokenizerError(f"data.tokenizer {config.path}: transformers is not installed; {_INSTALL_HINT}") from error
    path = Path(config.path)
    if path.is_file():
        if path.suffix != ".json":
            raise TokenizerError(f"{path}: a tokenizer file must be a tokenizer.json; or point at the tokenizer's directory")
        loader = lambda: PreTrainedTokenizerFast(tokenizer_file=str(path))  # noqa: E731
    elif path.is_dir():
        if not any((path / name).is_file() for name in HF_TOKENIZER_FILES):
            raise TokenizerError(
                f"{path}: no tokenizer files (looked for {', '.join(HF_TOKENIZER_FILES)}); save one there with "
                "tokenizer.save_pretrained(DIR), or set data.tokenizer: {type: byte}"
            )
        loader = lambda: AutoTokenizer.from_pretrained(str(path), local_files_only=True)  # noqa: E731
    else:
        raise TokenizerError(f"{path}: tokenizer not found (no such file or directory); fix data.tokenizer.path")
    try:
        return loader()
    except Exception as error:  # transformers raises many kinds for a broken file
        raise TokenizerError(f"{path}: could not load the tokenizer ({type(error).__name__}: {error})") from error


class HuggingFaceTokenizer:
    """fastlm's view of a transformers tokenizer: ids of its special tokens, plain encode/decode, its chat template."""

    def __init__(self, backend: Any, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None) -> None:
        self.backend = backend
        self.source = source
        self.name = f"huggingface:{Path(source).name}"
        self.bos_id = self._token_id(bos_token or backend.bos_token, "bos_token")
        eos = self._token_id(eos_token or backend.eos_token, "eos_token")
        if eos is None:
            raise TokenizerError(
                f"{source}: the tokenizer has no EOS token, so documents could not end and generation could not "
                "stop; set eos_token in its tokenizer_config.json or data.tokenizer.eos_token"
            )
        self.eos_id = eos
        pad = self._token_id(pad_token or backend.pad_token, "pad_token")
        self.pad_id = eos if pad is None else pad  # padding is never a target, any id will do

    @classmethod
    def load(cls, config: HuggingFaceTokenizerConfig) -> HuggingFaceTokenizer:
        return cls(_load_backend(config), config.path, config.bos_token, config.eos_token, config.pad_token)

    def _token_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.backend.unk_token_id and token != self.backend.unk_token:
            raise TokenizerError(f"{self.source}: {what} {token!r} is not in the vocab; fix the token or the tokenizer")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can emit, added tokens included (len(), not the base `vocab_size`)."""
        return len(self.backend)

    @property
    def fingerprint(self) -> str:
        """A hash of what decides the ids: the tokenizer's full JSON (or vocab), the special ids, the chat template."""
        backend = getattr(self.backend, "backend_tokenizer", None)
        body = backend.to_str() if backend is not None else json.dumps(sorted(self.backend.get_vocab().items()))
        extra = json.dumps([self.bos_id, self.eos_id, self.pad_id, self.chat_template])
        return hashlib.sha256((body + extra).encode("utf-8")).hexdigest()[:16]

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.backend, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """The text's ids without the tokenizer's own special tokens; BOS (when it has one) and EOS on request."""
        ids = list(self.backend.encode(text, add_special_tokens=False))
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text, add_special_tokens=False), dtype=smallest_unsigned(self.vocab_size - 1))

    def encode_batch(self, texts: Sequence[str], bos: bool = False, eos: bool = False) -> list[list[int]]:
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos else []
        return [head + ids + tail for ids in self.backend(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as the tokenizer's chat template writes it (its BOS included, if the template adds one),
        rendered under time and size limits (fastlm/data/chat_template.py); a failure is one line naming the file."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.source}: the tokenizer has no chat template, so messages cannot be rendered; add "
                "chat_template to its tokenizer_config.json (or use prompt/completion text fields)"
            )
        try:
            return render_template(self.chat_template, messages, add_generation_prompt,
                                   dict(self.backend.special_tokens_map))
        except TemplateError as error:
            raise TokenizerError(f"{self.template_file}: chat template: {error}") from None

    @property
    def template_file(self) -> Path:
        """Where the chat template was read from, for messages: its own file, else the tokenizer config."""
        folder = Path(self.source)
        if folder.is_file():
            return folder
        own = folder / "chat_template.jinja"
        return own if own.is_file() else folder / "tokenizer_config.json"

    def save_pretrained(self, directory: str | Path) -> None:
        self.backend.save_pretrained(str(directory))
