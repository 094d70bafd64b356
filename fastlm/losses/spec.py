"""Plain-number description of a monolithic loss, plus the tensors it reads.

Config objects stop here: `LossSpec.from_config` is the one place that turns a validated
`MonolithicLossConfig` into floats and flags, shared by the compiled and Triton paths. Kernels and
launchers take a `LossSpec` and tensors, never a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastlm.losses.config import MonolithicLossConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ClippedPolicySpec:
    name: str
    weight: float
    eps_low: float
    eps_high: float


@dataclass(frozen=True)
class GSPOSpec(ClippedPolicySpec):
    length_proportional: bool = False


@dataclass(frozen=True)
class DistillationSpec:
    name: str
    weight: float
    temperature: float
    reverse: bool


@dataclass(frozen=True)
class WeightedSpec:
    name: str
    weight: float


@dataclass(frozen=True)
class LossSpec:
    """Which children run, with their numbers. `None` means the child is absent."""

    cross_entropy: WeightedSpec | None = None
    z_loss: WeightedSpec | None = None
    grpo: ClippedPolicySpec | None = None
    gspo: GSPOSpec | None = None
    distillation: DistillationSpec | None = None
    logit_scale: float = 1.0
    softcap: float | None = None
    chunk_tokens: int = 4096

    @classmethod
    def from_config(cls, config: MonolithicLossConfig) -> "LossSpec":
        parts: dict[str, object] = {}
        for name, child in config.children.items():
            if child.type in ("cross_entropy", "z_loss"):
                parts[child.type] = WeightedSpec(name, child.weight)
            elif child.type == "grpo":
                parts["grpo"] = ClippedPolicySpec(name, child.weight, child.eps_low, child.eps_high)
            elif child.type == "gspo":
                parts["gspo"] = GSPOSpec(
                    name, child.weight, child.eps_low, child.eps_high, child.normalization == "length_proportional"
                )
            elif child.type == "distillation":
                parts["distillation"] = DistillationSpec(name, child.weight, child.temperature, child.kl == "reverse")
        return cls(
            **parts, logit_scale=config.logit_scale, softcap=config.softcap, chunk_tokens=config.chunk_tokens
        )

    @property
    def children(self) -> tuple[WeightedSpec | ClippedPolicySpec | DistillationSpec, ...]:
        """Present children in a fixed order (CE, z, GRPO, GSPO, distillation)."""
        found = (self.cross_entropy, self.z_loss, self.grpo, self.gspo, self.distillation)
        return tuple(child for child in found if child is not None)

    @property
    def needs_policy_inputs(self) -> bool:
        return self.grpo is not None or self.gspo is not None


@dataclass
class LossTargets:
    """Per-token tensors, flattened to (tokens,): what the children read besides the logits."""

    labels: torch.Tensor  # int64, IGNORE_INDEX (-100) masks a token
    old_logp: torch.Tensor | None = None  # GRPO/GSPO: log-prob of the label under the sampling policy
    advantages: torch.Tensor | None = None  # GRPO/GSPO: per token (GSPO: constant within a document)
    document_ids: torch.Tensor | None = None  # GSPO: int64, tokens of one document share an id
    teacher_logits: torch.Tensor | None = None  # distillation: (tokens, vocab), any float dtype
    # DPO: (sequences,) summed log-probs under the frozen reference; sequences are document_ids in
    # sorted order, and sequence 2k / 2k+1 are the chosen / rejected answer of pair k
    reference_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class LossNormalizers:
    """Counts over the whole optimizer step (every micro-batch and data-parallel rank).

    Dividing by step-wide counts makes gradient accumulation and data parallelism give exactly the
    gradient of one big batch.
    """

    tokens: float  # unmasked labels
    documents: float = 1.0  # GSPO documents (with at least one unmasked token)


@dataclass
class LossResult:
    """`loss` is the weighted sum (differentiable). `losses` and `metrics` are detached and additive:
    each is this call's contribution to the step-wide mean, so micro-batches and ranks are summed."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)  # child name -> unweighted loss
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # "<child>/<metric>" -> value


def transform_logits(logits: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """x = s*z, or x = c*tanh(s*z/c) with a softcap: the logits every child (and the sampler) sees."""
    scaled = logits * logit_scale if logit_scale != 1.0 else logits
    if softcap is not None:
        scaled = softcap * torch.tanh(scaled / softcap)
    return scaled
