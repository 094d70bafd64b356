"""GRPO on CPU with the hybrid Qwen3.5 family at a tiny shape: rollouts decode through the recurrent
states (fastlm/layers/kv_cache.py), and the sampler's log-probs equal the training forward's (packed
rollout rows: the linear layers restart at every document)."""

from __future__ import annotations

from pathlib import Path

from fastlm.logging.jsonl import read_metrics
from fastlm.run_config.loader import load_config
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HYBRID = {"type": "qwen3_5", "vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
          "head_dim": 16, "intermediate_size": 64, "max_seq_len": 64, "layer_types": ["linear_attention", "full_attention"],
          "linear_attention": {"key_heads": 1, "value_heads": 2, "key_head_dim": 8, "value_head_dim": 8}}


def test_grpo_runs_on_the_hybrid_family(tmp_path: Path) -> None:
    shipped = load_config(CONFIGS / "grpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=6", "rl.warmup_steps=2", "rl.prompts_per_rollout=4",
        "rl.group_size=4", "rl.eval_prompts=0", "trainer.log_every=1", "trainer.eval_every=0",
        "logging.progress=false", "logging.wandb.enabled=false"])
    values = shipped.model_dump(mode="json")
    values["model"] = {**HYBRID, "head": values["model"]["head"]}
    config = RunConfig.model_validate(values)
    summary = build_trainer(config).train()
    records = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if r["train/rl/warmup"] == 0.0]
    gap = max(r["train/sampling/logp_diff/max"] for r in records)
    print(f"qwen3_5 GRPO: {len(records)} RL steps, rewards {summary.rewards}, sampler vs training log-prob gap {gap:.2e}")
    assert len(records) == 4 and gap < 1e-4
