"""The one Triton kernel of the label-based monolithic loss (CE, z-loss, GRPO; GSPO through load mode).

Every label-based child has a gradient of the form `prob_coeff * p_j - label_coeff * d_jy`, so one
loss-agnostic gradient loop serves them all (see shared/design/losses.md, "Superposition"). One
program handles one token row; math is fp32 whatever the logits dtype. Three constexpr modes share
the body:

- `MODE_FUSED`: online softmax stats, in-kernel coefficients (CE, z, GRPO), gradient; writes lse,
  new_logp and entropy per token.
- `MODE_STATS`: stats only, as mergeable pieces (max, sum-exp, label logit, shifted x-moment) so a
  vocab-parallel group can all-reduce them; writes the label logit only where the label is in shard.
- `MODE_GRAD`: loads lse and both coefficients per token (computed in torch) and writes the gradient.

Masked rows (label -100) branch around the work and write a zero gradient; no early return.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals a @triton.jit function reads must be constexpr; the launcher passes `.value`.
MODE_FUSED = tl.constexpr(0)
MODE_STATS = tl.constexpr(1)
MODE_GRAD = tl.constexpr(2)
IGNORE_INDEX = tl.constexpr(-100)


@triton.jit
def _tanh(u):
    """tanh from exp (tl has no tanh); exp(-2|u|) never overflows."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _load_x(row_ptr, offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """One vocab block upcast to fp32 and transformed: x = s*z or c*tanh(s*z/c); 0 past the row end."""
    mask = offsets < n_cols
    x = tl.load(row_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x, mask


@triton.jit
def _block_stats(x, mask):
    """(max, sum exp(x-max), sum exp(x-max)*(x-max)) of one block; the shift keeps entropy exact."""
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, 0)
    shifted = tl.where(mask, x - m, 0.0)
    e = tl.where(mask, tl.exp(shifted), 0.0)
    return m, tl.sum(e, 0), tl.sum(e * shifted, 0)


@triton.jit
def _merge_stats(m1, s1, t1, m2, s2, t2):
    """Combine two blocks' stats onto the larger max (the same rule the TP all-reduce uses)."""
    m = tl.maximum(m1, m2)
    a1 = tl.exp(m1 - m)
    a2 = tl.exp(m2 - m)
    s = a1 * s1 + a2 * s2
    t = a1 * (t1 + (m1 - m) * s1) + a2 * (t2 + (m2 - m) * s2)
    return m, s, t


@triton.jit
def _store_grad(
    grad_row_ptr, x, mask, offsets, local_label, lse, prob_coeff, label_coeff, logit_scale, softcap,
    HAS_SOFTCAP: tl.constexpr,
):
    """grad_j = (prob_coeff*p_j - label_coeff*d_jy) * dx/dz, stored in the gradient buffer's dtype."""
    p = tl.exp(tl.where(mask, x, 0.0) - lse)
    grad = prob_coeff * p - tl.where(offsets == local_label, label_coeff, 0.0)
    if HAS_SOFTCAP:
        ratio = x / softcap
        grad = grad * (logit_scale * (1.0 - ratio * ratio))
    else:
        grad = grad * logit_scale
    tl.store(grad_row_ptr + offsets, grad.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lm_loss_kernel(
    logits_ptr,
    logits_stride,
    grad_ptr,
    grad_stride,
    labels_ptr,
    n_cols,
    vocab_start,
    logit_scale,
    softcap,
    out0_ptr,  # FUSED: lse; STATS: max; GRAD: lse (read)
    out1_ptr,  # FUSED: new_logp; STATS: sum-exp; GRAD: prob_coeff (read)
    out2_ptr,  # FUSED: entropy; STATS: label logit (0 off shard); GRAD: label_coeff (read)
    out3_ptr,  # STATS: sum exp(x-max)*(x-max); unused otherwise
    old_logp_ptr,
    advantages_ptr,
    ce_coeff,
    z_coeff,
    grpo_coeff,
    eps_low,
    eps_high,
    grad_scale,
    MODE: tl.constexpr,
    HAS_CE: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_GRPO: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    grad_row = grad_ptr + row * grad_stride
    offsets = tl.arange(0, BLOCK)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    label = tl.load(labels_ptr + row)
    local_label = label - vocab_start
    in_shard = (local_label >= 0) & (local_label < n_cols)
    if label != IGNORE_INDEX:
        x0, mask0 = _load_x(logits_row, offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
        if MODE == MODE_GRAD:
            lse = tl.load(out0_ptr + row)
            prob_coeff = tl.load(out1_ptr + row) * grad_scale
            label_coeff = tl.load(out2_ptr + row) * grad_scale
        else:
            m, s, t = _block_stats(x0, mask0)
            if not SINGLE_PASS:
                for block in range(1, n_blocks):
                    x, mask = _load_x(logits_row, block * BLOCK + offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
                    bm, bs, bt = _block_stats(x, mask)
                    m, s, t = _merge_stats(m, s, t, bm, bs, bt)
            safe_label = tl.where(in_shard, local_label, 0)
            z_label = tl.load(logits_row + safe_label).to(tl.float32) * logit_scale
            if HAS_SOFTCAP:
                z_label = softcap * _tanh(z_label / softcap)
            x_label = tl.where(in_shard, z_label, 0.0)
            if MODE == MODE_STATS:
                tl.store(out0_ptr + row, m)
                tl.store(out1_ptr + row, s)
                tl.store(out2_ptr + row, x_label)
                tl.store(out3_ptr + row, t)
            else:
                log_s = tl.log(s)
                lse = m + log_s
                new_logp = x_label - lse
                tl.store(out0_ptr + row, lse)
                tl.store(out1_ptr + row, new_logp)
                tl.store(out2_ptr + row, log_s - t / s)
                # In-kernel coefficients: the minimal copy of coefficients.py that fusion forces.
                prob_coeff = 0.0
                label_coeff = 0.0
                if HAS_CE:
                    prob_coeff += ce_coeff
                    label_coeff += ce_coeff
                if HAS_Z:
                    prob_coeff += 2.0 * z_coeff * lse
                if HAS_GRPO:
                    advantage = tl.load(advantages_ptr + row).to(tl.float32)
                    ratio = tl.exp(new_logp - tl.load(old_logp_ptr + row).to(tl.float32))
                    gain = tl.where(ratio <= 1.0 + eps_high, tl.maximum(advantage, 0.0), 0.0)
                    loss_side = tl.where(ratio >= 1.0 - eps_low, tl.minimum(advantage, 0.0), 0.0)
                    policy = grpo_coeff * ratio * (gain + loss_side)
                    prob_coeff += policy
                    label_coeff += policy
                prob_coeff = prob_coeff * grad_scale
                label_coeff = label_coeff * grad_scale
        if COMPUTE_GRAD:
            if SINGLE_PASS:
                _store_grad(
                    grad_row, x0, mask0, offsets, local_label, lse, prob_coeff, label_coeff, logit_scale, softcap,
                    HAS_SOFTCAP,
                )
            else:
                # Backwards, so the block the stats pass touched last is still cached.
                for step in range(0, n_blocks):
                    start = (n_blocks - 1 - step) * BLOCK
                    x, mask = _load_x(logits_row, start + offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
                    _store_grad(
                        grad_row, x, mask, start + offsets, local_label, lse, prob_coeff, label_coeff,
                        logit_scale, softcap, HAS_SOFTCAP,
                    )
    else:
        if MODE != MODE_GRAD:
            # Neutral, finite values: a masked row contributes nothing and never makes a NaN.
            tl.store(out0_ptr + row, 0.0)
            tl.store(out2_ptr + row, 0.0)
            if MODE == MODE_STATS:
                tl.store(out1_ptr + row, 1.0)
                tl.store(out3_ptr + row, 0.0)
            else:
                tl.store(out1_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
            for block in range(0, n_blocks):
                tl.store(grad_row + block * BLOCK + offsets, zeros, mask=block * BLOCK + offsets < n_cols)
