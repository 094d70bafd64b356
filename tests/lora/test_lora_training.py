"""LoRA in the trainers: adapter-only checkpoints that resume exactly and refuse another base; accumulation,
DDP and FSDP2 (gloo, world 2) give one big batch's adapter updates; SFT, DPO, GRPO (with a KL reference) and
distillation train adapters only, their reference being the base with adapters off."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))

from dist_helpers import final_weights, run_config, spawn, train_run

from fastlm.engine.checkpoint import CheckpointError
from fastlm.engine.frozen import frozen_logits
from fastlm.engine.init_path import resolve_init_path
from fastlm.engine.preflight import preflight_issues
from fastlm.engine.trainer import Trainer
from fastlm.logging.jsonl import read_metrics
from fastlm.lora.attach import AdapterSnapshot, BaseView, lora_layers
from fastlm.losses.dpo import label_sequence_logps
from fastlm.models.decoder import build_model
from fastlm.run_config.loader import load_config
from fastlm.run_config.schema import RunConfig
from fastlm.training.registry import build_trainer
from tests.step_helpers import forward_backward, next_batches

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LORA = {"lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}}
QUIET = ["logging.wandb.enabled=false", "logging.progress=false", "trainer.log_every=1", "trainer.eval_every=0"]


def test_adapter_checkpoint_resumes_exactly_and_names_its_base(tmp_path: Path) -> None:
    straight = run_config(tmp_path, "straight", model=LORA, trainer={"steps": 4, "checkpoint_every": 2})
    halves = run_config(tmp_path, "halves", model=LORA, trainer={"steps": 2, "checkpoint_every": 2})
    full = train_run(straight)
    first = train_run(halves)
    halves["trainer"]["steps"] = 4
    second = train_run(halves, resume=True)
    assert first["losses"] + second["losses"] == full["losses"]
    weights, resumed = final_weights(straight), final_weights(halves)
    trainable = [n for n, p in Trainer(RunConfig.model_validate(straight)).model.named_parameters() if p.requires_grad]
    assert sorted(weights) == sorted(trainable) and all(".lora_" in name for name in weights)  # adapters only
    assert all(torch.equal(weights[name], resumed[name]) for name in weights)
    other_base = {**halves, "run": {**halves["run"], "seed": 1}, "trainer": {**halves["trainer"], "steps": 6}}
    with pytest.warns(RuntimeWarning, match="belong to another base"), pytest.raises(CheckpointError, match="another base"):
        train_run(other_base, resume=True)


def _perturbed(config: dict) -> Trainer:
    trainer = Trainer(RunConfig.model_validate(config))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if ".lora_B" in name:  # B = 0 at init would leave A without gradient
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return trainer


def test_accumulation_gives_one_big_batch_adapter_gradients(tmp_path: Path) -> None:
    no_clip = {"grad_clip": None}
    accumulated = _perturbed(run_config(tmp_path, "acc", model=LORA, optimizer=no_clip, trainer={"grad_accumulation": 2}))
    big = _perturbed(run_config(tmp_path, "big", model=LORA, optimizer=no_clip, data={"micro_batch_size": 4}))
    forward_backward(accumulated, next_batches(accumulated))
    forward_backward(big, next_batches(big))
    pairs = [(a, b) for (name, a), b in zip(accumulated.model.named_parameters(), big.model.parameters()) if ".lora_" in name]
    error = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in pairs)
    print(f"accumulation 2x2 vs 1x4: max adapter grad rel err {error:.1e} over {len(pairs)} tensors")
    assert error < 1e-5 and all(p.grad is None for n, p in big.model.named_parameters() if ".lora_" not in n)


def _train_ddp_then_fsdp(configs: list[dict]) -> list[dict]:
    """Each config for 3 steps, then resumed from its adapter-only checkpoint for a 4th."""
    results = []
    for config in configs:
        first = train_run(config)
        second = train_run({**config, "trainer": {**config["trainer"], "steps": 4}}, resume=True)
        results.append({"losses": first["losses"] + second["losses"]})
    return results


def test_ddp_and_fsdp_world_2_match_one_process(tmp_path: Path) -> None:
    """2 gloo ranks with 2 rows each (DDP, then FSDP2; 3 steps, then a resume for a 4th) vs one process with
    4 rows, accumulation 2: the same losses and the same adapters (checkpoints gather adapters only)."""
    sections = {"model": LORA, "trainer": {"grad_accumulation": 2}}
    single = run_config(tmp_path, "single", data={"micro_batch_size": 4}, model=LORA,
                        trainer={"grad_accumulation": 2, "steps": 4})
    parallel = [run_config(tmp_path, kind, distributed={"data_parallel": kind}, **sections) for kind in ("ddp", "fsdp")]
    expected = train_run(single)
    ranks = spawn(_train_ddp_then_fsdp, parallel)
    reference = final_weights(single)
    for index, config in enumerate(parallel):
        losses = [run[index]["losses"] for run in ranks.values()]
        loss_gap = max(abs(a - b) / b for run in losses for a, b in zip(run, expected["losses"], strict=True))
        weights = final_weights(config)
        assert sorted(weights) == sorted(reference)
        weight_gap = max(float((weights[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in reference)
        print(f"{config['distributed']['data_parallel']} world 2 vs one process: loss gap {loss_gap:.1e}, "
              f"adapter gap {weight_gap:.1e}")
        assert loss_gap < 1e-6 and weight_gap < 1e-5


def test_dpo_reference_is_the_base_without_a_copy(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "dpo.yaml", [
        f"run.output_dir={tmp_path}/{{name}}", "trainer.steps=3", *QUIET, "model.hidden_size=64", "model.num_layers=1",
        "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=128", "model.max_seq_len=32",
        "data.seq_len=32", "data.micro_batch_size=4", "data.source.num_pairs=60", "data.source.max_operand=4",
        "optimizer.lr=1e-2", "model.lora={rank: 4, targets: [attn.q, attn.v, mlp.*]}"])
    trainer = build_trainer(config)
    assert isinstance(trainer.objective.reference, BaseView) and trainer.objective.reference.model is trainer.model
    base = build_model(config.model.model_copy(update={"lora": None}), "cpu")  # a separate frozen copy of the base
    base.load_state_dict({k: v for k, v in trainer.model.state_dict().items() if ".lora_" not in k})
    summary = trainer.train()
    assert abs(summary.losses[0] - math.log(2)) < 1e-6  # step 1: policy == reference (B = 0)
    assert summary.losses[-1] != summary.losses[0]
    objective = trainer.objective
    batch = objective.prepare(objective.eval_set[0] if objective.eval_set else objective.loader.next_batch())
    logits = frozen_logits(base.eval(), batch.input_ids, batch.document_ids)
    copy_logps = label_sequence_logps(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1),
                                      batch.document_ids.reshape(-1))
    print(f"DPO reference (adapters off) vs a frozen copy: sequence log-probs {batch.reference_logps.tolist()[:3]}")
    assert torch.equal(batch.reference_logps, copy_logps)


def test_grpo_with_kl_reference_trains_adapters(tmp_path: Path) -> None:
    """After a warm-up the KL reference is the policy as RL starts: a snapshot of the warmed-up adapters (and
    head, train_head) over the shared frozen base, not the base with adapters off; so the first RL step's
    kl is ~0 like kl_old. A resume past the warm-up reads the saved adapters back."""
    overrides = [f"run.output_dir={tmp_path}/{{name}}", *QUIET, "rl.warmup_steps=2", "rl.prompts_per_rollout=4",
                 "rl.group_size=4", "rl.eval_prompts=0", "data.micro_batch_size=8", "trainer.grad_accumulation=1",
                 "model.head.losses.grpo.beta=0.05"]
    config = load_config(CONFIGS / "grpo_lora.yaml", [*overrides, "trainer.steps=3", "trainer.checkpoint_every=3"])
    trainer = build_trainer(config)
    assert trainer.objective.reference is None  # taken at the first RL step
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n in before if ".lora_" in n} | {"lm_head_weight"}
    reference = trainer.objective.reference
    assert isinstance(reference, AdapterSnapshot) and reference.model is trainer.model
    assert set(reference.state) == moved and not torch.equal(reference.output_weight, before["lm_head_weight"])
    assert all(reference.state[n].data_ptr() != p.data_ptr() for n, p in trainer.model.named_parameters() if n in moved)
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["train/rl/warmup"] == 0.0]
    assert records and all(r["train/sampling/logp_diff/max"] < 1e-4 for r in records)
    assert records[0]["step"] == 3 and abs(records[0]["train/grpo/kl"]) < 1e-6 and abs(records[0]["train/grpo/kl_old"]) < 1e-6

    longer = load_config(CONFIGS / "grpo_lora.yaml", [*overrides, "trainer.steps=4"])
    resumed = build_trainer(longer)
    resumed.train(resume=True)
    assert isinstance(resumed.objective.reference, AdapterSnapshot)
    assert all(torch.equal(resumed.objective.reference.state[n], v) for n, v in reference.state.items())
    last = read_metrics(trainer.run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 4 and last["train/grpo/kl"] > 1e-6  # the policy then moves away from it


def test_distillation_student_with_adapters(tmp_path: Path) -> None:
    teacher = run_config(tmp_path, "teacher", trainer={"steps": 1, "checkpoint_every": 1})
    train_run(teacher)
    student = run_config(tmp_path, "student", model={**LORA, "head": {"losses": {"distillation": {
        "type": "distillation", "teacher_path": f"{tmp_path}/teacher"}}}}, trainer={"steps": 2})
    trainer = build_trainer(RunConfig.model_validate(student))
    summary = trainer.train()
    assert summary.steps == 2 and lora_layers(trainer.model)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".lora_" not in n)


def test_validate_names_bad_lora_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One line per problem, before anything runs: a target that matches no linear, a tied head to train, an
    adapter folder that is none; a good config's dry run prints the trainable / total split."""
    from fastlm.commands.main import main

    config = str(CONFIGS / "grpo_lora.yaml")
    assert main(["validate", config, "model.lora.targets=[attn.qkv]", "model.tie_embeddings=true",
                 f"model.lora.adapter_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.lora.targets: 'attn.qkv' matches no linear of this model; it has attn.k, attn.o, attn.q" in err
    assert "model.lora.train_head: the output matrix is the token embedding" in err
    assert main(["validate", config, f"model.lora.adapter_path={tmp_path}"]) == 2
    assert "model.lora.adapter_path: holds neither a PEFT adapter" in capsys.readouterr().err
    assert main(["train", config, "--dry-run", f"run.output_dir={tmp_path}/run"]) == 0
    out = capsys.readouterr().out  # 2 layers x 7 slices of rank 16 (38,912 values) + the untied head 260 x 64
    assert "LoRA: adapters on " in out and "; 55,552 trainable of 170,816 parameters (32.52%)" in out
    assert "(full fine-tune: 0.002 GiB)" in out


def test_adapters_start_on_a_fastlm_checkpoint_without_adapters(tmp_path: Path) -> None:
    """`run.init_path` to a full fine-tune's checkpoint with `model.lora` set: the base loads (the adapters start
    at B = 0, so the first loss is the base's), only adapters train; the other way round is still refused."""
    base = run_config(tmp_path, "base", trainer={"steps": 2, "checkpoint_every": 2})
    train_run(base)
    base_dir = str(resolve_init_path(RunConfig.model_validate(base).run.directory).path)  # as the loader resolves it
    plain = run_config(tmp_path, "plain", run={"init_path": base_dir}, trainer={"steps": 1})
    adapted = run_config(tmp_path, "adapted", model=LORA, run={"init_path": base_dir}, trainer={"steps": 2})
    assert not preflight_issues(RunConfig.model_validate(adapted))
    first = train_run(plain)["losses"][0]
    losses = train_run(adapted)["losses"]
    print("base's first loss", first, "adapted run's", losses)
    assert losses[0] == pytest.approx(first, rel=1e-6)
    assert all(".lora_" in name for name in final_weights(adapted))
    adapted_dir = str(resolve_init_path(RunConfig.model_validate(adapted).run.directory).path)
    back = run_config(tmp_path, "back", run={"init_path": adapted_dir})
    (issue,) = preflight_issues(RunConfig.model_validate(back))  # adapter-only weights are no base
    print(issue)
    assert issue.path == "run.init_path" and "holds a LoRA run's adapters, not a whole model" in str(issue)
