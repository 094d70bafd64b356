"""The generalized JSD of the distillation child (`kl: jsd`, 0 < beta < 1) on the compiled path, the
Triton path (stats launch, the mixture's vocab pass `jsd_sums_kernel`, grad launch; the interpreter on
CPU) and the chunked head against the float64 reference (values and gradients, masked labels, several
sub-chunks or looped vocab blocks, logit scale and softcap). TRL's formula itself:
test_trl_formulas.py::test_kl_jsd_is_trls_generalized_jsd."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastlm.losses.children import DistillationConfig
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.dispatch import resolve_implementation
from fastlm.losses.spec import LossSpec
from fastlm.losses.triton import triton_loss
from tests.losses.loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of
from tests.losses.test_chunked_head import FP32_TOL, errors_of, head_case, run_head

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# name: (kinds, distillation options, weights, head numbers)
CASES = {
    "ce+jsd0.3": ("ce+kd", {"jsd_beta": 0.3}, {"ce": 0.5}, {"logit_scale": 1.3, "softcap": 4.0}),
    "jsd0.7 tempered": ("kd", {"jsd_beta": 0.7, "tempered_student": True}, {}, {}),
    "jsd0.5 tempered t_squared+z": ("kd+z", {"jsd_beta": 0.5, "tempered_student": True, "t_squared": True}, {}, {}),
    "jsd0.5 w0+ce": ("ce+kd", {"jsd_beta": 0.5}, {"kd": 0.0}, {}),
}


def _spec(name: str, **numbers: object):  # noqa: ANN202 - LossSpec
    kinds, options, weights, head = CASES[name]
    return make_spec(kinds, weights, {"kd": options}, **head, **numbers)


@pytest.mark.parametrize("name", CASES)
def test_compiled_matches_float64(name: str) -> None:
    """float64 in, several sub-chunks of 5 tokens (the JSD pass runs per sub-chunk): ~1e-12."""
    spec = _spec(name, chunk_tokens=5)
    logits, targets, normalizers = make_case(seed_of("jsd" + name), spec=spec, dtype=torch.float64)
    assert (targets.labels == -100).any()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=1.5)
    result, grad = compiled_loss(logits, targets, normalizers, spec, grad_scale=1.5)
    errors = {"loss": rel_err(result.loss, expected.loss), "grad": rel_err(grad, expected_grad)}
    errors.update({child: rel_err(value, expected.losses[child]) for child, value in result.losses.items()})
    print(f"{name} compiled float64 vs reference: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < 1e-12, errors
    assert expected.losses["kd"] > 0


@pytest.mark.parametrize("name", ["ce+jsd0.3", "jsd0.7 tempered"])
def test_chunked_head_with_teacher_head_matches_float64(name: str) -> None:
    """Through the chunked head (fp32, chunks of 12 tokens, the teacher's logits from its head input a
    piece at a time): the loss, the hidden and weight gradients."""
    case = head_case(name, spec=_spec(name))
    errors = errors_of(*run_head(case, "compiled", 12, {}), case)
    print(f"{name} chunked compiled: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.3])
def test_triton_matches_float64(beta: float) -> None:
    """`kl: jsd` at every beta (the endpoints run as the forward / reverse KL) with cross entropy, a
    softcap and a logit scale, ~30% masked labels, looped vocab blocks of 16 with a tail (the single-block
    row: test_trl_formulas.py's, V = 11): loss, each child and the gradient within fp32 rounding of the
    float64 reference; masked rows get a zero gradient."""
    block = 16
    child = DistillationConfig(kl="jsd", beta=beta, temperature=1.7).to_child("kd")
    spec = LossSpec((make_spec("ce").children[0], child), logit_scale=1.3, softcap=4.0)
    logits, targets, normalizers = make_case(seed_of(f"jsd-triton{beta}"), spec=spec)
    assert (targets.labels == -100).any()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=1.5)
    result, grad = triton_loss(logits.to(DEVICE), _on(targets), normalizers, spec, grad_scale=1.5, max_block=block)
    errors = {"loss": rel_err(result.loss.cpu(), expected.loss), "grad": rel_err(grad.cpu(), expected_grad)}
    errors.update({name: rel_err(value.cpu(), expected.losses[name]) for name, value in result.losses.items()})
    print(f"jsd beta={beta} triton block {block} vs float64: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors
    assert torch.count_nonzero(grad[targets.labels.to(DEVICE) == -100]) == 0


@pytest.mark.parametrize("name", ["jsd0.5 tempered t_squared+z", "jsd0.5 w0+ce"])
def test_triton_cases_match_float64(name: str) -> None:
    """Compiled cases on the Triton path (a tempered student with T^2 and z-loss; weight 0: the loss
    logged, no teacher term in the gradient), looped blocks; the tempered case at 0.4 also runs under
    tensor parallelism (test_triton_distillation.py::test_tensor_parallel_two_ranks)."""
    spec = _spec(name)
    logits, targets, normalizers = make_case(seed_of("jsd" + name), spec=spec)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
    result, grad = triton_loss(logits.to(DEVICE), _on(targets), normalizers, spec, max_block=16)
    errors = {"loss": rel_err(result.loss.cpu(), expected.loss), "grad": rel_err(grad.cpu(), expected_grad)}
    errors.update({child: rel_err(value.cpu(), expected.losses[child]) for child, value in result.losses.items()})
    print(f"{name} triton vs float64: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors


def test_chunked_head_triton_with_teacher_head_matches_float64() -> None:
    """The Triton phases through the chunked head (chunks of 12 tokens; the JSD pass runs per chunk)."""
    case = head_case("ce+jsd0.3", spec=_spec("ce+jsd0.3"))
    errors = errors_of(*run_head(case, "triton", 12, {"max_block": 16}), case)
    print("ce+jsd0.3 chunked triton: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) < FP32_TOL, errors


def test_use_triton_takes_mixed_jsd() -> None:
    """The refusal is gone: `use_triton: true` validates and null picks Triton on CUDA for a mixed beta."""
    losses = {"kd": {"type": "distillation", "kl": "jsd", "beta": 0.4}}
    assert LMHeadConfig(losses=losses, use_triton=True).use_triton is True
    config = LMHeadConfig(losses=losses)
    assert resolve_implementation(config.monolithic(), "cuda") in ("triton", "compiled")  # compiled without triton
    slot = DistillationConfig(kl="jsd", beta=0.4).to_child("kd").slot()
    assert slot.switches["jsd"] and slot.scalars["beta"] == 0.4


def _on(targets):  # noqa: ANN001, ANN202 - LossTargets on the kernel's device
    from dataclasses import replace

    return replace(targets, labels=targets.labels.to(DEVICE), teacher_logits=targets.teacher_logits.to(DEVICE))
