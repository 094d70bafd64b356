"""Shared builders for the loss tests: seeded random inputs with masking, specs by short names,
and the float64-reference comparison every fast path goes through."""

from __future__ import annotations

import zlib

import torch

from fastlm.losses.children import CISPO, GRPO, GSPO, CrossEntropy, Distillation, ZLoss
from fastlm.losses.children.base import LossChild
from fastlm.losses.children.policy import reference_documents
from fastlm.losses.reference import reference_loss
from fastlm.losses.spec import IGNORE_INDEX, LossNormalizers, LossResult, LossSpec, LossTargets, label_logp

# Short names of the test children; a name's options (after ':' in make_spec) override these.
CHILDREN = {
    "ce": lambda w, **o: CrossEntropy("ce", w),
    "z": lambda w, **o: ZLoss("z", w),
    "grpo": lambda w, **o: GRPO("grpo", w, **{"eps_low": 0.2, "eps_high": 0.25, **o}),
    "gspo": lambda w, **o: GSPO("gspo", w, **{"eps_low": 0.05, "eps_high": 0.08, **o}),
    "gspo_len": lambda w, **o: GSPO("gspo", w, **{"eps_low": 0.05, "eps_high": 0.08, "loss_type": "dapo", **o}),
    "cispo": lambda w, **o: CISPO("cispo", w, **{"eps_high": 1.3, **o}),
    "kd": lambda w, **o: Distillation("kd", w, **{"temperature": 1.7, **o}),
    "kd_rev": lambda w, **o: Distillation("kd", w, **{"temperature": 1.7, "reverse": True, **o}),
    "kd_both": lambda w, **o: Distillation("kd", w, **{"temperature": 1.7, "tempered_student": True, **o}),
    "kd_rev_both": lambda w, **o: Distillation("kd", w, **{"temperature": 1.7, "reverse": True, "tempered_student": True, **o}),
    "kd_jsd_both": lambda w, **o: Distillation("kd", w, **{"temperature": 1.7, "jsd_beta": 0.4, "tempered_student": True, **o}),
}


def make_spec(
    kinds: str, weights: dict[str, float] | None = None, options: dict[str, dict] | None = None, **numbers: object
) -> LossSpec:
    """kinds: '+'-joined short names (CHILDREN); `options` per short name override the child's fields."""
    weights, options = weights or {}, options or {}
    children: list[LossChild] = []
    for kind in kinds.split("+"):
        if kind not in CHILDREN:
            raise ValueError(kind)
        children.append(CHILDREN[kind](weights.get(kind, {"z": 0.1}.get(kind, 1.0)), **options.get(kind, {})))
    return LossSpec(tuple(children), **numbers)


def random_documents(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Runs of 1..6 tokens with large, unsorted ids; the first id reappears on the last two tokens
    (another document: a document is a run of equal ids, `policy.document_slots`)."""
    ids = torch.empty(tokens, dtype=torch.int64)
    start, pool = 0, torch.randperm(10 * tokens, generator=generator) + 7
    run = 0
    while start < tokens:
        length = int(torch.randint(1, 7, (), generator=generator))
        ids[start : start + length] = pool[run]
        start, run = start + length, run + 1
    ids[-2:] = ids[0]
    return ids


def seed_of(text: str) -> int:
    """A seed stable across processes (str hash is salted per process)."""
    return zlib.crc32(text.encode()) % 10_000


def make_case(
    seed: int,
    tokens: int = 24,
    vocab: int = 37,
    dtype: torch.dtype = torch.float32,
    masked: float = 0.3,
    spec: LossSpec | None = None,
) -> tuple[torch.Tensor, LossTargets, LossNormalizers]:
    """Random logits (never zero), ~`masked` labels at -100, policy inputs near the current policy."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=generator, dtype=torch.float64) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[torch.rand(tokens, generator=generator) < masked] = IGNORE_INDEX
    document_ids = random_documents(tokens, generator)
    new_logp = label_logp(logits.double(), labels, spec.logit_scale if spec else 1.0, spec.softcap if spec else None)
    old_logp = (new_logp + 0.3 * torch.randn(tokens, generator=generator, dtype=torch.float64)).float()
    old_logp[labels == IGNORE_INDEX] = float("nan")  # masked tokens must never be read
    per_document = torch.randn(int(document_ids.max()) + 1, generator=generator)
    per_document_advantages = spec is not None and spec.per_document
    advantages = per_document[document_ids] if per_document_advantages else torch.randn(tokens, generator=generator)
    teacher = torch.randn(tokens, vocab, generator=generator, dtype=torch.float64).to(dtype) * 1.5
    ref_logp = (new_logp + 0.3 * torch.randn(tokens, generator=generator, dtype=torch.float64)).float()
    ref_logp[labels == IGNORE_INDEX] = float("nan")
    targets = LossTargets(labels, old_logp, advantages, document_ids, teacher, ref_logp=ref_logp)
    mask = labels != IGNORE_INDEX
    normalizers = LossNormalizers(float(mask.sum()), float(len(reference_documents(document_ids, mask))))
    return logits, targets, normalizers


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - b|| / ||b||. For a scalar the denominator is floored at 1 (the scale of a per-token loss
    term): policy losses are means of O(1) terms of both signs and can cancel to ~1e-3, where fp32
    rounding of the terms alone is ~1e-7 absolute. Tensors are floored at 1e-12 (zero reference)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    floor = 1.0 if expected.ndim == 0 else 1e-12
    return float((actual - expected).norm() / expected.norm().clamp(min=floor))


def reference_with_grad(
    logits: torch.Tensor, targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, grad_scale: float = 1.0
) -> tuple[LossResult, torch.Tensor]:
    """float64 reference result and d(grad_scale * loss)/d(logits) by autograd."""
    leaf = logits.detach().double().requires_grad_(True)
    double_targets = LossTargets(
        targets.labels,
        None if targets.old_logp is None else targets.old_logp.double(),
        None if targets.advantages is None else targets.advantages.double(),
        targets.document_ids,
        None if targets.teacher_logits is None else targets.teacher_logits.double(),
        ref_logp=None if targets.ref_logp is None else targets.ref_logp.double(),
    )
    result = reference_loss(leaf, double_targets, normalizers, spec)
    (result.loss * grad_scale).backward()
    return result, leaf.grad


def compare(
    name: str,
    result: LossResult,
    grad: torch.Tensor,
    expected: LossResult,
    expected_grad: torch.Tensor,
    tolerance: float,
) -> None:
    """Assert every child's loss, the total and the gradient agree; print the relative errors."""
    errors = {child: rel_err(value, expected.losses[child]) for child, value in result.losses.items()}
    errors["total"] = rel_err(result.loss, expected.loss)
    errors["grad"] = rel_err(grad, expected_grad)
    print(f"{name}: " + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert set(result.losses) == set(expected.losses)
    assert torch.isfinite(grad).all()
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    assert not bad, f"{name}: relative errors above {tolerance}: {bad}"
