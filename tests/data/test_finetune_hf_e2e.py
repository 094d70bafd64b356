"""End to end on CPU, as a user fine-tunes a Hugging Face model on their own chat data:

tiny HF Llama / Qwen2 (transformers config classes, random weights) + a BPE tokenizer trained locally and
saved next to it -> `fastlm prepare` a chat JSONL -> `fastlm train` with `run.init_path` (the tokenizer
comes from the checkpoint) -> `fastlm convert --to-hf` -> transformers reloads model and tokenizer, and
its greedy `generate` matches fastlm's greedy generator token for token. The model's vocab (512) is padded
past the tokenizer's (400): fastlm draws only ids the tokenizer can decode, which is transformers' `generate`
with the padding ids (>= the tokenizer's vocab size) suppressed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from fastlm.commands.main import main
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.generation import SamplingOptions, generate
from fastlm.models.hf import import_hf

MAX_NEW_TOKENS = 8
TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_hf.py"
_spec = importlib.util.spec_from_file_location("make_tiny_hf", TOOL)
make_tiny_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny_hf)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_finetune_export_and_transformers_generate_agree(tmp_path: Path, style: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_tiny_hf.tiny_hf_checkpoint(tmp_path / "hf", style)
    make_tiny_hf.addition_chat_jsonl(tmp_path / "chat.jsonl", 400, seed=1)
    (tmp_path / "prepare.yaml").write_text(yaml.safe_dump({
        "tokenizer": {"type": "huggingface", "path": "hf"}, "input_path": "chat.jsonl", "output_path": "prepared",
        "messages_field": "messages", "num_proc": 2}))
    assert main(["prepare", str(tmp_path / "prepare.yaml")]) == 0
    assert "prepared" in capsys.readouterr().out

    assert main(["convert", "--from-hf", str(hf)]) == 0  # prints the model section + run.init_path
    (tmp_path / "model.yaml").write_text(capsys.readouterr().out)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({
        "base": "model.yaml",
        "run": {"name": "sft", "output_dir": str(tmp_path / "runs" / "{name}")},
        "data": {"source": {"type": "memmap", "path": "prepared"}, "seq_len": 64, "micro_batch_size": 8},
        "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 2},
        "trainer": {"steps": 25, "log_every": 5, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False},
    }))
    assert main(["train", str(tmp_path / "sft.yaml")]) == 0
    run_dir = tmp_path / "runs" / "sft"
    losses = [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    print(f"{style}: SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0]
    assert load_latest_checkpoint(run_dir / "checkpoints").trainer_state["step"] == 25

    exported = tmp_path / "exported"
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(exported)]) == 0
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported), local_files_only=True)
    tokenizer = build_tokenizer(None, str(exported))  # the exported folder's tokenizer, as a run would load it
    questions = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in ((1, 2), (7, 8), (9, 9), (0, 4))]
    prompts = []
    for messages in questions:  # chat prompts, rendered by the exported tokenizer's template
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert prompts[-1] == tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True))
    prompts += [tokenizer.encode(text, bos=True) for text in ("The cat", "A child helps", "17+2")]
    fine_tuned = _greedy_agrees(exported, prompts, tokenizer, f"{style} fine-tuned")
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--chat", "--temperature", "0", "--max-new-tokens", str(MAX_NEW_TOKENS),
                 "--jsonl", *(arg for m in questions for arg in ("--prompt", m[0]["content"]))]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [hf_tokenizer.decode(tokens[: tokens.index(tokenizer.eos_id)] if tokenizer.eos_id in tokens else tokens,
                                    skip_special_tokens=True) for tokens in map(list, fine_tuned[0:8:2])]
    assert [record["completion"] for record in printed] == expected  # `fastlm generate --chat` prints what HF generates
    initial = _greedy_agrees(hf, prompts, tokenizer, f"{style} initial")  # random weights: varied tokens
    assert fine_tuned != initial and len(set(initial)) > 2 and max(map(len, initial)) == MAX_NEW_TOKENS


def _greedy_agrees(directory: Path, prompts: list[list[int]], tokenizer: Tokenizer, label: str) -> list[tuple[int, ...]]:
    """transformers' greedy `generate` and fastlm's greedy generator on the same HF folder give the same tokens,
    stopping at EOS as a user would and running past it for all MAX_NEW_TOKENS. transformers' side suppresses
    the model's padding ids (>= the tokenizer's vocab size), which fastlm's sampler never draws."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    padding = list(range(tokenizer.vocab_size, hf_model.config.vocab_size))
    ours = import_hf(directory, "cpu").eval()
    outputs = []
    for prompt in prompts:
        for stop in (True, False):
            hf_model.generation_config.eos_token_id = tokenizer.eos_id if stop else None
            with torch.no_grad():
                generated = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                              max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                              suppress_tokens=padding or None)[0, len(prompt):].tolist()
            options = SamplingOptions(MAX_NEW_TOKENS, temperature=0.0, stop_tokens=(tokenizer.eos_id,) if stop else ())
            [completion] = generate(ours, [prompt], options, tokenizer, torch.Generator())
            print(f"{label} {tokenizer.decode(prompt[-4:])!r} stop={stop}: transformers {generated} fastlm {completion.tokens}")
            assert completion.tokens == generated
            outputs.append(tuple(generated))
    return outputs


def test_readme_commands_validate_the_shipped_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """README's "Fine-tune a Hugging Face model" up to training, on a copy of configs/: the demo model, the
    model section, `fastlm prepare configs/prepare/chat.yaml`, then `fastlm validate configs/sft_hf.yaml`."""
    import shutil

    shutil.copytree(TOOL.parents[1] / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    make_tiny_hf.tiny_hf_checkpoint(tmp_path / "demo" / "hf-model")
    make_tiny_hf.addition_chat_jsonl(tmp_path / "demo" / "chat.jsonl", 200, seed=1)
    assert main(["convert", "--from-hf", "demo/hf-model"]) == 0
    (tmp_path / "hf_model.yaml").write_text(capsys.readouterr().out)
    assert main(["prepare", "configs/prepare/chat.yaml"]) == 0
    assert main(["validate", "configs/sft_hf.yaml"]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "data: " in out and "huggingface:hf-model" in out
