"""Checks of an RL run (online `rl:` or offline_rl data) that need more than the `rl:` section: the loss head's
policy child, the step budget, the prompt files, the reward functions' and environment's imports, the stop
tokens against the run's tokenizer. `cross_check` (fastlm/run_config/checks.py) runs them with the rest."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.tokenizer import TokenizerError, build_tokenizer
from fastlm.generation.backend_config import BackendConfig, NativeBackendConfig, missing_packages
from fastlm.generation.engine import SMALLEST_BLOCK_SIZE
from fastlm.generation.paged_cache import PagedKVCache
from fastlm.losses.children.policy import PolicyConfig
from fastlm.models.hf import config_to_hf
from fastlm.models.moe_family import MoESettings
from fastlm.rl.environments.base import load_environment
from fastlm.rl.prompts import stop_token_ids
from fastlm.rl.rewards import load_reward_functions

if TYPE_CHECKING:
    from fastlm.run_config.schema import RunConfig


def rl_issues(config: RunConfig) -> list[ConfigIssue]:
    """Every problem of an RL run that its sections alone cannot show; none for other runs."""
    return [*_run_issues(config), *_rollout_issues(config)]


def _run_issues(config: RunConfig) -> list[ConfigIssue]:
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
    return [*issues, *_policy_lag_issues(config)]


def _policy_lag_issues(config: RunConfig) -> list[ConfigIssue]:
    """A lag that leaves each rollout sampled ahead at least its first update (one process: preflight's world
    check refuses more)."""
    rl = config.rl
    if rl is None or not rl.max_policy_lag:
        return []
    issues = []
    if rl.max_policy_lag < rl.updates_per_rollout and rl.stale_samples == "drop":
        issues.append(ConfigIssue("rl.max_policy_lag", f"is below rl.updates_per_rollout ({rl.updates_per_rollout}): "
                                  "a rollout sampled one rollout ahead is that many steps old at its first update, so "
                                  "every one would be dropped", rl.max_policy_lag,
                                  hint=f"set it to at least {rl.updates_per_rollout}, or rl.stale_samples: keep"))
    return issues


def _rollout_issues(config: RunConfig) -> list[ConfigIssue]:
    """What a rollout would fail on: the completion budget, the prompt file, the reward functions' imports,
    the stop tokens, the importance-sampling mode for the policy child, what the sampler's old log-probs allow."""
    rl = config.rl
    if rl is None:
        return []
    issues: list[ConfigIssue] = []
    samples, micro_batches = rl.prompts_per_rollout * rl.group_size, config.trainer.grad_accumulation
    if samples < micro_batches:
        issues.append(ConfigIssue("rl.prompts_per_rollout", f"x rl.group_size ({rl.group_size}) = {samples} completions "
                                  f"per rollout cannot fill trainer.grad_accumulation = {micro_batches} micro-batches",
                                  rl.prompts_per_rollout, hint=f"raise it to at least {-(-micro_batches // rl.group_size)}, "
                                  "or lower trainer.grad_accumulation"))
    if rl.max_new_tokens >= config.model.max_seq_len:
        issues.append(ConfigIssue("rl.max_new_tokens", f"leaves no room for a prompt in model.max_seq_len "
                                  f"({config.model.max_seq_len})", rl.max_new_tokens, hint="lower it"))
    backend = rl.backend
    if isinstance(backend, NativeBackendConfig) and backend.generation == "engine" and backend.kv_cache_memory_gib:
        issues += _kv_cache_issues(config, backend.kv_cache_memory_gib)
    issues += backend_issues(backend)
    if rl.routing_replay and not isinstance(getattr(config.model, "moe", None), MoESettings):
        issues.append(ConfigIssue("rl.routing_replay", f"replays the routing of MoE layers, and model type "
                                  f"{config.model.type} has none", True, hint="set rl.routing_replay: false"))
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
    selecting = [(name, c) for name, c in config.model.head.losses.items()
                 if isinstance(c, PolicyConfig) and c.top_entropy_quantile < 1.0]
    if rl.importance_sampling.mismatch_kl_coeff > 0 and selecting:
        name, child = selecting[0]
        issues.append(ConfigIssue("rl.importance_sampling.mismatch_kl_coeff", "is folded into the advantages, which "
                                  f"model.head.losses.{name}.top_entropy_quantile {child.top_entropy_quantile:g} zeroes on "
                                  "the tokens it leaves out (the KL must act on every token)",
                                  rl.importance_sampling.mismatch_kl_coeff,
                                  hint=f"set model.head.losses.{name}.top_entropy_quantile: 1.0, or mismatch_kl_coeff: 0"))
    if rl.old_logprobs == "sampler":
        issues += _sampler_logprob_issues(config)
    if rl.teacher is not None:
        issues += _teacher_issues(config)
    try:
        load_reward_functions(rl.rewards)
    except ConfigError as error:
        issues += error.issues
    if rl.environment is not None:
        issues += _environment_issues(config)
    try:
        tokenizer = build_tokenizer(config.data.tokenizer, config.run.init_path)
        stop_token_ids(rl, tokenizer)
        if rl.backend.type == "transformers":  # its replica is the HF export: a model without one is refused now
            config_to_hf(config.model, tokenizer)
    except ConfigError as error:
        issues += error.issues
    except TokenizerError:
        pass  # cross_check's tokenizer check reports it
    if rl.backend.type == "transformers" and config.distributed.tensor_parallel > 1:
        issues.append(ConfigIssue("rl.backend.type", "the transformers backend's replica holds the whole vocab; "
                                  "it does not take a vocab-parallel head", rl.backend.type,
                                  hint="use rl.backend.type native, or distributed.tensor_parallel: 1"))
    return issues


def backend_issues(backend: BackendConfig) -> list[ConfigIssue]:
    """A backend whose Python package is not installed, refused before any work."""
    return [ConfigIssue("rl.backend.type", f"needs the Python package {name}, which is not installed", backend.type,
                        hint=f"pip install {name}, or use rl.backend.type native") for name in missing_packages(backend)]


def _kv_cache_issues(config: RunConfig, memory_gib: float) -> list[ConfigIssue]:
    """The engine's paged cache (`memory_gib`) must hold one sequence of model.max_seq_len tokens (counted at the
    smallest block size and cache dtype a run can have: an error here is an error on every device)."""
    model = config.model
    dtype = torch.float32 if config.trainer.precision == "fp32" else torch.bfloat16
    block = PagedKVCache.block_bytes(model.num_layers, model.kv_heads, model.head_dim, SMALLEST_BLOCK_SIZE, dtype)
    needed = (-(-model.max_seq_len // SMALLEST_BLOCK_SIZE) + 1) * block  # + the scratch block
    if needed <= memory_gib * 2**30:
        return []
    return [ConfigIssue("rl.backend.kv_cache_memory_gib", f"cannot hold one sequence of model.max_seq_len "
                        f"({model.max_seq_len}) tokens, which needs {needed / 2**30:.3g} GiB", memory_gib,
                        hint=f"raise it to at least {needed / 2**30:.3g} (or leave it unset: a share of free memory)")]


def _sampler_logprob_issues(config: RunConfig) -> list[ConfigIssue]:
    """`rl.old_logprobs: sampler` trains on the sampler's log-probs: nothing may need the trainer's, and the
    sampler may not truncate its distribution."""
    rl = config.rl
    assert rl is not None
    issues: list[ConfigIssue] = []
    correction = rl.importance_sampling
    if correction.mode != "none" or correction.mismatch_kl_coeff > 0:
        issues.append(ConfigIssue("rl.old_logprobs", "sampler skips the trainer's forward that rl.importance_sampling "
                                  "weighs against the sampler's log-probs", rl.old_logprobs,
                                  hint="set rl.importance_sampling.mode: none and mismatch_kl_coeff: 0 (the policy "
                                  "ratio then carries the gap), or rl.old_logprobs: trainer"))
    if rl.top_p < 1.0 or rl.top_k > 0:
        issues.append(ConfigIssue("rl.old_logprobs", f"sampler with top_p {rl.top_p} / top_k {rl.top_k}: the sampler's "
                                  "log-probs are of the truncated distribution, so every ratio would start below 1 by "
                                  "the mass cut off and the clip would silence negative advantages", rl.old_logprobs,
                                  hint="set rl.top_p: 1.0 and rl.top_k: 0, or rl.old_logprobs: trainer"))
    return issues


def _environment_issues(config: RunConfig) -> list[ConfigIssue]:
    """The environment class imports and builds, can demonstrate for a warm-up, and an episode has room."""
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


def _teacher_issues(config: RunConfig) -> list[ConfigIssue]:
    """rl.teacher scores online rollouts with the run's own tokenizer (fastlm/rl/teacher.py)."""
    from fastlm.data.tokenizer import build_tokenizer
    from fastlm.rl.teacher import teacher_issues

    if config.data.source.type == "offline_rl":
        return [ConfigIssue("rl.teacher", "the teacher scores the policy's own samples; offline_rl data is not sampled",
                            config.rl.teacher.path if config.rl and config.rl.teacher else None,
                            hint="remove rl.teacher, or distill offline with a distillation loss child")]
    return _gkd_issues(config) + teacher_issues(config, build_tokenizer(config.data.tokenizer, config.run.init_path))


def _gkd_issues(config: RunConfig) -> list[ConfigIssue]:
    """objective gkd trains the head's distillation child on rl.teacher's distributions; reverse_kl has no use for one."""
    assert config.rl is not None and config.rl.teacher is not None
    objective = config.rl.teacher.objective
    found = config.model.head.child_of_type("distillation")
    if objective == "gkd" and found is None:
        return [ConfigIssue("rl.teacher.objective", "gkd trains the head's distillation child on the teacher's "
                            "distributions over the student's samples, and model.head.losses has none", objective,
                            hint="add losses: {distillation: {kl: jsd, beta: 0.5}} (next to the policy child, or alone)")]
    if found is not None and objective == "reverse_kl":
        return [ConfigIssue(f"model.head.losses.{found[0]}", "in an RL run the distillation child reads rl.teacher's "
                            "head input, which only rl.teacher.objective gkd hands it", "distillation",
                            hint="set rl.teacher.objective: gkd, or remove the distillation child")]
    if found is not None and found[1].teacher_path is not None:
        return [ConfigIssue(f"model.head.losses.{found[0]}.teacher_path", "with rl.teacher.objective gkd the teacher is "
                            "rl.teacher.path", found[1].teacher_path, hint="remove teacher_path")]
    return []
