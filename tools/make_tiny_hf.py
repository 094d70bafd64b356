"""A tiny random Hugging Face checkpoint of any family fastlm converts, saved with a BPE tokenizer trained on
the generated corpus (with a chat template), a chat JSONL of addition problems and a prompt JSONL of them with
answers (for GRPO).

For trying README's "Fine-tune a Hugging Face model" or `fastlm convert --from-hf DIR --check` without a hub
download, and for the tests:

    python tools/make_tiny_hf.py demo [--family qwen3]    # writes demo/hf-model/, demo/chat.jsonl, demo/prompts.jsonl

`--family` takes a config.json model_type (llama, qwen2, gemma3_text, ...) or a fastlm family name (its first
model_type). A family added to the registry adds one entry to `TINY` (the keys its tiny transformers config
changes from `SHAPE`); tests/models/test_convert_check.py fails while a registered model_type has none.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from fastlm.data.bpe import train_bpe_tokenizer
from fastlm.data.corpus import generate_documents
from fastlm.models.registry import FAMILIES

TOKENIZER_VOCAB, MODEL_VOCAB = 400, 512  # the model's vocab padded above the tokenizer's
SHAPE: dict[str, Any] = dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             rms_norm_eps=1e-5, tie_word_embeddings=False)
SLIDING, FULL = "sliding_attention", "full_attention"
MOE = dict(num_experts_per_tok=2, intermediate_size=32)
GEMMA3_TEXT = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, layer_types=[SLIDING, FULL])
# Gemma 4: every text option fastlm converts: global layers with wider heads, one kv head and keys as values (31B),
# per-layer input embeddings and the last two layers sharing KV with double-wide MLPs (E2B / E4B)
GEMMA4_TEXT = dict(num_hidden_layers=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, sliding_window=8, layer_types=[SLIDING, FULL, SLIDING, FULL],
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=MODEL_VOCAB, num_kv_shared_layers=2,
                   use_double_wide_mlp=True, final_logit_softcapping=30.0)
GEMMA4_MOE = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                  sliding_window=8, layer_types=[SLIDING, FULL], hidden_size_per_layer_input=0, enable_moe_block=True,
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)  # 26B-A4B
QWEN3_5 = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])
QWEN3_5_MOE = {**QWEN3_5, **MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
QWEN3_5_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 2, "spatial_merge_size": 1, "temporal_patch_size": 1}
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 32}
# per model_type: the tiny config's keys on top of SHAPE (a dict), or the whole config from SHAPE (a function)
TINY: dict[str, dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": 8},
    "qwen3": {"head_dim": 16},
    "gemma3_text": GEMMA3_TEXT,
    "gemma3": lambda shape: {  # multimodal: fastlm imports its text tower
        "text_config": {**shape, **GEMMA3_TEXT}, "mm_tokens_per_image": 4,
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}},
    "gemma4_text": GEMMA4_TEXT,
    "gemma4": lambda shape: {"text_config": {**shape, **GEMMA4_MOE}, "vision_config": None, "audio_config": None},
    "phi3": {},
    "gpt2": {},
    "mixtral": {**MOE, "num_local_experts": 4},
    "olmoe": {**MOE, "num_experts": 4},
    "qwen3_moe": {**MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
    "deepseek_v3": {**MOE, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 2,
                    "topk_group": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                    "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "routed_scaling_factor": 2.5},
    "qwen2_moe": {**MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "qwen3_5_text": QWEN3_5,
    "qwen3_5": lambda shape: {"text_config": {**shape, **QWEN3_5}, "vision_config": QWEN3_5_VISION},
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "qwen3_5_moe": lambda shape: {"text_config": {**shape, **QWEN3_5_MOE}, "vision_config": QWEN3_5_VISION},
    "qwen3_next": QWEN3_5_MOE,
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "olmo2": {},
    "olmo3": {"sliding_window": 8, "layer_types": [SLIDING, FULL], "rope_parameters": {
        FULL: {"rope_type": "default", "rope_theta": 5e5}, SLIDING: {"rope_type": "default", "rope_theta": 5e5}}},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0156,
                "logits_scaling": 8.0},
    "smollm3": {"no_rope_layer_interval": 2},
    "glm4": {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    "ministral": {"head_dim": 16, "sliding_window": 8, "layer_types": [SLIDING, FULL]},
    "ministral3": {"head_dim": 16, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                       "llama_4_scaling_beta": 0.1}},
    "gpt_oss": {"head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 32, "rope_parameters": {**YARN, "truncate": False}},
}


def model_type_of(family: str) -> str:
    """`family` as a model_type: a model_type itself, or a fastlm family name's first model_type."""
    if family in TINY:
        return family
    if family in FAMILIES:
        return FAMILIES[family].hf.model_types[0]
    raise SystemExit(f"make_tiny_hf: unknown family {family!r}; choose one of {', '.join(sorted(TINY))}")


def tiny_config(model_type: str, special: dict[str, int | None]) -> transformers.PretrainedConfig:
    """The tiny transformers config of `model_type` with the tokenizer's special ids."""
    entry = TINY[model_type]
    shape = {**SHAPE, **special}
    fields = entry(shape) if callable(entry) else {**shape, **entry}
    return transformers.AutoConfig.for_model(model_type, **fields)


def tiny_hf_checkpoint(directory: Path, model_type: str = "llama", seed: int = 0,
                       tokenizer_from: Path | None = None) -> Path:
    """A random tiny HF model (vocab padded to 512 over the tokenizer's 400) saved with its tokenizer: trained
    here, or copied from `tokenizer_from` (a folder an earlier call wrote; training one takes a second).
    Every 1-D parameter (norms, biases, router corrections) gets noise on transformers' init, so a misplaced
    one changes the logits."""
    if tokenizer_from is None:
        style = "qwen2" if model_type.startswith("qwen") else "llama"
        train_bpe_tokenizer(generate_documents(400, seed=0), directory, TOKENIZER_VOCAB, style)  # type: ignore[arg-type]
        tokenizer_from = directory
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_from), local_files_only=True)
    tokenizer.save_pretrained(str(directory))
    config = tiny_config(model_type, {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                                      "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(str(directory))
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
    parser.add_argument("--family", default="llama", help=f"a model_type ({', '.join(sorted(TINY))}) or a fastlm "
                        "family name")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--tokenizer-from", type=Path, help="copy the tokenizer of an earlier hf-model/ folder "
                        "instead of training one")
    args = parser.parse_args()
    model_type = model_type_of(args.family)
    args.out.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_checkpoint(args.out / "hf-model", model_type, tokenizer_from=args.tokenizer_from)
    addition_chat_jsonl(args.out / "chat.jsonl", args.conversations, seed=1)
    addition_prompts_jsonl(args.out / "prompts.jsonl", 200, seed=2)
    print(f"wrote {model} ({model_type}, tokenizer + weights), {args.out / 'chat.jsonl'} and {args.out / 'prompts.jsonl'}")


if __name__ == "__main__":
    main()
