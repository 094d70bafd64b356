"""What a loss child is: its config, its per-token terms and gradient coefficients, its metrics, its kernel slot.

Every path iterates `spec.children` and asks each child, never branches on a kind:

- the torch tail (`coefficients.tail`, used by the compiled path and the tensor-parallel Triton
  path) calls `child.tail(inputs, out)`: the child adds its loss and metric sums and its gradient
  coefficients to `out`;
- the fused Triton launch reads `child.slot()`, its `KernelSlot`: data (its numbers, its term rows,
  its switches), which the Triton backend (losses/triton/interface.py) turns into the kernel's
  arguments; the child holds no kernel code and picks no backend. A child without a slot runs its
  `tail` on the Triton path too, between a stats and a grad launch;
- the reference (`reference.reference_loss`) calls `child.reference(inputs)`: plain autograd.

The gradient of every child with respect to the transformed logits x has the form

    prob_coeff_t * p_tj - label_coeff_t * [j == y_t] + teacher_coeff_t * (teacher term)_tj + x_coeff_t * p_tj * x_tj

so a child only adds per-token coefficients (weight, normaliser included); the gradient pass is
loss-agnostic (docs/design/losses.md, "Superposition").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from pydantic import Field

from fastlm.config.base import ConfigModel
from fastlm.losses.frozen_model import FrozenModel
from fastlm.losses.metrics import Sums
from fastlm.losses.tensors import LossNormalizers, LossTargets, safe_inverse


class ChildConfig(ConfigModel):
    """Common to every child: weight 0 keeps the metrics and writes no gradient."""

    weight: float = Field(1.0, ge=0.0, description="Multiplier of this child's loss; 0 = metrics only.")

    @property
    def triton_supported(self) -> bool:
        """Whether the fused Triton kernel runs this child with these options (its type is in the kernel)."""
        return True

    def frozen_model(self) -> FrozenModel | None:
        """The frozen model this child needs beside the trained one (a teacher, a reference), if any."""
        return None

    def to_child(self, name: str) -> LossChild:
        """The plain object the loss paths run (no pydantic past this point)."""
        raise NotImplementedError


@dataclass
class TailInputs:
    """Global (all-reduced under tensor parallelism) per-token statistics after the vocab pass, plus the
    targets. Every vector a child reads is in `dtype` and 0 on masked tokens (whatever the caller had
    there, NaN included), masked once per call on first use."""

    mask: torch.Tensor  # (T,) bool, True where the label is not the ignore index
    stats: dict[str, torch.Tensor]  # lse, new_logp, entropy[, teacher_kl, teacher_gap]: raw (T,) vectors
    targets: LossTargets
    normalizers: LossNormalizers
    dtype: torch.dtype
    _masked: dict[str, torch.Tensor] = field(default_factory=dict)

    def _get(self, name: str, values: torch.Tensor) -> torch.Tensor:
        if name not in self._masked:
            self._masked[name] = masked(values, self.mask, self.dtype)
        return self._masked[name]

    @property
    def per_token(self) -> float:
        return safe_inverse(self.normalizers.tokens)

    @property
    def lse(self) -> torch.Tensor:  # log sum_j exp(x_tj)
        return self._get("lse", self.stats["lse"])

    @property
    def new_logp(self) -> torch.Tensor:  # x_{t,y} - lse_t
        return self._get("new_logp", self.stats["new_logp"])

    @property
    def entropy(self) -> torch.Tensor:  # lse_t - sum_j p_tj x_tj
        return self._get("entropy", self.stats["entropy"])

    def stat(self, name: str) -> torch.Tensor:
        """Another vocab-pass statistic (teacher_kl, teacher_gap)."""
        return self._get(name, self.stats[name])

    def target(self, name: str) -> torch.Tensor:
        """A per-token target (old_logp, advantages, ref_logp)."""
        return self._get(name, getattr(self.targets, name))


@dataclass
class Tail:
    """What children add to: coefficients of the gradient form above (T,), and the additive sums."""

    prob: torch.Tensor
    label: torch.Tensor
    teacher: torch.Tensor | None = None  # distillation's k_t (the teacher term is child-defined, see distillation.py)
    x: torch.Tensor | None = None  # entropy bonus e_t of p_j * x_j
    sums: Sums = field(default_factory=Sums)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_label_form(self, coefficient: torch.Tensor) -> None:
        """c_t * (p_j - [j == y_t]): the gradient of any loss of the label's log-prob alone."""
        self.prob += coefficient
        self.label += coefficient

    def add_x_term(self, coefficient: torch.Tensor) -> None:
        self.x = coefficient if self.x is None else self.x + coefficient

    def loss(self, name: str, values: torch.Tensor, scale: float = 1.0) -> None:
        """The child's loss as the sum of `values` (already normalised per token, or scaled by `scale`)."""
        self.sums.add(self.losses, name, values, scale)

    def metric(self, child: str, name: str, values: torch.Tensor, scale: float) -> None:
        self.sums.add(self.metrics, metric_key(child, name), values, scale)


@dataclass
class ReferenceInputs:
    """What the float64 reference hands every child: autograd-connected tensors, no fused tricks."""

    x: torch.Tensor  # (T, V) transformed logits
    log_probs: torch.Tensor  # (T, V) log_softmax(x)
    new_logp: torch.Tensor  # (T,) label log-prob, 0 on masked tokens
    mask: torch.Tensor
    targets: LossTargets
    normalizers: LossNormalizers


@dataclass(frozen=True)
class KernelSlot:
    """A child's place in the fused Triton kernel, as data; the Triton backend (losses/triton/interface.py)
    turns the slots of a spec into the kernel's arguments.

    - `kind`: which per-token code of the backend serves it (losses/triton/terms.py `TERMS`; a
      per-document child's seam, triton/documents.py `SEAMS`);
    - `rows`: its rows of the kernel's (K, T) term buffer in order: "loss" is its loss, any other name
      a metric ("<child>/<name>" in the result);
    - `scalars`: its numbers, in one fp32 buffer the kernel reads once per row;
    - `switches`: its compile-time options (a switched-off option compiles to nothing);
    - `reads`: the per-token targets the kernel loads for it (old_logp, advantages, ref_logp);
    - `token_weights`: it reads its per-token weights w_t (`LossChild.call_weights`), not 1/N;
    - `entropy_weights`: it reads its entropy bonus's own per-token weights v_t (a policy child's
      `call_entropy_weights`), not w_t;
    - `entropy`: it reads the entropy (the vocab pass then keeps the moment sum);
    - `x_term`: its gradient has the `p_j * x_j` term (the entropy bonus).
    """

    kind: str
    rows: tuple[str, ...]
    scalars: dict[str, float] = field(default_factory=dict)
    switches: dict[str, bool] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    token_weights: bool = False
    entropy_weights: bool = False
    entropy: bool = False
    x_term: bool = False


@dataclass(frozen=True)
class LossChild:
    """Base of the plain child objects. Subclasses set `kind` (the config `type:`) and override what they compute."""

    name: str
    weight: float

    kind: ClassVar[str] = ""
    reads: ClassVar[tuple[str, ...]] = ()  # LossTargets fields besides labels (validation checks them)
    uses_teacher: ClassVar[bool] = False  # reads teacher logits in the vocab pass
    per_document: ClassVar[bool] = False  # needs every token's log-prob before its coefficients (seam)

    @property
    def whole_call(self) -> bool:
        """Whether its coefficients need every token's statistics of the call first (a chunked head's two passes)."""
        return self.per_document

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        raise NotImplementedError

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        """This call's unweighted share of the step-wide loss, by plain autograd."""
        raise NotImplementedError

    def slot(self) -> KernelSlot | None:
        """Its slot of the fused Triton kernel; None where the kernel has none for it (or for these
        options): the Triton path then runs its `tail` between a stats and a grad launch."""
        return None

    def call_weights(self, targets: LossTargets, normalizers: LossNormalizers, dtype: torch.dtype = torch.float32,
                     slot: torch.Tensor | None = None) -> torch.Tensor | None:
        """Its per-token aggregation weights w_t of this call, or None where every token weighs 1/N."""
        return None

    def prepare(self, targets: LossTargets, normalizers: LossNormalizers, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Per-token tensors (in `dtype`) that depend on the whole call rather than on one token (e.g. a
        weight from its document's token count): a chunked head computes them once, before slicing the
        call, and hands them to every chunk in `targets.prepared` under "<child>/<name>". None by default."""
        return {}

    def prepared(self, targets: LossTargets, name: str) -> torch.Tensor | None:
        """This child's `prepare`d tensor `name`, when the caller (a chunked head) computed it."""
        return None if targets.prepared is None else targets.prepared.get(f"{self.name}/{name}")

    def check_targets(self, targets: LossTargets, tokens: int) -> None:
        """Host-only checks (presence, shape, dtype) of the targets this child reads besides the labels."""

    def check_normalizers(self, normalizers: LossNormalizers) -> None:
        """Raise when a step-wide count this child divides by is 0 while tokens are unmasked."""


def metric_key(child: str, metric: str) -> str:
    return f"{child}/{metric}"


def masked(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` in `dtype`, 0 on masked tokens (whatever was there, NaN included); a Python 0 is no
    extra device tensor (a fill launch on CUDA)."""
    return torch.where(mask, values.to(dtype), 0.0)

