"""Short real GRPO runs through `rl.backend` and `rl.routing_replay`: the transformers backend samples the
rollouts (the sampler-vs-trainer gap stays at float rounding, fp32 CPU), and a tiny MoE model trains with its
sampler's routing replayed; both log the policy version of their completions."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import yaml

from fastlm.data.tokenizer import ByteTokenizer
from fastlm.generation.backend_config import NativeBackendConfig
from fastlm.logging.jsonl import read_metrics
from fastlm.rl.config import RLConfig
from fastlm.rl.rollout import RolloutSetup, collect_rollout
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer
from tests.rl.rl_helpers import tiny_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHORT = ["trainer.steps=4", "trainer.log_every=1", "trainer.eval_every=0", "rl.warmup_steps=0", "rl.prompts_per_rollout=4",
         "rl.eval_prompts=0", "logging.progress=false", "logging.wandb.enabled=false"]


def _rl_records(path: Path, overrides: list[str], tmp_path: Path) -> list[dict]:
    config = load_config(path, [f"run.output_dir={tmp_path}/{{name}}", *SHORT, *overrides])
    summary = build_trainer(config).train()
    records = [r for r in read_metrics(summary.run_dir / "metrics.jsonl") if "train/reward" in r]
    assert len(records) == 4
    for record in records:
        assert record["train/policy_version/min"] <= record["train/policy_version/max"]
    return records


def test_a_run_sampled_by_transformers_generate(tmp_path: Path) -> None:
    records = _rl_records(CONFIGS / "grpo.yaml", ["rl.backend.type=transformers"], tmp_path)
    gap = max(r["train/sampling/logp_diff/max"] for r in records)
    print(f"transformers backend: sampler vs training log-prob gap {gap:.2e}")
    assert gap < 1e-4


def test_an_moe_run_with_routing_replay(tmp_path: Path) -> None:
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump({
        "base": str(CONFIGS / "grpo.yaml"),
        "model": {"type": "qwen3_moe", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "head_dim": 16, "max_seq_len": 64, "moe": {"num_experts": 8, "top_k": 2, "ffn_size": 16},
                  "head": {"losses": {"grpo": {"type": "grpo"}}}},
        "rl": {"routing_replay": True}}))  # the default sampler: the rollout engine
    records = _rl_records(config, [], tmp_path)
    first_updates = [r for r in records if r["step"] % 2 == 1]
    worst = max(abs(r["train/grpo/ratio"] - 1) for r in first_updates)
    gap = max(r["train/sampling/logp_diff/max"] for r in records)
    print(f"MoE with routing replay: first-update |ratio - 1| {worst:.2e}, sampler vs trainer gap {gap:.2e}")
    assert worst < 1e-5 and gap < 1e-4


def test_a_rollout_logs_the_policy_version_it_was_sampled_with() -> None:
    model, tokenizer = tiny_model(), ByteTokenizer()
    rl = RLConfig(prompts_per_rollout=2, group_size=2, eval_prompts=0)
    setup = RolloutSetup.build(rl, model.config.head, tokenizer, model.config.max_seq_len, 32, 1)
    backend = NativeBackendConfig(generation="static").build(model, tokenizer, None, multi_turn=False)
    rollout = collect_rollout(model, model.head, backend, setup, random.Random(0), torch.Generator().manual_seed(0),
                              version=5)
    assert rollout.metrics["policy_version/min"] == rollout.metrics["policy_version/max"] == 5.0
    assert all(batch.routed_experts is None for batch in rollout.batches)  # a dense model records no routing
