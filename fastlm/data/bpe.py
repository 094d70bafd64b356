"""Train a byte-level BPE tokenizer on local text and save it as a Hugging Face tokenizer folder.

For a corpus without a hub tokenizer, and for the tests and benchmarks (no downloads): the folder loads
with `AutoTokenizer.from_pretrained(DIR, local_files_only=True)` and as `data.tokenizer: {type:
huggingface, path: DIR}`. Two styles of special tokens, as the architectures they stand in for:
Llama (a BOS that its chat template writes) and Qwen2 (no BOS). Both end turns with `<|im_end|>` (EOS).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TURN_TOKEN = "<|begin_of_text|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>"

# ChatML, as Qwen2 writes it; the Llama style starts with the BOS.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], directory: str | Path, vocab_size: int = 512,
                        style: Literal["llama", "qwen2"] = "llama") -> Path:
    """Learn merges from `texts`, attach the special tokens and a chat template, `save_pretrained(directory)`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TURN_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    llama = style == "llama"
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS_TOKEN if llama else None,
                                      eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    wrapped.chat_template = ("{{ bos_token }}" if llama else "") + CHATML_TEMPLATE
    directory = Path(directory)
    wrapped.save_pretrained(str(directory))
    return directory
