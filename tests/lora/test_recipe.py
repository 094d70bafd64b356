"""README's "Recipe" commands, as written, from a working directory that is not the recipe's: `fastlm init`,
a tiny Qwen3, LoRA SFT on its chat JSONL, PEFT export, GRPO from those adapters with the recipe's reward on
its prompt JSONL, PEFT export again; training commands get a few steps appended. The last adapter loads in
HF PEFT with fastlm's logits, and GRPO started from the SFT adapters (not from B = 0)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file

from fastlm.commands.main import main
from fastlm.engine.lora_training import load_lora_run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import make_tiny_hf  # noqa: E402 - after tools/ joins the path

QUIET = ["trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.wandb.enabled=false", "logging.progress=false"]
SHORT = {"sft": ["trainer.steps=3", "data.micro_batch_size=4", *QUIET],
         "grpo": ["trainer.steps=2", "trainer.grad_accumulation=1", "rl.prompts_per_rollout=2", "rl.group_size=2",
                  "rl.updates_per_rollout=1", "rl.max_new_tokens=3", "rl.eval_prompts=0", "data.micro_batch_size=4", *QUIET]}


def readme_recipe_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Recipe"):]
    section = section[:section.index("\n## ", 1)]
    return [shlex.split(line.split("#")[0]) for line in re.findall(r"^    ((?:fastlm|python) .*)$", section, re.MULTILINE)]


def run(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One README line: `fastlm ...` through main (stdout to the file after `>`), or the tiny-model tool."""
    if command[0] == "python":
        monkeypatch.setattr(sys, "argv", [command[1], *command[2:], "--conversations", "60"])
        make_tiny_hf.main()
        return
    arguments, target = command[1:], None
    if ">" in command:
        arguments, target = command[1:command.index(">")], command[command.index(">") + 1]
    name = Path(arguments[1]).stem if arguments[0] == "train" else None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(arguments + SHORT.get(name, [])) == 0, command
    if target is not None:
        Path(target).write_text(printed.getvalue())


def test_readme_recipe_runs_from_another_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    commands = readme_recipe_commands()
    assert [c[1] for c in commands] == ["init", "tools/make_tiny_hf.py", "convert", "prepare", "train", "convert",
                                        "train", "convert"]
    for command in commands:
        if command[0] == "python":
            command = [command[0], str(ROOT / command[1]), *command[2:]]
        run(command, monkeypatch)
    recipe = tmp_path / "mychat"
    assert "type: qwen3" in (recipe / "model.yaml").read_text()
    sft, grpo = (load_file(recipe / "adapters" / name / "adapter_model.safetensors") for name in ("sft", "grpo"))
    ups = [key for key in sft if "lora_B" in key]
    assert ups and set(grpo) == set(sft)
    moved_from_zero = sum(float(sft[key].norm()) for key in ups)
    gap = sum(float((grpo[key] - sft[key]).norm()) for key in ups)
    print(f"GRPO's adapters vs the SFT export: |B_sft| {moved_from_zero:.3e}, |B_grpo - B_sft| {gap:.3e}")
    assert moved_from_zero > 0 and gap < 0.5 * moved_from_zero  # started from the SFT adapters, not from B = 0

    ours = load_lora_run(str(tmp_path / "runs" / "chat_grpo"))[0].eval()
    ids = torch.tensor([[1, 5, 9, 30, 7]])
    base = transformers.AutoModelForCausalLM.from_pretrained(recipe / "hf-model")
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, str(recipe / "adapters" / "grpo")).eval()(ids).logits
        gap = float((theirs - ours.logits(ids)).abs().max())
    print(f"PEFT (transformers Qwen3) vs fastlm logits of the GRPO run: max abs diff {gap:.2e}")
    assert gap < 1e-5


def test_init_refuses_to_overwrite_and_names_the_recipes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "sft.yaml").write_text("run: {name: mine}\n")
    assert main(["init", str(tmp_path / "mine")]) == 2
    assert "sft.yaml exists" in capsys.readouterr().err
    assert (tmp_path / "mine" / "sft.yaml").read_text() == "run: {name: mine}\n"
    assert not (tmp_path / "mine" / "grpo.yaml").exists()
    assert main(["init", str(tmp_path / "other"), "--recipe", "nope"]) == 2
    assert "the recipes are lora_chat" in capsys.readouterr().err
