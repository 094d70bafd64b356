"""`fastlm validate` and `train --dry-run`: the start's checks of the machine and the run directory (the loader
has checked the config), then the report of what training would do: model size and memory, loss path, data."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from fastlm.commands.errors import exit_status
from fastlm.config.errors import ConfigError
from fastlm.data.config import PREPARED_SOURCE_TYPES
from fastlm.data.datasets import DataError
from fastlm.data.eval_source import build_run_loaders
from fastlm.data.summary import check_batch_fits, summarize
from fastlm.data.tokenizer import build_tokenizer
from fastlm.engine.compile import describe_training_path
from fastlm.engine.lora_training import lora_base_dtype
from fastlm.engine.memory import predict_training_memory
from fastlm.engine.preflight import preflight_issues, run_dir_issues
from fastlm.engine.runtime import describe_head
from fastlm.lora.checks import describe_lora
from fastlm.models import active_parameters, build_model, count_parameters
from fastlm.run_config.loader import dump_config
from fastlm.system.run_dir import RunDirError

if TYPE_CHECKING:
    from fastlm.data.tokenizer import Tokenizer
    from fastlm.run_config.schema import RunConfig


def validate_command(config: RunConfig, dry_run: bool, resume: bool) -> int:
    """`validate` and `train --dry-run`: the start's checks and the report; exit 2 on any problem."""
    try:
        issues = [*preflight_issues(config), *run_dir_issues(config, resume)]
        if issues:
            raise ConfigError(issues)
        report = describe_run(config)
    except (ConfigError, DataError, RunDirError) as error:
        return exit_status(error)
    print(dump_config(config), end="")
    print("---")
    print(report)
    print("config OK" + (" (dry run: nothing trained, nothing written)" if dry_run else ""))
    return 0


def describe_run(config: RunConfig) -> str:
    """What a dry run reports: the model's size, memory estimate, the loss implementation and the data."""
    model = build_model(config.model, device="meta")
    parameters = count_parameters(model)
    device = torch.device("cuda" if config.trainer.device != "cpu" and torch.cuda.is_available() else "cpu")
    memory = predict_training_memory(config, device)
    lines = [
        f"model: {config.model.type}, {parameters:,} parameters ({parameters / 1e6:.2f} M), "
        f"{active_parameters(config.model):,} active per token",
        f"{memory.describe()}, one micro-batch of {config.data.micro_batch_size} x {config.data.seq_len} on {device.type}",
        *([] if config.model.lora is None else [describe_lora(config, lora_base_dtype(config, device))]),
        describe_head(config, device),
        describe_training_path(config.trainer.compile, config.trainer.activation_checkpointing, device,
                               config.model.head_dim, config.distributed.data_parallel),
        describe_data(config),
        f"run directory: {config.run.directory}",
    ]
    return "\n".join(lines)


def describe_data(config: RunConfig) -> str:
    """The data summary, from the rows the trainer would pack (raises what the trainer's loaders raise)."""
    evaluation = config.data.eval_source
    if evaluation is None:
        return _describe_data(config)
    where = getattr(evaluation, "path", None) or f"{evaluation.type} documents"
    return (f"{_describe_data(config)}\ndata: the eval set is data.eval_source ({evaluation.type}: {where}), read "
            "whole; the train source is not split (data.eval_fraction is not used)")


def _describe_data(config: RunConfig) -> str:
    tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)
    data, trainer = config.data, config.trainer
    dp = max(int(os.environ.get("WORLD_SIZE", "1")) // config.distributed.tensor_parallel, 1)
    batch_rows = data.micro_batch_size * dp
    if config.rl is not None:  # online RL: rollouts come from the policy, not from a data set
        return describe_rl_data(config, tokenizer, dp)
    if data.source.type in PREPARED_SOURCE_TYPES:
        from fastlm.data.memmap import describe_prepared

        return describe_prepared(data, config.run.seed, tokenizer, batch_rows * trainer.grad_accumulation, trainer.steps)
    if data.source.type == "offline_rl":
        from fastlm.data.offline_rl import load_offline_rl
        from fastlm.rl.packing import pack_policy_samples

        train, evaluation = (
            pack_policy_samples(load_offline_rl(data.source.path, tokenizer), data.seq_len, tokenizer.pad_id),
            None,
        )
    else:
        batched = data.model_copy(update={"micro_batch_size": batch_rows})
        loaders = build_run_loaders(batched, config.run.seed, tokenizer)
        train, evaluation = loaders[0].rows, loaders[1].rows if loaders[1] is not None else None
    note = check_batch_fits(train, evaluation, batch_rows, trainer.eval_batches * batch_rows if trainer.eval_every else 0)
    summary = summarize(train, evaluation, data.seq_len, batch_rows, trainer.grad_accumulation, trainer.steps,
                        tokenizer.bos_id)
    return summary.describe() + (f"\n{note}" if note else "")


def describe_rl_data(config: RunConfig, tokenizer: Tokenizer, dp: int) -> str:
    """Where an online RL run's prompts come from (the prompt file, loaded and checked as the trainer loads it,
    or the built-in task) and what scores them; data.source is not read."""
    from fastlm.rl.prompts import JsonlPrompts

    rl = config.rl
    assert rl is not None
    if rl.environment is not None:
        return (f"data: online multi-turn RL in the {rl.environment.name} environment (up to {rl.environment.max_turns} "
                f"turns), {rl.prompts_per_rollout * dp} prompts x {rl.group_size} episodes per rollout, "
                f"{rl.warmup_steps} supervised warm-up steps; data.source is not read")
    if rl.prompts is not None:
        prompts = JsonlPrompts(rl.prompts, tokenizer, config.model.max_seq_len - rl.max_new_tokens)
        count = len(prompts.records)
        source = (f"{count} prompt{'s' if count != 1 else ''} from {rl.prompts.path} (rl.prompts; the {rl.task.type} "
                  "task is not used)")
    else:
        source = f"the built-in {rl.task.type} task (rl.task; set rl.prompts for a prompt file)"
    rewards = ", ".join(reward.function for reward in rl.rewards) or f"the {rl.task.type} task's own reward"
    return (f"data: online RL on {source}, {rl.prompts_per_rollout * dp} prompts x {rl.group_size} completions per "
            f"rollout, scored by {rewards}; {rl.warmup_steps} supervised warm-up steps; data.source is not read")
