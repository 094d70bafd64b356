"""GKD on student samples (`rl.teacher.objective: gkd`, fastlm/rl/teacher.py `add_teacher_heads`): the packed
rollout's batches carry the teacher's head input, and the head's distillation child (kl: jsd with beta) gives
the float64 generalized JSD of the teacher's and the student's distributions on the sampled rows; the
advantages keep reward_weight * A_group; validation names what gkd needs; a tiny RL run trains on it."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from fastlm.config.errors import ConfigError
from fastlm.data.offline_rl import PolicySample
from fastlm.layers.lm_head import LMHead
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers
from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import build_model
from fastlm.rl.config import TeacherConfig
from fastlm.rl.packing import pack_policy_samples, split_into_batches
from fastlm.rl.teacher import Teacher, add_gkd_inputs, teacher_metrics
from fastlm.run_config.loader import load_config
from fastlm.training.registry import build_trainer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _jsd64(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
           top_k: int | None = None) -> torch.Tensor:
    """Per-token beta*KL(q || M) + (1-beta)*KL(p || M), M = beta*q + (1-beta)*p, in float64 (TRL's definition);
    with `top_k` both over the teacher's k largest logits, renormalised there."""
    student, teacher = student.double() / temperature, teacher.double() / temperature
    if top_k is not None:
        support = teacher.topk(top_k, dim=-1).indices
        student, teacher = student.gather(-1, support), teacher.gather(-1, support)
    p = torch.log_softmax(student, -1)
    q = torch.log_softmax(teacher, -1)
    m = torch.logaddexp(p + math.log1p(-beta), q + math.log(beta))
    return beta * (q.exp() * (q - m)).sum(-1) + (1 - beta) * (p.exp() * (p - m)).sum(-1)


@pytest.mark.parametrize(("budget", "top_k"), [(0.0, None), (0.002, None), (0.002, 5)],
                         ids=["full-logits", "chunked", "chunked-top5"])
def test_rollout_batches_carry_the_teacher_head_and_the_loss_is_the_float64_jsd(budget: float, top_k: int | None) -> None:
    torch.manual_seed(4)
    teacher_model = build_model(LlamaConfig(hidden_size=48, num_layers=2, num_heads=4, max_seq_len=48, init_std=0.2)).eval()
    student = build_model(LlamaConfig(hidden_size=32, num_layers=1, num_heads=2, max_seq_len=48, init_std=0.2))
    samples = [PolicySample([5, 9, 11], [3, 7, 8, 2], 0.7, old_logp=[-1.0, -2.0, -0.5, -1.5]),
               PolicySample([4, 6], [10, 12, 1], -0.4, old_logp=[-0.25, -3.0, -1.25])]
    (batch,) = split_into_batches(pack_policy_samples(samples, 16, pad_id=0), 1)
    group = batch.advantages.clone()
    teacher = Teacher(teacher_model, TeacherConfig(path="unused", objective="gkd", reward_weight=0.5), 1.25, 5.0,
                      None, budget_mib=1.0)
    sums = add_gkd_inputs([batch], teacher)
    assert batch.teacher_head is not None and batch.teacher_head.hidden.shape == (*batch.input_ids.shape, 48)
    assert torch.equal(batch.advantages, 0.5 * group)
    beta, temperature = 0.3, 1.5
    head = LMHead(LMHeadConfig(losses={"grpo": {"type": "grpo", "weight": 0.0},
                                       "kd": {"type": "distillation", "kl": "jsd", "beta": beta,
                                              "temperature": temperature, "temperature_mode": "both",
                                              "kd_scale": "none", "top_k": top_k}},
                               logits_memory_mib=budget))
    tokens = batch.labels != IGNORE_INDEX
    result = student(batch.input_ids, batch.targets(), LossNormalizers(float(tokens.sum()), 2.0), batch.document_ids,
                     head=head)
    with torch.no_grad():  # float64: both models' logits over the packed rows, the teacher's through its transform
        teacher_logits = copy.deepcopy(teacher_model).double().logits(batch.input_ids, batch.document_ids) * 1.25
        teacher_logits = 5.0 * torch.tanh(teacher_logits / 5.0)
        student_logits = copy.deepcopy(student).double().logits(batch.input_ids, batch.document_ids)
    want = _jsd64(student_logits, teacher_logits, beta, temperature, top_k)[tokens].mean()
    u = torch.log_softmax(teacher_logits, -1).gather(-1, batch.labels.clamp_min(0)[..., None])[..., 0][tokens]
    metrics = teacher_metrics(sums)  # the sampled tokens' log-probs from the same hidden states
    assert metrics["distill/teacher_logp"] == pytest.approx(float(u.mean()), rel=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(float((batch.old_logp[tokens] - u).mean()), rel=1e-5)
    error = abs(float(result.losses["kd"]) - float(want)) / float(want)
    print(f"gkd jsd beta {beta} top_k {top_k} ({'chunked' if budget else 'full logits'}): {float(result.losses['kd']):.6f} "
          f"vs float64 {float(want):.6f}, rel err {error:.1e}")
    assert error < 1e-5
    result.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in student.parameters())


def test_gkd_needs_a_distillation_child_and_reverse_kl_none() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(CONFIGS / "grpo.yaml", ["rl.teacher={path: ../runs/x, objective: gkd}"])
    messages = {issue.path: issue.message for issue in raised.value.issues}
    print(messages)
    assert "gkd trains the head's distillation child" in messages["rl.teacher.objective"]
    with pytest.raises(ConfigError) as raised:
        load_config(CONFIGS / "grpo.yaml", ["rl.teacher={path: ../runs/x}",
                                            "model.head.losses.kd={type: distillation, kl: jsd}"])
    assert "only rl.teacher.objective gkd" in {i.path: i.message for i in raised.value.issues}["model.head.losses.kd"]
    with pytest.raises(ValueError, match="coef and discount shape the reverse_kl"):
        TeacherConfig(path="x", objective="gkd", discount=0.5)


def test_a_tiny_gkd_run_trains(tmp_path: Path) -> None:
    """configs/gkd.yaml shortened: a 2-step teacher run, then a student that distills from it with gkd (JSD beta
    0.5) after a 1-step warm-up:
    the RL step logs a finite, positive distillation loss and the reward-free policy child's zero gradient."""
    quiet = [f"run.output_dir={tmp_path}/{{name}}", "logging.progress=false", "logging.wandb.enabled=false",
             "trainer.steps=2", "rl.warmup_steps=1", "rl.prompts_per_rollout=2", "rl.group_size=2",
             "rl.eval_prompts=2", "trainer.log_every=1", "trainer.eval_every=0", "rl.updates_per_rollout=1"]
    teacher = build_trainer(load_config(CONFIGS / "grpo.yaml", quiet)).train()
    config = load_config(CONFIGS / "gkd.yaml", [*quiet, f"rl.teacher.path={teacher.run_dir}"])
    student = build_trainer(config)
    student.train()
    from fastlm.logging.jsonl import read_metrics

    records = [r for r in read_metrics(student.run_dir / "metrics.jsonl") if r.get("train/rl/warmup") == 0.0]
    print(records[-1])
    assert records and all(0 < r["train/loss/distillation"] < 10 and r["train/distill/reverse_kl"] > 0 for r in records)


def test_a_resumed_gkd_rollout_gets_its_teacher_head_back(tmp_path: Path) -> None:
    """A checkpoint taken mid-rollout leaves the teacher's head input out (the teacher makes it again on resume,
    not a copy of its hidden states and weight in every checkpoint): the resumed step equals the straight one."""
    quiet = [f"run.output_dir={tmp_path}/{{name}}", "logging.progress=false", "logging.wandb.enabled=false",
             "trainer.steps=2", "rl.warmup_steps=1", "rl.prompts_per_rollout=2", "rl.group_size=2",
             "rl.eval_prompts=0", "trainer.log_every=1", "trainer.eval_every=0", "rl.updates_per_rollout=1"]
    teacher = build_trainer(load_config(CONFIGS / "grpo.yaml", quiet)).train()
    student = [*quiet, f"rl.teacher.path={teacher.run_dir}", "rl.updates_per_rollout=2", "trainer.log_every=1"]

    def run(name: str, steps: int, resume: bool = False) -> dict:
        config = load_config(CONFIGS / "gkd.yaml", [*student, f"run.name={name}", f"trainer.steps={steps}"])
        summary = build_trainer(config).train(resume=resume)
        from fastlm.logging.jsonl import read_metrics

        return {r["step"]: r for r in read_metrics(summary.run_dir / "metrics.jsonl")}

    straight = run("straight", 3)
    run("resumed", 2)
    resumed = run("resumed", 3, resume=True)
    print(f"step 3 distillation loss: straight {straight[3]['train/loss/distillation']:.6f}, "
          f"resumed {resumed[3]['train/loss/distillation']:.6f}")
    assert resumed[3]["train/loss/distillation"] == pytest.approx(straight[3]["train/loss/distillation"], rel=1e-5)
