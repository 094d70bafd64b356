"""Multi-turn rollouts: every episode of a rollout advances one policy turn at a time, all on one KV cache.

The G episodes of each prompt record start from their environment's `reset`; the policy's turns are sampled
for all live episodes at once (the backend's `session`, natively a `Continuation`: the first turn from the
prompts, later ones after a prefill of only the appended environment tokens); each turn goes to its
environment's `step`, whose reply is appended through the chat template (`Transcript`). Episodes end
independently (base.py lists when). An episode's tokens after its prompt interleave policy turns (targets,
with the sampler's log-probs) and environment replies (masked, no log-probs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fastlm.data.chat import ChatError
from fastlm.data.datasets import DataError
from fastlm.data.tokenizer import Message, Tokenizer
from fastlm.generation import Completion, GenerationBackend, SamplingOptions
from fastlm.rl.environments.base import EnvironmentFactory
from fastlm.rl.environments.transcript import Transcript, completion_text
from fastlm.rl.prompts import PromptRecord

COUNTED_INFO = ("tool_calls", "tool_errors")  # numbers of a step's info summed over an episode


@dataclass
class Episode:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # after the prompt: policy turns and environment replies
    policy: list[bool] = field(default_factory=list)  # which of `tokens` the policy sampled
    logprobs: list[float] = field(default_factory=list)  # the sampler's (0 on environment tokens)
    reward: float = 0.0
    turns: int = 0
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTED_INFO, 0.0))
    ended: bool = False  # the environment ended it (not max_turns, a turn without stop token, or no room)
    messages: list[Message] = field(default_factory=list)

    def add_turn(self, completion: Completion) -> None:
        self.tokens += completion.tokens
        self.policy += [True] * len(completion.tokens)
        self.logprobs += completion.logprobs
        self.turns += 1

    def add_reply(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.policy += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)

    @property
    def policy_tokens(self) -> int:
        return sum(self.policy)


def run_episodes(backend: GenerationBackend, tokenizer: Tokenizer, factory: EnvironmentFactory, records: list[PromptRecord],
                 group: int, options: SamplingOptions, generator: torch.Generator | None,
                 limit: int) -> tuple[list[Episode], float]:
    """G episodes per record (record-major), each of at most `limit` tokens, prompt included, and the seconds
    spent in the environments' `step` (the reward's and tools' share of the rollout)."""
    rows = [(index, record) for index, record in enumerate(records) for _ in range(group)]
    environments = [factory.new(index) for index, _ in rows]
    transcripts = []
    for (index, record), environment in zip(rows, environments):
        messages = factory.reset(environment, record, index)
        try:
            transcripts.append(Transcript(tokenizer, messages))
        except ChatError as error:
            raise DataError(f"environment '{factory.path}' reset, prompt index {index}: {error}") from error
    episodes = [Episode(t.prompt) for t in transcripts]
    session = backend.session(options, limit)
    try:
        completions: dict[int, Completion] = dict(enumerate(session.start([e.prompt for e in episodes], generator)))
    except ValueError as error:
        raise DataError(f"environment '{factory.path}': {error}") from error
    step_seconds = 0.0
    while completions:
        appended: dict[int, list[int]] = {}
        for row, completion in completions.items():
            episode, transcript, index = episodes[row], transcripts[row], rows[row][0]
            episode.add_turn(completion)
            text = completion_text(completion, tokenizer)
            if not completion.stopped:
                transcript.record(text)
                continue
            conversation = transcript.messages + [{"role": "assistant", "content": text}]
            started = time.perf_counter()
            new_messages, reward, info = factory.step(environments[row], conversation, text, index)
            step_seconds += time.perf_counter() - started
            episode.reward += reward or 0.0
            for key in COUNTED_INFO:
                value = info.get(key, 0)
                episode.counts[key] += float(value) if isinstance(value, (int, float)) else 0.0
            if new_messages is None:
                episode.ended = True
                transcript.record(text)
                continue
            try:
                reply = transcript.reply(text, completion.tokens[-1], new_messages)
            except ChatError as error:
                raise DataError(f"environment '{factory.path}' step, prompt index {index}: {error}") from error
            if episode.turns < factory.max_turns and reply and session.room(row, len(reply)):
                episode.add_reply(reply)
                appended[row] = reply
        completions = session.extend(appended, generator) if appended else {}
    for episode, transcript in zip(episodes, transcripts):
        episode.messages = transcript.messages
    factory.release(environments)
    return episodes, step_seconds
