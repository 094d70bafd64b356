"""Hostile Hugging Face folders: `fastlm convert --from-hf` answers each with one clear error (exit 2),
never a traceback, a hang, a read outside the folder, or an allocation the machine cannot hold."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from fastlm.commands.main import main
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import build_model
from fastlm.models.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, export_hf, import_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_model(LlamaConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=32), "cpu")
    return export_hf(model, tmp_path_factory.mktemp("hf") / "tiny", ByteTokenizer())


def _edit_config(edit: Callable[[dict], dict]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        config = json.loads((directory / CONFIG_FILE).read_text())
        (directory / CONFIG_FILE).write_text(json.dumps(edit(config)))
    return apply


def _index(weight_map: object) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return apply


def _fifo_weights(directory: Path) -> None:
    (directory / WEIGHTS_FILE).unlink()
    os.mkfifo(directory / WEIGHTS_FILE)  # reading it would block forever


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "hidden_size 1e9": (_edit_config(lambda c: {**c, "hidden_size": 1_000_000_000, "num_attention_heads": 1,
                                                 "num_key_value_heads": 1, "head_dim": 1_000_000_000}),
                        r"parameters: .+ GiB as fp32, but only [\d,.]+ GiB of memory is available"),
    "100,000 layers of width 4096": (_edit_config(lambda c: {**c, "hidden_size": 4096, "num_attention_heads": 32,
                                                             "num_key_value_heads": 32, "head_dim": 128,
                                                             "intermediate_size": 11008,
                                                             "num_hidden_layers": 100_000}),
                                     r"GiB of memory is available"),
    "index path outside the folder": (_index({"model.norm.weight": "../../../../etc/passwd"}), "points outside"),
    "index absolute path": (_index({"model.norm.weight": "/etc/passwd"}), "points outside"),
    "index weight_map a list": (_index(["model.safetensors"]), "weight_map: must map tensor names to file names"),
    "index not JSON": (lambda d: (d / INDEX_FILE).write_text("{"), "is not valid JSON"),
    "index nested 100k deep": (lambda d: (d / INDEX_FILE).write_text("[" * 100_000 + "]" * 100_000),
                               "nested too deeply"),
    "config.json invalid UTF-8": (lambda d: (d / CONFIG_FILE).write_bytes(b'{"model_type": "\xff"}'),
                                  "is not valid JSON"),
    "config.json rope_parameters a list": (_edit_config(lambda c: {**c, "rope_parameters": [1, 2]}),
                                           "a field has the wrong type or value"),
    "safetensors header garbage": (lambda d: (d / WEIGHTS_FILE).write_bytes((10**6).to_bytes(8, "little") + b"{no"),
                                   "is not a readable safetensors file"),
    "safetensors truncated": (lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:200]),
                              "is not a readable safetensors file"),
    "weights are a FIFO": (_fifo_weights, "is not a regular file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_hf_folder_is_one_clear_error(folder: Path, tmp_path: Path, case: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "hf"
    shutil.copytree(folder, directory)
    damage, message = HOSTILE[case]
    damage(directory)
    assert main(["convert", "--from-hf", str(directory)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("invalid configuration") and "Traceback" not in stderr
    assert re.search(message, stderr), stderr


def test_the_untouched_folder_imports(folder: Path) -> None:
    """The control: the same folder without damage imports (so the refusals above are the damage's)."""
    assert import_hf(folder, "cpu").config.hidden_size == 32
