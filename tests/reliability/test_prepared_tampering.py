"""A prepared data set is never trusted blindly: each tampering below (the red team's 33, grouped by the check
that catches them) is one line naming the file, at open (what `validate` and `train` do), never a traceback
or a run that trains on garbage. `fastlm prepare --verify` checks the tokens in full. SFT records longer
than a row are refused alike from a prepared set and from JSONL.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from crash_harness import write_config

from fastlm.commands.main import main
from fastlm.data.config import JsonlSource
from fastlm.data.datasets import DataError, load_documents, pack_documents
from fastlm.data.prepare import PrepareConfig, prepare
from fastlm.data.prepared import SAMPLE_BLOCKS, SAMPLE_BYTES, TOKENS_FILE, open_prepared, token_sample
from fastlm.data.tokenizer import ByteTokenizer

SFT = [{"prompt": f"question {i}? ", "completion": f"answer {i}" + "!" * (i % 7)} for i in range(40)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("prepared")
    (directory / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT))
    return prepare(PrepareConfig(input_path=str(directory / "sft.jsonl"), output_path=str(directory / "out"),
                                 prompt_field="prompt", completion_field="completion")).path


def _metadata(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(out: Path) -> None:
        metadata = json.loads((out / "metadata.json").read_text())
        result = edit(metadata)
        (out / "metadata.json").write_text(json.dumps(result if isinstance(result, list) else metadata))
    return apply


def _offsets(make: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], None]:
    def apply(out: Path) -> None:
        np.save(out / "documents.npy", make(np.load(out / "documents.npy")))
    return apply


def _poke_tokens(value: int, fix_checksum: bool) -> Callable[[Path], None]:
    """Change one id in place (same size); with `fix_checksum`, the attacker also fixes the sampled checksum."""
    def apply(out: Path) -> None:
        tokens = np.fromfile(out / TOKENS_FILE, dtype=np.uint16)
        tokens[len(tokens) // 2] = value
        tokens.tofile(out / TOKENS_FILE)
        if fix_checksum:
            _metadata(lambda m: m.update(tokens_sample_sha256=token_sample(out / TOKENS_FILE, np.dtype("uint16"))[0]))(out)
    return apply


def _shift_boundary(offsets: np.ndarray) -> np.ndarray:
    """Move one document boundary by a token: still int64, from 0 to the end, never decreasing."""
    shifted = offsets.copy()
    shifted[5] += 1
    return shifted


def _flip_flag(out: Path) -> None:
    """One token of the SFT loss mask turned from prompt to target (same size: only a checksum sees it)."""
    flags = np.fromfile(out / "targets.bin", dtype=np.uint8)
    flags[int(np.argmin(flags))] = 1
    flags.tofile(out / "targets.bin")


def _deep(out: Path) -> None:
    (out / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)


TAMPERINGS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no dtype": (_metadata(lambda m: m.pop("dtype")), "'dtype' must be one of"),
    "float16 dtype": (_metadata(lambda m: m.update(dtype="float16")), "'dtype' must be one of"),
    "list dtype": (_metadata(lambda m: m.update(dtype=["uint16"])), "'dtype' must be one of"),
    "string count": (_metadata(lambda m: m.update(tokens="12")), "'tokens' must be an integer"),
    "float count": (_metadata(lambda m: m.update(documents=40.0)), "'documents' must be an integer"),
    "negative count": (_metadata(lambda m: m.update(tokens=-1)), "'tokens' must be an integer"),
    "more documents than tokens": (_metadata(lambda m: m.update(documents=10**9)), "'documents' must be"),
    "bool has_targets": (_metadata(lambda m: m.update(has_targets="yes")), "'has_targets' must be true or false"),
    "no tokenizer": (_metadata(lambda m: m.pop("tokenizer")), "'tokenizer' must be an object"),
    "tokenizer a list": (_metadata(lambda m: m.update(tokenizer=[])), "'tokenizer' must be an object"),
    "max id past vocab": (_metadata(lambda m: m.update(max_token_id=10**6)), "'max_token_id' must be an integer below"),
    "bad checksum field": (_metadata(lambda m: m.update(tokens_sample_sha256=7)), "must be a sha256 hex digest"),
    "metadata a list": (_metadata(lambda m: [m]), "not a fastlm-prepared v2 metadata file"),
    "deep metadata": (_deep, "nested too deeply"),
    "metadata not UTF-8": (lambda out: (out / "metadata.json").write_bytes(b'{"format": "\xff"}'), "not valid JSON"),
    "float offsets": (_offsets(lambda o: o.astype(np.float64)), "offsets (float64"),
    "int32 offsets": (_offsets(lambda o: o.astype(np.int32)), "offsets (int32"),
    "2-D offsets": (_offsets(lambda o: np.stack([o, o])), "shape (2, 41)"),
    "non-monotonic offsets": (_offsets(lambda o: np.concatenate([o[:5], o[6:7], o[5:6], o[7:]])), "must never decrease"),
    "offsets past the end": (_offsets(lambda o: o + 1), "offsets (int64, shape (41,))"),
    "truncated offsets": (lambda out: (out / "documents.npy").write_bytes((out / "documents.npy").read_bytes()[:90]),
                          "documents.npy: unreadable"),
    "pickled offsets": (lambda out: np.save(out / "documents.npy", np.array([{"a": 1}], dtype=object)), "unreadable"),
    "tokens edited": (_poke_tokens(65, fix_checksum=False), "sampled checksum does not match"),
    "id past the vocab, checksum fixed": (_poke_tokens(300, fix_checksum=True), "holds token id 300, past the tokenizer's"),
    "truncated tokens": (lambda out: (out / TOKENS_FILE).write_bytes((out / TOKENS_FILE).read_bytes()[:-2]), "truncated"),
    "truncated targets": (lambda out: (out / "targets.bin").write_bytes(b"\x01"), "target flags"),
    "loss mask edited": (_flip_flag, "targets.bin: its sampled checksum does not match"),
    "document boundary shifted": (_offsets(_shift_boundary), "documents.npy: its sha256 does not match"),
    "targets declared absent": (_metadata(lambda m: m.update(has_targets=False)), "targets.bin: present, but"),
    "no offsets checksum": (_metadata(lambda m: m.pop("offsets_sha256")), "'offsets_sha256' must be a sha256"),
    "no targets checksum": (_metadata(lambda m: m.pop("targets_sample_sha256")), "'targets_sample_sha256' must be"),
    "a v1 set": (_metadata(lambda m: m.update(version=1)), "v1, written by an earlier fastlm"),
}


@pytest.mark.parametrize("name", list(TAMPERINGS))
def test_tampering_is_one_line_naming_the_file(prepared: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    tamper, message = TAMPERINGS[name]
    tamper(out)
    with pytest.raises(DataError) as caught:
        open_prepared(out, ByteTokenizer())
    text = str(caught.value)
    assert message in text and str(out) in text and "\n" not in text, text


def test_validate_and_train_refuse_a_tampered_set_in_one_line(prepared: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    _poke_tokens(300, fix_checksum=True)(out)
    config = write_config(tmp_path, "run", steps=1, source={"type": "memmap", "path": str(out)})
    assert main(["validate", str(config)]) == 2
    assert main(["train", str(config)]) == 2  # the same preflight: nothing written
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("holds token id 300") == 2, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["loss mask edited", "document boundary shifted"])
def test_validate_and_train_refuse_an_edited_mask_or_boundary(prepared: Path, tmp_path: Path, name: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    TAMPERINGS[name][0](out)
    config = write_config(tmp_path, "run", steps=1, source={"type": "memmap", "path": str(out)})
    assert main(["validate", str(config)]) == 2
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count(TAMPERINGS[name][1]) == 2, err
    assert not (tmp_path / "run").exists()


def test_verify_checks_every_target_flag_where_the_sample_does_not(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """An SFT set whose loss mask is larger than the sample: a flag changed between sampled blocks passes open
    (cheap), not --verify; a flag that is neither 0 nor 1 is named."""
    records = [{"prompt": f"q{i}? ", "completion": "answer " * 120} for i in range(400)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "prepare.yaml"
    config.write_text(yaml.safe_dump({"input_path": str(tmp_path / "sft.jsonl"), "output_path": str(tmp_path / "out"),
                                      "prompt_field": "prompt", "completion_field": "completion"}))
    assert main(["prepare", str(config)]) == 0
    assert main(["prepare", str(config), "--verify"]) == 0
    assert "every file's sha256, every id and target flag match" in capsys.readouterr().out
    path = tmp_path / "out" / "targets.bin"
    assert path.stat().st_size > SAMPLE_BLOCKS * SAMPLE_BYTES
    original = path.read_bytes()
    for value, message in ((original[SAMPLE_BYTES + 10] ^ 1, "targets.bin: sha256 does not match"),
                           (2, f"targets.bin: flag {SAMPLE_BYTES + 10} is not 0 or 1")):
        data = bytearray(original)
        data[SAMPLE_BYTES + 10] = value  # inside the gap after the first sampled block
        path.write_bytes(bytes(data))
        open_prepared(tmp_path / "out", ByteTokenizer())  # the sampled check does not read it
        assert main(["prepare", str(config), "--verify"]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_verify_checks_every_token_where_the_sample_does_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A set larger than the sample: an id changed between sampled blocks passes open (cheap), not --verify."""
    text = tmp_path / "big.txt"
    text.write_text("\n\n".join(f"paragraph {i} " + "lorem ipsum dolor " * 40 for i in range(400)))
    config = tmp_path / "prepare.yaml"
    config.write_text(yaml.safe_dump({"input_path": str(text), "output_path": str(tmp_path / "out")}))
    assert main(["prepare", str(config)]) == 0
    assert main(["prepare", str(config), "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    path = tmp_path / "out" / TOKENS_FILE
    assert path.stat().st_size > SAMPLE_BLOCKS * SAMPLE_BYTES
    data = bytearray(path.read_bytes())
    data[SAMPLE_BYTES + 10] ^= 1  # inside the gap after the first sampled block
    path.write_bytes(bytes(data))
    open_prepared(tmp_path / "out", ByteTokenizer())  # the sampled check does not read it
    assert main(["prepare", str(config), "--verify"]) == 1
    err = capsys.readouterr().err
    assert "tokens.bin: sha256 does not match" in err and "Traceback" not in err
    assert hashlib.sha256(bytes(data)).hexdigest()  # (the file stays as the attacker left it)


def test_sft_records_longer_than_a_row_are_refused_alike(prepared: Path, tmp_path: Path) -> None:
    """The JSONL source and a prepared set of the same records: the same rule, the same words."""
    source = JsonlSource(type="jsonl", path=str(prepared.parent / "sft.jsonl"), prompt_field="prompt",
                         completion_field="completion")
    documents = load_documents(source, ByteTokenizer())
    longest = max(len(d.tokens) for d in documents)
    seq_len = longest - 3
    rule = rf"tokens \(with BOS/EOS\), more than one row of data.seq_len \+ 1 = {seq_len + 1}; splitting it would"
    with pytest.raises(DataError, match=rule):
        pack_documents(documents, seq_len, 0)
    config = write_config(tmp_path, "run", steps=1, source={"type": "memmap", "path": str(prepared)})
    data = yaml.safe_load(config.read_text())
    data["data"]["seq_len"] = seq_len
    config.write_text(yaml.safe_dump(data))
    from fastlm.data.memmap import memmap_rows
    from fastlm.run_config.loader import load_config

    with pytest.raises(DataError, match=rf"{longest} {rule}"):
        memmap_rows(str(prepared), load_config(config).data, 0, ByteTokenizer())
