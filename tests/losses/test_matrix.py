"""The compiled-vs-Triton test matrix: every child and option in every path, against float64.

One table (`MATRIX`: the label-based mixes, distillation, GSPO, and the policy family's loss_type,
delta, beta, entropy_coeff and CISPO) drives the compiled path, the fused Triton kernel (single
block and looped blocks with a tail; the seam for per-document children) and, for some rows, both
under tensor parallelism: losses, total and gradient against the float64 reference (autograd),
metrics against the compiled path in float64, weight-0 children logging without gradient. Inputs from
loss_cases.make_case: ~30% masked labels (their old_logp / ref_logp are NaN, so a masked token that
is read shows up), several documents per row (runs of 1-6 tokens, one id split in two runs).
Without CUDA the kernel runs on Triton's interpreter (tests/conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.distributed as dist
from loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of

from fastlm.losses.compiled import compiled_loss
from fastlm.losses.spec import LossResult, LossSpec, LossTargets
from fastlm.losses.triton import triton_loss
from tests.distributed.dist_helpers import spawn_ranks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-5
# name: (kinds, child options, child weights, head numbers)
MATRIX = {
    "ce": ("ce", {}, {}, {}),
    "ce+z": ("ce+z", {}, {}, {}),
    "grpo+z scaled": ("grpo+z", {}, {}, {"logit_scale": 0.7}),
    "ce+z+grpo softcap": ("ce+z+grpo", {}, {"ce": 0.5}, {"logit_scale": 1.3, "softcap": 4.0}),
    "grpo+z w0": ("grpo+z", {}, {"grpo": 0.0}, {"logit_scale": 0.7}),
    "kd": ("kd", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "kd_rev": ("kd_rev", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "ce+kd": ("ce+kd", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "ce+z+kd_rev": ("ce+z+kd_rev", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "ce+z+grpo+kd": ("ce+z+grpo+kd", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "grpo+z+kd_rev": ("grpo+z+kd_rev", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "gspo": ("gspo", {}, {}, {}),
    "gspo dapo+z softcap": ("gspo_len+z", {}, {}, {"softcap": 3.0}),
    "ce+grpo+gspo": ("ce+grpo+gspo", {"gspo": {"eps_low": 0.2, "eps_high": 0.3}}, {}, {}),
    "grpo seq-mean+z": ("grpo+z", {"grpo": {"loss_type": "grpo"}}, {}, {}),
    "grpo bnpo+ce": ("ce+grpo", {"grpo": {"loss_type": "bnpo"}}, {}, {"logit_scale": 1.3}),
    "grpo dr_grpo": ("grpo", {"grpo": {"loss_type": "dr_grpo", "max_completion_length": 16}}, {}, {}),
    "grpo delta+z": ("grpo+z", {"grpo": {"delta": 1.3}}, {}, {"softcap": 4.0}),
    "grpo entropy": ("grpo", {"grpo": {"entropy_coeff": 0.05}}, {}, {"softcap": 3.0, "logit_scale": 0.8}),
    "grpo beta+z": ("grpo+z", {"grpo": {"beta": 0.1}}, {}, {}),
    "grpo all+ce+z+kd": ("ce+z+grpo+kd", {"grpo": {"loss_type": "grpo", "delta": 1.4, "entropy_coeff": 0.03,
                                                  "beta": 0.2}}, {}, {}),
    "cispo+z": ("cispo+z", {}, {}, {}),
    "cispo bnpo beta entropy": ("cispo", {"cispo": {"loss_type": "bnpo", "beta": 0.1, "entropy_coeff": 0.05}}, {}, {}),
    "gspo dapo delta entropy beta+z": ("gspo+z", {"gspo": {"loss_type": "dapo", "delta": 1.2, "entropy_coeff": 0.05,
                                                          "beta": 0.1}}, {}, {}),
    "gspo dr_grpo+kd_rev": ("gspo+kd_rev", {"gspo": {"loss_type": "dr_grpo", "max_completion_length": 12}}, {}, {}),
    "gspo bnpo beta entropy+ce": ("ce+gspo", {"gspo": {"loss_type": "bnpo", "beta": 0.1, "entropy_coeff": 0.05}}, {},
                                  {"logit_scale": 1.3}),
    "gspo w0 beta+z": ("gspo+z", {"gspo": {"beta": 0.1}}, {"gspo": 0.0}, {}),
    "grpo w0 entropy beta+ce": ("ce+grpo", {"grpo": {"entropy_coeff": 0.05, "beta": 0.1}}, {"grpo": 0.0}, {}),
    "cispo w0 entropy+ce": ("ce+cispo", {"cispo": {"entropy_coeff": 0.05}}, {"cispo": 0.0}, {}),
    # distillation temperature_mode both: the student tempered too (a second online softmax at x/T)
    "kd both": ("kd_both", {}, {}, {"softcap": 3.0, "logit_scale": 1.3}),
    "kd_rev both+ce+z": ("ce+z+kd_rev_both", {}, {}, {"logit_scale": 0.7}),
    "kd both T=0.6+ce+z+grpo": ("ce+z+grpo+kd_both", {"kd_both": {"temperature": 0.6}}, {}, {"softcap": 4.0}),
    "kd_rev both+gspo": ("gspo+kd_rev_both", {}, {}, {}),
    "kd both w0+ce+grpo entropy": ("ce+grpo+kd_both", {"grpo": {"entropy_coeff": 0.05}}, {"kd_both": 0.0}, {}),
    # TRL's GKD: both tempered, no T^2 (kd_scale none)
    "kd_rev gkd+ce": ("ce+kd_rev_both", {"kd_rev_both": {"t_squared": False}}, {}, {"softcap": 3.0}),
    # TRL's options: the entropy weighted like the loss (fused), or the token mean / a call-wide entropy
    # quantile / the bias-corrected KL (the torch tail between two Triton launches)
    "grpo seq-mean entropy by loss_type": ("grpo", {"grpo": {"loss_type": "grpo", "entropy_coeff": 0.05,
                                                             "entropy_token_mean": False}}, {}, {}),
    "grpo top-entropy bias-kl+z": ("grpo+z", {"grpo": {"loss_type": "grpo", "top_entropy_quantile": 0.4, "beta": 0.1,
                                                       "bias_corrected_kl": True, "entropy_coeff": 0.05}}, {}, {}),
    "cispo top-entropy bias-kl": ("cispo", {"cispo": {"top_entropy_quantile": 0.5, "beta": 0.1,
                                                      "bias_corrected_kl": True, "entropy_coeff": 0.03}}, {}, {}),
    "gspo top-entropy bias-kl": ("gspo", {"gspo": {"top_entropy_quantile": 0.6, "beta": 0.1, "bias_corrected_kl": True,
                                                   "entropy_coeff": 0.05}}, {}, {"logit_scale": 1.3}),
    # a step of 3 loss calls (micro_batches) and 2.5x this call's tokens: the token-mean entropy bonus
    # (each call's mean, averaged over the calls) is then a weight row apart from w_t in the fused kernel
    "dapo entropy beta accumulated": ("grpo+z", {"grpo": {"entropy_coeff": 0.05, "beta": 0.1}}, {}, {}),
    "grpo seq-mean entropy accumulated": ("grpo", {"grpo": {"loss_type": "grpo", "entropy_coeff": 0.05}}, {}, {}),
    "gspo entropy beta accumulated+z": ("gspo+z", {"gspo": {"loss_type": "dapo", "entropy_coeff": 0.05, "beta": 0.1}},
                                        {}, {}),  # GSPO's seam reads the row
}
BLOCKS = {"single": 64, "looped": 16}  # vocab 37: one block of 64, or three blocks of 16 with a tail


def _case(name: str) -> tuple[LossSpec, torch.Tensor, LossTargets, object]:
    kinds, options, weights, numbers = MATRIX[name]
    spec = make_spec(kinds, weights, options, **numbers)
    logits, targets, normalizers = make_case(seed_of("matrix" + name), tokens=24, vocab=37, spec=spec)
    if "accumulated" in name:
        normalizers = dataclasses.replace(normalizers, tokens=2.5 * normalizers.tokens,
                                          documents=2.0 * normalizers.documents, micro_batches=3.0)
    return spec, logits, targets, normalizers


def _on(targets: LossTargets, device: torch.device) -> LossTargets:
    return LossTargets(*(None if t is None else t.to(device) for t in dataclasses.astuple(targets)))


def _double(targets: LossTargets) -> LossTargets:
    return LossTargets(*(t.double() if t is not None and t.is_floating_point() else t for t in dataclasses.astuple(targets)))


def _errors(result: LossResult, grad: torch.Tensor, expected: LossResult, expected_grad: torch.Tensor,
            metrics64: dict[str, torch.Tensor]) -> dict[str, float]:
    errors = {child: rel_err(value.cpu(), expected.losses[child]) for child, value in result.losses.items()}
    errors["total"] = rel_err(result.loss.cpu(), expected.loss)
    errors["grad"] = rel_err(grad.cpu(), expected_grad)
    errors.update({key: rel_err(value.cpu(), metrics64[key].cpu()) for key, value in result.metrics.items()})
    assert set(result.losses) == set(expected.losses) and set(result.metrics) == set(metrics64)
    assert torch.isfinite(grad).all()
    return errors


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_path_matches_float64(name: str) -> None:
    """compiled, fused single block, fused looped: loss, each child, gradient, every metric; a weight-0
    child logs its loss and metrics and changes no gradient."""
    spec, logits, targets, normalizers = _case(name)
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=2.0)
    metrics64 = compiled_loss(logits.double(), _double(targets), normalizers, spec)[0].metrics
    runs = {"compiled": compiled_loss(logits, targets, normalizers, spec, grad_scale=2.0)}
    device_targets = _on(targets, DEVICE)
    for block, max_block in BLOCKS.items():
        runs[f"triton {block}"] = triton_loss(logits.to(DEVICE), device_targets, normalizers, spec, grad_scale=2.0,
                                              max_block=max_block)
    for path, (result, grad) in runs.items():
        errors = _errors(result, grad, expected, expected_grad, metrics64)
        print(f"{name} / {path}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
        assert max(errors.values()) < FP32_TOL, (path, errors)
    for child in spec.children:
        if child.weight == 0:  # metrics and loss logged, nothing in the gradient
            others = LossSpec(tuple(c for c in spec.children if c is not child), spec.logit_scale, spec.softcap)
            _, without = compiled_loss(logits, targets, normalizers, others, grad_scale=2.0)
            assert rel_err(runs["triton looped"][1].cpu(), without) < 1e-6
            assert float(expected.losses[child.name]) != 0.0
            token_metrics = getattr(child, "token_metric_names", tuple)()  # policy children's
            assert {f"{child.name}/{metric}" for metric in token_metrics} <= set(runs["triton single"][0].metrics)


def test_metric_names_follow_trl() -> None:
    """`kl` is k3 against the reference (only with beta); today's sampling-policy k3 is `kl_old`."""
    spec, logits, targets, normalizers = _case("grpo beta+z")
    metrics = compiled_loss(logits, targets, normalizers, spec)[0].metrics
    assert {"grpo/kl", "grpo/kl_old"} <= set(metrics) and float(metrics["grpo/kl"]) > 0
    mask = targets.labels != -100
    new_logp = torch.log_softmax(logits.double(), -1).gather(1, targets.labels.clamp(min=0)[:, None])[:, 0]
    gap = targets.ref_logp.double()[mask] - new_logp[mask]
    expected = (torch.exp(gap) - gap - 1).sum() / normalizers.tokens
    assert abs(float(metrics["grpo/kl"]) - float(expected)) < 1e-6
    plain = make_spec("grpo+z")
    assert "grpo/kl" not in compiled_loss(logits, targets, normalizers, plain)[0].metrics


def test_delta_caps_negative_advantage_tokens() -> None:
    """Dual clip: a token with A < 0 and r > delta has loss -delta*A and no gradient."""
    spec = make_spec("grpo", options={"grpo": {"delta": 1.3}})
    child = spec.children[0]
    logits, targets, normalizers = make_case(seed_of("delta"), tokens=64, vocab=37, spec=spec)
    mask = targets.labels != -100
    new_logp = torch.log_softmax(logits.double(), -1).gather(1, targets.labels.clamp(min=0)[:, None])[:, 0]
    capped = mask & (targets.advantages < 0) & (torch.exp(new_logp - targets.old_logp.double()) > child.delta)
    assert capped.any(), "the case should exercise the cap"
    keep = targets.labels.clone()
    keep[~capped] = -100
    only = dataclasses.replace(targets, labels=keep)
    result, grad = compiled_loss(logits, only, normalizers, spec)
    expected = -(child.delta * targets.advantages[capped].double()).sum() / normalizers.tokens
    assert abs(float(result.losses["grpo"]) - float(expected)) < 1e-5
    assert float(grad.abs().max()) == 0.0


TP_MATRIX = ["grpo all+ce+z+kd", "cispo bnpo beta entropy", "gspo dapo delta entropy beta+z", "kd_rev both+ce+z",
             "kd both T=0.6+ce+z+grpo", "grpo top-entropy bias-kl+z"]


def _tp_worker(rank: int, world: int, folder: str) -> None:
    """One rank of a vocab-parallel head (vocab 38: equal shards of 19): its shard of the logits and
    teacher logits, global labels; both implementations; saves its results."""
    saved = {}
    for name in TP_MATRIX:
        spec, logits, targets, normalizers = _tp_case(name)
        shard = logits.chunk(world, dim=1)[rank].contiguous()
        local = dataclasses.replace(targets, teacher_logits=targets.teacher_logits.chunk(world, dim=1)[rank].contiguous())
        result, grad = compiled_loss(shard, local, normalizers, spec, group=dist.group.WORLD)
        saved[name, "compiled"] = (result.loss, result.losses, result.metrics, grad)
        result, grad = triton_loss(shard.to(DEVICE), _on(local, DEVICE), normalizers, spec, group=dist.group.WORLD,
                                   max_block=16)
        saved[name, "triton"] = (result.loss.cpu(), {k: v.cpu() for k, v in result.losses.items()},
                                 {k: v.cpu() for k, v in result.metrics.items()}, grad.cpu())
    torch.save(saved, os.path.join(folder, f"rank{rank}.pt"))


def _tp_case(name: str):
    kinds, options, weights, numbers = MATRIX[name]
    spec = make_spec(kinds, weights, options, **numbers)
    logits, targets, normalizers = make_case(seed_of("tp" + name), tokens=20, vocab=38, spec=spec)
    return spec, logits, targets, normalizers


def test_tensor_parallel_two_ranks(tmp_path: os.PathLike) -> None:
    """gloo, world size 2, each rank 19 of 38 vocab ids (Triton: blocks of 16 and a tail), both paths."""
    world = 2
    spawn_ranks(_tp_worker, str(tmp_path), world=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name in TP_MATRIX:
        spec, logits, targets, normalizers = _tp_case(name)
        expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec)
        metrics64 = compiled_loss(logits.double(), _double(targets), normalizers, spec)[0].metrics
        for path in ("compiled", "triton"):
            grad = torch.cat([saved[name, path][3] for saved in ranks], dim=1)
            for rank, saved in enumerate(ranks):
                errors = _errors(LossResult(*saved[name, path][:3]), grad, expected, expected_grad, metrics64)
                print(f"TP {name} / {path} rank {rank}: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
                assert max(errors.values()) < FP32_TOL, errors
