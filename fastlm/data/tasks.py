"""Verifiable tasks: prompts with one right answer and a programmatic reward, learnable by a tiny byte model.

A completion is the text the policy writes after the prompt, up to (not including) the stop token.
Reward: 1 for a correct answer followed by the stop token (`Task.is_correct`: the exact text, or for the
arithmetic chain the final number); `format_reward` for a well-formed but wrong answer that stops; 0
otherwise (rambling, no stop token, wrong characters).
"""

from __future__ import annotations

import random
import re
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

    def is_correct(self, problem: Problem, text: str) -> bool: ...


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

    def is_correct(self, problem: Problem, text: str) -> bool:
        return text == problem.answer


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

    def is_correct(self, problem: Problem, text: str) -> bool:
        return text == problem.answer


FINAL_ANSWER = re.compile(r"Answer: (-?\d+)$")


@dataclass(frozen=True)
class ArithmeticChainTask:
    """"Start with 7. Add 5. Take away 3. Multiply by 2. What is the result?" -> "7+5=12 12-3=9 9*2=18 Answer: 18".

    The demonstrated answer shows every step (tens of byte tokens for 3 steps); a completion is correct
    when its final "Answer: N" carries the right number, however the steps are written.
    """

    steps: int = 3
    max_operand: int = 9

    def sample(self, rng: random.Random) -> Problem:
        value = rng.randint(1, self.max_operand)
        words, work = [f"Start with {value}."], []
        for _ in range(self.steps):
            kind = rng.choice(("add", "take", "multiply") if value <= 50 else ("add", "take"))
            if kind == "take" and value == 0:
                kind = "add"
            operand = rng.randint(2, 3) if kind == "multiply" else rng.randint(1, self.max_operand)
            if kind == "take":
                operand = min(operand, value)
            result = {"add": value + operand, "take": value - operand, "multiply": value * operand}[kind]
            words.append({"add": f"Add {operand}.", "take": f"Take away {operand}.",
                          "multiply": f"Multiply by {operand}."}[kind])
            work.append(f"{value}{ {'add': '+', 'take': '-', 'multiply': '*'}[kind] }{operand}={result}")
            value = result
        return Problem(" ".join(words) + " What is the result? ", " ".join(work) + f" Answer: {value}")

    def well_formed(self, text: str) -> bool:
        return text.isascii() and FINAL_ANSWER.search(text) is not None

    def wrong_answer(self, problem: Problem, rng: random.Random) -> str:
        """The worked answer with the final number off by 1..3 (a slip in the last step)."""
        right = int(FINAL_ANSWER.search(problem.answer).group(1))  # type: ignore[union-attr]
        wrong = right + rng.choice((-3, -2, -1, 1, 2, 3))
        wrong = wrong if wrong >= 0 else right + 1
        head = problem.answer.rsplit("=", 1)[0]
        return f"{head}={wrong} Answer: {wrong}"

    def is_correct(self, problem: Problem, text: str) -> bool:
        got, want = FINAL_ANSWER.search(text), FINAL_ANSWER.search(problem.answer)
        return got is not None and want is not None and int(got.group(1)) == int(want.group(1))


def score(task: Task, problem: Problem, completion: str, stopped: bool, format_reward: float) -> float:
    """The reward of one completion (see the module docstring)."""
    if not stopped:
        return 0.0
    if task.is_correct(problem, completion):
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
