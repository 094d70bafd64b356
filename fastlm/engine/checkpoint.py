"""Crash-safe checkpoints: `<run dir>/checkpoints/step-XXXXXXXX/` plus an atomically updated `latest`.

A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed into
place, so a reader sees either a complete checkpoint or none. `manifest.json` holds the sha256 of every
file; loading verifies them and falls back to the previous complete checkpoint when one is damaged.
Nothing is unpickled: weights are safetensors and the rest is read with `torch.load(weights_only=True)`.

A writer killed mid-save leaves at most a `.tmp-*` directory (never picked, removed by the next save)
and, if killed after the rename, a `latest` pointing one checkpoint back. Checkpoints newer than the
one being written belong to an abandoned timeline (a resume from an older checkpoint) and are removed.
The `fault_point` calls let crash tests kill the writer at each of these places.

`latest` and manifests are read without following symbolic links, and `latest` must name a `step-N`
directory inside its own folder: a pointer is never followed out of the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from fastlm.system.disk_space import raise_if_disk_full
from fastlm.system.json_text import JsonTextError, parse_json
from fastlm.system.run_dir import RunDirError, open_run_file
from fastlm.system.signals import fault_point

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_PREFIX = "step-"
_TEMP_PREFIXES = (".tmp-", f".{LATEST_FILE}.tmp-")
CHECKPOINT_FILES = (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the file."""


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (directory entries must hit the disk for renames to be durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = open_run_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_path(path.parent)


_STEP_NAME = re.compile(r"step-([0-9]+)", re.ASCII)  # ASCII digits only: `step-²` is no step
MAX_JSON_BYTES = 16 << 20  # a manifest holds hashes and the resolved config: a few KiB


def checkpoint_step(path: Path) -> int | None:
    """The step a `step-N` directory name stands for; None for any other name."""
    match = _STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete (renamed-into-place) checkpoint directories, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_step(p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def save_checkpoint(
    directory: Path,
    step: int,
    model: torch.nn.Module | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    keep: int,
) -> Path:
    """Write step `step` atomically, point `latest` at it, and delete all but the newest `keep`.

    `model` / `optimizer` may be given as their full state dicts (what a distributed run gathers on rank 0).
    """
    directory.mkdir(parents=True, exist_ok=True)
    _check_pointer_kind(directory / LATEST_FILE)
    _remove_leftovers(directory, step)
    final = directory / step_dir_name(step)
    temporary = directory / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    previous = complete_checkpoints(directory)
    try:
        _write(temporary, final, step, model, optimizer, trainer_state, config)
    except Exception as error:
        shutil.rmtree(temporary, ignore_errors=True)  # a failed write leaves nothing half-written behind
        intact = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint"
        raise_if_disk_full(error, f"checkpoint {final.name}", directory, checkpoint_bytes(model, optimizer), intact,
                           then="continue with --resume")
        raise
    for old in complete_checkpoints(directory)[:-keep]:
        _discard(old)
    return final


def checkpoint_bytes(*states: Any) -> int:
    """Bytes of every tensor in modules / optimizers / nested state dicts: what a checkpoint of them needs."""
    total = 0
    pending = list(states)
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, (torch.nn.Module, torch.optim.Optimizer)):
            pending.append(item.state_dict())
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total + (64 << 10)  # manifest, trainer state, pickle framing


def _write(
    temporary: Path,
    final: Path,
    step: int,
    model: torch.nn.Module | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    trainer_state: dict[str, Any],
    config: dict[str, Any],
) -> None:
    """Files into `temporary`, fsynced, renamed to `final`, then `latest` pointed at it."""
    temporary.mkdir()
    if isinstance(model, torch.nn.Module):
        save_model(model, str(temporary / MODEL_FILE))  # shared (tied) tensors are stored once
    else:
        save_file(model, str(temporary / MODEL_FILE))
    optimizer_state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    torch.save(optimizer_state, temporary / OPTIMIZER_FILE)
    torch.save(trainer_state, temporary / STATE_FILE)
    fault_point("checkpoint_files_written")
    files = {name: _sha256(temporary / name) for name in CHECKPOINT_FILES}
    manifest = {"step": step, "time": time.time(), "files": files, "config": config}
    (temporary / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    for name in (*files, MANIFEST_FILE):
        _fsync_path(temporary / name)
    _fsync_path(temporary)
    fault_point("checkpoint_before_rename")
    if final.exists():  # re-saving a step after a resume: the new one replaces it
        _discard(final)
    os.rename(temporary, final)
    _fsync_path(final.parent)
    fault_point("checkpoint_before_latest")
    _write_text_atomic(final.parent / LATEST_FILE, final.name + "\n")


def _check_pointer_kind(pointer: Path) -> None:
    """`latest` is replaced by a rename: a directory (or other non-file) in its place would make every save
    fail after its files are written, so it is refused first, with the fix."""
    if os.path.lexists(pointer) and not pointer.is_symlink() and not pointer.is_file():
        raise CheckpointError(f"{pointer}: is a directory or special file, not the checkpoint pointer fastlm "
                              "writes; move it away and continue with --resume")


def _discard(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a half-deleted `step-*` behind: rename it to a
    temp name first (atomic), so a kill during the delete leaves only a `.tmp-*` that the next save removes."""
    doomed = path.with_name(f".tmp-discard-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def _remove_leftovers(directory: Path, step: int) -> None:
    """Temp files of writers that died mid-save, and checkpoints past `step` (an abandoned timeline)."""
    for path in directory.iterdir():
        if path.name.startswith(_TEMP_PREFIXES) and path.is_dir():
            shutil.rmtree(path)
        elif path.name.startswith(_TEMP_PREFIXES):
            path.unlink()
    for path in complete_checkpoints(directory):
        if (checkpoint_step(path) or 0) > step:
            _discard(path)


def changed_model_keys(stored: dict[str, Any], current: dict[str, Any], init: bool = False) -> list[str]:
    """The model-config keys where a checkpoint's model is not this run's. The loss head and the init scale may
    change on resume; a run started from a checkpoint without adapters (`init`) may also add `lora`."""
    free = {"head", "init_std"} | ({"lora"} if init and stored.get("lora") is None else set())
    stored = with_defaults(stored)
    return sorted(key for key in set(stored) | set(current) if key not in free and stored.get(key) != current.get(key))


def with_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """A stored model section with the defaults of fields added since it was written (a checkpoint of an earlier
    fastlm lacks them, which is no change); as stored when it no longer validates."""
    from pydantic import TypeAdapter, ValidationError

    from fastlm.models.config import ModelConfig

    try:
        return TypeAdapter(ModelConfig).validate_python(stored).model_dump(mode="json")
    except (ValidationError, ValueError, TypeError):
        return stored


def model_changes(stored: dict[str, Any], current: dict[str, Any], init: bool = False) -> list[tuple[str, Any, Any]]:
    """(dotted field, checkpoint's value, this run's) of each changed model-config leaf (`changed_model_keys`'s
    keys, a section such as `lora` or `moe` compared field by field)."""
    found: list[tuple[str, Any, Any]] = []

    def walk(prefix: str, old: Any, new: Any) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    walk(f"{prefix}.{key}", old.get(key), new.get(key))
        else:
            found.append((prefix, old, new))

    filled = with_defaults(stored)
    for key in changed_model_keys(stored, current, init):
        walk(f"model.{key}", filled.get(key), current.get(key))
    return found


def describe_model_change(changes: list[tuple[str, Any, Any]], checkpoint: str) -> str:
    """One line: each changed field with both values, and the two ways on (the checkpoint's values, or a new run)."""
    shown = "; ".join(f"{field} is {new!r:.60} in this run but {old!r:.60} in the checkpoint"
                      for field, old, new in changes[:3])
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    back = " ".join(f"{field}={old!r:.60}" for field, old, _ in changes[:3])
    return (f"{checkpoint}: {shown}{more}; a resume continues the checkpoint's model. Resume with {back}, or keep "
            "the new values in a new run (another run.name, or run.overwrite=true)")


class ModelChangedError(CheckpointError):
    """The run's model config is not the checkpoint's: a decision for the user when no checkpoint of the run
    fits it (then it is the one error), damage when an older one does (then it is skipped)."""


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: states are already read; the model is loaded on request into a built model."""

    path: Path
    step: int
    optimizer_state: dict[str, Any]
    trainer_state: dict[str, Any]
    config: dict[str, Any]

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full weights on CPU (a distributed resume cuts each rank's shard from them)."""
        return load_file(str(self.path / MODEL_FILE))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every stored tensor, from the safetensors header (no tensor is read)."""
        with safe_open(str(self.path / MODEL_FILE), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}

    def check_fits(self, expected: dict[str, tuple[int, ...]], model_config: dict[str, Any], init: bool = False) -> None:
        """The stored tensors have the shapes of the model being resumed or started from (`expected`: name ->
        full shape, `init`: a new run's `run.init_path`), and the stored model config is this run's as
        `changed_model_keys` compares them: else `CheckpointError`."""
        stored = self.config.get("model") if isinstance(self.config.get("model"), dict) else {}
        changed = changed_model_keys(stored, model_config, init)
        if changed and not init:
            raise ModelChangedError(describe_model_change(model_changes(stored, model_config), str(self.path)))
        shapes = self.tensor_shapes()
        wrong = [f"{name} {shapes[name]} vs {expected[name]}" for name in sorted(set(shapes) & set(expected))
                 if shapes[name] != expected[name]]
        unexpected = sorted(set(shapes) - set(expected))
        if changed or wrong or unexpected:
            details = [f"model.{key}: checkpoint {stored.get(key)!r}, this run {model_config.get(key)!r}"
                       for key in changed[:5]]
            details += [f"tensor {item}" for item in wrong[:3]] + [f"unexpected tensor {n}" for n in unexpected[:3]]
            raise CheckpointError(f"{self.path}: written for another model ({'; '.join(details)}); was the model "
                                  "config changed since the checkpoint? Restore it, or start over with run.overwrite=true")

    def load_model(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        try:
            missing, unexpected = load_model(model, str(self.path / MODEL_FILE), strict=False, device=str(device))
        except (RuntimeError, ValueError, OSError) as error:  # e.g. a size mismatch: name the file, not a traceback
            raise CheckpointError(f"{self.path / MODEL_FILE}: does not fit the model ({error})") from None
        if missing or unexpected:
            raise CheckpointError(
                f"{self.path / MODEL_FILE}: does not match the model (missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}); was the model config changed since the checkpoint?"
            )


def _read_json(path: Path) -> Any:
    """A JSON file that may be hostile: bounded size, UTF-8, any nesting depth refused cleanly."""
    try:
        with os.fdopen(open_run_file(path, os.O_RDONLY), "rb") as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
    except RunDirError as error:
        raise CheckpointError(str(error)) from None
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable ({error.strerror or error})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES >> 20} MiB (not a manifest)")
    try:
        return parse_json(raw)
    except JsonTextError as error:
        raise CheckpointError(f"{path}: unreadable manifest ({error})") from None


def read_manifest(path: Path) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(step, file -> sha256, config) of a manifest whose every piece has the expected type."""
    manifest_path = path / MANIFEST_FILE
    if not os.path.lexists(manifest_path):
        raise CheckpointError(f"{manifest_path}: missing (incomplete checkpoint)")
    manifest = _read_json(manifest_path)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: must hold a JSON object, not {type(manifest).__name__}")
    step, files, config = manifest.get("step"), manifest.get("files"), manifest.get("config", {})
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{manifest_path}: 'step' must be a non-negative integer, got {step!r:.80}")
    named = checkpoint_step(path)
    if named is not None and named != step:
        raise CheckpointError(f"{manifest_path}: records step {step}, but the directory is {path.name}")
    if (not isinstance(files, dict) or set(files) != set(CHECKPOINT_FILES)
            or not all(isinstance(digest, str) for digest in files.values())):
        raise CheckpointError(f"{manifest_path}: 'files' must map exactly {list(CHECKPOINT_FILES)} to sha256 "
                              f"digests, got {str(files)[:120]}")
    if not isinstance(config, dict):
        raise CheckpointError(f"{manifest_path}: 'config' must be a JSON object, not {type(config).__name__}")
    return step, files, config


def _verify(path: Path) -> LoadedCheckpoint:
    step, expected, config = read_manifest(path)
    for name, digest in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from checkpoint")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file}: sha256 mismatch (file is corrupt or was modified)")
    try:
        with safe_open(str(path / MODEL_FILE), framework="pt"):  # the header parses: a hostile file fails here
            pass
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        trainer_state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"{path}: could not read state ({str(error)[:300]})") from None
    if not isinstance(optimizer_state, dict):
        raise CheckpointError(f"{path / OPTIMIZER_FILE}: must hold a dict, not {type(optimizer_state).__name__}")
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{path / STATE_FILE}: must hold a dict, not {type(trainer_state).__name__}")
    if trainer_state.get("step") != step or type(trainer_state.get("step")) is not int:
        raise CheckpointError(f"{path / STATE_FILE}: trainer state is at step {trainer_state.get('step')!r:.40}, "
                              f"but the manifest records step {step}")
    return LoadedCheckpoint(path, step, optimizer_state, trainer_state, config)


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """One named `step-*` directory, verified (no fallback: the caller asked for this one)."""
    return _verify(path)


def latest_pointer(directory: Path) -> Path | None:
    """The checkpoint `latest` names, if it is a small UTF-8 regular file (not a link) naming a complete
    `step-N` directory of this folder; else None (with a warning: the newest complete checkpoint is used
    instead). A pointer is never followed out of its folder."""
    pointer = directory / LATEST_FILE
    if not os.path.lexists(pointer):
        return None
    try:
        with os.fdopen(open_run_file(pointer, os.O_RDONLY), "rb") as handle:
            name = handle.read(256).decode("utf-8").strip()
        if checkpoint_step(Path(name)) is None:
            raise ValueError(f"does not name a step-N directory of {directory} ({name[:40]!r})")
        if directory / name not in complete_checkpoints(directory):
            raise ValueError(f"names {name}, which is not a complete checkpoint directory there")
    except (OSError, ValueError, RunDirError) as error:
        warnings.warn(f"ignoring {pointer}: {error}; using the newest complete checkpoint", RuntimeWarning,
                      stacklevel=3)
        return None
    return directory / name


def _candidates(directory: Path) -> list[Path]:
    """The `latest` target first, then every other complete checkpoint, newest first."""
    ordered = list(reversed(complete_checkpoints(directory)))
    target = latest_pointer(directory)
    if target in ordered:
        ordered.remove(target)
        ordered.insert(0, target)
    return ordered


def load_latest_checkpoint(
    directory: Path, use: Callable[[LoadedCheckpoint], None] | None = None
) -> LoadedCheckpoint:
    """The newest checkpoint that verifies (and that `use` accepts: `use` restores it and raises
    `CheckpointError` when it does not fit); each refused one is reported (warning) and skipped. When no
    checkpoint fits this run's model config (`ModelChangedError`: the config, not the checkpoints, changed),
    that one line is the error, without a warning per checkpoint."""
    problems: list[str] = []
    changed: list[ModelChangedError] = []
    for path in _candidates(directory):
        try:
            loaded = _verify(path)
            if use is not None:
                use(loaded)
        except ModelChangedError as error:  # said once below: skipped if an older one fits, else the error
            changed.append(error)
            problems.append(str(error))
            continue
        except CheckpointError as error:
            problems.append(str(error))
            warnings.warn(f"skipping checkpoint: {error}", RuntimeWarning, stacklevel=2)
            continue
        for error in changed:  # a checkpoint whose manifest alone was edited: damage after all
            warnings.warn(f"skipping checkpoint: {error}", RuntimeWarning, stacklevel=2)
        return loaded
    if changed and len(changed) == len(problems):
        raise changed[0]
    detail = "; ".join(problems) if problems else "no checkpoints found"
    raise CheckpointError(f"no usable checkpoint in {directory}: {detail}")
