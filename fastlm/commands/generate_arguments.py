"""`fastlm generate`'s flags, apart from its work so that `fastlm --help` imports no torch."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_MAX_NEW_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a run directory, its checkpoints/ dir, a step-* dir, or a `convert --to` folder")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line, or JSONL with a 'prompt' field (*.jsonl)")
    parser.add_argument("--max-new-tokens", type=int, help=f"default: the run's rl.max_new_tokens, else {DEFAULT_MAX_NEW_TOKENS}")
    parser.add_argument("--temperature", type=float, help="0 = greedy; default: the run's rl.temperature, else 1.0")
    parser.add_argument("--top-p", type=float, help="nucleus mass; default: the run's rl.top_p, else 1.0")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens; default: the run's rl.top_k, else 0 (off)")
    parser.add_argument("--seed", type=int, help="sampling seed; default: the run's run.seed")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--jsonl", action="store_true", help="print one JSON object per completion")
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user message through the "
                        "tokenizer's chat template (for models fine-tuned on chat data); a --prompts-file JSONL may "
                        "then hold whole conversations, {\"messages\": [{\"role\", \"content\"}, ...]}")
