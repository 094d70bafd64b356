"""`fastlm generate` on a real checkpoint: the run's tokenizer, the rollouts' generator, seeded and repeatable."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastlm.commands.generate import LoadedModel, sampling_options
from fastlm.commands.main import main
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.trainer import Trainer
from fastlm.generation import SamplingOptions, generate
from fastlm.models.decoder import build_model
from fastlm.run_config.schema import RunConfig


def test_generate_prints_the_samplers_completions(tiny_config: Callable[..., RunConfig], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_config("gen", trainer={"steps": 2})
    Trainer(config).train()
    run_dir = Path(config.run.directory)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"prompt": "The dog"}\n', encoding="utf-8")
    argv = ["generate", str(run_dir), "--prompt", "The cat", "--prompts-file", str(prompts_file),
            "--max-new-tokens", "6", "--temperature", "0.8", "--seed", "5", "--jsonl"]
    assert main(argv) == 0
    first = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(argv) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == first, "a seed repeats"
    print(first)

    # The same completions as the sampler called on the checkpoint's weights directly.
    model = build_model(config.model, device="cpu")
    load_latest_checkpoint(run_dir / "checkpoints").load_model(model)
    tokenizer = ByteTokenizer()
    expected = generate(model, [tokenizer.encode(p, bos=True) for p in ("The cat", "The dog")],
                        SamplingOptions(6, 0.8, stop_tokens=(tokenizer.eos_id,)), tokenizer,
                        torch.Generator().manual_seed(5))
    assert [r["prompt"] for r in first] == ["The cat", "The dog"]
    for record, completion in zip(first, expected):
        body = completion.tokens[:-1] if completion.stopped else completion.tokens
        assert record["completion"] == tokenizer.decode(body) and record["stopped"] == completion.stopped


def test_generate_decodes_with_a_vocab_padded_past_the_tokenizers(tiny_config: Callable[..., RunConfig],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A model vocab padded to 320 past the byte tokenizer's 260 (as checkpoints pad to a multiple of 64): the
    sampler draws only ids the tokenizer decodes, so a hot sample prints instead of failing on an id >= 260."""
    config = tiny_config("padded", model={"vocab_size": 320, "init_std": 0.5}, trainer={"steps": 1})
    Trainer(config).train()
    argv = ["generate", config.run.directory, "--prompt", "The cat", "--max-new-tokens", "24", "--temperature", "2.0",
            "--seed", "0", "--jsonl"]
    assert main(argv) == 0, capsys.readouterr().err
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["prompt"] == "The cat" and record["completion"]


def test_generate_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "no such run directory or checkpoint" in capsys.readouterr().err
    assert main(["generate", str(tmp_path)]) == 2
    assert "no prompts" in capsys.readouterr().err


def test_sampling_defaults_come_from_the_runs_rl_section() -> None:
    run = RunConfig.model_validate({
        "model": {"type": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 32,
                  "head": {"logit_scale": 0.5, "losses": {"grpo": {"type": "grpo"}}}},
        "rl": {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 3},
    })
    loaded = LoadedModel(build_model(run.model, device="meta"), ByteTokenizer(), run, Path("."))
    flags = argparse.Namespace(max_new_tokens=None, temperature=None, top_p=0.95, top_k=None)
    options = sampling_options(flags, loaded, loaded.tokenizer)
    assert (options.max_new_tokens, options.temperature, options.top_p, options.logit_scale) == (3, 0.5, 0.95, 0.5)
    plain = sampling_options(flags, LoadedModel(loaded.model, ByteTokenizer(), None, Path(".")), ByteTokenizer())
    assert (plain.max_new_tokens, plain.temperature, plain.top_k, plain.stop_tokens) == (64, 1.0, 0, (ByteTokenizer().eos_id,))
