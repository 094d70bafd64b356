"""README's "LoRA" commands, as written, on a copy of configs/ after the "Fine-tune a Hugging Face model" steps
(demo model, model section, prepared chat data); training commands get a few steps appended."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel

from fastlm.commands.main import main

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import make_tiny_hf  # noqa: E402 - after tools/ joins the path

SHORT = {"sft_lora": ["trainer.steps=3", "trainer.eval_every=0", "logging.wandb.enabled=false"],
         "grpo_lora": ["trainer.steps=3", "rl.warmup_steps=1", "rl.prompts_per_rollout=2", "rl.group_size=4",
                       "rl.eval_prompts=0", "data.micro_batch_size=8", "logging.wandb.enabled=false"]}


def readme_lora_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## LoRA\n"):]
    section = section[:section.index("\n## ", 1)]
    return [shlex.split(line.split("#")[0])[1:] for line in re.findall(r"^    (fastlm .*)$", section, re.MULTILINE)]


def test_readme_lora_commands_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    make_tiny_hf.tiny_hf_checkpoint(tmp_path / "demo" / "hf-model")
    make_tiny_hf.addition_chat_jsonl(tmp_path / "demo" / "chat.jsonl", 100, seed=1)
    assert main(["convert", "--from-hf", "demo/hf-model"]) == 0
    (tmp_path / "hf_model.yaml").write_text(capsys.readouterr().out)
    assert main(["prepare", "configs/prepare/chat.yaml"]) == 0
    commands = readme_lora_commands()
    assert [c[0] for c in commands] == ["validate", "train", "generate", "convert", "convert", "convert", "train"]
    for command in commands:
        name = Path(command[1]).stem if command[0] == "train" else None
        assert main(command + SHORT.get(name, [])) == 0, command
        if command[0] == "validate":
            assert "LoRA: " in capsys.readouterr().out
    base = transformers.AutoModelForCausalLM.from_pretrained("demo/hf-model")
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 30]])
        adapted = PeftModel.from_pretrained(base, "exported/sft_lora_peft").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained("exported/sft_lora_merged").eval()(ids).logits
    assert float((adapted - merged).abs().max()) < 1e-5
    assert (tmp_path / "adapters" / "sft_lora" / "lora.yaml").is_file()
