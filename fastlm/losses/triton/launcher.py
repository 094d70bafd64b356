"""Launch the fused label-based loss kernel: argument assembly, the three modes, the TP all-reduce.

- no tensor parallelism, no GSPO: one fused forward+backward launch (coefficients in-kernel);
- tensor parallelism (`group`): stats launch, all-reduce of the mergeable pieces, coefficients in
  torch (`coefficients.label_children`), grad launch;
- GSPO: stats launch, then `label_children` (which runs the GSPO seam), then the grad launch.
Losses and metrics always come from `label_children`, so every path reports the same keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import triton

from fastlm.losses.coefficients import LabelChildren, TokenStats, label_children
from fastlm.losses.seam import safe_inverse
from fastlm.losses.spec import LossNormalizers, LossResult, LossSpec, LossTargets
from fastlm.losses.triton.kernel import MODE_FUSED, MODE_GRAD, MODE_STATS, lm_loss_kernel
from fastlm.losses.validation import ProcessGroup, validate_loss_inputs, vocab_shard

MAX_BLOCK = 32768


def _block_size(vocab: int, max_block: int) -> int:
    if max_block < 16 or max_block & (max_block - 1) or max_block > MAX_BLOCK:
        raise ValueError(f"max_block must be a power of two in [16, {MAX_BLOCK}], got {max_block}")
    return min(triton.next_power_of_2(vocab), max_block)


def _num_warps(block: int) -> int:
    """More warps for wider blocks, so each thread keeps a bounded slice of the row in registers."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check_supported(logits: torch.Tensor, targets: LossTargets, spec: LossSpec) -> None:
    """What this kernel cannot run, named; the shared checks live in validation.py."""
    if spec.distillation is not None:
        raise ValueError(
            f"the Triton loss kernel has no path for distillation child '{spec.distillation.name}'; "
            "use the compiled implementation (use_triton: null or false)"
        )
    if not spec.children:
        raise ValueError("the loss spec has no children; nothing for the Triton kernel to compute")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be float32, float16 or bfloat16 for the Triton kernel, got {logits.dtype}")
    for name, tensor in (("labels", targets.labels), ("old_logp", targets.old_logp), ("advantages", targets.advantages)):
        if tensor is not None and tensor.device != logits.device:
            raise ValueError(f"targets.{name} is on {tensor.device} but logits are on {logits.device}")
    if logits.ndim == 2 and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocab dim (stride 1), got strides {logits.stride()}")


class _Launch:
    """The arguments every launch shares for one call; `run` fills in the mode-specific ones."""

    def __init__(self, logits: torch.Tensor, labels: torch.Tensor, spec: LossSpec, vocab_start: int, max_block: int):
        self.logits = logits
        self.labels = labels
        self.spec = spec
        self.vocab_start = vocab_start
        self.block = _block_size(logits.shape[1], max_block)

    def vector(self) -> torch.Tensor:
        return torch.empty(self.logits.shape[0], dtype=torch.float32, device=self.logits.device)

    def run(
        self,
        mode: int,
        outputs: tuple[torch.Tensor, ...],
        grad: torch.Tensor | None,
        policy: tuple[torch.Tensor, torch.Tensor] | None = None,
        coeffs: tuple[float, float, float] = (0.0, 0.0, 0.0),
        grad_scale: float = 1.0,
    ) -> None:
        spec = self.spec
        out = outputs + (outputs[0],) * (4 - len(outputs))
        old_logp, advantages = policy if policy is not None else (out[0], out[0])
        policy_spec = spec.grpo
        lm_loss_kernel[(self.logits.shape[0],)](
            self.logits,
            self.logits.stride(0),
            grad if grad is not None else self.logits,
            grad.stride(0) if grad is not None else 0,
            self.labels,
            self.logits.shape[1],
            self.vocab_start,
            float(spec.logit_scale),
            float(spec.softcap) if spec.softcap is not None else 1.0,
            *out,
            old_logp,
            advantages,
            *coeffs,
            float(policy_spec.eps_low) if policy_spec is not None else 0.0,
            float(policy_spec.eps_high) if policy_spec is not None else 0.0,
            float(grad_scale),
            MODE=mode,
            HAS_CE=mode == MODE_FUSED.value and spec.cross_entropy is not None,
            HAS_Z=mode == MODE_FUSED.value and spec.z_loss is not None,
            HAS_GRPO=mode == MODE_FUSED.value and spec.grpo is not None,
            HAS_SOFTCAP=spec.softcap is not None,
            COMPUTE_GRAD=grad is not None,
            SINGLE_PASS=self.logits.shape[1] <= self.block,
            BLOCK=self.block,
            num_warps=_num_warps(self.block),
        )


def _fused(
    launch: _Launch,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    mask: torch.Tensor,
    grad: torch.Tensor | None,
    grad_scale: float,
) -> TokenStats:
    """One launch: stats, in-kernel CE/z/GRPO coefficients and the gradient."""
    lse, new_logp, entropy = launch.vector(), launch.vector(), launch.vector()
    per_token = safe_inverse(normalizers.tokens)
    coeffs = tuple(child.weight * per_token if child is not None else 0.0 for child in (spec.cross_entropy, spec.z_loss, spec.grpo))
    policy = None
    if spec.grpo is not None:
        policy = (targets.old_logp.float().contiguous(), targets.advantages.float().contiguous())
    launch.run(MODE_FUSED.value, (lse, new_logp, entropy), grad, policy, coeffs, grad_scale)
    return TokenStats(lse, new_logp, entropy, mask)


def _reduce_stats(launch: _Launch, mask: torch.Tensor, group: ProcessGroup | None) -> TokenStats:
    """Stats launch, then merge the shards' (max, sum-exp, label logit, shifted moment) over `group`."""
    maximum, sum_exp, label_logit, moment = (launch.vector() for _ in range(4))
    launch.run(MODE_STATS.value, (maximum, sum_exp, label_logit, moment), None)
    if group is not None:
        local_max = maximum.clone()
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shift = local_max - maximum
        rescale = torch.exp(shift)
        pieces = torch.stack([sum_exp * rescale, label_logit, rescale * (moment + shift * sum_exp)])
        dist.all_reduce(pieces, group=group)
        sum_exp, label_logit, moment = pieces.unbind(0)
    log_sum = torch.log(sum_exp)
    lse = maximum + log_sum
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    return TokenStats(
        torch.where(mask, lse, zero),
        torch.where(mask, label_logit - lse, zero),
        torch.where(mask, log_sum - moment / sum_exp, zero),
        mask,
    )


def _result(children: LabelChildren, spec: LossSpec) -> LossResult:
    """loss = sum of weight * unweighted child loss (detached; the autograd Function carries the gradient)."""
    loss = sum((child.weight * children.losses[child.name] for child in spec.children), children.prob_coeff.new_zeros(()))
    return LossResult(loss, children.losses, children.metrics)


def triton_loss(
    logits: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    *,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
    compute_grad: bool = True,
    inplace: bool = False,
    max_block: int = MAX_BLOCK,
) -> tuple[LossResult, torch.Tensor | None]:
    """The label-based monolithic loss and its gradient w.r.t. the raw logits (this rank's vocab shard
    under `group`). `inplace` overwrites `logits` with the gradient; `max_block` caps the vocab block."""
    _check_supported(logits, targets, spec)
    mask = validate_loss_inputs(logits, targets, normalizers, spec, group)
    vocab_start, _ = vocab_shard(logits, group)
    launch = _Launch(logits, targets.labels.contiguous(), spec, vocab_start, max_block)
    grad = None
    if compute_grad:
        grad = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
    if group is None and spec.gspo is None:
        stats = _fused(launch, targets, normalizers, spec, mask, grad, grad_scale)
        children = label_children(stats, targets, normalizers, spec)
    else:
        stats = _reduce_stats(launch, mask, group)
        children = label_children(stats, targets, normalizers, spec)
        if grad is not None:
            launch.run(MODE_GRAD.value, (stats.lse, children.prob_coeff.float(), children.label_coeff.float()), grad,
                       grad_scale=grad_scale)
    return _result(children, spec), grad
