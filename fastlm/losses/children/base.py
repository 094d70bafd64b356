"""What a loss child is: its config, its per-token terms and gradient coefficients, its metrics, its kernel slot.

Every path iterates `spec.children` and asks each child, never branches on a kind:

- the torch tail (`coefficients.tail`, used by the compiled path and the tensor-parallel Triton
  path) calls `child.tail(inputs, out)`: the child adds its loss and metric sums and its gradient
  coefficients to `out`;
- the fused Triton launch asks `child.kernel_arguments(row)` for its constexpr slot (`ROW_<KIND>`,
  the first row of its terms in the (K, T) buffer) and its numbers, `child.kernel_tensors(...)` for
  per-call tensors; `kernel_absent()` gives the
  values of an absent child; `fused_keys()` names the rows the kernel writes for it; a per-document
  child (GSPO) runs its tail as `kernel_seam` on that buffer before the grad launch;
- the reference (`reference.reference_loss`) calls `child.reference(inputs)`: plain autograd.

The gradient of every child with respect to the transformed logits x has the form

    prob_coeff_t * p_tj - label_coeff_t * [j == y_t] + teacher_coeff_t * (teacher term)_tj + x_coeff_t * p_tj * x_tj

so a child only adds per-token coefficients (weight, normaliser included); the gradient pass is
loss-agnostic (docs/design/losses.md, "Superposition").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field

from fastlm.config.base import ConfigModel
from fastlm.losses.metrics import Sums
from fastlm.losses.spec import LossNormalizers, LossTargets, safe_inverse

if TYPE_CHECKING:
    from fastlm.losses.coefficients import FusedLayout


class ChildConfig(ConfigModel):
    """Common to every child: weight 0 keeps the metrics and writes no gradient."""

    weight: float = Field(1.0, ge=0.0, description="Multiplier of this child's loss; 0 = metrics only.")

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
class LossChild:
    """Base of the plain child objects. Subclasses set `kind` (the config `type:`) and override what they compute."""

    name: str
    weight: float

    kind: ClassVar[str] = ""
    reads: ClassVar[tuple[str, ...]] = ()  # LossTargets fields besides labels (validation checks them)
    uses_teacher: ClassVar[bool] = False  # reads teacher logits in the vocab pass
    per_document: ClassVar[bool] = False  # needs every token's log-prob before its coefficients (seam)
    kernel: ClassVar[bool] = True  # the fused Triton kernel has a slot for it

    @property
    def torch_tail(self) -> bool:
        """Whether its options are past the fused kernel's slot: the Triton path then runs its `tail` between a
        stats launch and a grad launch (as under tensor parallelism)."""
        return False

    @property
    def whole_call(self) -> bool:
        """Whether its coefficients need every token's statistics of the call first (a chunked head's two passes)."""
        return self.per_document

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        raise NotImplementedError

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        """This call's unweighted share of the step-wide loss, by plain autograd."""
        raise NotImplementedError

    def fused_keys(self) -> tuple[tuple[bool, str], ...]:
        """(is a loss, result key) of each (K, T) row the fused kernel writes for this child, in kernel order."""
        return ()

    def kernel_arguments(self, row: int) -> dict[str, Any]:
        """This child's slot of the fused kernel: `ROW_<KIND>` (its first term row), its numbers and
        constexprs (the same every call of a spec: the launcher caches them)."""
        return {}

    def kernel_tensors(self, targets: LossTargets, normalizers: LossNormalizers) -> dict[str, Any]:
        """Per-call tensors of this child's slot (e.g. per-token weights); none by default."""
        return {}

    def grad_stats(self) -> tuple[str, ...]:
        """Per-token vocab-pass statistics (TailInputs.stats keys) the kernel's gradient launch reads
        for this child besides lse (the teacher's pointers kd0, kd1, ... in order); none by default."""
        return ()

    def kernel_x_term(self) -> bool:
        """Whether the fused kernel's coefficients of this child include a `p_j * x_j` term."""
        return False

    @classmethod
    def kernel_absent(cls) -> dict[str, Any]:
        """The kernel arguments of this child when it is absent (slot -1, neutral numbers)."""
        return {}

    def kernel_seam(self, terms: torch.Tensor, layout: FusedLayout, targets: LossTargets,
                    normalizers: LossNormalizers) -> None:
        """A per-document child's tail on the fused Triton path, between the fused launch (no gradient)
        and the grad launch: fill its `fused_keys` rows the fused launch leaves to it and add its
        coefficients to the state rows of `terms` (`layout`), sync-free."""
        raise NotImplementedError(f"{self.kind} has no Triton seam")

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

