"""The distillation child over the teacher's top-k support (`top_k: k`): teacher and student renormalised over
the teacher's k largest logits (NeMo RL's `DistillationLossFn`, `zero_outside_topk: false`). The compiled path
and the chunked head against the float64 reference (values and gradients, masked labels, sub-chunks, logit
scale and softcap, tempered students, forward / reverse / the generalized JSD), the reference against NeMo
RL's formula written out by hand, and the refusals (the fused Triton kernel, tensor parallelism)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from fastlm.losses.children import DistillationConfig
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.dispatch import resolve_implementation
from fastlm.losses.reference import reference_loss
from fastlm.losses.spec import LossSpec
from tests.losses.loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of
from tests.losses.test_chunked_head import FP32_TOL, errors_of, head_case, run_head

# name: (kinds, distillation options, head numbers)
CASES = {
    "ce+forward k5": ("ce+kd", {"top_k": 5}, {"logit_scale": 1.3, "softcap": 4.0}),
    "reverse k3 tempered": ("kd", {"top_k": 3, "reverse": True, "tempered_student": True}, {}),
    "jsd0.3 k6 tempered t_squared+z": ("kd+z", {"top_k": 6, "jsd_beta": 0.3, "tempered_student": True,
                                                "t_squared": True}, {}),
}


def _spec(name: str, **numbers: object) -> LossSpec:
    kinds, options, head = CASES[name]
    return make_spec(kinds, {}, {"kd": options}, **head, **numbers)


@pytest.mark.parametrize("name", CASES)
def test_compiled_matches_float64(name: str) -> None:
    """float64 in, sub-chunks of 5 tokens: loss, each child and the gradient to ~1e-16."""
    spec = _spec(name, chunk_tokens=5)
    logits, targets, normalizers = make_case(seed_of("topk" + name), spec=spec, dtype=torch.float64)
    assert (targets.labels == -100).any()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=1.5)
    result, grad = compiled_loss(logits, targets, normalizers, spec, grad_scale=1.5)
    errors = {"loss": rel_err(result.loss, expected.loss), "grad": rel_err(grad, expected_grad)}
    errors.update({child: rel_err(value, expected.losses[child]) for child, value in result.losses.items()})
    print(f"{name} compiled float64 vs reference: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < 1e-12, errors
    assert expected.losses["kd"] > 0


def _nemo_rl(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, k: int, kl_type: str) -> torch.Tensor:
    """NeMo RL's DistillationLossFn (zero_outside_topk false) as written there, token mean over unmasked labels."""
    teacher_topk_logits, teacher_topk_indices = teacher.topk(k, dim=-1)
    student_topk_logprobs = torch.log_softmax(student.gather(-1, teacher_topk_indices), dim=-1)
    teacher_topk_logprobs = torch.log_softmax(teacher_topk_logits, dim=-1)
    if kl_type == "forward":
        per_token = teacher_topk_logprobs.exp() * (teacher_topk_logprobs - student_topk_logprobs)
    else:
        per_token = student_topk_logprobs.exp() * (student_topk_logprobs - teacher_topk_logprobs)
    keep = labels != -100
    return per_token.sum(-1)[keep].sum() / keep.sum()


@pytest.mark.parametrize("kl", ["forward", "reverse"])
def test_reference_and_compiled_are_nemo_rls_topk_kl(kl: str) -> None:
    """At T = 1 the child's top-k KL is NeMo RL's: loss and gradient to 1e-12 (float64, masked labels)."""
    child = DistillationConfig(kl=kl, top_k=4).to_child("kd")
    spec = LossSpec((child,))
    logits, targets, normalizers = make_case(seed_of("nemo" + kl), spec=spec, dtype=torch.float64)
    student = logits.clone().requires_grad_(True)
    want = _nemo_rl(student, targets.teacher_logits, targets.labels, 4, kl)
    want.backward()
    leaf = logits.clone().requires_grad_(True)
    result = reference_loss(leaf, targets, normalizers, spec)
    result.loss.backward()
    compiled, grad = compiled_loss(logits, targets, normalizers, spec)
    for path, loss, gradient in (("reference", result.loss, leaf.grad), ("compiled", compiled.loss, grad)):
        loss_error = rel_err(loss.detach(), want.detach())
        grad_error = rel_err(gradient, student.grad)
        print(f"top-k {kl} / {path} vs NeMo RL DistillationLossFn: loss {loss_error:.1e}, grad {grad_error:.1e}")
        assert loss_error < 1e-12 and grad_error < 1e-12


def test_support_only_and_whole_vocab_limit() -> None:
    """Columns outside the teacher's top k get no distillation gradient; k >= V is the whole-vocab KL."""
    spec = make_spec("kd", {}, {"kd": {"top_k": 3}})
    logits, targets, normalizers = make_case(seed_of("topk-support"), spec=spec, dtype=torch.float64)
    _, grad = compiled_loss(logits, targets, normalizers, spec)
    outside = torch.ones_like(grad, dtype=torch.bool).scatter_(-1, targets.teacher_logits.topk(3, dim=-1).indices, False)
    assert torch.count_nonzero(grad[outside]) == 0 and torch.count_nonzero(grad[targets.labels != -100]) > 0
    whole = make_spec("kd")
    wide = make_spec("kd", {}, {"kd": {"top_k": logits.shape[1] + 5}})
    expected, expected_grad = compiled_loss(logits, targets, normalizers, whole)
    result, wide_grad = compiled_loss(logits, targets, normalizers, wide)
    assert rel_err(result.loss, expected.loss) < 1e-14 and rel_err(wide_grad, expected_grad) < 1e-14


@pytest.mark.parametrize("name", ["ce+forward k5", "reverse k3 tempered"])
def test_chunked_head_with_teacher_head_matches_float64(name: str) -> None:
    """Through the chunked head (fp32, chunks of 12 tokens, the teacher's logits a piece at a time)."""
    case = head_case(name, spec=_spec(name))
    errors = errors_of(*run_head(case, "compiled", 12, {}), case)
    print(f"{name} chunked compiled: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors


def test_triton_and_tensor_parallel_refuse_top_k(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    losses = {"kd": {"type": "distillation", "top_k": 8}}
    with pytest.raises(ValidationError, match=r"no path for the options of \['kd'\].*top_k"):
        LMHeadConfig(losses=losses, use_triton=True)
    assert resolve_implementation(LMHeadConfig(losses=losses).monolithic(), "cuda") == "compiled"
    with pytest.raises(ValueError, match="top_k has no Triton path"):
        DistillationConfig(top_k=8).to_child("kd").slot()
    with pytest.raises(ValidationError, match="top_k"):
        DistillationConfig(top_k=0)
    spec = make_spec("kd", {}, {"kd": {"top_k": 3}})
    logits, targets, normalizers = make_case(seed_of("topk-tp"), spec=spec)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="top_k needs the teacher's whole row"):
            compiled_loss(logits, dataclasses.replace(targets), normalizers, spec, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
