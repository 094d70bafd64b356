"""Checks that span several sections (each section validates itself; these need the whole run)."""

from __future__ import annotations

import os
from pathlib import Path

from fastlm.config.errors import ConfigIssue
from fastlm.data.config import PREFERENCE_SOURCE_TYPES
from fastlm.data.tokenizer import TokenizerError, build_tokenizer
from fastlm.lora.checks import lora_issues
from fastlm.rl.checks import rl_issues
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
    issues += rl_issues(config)
    issues += _output_dir_checks(config)
    issues += _eval_source_checks(config)
    issues += lora_issues(config)
    issues += _tiled_mlp_checks(config)
    return issues


def _tiled_mlp_checks(config: RunConfig) -> list[ConfigIssue]:
    """The tiled MLP recomputes each tile in backward: the recomputation must be the forward exactly (no dropout
    draw) and count nothing twice (an MoE router's losses and loads are counted per forward)."""
    if not config.trainer.mlp_tile_len:
        return []
    if config.model.active_blocks_parameters() < config.model.blocks_parameters():  # a mixture of experts
        return [ConfigIssue("trainer.mlp_tile_len", "the tiled MLP serves dense MLPs; an MoE layer's router losses would "
                            "be counted once per recomputed tile", config.trainer.mlp_tile_len,
                            hint="set trainer.mlp_tile_len: 0")]
    if config.model.dropout:
        return [ConfigIssue("trainer.mlp_tile_len", "the tiled MLP recomputes each tile in backward, which would draw "
                            f"other dropout masks (model.dropout={config.model.dropout})", config.trainer.mlp_tile_len,
                            hint="set model.dropout: 0.0, or trainer.mlp_tile_len: 0")]
    return []


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
    from fastlm.engine.init_path import init_source

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


_TRAIN_TEACHER = "train that model first: fastlm train configs/tiny.yaml (writes runs/tiny/checkpoints/latest)"


def _frozen_model_checks(config: RunConfig) -> list[ConfigIssue]:
    """The frozen models the loss children declare: a teacher must come from somewhere, checkpoints must exist,
    and none is vocab-sharded; DPO needs preference pairs."""
    issues: list[ConfigIssue] = []
    source = config.data.source.type
    rl_teacher = config.rl.teacher if config.rl is not None else None
    gkd = rl_teacher is not None and rl_teacher.objective == "gkd"  # rl.teacher brings the teacher (rl/checks.py)
    for child, need in config.model.head.frozen_models():
        field = f"{child}.{need.key}"
        if need.role == "teacher" and need.path is None and not gkd:
            issues.append(ConfigIssue(field, "distillation needs a teacher, and no data source brings teacher "
                                      "logits", None, hint="set it to a fastlm checkpoint, e.g. "
                                      f"../runs/tiny/checkpoints/latest; {_TRAIN_TEACHER}"))
        if need.path is not None and not Path(need.path).exists():
            issues.append(ConfigIssue(field, "checkpoint not found", need.path, hint=_TRAIN_TEACHER))
        if config.distributed.tensor_parallel > 1:
            issues.append(ConfigIssue("distributed.tensor_parallel", f"the frozen model of {child} is not "
                                      "vocab-sharded", config.distributed.tensor_parallel, hint="use 1 (data parallel only)"))
    if config.model.head.is_dpo and source not in PREFERENCE_SOURCE_TYPES:
        issues.append(ConfigIssue("data.source.type", "the dpo loss trains on preference pairs", source,
                                  hint=f"use one of {sorted(PREFERENCE_SOURCE_TYPES)}"))
    if source in PREFERENCE_SOURCE_TYPES and not config.model.head.is_dpo:
        issues.append(ConfigIssue("data.source.type", "preference pairs need a dpo loss in model.head.losses", source,
                                  hint="add losses: {dpo: {beta: 0.1}} alone, or use a text source"))
    return issues
