"""tools/bench_data.py runs end to end at a tiny size and its two measurements agree with their inputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_data.py"
spec = importlib.util.spec_from_file_location("bench_data", TOOL)
bench_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_data)  # type: ignore[union-attr]


def test_bench_data_smoke(tmp_path: Path) -> None:
    corpus, texts = bench_data._corpus(tmp_path, 300)
    tokenizer_dir = bench_data.train_bpe_tokenizer(bench_data.generate_documents(300, seed=9), tmp_path / "tok", 300)
    prepared = bench_data.bench_prepare(tmp_path, tokenizer_dir, texts, corpus, num_proc=2)
    assert prepared["tokens"] > 2049 and prepared["prepare_tokens_per_second"] > 0
    loader = bench_data.bench_loader(prepared["path"], tokenizer_dir, batch_size=2, seconds=0.2)
    assert loader["rows"] == -(-prepared["tokens"] // 2049) and loader["batches_per_second"] > 0
