"""`fastlm generate --chat` takes whole conversations from a JSONL (`messages`), rendered by the chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastlm.commands.main import main
from fastlm.data.chat import encode_chat_prompt
from fastlm.data.tokenizer import ByteTokenizer
from fastlm.engine.checkpoint import load_latest_checkpoint
from fastlm.engine.trainer import Trainer
from fastlm.generation import SamplingOptions, generate
from fastlm.models.decoder import build_model
from fastlm.run_config.schema import RunConfig

CONVERSATION = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "and 3+3="}]


def test_generate_chat_takes_multi_turn_jsonl(tiny_config: Callable[..., RunConfig], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny_config("chat", trainer={"steps": 1}, model={"max_seq_len": 128})
    Trainer(config).train()
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    argv = ["generate", config.run.directory, "--prompts-file", str(prompts), "--chat", "--temperature", "0",
            "--max-new-tokens", "5", "--jsonl"]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == [CONVERSATION, "1+1="]
    model = build_model(config.model, device="cpu")
    load_latest_checkpoint(Path(config.run.directory) / "checkpoints").load_model(model)
    tokenizer = ByteTokenizer()
    ids = [encode_chat_prompt(tokenizer, CONVERSATION), encode_chat_prompt(tokenizer, [{"role": "user", "content": "1+1="}])]
    assert tokenizer.decode(ids[0]).count("2+2=") == 1 and "and 3+3=" in tokenizer.decode(ids[0])  # every turn rendered
    expected = generate(model, ids, SamplingOptions(5, 0.0, stop_tokens=(tokenizer.eos_id,)), tokenizer,
                        torch.Generator().manual_seed(0))
    for record, completion in zip(records, expected):
        body = completion.tokens[:-1] if completion.stopped else completion.tokens
        assert record["completion"] == tokenizer.decode(body)
    assert main([arg for arg in argv if arg != "--chat"]) == 2
    assert "line 1: a conversation ('messages') needs --chat" in capsys.readouterr().err
    prompts.write_text(json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    assert main(argv) == 2
    assert "line 1: message 0 has role 'robot'" in capsys.readouterr().err
