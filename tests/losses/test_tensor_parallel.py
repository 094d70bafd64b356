"""Vocab-parallel compiled loss on two gloo ranks vs the float64 reference on the full vocab."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))


def _rank(rank: int, port: int, kinds: str, errors: dict) -> None:
    from loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of

    from fastlm.losses.compiled import compiled_loss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        spec = make_spec(kinds, softcap=3.0)
        logits, targets, normalizers = make_case(seed_of("tp" + kinds), vocab=38, spec=spec)
        shard = slice(rank * 19, (rank + 1) * 19)
        targets.teacher_logits, full_teacher = targets.teacher_logits[:, shard], targets.teacher_logits
        result, grad = compiled_loss(logits[:, shard].contiguous(), targets, normalizers, spec, group=dist.group.WORLD)
        targets.teacher_logits = full_teacher
        expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
        found = {k: rel_err(v, expected.losses[k]) for k, v in result.losses.items()}
        found["grad"] = rel_err(grad, expected_grad[:, shard])
        errors[rank] = found
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("kinds", ["ce+z+gspo+kd_rev", "ce+grpo+kd_both", "ce+kd_jsd_both"])
def test_vocab_parallel_matches_reference(kinds: str) -> None:
    with mp.Manager() as manager:
        errors = manager.dict()
        mp.spawn(_rank, args=(_free_port(), kinds, errors), nprocs=2, join=True)
        found = dict(errors)
    print(f"TP world 2 {kinds}: {found}")
    assert len(found) == 2 and all(v < 1e-6 for rank in found.values() for v in rank.values())
