"""What running user code in its own process costs a rollout: reward functions and environment steps called
in the trainer's process (as before fastlm/rl/user_code.py) against the same calls in the user-code process.

    python tools/bench_user_code.py                         # 128 completions of 512 tokens, 2 env turns each
    python tools/bench_user_code.py --completions 1024 --tokens 2048

Rewards: one call per rollout with the reserved arguments of `--completions` completions (text of ~4
characters a token, their ids) plus an `answer` column; "here" is the function on deep copies of them in
this process, "process" the same call through `UserCodeProcess` (pickling both ways included). Environments:
per rollout, `--completions` episodes of create + reset + `--turns` steps + one release. Start: the first
call, which starts the child and imports the module. Medians of `--repeats` runs; milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastlm.config.errors import ConfigError  # noqa: E402 - after the path fix
from fastlm.rl.config import RewardConfig  # noqa: E402
from fastlm.rl.environments.base import load_environment  # noqa: E402
from fastlm.rl.environments.config import EnvironmentConfig  # noqa: E402
from fastlm.rl.prompts import PromptRecord  # noqa: E402
from fastlm.rl.rewards import load_reward_functions, score_completions  # noqa: E402

MODULE = '''
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip().endswith(a) else 0.0 for c, a in zip(completions, answer)]

class Echo:
    def reset(self, record):
        return [{"role": "user", "content": record.text}]

    def step(self, messages, completion):
        turn = sum(m["role"] == "assistant" for m in messages)
        return ([{"role": "tool", "content": completion[:64]}] if turn < 2 else None), 1.0, {"tool_calls": 1}
'''


def milliseconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def bench_rewards(count: int, tokens: int, repeats: int) -> dict[str, float]:
    arguments = {"prompts": [f"Question {i}: " + "x" * 200 for i in range(count)],
                 "completions": [("word " * (tokens // 2))[: 4 * tokens] for _ in range(count)],
                 "completion_ids": [list(range(tokens)) for _ in range(count)], "stopped": [True] * count,
                 "answer": [str(i) for i in range(count)]}
    (function,) = load_reward_functions([RewardConfig(function="bench_user_code_module:exact")])
    here = [function.__class__(function.name, function.path, function.function, 1.0)]  # no process: called here
    started = time.perf_counter()
    score_completions([function], arguments, 8)
    start = 1e3 * (time.perf_counter() - started)
    result = {"reward here ms": milliseconds(lambda: score_completions(here, arguments, 8), repeats),
              "reward process ms": milliseconds(lambda: score_completions([function], arguments, 8), repeats),
              "reward process start ms": start}
    function.process.close()
    return result


def bench_environment(count: int, turns: int, repeats: int) -> dict[str, float]:
    factory = load_environment(EnvironmentConfig(name="bench_user_code_module:Echo"), 0.1)
    here = factory.__class__(factory.path, factory.make, factory.max_turns, factory.prototype)  # no process
    record, conversation = PromptRecord("What is 1+1?"), [{"role": "assistant", "content": "I will call a tool."}]

    def rollout(chosen) -> None:
        environments = [chosen.new(i) for i in range(count)]
        for index, environment in enumerate(environments):
            chosen.reset(environment, record, index)
            for _ in range(turns):
                chosen.step(environment, conversation, "I will call a tool.", index)
        chosen.release(environments)

    started = time.perf_counter()
    rollout(factory)
    start = 1e3 * (time.perf_counter() - started)
    result = {"environment here ms": milliseconds(lambda: rollout(here), repeats),
              "environment process ms": milliseconds(lambda: rollout(factory), repeats),
              "environment process first rollout ms": start}
    factory.process.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "bench_user_code_module.py").write_text(textwrap.dedent(MODULE))
        sys.path.insert(0, folder)
        try:
            result = {"completions": args.completions, "tokens": args.tokens, "turns": args.turns,
                      **bench_rewards(args.completions, args.tokens, args.repeats),
                      **bench_environment(args.completions, args.turns, args.repeats)}
        except ConfigError as error:
            raise SystemExit(str(error)) from error
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value:.2f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
