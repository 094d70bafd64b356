"""`fastlm prepare` through `datasets`, the prepared layout, and its bad inputs (file + line/row + fix, nothing half-written)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from datasets import Dataset

from fastlm.commands.main import main
from fastlm.data.batch import batch_from_rows
from fastlm.data.config import DataConfig, HuggingFaceTokenizerConfig, JsonlSource
from fastlm.data.datasets import DataError, load_documents, pack_documents
from fastlm.data.memmap import memmap_rows
from fastlm.data.prepare import PrepareConfig, prepare
from fastlm.data.prepared import TOKENS_FILE, open_prepared
from fastlm.data.tokenizer import ByteTokenizer, build_tokenizer
from fastlm.engine.preflight import preflight_issues
from fastlm.run_config.schema import RunConfig

RECORDS = [{"text": f"document {i}: " + "word " * (i % 7), "prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)]


def _jsonl(path: Path, records: list[dict] = RECORDS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _prepare(tmp_path: Path, input_path: Path, name: str = "out", **fields) -> Path:
    return prepare(PrepareConfig(input_path=str(input_path), output_path=str(tmp_path / name), **fields)).path


def test_prepared_rows_equal_the_in_memory_packing(tmp_path: Path) -> None:
    """Same documents, same rows: the memmap loader cuts the stream exactly as pack_documents does."""
    tokenizer = ByteTokenizer()
    out = _prepare(tmp_path, _jsonl(tmp_path / "sft.jsonl"), prompt_field="prompt", completion_field="completion", num_proc=2)
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["tokenizer"]["fingerprint"] == tokenizer.fingerprint and metadata["dtype"] == "uint16"
    assert metadata["documents"] == 40 and metadata["has_targets"] and metadata["sources"][0]["path"].endswith("sft.jsonl")
    documents = load_documents(JsonlSource(path=str(tmp_path / "sft.jsonl"), prompt_field="prompt",
                                           completion_field="completion"), tokenizer)
    expected = pack_documents(documents, seq_len=15, pad_id=tokenizer.pad_id)
    rows, held_out = memmap_rows(str(out), DataConfig(seq_len=15, eval_fraction=0.0), 0, tokenizer)
    assert held_out is None and len(rows) == len(expected)
    picks = torch.arange(len(rows))
    ours, theirs = batch_from_rows(*rows.take(picks)), batch_from_rows(*expected.take(picks))
    for name in ("input_ids", "labels", "document_ids", "padding"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.padding.any() and torch.equal(ours.padding, ours.input_ids == tokenizer.pad_id)  # the last row's tail


def test_parquet_csv_and_jsonl_give_the_same_tokens(tmp_path: Path) -> None:
    Dataset.from_list(RECORDS).to_parquet(str(tmp_path / "data.parquet"))
    Dataset.from_list(RECORDS).to_csv(str(tmp_path / "data.csv"), index=False)
    outputs = [_prepare(tmp_path, path, path.suffix[1:]) for path in
               (_jsonl(tmp_path / "data.jsonl"), tmp_path / "data.parquet", tmp_path / "data.csv")]
    tokens = [np.fromfile(out / TOKENS_FILE, dtype=np.uint16) for out in outputs]
    assert all(np.array_equal(tokens[0], other) for other in tokens[1:])
    assert ByteTokenizer().decode(tokens[0][: tokens[0].tolist().index(257) + 1]) == RECORDS[0]["text"]


def test_text_files_split_at_blank_lines_and_hf_tokenizers_pick_uint16(tmp_path: Path, bpe_dir: Callable[[str], Path]) -> None:
    (tmp_path / "corpus.txt").write_text("first doc\nstill first\n\n\nsecond doc\n", encoding="utf-8")
    config = HuggingFaceTokenizerConfig(path=str(bpe_dir("llama")))
    out = _prepare(tmp_path, tmp_path / "corpus.txt", tokenizer=config.model_dump())
    dataset = open_prepared(out, build_tokenizer(config))
    assert dataset.num_documents == 2 and dataset.targets is None
    tokenizer = build_tokenizer(config)
    texts = [tokenizer.decode(dataset.tokens[a:b].tolist()) for a, b in zip(dataset.offsets[:-1], dataset.offsets[1:])]
    assert [t.strip() for t in texts] == ["first doc\nstill first", "second doc"]


@pytest.mark.parametrize(("write", "fields", "message"), [
    (lambda p: _jsonl(p / "x.jsonl"), {"text_field": "body"}, r"x.jsonl: no column 'body' \(columns: .*set text_field"),
    (lambda p: Dataset.from_list(RECORDS).to_parquet(str(p / "x.parquet")) and p / "x.parquet",
     {"messages_field": "messages"}, r"x.parquet: no column 'messages'"),
    (lambda p: _jsonl(p / "x.jsonl", RECORDS[:3] + [{"text": ""}]), {}, r"x.jsonl row 4: field 'text' is empty"),
    (lambda p: (p / "x.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n') and p / "x.jsonl", {},
     r"x.jsonl line 2: not valid UTF-8"),
    (lambda p: (p / "x.jsonl").write_text('{"text": "ok"}\n{"text": \n') and p / "x.jsonl", {},
     r"x.jsonl: could not be read as json"),
    (lambda p: (p / "x.jsonl").write_text("") or p / "x.jsonl", {}, r"no documents \(the input files are empty\)"),
])
def test_bad_inputs_name_the_file_and_leave_nothing(tmp_path: Path, write, fields: dict, message: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    path = write(data)
    with pytest.raises(DataError, match=message):
        _prepare(tmp_path, path, **fields)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no output, no staging directory


def test_damaged_prepared_sets_are_refused_with_the_fix(tmp_path: Path, bpe_dir: Callable[[str], Path]) -> None:
    out = _prepare(tmp_path, _jsonl(tmp_path / "d.jsonl"))
    with pytest.raises(DataError, match=r"prepared with tokenizer byte .* but the run uses huggingface:.*prepare it again"):
        open_prepared(out, build_tokenizer(HuggingFaceTokenizerConfig(path=str(bpe_dir("llama")))))
    offsets = np.load(out / "documents.npy")
    np.save(out / "documents.npy", offsets[:-1])  # an index that lost its last document
    with pytest.raises(DataError, match=r"documents.npy: holds 40 offsets .* metadata says 40 documents"):
        open_prepared(out, ByteTokenizer())
    (out / "documents.npy").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"documents.npy: unreadable"):
        open_prepared(out, ByteTokenizer())
    np.save(out / "documents.npy", offsets)
    tokens = out / TOKENS_FILE
    tokens.write_bytes(tokens.read_bytes()[:-6])
    with pytest.raises(DataError, match=r"tokens.bin: \d+ bytes, but .*metadata.json says \d+ .*truncated"):
        open_prepared(out, ByteTokenizer())
    (out / "metadata.json").unlink()  # what a killed prepare would leave, were it renamed
    with pytest.raises(DataError, match=r"metadata.json: missing.*run `fastlm prepare` again"):
        open_prepared(out, ByteTokenizer())


def test_cli_prepare_then_validate_checks_vocab_and_tokenizer(tmp_path: Path, bpe_dir: Callable[[str], Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "prep.yaml").write_text(yaml.safe_dump({"input_path": "d.jsonl", "output_path": "prepared"}))
    assert main(["prepare", str(tmp_path / "prep.yaml"), "num_proc=2"]) == 0
    assert "prepared" in capsys.readouterr().out
    assert main(["prepare", str(tmp_path / "prep.yaml")]) == 2
    assert "already exists; choose another output_path or set overwrite: true" in capsys.readouterr().err
    config = {"model": {"vocab_size": 256}, "data": {"source": {"type": "memmap", "path": str(tmp_path / "prepared")}}}
    issues = preflight_issues(RunConfig.model_validate(config))
    assert [i.path for i in issues] == ["data.source.path"] and "token id 257, beyond model.vocab_size 256" in str(issues[0])
    config["data"]["tokenizer"] = {"type": "huggingface", "path": str(bpe_dir("qwen2"))}
    config["model"]["vocab_size"] = 512
    [issue] = preflight_issues(RunConfig.model_validate(config))
    assert "prepared with tokenizer byte" in str(issue)
