"""Data fingerprints: content decides (moved data is the same data), every file of a prepared directory
and of a blend counts, large files are sampled at bounded cost with the time standing in for the rest."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from fastlm.config.base import ConfigModel
from fastlm.data import fingerprint
from fastlm.data.config import TextSource
from fastlm.data.fingerprint import data_fingerprint, describe_change, source_files


class _Entry(ConfigModel):
    path: str


class _Blend(ConfigModel):
    """Shaped like a blend of prepared directories: paths nested in a list of sections."""

    sources: list[_Entry]
    tokenizer_path: str | None = None


def test_moved_data_with_the_same_content_is_unchanged(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "corpus.txt").write_text("one\n\ntwo\n")
    before = data_fingerprint(TextSource(path=str(tmp_path / "a" / "corpus.txt")))
    shutil.move(tmp_path / "a", tmp_path / "b")
    after = data_fingerprint(TextSource(path=str(tmp_path / "b" / "corpus.txt")))
    assert describe_change(before, after) is None
    (tmp_path / "b" / "corpus.txt").write_text("one\n\ntwo!\n")
    changed = data_fingerprint(TextSource(path=str(tmp_path / "b" / "corpus.txt")))
    assert describe_change(before, changed) == f"{tmp_path / 'b' / 'corpus.txt'} changed: 9 bytes then, 10 now"


def test_directories_and_nested_paths_count_every_file(tmp_path: Path) -> None:
    for name in ("first", "second"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "tokens.bin").write_bytes(b"\0" * 8)
        (tmp_path / name / "sub" / "offsets.npy").write_bytes(b"\1" * 8)
    blend = _Blend(sources=[_Entry(path=str(tmp_path / "first")), _Entry(path=str(tmp_path / "second"))])
    assert [p.relative_to(tmp_path).as_posix() for p in source_files(blend)] == [
        "first/sub/offsets.npy", "first/tokens.bin", "second/sub/offsets.npy", "second/tokens.bin"]
    before = data_fingerprint(blend)
    (tmp_path / "second" / "sub" / "offsets.npy").write_bytes(b"\2" * 8)
    assert describe_change(before, data_fingerprint(blend)) == (
        f"{tmp_path / 'second' / 'sub' / 'offsets.npy'} changed: same size, different content")


def test_large_files_are_sampled_and_the_time_decides(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1 << 12)
    monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 1 << 8)
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(1 << 16))
    (before,) = fingerprint.fingerprint_files([path])
    assert not before["complete"]
    os.utime(path, ns=(before["mtime_ns"] + 10**9, before["mtime_ns"] + 10**9))  # touched, content unchanged
    stored, now = {"source": {}, "files": [before]}, {"source": {}, "files": fingerprint.fingerprint_files([path])}
    assert "was modified since (its content is only sampled" in describe_change(stored, now)


def test_another_tokenizer_is_other_data(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("one\n\ntwo\n")
    source = TextSource(path=str(tmp_path / "corpus.txt"))
    assert describe_change(data_fingerprint(source, "aaaa"), data_fingerprint(source, "aaaa")) is None
    assert describe_change(data_fingerprint(source, "aaaa"), data_fingerprint(source, "bbbb")) == (
        "the tokenizer changed (fingerprint aaaa then, bbbb now)")
