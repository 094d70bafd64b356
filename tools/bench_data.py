"""Data pipeline speed on CPU: `fastlm prepare` against its tokenizer called directly, and the memmap loader
against what the trainer consumes.

1. prepare: a JSONL of generated documents (text field) tokenized by `fastlm prepare` (datasets map with
   `--num-proc` workers, writing the memmap files) vs the same tokenizer's `encode_batch` on the same texts
   in one process, already in memory (no reading, no writing): tokens/s of each and their ratio.
2. loader: batches/s of `data.source: {type: memmap}` at seq 2048 (batch_size rows of 2049 tokens read from
   the memory map, document ids, labels; `Batch` built as the trainer receives it), against
   `--trainer-tokens-per-second` (docs/benchmarks.md: llama-1b on one H200) and ten times it.

The tokenizer is a byte-level BPE trained here on the generated corpus (`--vocab`), or `--tokenizer DIR`
(a local Hugging Face tokenizer folder). Runs in about a minute on 2 cores.

    python tools/bench_data.py --num-proc 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import datasets
import tokenizers
import torch
import transformers

from fastlm.data.bpe import train_bpe_tokenizer
from fastlm.data.config import DataConfig, HuggingFaceTokenizerConfig
from fastlm.data.corpus import generate_documents
from fastlm.data.memmap import memmap_loaders
from fastlm.data.prepare import PrepareConfig, prepare
from fastlm.data.tokenizer import build_tokenizer

H200_LLAMA_1B_TOKENS_PER_SECOND = 76_157  # docs/benchmarks.md, tools/bench_train.py run A: packed+compile, 4x2048


def _corpus(directory: Path, documents: int) -> tuple[Path, list[str]]:
    texts = [" ".join(generate_documents(8, seed=index)) for index in range(documents)]  # ~8 documents' text each
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    return path, texts


def bench_prepare(directory: Path, tokenizer_dir: Path, texts: list[str], corpus: Path, num_proc: int) -> dict:
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(tokenizer_dir)))
    started = time.perf_counter()
    direct = sum(len(ids) for ids in tokenizer.encode_batch(texts, bos=True, eos=True))
    direct_seconds = time.perf_counter() - started
    summary = prepare(PrepareConfig(tokenizer={"type": "huggingface", "path": str(tokenizer_dir)},
                                    input_path=str(corpus), output_path=str(directory / "prepared"),
                                    num_proc=num_proc, batch_size=1000))
    assert summary.tokens == direct, (summary.tokens, direct)
    return {"tokens": direct, "direct_tokens_per_second": direct / direct_seconds,
            "prepare_tokens_per_second": summary.tokens / summary.seconds, "prepare_seconds": summary.seconds,
            "direct_seconds": direct_seconds, "path": summary.path}


def bench_loader(prepared: Path, tokenizer_dir: Path, batch_size: int, seconds: float) -> dict:
    tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(tokenizer_dir)))
    config = DataConfig.model_validate({"source": {"type": "memmap", "path": str(prepared)}, "seq_len": 2048,
                                        "micro_batch_size": batch_size, "eval_fraction": 0.0})
    loader, _ = memmap_loaders(config, seed=0, tokenizer=tokenizer)
    loader.next_batch()  # page the files in
    batches, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = loader.next_batch()
        batches += 1
    elapsed = time.perf_counter() - started
    assert batch.input_ids.shape == (batch_size, 2048)
    return {"rows": len(loader.rows), "batches_per_second": batches / elapsed,
            "tokens_per_second": batches * batch_size * 2048 / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=20_000, help="JSONL records (each ~8 generated documents)")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocab to train (without --tokenizer)")
    parser.add_argument("--tokenizer", type=Path, help="a local Hugging Face tokenizer folder instead")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="rows of seq 2048 per batch (the 1B bench's 4)")
    parser.add_argument("--loader-seconds", type=float, default=5.0)
    parser.add_argument("--trainer-tokens-per-second", type=float, default=H200_LLAMA_1B_TOKENS_PER_SECOND)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        corpus, texts = _corpus(directory, args.documents)
        tokenizer_dir = args.tokenizer or train_bpe_tokenizer(generate_documents(5000, seed=99), directory / "tok",
                                                              args.vocab)
        tokenizer = build_tokenizer(HuggingFaceTokenizerConfig(path=str(tokenizer_dir)))
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
              f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"tokenizers {tokenizers.__version__}, datasets {datasets.__version__}")
        print(f"# tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}); "
              f"corpus {corpus.stat().st_size / 2**20:.1f} MiB in {len(texts):,} records")
        result = bench_prepare(directory, tokenizer_dir, texts, corpus, args.num_proc)
        print(f"prepare (num_proc={args.num_proc}, read + tokenize + write): "
              f"{result['prepare_tokens_per_second']:,.0f} tokens/s "
              f"({result['tokens']:,} tokens in {result['prepare_seconds']:.1f} s)")
        print(f"tokenizer called directly (encode_batch, in memory, one process): "
              f"{result['direct_tokens_per_second']:,.0f} tokens/s ({result['direct_seconds']:.1f} s); "
              f"prepare / direct = "
              f"{result['prepare_tokens_per_second'] / result['direct_tokens_per_second']:.2f}")
        loader = bench_loader(result["path"], tokenizer_dir, args.batch_size, args.loader_seconds)
        trainer_batches = args.trainer_tokens_per_second / (args.batch_size * 2048)
        print(f"memmap loader, seq 2048, batch {args.batch_size} ({loader['rows']:,} rows): "
              f"{loader['batches_per_second']:,.1f} batches/s = {loader['tokens_per_second']:,.0f} tokens/s")
        print(f"trainer at {args.trainer_tokens_per_second:,.0f} tokens/s consumes {trainer_batches:.1f} batches/s; "
              f"10x = {10 * trainer_batches:.1f}; "
              f"loader / trainer = {loader['batches_per_second'] / trainer_batches:.1f}x "
              f"({'meets' if loader['batches_per_second'] > 10 * trainer_batches else 'MISSES'} the 10x goal)")


if __name__ == "__main__":
    main()
