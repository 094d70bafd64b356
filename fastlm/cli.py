"""`fastlm train | validate | print-config | convert | prepare | generate`: the one command users run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastlm.config.errors import ConfigError
from fastlm.run_config.loader import dump_config, load_config
from fastlm.run_config.schema import RunConfig

if TYPE_CHECKING:
    from fastlm.data.tokenizer import Tokenizer


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config (may inherit others through `base:`)")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides, values parsed as YAML")
    parser.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="another override (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastlm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train from a config")
    _add_config_arguments(train)
    train.add_argument("--dry-run", action="store_true", help="validate and report, train nothing, write nothing")
    train.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    train.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="start N processes on this machine (torchrun) after checking the config once")
    validate = commands.add_parser("validate", help="resolve and check a config, build the model on meta")
    _add_config_arguments(validate)
    validate.add_argument("--resume", action="store_true", help="check as `train --resume` would (a checkpoint to "
                          "continue) instead of a fresh start (no earlier run in the directory)")
    show = commands.add_parser("print-config", help="print the fully resolved config as YAML")
    _add_config_arguments(show)
    show.add_argument("--describe", action="store_true", help="add each field's description as a # comment")
    convert = commands.add_parser("convert", help="import / export Hugging Face checkpoints (config.json + safetensors)")
    direction = convert.add_mutually_exclusive_group(required=False)  # --merge-lora --to DIR takes none of them
    direction.add_argument("--from-hf", metavar="DIR", help="HF checkpoint to import: prints the matching model YAML")
    direction.add_argument("--to-hf", metavar="DIR", help="write the fastlm model given by --from as a HF checkpoint")
    direction.add_argument("--to-peft", metavar="DIR", help="write a LoRA run's adapters (--from) as a HF PEFT adapter")
    direction.add_argument("--from-peft", metavar="DIR", help="a HF PEFT adapter -> a fastlm adapter folder (--to)")
    convert.add_argument("--merge-lora", action="store_true", help="merge a LoRA run (--from) into --to or --to-hf")
    convert.add_argument("--to", metavar="DIR", help="with --from-hf: also write model.yaml + model.safetensors here")
    convert.add_argument("--from", dest="from_fastlm", metavar="DIR",
                         help="with --to-hf: a checkpoint (step, checkpoints or run folder) or a --to folder")
    prepare = commands.add_parser("prepare", help="tokenize local text/JSONL/Parquet/CSV files into a memory-mapped "
                                  "data set (data.source: {type: memmap, path})")
    prepare.add_argument("config", help="YAML prepare config: tokenizer, input_path, output_path, record fields, num_proc")
    prepare.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides, values parsed as YAML")
    prepare.add_argument("--verify", action="store_true", help="check the set at output_path in full (files, offsets, "
                         "the tokens' sha256, every id) instead of writing it")
    generate = commands.add_parser("generate", help="print a trained model's completions of prompts")
    from fastlm.engine.generate import add_arguments

    add_arguments(generate)
    return parser


def describe_run(config: RunConfig) -> str:
    """What a dry run reports: the model's size, memory estimate, the loss implementation and the data."""
    import torch

    from fastlm.engine.compile import describe_training_path
    from fastlm.engine.runtime import describe_head
    from fastlm.lora.checks import describe_lora
    from fastlm.lora.training import lora_base_dtype
    from fastlm.models import active_parameters, build_model, count_parameters, estimate_memory

    model = build_model(config.model, device="meta")
    parameters = count_parameters(model)
    memory = estimate_memory(config.model)
    device = torch.device("cuda" if config.trainer.device != "cpu" and torch.cuda.is_available() else "cpu")
    lines = [
        f"model: {config.model.type}, {parameters:,} parameters ({parameters / 1e6:.2f} M), "
        f"{active_parameters(config.model):,} active per token",
        f"estimated training memory (params + grads + AdamW, fp32): {memory / 2**30:.3f} GiB",
        *([] if config.model.lora is None else [describe_lora(config, lora_base_dtype(config, device))]),
        describe_head(config, device),
        describe_training_path(config.trainer.compile, config.trainer.activation_checkpointing, device,
                               config.distributed.data_parallel),
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
    from fastlm.data.config import PREPARED_SOURCE_TYPES
    from fastlm.data.eval_source import build_run_loaders
    from fastlm.data.summary import check_batch_fits, summarize
    from fastlm.data.tokenizer import build_tokenizer

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
                        tokenizer.pad_id, tokenizer.bos_id)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow flags (`train c.yaml --dry-run a.b=1`), where argparse leaves them over.
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and args.command in ("convert", "generate")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if args.command == "generate":
        from fastlm.engine.generate import generate_command

        return generate_command(args)
    if args.command == "convert" and (args.to_peft or args.from_peft or args.merge_lora):
        from fastlm.lora.convert import lora_convert_command

        return lora_convert_command(args.from_fastlm, args.to, args.to_hf, args.to_peft, args.from_peft, args.merge_lora)
    if args.command == "convert":
        from fastlm.engine.convert import convert_command

        return convert_command(args.from_hf, args.to, args.from_fastlm, args.to_hf)
    if args.command == "prepare":
        from fastlm.data.prepare import prepare_command

        return prepare_command(args.config, [*args.overrides, *extra], args.verify)
    overrides = [*args.overrides, *extra, *args.set_overrides]
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        print(error.render(), file=sys.stderr)
        return 2
    if args.command == "print-config":
        if args.describe:
            from fastlm.run_config.describe import describe_config

            print(describe_config(config), end="")
        else:
            print(dump_config(config), end="")
        return 0
    if args.command == "validate" or args.dry_run:
        return _validate(config, dry_run=args.command == "train", resume=args.resume)
    if args.nproc_per_node is not None:
        from fastlm.engine.launch import launch_processes

        return launch_processes(config, args.nproc_per_node, argv if argv is not None else sys.argv[1:])
    from fastlm.engine.launch import run_training

    return run_training(config, resume=args.resume)


def _validate(config: RunConfig, dry_run: bool, resume: bool) -> int:
    """`validate` and `train --dry-run`: the trainer's start-up checks and the report; exit 2 on any problem."""
    from fastlm.data.datasets import DataError
    from fastlm.engine.preflight import preflight_issues, run_dir_issues

    try:
        issues = [*preflight_issues(config), *run_dir_issues(config, resume)]
        if issues:
            raise ConfigError(issues)
        report = describe_run(config)
    except ConfigError as error:
        print(error.render(), file=sys.stderr)
        return 2
    except DataError as error:
        print(f"fastlm: {error}", file=sys.stderr)
        return 2
    print(dump_config(config), end="")
    print("---")
    print(report)
    print("config OK" + (" (dry run: nothing trained, nothing written)" if dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
