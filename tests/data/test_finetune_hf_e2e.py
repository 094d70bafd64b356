"""End to end on CPU, as a user fine-tunes a Hugging Face model on their own chat data:

tiny HF Llama / Qwen2 (transformers config classes, random weights) + a BPE tokenizer trained locally and
saved next to it -> `fastlm prepare` a chat JSONL -> `fastlm train` with `run.init_path` (the tokenizer
comes from the checkpoint) -> `fastlm convert --to-hf` -> transformers reloads model and tokenizer, and
its greedy `generate` matches fastlm's greedy sampler token for token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from fastlm.cli import main
from fastlm.data.bpe import train_bpe_tokenizer
from fastlm.data.corpus import generate_documents
from fastlm.data.tokenizer import Tokenizer, build_tokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.models.hf import import_hf
from fastlm.rl.sampler import SamplingOptions, sample_completions

MAX_NEW_TOKENS = 8


def _hf_checkpoint(directory: Path, style: str) -> Path:
    """A random tiny HF model (vocab padded to 512 over the tokenizer's 400) saved with its tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(train_bpe_tokenizer(generate_documents(400, seed=0), directory, 400, style)), local_files_only=True)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    config = transformers.LlamaConfig(**shape) if style == "llama" else transformers.Qwen2Config(**shape)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def _chat_jsonl(path: Path, count: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        conversations.append([{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    return conversations


@pytest.mark.slow
@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_finetune_export_and_transformers_generate_agree(tmp_path: Path, style: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    hf = _hf_checkpoint(tmp_path / "hf", style)
    _chat_jsonl(tmp_path / "chat.jsonl", 400, seed=1)
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
    """transformers' greedy `generate` and fastlm's greedy sampler on the same HF folder give the same tokens,
    stopping at EOS as a user would and running past it for all MAX_NEW_TOKENS."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    ours = import_hf(directory, "cpu").eval()
    outputs = []
    for prompt in prompts:
        for stop in (True, False):
            hf_model.generation_config.eos_token_id = tokenizer.eos_id if stop else None
            with torch.no_grad():
                generated = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                              max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
            options = SamplingOptions(MAX_NEW_TOKENS, tokenizer.eos_id if stop else -1, tokenizer.pad_id, temperature=0.0)
            [completion] = sample_completions(ours, [prompt], options, torch.Generator())
            print(f"{label} {tokenizer.decode(prompt[-4:])!r} stop={stop}: transformers {generated} fastlm {completion.tokens}")
            assert completion.tokens == generated
            outputs.append(tuple(generated))
    return outputs
