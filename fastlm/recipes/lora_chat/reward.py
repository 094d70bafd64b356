"""The recipe's reward (grpo.yaml `rl.rewards`): 1 for a completion that is the record's `answer`, else 0.

A reward function gets one list entry per completion (`completions`, plus each extra column of
prompts.jsonl, here `answer`) and returns one float or None per completion (docs/rl.md). Edit it for your
task: a regex, a unit test, a judge; keep it deterministic and quick (`rl.reward_timeout_s`).
"""


def exact_answer(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    return [1.0 if completion.strip() == str(expected).strip() else 0.0 for completion, expected in zip(completions, answer)]
