"""A run's files stay in its folder: `.lock`, `metrics.jsonl`, `latest` and manifests are never followed
through a symbolic link or out of their folder, a wrong kind of file in their place is one line (exit 1),
and `run.overwrite=true` puts the earlier run back when the new one fails or is killed before its first
checkpoint. Each case is a red-team reproduction: the file outside the run must be byte-for-byte unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from crash_harness import ROOT, run_dir, write_config

from fastlm.commands.main import main
from fastlm.data.datasets import DataError
from fastlm.engine.objective import SupervisedObjective
from fastlm.logging.jsonl import read_metrics
from fastlm.system.run_dir import REPLACED_DIR, RunDirError, RunDirLock
from fastlm.system.signals import FAULT_ENV

OUTSIDE = b"precious bytes outside the run\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step run with a checkpoint at each step (every case copies it)."""
    config = write_config(tmp_path_factory.mktemp("template"), "run", steps=2)
    assert main(["train", str(config)]) == 0
    return config


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(config of a copy of the trained run in tmp_path, its run directory)."""
    config = write_config(tmp_path, "run", steps=3)
    shutil.copytree(run_dir(trained), run_dir(config))
    return config, run_dir(config)


def _one_line_error(capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fastlm")]
    assert "Traceback" not in err and len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside.txt"
    target.write_bytes(OUTSIDE)
    return target


def _planted_lock(trained: Path, tmp_path: Path, kind: str) -> tuple[Path, Path, Path]:
    """(config, lock, outside file) of a copy of the trained run whose `.lock` is a `kind` in place of a file."""
    config, directory = _copy(trained, tmp_path)
    target = _outside(tmp_path)
    lock = directory / ".lock"
    lock.unlink(missing_ok=True)
    if kind == "symlink":
        lock.symlink_to(target)
    elif kind == "dangling":
        lock.symlink_to(tmp_path / "missing")
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    return config, lock, target


@pytest.mark.parametrize("kind", ["symlink", "dangling", "directory", "fifo"])
def test_a_planted_lock_is_refused_in_one_line(trained: Path, tmp_path: Path, kind: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    config, lock, target = _planted_lock(trained, tmp_path, kind)
    started = time.monotonic()
    assert main(["train", str(config), "--resume"]) == 1
    assert time.monotonic() - started < 10  # no spin, no wait on a FIFO
    _one_line_error(capsys, str(lock), "not a regular file")
    assert target.read_bytes() == OUTSIDE and not (tmp_path / "missing").exists()


def test_lock_wait_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock file that vanishes at every try (holders leaving in a loop) ends in a message, not a spin."""
    import fastlm.system.run_dir as run_dir_module

    monkeypatch.setattr(run_dir_module, "LOCK_WAIT_S", 0.2)
    monkeypatch.setattr(RunDirLock, "_open", lambda self: (_ for _ in ()).throw(FileNotFoundError()))
    with pytest.raises(RunDirError, match="could not take the lock within"):
        RunDirLock(tmp_path / "run").acquire()


def test_a_metrics_symlink_is_never_appended_through(trained: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config, directory = _copy(trained, tmp_path)
    target = _outside(tmp_path)
    (directory / "metrics.jsonl").unlink()
    (directory / "metrics.jsonl").symlink_to(target)
    assert main(["train", str(config), "--resume"]) == 1
    _one_line_error(capsys, "metrics.jsonl", "symbolic link")
    assert target.read_bytes() == OUTSIDE


def test_generate_never_follows_latest_out_of_the_folder(trained: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`latest` naming `../elsewhere/step-N` (a planted checkpoint outside) is ignored: the run's own loads."""
    _, directory = _copy(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(directory / "checkpoints" / "step-00000001", elsewhere / "step-00000009")
    (directory / "checkpoints" / "latest").write_text("../../elsewhere/step-00000009\n")
    with pytest.warns(RuntimeWarning, match="ignoring .*latest"):
        assert main(["generate", str(directory), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "checkpoints/step-00000002" in capsys.readouterr().err


def test_latest_as_a_directory_is_one_line_before_any_step(trained: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config, directory = _copy(trained, tmp_path)
    (directory / "checkpoints" / "latest").unlink()
    (directory / "checkpoints" / "latest").mkdir()
    assert main(["train", str(config), "--resume"]) == 1
    _one_line_error(capsys, "checkpoints/latest", "not the checkpoint pointer")
    assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == ["latest", "step-00000001",
                                                                             "step-00000002"]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file() and path.name != ".lock"}


def _broken(self: object, step: int) -> list:
    raise DataError("first batch failed")


FAILING_TRAIN = ("import sys; from fastlm.data.datasets import DataError; "
                 "from fastlm.engine.objective import SupervisedObjective; from fastlm.commands.main import main\n"
                 "def broken(self, step): raise DataError('first batch failed')\n"
                 "SupervisedObjective.batches = broken; sys.exit(main(['train', sys.argv[1]]))")


def test_overwrite_keeps_the_earlier_run_until_the_new_one_checkpoints(trained: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A first step that fails puts the earlier run back exactly; a good start removes it only once its
    own first checkpoint exists."""
    config, directory = _copy(trained, tmp_path)
    before = _snapshot(directory)
    with monkeypatch.context() as patch:
        patch.setattr(SupervisedObjective, "batches", _broken)
        assert main(["train", str(config), "run.overwrite=true"]) == 1
    _one_line_error(capsys, "first batch failed")
    assert _snapshot(directory) == before and not (directory / REPLACED_DIR).exists()
    assert main(["train", str(config), "run.overwrite=true"]) == 0
    assert not (directory / REPLACED_DIR).exists()
    assert [record["step"] for record in read_metrics(directory / "metrics.jsonl")] == [1, 2, 3]


def _with_run_keys(config: Path, **keys: object) -> Path:
    data = yaml.safe_load(config.read_text())
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        data[section][key] = value
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.mark.parametrize("fault", ["overwrite_set_aside", "overwrite_putting_back"])
def test_overwrite_killed_before_its_first_checkpoint_gets_the_earlier_run_back(
        trained: Path, tmp_path: Path, fault: str, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL a `run.overwrite=true` start right after it set the earlier run aside, or while it puts it back
    after a failed first step: the next start (here a --resume) has the earlier run, whole. (A kill while
    setting aside, `overwrite_moving_aside`, is recovered by the same code path as the second case.)"""
    config, directory = _copy(trained, tmp_path)
    before = _snapshot(directory)
    _with_run_keys(config, run__overwrite=True)
    command = [sys.executable, "-c", FAILING_TRAIN, str(config)] if fault == "overwrite_putting_back" else \
        [sys.executable, "-m", "fastlm", "train", str(config)]
    process = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), FAULT_ENV: fault},
                             capture_output=True, text=True, timeout=180)
    assert process.returncode == -signal.SIGKILL, process.stderr
    assert _snapshot(directory) != before  # the earlier run is aside (wholly or in part), not yet back
    _with_run_keys(config, run__overwrite=False)
    assert main(["train", str(config), "--resume"]) == 0
    assert "restored the earlier run" in capsys.readouterr().err
    assert [record["step"] for record in read_metrics(directory / "metrics.jsonl")] == [1, 2, 3]
    assert not (directory / REPLACED_DIR).exists()
    kept = {k: v for k, v in before.items() if k.startswith("checkpoints/step-00000002")}
    assert {k: v for k, v in _snapshot(directory).items() if k in kept} == kept


GENERATE = ["--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"]


def _manifest_list(step: Path) -> None:
    (step / "manifest.json").write_text("[1, 2]")


def _manifest_deep(step: Path) -> None:
    (step / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _manifest_other_model(step: Path) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["config"]["model"]["hidden_size"] = 64
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", [_manifest_list, _manifest_deep, _manifest_other_model])
def test_generate_refuses_a_hostile_manifest_in_one_line(trained: Path, tmp_path: Path, damage: Callable[[Path], None],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    _, directory = _copy(trained, tmp_path)
    step = directory / "checkpoints" / "step-00000002"
    damage(step)
    assert main(["generate", str(step), *GENERATE]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "manifest.json" in err or "do not fit the model" in err, err


@pytest.mark.parametrize(("flags", "message"), [(["--temperature", "nan"], "got nan, 1.0, 0"),
                                                (["--temperature", "inf"], "got inf, 1.0, 0"),
                                                (["--temperature", "-1"], "got -1.0, 1.0, 0"),
                                                (["--top-p", "0"], "got 1.0, 0.0, 0"),
                                                (["--top-p", "1.5"], "got 1.0, 1.5, 0")])
def test_generate_checks_sampling_options(trained: Path, flags: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(run_dir(trained)), *GENERATE, *flags]) == 2
    err = capsys.readouterr().err
    assert "need a finite temperature >= 0, top_p in (0, 1]" in err and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_generate_into_a_closed_stdout_ends_quietly(trained: Path) -> None:
    """`fastlm generate ... | head -c1`, with the reader gone before the first write: no BrokenPipe traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run([sys.executable, "-m", "fastlm", "generate", str(run_dir(trained)), *GENERATE],
                                 cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=write_end,
                                 stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert process.returncode == 0 and "Traceback" not in process.stderr and "BrokenPipe" not in process.stderr, \
        process.stderr


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_validate_flags_a_planted_lock_as_train_would(trained: Path, tmp_path: Path, kind: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    config, lock, target = _planted_lock(trained, tmp_path, kind)
    assert main(["validate", str(config), "--resume"]) == 2
    _one_line_error(capsys, str(lock), "not a regular file")
    assert main(["train", str(config), "--resume", "--dry-run"]) == 2
    _one_line_error(capsys, str(lock), "not a regular file")
    assert target.read_bytes() == OUTSIDE
