"""Verifiable tasks: prompts with one right answer and a programmatic reward, learnable by a tiny byte model.

A completion is the text the policy writes after the prompt, up to (not including) the stop token.
Reward: 1 for the exact answer followed by the stop token; `format_reward` for a well-formed but wrong
answer that stops; 0 otherwise (rambling, no stop token, wrong characters).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    """A family of problems; `well_formed` says whether a completion is in the answer's alphabet."""

    def sample(self, rng: random.Random) -> Problem: ...

    def well_formed(self, text: str) -> bool: ...

    def wrong_answer(self, problem: Problem, rng: random.Random) -> str: ...


@dataclass(frozen=True)
class AdditionTask:
    """"3+4=" -> "7": sums of two operands in [0, max_operand]."""

    max_operand: int = 9

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(f"{a}+{b}=", str(a + b))

    def well_formed(self, text: str) -> bool:
        return text.isascii() and text.isdigit()

    def wrong_answer(self, problem: Problem, rng: random.Random) -> str:
        """A plausible wrong sum (off by 1..3), for noisy demonstrations."""
        answer, offset = int(problem.answer), rng.choice((-3, -2, -1, 1, 2, 3))
        return str(answer + offset if answer + offset >= 0 else answer - offset)


@dataclass(frozen=True)
class ReverseTask:
    """"abc>" -> "cba": reverse a string of `length` letters from `alphabet`."""

    length: int = 3
    alphabet: str = "abcde"

    def sample(self, rng: random.Random) -> Problem:
        text = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(f"{text}>", text[::-1])

    def well_formed(self, text: str) -> bool:
        return len(text) == self.length and all(char in self.alphabet for char in text)

    def wrong_answer(self, problem: Problem, rng: random.Random) -> str:
        """The answer with one letter changed (copying instead of reversing is the other common error)."""
        letters = list(problem.answer)
        position = rng.randrange(len(letters))
        letters[position] = rng.choice([c for c in self.alphabet if c != letters[position]] or letters[position])
        return "".join(letters)


def score(task: Task, problem: Problem, completion: str, stopped: bool, format_reward: float) -> float:
    """The reward of one completion (see the module docstring)."""
    if not stopped:
        return 0.0
    if completion == problem.answer:
        return 1.0
    return format_reward if task.well_formed(completion) else 0.0


def demonstrations(task: Task, count: int, noise: float, seed: int) -> list[Problem]:
    """`count` solved problems for the supervised warm-up; a `noise` share carries a wrong answer so the
    warmed-up policy is imperfect and RL has something to fix."""
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"noise must be in [0, 1), got {noise}")
    rng = random.Random(seed)
    shown = []
    for _ in range(count):
        problem = task.sample(rng)
        answer = task.wrong_answer(problem, rng) if rng.random() < noise else problem.answer
        shown.append(Problem(problem.prompt, answer))
    return shown
