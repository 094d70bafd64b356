"""A full disk (a real, size-limited tmpfs) is one clear line and loses nothing.

The run's directory lives on a 700 KiB tmpfs: the first checkpoint (about 420 KiB) fits, the second
does not. `fastlm train` must exit 1 naming the checkpoint, the space needed and free and that the
previous checkpoint is intact, leave no temporary directory; `--resume` on the still-full disk must
refuse up front; after the disk grows (remount) the resume finishes with every step logged once.
Mounting needs root (CI runs as root).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from crash_harness import finish, run_dir, start, write_config

from fastlm.commands.main import main
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.logging.jsonl import JsonlSink, read_metrics
from fastlm.system.disk_space import DiskFullError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a size-limited tmpfs needs root")


def _mount(path: Path, size: str, remount: bool = False) -> None:
    options = f"remount,size={size}" if remount else f"size={size}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, "700k")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_is_one_line_and_loses_nothing(small_disk: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, "full", steps=4, checkpoint_every=1, keep=1)
    config.write_text(config.read_text().replace(str(tmp_path / "{name}"), str(small_disk / "{name}")))
    directory = run_dir(config)
    code, stderr = finish(start(config, resume=False))
    assert code == 1 and "Traceback" not in stderr, stderr
    line = next(line for line in stderr.splitlines() if line.startswith("fastlm:"))
    print(line)
    assert "no space left on device writing checkpoint step-00000002" in line
    assert "the previous checkpoint step-00000001 is intact" in line and "MiB is free" in line
    checkpoints = directory / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000001"]  # no .tmp-* left
    assert load_latest_checkpoint(checkpoints).step == 1

    code, stderr = finish(start(config, resume=True))  # the disk is still full: said before any step runs
    assert code == 1 and "not enough space" in stderr and "the previous checkpoint is intact" in stderr, stderr

    _mount(small_disk, "4m", remount=True)
    code, stderr = finish(start(config, resume=True))
    assert code == 0, stderr
    assert [record["step"] for record in read_metrics(directory / "metrics.jsonl")] == [1, 2, 3, 4]


def test_full_disk_while_logging_names_the_record(small_disk: Path) -> None:
    filler = small_disk / "filler"
    with filler.open("wb", buffering=0) as handle:  # take every free block
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
    sink = JsonlSink(small_disk / "metrics.jsonl")
    with pytest.raises(DiskFullError, match="no space left on device writing the step 7 record of metrics.jsonl"):
        sink.log(7, {"train/loss": 1.0})


def test_full_disk_during_prepare_is_one_line_and_leaves_nothing(small_disk: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"  # about 2 MiB of tokens (2-byte ids) for a 700 KiB disk
    corpus.write_text("\n\n".join(f"document {i} " + "words " * 160 for i in range(1000)), encoding="utf-8")
    config = tmp_path / "prepare.yaml"
    config.write_text(f"input_path: {corpus}\noutput_path: {small_disk / 'prepared'}\n")
    assert main(["prepare", str(config)]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    print(line)
    assert line.startswith("fastlm prepare: no space left on device writing the prepared data set prepared")
    assert "nothing was moved into place" in line and "Traceback" not in line
    assert list(small_disk.iterdir()) == []  # no staging directory left
