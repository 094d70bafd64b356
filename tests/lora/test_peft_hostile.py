"""`fastlm convert --from-peft` and `model.lora.adapter_path` on a hostile PEFT folder: every damaged
adapter_config.json or safetensors file is one line and exit 2, before anything is allocated from it (`r: 1e9`
tried 512 GB) or written (a wrong-shaped or NaN lora_A was written without complaint; `r: 4.7` was truncated to
4 while the scale used 4.7). The adapter is a real PEFT save on a real transformers base."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from fastlm.commands.main import main

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny Qwen2 base, a PEFT LoRA adapter on its q_proj and v_proj, rank 4, with B made non-zero)."""
    directory = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model.save_pretrained(directory / "base")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    peft_model.save_pretrained(directory / "adapter")
    config = json.loads((directory / "adapter" / CONFIG).read_text())
    config["base_model_name_or_path"] = str(directory / "base")
    (directory / "adapter" / CONFIG).write_text(json.dumps(config))
    return directory / "base", directory / "adapter"


def _config(**changes: object) -> Callable[[Path], None]:
    def apply(adapter: Path) -> None:
        config = json.loads((adapter / CONFIG).read_text())
        for key, value in changes.items():
            if value is _MISSING:
                config.pop(key)
            else:
                config[key] = value
        (adapter / CONFIG).write_text(json.dumps(config))  # NaN is written as NaN, as Python's json reads it
    return apply


def _tensor(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(adapter: Path) -> None:
        tensors = load_file(str(adapter / WEIGHTS))
        edit(tensors)
        save_file(tensors, str(adapter / WEIGHTS))
    return apply


def _bytes(make: Callable[[bytes], bytes], name: str = WEIGHTS) -> Callable[[Path], None]:
    def apply(adapter: Path) -> None:
        (adapter / name).write_bytes(make((adapter / name).read_bytes()))
    return apply


_MISSING = object()
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "r 0": (_config(r=0), "'r' must be a whole number >= 1, got 0"),
    "r -4": (_config(r=-4), "'r' must be a whole number >= 1, got -4"),
    "r a string": (_config(r="x"), "'r' must be a whole number >= 1, got 'x'"),
    "r 1e9": (_config(r=1e9), "'r' must be a whole number >= 1, got 1000000000.0"),
    "r 10**9 as an integer": (_config(r=10**9), "rank 1000000000 (adapter_config.json) needs lora_A (rank, in)"),
    "r 4.7": (_config(r=4.7), "'r' must be a whole number >= 1, got 4.7"),
    "r missing": (_config(r=_MISSING), "'r' must be a whole number >= 1, got None"),
    "alpha NaN": (_config(lora_alpha=float("nan")), "'lora_alpha' must be a finite number > 0, got nan"),
    "alpha 0": (_config(lora_alpha=0), "'lora_alpha' must be a finite number > 0, got 0"),
    "target_modules empty": (_config(target_modules=[]), "'target_modules' must be a module name or a list"),
    "target_modules a number": (_config(target_modules=5), "'target_modules' must be a module name or a list"),
    "target_modules unknown": (_config(target_modules=["nope_proj"]), "'nope_proj' matches no linear of this model"),
    "rank_pattern bad regex": (_config(rank_pattern={"(": 4}), "'rank_pattern' must be {regex: whole number >= 1}"),
    "100k-deep JSON": (_bytes(lambda _: b"[" * 100_000 + b"]" * 100_000, CONFIG),
                       "not a PEFT adapter config (nested too deeply)"),
    "config not JSON": (_bytes(lambda _: b"\xff\xfe", CONFIG), "not a PEFT adapter config (not UTF-8)"),
    "truncated safetensors": (_bytes(lambda data: data[: len(data) // 2]), "not a readable safetensors file"),
    "garbage safetensors": (_bytes(lambda _: b"\x10" * 64), "not a readable safetensors file"),
    "wrong-shaped lora_A": (_tensor(lambda t: t.update({A_KEY: torch.randn(4, 31)})), "do not fit"),
    "NaN in lora_A": (_tensor(lambda t: t[A_KEY].view(-1)[3].fill_(float("nan"))), f"tensor {A_KEY} holds NaN or inf"),
    "lora_B missing": (_tensor(lambda t: t.pop(A_KEY.replace("lora_A", "lora_B"))), "q_proj's factors are {'A': (4, 32)}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_peft_folder_is_one_line_and_exit_2(saved: tuple[Path, Path], tmp_path: Path, case: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base, adapter = saved
    hostile = tmp_path / "adapter"
    shutil.copytree(adapter, hostile)
    damage, message = CASES[case]
    damage(hostile)
    assert main(["convert", "--from-peft", str(hostile), "--from", str(base), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_the_intact_adapter_imports(saved: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, adapter = saved
    assert main(["convert", "--from-peft", str(adapter), "--to", str(tmp_path / "out")]) == 0
    assert "rank: 4" in capsys.readouterr().out
    assert (tmp_path / "out" / "adapter.safetensors").is_file()


def test_an_adapter_of_a_higher_rank_names_one_fix(saved: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """model.lora.adapter_path on a sound rank-4 adapter with model.lora.rank 2: the config is to change, and the
    issue says so once (it used to blame the folder: 'unreadable adapter ... raise it. Fix: point it at a PEFT
    adapter folder')."""
    import yaml

    from fastlm.models.hf import config_from_hf

    base, adapter = saved
    section = config_from_hf(json.loads((base / "config.json").read_text())).model_dump(mode="json", exclude={"head"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "run", "output_dir": str(tmp_path / "run"), "init_path": str(base)},
        "model": {**section, "lora": {"rank": 2, "alpha": 4.0, "targets": ["q_proj", "v_proj"],
                                      "adapter_path": str(adapter)}},
        "data": {"source": {"type": "generated", "num_documents": 20}, "seq_len": 16, "micro_batch_size": 2},
        "trainer": {"device": "cpu"}, "logging": {"wandb": {"enabled": False}}}))
    assert main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "model.lora.adapter_path: does not fit model.lora: " in err and "more than model.lora.rank 2" in err, err
    assert "Fix: match model.lora.rank and targets to the adapter" in err and "point it at" not in err, err
