"""An offline Hugging Face starting point: a tiny random Llama or Qwen2 saved with a BPE tokenizer trained
on the generated corpus (with a chat template), and a chat JSONL of addition problems.

For trying README's "Fine-tune a Hugging Face model" without a hub download, and for the tests:

    python tools/make_tiny_hf.py demo [--style qwen2]    # writes demo/hf-model/ and demo/chat.jsonl
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


def tiny_hf_checkpoint(directory: Path, style: str = "llama", seed: int = 0) -> Path:
    """A random tiny HF model (vocab padded to 512 over the tokenizer's 400) saved with its tokenizer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(train_bpe_tokenizer(generate_documents(400, seed=0), directory, TOKENIZER_VOCAB, style)),  # type: ignore[arg-type]
        local_files_only=True)
    shape = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for hf-model/ and chat.jsonl")
    parser.add_argument("--style", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--conversations", type=int, default=2000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_checkpoint(args.out / "hf-model", args.style)
    addition_chat_jsonl(args.out / "chat.jsonl", args.conversations, seed=1)
    print(f"wrote {model} ({args.style}, tokenizer + weights) and {args.out / 'chat.jsonl'}")


if __name__ == "__main__":
    main()
