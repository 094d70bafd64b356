"""Where rollout prompts come from: a built-in verifiable task, or a JSONL prompt data set.

Both give `PromptRecord`s: the prompt text and the record's other columns, which reach the reward functions
as keyword arguments (fastlm/rl/rewards.py). A JSONL prompt may be plain text or a conversation (TRL's
conversational format, a list of {"role", "content"} messages): a conversation is rendered by the run's
tokenizer's chat template with the generation prompt, and the reward functions get the messages. A built-in task's records
carry `answer` (the demonstrated answer), and its built-in reward (`task_reward`) scores completions with the task's own check.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.chat import ChatError, check_messages
from fastlm.data.datasets import DataError, jsonl_records
from fastlm.data.tasks import AdditionTask, ArithmeticChainTask, Problem, ReverseTask, Task, score
from fastlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, TokenizerError
from fastlm.rl.config import AdditionTaskConfig, ArithmeticChainTaskConfig, JsonlPromptsConfig, RLConfig, TaskConfig
from fastlm.rl.records import PromptRecord
from fastlm.rl.rewards import RESERVED_ARGUMENTS


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """The prompt's ids with the tokenizer's BOS in front (once: a chat template may have written it)."""
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


class PromptSource(Protocol):
    def sample(self, rng: random.Random) -> PromptRecord: ...


def build_task(config: TaskConfig) -> Task:
    if isinstance(config, AdditionTaskConfig):
        return AdditionTask(config.max_operand)
    if isinstance(config, ArithmeticChainTaskConfig):
        return ArithmeticChainTask(config.steps, config.max_operand)
    return ReverseTask(config.length, config.alphabet)


@dataclass(frozen=True)
class TaskPrompts:
    task: Task

    def sample(self, rng: random.Random) -> PromptRecord:
        problem = self.task.sample(rng)
        return PromptRecord(problem.prompt, {"answer": problem.answer})


def task_reward(task: Task, format_reward: float) -> Callable[..., list[float]]:
    """The built-in task's reward as a reward function (1 right, `format_reward` well-formed, else 0)."""

    def reward(prompts: list[str], completions: list[str], stopped: list[bool], answer: list[str],
               **_: Any) -> list[float]:
        return [score(task, Problem(p, a), c, s, format_reward) for p, c, s, a in zip(prompts, completions, stopped, answer)]

    return reward


class JsonlPrompts:
    """Every record of a JSONL file, drawn uniformly with replacement; checked when loaded (file and line)."""

    def __init__(self, config: JsonlPromptsConfig, tokenizer: Tokenizer, max_prompt_tokens: int) -> None:
        path = Path(config.path)
        self.records: list[PromptRecord] = []
        for line, record in jsonl_records(path):
            value = record.get(config.prompt_field)
            text, prompt = _prompt_text(value, tokenizer, f"{path} line {line}: field '{config.prompt_field}' "
                                        f"(rl.prompts.prompt_field)", sorted(record))
            tokens = len(encode_prompt(tokenizer, text))
            if tokens > max_prompt_tokens:
                raise DataError(f"{path} line {line}: the prompt has {tokens} tokens, more than model.max_seq_len - "
                                f"rl.max_new_tokens = {max_prompt_tokens}; shorten it or raise model.max_seq_len")
            columns = {key: value for key, value in record.items() if key != config.prompt_field}
            self.records.append(PromptRecord(text, columns, prompt))
        if not self.records:
            raise DataError(f"{path}: no prompts (the file has no JSON records)")
        reserved = sorted(set(self.records[0].columns) & set(RESERVED_ARGUMENTS))
        if reserved:
            raise DataError(f"{path}: column '{reserved[0]}' has the name of a reward function argument (reserved: "
                            f"{', '.join(RESERVED_ARGUMENTS)}), so the reward would get it instead of the model's "
                            f"{reserved[0]}; rename the column")
        keys = set(self.records[0].columns)
        for index, record in enumerate(self.records):
            if set(record.columns) != keys:
                raise DataError(f"{path}: record {index + 1} has columns {sorted(record.columns)} but the first has "
                                f"{sorted(keys)}; every record needs the same fields (reward functions get lists)")

    def sample(self, rng: random.Random) -> PromptRecord:
        return self.records[rng.randrange(len(self.records))]


def _prompt_text(value: Any, tokenizer: Tokenizer, where: str, keys: list[str]) -> tuple[str, Any]:
    """(text to encode, prompt for the reward functions) of a plain-text or conversational prompt."""
    if isinstance(value, str) and value:
        return value, None
    if isinstance(value, list):
        try:
            messages = check_messages(value)
            return tokenizer.render_chat(messages, add_generation_prompt=True), messages
        except (ChatError, TokenizerError) as error:
            raise DataError(f"{where}: {error}") from error
    raise DataError(f"{where} must be a non-empty string or a list of chat messages, got {value!r:.80} (keys: {keys})")


def stop_token_ids(rl: RLConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """`rl.stop_tokens` as ids of the run's tokenizer (special-token names or single-token text); default EOS."""
    if rl.stop_tokens is None:
        if tokenizer.eos_id is None:
            raise ConfigError(ConfigIssue("rl.stop_tokens", "the run's tokenizer has no EOS token to end completions",
                                          None, hint="name the stop token(s), e.g. rl.stop_tokens: ['<|im_end|>']"))
        return (tokenizer.eos_id,)
    special = {name: token for token, name in SPECIAL_TOKENS.items()}
    ids = []
    for index, name in enumerate(rl.stop_tokens):
        token_to_id = getattr(tokenizer, "token_to_id", None)
        token = token_to_id(name) if callable(token_to_id) else special.get(name)
        if token is None:
            encoded = tokenizer.encode(name)
            token = encoded[0] if len(encoded) == 1 else None
        if token is None:
            raise ConfigError(ConfigIssue(f"rl.stop_tokens[{index}]", "is not a single token of the run's tokenizer",
                                          name, hint=f"special tokens: {sorted(special)}; or one character/byte"))
        ids.append(int(token))
    return tuple(ids)
