"""The built-in environment: arithmetic a small model cannot do in its head, with a calculator tool.

A problem is an expression of `operations` operations on operands up to `max_operand` ("What is 37*24+19?");
the answer ends "Answer: N". The policy may call the calculator (`<tool_call>{"name": "calculator",
"arguments": {"expression": "37*24+19"}}</tool_call>`), reads its result as a "tool" message and answers
in a later turn. Reward as the built-in tasks: 1 for the right final number, `format_reward` for a
well-formed wrong answer, 0 otherwise (an episode that never answers gets 0). Demonstrations for the
warm-up call the tool in a `tool_share` of the problems and answer directly in the rest (right or, with
`noise`, off by a little), so a warmed-up policy sometimes uses the tool and RL can learn that it pays.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from fastlm.config.base import ConfigModel
from fastlm.data.tasks import FINAL_ANSWER, Problem, score
from fastlm.data.tokenizer import Message
from fastlm.rl.environments.calculator import calculator, evaluate, format_number
from fastlm.rl.environments.tool_calls import (
    MalformedCall,
    format_tool_call,
    parse_tool_calls,
)
from fastlm.rl.prompts import PromptRecord

TOOL = "calculator"


class ToolArithmeticOptions(ConfigModel):
    operations: int = Field(2, ge=1, le=6, description="Operations per problem (+, -, *).")
    max_operand: int = Field(99, ge=2, le=9999)
    tool_share: float = Field(0.5, ge=0.0, le=1.0, description="Share of warm-up demonstrations that call the tool.")
    system_prompt: str | None = Field(None, description="A system message before the problem (e.g. the tool's "
                                      "description for a model that was not warmed up on it).")


@dataclass(frozen=True)
class ToolArithmeticTask:
    """The problems (a built-in `Task`: prompts, the eval's check)."""

    operations: int = 2
    max_operand: int = 99

    def sample(self, rng: random.Random) -> Problem:
        expression = str(rng.randint(2, self.max_operand))
        for _ in range(self.operations):
            expression += rng.choice("+-*") + str(rng.randint(2, self.max_operand))
        return Problem(f"What is {expression}?", f"Answer: {format_number(evaluate(expression))}")

    @staticmethod
    def expression(problem: Problem) -> str:
        return problem.prompt.removeprefix("What is ").removesuffix("?")

    def well_formed(self, text: str) -> bool:
        return text.isascii() and FINAL_ANSWER.search(text) is not None

    def wrong_answer(self, problem: Problem, rng: random.Random) -> str:
        right = int(FINAL_ANSWER.search(problem.answer).group(1))  # type: ignore[union-attr]
        return f"Answer: {right + rng.choice((-3, -2, -1, 1, 2, 3))}"

    def is_correct(self, problem: Problem, text: str) -> bool:
        got, want = FINAL_ANSWER.search(text), FINAL_ANSWER.search(problem.answer)
        return got is not None and want is not None and int(got.group(1)) == int(want.group(1))


class ToolArithmetic:
    """One episode of the calculator task (the environment interface of fastlm/rl/environments/base.py)."""

    def __init__(self, options: ToolArithmeticOptions, format_reward: float) -> None:
        self.options = options
        self.format_reward = format_reward
        self.task = ToolArithmeticTask(options.operations, options.max_operand)
        self.problem: Problem | None = None

    def _opening(self, question: str) -> list[Message]:
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return system + [{"role": "user", "content": question}]

    def reset(self, record: PromptRecord) -> list[Message]:
        self.problem = Problem(record.text, record.columns["answer"])
        return self._opening(record.text)

    def step(self, messages: list[Message], completion: str) -> tuple[list[Message] | None, float | None, dict[str, Any]]:
        calls = parse_tool_calls(completion)
        if not calls:
            assert self.problem is not None
            return None, score(self.task, self.problem, completion, True, self.format_reward), {}
        results, errors = [], 0
        for call in calls:
            if isinstance(call, MalformedCall):
                result = f"error: {call.reason}"
            elif call.name != TOOL:
                result = f"error: unknown tool '{call.name}' (the tool is '{TOOL}')"
            elif not isinstance(call.arguments.get("expression"), str):
                result = 'error: the calculator takes {"expression": "<arithmetic>"}'
            else:
                result = calculator(call.arguments["expression"])
            errors += result.startswith("error:")
            results.append({"role": "tool", "content": result})
        return results, None, {"tool_calls": len(calls), "tool_errors": errors}

    def demonstrations(self, count: int, noise: float, seed: int) -> list[list[Message]]:
        """Solved conversations for the warm-up (see the module docstring)."""
        rng = random.Random(seed)
        shown = []
        for _ in range(count):
            problem = self.task.sample(rng)
            opening = self._opening(problem.prompt)
            if rng.random() < self.options.tool_share:
                expression = self.task.expression(problem)
                shown.append(opening + [
                    {"role": "assistant", "content": format_tool_call(TOOL, {"expression": expression})},
                    {"role": "tool", "content": calculator(expression)},
                    {"role": "assistant", "content": problem.answer},
                ])
            else:
                answer = self.task.wrong_answer(problem, rng) if rng.random() < noise else problem.answer
                shown.append(opening + [{"role": "assistant", "content": answer}])
        return shown
