"""Checks that span several sections (each section validates itself; these need the whole run)."""

from __future__ import annotations

import os
from pathlib import Path

from fastlm.config.errors import ConfigIssue
from fastlm.data.config import PREFERENCE_SOURCE_TYPES
from fastlm.data.tokenizer import TokenizerError, build_tokenizer
from fastlm.lora.checks import lora_issues
from fastlm.losses.children.policy import PolicyConfig
from fastlm.run_config.schema import RunConfig


def cross_check(config: RunConfig) -> list[ConfigIssue]:
    """Problems that no single section can see; each names the field to change."""
    issues: list[ConfigIssue] = []
    model = config.model
    issues += _tokenizer_checks(config)
    if config.data.seq_len > model.max_seq_len:
        issues.append(ConfigIssue("data.seq_len", f"longer than model.max_seq_len ({model.max_seq_len})",
                                  config.data.seq_len, hint="lower data.seq_len or raise model.max_seq_len"))
    tp = config.distributed.tensor_parallel
    if model.vocab_size % tp:
        issues.append(ConfigIssue("distributed.tensor_parallel", f"does not divide model.vocab_size ({model.vocab_size})",
                                  tp, hint="pick a tensor_parallel that divides the vocab (pad the vocab if needed)"))
    issues += _frozen_model_checks(config)
    issues += _init_checkpoint_checks(config)
    issues += _rl_checks(config)
    issues += _rollout_checks(config)
    issues += _output_dir_checks(config)
    issues += _eval_source_checks(config)
    issues += lora_issues(config)
    return issues


def _eval_source_checks(config: RunConfig) -> list[ConfigIssue]:
    """data.eval_source is a document stream beside a train source of documents (not pairs, rollouts or RL)."""
    from fastlm.data.eval_source import EVAL_SOURCE_TYPES

    evaluation = config.data.eval_source
    if evaluation is None:
        return []
    if evaluation.type not in EVAL_SOURCE_TYPES:
        return [ConfigIssue("data.eval_source.type", "an eval set is a stream of documents", evaluation.type,
                            hint=f"use one of {sorted(EVAL_SOURCE_TYPES)}")]
    source = config.data.source.type
    if config.rl is not None or source in PREFERENCE_SOURCE_TYPES or source == "offline_rl":
        what = (
            "an online RL run is judged by eval/reward" if config.rl is not None
            else f"the {source} source has no eval/loss on documents"
        )
        return [ConfigIssue("data.eval_source", f"{what}: no eval set to read", evaluation.type,
                            hint="remove data.eval_source")]
    return []


def _output_dir_checks(config: RunConfig) -> list[ConfigIssue]:
    """The run directory (or the nearest folder that exists above it) must be a writable directory:
    otherwise the first checkpoint or metrics line would fail after the model is built."""
    directory = Path(config.run.directory).absolute()
    existing = next(path for path in (directory, *directory.parents) if path.exists() or path == path.parent)
    if not existing.is_dir():
        problem = f"{existing} is not a directory" + ("" if existing == directory else f" (so {directory} cannot be made)")
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable by this user"
    else:
        return []
    return [ConfigIssue("run.output_dir", problem, config.run.output_dir,
                        hint="choose a run.output_dir in a folder you can write to")]


def _rl_checks(config: RunConfig) -> list[ConfigIssue]:
    """An RL run (online `rl:` or offline_rl data) needs one policy child and room for RL steps after warm-up."""
    offline = config.data.source.type == "offline_rl"
    if config.rl is None and not offline:
        return []
    issues: list[ConfigIssue] = []
    kinds = [c.type for c in config.model.head.losses.values() if isinstance(c, PolicyConfig)]
    if len(kinds) != 1:
        issues.append(ConfigIssue("model.head.losses", f"an RL run needs exactly one policy child (grpo, gspo or cispo), found "
                                  f"{kinds or 'none'}", sorted(config.model.head.losses),
                                  hint="e.g. losses: {grpo: {type: grpo}, z_loss: {type: z_loss}}"))
    warmup = config.rl.warmup_steps if config.rl is not None else 0
    if offline and warmup:
        issues.append(ConfigIssue("rl.warmup_steps", "the supervised warm-up needs the online task, not offline_rl data",
                                  warmup, hint="set rl.warmup_steps: 0"))
    if warmup >= config.trainer.steps:
        issues.append(ConfigIssue("rl.warmup_steps", f"leaves no RL steps out of trainer.steps ({config.trainer.steps})",
                                  warmup, hint="lower it or raise trainer.steps"))
    every, updates = config.trainer.log_every, config.rl.updates_per_rollout if config.rl is not None else 1
    if every > 1 and every % updates:  # log_every 1 shows every update; others must sample the same update of each rollout
        issues.append(ConfigIssue(
            "trainer.log_every", f"is not a multiple of rl.updates_per_rollout ({updates}): the logged steps would "
            "alternate between a rollout's first update (ratio 1, kl_old 0) and later ones, so the KL and clip "
            "panels zigzag", every, hint=f"set trainer.log_every: {updates * -(-every // updates)} (or 1)"))
    return issues


def _rollout_checks(config: RunConfig) -> list[ConfigIssue]:
    """What a rollout would fail on: the completion budget, the prompt file, the reward functions' imports,
    the stop tokens, the importance-sampling mode for the policy child."""
    from fastlm.config.errors import ConfigError
    from fastlm.rl.prompts import stop_token_ids
    from fastlm.rl.rewards import load_reward_functions

    rl = config.rl
    if rl is None:
        return []
    issues: list[ConfigIssue] = []
    if rl.max_new_tokens >= config.model.max_seq_len:
        issues.append(ConfigIssue("rl.max_new_tokens", f"leaves no room for a prompt in model.max_seq_len "
                                  f"({config.model.max_seq_len})", rl.max_new_tokens, hint="lower it"))
    if rl.prompts is not None and not Path(rl.prompts.path).is_file():
        issues.append(ConfigIssue("rl.prompts.path", "no such file", rl.prompts.path))
    if hasattr(rl.eval_prompts, "path") and not Path(rl.eval_prompts.path).is_file():
        issues.append(ConfigIssue("rl.eval_prompts.path", "no such file", rl.eval_prompts.path))
    gspo = any(c.type == "gspo" for c in config.model.head.losses.values())
    if rl.importance_sampling.mode in ("token_truncate", "token_mask", "icepop") and gspo:
        issues.append(ConfigIssue("rl.importance_sampling.mode", "GSPO weighs whole sequences; per-token weights would "
                                  "be averaged into its sequence advantage", rl.importance_sampling.mode,
                                  hint="use a sequence_* mode with gspo"))
    if rl.importance_sampling.mismatch_kl_coeff > 0 and gspo:
        issues.append(ConfigIssue("rl.importance_sampling.mismatch_kl_coeff", "is a per-token advantage shift, which "
                                  "GSPO's sequence ratio would mix across tokens", rl.importance_sampling.mismatch_kl_coeff,
                                  hint="use it with grpo or cispo, or set it to 0"))
    try:
        load_reward_functions(rl.rewards)
    except ConfigError as error:
        issues += error.issues
    if rl.environment is not None:
        issues += _environment_checks(config)
    try:
        stop_token_ids(rl, build_tokenizer(config.data.tokenizer, config.run.init_path))
    except ConfigError as error:
        issues += error.issues
    except TokenizerError:
        pass  # _tokenizer_checks reports it
    return issues


def _environment_checks(config: RunConfig) -> list[ConfigIssue]:
    """The environment class imports and builds, can demonstrate for a warm-up, and an episode has room."""
    from fastlm.config.errors import ConfigError
    from fastlm.rl.environments.base import load_environment

    rl = config.rl
    assert rl is not None and rl.environment is not None
    issues: list[ConfigIssue] = []
    limit = min(config.data.seq_len + 1, config.model.max_seq_len - rl.max_new_tokens - 1)
    if limit <= rl.max_new_tokens:
        issues.append(ConfigIssue("rl.max_new_tokens", f"leaves no room for a multi-turn episode: an episode holds "
                                  f"min(data.seq_len + 1, model.max_seq_len - max_new_tokens - 1) = {limit} tokens",
                                  rl.max_new_tokens, hint="raise model.max_seq_len and data.seq_len, or lower it"))
    try:
        factory = load_environment(rl.environment, rl.format_reward)
    except ConfigError as error:
        return issues + error.issues
    if rl.warmup_steps and not callable(getattr(factory.prototype, "demonstrations", None)):
        issues.append(ConfigIssue("rl.warmup_steps", f"environment '{factory.path}' has no demonstrations(count, noise, "
                                  "seed) for the supervised warm-up", rl.warmup_steps, hint="set rl.warmup_steps: 0"))
    return issues


def _tokenizer_checks(config: RunConfig) -> list[ConfigIssue]:
    """The run's tokenizer loads and the model's vocab covers its ids (a larger, padded vocab is fine)."""
    field = "data.tokenizer" if config.data.tokenizer is not None else "run.init_path"
    try:
        tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)
    except TokenizerError as error:
        return [ConfigIssue(field, str(error))]
    if config.model.vocab_size < tokenizer.vocab_size:
        return [ConfigIssue("model.vocab_size", f"smaller than the {tokenizer.name} tokenizer's {tokenizer.vocab_size} "
                            "ids (ids past the model's vocab would crash the embedding)", config.model.vocab_size,
                            hint=f"use at least {tokenizer.vocab_size} (padding it up, e.g. to a multiple of 128, is fine), "
                            "or the tokenizer the model was trained with")]
    return []


def _init_checkpoint_checks(config: RunConfig) -> list[ConfigIssue]:
    """A HF `run.init_path` must have the architecture the model section describes exactly, so `fastlm validate`
    fails before any work instead of the trainer failing at load time (a fastlm checkpoint: preflight)."""
    from fastlm.run_config.init_path import init_source

    if config.run.init_path is None or init_source(config.run.init_path).kind != "hf":
        return []
    from fastlm.config.errors import ConfigError
    from fastlm.models.hf import check_matches, config_from_hf, read_hf_config

    try:
        check_matches(config.model, config_from_hf(read_hf_config(config.run.init_path)), config.run.init_path)
    except ConfigError as error:
        return [issue if issue.path.startswith("model.") else
                ConfigIssue("run.init_path", issue.message, config.run.init_path, hint=issue.hint)
                for issue in error.issues]
    return []


_CHECKPOINT_KEYS = {"distillation": "teacher_path", "dpo": "reference_path"}  # child type -> checkpoint field
_TRAIN_TEACHER = "train that model first: fastlm train configs/tiny.yaml (writes runs/tiny/checkpoints/latest)"


def _frozen_model_checks(config: RunConfig) -> list[ConfigIssue]:
    """Distillation needs a teacher and DPO needs preference pairs; checkpoint paths must exist."""
    issues: list[ConfigIssue] = []
    source = config.data.source.type
    for name, child in config.model.head.losses.items():
        field = f"model.head.losses.{name}"
        if child.type == "distillation" and child.teacher_path is None:
            issues.append(ConfigIssue(f"{field}.teacher_path", "distillation needs a teacher, and no data source "
                                      "brings teacher logits", None, hint="set it to a fastlm checkpoint, e.g. "
                                      f"../runs/tiny/checkpoints/latest; {_TRAIN_TEACHER}"))
        key = _CHECKPOINT_KEYS.get(child.type)
        path = getattr(child, key) if key else None
        if path is not None and not Path(path).exists():
            issues.append(ConfigIssue(f"{field}.{key}", "checkpoint not found", path, hint=_TRAIN_TEACHER))
        if key is not None and config.distributed.tensor_parallel > 1:
            issues.append(ConfigIssue("distributed.tensor_parallel", f"the frozen model of {field} is not "
                                      "vocab-sharded", config.distributed.tensor_parallel, hint="use 1 (data parallel only)"))
    if config.model.head.is_dpo and source not in PREFERENCE_SOURCE_TYPES:
        issues.append(ConfigIssue("data.source.type", "the dpo loss trains on preference pairs", source,
                                  hint=f"use one of {sorted(PREFERENCE_SOURCE_TYPES)}"))
    if source in PREFERENCE_SOURCE_TYPES and not config.model.head.is_dpo:
        issues.append(ConfigIssue("data.source.type", "preference pairs need a dpo loss in model.head.losses", source,
                                  hint="add losses: {dpo: {beta: 0.1}} alone, or use a text source"))
    return issues
