"""`fastlm train | validate | print-config | convert | prepare | generate | init`: the one command users run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastlm.commands.generate_arguments import add_arguments as add_generate_arguments

# Each command imports its work when it runs (torch and the rest cost seconds): `fastlm --help` and a
# mistyped command answer at once (tests/commands/test_startup.py).


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
    convert.add_argument("--check", action="store_true", help="with --from-hf: compare fastlm with transformers on "
                         "random ids (logits, greedy generation, export round trip, unmapped parameters); exit 1 on a "
                         "failed check")
    convert.add_argument("--device", default="cpu", help="with --check: cpu (fp32, default) or cuda (bf16)")
    convert.add_argument("--check-tokens", type=int, default=256, help="with --check: random ids per row")
    convert.add_argument("--check-new-tokens", type=int, default=16, help="with --check: greedy tokens compared")
    convert.add_argument("--tolerance", type=float, help="with --check: max |logit difference| (default 1e-4 fp32, "
                         "0.25 bf16)")
    prepare = commands.add_parser("prepare", help="tokenize local text/JSONL/Parquet/CSV files into a memory-mapped "
                                  "data set (data.source: {type: memmap, path})")
    prepare.add_argument("config", help="YAML prepare config: tokenizer, input_path, output_path, record fields, num_proc")
    prepare.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides, values parsed as YAML")
    prepare.add_argument("--verify", action="store_true", help="check the set at output_path in full (files, offsets, "
                         "the tokens' sha256, every id) instead of writing it")
    generate = commands.add_parser("generate", help="print a trained model's completions of prompts")
    add_generate_arguments(generate)
    init = commands.add_parser("init", help="copy a recipe (configs + reward code: LoRA SFT on chat data, then GRPO, "
                               "then PEFT export) into a folder")
    init.add_argument("directory", help="the folder to write (made if missing; existing files are never overwritten)")
    init.add_argument("--recipe", default="lora_chat", help="which recipe (default: lora_chat)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also follow flags (`train c.yaml --dry-run a.b=1`), where argparse leaves them over.
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray or (extra and args.command in ("convert", "generate", "init")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if args.command == "init":
        from fastlm.commands.init import init_command

        return init_command(args.directory, args.recipe)
    if args.command == "generate":
        from fastlm.commands.generate import generate_command

        return generate_command(args)
    if args.command == "convert" and (args.to_peft or args.from_peft or args.merge_lora):
        from fastlm.commands.convert import lora_convert_command

        return lora_convert_command(args.from_fastlm, args.to, args.to_hf, args.to_peft, args.from_peft, args.merge_lora)
    if args.command == "convert":
        from fastlm.commands.convert import convert_command

        if args.check:
            from fastlm.commands.convert import check_command

            return check_command(args.from_hf, args.to, args.device, args.check_tokens, args.check_new_tokens,
                                 args.tolerance)
        return convert_command(args.from_hf, args.to, args.from_fastlm, args.to_hf)
    if args.command == "prepare":
        from fastlm.commands.prepare import prepare_command

        return prepare_command(args.config, [*args.overrides, *extra], args.verify)
    from fastlm.commands.errors import exit_status
    from fastlm.config.errors import ConfigError
    from fastlm.run_config.loader import dump_config, load_config

    overrides = [*args.overrides, *extra, *args.set_overrides]
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        return exit_status(error)
    if args.command == "print-config":
        if args.describe:
            from fastlm.run_config.describe import describe_config

            print(describe_config(config), end="")
        else:
            print(dump_config(config), end="")
        return 0
    if args.command == "validate" or args.dry_run:
        from fastlm.commands.validate import validate_command

        return validate_command(config, dry_run=args.command == "train", resume=args.resume)
    if args.nproc_per_node is not None:
        from fastlm.commands.train import launch_processes

        return launch_processes(config, args.nproc_per_node, argv if argv is not None else sys.argv[1:])
    from fastlm.commands.train import run_training

    return run_training(config, resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
