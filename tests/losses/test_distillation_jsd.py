"""The generalized JSD of the distillation child (`kl: jsd`, 0 < beta < 1) on the compiled path and the
chunked head against the float64 reference (values and gradients, masked labels, several sub-chunks,
logit scale and softcap), and its refusal by the fused Triton kernel (the mixture needs a second vocab
pass). TRL's formula itself: test_trl_formulas.py::test_kl_jsd_is_trls_generalized_jsd."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fastlm.losses.children import DistillationConfig
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.config import LMHeadConfig
from fastlm.losses.dispatch import resolve_implementation
from tests.losses.loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of
from tests.losses.test_chunked_head import FP32_TOL, errors_of, head_case, run_head

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


def test_fused_triton_refuses_mixed_jsd_and_auto_picks_compiled() -> None:
    losses = {"kd": {"type": "distillation", "kl": "jsd", "beta": 0.4}}
    with pytest.raises(ValidationError, match=r"no path for the options of \['kd'\].*second vocab pass"):
        LMHeadConfig(losses=losses, use_triton=True)
    config = LMHeadConfig(losses=losses)
    assert resolve_implementation(config.monolithic(), "cuda") == "compiled"
    with pytest.raises(ValueError, match="no fused Triton path"):
        DistillationConfig(kl="jsd", beta=0.4).to_child("kd").slot()
    for beta in (0.0, 1.0):  # TRL's endpoints are the plain KLs, which the kernel runs
        endpoint = DistillationConfig(kl="jsd", beta=beta)
        assert endpoint.triton_supported and endpoint.to_child("kd").slot() is not None
