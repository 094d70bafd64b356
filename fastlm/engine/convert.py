"""The fastlm side of `fastlm convert`: a model's folder in our names (`save_fastlm`), and a model's config,
weights and tokenizer read back from such a folder or a training checkpoint (`load_fastlm`, also what
`fastlm generate` and the trainer's HF export read). Above `fastlm.models.hf`, which maps the HF side,
because a checkpoint is the engine's."""

from __future__ import annotations

from pathlib import Path

from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_file, save_file

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.config.yaml_reader import parse_yaml, read_config_file
from fastlm.data.config import TokenizerConfig
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.checkpoint import (
    LATEST_FILE,
    MANIFEST_FILE,
    CheckpointError,
    load_checkpoint,
    load_latest_checkpoint,
)
from fastlm.models.base import DecoderConfig
from fastlm.models.config import ModelConfig
from fastlm.models.decoder import DecoderLM
from fastlm.models.hf import (
    FASTLM_CONFIG_FILE,
    WEIGHTS_FILE,
    StateDict,
    model_yaml,
)


def save_fastlm(model: DecoderLM, directory: str | Path, init_path: str | None = None) -> Path:
    """model.yaml (the model section) + model.safetensors in our names, as in a training checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
              str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / FASTLM_CONFIG_FILE).write_text(model_yaml(model.config, init_path), encoding="utf-8")
    return directory


def load_fastlm(source: str | Path) -> tuple[DecoderConfig, StateDict, Tokenizer]:
    """Model config, weights and the run's tokenizer from a `save_fastlm` folder, a checkpoint step folder
    (manifest.json), a checkpoints folder (`latest`) or a run folder (checkpoints/): the newest verified
    checkpoint. The tokenizer is the stored run config's (`data.tokenizer`, else `run.init_path`'s, else bytes)."""
    path = Path(source)
    try:  # the stored config is read as hostile as any: bounded YAML, or a verified checkpoint's manifest
        if (path / FASTLM_CONFIG_FILE).is_file():
            stored = parse_yaml(read_config_file(path / FASTLM_CONFIG_FILE, str(path)), str(path / FASTLM_CONFIG_FILE))
        elif (path / MANIFEST_FILE).is_file():
            stored = load_checkpoint(path).config
        else:
            folder = path if (path / LATEST_FILE).exists() else path / "checkpoints"
            loaded = load_latest_checkpoint(folder)
            path, stored = loaded.path, loaded.config
    except CheckpointError as error:
        raise ConfigError(ConfigIssue("", str(error), source=str(source))) from None
    try:
        if not isinstance(stored, dict) or not isinstance(stored.get("data", {}), dict):
            raise ValueError(f"expected a mapping with a 'model' section, got {type(stored).__name__}")
        config = TypeAdapter(ModelConfig).validate_python(stored.get("model"))
        tokenizer_config = TypeAdapter(TokenizerConfig | None).validate_python(stored.get("data", {}).get("tokenizer"))
        init_path = (stored.get("run") or {}).get("init_path")
    except (ValidationError, ValueError, AttributeError) as error:
        raise ConfigError(f"{path}: stored config is invalid: {error}") from None
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ConfigError(ConfigIssue("", f"{weights} is missing", source=str(path)))
    tokenizer = build_tokenizer(tokenizer_config, init_path)
    try:
        state = load_file(str(weights), device="cpu")
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for any bad header
        raise ConfigError(ConfigIssue("", f"{weights} is not a readable safetensors file: {str(error)[:200]}",
                                      source=str(path))) from None
    return config, state, tokenizer
