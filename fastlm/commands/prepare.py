"""`fastlm prepare CONFIG [key=value ...] [--verify]`: the prepare YAML read as layered as a run config, then
fastlm/data/prepare.py's `prepare` (or `verify_prepared`), with one line and an exit status for any failure."""

from __future__ import annotations

from pydantic import ValidationError

from fastlm.commands.errors import RUN_TIME, exit_status
from fastlm.config.errors import ConfigError
from fastlm.data.datasets import DataError
from fastlm.data.prepare import PrepareConfig, PrepareStopped, prepare
from fastlm.data.prepared import verify_prepared
from fastlm.data.tokenizer import TokenizerError
from fastlm.run_config.loader import load_layers, to_issue
from fastlm.system.disk_space import DiskFullError
from fastlm.system.run_dir import RunDirError


def load_prepare_config(path: str, overrides: list[str]) -> PrepareConfig:
    """The prepare YAML (with `base:` and overrides, paths relative to the file) as a validated config."""
    layered = load_layers(path, overrides)
    try:
        return PrepareConfig.model_validate(layered.data)
    except ValidationError as error:
        raise ConfigError([to_issue(item, layered, PrepareConfig) for item in error.errors()]) from None


def prepare_command(path: str, overrides: list[str], verify: bool = False) -> int:
    """`fastlm prepare CONFIG [key=value ...] [--verify]`: exit 0 with a summary, 2 with the error for bad input,
    1 for run-time trouble (a full disk, another prepare into the same output, a stop signal, a damaged set)."""
    try:
        config = load_prepare_config(path, overrides)
        if verify:  # check the set at output_path in full, write nothing; a damaged set is a run-time error: 1
            try:
                print(verify_prepared(config.output_path))
            except DataError as error:
                return exit_status(error, RUN_TIME, "fastlm prepare --verify")
            return 0
        summary = prepare(config)
    except (ConfigError, DataError, TokenizerError) as error:
        return exit_status(error, command="fastlm prepare")
    except (DiskFullError, RunDirError, PrepareStopped) as error:  # run-time trouble, not bad input: 1
        return exit_status(error, RUN_TIME, "fastlm prepare")
    print(summary.describe())
    return 0
