"""Every file a resume reads is hostile: each damage below (most with the manifest checksum fixed up, as an
attacker or a bad copy tool would) makes the newest checkpoint skipped with its reason, and the resume
continues from the previous complete one; with nothing usable the CLI prints one error, no traceback.
Data that changed since the checkpoint is refused naming the file, unless run.accept_changed_data is set.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from crash_harness import ROOT, write_config
from safetensors.torch import save_file

from fastlm.data.datasets import DataError
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config

NEWEST, PREVIOUS = "step-00000004", "step-00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 4 steps with checkpoints at 2 and 4 (the template every case copies)."""
    directory = tmp_path_factory.mktemp("template")
    config = write_config(directory, "run", steps=4, checkpoint_every=2)
    Trainer(load_config(config)).train()
    return config


def _copy(trained: Path, tmp_path: Path, *overrides: str):
    source = trained.parent / "run"
    shutil.copytree(source, tmp_path / "run")
    return load_config(trained, [f"run.output_dir={tmp_path}/run", *overrides])


def _replace(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a file and fix its manifest checksum, so only the content checks can catch it."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _pickled(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _edit_state(step_dir: Path, edit: Callable[[dict], object]) -> None:
    state = torch.load(step_dir / "trainer_state.pt", weights_only=True)
    _replace(step_dir, "trainer_state.pt", _pickled(edit(state)))


def _edit_manifest(step_dir: Path, edit: Callable[[dict], object]) -> None:
    manifest = json.loads((step_dir / "manifest.json").read_text())
    (step_dir / "manifest.json").write_text(json.dumps(edit(manifest)))


def _other_size(step_dir: Path) -> None:
    weights = {name: torch.zeros(*[48 if size == 32 else size for size in shape])
               for name, shape in load_latest_checkpoint(step_dir.parent).tensor_shapes().items()}
    buffer = step_dir / "other.safetensors"
    save_file(weights, str(buffer))
    _replace(step_dir, "model.safetensors", buffer.read_bytes())
    buffer.unlink()


DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "tensors of another model size": (_other_size, "written for another model .*tensor"),
    "manifest of another model config": (
        lambda d: _edit_manifest(d, lambda m: {**m, "config": {**m["config"], "model": {**m["config"]["model"],
                                                                                        "rope_theta": 5.0}}}),
        "model.rope_theta is 10000.0 in this run but 5.0 in the checkpoint"),
    "manifest is a list": (lambda d: (d / "manifest.json").write_text("[1, 2]"), "must hold a JSON object"),
    "manifest without files": (lambda d: _edit_manifest(d, lambda m: {"step": 4}), "'files' must map exactly"),
    "manifest nested 100k deep": (lambda d: (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
                                  "nested too deeply"),
    "manifest invalid UTF-8": (lambda d: (d / "manifest.json").write_bytes(b'{"step": "\xff"}'), "unreadable manifest"),
    "manifest points outside the checkpoint": (
        lambda d: _edit_manifest(d, lambda m: {**m, "files": {**m["files"], "../../../../etc/passwd": "0" * 64}}),
        "'files' must map exactly"),
    "manifest step disagrees with the directory": (lambda d: _edit_manifest(d, lambda m: {**m, "step": 3}),
                                                    "records step 3, but the directory is step-00000004"),
    "manifest step is text": (lambda d: _edit_manifest(d, lambda m: {**m, "step": "4"}), "'step' must be"),
    "trainer state is a list": (lambda d: _edit_state(d, lambda s: [s]), "must hold a dict, not list"),
    "trainer state at step 10**9": (lambda d: _edit_state(d, lambda s: {**s, "step": 10**9}),
                                    "trainer state is at step 1000000000, but the manifest records step 4"),
    "trainer state without rng": (lambda d: _edit_state(d, lambda s: {k: v for k, v in s.items() if k != "rng"}),
                                  "cannot restore it \\(KeyError"),
    "optimizer state of another shape": (lambda d: _replace(d, "optimizer.pt", _pickled({"state": 5})),
                                         "cannot restore it"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_newest_checkpoint_is_skipped_with_its_reason(trained: Path, tmp_path: Path, damage: str) -> None:
    config = _copy(trained, tmp_path)
    apply, reason = DAMAGES[damage]
    apply(tmp_path / "run" / "checkpoints" / NEWEST)
    trainer = Trainer(config)
    with pytest.warns(RuntimeWarning, match=f"skipping checkpoint: .*{NEWEST}.*{reason}"):
        trainer.resume()
    assert trainer.step == 2


@pytest.mark.parametrize("pointer", ["invalid UTF-8", "a directory", "outside the folder"])
def test_bad_latest_pointer_is_ignored_with_a_warning(trained: Path, tmp_path: Path, pointer: str) -> None:
    config = _copy(trained, tmp_path)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.unlink()
    if pointer == "invalid UTF-8":
        latest.write_bytes(b"step-\xff\xfe\n")
    elif pointer == "a directory":
        latest.mkdir()
    else:
        latest.write_text("../../run/checkpoints/step-00000002\n")
    trainer = Trainer(config)
    with pytest.warns(RuntimeWarning, match="ignoring .*latest"):
        trainer.resume()
    assert trainer.step == 4  # the newest complete checkpoint


def test_non_ascii_step_directory_blocks_neither_load_nor_save(trained: Path, tmp_path: Path) -> None:
    config = _copy(trained, tmp_path, "trainer.steps=6")
    (tmp_path / "run" / "checkpoints" / "step-\u0663").mkdir()  # an Arabic-Indic 3: str.isdigit() says yes
    assert Trainer(config).train(resume=True).steps == 6
    assert load_latest_checkpoint(tmp_path / "run" / "checkpoints").step == 6


def test_damaged_metrics_lines_are_dropped_on_resume(trained: Path, tmp_path: Path) -> None:
    config = _copy(trained, tmp_path, "trainer.steps=6")
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0] + b'{"step": 2, "train/loss": \xff}\n' + b"".join(lines[1:]) + b'{"step": 5, "tr')
    with pytest.warns(RuntimeWarning, match="dropped 2 damaged line\\(s\\) \\(line 2, 6\\)"):
        Trainer(config).train(resume=True)
    assert [record["step"] for record in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]


def test_nothing_usable_is_one_clear_error_in_the_cli(trained: Path, tmp_path: Path) -> None:
    _copy(trained, tmp_path)
    for step_dir in (tmp_path / "run" / "checkpoints").glob("step-*"):
        (step_dir / "manifest.json").write_text("[]")
    config = tmp_path / "run.yaml"
    config.write_text(trained.read_text().replace(str(trained.parent), str(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "fastlm", "train", str(config), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "fastlm: no usable checkpoint in" in done.stderr and "must hold a JSON object, not list" in done.stderr


def test_changed_data_is_refused_naming_the_file(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(f"document number {i} says hello" for i in range(40)), encoding="utf-8")
    config_path = write_config(tmp_path, "text", steps=2, checkpoint_every=2, source={"type": "text", "path": str(data)})
    Trainer(load_config(config_path)).train()
    data.write_text(data.read_text().replace("hello", "howdy"), encoding="utf-8")  # same size, same row count
    with pytest.raises(DataError, match=f"changed since checkpoint step-00000002: {data} changed: same size, "
                       "different content.*run.accept_changed_data=true"):
        Trainer(load_config(config_path, ["trainer.steps=3"])).train(resume=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = Trainer(load_config(config_path, ["trainer.steps=3", "run.accept_changed_data=true"])).train(resume=True)
    assert summary.steps == 3
