"""Crash-safe checkpoints: `<run dir>/checkpoints/step-XXXXXXXX/` plus an atomically updated `latest`.

A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed into
place, so a reader sees either a complete checkpoint or none. `manifest.json` holds the sha256 of every
file; loading verifies them and falls back to the previous complete checkpoint when one is damaged.
Nothing is unpickled: weights are safetensors and the rest is read with `torch.load(weights_only=True)`.

A writer killed mid-save leaves at most a `.tmp-*` directory (never picked, removed by the next save)
and, if killed after the rename, a `latest` pointing one checkpoint back. Checkpoints newer than the
one being written belong to an abandoned timeline (a resume from an older checkpoint) and are removed.
The `fault_point` calls let crash tests kill the writer at each of these places.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from fastlm.engine.signals import fault_point

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_PREFIX = "step-"
_TEMP_PREFIXES = (".tmp-", f".{LATEST_FILE}.tmp-")


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
    temporary.write_text(text, encoding="utf-8")
    _fsync_path(temporary)
    os.replace(temporary, path)
    _fsync_path(path.parent)


def _step_dirs(directory: Path) -> list[Path]:
    """Complete (renamed-into-place) checkpoint directories, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


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
    _remove_leftovers(directory, step)
    final = directory / step_dir_name(step)
    temporary = directory / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    temporary.mkdir()
    if isinstance(model, torch.nn.Module):
        save_model(model, str(temporary / MODEL_FILE))  # shared (tied) tensors are stored once
    else:
        save_file(model, str(temporary / MODEL_FILE))
    optimizer_state = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    torch.save(optimizer_state, temporary / OPTIMIZER_FILE)
    torch.save(trainer_state, temporary / STATE_FILE)
    fault_point("checkpoint_files_written")
    files = {name: _sha256(temporary / name) for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE)}
    manifest = {"step": step, "time": time.time(), "files": files, "config": config}
    (temporary / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    for name in (*files, MANIFEST_FILE):
        _fsync_path(temporary / name)
    _fsync_path(temporary)
    fault_point("checkpoint_before_rename")
    if final.exists():  # re-saving a step after a resume: the new one replaces it
        _discard(final)
    os.rename(temporary, final)
    _fsync_path(directory)
    fault_point("checkpoint_before_latest")
    _write_text_atomic(directory / LATEST_FILE, final.name + "\n")
    for old in _step_dirs(directory)[:-keep]:
        _discard(old)
    return final


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
    for path in _step_dirs(directory):
        if int(path.name[len(_PREFIX):]) > step:
            _discard(path)


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

    def load_model(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        missing, unexpected = load_model(model, str(self.path / MODEL_FILE), strict=False, device=str(device))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.path / MODEL_FILE}: does not match the model (missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}); was the model config changed since the checkpoint?"
            )


def _verify(path: Path) -> LoadedCheckpoint:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path}: missing (incomplete checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        expected: dict[str, str] = manifest["files"]
        step = int(manifest["step"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({error})") from error
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
        raise CheckpointError(f"{path}: could not read state ({error})") from error
    return LoadedCheckpoint(path, step, optimizer_state, trainer_state, manifest.get("config", {}))


def load_checkpoint(path: Path) -> LoadedCheckpoint:
    """One named `step-*` directory, verified (no fallback: the caller asked for this one)."""
    return _verify(path)


def _candidates(directory: Path) -> list[Path]:
    """The `latest` target first, then every other complete checkpoint, newest first."""
    ordered = list(reversed(_step_dirs(directory)))
    pointer = directory / LATEST_FILE
    if pointer.is_file():
        target = directory / pointer.read_text(encoding="utf-8").strip()
        if target in ordered:
            ordered.remove(target)
            ordered.insert(0, target)
    return ordered


def load_latest_checkpoint(directory: Path) -> LoadedCheckpoint:
    """The newest checkpoint that verifies; each damaged one is reported (warning) and skipped."""
    problems = []
    for path in _candidates(directory):
        try:
            loaded = _verify(path)
        except CheckpointError as error:
            problems.append(str(error))
            warnings.warn(f"skipping corrupt checkpoint: {error}", RuntimeWarning, stacklevel=2)
            continue
        return loaded
    detail = "; ".join(problems) if problems else "no checkpoints found"
    raise CheckpointError(f"no usable checkpoint in {directory}: {detail}")
