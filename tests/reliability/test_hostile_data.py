"""Hostile data and checkpoint files: every failure names the file and line (or the tensor), before training."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from crash_harness import ROOT, write_config

from fastlm.data.batch import Batch
from fastlm.data.config import DataConfig, JsonlSource
from fastlm.data.datasets import DataError
from fastlm.data.eval_source import build_loaders
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.trainer import Trainer
from fastlm.run_config.loader import load_config
from tests.step_helpers import forward_backward

GOOD = '{"text": "a fine document"}\n'


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b'{"text": "unterminated\n', "invalid JSON"),
        (b'["a", "list"]\n', "expected a JSON object, got list"),
        (b'{"body": "wrong key"}\n', "missing field 'text'"),
        (b'{"text": 42}\n', "field 'text' must be a string, got int"),
        (b'{"text": ""}\n', "field 'text' is empty"),
        (b'{"text": "   "}\n', "field 'text' is empty"),
        (b'{"text": "bad \xff byte"}\n', "not valid UTF-8"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path, bad_line: bytes, message: str) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD.encode() * 2 + bad_line + GOOD.encode())
    with pytest.raises(DataError, match=message) as caught:
        build_loaders(DataConfig(source=JsonlSource(path=str(path)), seq_len=16, micro_batch_size=2), 0, ByteTokenizer())
    assert f"{path} line 3" in str(caught.value)


def test_empty_completion_and_overlong_prompt_record(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    fields = {"prompt_field": "q", "completion_field": "a"}
    path.write_text('{"q": "1+1=", "a": "2"}\n{"q": "", "a": ""}\n', encoding="utf-8")
    with pytest.raises(DataError, match=f"{path} line 2: field 'a' is empty"):
        build_loaders(
            DataConfig(source=JsonlSource(path=str(path), **fields), seq_len=16, micro_batch_size=2), 0, ByteTokenizer()
        )
    path.write_text('{"q": "1+1=", "a": "2"}\n{"q": "' + "x" * 40 + '", "a": "y"}\n{"q": "2+2=", "a": "4"}\n',
                    encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path} line 2: prompt \+ completion is 43 tokens.*data.seq_len \+ 1 = 17"):
        build_loaders(
            DataConfig(source=JsonlSource(path=str(path), **fields), seq_len=16, micro_batch_size=2), 0, ByteTokenizer()
        )


def test_long_plain_text_documents_are_split_not_refused(tmp_path: Path) -> None:
    """A pretraining document longer than a row is cut across rows (each piece its own document id)."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "z" * 100}) + "\n" + GOOD, encoding="utf-8")
    train, _ = build_loaders(DataConfig(source=JsonlSource(path=str(path)), seq_len=16, micro_batch_size=2,
                                        eval_fraction=0.0), seed=0, tokenizer=ByteTokenizer())
    assert len(train.rows) == 7  # 102 + 17 tokens in rows of 17


@pytest.mark.parametrize("tensor", ["input_ids", "labels"])
def test_out_of_range_token_ids_name_the_tensor(tmp_path: Path, tensor: str) -> None:
    trainer = Trainer(load_config(write_config(tmp_path, "vocab", steps=1)))
    batch = trainer.objective.loader.next_batch()
    values = getattr(batch, tensor).clone()
    values[0, 3] = trainer.config.model.vocab_size + 40  # labels[0, 3] is unmasked: generated text has no prompts
    hostile = Batch(**{**batch.__dict__, tensor: values})
    with pytest.raises(DataError, match=rf"Batch.{tensor} holds token id 300 outside 0..259"):  # one line, exit 1
        forward_backward(trainer, [hostile])
    labels = batch.labels.clone()
    labels[1, 0] = -7  # -100 is the only legal negative label
    with pytest.raises(ValueError, match="Batch.labels holds token id -7"):
        forward_backward(trainer, [Batch(**{**batch.__dict__, "labels": labels})])


def _rewrite_with_checksum(step_dir: Path, name: str, data: bytes) -> None:
    """What an attacker (or a bad copy tool) can do: replace a file and fix its manifest entry too."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_hostile_safetensors_header_is_refused_and_previous_used(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "hostile", steps=2, checkpoint_every=1))
    Trainer(config).train()
    newest = Path(config.run.directory) / "checkpoints" / "step-00000002"
    _rewrite_with_checksum(newest, "model.safetensors", (10**12).to_bytes(8, "little") + b"{not json")
    with pytest.warns(RuntimeWarning, match=f"{newest}: could not read state"):
        loaded = load_latest_checkpoint(newest.parent)
    assert loaded.step == 1


def test_cli_names_bad_data_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + '{"text": 3}\n', encoding="utf-8")
    config = write_config(tmp_path, "clidata", steps=1, source={"type": "jsonl", "path": str(path)})
    done = subprocess.run([sys.executable, "-m", "fastlm", "train", str(config)], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{path} line 2: field 'text' must be a string" in done.stderr
