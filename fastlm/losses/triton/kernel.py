"""The one Triton kernel of the monolithic loss: label-based children (CE, z-loss, GRPO; GSPO through
load mode) and distillation, in one vocab loop.

Every label-based child has a gradient of the form `prob_coeff * p_j - label_coeff * d_jy`, so one
loss-agnostic gradient loop serves them all (see shared/design/losses.md, "Superposition").
Distillation (teacher u = teacher_logits / T, q = softmax(u), coefficient k = w/N) adds one
per-element term to the same loop, with the rest folded into `prob_coeff`:

- forward KL(q || p): d/dx_j = k*(p_j - q_j): `prob_coeff += k`, element term `-k*q_j`;
- reverse KL(p || q): d/dx_j = k*p_j*(log p_j - log q_j - KL) = k*p_j*((x_j - u_j) - E_p[x - u])
  (the lse terms cancel against KL = E_p[x - u] - lse_x + lse_u): `prob_coeff -= k*E_p[x - u]`,
  element term `k*p_j*(x_j - u_j)`.

Both need full-row statistics before the first gradient element: the teacher's online softmax (max,
sum-exp) runs in the stats pass next to the student's, plus one mergeable cross sum:
forward `sum_j exp(u_j - max_u)*(u_j - x_j)`, reverse `sum_j exp(x_j - max_x)*(x_j - u_j)`, so
KL = cross/sum_u - lse_u + lse_x (forward) or cross/sum_x - lse_x + lse_u (reverse).

One program handles one token row; math is fp32 whatever the input dtypes. Three constexpr modes
share the body:

- `MODE_FUSED`: online softmax stats, in-kernel coefficients (CE, z, GRPO, distillation), gradient;
  writes every per-token term the losses and metrics need into one (K, T) fp32 buffer, already
  scaled by 1/tokens, so the whole loss tail is one sum over T (`coefficients.fused_layout` gives the
  rows: each present child's loss then its metrics, the weighted total, then the unscaled
  value-check counts of validation.py: label out of range, unmasked, non-finite old_logp /
  advantage). Out-of-range labels read no logit (masked load) and only raise that count.
- `MODE_STATS`: stats only, as mergeable pieces (max, sum-exp, label logit, shifted x-moment; teacher
  max, teacher sum-exp, cross sum) so a vocab-parallel group can all-reduce them; writes the label
  logit only where the label is in shard.
- `MODE_GRAD`: loads lse, both coefficients (and the teacher lse) per token, computed in torch, and
  writes the gradient.

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
def _load_u(teacher_row_ptr, offsets, n_cols, inv_temperature):
    """One block of teacher logits upcast to fp32 and divided by the temperature; 0 past the row end."""
    return tl.load(teacher_row_ptr + offsets, mask=offsets < n_cols, other=0.0).to(tl.float32) * inv_temperature


@triton.jit
def _block_stats(x, mask):
    """(max, sum exp(x-max), sum exp(x-max)*(x-max), exp(x-max)) of one block; the shift keeps entropy exact."""
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, 0)
    shifted = tl.where(mask, x - m, 0.0)
    e = tl.where(mask, tl.exp(shifted), 0.0)
    return m, tl.sum(e, 0), tl.sum(e * shifted, 0), e


@triton.jit
def _teacher_block_stats(u, x, e, mask, KD_REVERSE: tl.constexpr):
    """(teacher max, sum exp(u-max_u), cross sum) of one block; `e` = exp(x - max_x) of the student."""
    mu = tl.max(tl.where(mask, u, float("-inf")), 0)
    e_q = tl.where(mask, tl.exp(u - mu), 0.0)
    if KD_REVERSE:
        cross = tl.sum(e * tl.where(mask, x - u, 0.0), 0)
    else:
        cross = tl.sum(e_q * tl.where(mask, u - x, 0.0), 0)
    return mu, tl.sum(e_q, 0), cross


@triton.jit
def _rescale(m1, m2):
    """The larger max and the factors exp(m_i - m) that move each side's sums onto it."""
    m = tl.maximum(m1, m2)
    return m, tl.exp(m1 - m), tl.exp(m2 - m)


@triton.jit
def _expm1(d):
    """exp(d) - 1 without cancellation near 0 (Kahan: (u - 1) * d / log u with u = exp(d))."""
    u = tl.exp(d)
    near = (u - 1.0) * d / tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, d, tl.where(tl.abs(d) < 0.5, near, u - 1.0))


@triton.jit
def _non_finite(v):
    return ((v != v) | (tl.abs(v) == float("inf"))).to(tl.float32)


@triton.jit
def _store_term(terms_ptr, index, n_tokens, row, value):
    """Row `index` of the (K, T) term buffer at token `row`."""
    tl.store(terms_ptr + index * n_tokens + row, value)


@triton.jit
def _store_terms(
    terms_ptr, row, n_tokens, lse, new_logp, entropy, in_vocab, old_logp_ptr, advantages_ptr, kl_kd, ce_weight,
    z_weight, grpo_weight, kd_weight, token_scale, eps_low, eps_high, ROW_CE: tl.constexpr, ROW_Z: tl.constexpr,
    ROW_GRPO: tl.constexpr, ROW_KD: tl.constexpr, ROW_TOTAL: tl.constexpr, ROW_FLAGS: tl.constexpr,
):
    """The per-token terms of an unmasked row (order: coefficients.fused_layout / metrics.GRPO_METRICS),
    scaled by `token_scale`; then the value-check counts, unscaled."""
    total = 0.0
    if ROW_CE >= 0:
        _store_term(terms_ptr, ROW_CE, n_tokens, row, -new_logp * token_scale)
        total -= ce_weight * new_logp
    if ROW_Z >= 0:
        _store_term(terms_ptr, ROW_Z, n_tokens, row, lse * lse * token_scale)
        _store_term(terms_ptr, ROW_Z + 1, n_tokens, row, lse * token_scale)
        total += z_weight * lse * lse
    if ROW_GRPO >= 0:
        old_logp = tl.load(old_logp_ptr + row).to(tl.float32)
        advantage = tl.load(advantages_ptr + row).to(tl.float32)
        ratio = tl.exp(new_logp - old_logp)
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        token_loss = -tl.minimum(ratio * advantage, clipped * advantage)
        delta = old_logp - new_logp
        low = ((ratio < 1.0 - eps_low) & (advantage < 0.0)).to(tl.float32)
        high = ((ratio > 1.0 + eps_high) & (advantage > 0.0)).to(tl.float32)
        _store_term(terms_ptr, ROW_GRPO, n_tokens, row, token_loss * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 1, n_tokens, row, new_logp * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 2, n_tokens, row, entropy * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 3, n_tokens, row, (_expm1(delta) - delta) * token_scale)  # k3 KL
        _store_term(terms_ptr, ROW_GRPO + 4, n_tokens, row, ratio * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 5, n_tokens, row, advantage * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 6, n_tokens, row, low * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 7, n_tokens, row, high * token_scale)
        _store_term(terms_ptr, ROW_GRPO + 8, n_tokens, row, tl.maximum(low, high) * token_scale)
        total += grpo_weight * token_loss
        _store_term(terms_ptr, ROW_FLAGS + 2, n_tokens, row, _non_finite(old_logp))
        _store_term(terms_ptr, ROW_FLAGS + 3, n_tokens, row, _non_finite(advantage))
    if ROW_KD >= 0:
        _store_term(terms_ptr, ROW_KD, n_tokens, row, kl_kd * token_scale)
        total += kd_weight * kl_kd
    _store_term(terms_ptr, ROW_TOTAL, n_tokens, row, total * token_scale)
    _store_term(terms_ptr, ROW_FLAGS, n_tokens, row, 1.0 - in_vocab.to(tl.float32))
    _store_term(terms_ptr, ROW_FLAGS + 1, n_tokens, row, 1.0)


@triton.jit
def _probs(x, mask, lse):
    return tl.exp(tl.where(mask, x, 0.0) - lse)


@triton.jit
def _store_grad(
    grad_row_ptr, x, p, u, mask, offsets, local_label, prob_coeff, label_coeff, logit_scale, softcap,
    kd_scale, teacher_lse, HAS_SOFTCAP: tl.constexpr, KD_GRAD: tl.constexpr, KD_REVERSE: tl.constexpr,
):
    """grad_j = (prob_coeff*p_j - label_coeff*d_jy + distillation element term) * dx/dz, stored in the
    gradient buffer's dtype; `p` is the student softmax of this block."""
    grad = prob_coeff * p - tl.where(offsets == local_label, label_coeff, 0.0)
    if KD_GRAD:
        if KD_REVERSE:
            grad += kd_scale * p * (x - u)
        else:
            grad -= kd_scale * tl.exp(tl.where(mask, u, 0.0) - teacher_lse)
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
    teacher_ptr,
    teacher_stride,
    n_cols,
    vocab_start,
    logit_scale,
    softcap,
    inv_temperature,
    out0_ptr,  # FUSED: the (K, T) term buffer; STATS: max; GRAD: lse (read)
    out1_ptr,  # STATS: sum-exp; GRAD: prob_coeff (read); unused in FUSED
    out2_ptr,  # STATS: label logit (0 off shard); GRAD: label_coeff (read); unused in FUSED
    out3_ptr,  # STATS: sum exp(x-max)*(x-max); unused otherwise
    kd0_ptr,  # STATS: teacher max; GRAD: teacher lse (read); unused in FUSED
    kd1_ptr,  # STATS: teacher sum-exp; unused otherwise
    kd2_ptr,  # STATS: cross sum; unused otherwise
    old_logp_ptr,
    advantages_ptr,
    ce_weight,
    z_weight,
    grpo_weight,
    kd_weight,
    token_scale,  # 1 / tokens of the step (0 when none)
    eps_low,
    eps_high,
    grad_scale,
    MODE: tl.constexpr,
    ROW_CE: tl.constexpr,  # FUSED: first term row of each child, -1 when absent (coefficients.fused_layout)
    ROW_Z: tl.constexpr,
    ROW_GRPO: tl.constexpr,
    ROW_KD: tl.constexpr,
    ROW_TOTAL: tl.constexpr,
    ROW_FLAGS: tl.constexpr,
    N_TERMS: tl.constexpr,  # K, rows of the term buffer
    HAS_KD: tl.constexpr,  # teacher statistics in this launch (FUSED, STATS)
    KD_GRAD: tl.constexpr,  # distillation term in the gradient (FUSED, GRAD; weight != 0)
    KD_REVERSE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n_tokens = tl.num_programs(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    grad_row = grad_ptr + row * grad_stride
    teacher_row = teacher_ptr + row * teacher_stride
    offsets = tl.arange(0, BLOCK)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    label = tl.load(labels_ptr + row)
    local_label = label - vocab_start
    in_shard = (local_label >= 0) & (local_label < n_cols)
    if label != IGNORE_INDEX:
        x0, mask0 = _load_x(logits_row, offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
        u0 = x0
        if HAS_KD or KD_GRAD:
            u0 = _load_u(teacher_row, offsets, n_cols, inv_temperature)
        teacher_lse = 0.0
        kd_coeff = kd_weight * token_scale
        kd_scale = kd_coeff * grad_scale
        if MODE == MODE_GRAD:
            lse = tl.load(out0_ptr + row)
            prob_coeff = tl.load(out1_ptr + row) * grad_scale
            label_coeff = tl.load(out2_ptr + row) * grad_scale
            if KD_GRAD:
                teacher_lse = tl.load(kd0_ptr + row)
            p0 = _probs(x0, mask0, lse)
        else:
            m, s, t, e = _block_stats(x0, mask0)
            mu = 0.0
            su = 1.0
            cross = 0.0
            if HAS_KD:
                mu, su, cross = _teacher_block_stats(u0, x0, e, mask0, KD_REVERSE)
            if not SINGLE_PASS:
                for block in range(1, n_blocks):
                    block_offsets = block * BLOCK + offsets
                    x, mask = _load_x(logits_row, block_offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
                    bm, bs, bt, be = _block_stats(x, mask)
                    new_m, a1, a2 = _rescale(m, bm)
                    t = a1 * (t + (m - new_m) * s) + a2 * (bt + (bm - new_m) * bs)
                    s = a1 * s + a2 * bs
                    if HAS_KD:
                        u = _load_u(teacher_row, block_offsets, n_cols, inv_temperature)
                        bmu, bsu, bcross = _teacher_block_stats(u, x, be, mask, KD_REVERSE)
                        new_mu, b1, b2 = _rescale(mu, bmu)
                        su = b1 * su + b2 * bsu
                        if KD_REVERSE:
                            cross = a1 * cross + a2 * bcross
                        else:
                            cross = b1 * cross + b2 * bcross
                        mu = new_mu
                    m = new_m
            # Masked load: a label outside this shard (or outside the vocabulary) reads nothing.
            z_label = tl.load(logits_row + local_label, mask=in_shard, other=0.0).to(tl.float32) * logit_scale
            if HAS_SOFTCAP:
                z_label = softcap * _tanh(z_label / softcap)
            x_label = tl.where(in_shard, z_label, 0.0)
            if MODE == MODE_STATS:
                tl.store(out0_ptr + row, m)
                tl.store(out1_ptr + row, s)
                tl.store(out2_ptr + row, x_label)
                tl.store(out3_ptr + row, t)
                if HAS_KD:
                    tl.store(kd0_ptr + row, mu)
                    tl.store(kd1_ptr + row, su)
                    tl.store(kd2_ptr + row, cross)
            else:
                log_s = tl.log(s)
                lse = m + log_s
                new_logp = x_label - lse
                # In-kernel coefficients: the minimal copy of coefficients.py that fusion forces.
                prob_coeff = 0.0
                label_coeff = 0.0
                if ROW_CE >= 0:
                    prob_coeff += ce_weight * token_scale
                    label_coeff += ce_weight * token_scale
                if ROW_Z >= 0:
                    prob_coeff += 2.0 * z_weight * token_scale * lse
                if ROW_GRPO >= 0:
                    advantage = tl.load(advantages_ptr + row).to(tl.float32)
                    ratio = tl.exp(new_logp - tl.load(old_logp_ptr + row).to(tl.float32))
                    gain = tl.where(ratio <= 1.0 + eps_high, tl.maximum(advantage, 0.0), 0.0)
                    loss_side = tl.where(ratio >= 1.0 - eps_low, tl.minimum(advantage, 0.0), 0.0)
                    policy = grpo_weight * token_scale * ratio * (gain + loss_side)
                    prob_coeff += policy
                    label_coeff += policy
                kl_kd = 0.0
                if HAS_KD:
                    teacher_lse = mu + tl.log(su)
                    if KD_REVERSE:
                        mean_gap = cross / s  # E_p[x - u]
                        kl_kd = mean_gap - lse + teacher_lse
                        if KD_GRAD:
                            prob_coeff -= kd_coeff * mean_gap
                    else:
                        kl_kd = cross / su - teacher_lse + lse
                        if KD_GRAD:
                            prob_coeff += kd_coeff
                _store_terms(
                    out0_ptr, row, n_tokens, lse, new_logp, log_s - t / s, in_shard, old_logp_ptr, advantages_ptr,
                    kl_kd, ce_weight, z_weight, grpo_weight, kd_weight, token_scale, eps_low, eps_high,
                    ROW_CE, ROW_Z, ROW_GRPO, ROW_KD, ROW_TOTAL, ROW_FLAGS,
                )
                prob_coeff = prob_coeff * grad_scale
                label_coeff = label_coeff * grad_scale
            # One row in one block: p = exp(x - m) / sum reuses the stats pass's exponentials (one
            # exp per element instead of two; the special-function unit is a bottleneck near R1).
            p0 = e / s
        if COMPUTE_GRAD:
            if SINGLE_PASS:
                _store_grad(
                    grad_row, x0, p0, u0, mask0, offsets, local_label, prob_coeff, label_coeff, logit_scale, softcap,
                    kd_scale, teacher_lse, HAS_SOFTCAP, KD_GRAD, KD_REVERSE,
                )
            else:
                # Backwards, so the block the stats pass touched last is still cached.
                for step in range(0, n_blocks):
                    start = (n_blocks - 1 - step) * BLOCK
                    x, mask = _load_x(logits_row, start + offsets, n_cols, logit_scale, softcap, HAS_SOFTCAP)
                    u = x
                    if KD_GRAD:
                        u = _load_u(teacher_row, start + offsets, n_cols, inv_temperature)
                    _store_grad(
                        grad_row, x, _probs(x, mask, lse), u, mask, start + offsets, local_label, prob_coeff, label_coeff,
                        logit_scale, softcap, kd_scale, teacher_lse, HAS_SOFTCAP, KD_GRAD, KD_REVERSE,
                    )
    else:
        # Neutral, finite values: a masked row contributes nothing and never makes a NaN.
        if MODE == MODE_STATS:
            tl.store(out0_ptr + row, 0.0)
            tl.store(out1_ptr + row, 1.0)
            tl.store(out2_ptr + row, 0.0)
            tl.store(out3_ptr + row, 0.0)
            if HAS_KD:
                tl.store(kd0_ptr + row, 0.0)
                tl.store(kd1_ptr + row, 1.0)
                tl.store(kd2_ptr + row, 0.0)
        if MODE == MODE_FUSED:
            for index in tl.static_range(N_TERMS):
                _store_term(out0_ptr, index, n_tokens, row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
            for block in range(0, n_blocks):
                tl.store(grad_row + block * BLOCK + offsets, zeros, mask=block * BLOCK + offsets < n_cols)
