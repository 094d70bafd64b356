"""Distillation: KL between the tempered teacher q = softmax(t / T) and the student p = softmax(x).

`temperature_mode: both` tempers the student too, p_T = softmax(x / T), and scales the KL by `kd_scale`
s: `t_squared` (default) is Hinton et al. 2015 (arXiv:1503.02531, section 2: "multiply them by T^2",
so the gradient's scale does not change with T), `s = T^2`; `none` is TRL's GKD
(`GKDTrainer.generalized_jsd_loss` at beta 0 (forward) or 1 (reverse): the KL of the two tempered
softmaxes, token mean, unscaled), `s = 1`. Loss `s KL(q || p_T)`, gradient `(s/T) (p_T - q)` (forward;
reverse `(s/T) p_T ((x/T - u) - E_pT[x/T - u])`), the whole term per element (`tempered_student`).
Every path runs it: the vocab pass keeps a second online softmax of the student at x/T (its max is
max(x)/T, so one more sum-exp) next to the untempered one the label children and the metrics use.

Gradient with k_t = w/N on unmasked tokens (docs/design/losses.md):
- forward KL(q || p): d/dx_j = k*(p_j - q_j): `prob += k`, teacher term `-k*q_j`;
- reverse KL(p || q) = sum_j p_j l_j with l_j = log p_j - log q_j: d/dx_j = k*p_j*(l_j - KL)
  = k*p_j*((x_j - u_j) - E_p[x - u]) (the lse terms cancel): `prob -= k*E_p[x - u]`, teacher term
  `k*p_j*(x_j - u_j)`.
The vocab pass (compiled chunks or the kernel) computes the teacher's softmax and the KL per token;
this child turns them into its loss and coefficients.

`kl: jsd` with `beta` is TRL's generalized JSD (`GKDTrainer.generalized_jsd_loss`; Agarwal et al. 2023,
arXiv:2306.13649, eq. 1): M = beta*q + (1-beta)*p, loss beta*KL(q || M) + (1-beta)*KL(p || M); beta 0 is
the forward KL and beta 1 the reverse one (TRL's endpoints, run as `forward`/`reverse`). For 0 < beta < 1
(`jsd_beta`) d/dp_j of the loss is (1-beta) log(p_j/M_j), so d/dx_j = (1-beta) p_j (l_j - E_p[l]) with
l = log p - log M: the whole term per element (teacher coefficient k*(1-beta)/T_s). M needs both
normalised softmaxes, so every path adds a vocab pass once the log-partitions are known: the compiled
path per sub-chunk (`compiled._chunk_jsd`), the Triton path between its statistics and gradient launches
(`triton.kernel.jsd_sums_kernel`; the single fused launch has no room for a third pass over the row).

`top_k: k` takes the divergence over the teacher's k largest logits S only, both distributions renormalised
over S (NeMo RL's `DistillationLossFn` with `zero_outside_topk: false`): q_S = softmax(u_S), p_S =
softmax(x_S) (x/T with a tempered student), then the same forward / reverse / JSD formula on the k entries;
columns outside S get no gradient. It runs on the reference and compiled paths (a config error with
`use_triton: true`; under tensor parallelism, where no rank sees the whole row, a clear error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from fastlm.losses.children.base import ChildConfig, KernelSlot, LossChild, ReferenceInputs, Tail, TailInputs
from fastlm.losses.frozen_model import FrozenModel
from fastlm.losses.tensors import LossTargets, safe_inverse


class DistillationConfig(ChildConfig):
    type: Literal["distillation"] = "distillation"
    temperature: float = Field(1.0, gt=0.0)
    kl: Literal["forward", "reverse", "jsd"] = Field(
        "forward", description="forward: KL(teacher || student); reverse: KL(student || teacher); jsd: TRL's "
        "generalized JSD with beta (0 = forward, 1 = reverse, between: beta KL(T||M) + (1-beta) KL(S||M)).",
    )
    beta: float = Field(
        0.5, ge=0.0, le=1.0,
        description="kl: jsd: the mixture M = beta*teacher + (1-beta)*student (TRL GKDConfig.beta); 0.5 = JSD.",
    )
    temperature_mode: Literal["teacher", "both"] = Field(
        "teacher",
        description="teacher: only the teacher is divided by T; both: student and teacher (scaled by kd_scale).",
    )
    kd_scale: Literal["t_squared", "none"] = Field(
        "t_squared",
        description="temperature_mode both: t_squared multiplies the KL by T^2 (Hinton et al. 2015); none leaves it "
        "unscaled (TRL's GKD, generalized_jsd_loss at beta 0 or 1). temperature_mode teacher is never scaled.",
    )
    teacher_path: str | None = Field(
        None, description="Checkpoint directory of the frozen teacher; None means the batch brings teacher logits."
    )
    top_k: int | None = Field(
        None, ge=1,
        description="The divergence over the teacher's k largest logits only, teacher and student renormalised over "
        "them (NeMo RL's zero_outside_topk: false); None = the whole vocab. Compiled path only (not use_triton: true).",
    )

    @property
    def triton_supported(self) -> bool:
        """The fused kernel streams whole rows; a per-token top-k support is not in it (compiled path)."""
        return self.top_k is None

    def frozen_model(self) -> FrozenModel:
        return FrozenModel("teacher", "teacher_path", self.teacher_path)

    @property
    def mixed_jsd(self) -> bool:
        """kl: jsd strictly between its endpoints (beta 0 and 1 are the forward and reverse KL)."""
        return self.kl == "jsd" and 0.0 < self.beta < 1.0

    def to_child(self, name: str) -> Distillation:
        reverse = self.kl == "reverse" or (self.kl == "jsd" and self.beta == 1.0)
        return Distillation(name, self.weight, self.temperature, reverse, self.temperature_mode == "both",
                            self.kd_scale == "t_squared", self.beta if self.mixed_jsd else None, self.top_k)


@dataclass(frozen=True)
class Distillation(LossChild):
    temperature: float = 1.0
    reverse: bool = False
    tempered_student: bool = False  # temperature_mode both: p_T = softmax(x / T)
    t_squared: bool = True  # with a tempered student: loss T^2 KL (Hinton), else KL (GKD)
    jsd_beta: float | None = None  # generalized JSD's beta, strictly in (0, 1); None = a plain KL
    top_k: int | None = None  # the teacher's k largest logits as the support of both distributions; None = all

    @property
    def student_inv_temperature(self) -> float:
        """1/T when the student is tempered too, else 1 (then p_T = p)."""
        return 1.0 / self.temperature if self.tempered_student else 1.0

    @property
    def loss_scale(self) -> float:
        """T^2 with a tempered student and kd_scale t_squared (keeps the gradient's scale independent of T), else 1."""
        return self.temperature**2 if self.tempered_student and self.t_squared else 1.0

    def token_stats(
        self, student_lse: torch.Tensor, teacher_lse: torch.Tensor, cross: torch.Tensor, student_sum: torch.Tensor,
        teacher_sum: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The KL per token and its mean gap from a vocab pass's mergeable sums (compiled chunks, or the
        kernel's shards merged over tensor parallelism): `cross` = sum_j e_s,j (x_s,j - u_j) (reverse)
        or sum_j e_q,j (u_j - x_s,j) (forward), with e_s, e_q the unnormalised student and teacher
        softmax terms of sums `student_sum`, `teacher_sum` and log-partitions `student_lse`, `teacher_lse`."""
        if self.reverse:
            gap = cross / student_sum  # E_ps[x_s - u]
            return {"teacher_kl": gap - student_lse + teacher_lse, "teacher_gap": gap}
        gap = cross / teacher_sum  # E_q[u - x_s]
        return {"teacher_kl": gap - teacher_lse + student_lse, "teacher_gap": gap}

    kind = "distillation"
    reads = ("teacher_logits",)
    uses_teacher = True

    def tail(self, inputs: TailInputs, out: Tail) -> None:
        out.loss(self.name, inputs.stat("teacher_kl"), inputs.per_token * self.loss_scale)
        if self.weight == 0:
            return
        k = inputs.mask.to(inputs.dtype) * (self.weight * inputs.per_token)
        if self.top_k is not None:  # s/T_s * (d divergence / d(x_S / T_s)), scattered on S: the whole teacher term
            out.teacher = k * (self.loss_scale * self.student_inv_temperature)
            return
        if self.jsd_beta is not None:  # s (1-beta)/T_s * p_T,j (l_j - E[l]): all in the teacher term
            out.teacher = k * (self.loss_scale * (1.0 - self.jsd_beta) * self.student_inv_temperature)
            return
        if self.tempered_student:  # s * d KL_T / dx = (s / T) * (p_T - q) ...: all in the teacher term
            out.teacher = k * (self.loss_scale / self.temperature)
            return
        out.teacher = k
        out.prob += -k * inputs.stat("teacher_gap") if self.reverse else k

    def reference(self, inputs: ReferenceInputs) -> torch.Tensor:
        student = torch.log_softmax(inputs.x / self.temperature, dim=-1) if self.tempered_student else inputs.log_probs
        teacher = torch.log_softmax(inputs.targets.teacher_logits.to(student.dtype) / self.temperature, dim=-1)
        if self.top_k is not None:  # both renormalised over the teacher's top k
            support = teacher.topk(min(self.top_k, teacher.shape[-1]), dim=-1).indices
            student = torch.log_softmax(student.gather(-1, support), dim=-1)
            teacher = torch.log_softmax(teacher.gather(-1, support), dim=-1)
        if self.jsd_beta is not None:
            beta = self.jsd_beta
            mixture = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
            per_token = (beta * (teacher.exp() * (teacher - mixture)).sum(-1)
                         + (1 - beta) * (student.exp() * (student - mixture)).sum(-1))
        elif self.reverse:
            per_token = (student.exp() * (student - teacher)).sum(-1)
        else:
            per_token = (teacher.exp() * (teacher - student)).sum(-1)
        return (per_token * inputs.mask).sum() * safe_inverse(inputs.normalizers.tokens) * self.loss_scale

    def slot(self) -> KernelSlot:
        """The teacher's slot: its statistics and gradient term live in the kernel's vocab loop
        (`tempered`: the student at x/T there too)."""
        if self.top_k is not None:
            raise ValueError(f"distillation loss '{self.name}': top_k has no Triton path (the kernel streams whole "
                             "rows); set model.head.use_triton: false or null")
        scalars = {"weight": self.weight, "inv_temperature": 1.0 / self.temperature, "kd_scale": self.loss_scale}
        if self.jsd_beta is not None:
            scalars["beta"] = self.jsd_beta
        return KernelSlot(self.kind, ("loss",), scalars,
                          {"reverse": self.reverse, "tempered": self.student_inv_temperature != 1.0,
                           "jsd": self.jsd_beta is not None})

    def check_targets(self, targets: LossTargets, tokens: int) -> None:
        if targets.teacher_logits is None:
            raise ValueError(f"targets.teacher_logits is required by distillation loss '{self.name}' but is None")
