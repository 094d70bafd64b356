"""LoRA on a mixture-of-experts model: adapters sit on linears, so the routed experts' stacked weights get none;
validation says which modules get adapters and refuses to leave the experts out silently (unless
model.lora.frozen_experts says so). A PEFT export names its base, or is refused when the run has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastlm.commands.main import main

MOE = ("model={type: qwen3_moe, vocab_size: 260, hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
       "head_dim: 16, intermediate_size: 64, dense_layers: [0], moe: {num_experts: 4, top_k: 2, ffn_size: 16}}")
QUIET = ["trainer.device=cpu", "data.source.num_documents=20", "logging.wandb.enabled=false"]


def test_lora_on_moe_names_its_modules_and_refuses_frozen_experts_unless_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["configs/tiny.yaml", MOE, *QUIET, f"run.output_dir={tmp_path}"]
    assert main(["validate", *common, "model.lora={rank: 4}"]) == 2
    err = capsys.readouterr().err
    assert ("model.lora.targets: leave this mixture-of-experts model's routed experts without adapters (6,144 of its "
            in err), err
    assert "adapters go on attn.q, attn.k, attn.v, attn.o, mlp.gate, mlp.up, mlp.down, mlp.router" in err
    assert "Fix: set model.lora.frozen_experts: true" in err
    assert main(["validate", *common, "model.lora={rank: 4, targets: [attn.q, attn.v], frozen_experts: true}"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: adapters on attn.q, attn.v; the routed experts (6,144 parameters) get none" in out, out


def test_peft_export_of_a_run_without_a_base_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run without run.init_path has a seeded random base: PEFT's base_model_name_or_path would be null."""
    overrides = [*QUIET, f"run.output_dir={tmp_path / 'run'}", "model.hidden_size=32", "model.num_layers=1",
                 "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64", "data.seq_len=16",
                 "data.micro_batch_size=2", "trainer.steps=1", "trainer.eval_every=0", "trainer.checkpoint_every=1",
                 "logging.progress=false", "model.lora={rank: 2}"]
    assert main(["train", "configs/tiny.yaml", *overrides]) == 0
    capsys.readouterr()
    assert main(["convert", "--from", str(tmp_path / "run"), "--to-peft", str(tmp_path / "peft")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("invalid configuration") and "--to-peft: this run has no run.init_path" in err, err
    assert "--merge-lora --to-hf DIR" in err and not (tmp_path / "peft").exists()
