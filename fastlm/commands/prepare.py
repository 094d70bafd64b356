"""`fastlm prepare CONFIG [key=value ...] [--verify]`: the prepare YAML read as layered as a run config, then
fastlm/data/prepare.py's `prepare` (or `verify_prepared`), with one line and an exit status for any failure."""

from __future__ import annotations

import sys

from pydantic import ValidationError

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
                print(f"fastlm prepare --verify: {error}", file=sys.stderr)
                return 1
            return 0
        summary = prepare(config)
    except ConfigError as error:
        print(error.render(), file=sys.stderr)
        return 2
    except (DataError, TokenizerError) as error:
        print(f"fastlm prepare: {error}", file=sys.stderr)
        return 2
    except (DiskFullError, RunDirError, PrepareStopped) as error:  # run-time trouble, not bad input: 1
        print(f"fastlm prepare: {error}", file=sys.stderr)
        return 1
    print(summary.describe())
    return 0
