"""The fused kernel's interface as data: a new child touches only its own file and its registrations.

The toy child below lives in this file alone: a confidence-penalty cross entropy (Pereyra et al. 2017,
"Regularizing Neural Networks by Penalizing Confident Output Distributions": the cross entropy minus
beta times the entropy, the reverse-KL relative of label smoothing), `lse - x_y - beta * H` per token,
gradient `w/N ((p_j - [j = y]) + beta p_j (x_j - E_p[x]))`: the label form plus the entropy term, so it
needs no new per-element math. Its config and child (tail, reference, slot) are its "own file"; its
per-token @triton.jit function is registered in triton/terms.py's table from here. Without that
function the Triton path runs its torch tail between two launches; with it, the single fused launch.
Both agree with the float64 reference (losses, total, gradient; ~30% masked labels) and the compiled
path. docs/losses.md states the places a new child touches; a test below holds it to this file's count.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton
import triton.language as tl
from loss_cases import make_case, make_spec, reference_with_grad, rel_err, seed_of

from fastlm.losses.children.base import ChildConfig, KernelSlot, LossChild, ReferenceInputs, Tail, TailInputs
from fastlm.losses.compiled import compiled_loss
from fastlm.losses.spec import LossSpec, LossTargets, safe_inverse
from fastlm.losses.triton import kernel, terms, triton_loss
from fastlm.losses.triton.interface import interface, launch_constexprs, params_on
from fastlm.losses.triton.terms import store_row

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 1e-5
MAX_KERNEL_PARAMETERS = 30  # issue 39: was 73 (and `_store_terms` 47)
# What the toy child needed besides this file's definitions: for the Triton path nothing; for the single
# fused launch one @triton.jit function with its line in terms.TERMS. (Its REGISTRY line only names its
# `type:` for configs; the spec here holds the child object itself.)
PLACES_FOR_TRITON = 2  # its file, its REGISTRY line
PLACES_FOR_FUSED = 3  # and its per-token @triton.jit function (terms.py, with its TERMS line)


class ConfidencePenaltyConfig(ChildConfig):
    type: Literal["confidence_penalty"] = "confidence_penalty"
    beta: float = 0.3

    def to_child(self, name: str) -> ConfidencePenalty:
        return ConfidencePenalty(name, self.weight, self.beta)


@dataclass(frozen=True)
class ConfidencePenalty(LossChild):
    beta: float = 0.3

    kind = "confidence_penalty"

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        out.loss(self.name, -inputs.new_logp - self.beta * inputs.entropy, inputs.per_token)
        out.metric(self.name, "entropy", inputs.entropy, inputs.per_token)
        if self.weight != 0:
            c = inputs.mask.to(inputs.dtype) * (self.weight * inputs.per_token)
            out.add_label_form(c)
            out.prob -= c * self.beta * (inputs.lse - inputs.entropy)  # -beta c E_p[x]
            out.add_x_term(c * self.beta)

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        entropy = -(inputs.log_probs.exp() * inputs.log_probs).sum(-1)
        per_token = torch.where(inputs.mask, -inputs.new_logp - self.beta * entropy, 0.0)
        return per_token.sum() * safe_inverse(inputs.normalizers.tokens)

    def slot(self) -> KernelSlot:
        return KernelSlot(self.kind, ("loss", "entropy"), {"weight": self.weight, "beta": self.beta}, entropy=True,
                          x_term=self.beta > 0)


@triton.jit
def confidence_penalty_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio,
                             ref_gap, token_scale, prob, label, x, total, S: tl.constexpr):
    """The toy child's per-token code (terms.py's signature): the label form and the entropy term."""
    c = tl.load(params + S.weight) * token_scale
    beta = tl.load(params + S.beta)
    prob += c - c * beta * (lse - entropy)
    label += c
    x += c * beta
    if write:
        loss = (-new_logp - beta * entropy) * token_scale
        store_row(rows, S.loss_row, stride, loss)
        store_row(rows, S.entropy_row, stride, entropy * token_scale)
        total += tl.load(params + S.weight) * loss
    return prob, label, x, total


def _spec(kinds: str, **numbers: object) -> LossSpec:
    """The toy child (weight 0.7) after the children of `kinds` (loss_cases short names)."""
    others = make_spec(kinds, **numbers) if kinds else LossSpec(**numbers)
    return dataclasses.replace(others, children=(*others.children, ConfidencePenaltyConfig(weight=0.7).to_child("cp")))


def _forget_interfaces() -> None:
    """The per-spec caches of interface.py: registering a function in TERMS changes what a spec compiles to."""
    for cached in (interface, launch_constexprs, params_on):
        cached.cache_clear()


def _on(targets: LossTargets) -> LossTargets:
    return LossTargets(*(None if t is None else t.to(DEVICE) for t in dataclasses.astuple(targets)))


@pytest.mark.parametrize("registered", [False, True], ids=["torch tail", "fused"])
@pytest.mark.parametrize("kinds", ["", "z+grpo"])
def test_a_child_from_this_file_alone_matches_float64(monkeypatch: pytest.MonkeyPatch, registered: bool,
                                                      kinds: str) -> None:
    """compiled and Triton (one block, looped blocks with a tail) against float64: losses, total,
    gradient; metrics against the compiled path in float64. Unregistered, the Triton path runs the
    toy child's torch tail (two launches); registered, one fused launch."""
    if registered:
        monkeypatch.setitem(terms.TERMS, "confidence_penalty", confidence_penalty_terms)
    spec = _spec(kinds, softcap=3.0, logit_scale=1.3)
    _forget_interfaces()
    assert interface(spec).fused is registered
    logits, targets, normalizers = make_case(seed_of("toy" + kinds), tokens=24, vocab=37, spec=spec)
    assert (targets.labels == -100).any()
    expected, expected_grad = reference_with_grad(logits, targets, normalizers, spec, grad_scale=2.0)
    double = LossTargets(*(t.double() if t is not None and t.is_floating_point() else t
                           for t in dataclasses.astuple(targets)))
    metrics64 = compiled_loss(logits.double(), double, normalizers, spec)[0].metrics
    runs = {"compiled": compiled_loss(logits, targets, normalizers, spec, grad_scale=2.0)}
    for name, block in (("single", 64), ("looped", 16)):
        runs[f"triton {name}"] = triton_loss(logits.to(DEVICE), _on(targets), normalizers, spec, grad_scale=2.0,
                                             max_block=block)
    for path, (result, grad) in runs.items():
        errors = {child: rel_err(value.cpu(), expected.losses[child]) for child, value in result.losses.items()}
        errors["total"] = rel_err(result.loss.cpu(), expected.loss)
        errors["grad"] = rel_err(grad.cpu(), expected_grad)
        errors.update({key: rel_err(value.cpu(), metrics64[key]) for key, value in result.metrics.items()})
        print(f"toy{'+' + kinds if kinds else ''} ({'fused' if registered else 'torch tail'}) / {path}: "
              + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))
        assert set(result.losses) == set(expected.losses) and set(result.metrics) == set(metrics64)
        assert "cp/entropy" in result.metrics and torch.isfinite(grad).all()
        assert max(errors.values()) < FP32_TOL, (path, errors)
    _forget_interfaces()


def test_kernel_signature_stays_small() -> None:
    """The kernel's parameters (the children's numbers in one buffer, their rows and switches in
    constexpr slots) and its helpers', as docs/architecture.md's Counts line states them."""
    counts = {"lm_loss_kernel": len(kernel.lm_loss_kernel.arg_names),
              "slot functions": len(terms.grpo_terms.arg_names),
              "_store_common_terms": len(kernel._store_common_terms.arg_names)}
    print(counts)
    assert counts["lm_loss_kernel"] <= MAX_KERNEL_PARAMETERS
    assert all(len(function.arg_names) == counts["slot functions"] for function in terms.TERMS.values())
    line = next(line for line in (ROOT / "docs/architecture.md").read_text().splitlines() if line.startswith("Counts"))
    assert f"`lm_loss_kernel` {counts['lm_loss_kernel']} parameters" in line, line


def test_docs_state_the_places_a_new_child_touches() -> None:
    """docs/losses.md says how many places a new child touches; this file's toy child is the proof."""
    text = (ROOT / "docs/losses.md").read_text()
    found = re.search(r"touches exactly (\w+) places \((\w+) for the single fused launch\)", text)
    assert found, "docs/losses.md no longer states the count"
    words = {"two": 2, "three": 3, "four": 4}
    assert (words[found[1]], words[found[2]]) == (PLACES_FOR_TRITON, PLACES_FOR_FUSED)


def test_children_hold_no_kernel_code() -> None:
    """A child declares its slot as data: no child module imports Triton or the Triton backend."""
    for path in sorted((ROOT / "fastlm/losses/children").glob("*.py")):
        imports = [line for line in path.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))]
        assert not [line for line in imports if "triton" in line], path.name
