"""Where training text comes from and how it is cut into packed sequences."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from fastlm.config.base import ConfigModel
from fastlm.data.prepared_layout import prepared_files


class GeneratedSource(ConfigModel):
    """A corpus the project writes itself (no downloads): templated sentences and arithmetic facts."""

    type: Literal["generated"] = "generated"
    num_documents: int = Field(4000, ge=2)
    seed: int = 1234


class TextSource(ConfigModel):
    """A UTF-8 text file; documents are separated by blank lines."""

    type: Literal["text"] = "text"
    path: str


class RecordFields(ConfigModel):
    """Which fields of a record hold the document (TRL's data set conventions), in this order of precedence:
    `messages_field` (a conversation rendered with the tokenizer's chat template, loss on assistant turns),
    `prompt_field` + `completion_field` (strings, or lists of messages; loss on the completion), else
    `text_field` (plain text, every token a target)."""

    text_field: str = "text"
    prompt_field: str | None = None
    completion_field: str | None = None
    messages_field: str | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> RecordFields:
        if (self.prompt_field is None) != (self.completion_field is None):
            raise ValueError("set both prompt_field and completion_field (SFT) or neither (plain text_field)")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ValueError("set messages_field (conversations) or prompt_field + completion_field, not both")
        return self


class JsonlSource(RecordFields):
    """One JSON object per line; the fields are read as `RecordFields` says."""

    type: Literal["jsonl"] = "jsonl"
    path: str


class OfflineRLSource(ConfigModel):
    """Policy-gradient samples produced elsewhere, one JSON object per line (see fastlm/data/offline_rl.py):
    {"prompt": str, "completion": str, "advantage": float, "old_logprobs": [float per completion token + EOS]}."""

    type: Literal["offline_rl"] = "offline_rl"
    path: str


class PreferencesJsonlSource(ConfigModel):
    """DPO pairs, one JSON object per line: {"prompt": str, "chosen": str, "rejected": str}."""

    type: Literal["preferences_jsonl"] = "preferences_jsonl"
    path: str
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"


class GeneratedPreferencesSource(ConfigModel):
    """DPO pairs from the addition task (no downloads): chosen = the right sum, rejected = a wrong one."""

    type: Literal["generated_preferences"] = "generated_preferences"
    num_pairs: int = Field(2000, ge=2)
    max_operand: int = Field(9, ge=1, description="Operands are drawn from [0, max_operand].")
    seed: int = 1234


class MemmapSource(ConfigModel):
    """A data set written by `fastlm prepare` (tokens on disk, read row by row; fastlm/data/prepared.py)."""

    type: Literal["memmap"] = "memmap"
    path: str

    def data_files(self) -> list[str]:
        """The files training reads (the checkpoint's data fingerprint hashes them)."""
        return prepared_files(self.path)


class BlendEntry(ConfigModel):
    path: str = Field(description="A directory written by `fastlm prepare`.")
    weight: float = Field(gt=0.0, allow_inf_nan=False, description="Share of rows drawn from it (weights are normalised).")


class BlendSource(ConfigModel):
    """Several prepared data sets, rows drawn by weight."""

    type: Literal["blend"] = "blend"
    sources: list[BlendEntry] = Field(min_length=1)

    def data_files(self) -> list[str]:
        """The files training reads, source by source (the checkpoint's data fingerprint hashes them)."""
        return [file for entry in self.sources for file in prepared_files(entry.path)]


PREPARED_SOURCE_TYPES: frozenset[str] = frozenset({"memmap", "blend"})
PREFERENCE_SOURCE_TYPES: frozenset[str] = frozenset({"preferences_jsonl", "generated_preferences"})

DataSource = Annotated[
    GeneratedSource | TextSource | JsonlSource | MemmapSource | BlendSource | OfflineRLSource
    | PreferencesJsonlSource | GeneratedPreferencesSource,
    Field(discriminator="type"),
]


class ByteTokenizerConfig(ConfigModel):
    """UTF-8 bytes + BOS/EOS/PAD/SEP (vocab 260): no files needed."""

    type: Literal["byte"] = "byte"


class HuggingFaceTokenizerConfig(ConfigModel):
    """A local Hugging Face tokenizer (a directory saved by `save_pretrained`, or one tokenizer.json file),
    loaded by transformers with local files only. The token fields override the tokenizer's own special
    tokens (a bare tokenizer.json names none)."""

    type: Literal["huggingface"] = "huggingface"
    path: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None


TokenizerConfig = Annotated[ByteTokenizerConfig | HuggingFaceTokenizerConfig, Field(discriminator="type")]


class DataConfig(ConfigModel):
    tokenizer: TokenizerConfig | None = Field(
        None, description="null: the tokenizer saved with run.init_path if it holds one, else {type: byte}."
    )
    source: DataSource = Field(default_factory=GeneratedSource)
    seq_len: int = Field(128, ge=2, description="Tokens per packed row (documents are packed with ids).")
    micro_batch_size: int = Field(8, ge=1)
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of documents held out for eval/loss.")
    eval_source: DataSource | None = Field(
        None, description="A separate eval set (a generated, text, jsonl or memmap source): eval/loss reads it, and "
        "the train source is used whole (eval_fraction is then ignored).")
