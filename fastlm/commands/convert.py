"""`fastlm convert`: Hugging Face checkpoints in and out (`--from-hf`, `--to-hf`), and a LoRA run's adapters
merged (`--merge-lora`) or as HF PEFT files (`--to-peft`, `--from-peft`), and the parity report against
transformers (`--from-hf DIR --check`). Errors are one message, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

from fastlm.commands.errors import exit_status
from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.tokenizer import TokenizerError
from fastlm.engine.checkpoint import CheckpointError
from fastlm.engine.convert import load_fastlm, save_fastlm
from fastlm.engine.lora_convert import import_peft, merged_model, save_merged_fastlm, write_peft
from fastlm.engine.lora_training import load_lora_run
from fastlm.lora.peft import PeftFormatError
from fastlm.models.hf import hf_model_type, import_hf, model_yaml, save_hf


def convert_command(from_hf: str | None, to: str | None, from_fastlm: str | None, to_hf: str | None) -> int:
    """`fastlm convert`: --from-hf DIR [--to DIR] imports (prints the model YAML), --from SRC --to-hf DIR exports."""
    try:
        if from_hf is not None:
            if from_fastlm is not None:
                raise ConfigError("--from is for --to-hf; with --from-hf use --to DIR")
            model = import_hf(from_hf, "cpu")
            print(model_yaml(model.config, str(Path(from_hf).resolve())), end="")
            if to is not None:
                print(f"# wrote {save_fastlm(model, to, str(Path(from_hf).resolve()))}", file=sys.stderr)
            return 0
        if from_fastlm is None or to is not None:
            raise ConfigError("--to-hf DIR needs --from SRC (a checkpoint or a `convert --to` folder) and no --to")
        config, state, tokenizer = load_fastlm(from_fastlm)
        if config.lora is not None:
            raise ConfigError(f"--from {from_fastlm} is a LoRA run: add --merge-lora (or use --to-peft DIR)")
        print(f"wrote {save_hf(config, state, to_hf, tokenizer)} ({hf_model_type(config)}, {tokenizer.name} tokenizer)")
        return 0
    except (ConfigError, TokenizerError) as error:
        return exit_status(error, command="fastlm convert")


def check_command(from_hf: str | None, to: str | None, device: str, tokens: int, new_tokens: int,
                  tolerance: float | None) -> int:
    """`fastlm convert --from-hf DIR --check`: the parity table (fastlm/engine/parity.py); 0 when every
    check passes, 1 when one fails, 2 for a usage or checkpoint error."""
    try:
        if from_hf is None or to is not None:
            raise ConfigError("--check goes with --from-hf DIR alone (no --to)")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ConfigError(ConfigIssue("--device", "must be cpu or cuda", device))
        if tokens < 2 or new_tokens < 1:
            raise ConfigError(ConfigIssue("--check-tokens", "need at least 2 ids and 1 new token", (tokens, new_tokens)))
        from fastlm.engine.parity import parity_report  # lazy: transformers (the `hf` extra) is imported there

        report = parity_report(from_hf, device, tokens, new_tokens, tolerance)
    except ConfigError as error:
        return exit_status(error)
    print(report.table())
    return 0 if report.passed else 1


def lora_convert_command(source: str | None, to: str | None, to_hf: str | None, to_peft_dir: str | None,
                         from_peft_dir: str | None, merge: bool) -> int:
    """The LoRA branches of `fastlm convert`: `--from-peft ADAPTER --to DIR [--from BASE_HF_DIR]`, `--from RUN
    --to-peft DIR`, `--from RUN --merge-lora` with `--to DIR` or `--to-hf DIR`."""
    try:
        if from_peft_dir is not None:
            if to is None or to_hf is not None or merge:
                raise ConfigError("--from-peft ADAPTER needs --to DIR (and optionally --from BASE_HF_DIR)")
            print(import_peft(from_peft_dir, source, to), end="")
            return 0
        if source is None or (to_peft_dir is None) == (not merge) or (merge and (to is None) == (to_hf is None)):
            raise ConfigError("use --from RUN --to-peft DIR, or --from RUN --merge-lora with one of --to DIR / --to-hf DIR")
        model, targets, init_path, tokenizer = load_lora_run(source)
        if to_peft_dir is not None:
            print(f"wrote {write_peft(model, targets, init_path, to_peft_dir)} (PEFT LoRA on {init_path})")
        elif to_hf is not None:
            plain = merged_model(model)
            print(f"wrote {save_hf(plain.config, plain.state_dict(), to_hf, tokenizer)} (merged, HF)")
        else:
            print(f"wrote {save_merged_fastlm(merged_model(model), tokenizer, to)} (merged, fastlm)")
        return 0
    except (ConfigError, CheckpointError, PeftFormatError, TokenizerError) as error:
        return exit_status(error, command="fastlm convert")
