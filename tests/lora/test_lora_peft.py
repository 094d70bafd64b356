"""PEFT round trip: a LoRA run's adapters written with `convert --to-peft` load into HF PEFT on the exported
base with the run's logits; `--merge-lora --to-hf` gives the same model as one checkpoint; `--from-peft`
(and `model.lora.adapter_path` on a PEFT folder) bring the very same adapters back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from peft import PeftModel

from fastlm.commands.main import main
from fastlm.engine.convert import load_fastlm
from fastlm.engine.lora_training import checkpointed, load_lora_run
from fastlm.engine.trainer import Trainer
from fastlm.models.decoder import build_model
from fastlm.models.hf import config_from_hf
from fastlm.run_config.schema import RunConfig

SEQ = 16
BASES = {  # a Qwen2 (separate q/k/v/gate/up in HF, qkv biases, untied head) and a GPT-2 (fused Conv1D c_attn)
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"vocab_size": 272, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64},
              {"rank": 4, "alpha": 8.0, "targets": ["all-linear"], "train_head": True}),
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,  # hybrid: Gated DeltaNet + gated attention
                {"vocab_size": 272, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 64, "layer_types": ["linear_attention", "full_attention"],
                 "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                 "linear_value_head_dim": 8},
                {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             {"vocab_size": 272, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
             {"rank": 3, "alpha": 4.0, "rslora": True, "targets": ["attn.q", "attn.v", "c_fc", "mlp.down"]}),
}


def _hf_base(kind: str, directory: Path) -> Path:
    config_class, model_class, fields, _ = BASES[kind]
    torch.manual_seed(1)
    model = model_class(config_class(**fields))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(directory)
    return directory


def _run_config(base: Path, run_dir: Path, lora: dict, **extra: dict) -> RunConfig:
    section = config_from_hf(json.loads((base / "config.json").read_text())).model_dump(mode="json", exclude={"head"})
    return RunConfig.model_validate({
        "run": {"name": "lora", "output_dir": str(run_dir), "init_path": str(base)},
        "model": {**section, "lora": lora},
        "data": {"source": {"type": "generated", "num_documents": 40}, "seq_len": SEQ, "micro_batch_size": 2},
        "optimizer": {"lr": 3e-2}, "trainer": {"steps": 2, "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "logging": {"wandb": {"enabled": False}, "progress": False}, **extra,
    })


@pytest.mark.parametrize("kind", sorted(BASES))
def test_peft_round_trip(kind: str, tmp_path: Path) -> None:
    base = _hf_base(kind, tmp_path / "base")
    run_dir, adapter, merged, imported = (tmp_path / name for name in ("run", "peft", "merged", "imported"))
    Trainer(_run_config(base, run_dir, BASES[kind][3])).train()
    assert main(["convert", "--from", str(run_dir), "--to-peft", str(adapter)]) == 0
    assert main(["convert", "--from", str(run_dir), "--merge-lora", "--to-hf", str(merged)]) == 0
    assert main(["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "refused")]) == 2  # needs --merge-lora
    assert main(["convert", "--from", str(run_dir), "--merge-lora", "--to", str(tmp_path / "merged_fastlm")]) == 0

    ours, _, _, _ = load_lora_run(str(run_dir))
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    with torch.no_grad():
        expected = ours.eval().logits(ids)
        plain = hf_base.eval()(ids).logits
        with_peft = PeftModel.from_pretrained(hf_base, str(adapter)).eval()(ids).logits
        merged_logits = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()(ids).logits
        merged_config, merged_state, _ = load_fastlm(tmp_path / "merged_fastlm")
        merged_ours = build_model(merged_config, "cpu")
        merged_ours.load_state_dict(merged_state)
        fastlm_gap = float((merged_ours.eval().logits(ids) - ours.logits(ids)).abs().max())
    moved = float((expected - plain).abs().max())
    peft_gap, merged_gap = float((with_peft - expected).abs().max()), float((merged_logits - expected).abs().max())
    print(f"{kind}: adapters move the logits by {moved:.2e}; PEFT vs fastlm {peft_gap:.2e}, merged HF vs fastlm "
          f"{merged_gap:.2e} (fp32, |logits| max {float(expected.abs().max()):.2f})")
    assert moved > 1e-3 and peft_gap <= 1e-5 and merged_gap <= 1e-5 and fastlm_gap <= 1e-5

    trained = checkpointed(ours)
    direct = Trainer(_run_config(base, tmp_path / "direct", {**BASES[kind][3], "adapter_path": str(adapter)}))
    again = checkpointed(direct.model)
    assert set(again) == set(trained) and all(torch.equal(again[k], trained[k]) for k in trained)
    # --from-peft: a fastlm adapter folder and the model.lora that holds it (GPT-2's c_attn comes back as rank
    # 3r adapters on each of q, k, v: the same function, PEFT's trainable rows)
    assert main(["convert", "--from-peft", str(adapter), "--to", str(imported), "--from", str(base)]) == 0
    section = yaml.safe_load((imported / "lora.yaml").read_text())["model"]["lora"]
    restarted = Trainer(_run_config(base, tmp_path / "again", section)).model.eval()  # on the trainer's device (CUDA if any)
    with torch.no_grad():
        gap = float((restarted.logits(ids.to(restarted.output_weight.device)).cpu() - expected).abs().max())
    print(f"{kind}: a run started from the --from-peft folder vs the trained run: logits gap {gap:.2e}")
    assert gap <= 1e-5
