"""TRL's names mean TRL's behaviour: the policy options and GKD against TRL's formulas, written out by
hand in float64 from GRPOTrainer._compute_loss / get_high_entropy_mask and GKDTrainer.generalized_jsd_loss
(huggingface/trl 1.16), on a padded (B, T) batch. fastlm's float64 reference and its compiled path must give
the same loss and the same gradient, and the Triton path (fp32) too; test_matrix.py ties the Triton paths
to that reference on every option."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fastlm.losses.children import CISPO, GRPO, GSPO, Distillation
from fastlm.losses.children.base import LossChild
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.reference import reference_loss
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossSpec, LossTargets
from fastlm.losses.triton import triton_loss

B, T, V = 4, 7, 11
LENGTHS = [7, 3, 5, 1]  # completion tokens per row; the rest is padding


def _batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=generator, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (B, T), generator=generator)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = logp + 0.4 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    ref = logp + 0.4 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return {"logits": logits, "ids": ids, "mask": mask, "old": old, "ref": ref, "advantages": advantages}


def _trl_policy_loss(logits: torch.Tensor, batch: dict, loss_type: str, *, epsilon_low: float = 0.2,
                     epsilon_high: float = 0.28, beta: float = 0.0, use_bias_correction_kl: bool = False,
                     top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0, sequence: bool = False,
                     max_completion_length: int = T, num_items_in_batch: float | None = None,
                     accumulation: int = 1) -> torch.Tensor:
    """GRPOTrainer._compute_loss of one micro-batch, one process, no vLLM correction, as written in TRL 1.16:
    `accumulation` is current_gradient_accumulation_steps (= steps_per_generation), `num_items_in_batch`
    the window's completion tokens (default: this micro-batch's)."""
    mask, ids, advantages = batch["mask"], batch["ids"], batch["advantages"][:, None]
    log_probs = torch.log_softmax(logits, -1)
    per_token_logps = log_probs.gather(-1, ids[..., None])[..., 0]
    entropies = -(log_probs.exp() * log_probs).sum(-1)
    entropy_mask = None
    if top_entropy_quantile < 1.0:  # get_high_entropy_mask
        threshold = torch.quantile(entropies.detach()[mask.bool()], 1 - top_entropy_quantile)
        entropy_mask = ((entropies.detach() * mask) >= threshold) & mask.bool()
    log_ratio = per_token_logps - batch["old"]
    if sequence:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_importance_weights = log_ratio
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        ref = batch["ref"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / accumulation
    else:  # cispo, dapo: the window's tokens (x accumulation / steps_per_generation = 1)
        normalizer = (mask.sum() if num_items_in_batch is None else torch.tensor(num_items_in_batch)).clamp(min=1.0)
        loss = (per_token_loss * mask).sum() / normalizer
    if entropy_coef:  # every loss type: the mean over the effective mask, / the accumulation steps
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        loss = loss - entropy_coef * entropy_loss
    return loss


def _flat(batch: dict) -> tuple[LossTargets, LossNormalizers]:
    """The same batch as fastlm's flattened tokens: padding masked, one document per row."""
    mask = batch["mask"].bool()
    rows = mask.shape[0]
    labels = torch.where(mask, batch["ids"], IGNORE_INDEX).reshape(-1)
    nan = torch.full_like(batch["old"], float("nan"))  # padding must never be read
    targets = LossTargets(
        labels, torch.where(mask, batch["old"], nan).reshape(-1), batch["advantages"][:, None].expand(rows, T).reshape(-1),
        torch.arange(rows)[:, None].expand(rows, T).reshape(-1).clone(),
        ref_logp=torch.where(mask, batch["ref"], nan).reshape(-1))
    return targets, LossNormalizers(float(mask.sum()), float(rows))


def _fastlm(child: LossChild, batch: dict, rows: slice = slice(None), normalizers: LossNormalizers | None = None,
            ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(path, loss, d loss / d logits) of the float64 reference, the compiled path in float64 and the Triton
    path in fp32, on the batch's `rows` (one loss call) under `normalizers` (default: the call is the step)."""
    spec = LossSpec((child,))
    batch = {key: value[rows] for key, value in batch.items()}
    targets, call_normalizers = _flat(batch)
    normalizers = normalizers or call_normalizers
    tokens = batch["logits"].shape[0] * T
    logits = batch["logits"].reshape(tokens, V).clone().requires_grad_(True)
    result = reference_loss(logits, targets, normalizers, spec)
    result.loss.backward()
    compiled, grad = compiled_loss(batch["logits"].reshape(tokens, V), targets, normalizers, spec)
    single = LossTargets(*(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                           for t in dataclasses.astuple(targets)))
    fused, fused_grad = triton_loss(batch["logits"].reshape(tokens, V).float(), single, normalizers, spec)
    return [("reference", result.loss.detach(), logits.grad), ("compiled", compiled.loss, grad),
            ("triton", fused.loss.double(), fused_grad.double())]


TOLERANCE = {"reference": 1e-12, "compiled": 1e-12, "triton": 1e-5}  # the Triton path computes in fp32


def _check(name: str, child: LossChild, batch: dict, **trl: object) -> None:
    logits = batch["logits"].clone().requires_grad_(True)
    want = _trl_policy_loss(logits, batch, **trl)
    want.backward()
    _compare(name, _fastlm(child, batch), want, logits.grad)


def _compare(name: str, runs: list[tuple[str, torch.Tensor, torch.Tensor]], want: torch.Tensor,
             want_grad: torch.Tensor) -> None:
    for path, loss, grad in runs:
        loss_error = abs(float(loss) - float(want)) / max(abs(float(want)), 1e-12)
        grad_error = float((grad.reshape(want_grad.shape) - want_grad).norm() / want_grad.norm())
        print(f"{name} / {path} vs TRL: loss {loss_error:.1e}, grad {grad_error:.1e}")
        assert loss_error < TOLERANCE[path] and grad_error < TOLERANCE[path], (path, loss_error, grad_error)


CASES = {
    # cispo: eps_high is TRL's epsilon_high, the cap itself (1.2 here so that it binds)
    "cispo cap": (lambda: CISPO("p", 1.0, eps_high=1.2), {"loss_type": "cispo", "epsilon_high": 1.2}),
    # entropy_coeff: TRL's token mean (dapo: over the step's tokens; grpo: per micro-batch)
    "dapo entropy": (lambda: GRPO("p", 1.0, entropy_coeff=0.07, eps_high=0.28),
                     {"loss_type": "dapo", "entropy_coef": 0.07}),
    "grpo entropy": (lambda: GRPO("p", 1.0, loss_type="grpo", entropy_coeff=0.07, eps_high=0.28),
                     {"loss_type": "grpo", "entropy_coef": 0.07}),
    "dr_grpo entropy": (lambda: GRPO("p", 1.0, loss_type="dr_grpo", max_completion_length=T, entropy_coeff=0.07,
                                     eps_high=0.28), {"loss_type": "dr_grpo", "entropy_coef": 0.07}),
    # top_entropy_quantile: the policy term and the entropy bonus on the top share of tokens, the KL on all
    "grpo top entropy": (lambda: GRPO("p", 1.0, loss_type="grpo", top_entropy_quantile=0.4, beta=0.1,
                                      entropy_coeff=0.05, eps_high=0.28),
                         {"loss_type": "grpo", "top_entropy_quantile": 0.4, "beta": 0.1, "entropy_coef": 0.05}),
    "dapo top entropy": (lambda: GRPO("p", 1.0, top_entropy_quantile=0.5, entropy_coeff=0.05, eps_high=0.28),
                         {"loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.05}),
    "bnpo top entropy": (lambda: GRPO("p", 1.0, loss_type="bnpo", top_entropy_quantile=0.3, eps_high=0.28),
                         {"loss_type": "bnpo", "top_entropy_quantile": 0.3}),
    "cispo top entropy": (lambda: CISPO("p", 1.0, eps_high=1.2, top_entropy_quantile=0.5, entropy_coeff=0.05),
                          {"loss_type": "cispo", "epsilon_high": 1.2, "top_entropy_quantile": 0.5,
                           "entropy_coef": 0.05}),
    # use_bias_correction_kl: the k3 term times the (not detached) ratio
    "dapo bias-corrected kl": (lambda: GRPO("p", 1.0, beta=0.2, bias_corrected_kl=True, eps_high=0.28),
                               {"loss_type": "dapo", "beta": 0.2, "use_bias_correction_kl": True}),
    "cispo bias-corrected kl": (lambda: CISPO("p", 1.0, eps_high=1.2, beta=0.2, bias_corrected_kl=True),
                                {"loss_type": "cispo", "epsilon_high": 1.2, "beta": 0.2, "use_bias_correction_kl": True}),
    # GSPO = TRL's importance_sampling_level "sequence" (loss_type grpo, the paper's)
    "gspo bias-corrected kl top entropy": (
        lambda: GSPO("p", 1.0, eps_low=0.05, eps_high=0.08, beta=0.2, bias_corrected_kl=True, top_entropy_quantile=0.6,
                     entropy_coeff=0.05),
        {"loss_type": "grpo", "sequence": True, "epsilon_low": 0.05, "epsilon_high": 0.08, "beta": 0.2,
         "use_bias_correction_kl": True, "top_entropy_quantile": 0.6, "entropy_coef": 0.05}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_policy_options_match_trl(name: str) -> None:
    make, trl = CASES[name]
    _check(name, make(), _batch(11), **trl)


ACCUMULATED = {  # gradient accumulation over micro-batches of 10 and 6 completion tokens
    "dapo entropy": (lambda: GRPO("p", 1.0, entropy_coeff=0.07, eps_high=0.28),
                     {"loss_type": "dapo", "entropy_coef": 0.07}),
    "cispo top entropy": (lambda: CISPO("p", 1.0, eps_high=1.2, top_entropy_quantile=0.5, entropy_coeff=0.05),
                          {"loss_type": "cispo", "epsilon_high": 1.2, "top_entropy_quantile": 0.5,
                           "entropy_coef": 0.05}),
    "bnpo top entropy": (lambda: GRPO("p", 1.0, loss_type="bnpo", top_entropy_quantile=0.5, entropy_coeff=0.05,
                                      eps_high=0.28),
                         {"loss_type": "bnpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.05}),
}


@pytest.mark.parametrize("name", list(ACCUMULATED))
def test_entropy_bonus_matches_trl_under_accumulation(name: str) -> None:
    """Two micro-batches (rows 0-1: 10 tokens, rows 2-3: 6): TRL's per-micro-batch losses summed, against
    two fastlm calls with the step's normalizers summed: the bonus is each micro-batch's mean over its
    trained tokens divided by the accumulation steps (TRL 1.16), for dapo and cispo too."""
    make, trl = ACCUMULATED[name]
    batch, halves = _batch(11), (slice(0, 2), slice(2, 4))
    logits = batch["logits"].clone().requires_grad_(True)
    tokens = float(batch["mask"].sum())
    want = sum(_trl_policy_loss(logits[rows], {key: value[rows] for key, value in batch.items()}, **trl,
                                num_items_in_batch=tokens, accumulation=2) for rows in halves)
    want.backward()
    normalizers = LossNormalizers(tokens, float(B), micro_batches=2.0)
    calls = [_fastlm(make(), batch, rows, normalizers) for rows in halves]
    runs = [(first[0], first[1] + second[1], torch.cat([first[2], second[2]]))
            for first, second in zip(*calls, strict=True)]
    _compare(name, runs, want, logits.grad)


def test_cispo_cap_binds_and_its_metric_is_trls() -> None:
    batch = _batch(11)
    targets, normalizers = _flat(batch)
    result, _ = compiled_loss(batch["logits"].reshape(B * T, V), targets, normalizers,
                              LossSpec((CISPO("p", 1.0, eps_high=1.2),)))
    mask = batch["mask"].bool()
    logp = torch.log_softmax(batch["logits"], -1).gather(-1, batch["ids"][..., None])[..., 0]
    clipped = (torch.exp(logp - batch["old"]) > 1.2) & (batch["advantages"][:, None] > 0)
    assert clipped[mask].any()
    assert float(result.metrics["p/cispo_clip_ratio"]) == pytest.approx(float(clipped[mask].double().mean()), abs=1e-12)


def _trl_gkd(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, beta: float,
             temperature: float) -> torch.Tensor:
    """GKDTrainer.generalized_jsd_loss, reduction batchmean with labels, as written in TRL."""
    student_log_probs = torch.log_softmax(student / temperature, dim=-1)
    teacher_log_probs = torch.log_softmax(teacher / temperature, dim=-1)
    kl_div = torch.nn.functional.kl_div
    if beta == 0:
        jsd = kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta_t), teacher_log_probs + torch.log(beta_t)]), dim=0)
        kl_teacher = kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    keep = labels != -100
    return jsd[keep].sum() / keep.sum().clamp_min(1)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_kd_scale_none_is_trls_gkd_and_t_squared_hintons(reverse: bool) -> None:
    batch = _batch(5)
    generator = torch.Generator().manual_seed(6)
    teacher = torch.randn(B * T, V, generator=generator, dtype=torch.float64) * 2.0
    targets, normalizers = _flat(batch)
    targets = dataclasses.replace(targets, teacher_logits=teacher)
    temperature = 2.0
    student = batch["logits"].reshape(B * T, V).clone().requires_grad_(True)
    want = _trl_gkd(student, teacher, targets.labels, 1.0 if reverse else 0.0, temperature)
    want.backward()
    for t_squared, scale in ((False, 1.0), (True, temperature**2)):
        spec = LossSpec((Distillation("kd", 1.0, temperature, reverse, True, t_squared),))
        leaf = batch["logits"].reshape(B * T, V).clone().requires_grad_(True)
        result = reference_loss(leaf, targets, normalizers, spec)
        result.loss.backward()
        compiled, grad = compiled_loss(batch["logits"].reshape(B * T, V), targets, normalizers, spec)
        for path, loss, gradient in (("reference", result.loss, leaf.grad), ("compiled", compiled.loss, grad)):
            loss_error = abs(float(loss) / scale - float(want)) / float(want)
            grad_error = float((gradient / scale - student.grad).norm() / student.grad.norm())
            print(f"kd t_squared={t_squared} ({'reverse' if reverse else 'forward'}) / {path} vs TRL GKD x {scale:g}: "
                  f"loss {loss_error:.1e}, grad {grad_error:.1e}")
            assert loss_error < 1e-12 and grad_error < 1e-12


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_kl_jsd_is_trls_generalized_jsd(beta: float) -> None:
    """`kl: jsd` + `beta` (temperature_mode both, kd_scale none) is GKDTrainer.generalized_jsd_loss: its
    endpoints run as the forward / reverse KL, between them the mixture, on padded rows (masked labels)."""
    from fastlm.losses.children import DistillationConfig

    batch = _batch(8)
    teacher = torch.randn(B * T, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 2.0
    targets, normalizers = _flat(batch)
    targets = dataclasses.replace(targets, teacher_logits=teacher)
    temperature = 1.5
    student = batch["logits"].reshape(B * T, V).clone().requires_grad_(True)
    want = _trl_gkd(student, teacher, targets.labels, beta, temperature)
    want.backward()
    child = DistillationConfig(kl="jsd", beta=beta, temperature=temperature, temperature_mode="both",
                               kd_scale="none").to_child("kd")
    assert child.jsd_beta == (beta if 0 < beta < 1 else None) and child.reverse == (beta == 1.0)
    spec = LossSpec((child,))
    leaf = batch["logits"].reshape(B * T, V).clone().requires_grad_(True)
    result = reference_loss(leaf, targets, normalizers, spec)
    result.loss.backward()
    compiled, grad = compiled_loss(batch["logits"].reshape(B * T, V), targets, normalizers, spec)
    fp32 = dataclasses.replace(targets, teacher_logits=teacher.float())
    triton, triton_grad = triton_loss(batch["logits"].reshape(B * T, V).float(), fp32, normalizers, spec, max_block=16)
    for path, loss, gradient, tolerance in (("reference", result.loss, leaf.grad, 1e-12),
                                            ("compiled", compiled.loss, grad, 1e-12),
                                            ("triton fp32", triton.loss, triton_grad, 2e-6)):
        loss_error = abs(float(loss.detach()) - float(want)) / float(want)
        grad_error = float((gradient.double() - student.grad).norm() / student.grad.norm())
        print(f"jsd beta={beta} / {path} vs TRL generalized_jsd_loss: loss {loss_error:.1e}, grad {grad_error:.1e}")
        assert loss_error < tolerance and grad_error < tolerance


def test_config_names_reach_the_children() -> None:
    from fastlm.losses.children import CISPOConfig, DistillationConfig, GRPOConfig, GSPOConfig

    grpo = GRPOConfig(beta=0.1, use_bias_correction_kl=True, top_entropy_quantile=0.2, entropy_coeff=0.01,
                      entropy_aggregation="loss_type").to_child("g")
    assert (grpo.bias_corrected_kl, grpo.top_entropy_quantile, grpo.entropy_token_mean) == (True, 0.2, False)
    assert grpo.slot() is None and grpo.whole_call
    assert not GRPOConfig(loss_type="bnpo", entropy_coeff=0.01).to_child("g").slot().entropy_weights  # mean = w_t
    for loss_type in ("dapo", "grpo"):  # the token mean is a weight row of its own in the fused kernel
        assert GRPOConfig(loss_type=loss_type, entropy_coeff=0.01).to_child("g").slot().entropy_weights
    assert GSPOConfig(entropy_coeff=0.01).to_child("s").slot() is not None  # its seam reads the row
    assert GSPOConfig(top_entropy_quantile=0.5).to_child("s").whole_call
    assert CISPOConfig().to_child("c").eps_high == 5.0  # TRL's recommended epsilon_high, the cap
    with pytest.raises(ValueError, match="use_bias_correction_kl corrects the KL penalty"):
        GRPOConfig(use_bias_correction_kl=True)
    gkd = DistillationConfig(temperature=2.0, temperature_mode="both", kd_scale="none").to_child("kd")
    hinton = DistillationConfig(temperature=2.0, temperature_mode="both").to_child("kd")
    teacher_only = DistillationConfig(temperature=2.0, kd_scale="t_squared").to_child("kd")
    assert (gkd.loss_scale, hinton.loss_scale, teacher_only.loss_scale) == (1.0, 4.0, 1.0)
