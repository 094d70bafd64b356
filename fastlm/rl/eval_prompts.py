"""Which prompts the greedy eval of a run on a prompt data set (`rl.prompts`, or an eval JSONL) decodes.

`rl.eval_prompts` picks them: a JSONL of eval prompts, or prompts held out of `rl.prompts` (a fraction
of the file, or a count, at most a tenth of it), chosen by the run's seed and removed from the training
prompts before the first rollout. rl/evaluation.py decodes them greedily and scores them by the run's
reward functions.
"""

from __future__ import annotations

import random

from fastlm.data.tokenizer import Tokenizer
from fastlm.rl.config import JsonlPromptsConfig, RLConfig
from fastlm.rl.prompts import JsonlPrompts, PromptRecord, PromptSource

HELD_OUT_SHARE = 10  # a count of eval prompts takes at most 1/HELD_OUT_SHARE of rl.prompts


def eval_records(config: RLConfig, source: PromptSource, tokenizer: Tokenizer, max_prompt_tokens: int,
                 seed: int) -> tuple[list[PromptRecord], str]:
    """(the eval prompts, a line that says where they come from). Held-out prompts leave `source`."""
    chosen = config.eval_prompts
    if isinstance(chosen, JsonlPromptsConfig):
        records = JsonlPrompts(chosen, tokenizer, max_prompt_tokens).records
        return records, f"rl: eval/reward on the {len(records)} prompts of {chosen.path} (rl.eval_prompts)"
    if not chosen or not isinstance(source, JsonlPrompts):
        return [], "rl: no eval (rl.eval_prompts: 0)"
    records = source.records
    if isinstance(chosen, float):
        count = min(max(1, round(chosen * len(records))), len(records) - 1)
    else:
        count = min(chosen, len(records) // HELD_OUT_SHARE)
    if count <= 0:
        return [], (f"rl: no eval: {len(records)} prompts in rl.prompts are too few to hold out {chosen} "
                    f"(at most a {HELD_OUT_SHARE}th of them); give rl.eval_prompts a fraction or an eval JSONL")
    held = set(random.Random(seed).sample(range(len(records)), count))
    source.records = [record for index, record in enumerate(records) if index not in held]
    return [records[index] for index in sorted(held)], (
        f"rl: eval/reward on {count} prompts held out of {config.prompts.path} (rl.eval_prompts), "
        f"{len(source.records)} left to train on")
