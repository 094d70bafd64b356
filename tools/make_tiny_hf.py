"""An offline Hugging Face starting point: a tiny random Llama, Qwen2 or Qwen3 saved with a BPE tokenizer
trained on the generated corpus (with a chat template), a chat JSONL of addition problems and a prompt
JSONL of them with answers (for GRPO).

For trying README's "Fine-tune a Hugging Face model" and its recipe without a hub download, and for the tests:

    python tools/make_tiny_hf.py demo [--style qwen3]    # writes demo/hf-model/, demo/chat.jsonl, demo/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import transformers

from fastlm.data.bpe import train_bpe_tokenizer
from fastlm.data.corpus import generate_documents

TOKENIZER_VOCAB, MODEL_VOCAB = 400, 512  # the model's vocab padded above the tokenizer's


STYLES = ("llama", "qwen2", "qwen3")


def tiny_hf_checkpoint(directory: Path, style: str = "llama", seed: int = 0) -> Path:
    """A random tiny HF model (vocab padded to 512 over the tokenizer's 400) saved with its tokenizer; Qwen3
    with its QK-norm and 16-wide heads (Qwen3's config sets head_dim apart from hidden_size / heads)."""
    tokenizer_style = "llama" if style == "llama" else "qwen2"  # Qwen3 writes ChatML as Qwen2 does
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(train_bpe_tokenizer(generate_documents(400, seed=0), directory, TOKENIZER_VOCAB, tokenizer_style)),  # type: ignore[arg-type]
        local_files_only=True)
    shape = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    if style == "qwen3":
        config = transformers.Qwen3Config(**shape, head_dim=16)
    else:
        config = transformers.LlamaConfig(**shape) if style == "llama" else transformers.Qwen2Config(**shape)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


def addition_chat_jsonl(path: Path, count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` conversations {"messages": [user "a+b=", assistant "sum"]}, one JSON object per line."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        conversations.append([{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations), encoding="utf-8")
    return conversations


def addition_prompts_jsonl(path: Path, count: int, seed: int) -> None:
    """`count` GRPO prompts {"prompt": [user "a+b="], "answer": "sum"} (TRL's conversational format)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for hf-model/ and chat.jsonl")
    parser.add_argument("--style", choices=STYLES, default="llama")
    parser.add_argument("--conversations", type=int, default=2000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_checkpoint(args.out / "hf-model", args.style)
    addition_chat_jsonl(args.out / "chat.jsonl", args.conversations, seed=1)
    addition_prompts_jsonl(args.out / "prompts.jsonl", 200, seed=2)
    print(f"wrote {model} ({args.style}, tokenizer + weights), {args.out / 'chat.jsonl'} and {args.out / 'prompts.jsonl'}")


if __name__ == "__main__":
    main()
