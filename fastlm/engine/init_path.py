"""`run.init_path` to a local folder: a fastlm checkpoint, a Hugging Face folder, or a hub name.

A run starts from (in this order):
- a fastlm checkpoint: a run folder, its `checkpoints/`, `latest` or one `step-*` (SFT in fastlm, then RL from
  it), resolved to the step folder;
- a local Hugging Face folder (config.json + *.safetensors);
- a hub name (`Qwen/Qwen3-0.6B`, optionally `@revision`): the snapshot in the local Hugging Face cache
  (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub; `models--Qwen--Qwen3-0.6B/snapshots/
  <commit>` that `refs/<revision>` names), else downloaded through huggingface_hub unless HF_HUB_OFFLINE is set.
Anything else is a `ConfigError` at run.init_path naming where it looked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from fastlm.config.errors import ConfigError, ConfigIssue
from fastlm.data.config import HuggingFaceTokenizerConfig, TokenizerConfig
from fastlm.data.tokenizer import holds_hf_tokenizer
from fastlm.engine.checkpoint import MANIFEST_FILE
from fastlm.engine.preflight import resolve_step_dir

FIELD = "run.init_path"
HF_CONFIG_FILE = "config.json"
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]  # config, weights, tokenizer


@dataclass(frozen=True)
class InitSource:
    kind: Literal["fastlm", "hf"]
    path: Path  # fastlm: the step folder (manifest.json); hf: the folder with config.json


def init_source(path: str | Path) -> InitSource:
    """The kind of an already resolved local `run.init_path`."""
    path = Path(path)
    return InitSource("fastlm" if (path / MANIFEST_FILE).is_file() else "hf", path)


def resolve_init_path(value: str) -> InitSource:
    """The local folder `value` names (see the module docstring); `ConfigError` at run.init_path otherwise."""
    local = Path(value).expanduser()
    if local.exists():
        step = resolve_step_dir(local)
        if step is not None:
            return InitSource("fastlm", step.resolve())
        if (local / HF_CONFIG_FILE).is_file():
            return InitSource("hf", local.resolve())
        raise ConfigError(ConfigIssue(FIELD, "neither a fastlm checkpoint (a run, checkpoints/ or step-* folder) nor a "
                                      f"Hugging Face folder ({HF_CONFIG_FILE} + *.safetensors)", value,
                                      hint="point it at a finished fastlm run or a save_pretrained folder"))
    match = HUB_NAME.match(value)
    if match is None or value.startswith((".", "/", "~")):
        raise ConfigError(ConfigIssue(FIELD, f"no such folder ({local.absolute()})", value,
                                      hint="give a fastlm run folder, a Hugging Face folder, or a hub name like "
                                      "Qwen/Qwen3-0.6B"))
    return InitSource("hf", hub_snapshot(match["repo"], match["revision"] or "main"))


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo: str, revision: str, cache: Path) -> Path | None:
    """The cached snapshot of `repo` at `revision` (a branch or tag through refs/, or a commit), if it holds a
    config.json."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    ref = folder / "refs" / revision
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    return snapshot if (snapshot / HF_CONFIG_FILE).is_file() else None


def hub_snapshot(repo: str, revision: str) -> Path:
    """The local snapshot of a hub model: the cache's, else a download (config, weights, tokenizer files)."""
    cache = hub_cache()
    found = cached_snapshot(repo, revision, cache)
    if found is not None:
        return found
    where = cache / f"models--{repo.replace('/', '--')}"
    name = repo if revision == "main" else f"{repo}@{revision}"
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no"):
        problem = "HF_HUB_OFFLINE is set, so it was not downloaded"
    else:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES))
        except Exception as error:  # noqa: BLE001 - offline, unknown repo, gated, disk full: all say the same to the user
            problem = f"downloading it failed ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
    raise ConfigError(ConfigIssue(FIELD, f"no local folder {Path(name).absolute()}, and the hub model {name} is not "
                                  f"in the Hugging Face cache (looked in {where}) and {problem}", name,
                                  hint=f"download it where the network is: `huggingface-cli download {repo}` (set "
                                  "HF_HOME or HF_HUB_CACHE to use another cache), or give a local folder"))


def checkpoint_tokenizer(step_dir: Path) -> TokenizerConfig | None:
    """The tokenizer a fastlm checkpoint was trained with: its run's data.tokenizer, else the HF tokenizer saved with
    that run's own init_path; None for bytes (or a manifest that does not say)."""
    try:
        stored: Any = json.loads((step_dir / MANIFEST_FILE).read_text(encoding="utf-8"))["config"]
        data, run = stored.get("data") or {}, stored.get("run") or {}
        if data.get("tokenizer") is not None:
            return TypeAdapter(TokenizerConfig).validate_python(data["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError):
        return None
    init = run.get("init_path")
    return HuggingFaceTokenizerConfig(path=init) if isinstance(init, str) and holds_hf_tokenizer(init) else None
