"""On-policy distillation (`rl.teacher`, fastlm/rl/teacher.py) against its float64 formula: the teacher's log-probs
of the packed rollout's sampled tokens (a teacher of another size, over token chunks), the advantage
A_t = reward_weight * A_group + coef * sum_k discount^k (u_{t+k} - s_{t+k}) on policy tokens only, documents kept
apart; the metrics; and the refusal of a teacher with another tokenizer."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import reference_logprobs, rel_err

from fastlm.config.errors import ConfigError
from fastlm.data.offline_rl import PolicySample
from fastlm.losses.spec import IGNORE_INDEX
from fastlm.models.config import LlamaConfig
from fastlm.models.decoder import build_model
from fastlm.rl.config import TeacherConfig
from fastlm.rl.packing import pack_policy_samples, split_into_batches
from fastlm.rl.teacher import Teacher, add_teacher_advantages, discounted, teacher_metrics
from fastlm.run_config.loader import load_config


def reference_discounted(gain: list[float], policy: list[bool], documents: list[int], discount: float) -> list[float]:
    """sum_k discount^k gain over the later policy tokens of the same document, one position at a time."""
    out = []
    for t in range(len(gain)):
        if not policy[t]:
            out.append(None)
            continue
        total, power = 0.0, 0
        for k in range(t, len(gain)):
            if documents[k] != documents[t]:
                break
            if policy[k]:
                total += discount**power * gain[k]
                power += 1
        out.append(total)
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_discounted_sum_follows_its_formula(discount: float) -> None:
    generator = torch.Generator().manual_seed(3)
    gain = torch.randn(3, 17, generator=generator, dtype=torch.float64)
    policy = torch.rand(3, 17, generator=generator) > 0.3
    documents = torch.tensor([[0] * 6 + [1] * 11, [2] * 17, [3] * 3 + [4] * 4 + [5] * 10])
    got = discounted(gain.masked_fill(~policy, 0.0), policy, documents, discount)
    for row in range(3):
        want = reference_discounted(gain[row].tolist(), policy[row].tolist(), documents[row].tolist(), discount)
        for t, value in enumerate(want):
            if value is not None:
                assert got[row, t].item() == pytest.approx(value, abs=1e-12), (row, t)


@pytest.mark.parametrize(("reward_weight", "coef", "discount"), [(0.0, 1.0, 0.0), (0.5, 2.0, 0.0), (1.0, 0.3, 0.9)])
def test_teacher_advantages_match_float64(reward_weight: float, coef: float, discount: float) -> None:
    """A packed rollout of two completions (prompt tokens masked): the teacher, another size, scores each sampled
    token as a float64 unpacked forward does; the advantages follow the formula, zero off the policy tokens."""
    torch.manual_seed(2)
    teacher_model = build_model(LlamaConfig(hidden_size=48, num_layers=2, num_heads=4, max_seq_len=48, init_std=0.2)).eval()
    samples = [PolicySample([5, 9, 11], [3, 7, 8, 2], 0.7, old_logp=[-1.0, -2.0, -0.5, -1.5]),
               PolicySample([4, 6], [10, 12, 1], -0.4, old_logp=[-0.25, -3.0, -1.25])]
    rows = pack_policy_samples(samples, 16, pad_id=0)
    (batch,) = split_into_batches(rows, 1)
    teacher = Teacher(teacher_model, TeacherConfig(path="unused", coef=coef, reward_weight=reward_weight, discount=discount),
                      1.0, None, None, budget_mib=0.001)  # a tiny budget: many token chunks
    group = batch.advantages.clone()
    sampled = batch.old_logp.clone()
    sums = add_teacher_advantages([batch], teacher)
    policy = batch.labels != IGNORE_INDEX
    expected_u = torch.zeros_like(sampled, dtype=torch.float64)
    start = 0
    for sample in samples:  # each document's float64 log-probs of its completion tokens
        sequence = sample.prompt_tokens + sample.completion_tokens
        u = reference_logprobs(teacher_model, sequence, len(sample.prompt_tokens))
        positions = torch.arange(start + len(sample.prompt_tokens) - 1, start + len(sequence) - 1)
        expected_u[0, positions] = u
        start += len(sequence)
    gain = (expected_u - sampled.double()).masked_fill(~policy, 0.0)
    term = discounted(gain, policy, batch.document_ids, discount)
    want = (reward_weight * group.double() + coef * term).masked_fill(~policy, 0.0)
    error = rel_err(batch.advantages, want)
    print(f"reward_weight {reward_weight} coef {coef} discount {discount}: advantages rel err {error:.2e}")
    assert error < 1e-5 and bool((batch.advantages[~policy] == 0).all())
    metrics = teacher_metrics(sums)
    tokens = int(policy.sum())
    assert metrics["distill/reverse_kl"] == pytest.approx(float(-gain.sum()) / tokens, rel=1e-5)
    assert metrics["distill/logp_gap"] == pytest.approx(-metrics["distill/reverse_kl"], rel=1e-6)
    assert metrics["distill/teacher_logp"] == pytest.approx(float(expected_u[policy].sum()) / tokens, rel=1e-5)


def test_teacher_with_another_tokenizer_is_refused(tmp_path) -> None:
    """A teacher trained with another tokenizer (a tiny HF folder's BPE) for a byte-tokenizer run: refused at load,
    naming rl.teacher.path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from make_tiny_hf import tiny_hf_checkpoint

    folder = tiny_hf_checkpoint(tmp_path / "teacher")
    with pytest.raises(ConfigError) as raised:
        load_config("configs/grpo.yaml", [f"rl.teacher={{path: {folder}}}"])
    issues = [issue for issue in raised.value.issues if issue.path == "rl.teacher.path"]
    print(issues)
    assert len(issues) == 1 and "tokenizer" in issues[0].message


def test_missing_teacher_is_refused_at_its_field() -> None:
    with pytest.raises(ConfigError) as raised:
        load_config("configs/grpo.yaml", ["rl.teacher={path: runs/no-such-teacher}"])
    assert [issue.path for issue in raised.value.issues] == ["rl.teacher.path"]
