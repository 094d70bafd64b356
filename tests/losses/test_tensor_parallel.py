"""Vocab-parallel compiled loss on two gloo ranks vs the float64 reference on the full vocab."""

from __future__ import annotations

import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from tests.distributed.dist_helpers import spawn  # noqa: E402


def _errors(kinds: str) -> dict[str, float]:
    """This rank's relative errors against the float64 reference on its half of the vocab."""
    from loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of

    from fastlm.losses.compiled import compiled_loss

    spec = make_spec(kinds, softcap=3.0)
    logits, targets, normalizers = make_case(seed_of("tp" + kinds), vocab=38, spec=spec)
    rank = dist.get_rank()
    shard = slice(rank * 19, (rank + 1) * 19)
    targets.teacher_logits, full_teacher = targets.teacher_logits[:, shard], targets.teacher_logits
    result, grad = compiled_loss(logits[:, shard].contiguous(), targets, normalizers, spec, group=dist.group.WORLD)
    targets.teacher_logits = full_teacher
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    found = {k: rel_err(v, expected.losses[k]) for k, v in result.losses.items()}
    found["grad"] = rel_err(grad, expected_grad[:, shard])
    return found


@pytest.mark.parametrize("kinds", ["ce+z+gspo+kd_rev", "ce+grpo+kd_both", "ce+kd_jsd_both"])
def test_vocab_parallel_matches_reference(kinds: str) -> None:
    found = spawn(_errors, kinds)
    print(f"TP world 2 {kinds}: {found}")
    assert len(found) == 2 and all(v < 1e-6 for rank in found.values() for v in rank.values())
