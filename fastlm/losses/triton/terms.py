"""The fused kernel's per-token code of each label-form child: one @triton.jit function per slot kind.

A child declares its slot as data (children/base.py `KernelSlot`); interface.py turns it into a flat
namedtuple constexpr whose fields are this function (`terms`), the row of each of its term rows
(`<row>_row`, '/' read as '_'), the offset of each of its numbers in the kernel's fp32 parameter buffer,
each of its switches, `token_weights` (its row of the per-token weights w_t, -1 for 1/N) and
`entropy_weights` (a policy slot's row of its entropy bonus's weights v_t, -1 for w_t). The kernel
(kernel.py) calls every slot's function after the statistics pass, once per row, with one signature:

    terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
          token_scale, prob, label, x, total, S) -> prob, label, x, total

`rows` points at this token's column of the (K, T) term buffer (row r at rows + r * stride), `weights`
at its w_t column, `params` at the parameter buffer; `write` is false on the segments of a split row
that do not own its terms. Each function adds its share of the gradient coefficients (the form
`prob * p_j - label * [j = y] + x * p_j * x_j`, docs/design/losses.md "Superposition", weight and w_t
included) and, where `write`, stores its terms (scaled by `token_scale`, policy losses by their w_t)
and adds its weighted loss to `total`. Switches are constexprs, so a child's unused options compile to
nothing, and an unused slot runs `no_terms`. A new kind of child adds its function here and one line of
TERMS; a child without a function here runs its torch tail on the Triton path (launcher.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_row(token_rows, index, stride, value):
    """Row `index` of a per-token (K, T) buffer at the token whose column `token_rows` points to."""
    tl.store(token_rows + index * stride, value)


@triton.jit
def expm1(d):
    """exp(d) - 1 without cancellation near 0 (Kahan: (u - 1) * d / log u with u = exp(d))."""
    u = tl.exp(d)
    near = (u - 1.0) * d / tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, d, tl.where(tl.abs(d) < 0.5, near, u - 1.0))


@triton.jit
def non_finite(v):
    return ((v != v) | (tl.abs(v) == float("inf"))).to(tl.float32)


@triton.jit
def no_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
             token_scale, prob, label, x, total, S: tl.constexpr):
    """An unused slot."""
    return prob, label, x, total


@triton.jit
def cross_entropy_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio,
                        ref_gap, token_scale, prob, label, x, total, S: tl.constexpr):
    """`lse - x_y`: coefficient w/N in the label form."""
    weight = tl.load(params + S.weight)
    prob += weight * token_scale
    label += weight * token_scale
    if write:
        store_row(rows, S.loss_row, stride, -new_logp * token_scale)
        total -= weight * new_logp * token_scale
    return prob, label, x, total


@triton.jit
def z_loss_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
                 token_scale, prob, label, x, total, S: tl.constexpr):
    """`lse^2`: 2 w/N lse in prob; its metric the mean lse."""
    weight = tl.load(params + S.weight)
    prob += 2.0 * weight * token_scale * lse
    if write:
        store_row(rows, S.loss_row, stride, lse * lse * token_scale)
        store_row(rows, S.lse_row, stride, lse * token_scale)
        total += weight * lse * lse * token_scale
    return prob, label, x, total


@triton.jit
def _token_weight(weights, stride, token_scale, S: tl.constexpr):
    """w_t: the slot's row of the per-token weights (loss_type != dapo), else 1/N."""
    w = token_scale
    if S.token_weights >= 0:
        w = tl.load(weights + S.token_weights * stride)
    return w


@triton.jit
def _entropy_weight(weights, stride, w, S: tl.constexpr):
    """v_t: the slot's row of its entropy bonus's weights (a token mean apart from w_t), else w_t."""
    v = w
    if S.entropy_weights >= 0:
        v = tl.load(weights + S.entropy_weights * stride)
    return v


@triton.jit
def _policy_numbers(params, S: tl.constexpr):
    """(beta, entropy_coeff) of a policy slot: its reference-KL and entropy-bonus numbers, 0 when switched off."""
    beta = 0.0
    entropy_coeff = 0.0
    if S.ref:
        beta = tl.load(params + S.beta)
    if S.entropy:
        entropy_coeff = tl.load(params + S.entropy_coeff)
    return beta, entropy_coeff


@triton.jit
def _policy_coefficients(slope, weight, w, v, ref_gap, beta, entropy_coeff, lse, entropy, prob, label, x,
                         S: tl.constexpr):
    """A token-level policy child's (GRPO, CISPO) share of the coefficients, times its weight and
    w_t: `slope` (d token loss / d new_logp) plus the reference KL's in the label form
    c*(p_j - d_jy); the entropy bonus e (times v_t) as the x term, with -e*E_p[x] = -e*(lse - H) in prob."""
    if S.ref:
        slope += beta * expm1(ref_gap)
    policy = weight * w * slope
    prob += policy
    label += policy
    if S.entropy:
        bonus = weight * v * entropy_coeff
        x += bonus
        prob -= bonus * (lse - entropy)
    return prob, label, x


@triton.jit
def _token_metrics(rows, stride, new_logp, entropy, old_logp, ref_gap, token_scale, S: tl.constexpr):
    """new_logp, entropy, kl_old[, kl] (children/policy.py `token_metric_names`)."""
    delta = old_logp - new_logp
    store_row(rows, S.new_logp_row, stride, new_logp * token_scale)
    store_row(rows, S.entropy_row, stride, entropy * token_scale)
    store_row(rows, S.kl_old_row, stride, (expm1(delta) - delta) * token_scale)
    if S.ref:
        store_row(rows, S.kl_row, stride, (expm1(ref_gap) - ref_gap) * token_scale)


@triton.jit
def _policy_loss(rows, stride, token_loss, new_logp, entropy, old_logp, ref_gap, beta, entropy_coeff, w, v,
                 token_scale, S: tl.constexpr):
    """A token-level policy child's loss row (times its w_t, with its regularisers; the entropy bonus
    times v_t) and its token metrics. Returns its loss term for the weighted total."""
    if S.ref:
        token_loss += beta * (expm1(ref_gap) - ref_gap)
    term = token_loss * w - entropy_coeff * entropy * v
    store_row(rows, S.loss_row, stride, term)
    _token_metrics(rows, stride, new_logp, entropy, old_logp, ref_gap, token_scale, S)
    return term


@triton.jit
def grpo_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
               token_scale, prob, label, x, total, S: tl.constexpr):
    """The clipped surrogate (children/grpo.py): slope r*A where the unclipped term is active."""
    weight = tl.load(params + S.weight)
    eps_low = tl.load(params + S.eps_low)
    eps_high = tl.load(params + S.eps_high)
    delta = tl.load(params + S.delta)
    beta, entropy_coeff = _policy_numbers(params, S)
    w = _token_weight(weights, stride, token_scale, S)
    v = _entropy_weight(weights, stride, w, S)
    gain = tl.where(ratio <= 1.0 + eps_high, tl.maximum(advantage, 0.0), 0.0)
    loss_side = tl.where((ratio >= 1.0 - eps_low) & (ratio <= delta), tl.minimum(advantage, 0.0), 0.0)
    prob, label, x = _policy_coefficients(ratio * (gain + loss_side), weight, w, v, ref_gap, beta, entropy_coeff,
                                          lse, entropy, prob, label, x, S)
    if write:
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        capped = tl.minimum(ratio, delta)
        token_loss = -tl.minimum(capped * advantage, clipped * advantage)
        total += weight * _policy_loss(rows, stride, token_loss, new_logp, entropy, old_logp, ref_gap, beta,
                                       entropy_coeff, w, v, token_scale, S)
        low = ((ratio < 1.0 - eps_low) & (advantage < 0.0)).to(tl.float32)
        high = ((ratio > 1.0 + eps_high) & (advantage > 0.0)).to(tl.float32)
        store_row(rows, S.ratio_row, stride, ratio * token_scale)
        store_row(rows, S.advantage_row, stride, advantage * token_scale)
        store_row(rows, S.clip_ratio_low_mean_row, stride, low * token_scale)
        store_row(rows, S.clip_ratio_high_mean_row, stride, high * token_scale)
        store_row(rows, S.clip_ratio_region_mean_row, stride, tl.maximum(low, high) * token_scale)
    return prob, label, x, total


@triton.jit
def cispo_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
                token_scale, prob, label, x, total, S: tl.constexpr):
    """`-sg(min(r, cap)) A new_logp` (children/cispo.py): slope min(r, cap)*A on every token."""
    weight = tl.load(params + S.weight)
    cap = tl.load(params + S.cap)
    beta, entropy_coeff = _policy_numbers(params, S)
    w = _token_weight(weights, stride, token_scale, S)
    v = _entropy_weight(weights, stride, w, S)
    prob, label, x = _policy_coefficients(tl.minimum(ratio, cap) * advantage, weight, w, v, ref_gap, beta,
                                          entropy_coeff, lse, entropy, prob, label, x, S)
    if write:
        token_loss = -tl.minimum(ratio, cap) * advantage * new_logp
        total += weight * _policy_loss(rows, stride, token_loss, new_logp, entropy, old_logp, ref_gap, beta,
                                       entropy_coeff, w, v, token_scale, S)
        store_row(rows, S.ratio_row, stride, ratio * token_scale)
        store_row(rows, S.advantage_row, stride, advantage * token_scale)
        store_row(rows, S.cispo_clip_ratio_row, stride, ((ratio > cap) & (advantage > 0.0)).to(tl.float32) * token_scale)
    return prob, label, x, total


@triton.jit
def gspo_terms(rows, stride, write, params, weights, lse, new_logp, entropy, old_logp, advantage, ratio, ref_gap,
               token_scale, prob, label, x, total, S: tl.constexpr):
    """GSPO's token metrics; its loss, document metrics and coefficients need the whole call (its seam,
    documents.py, after this launch)."""
    if write:
        _token_metrics(rows, stride, new_logp, entropy, old_logp, ref_gap, token_scale, S)
    return prob, label, x, total


# Slot kind (`KernelSlot.kind`) -> its per-token function.
TERMS = {
    "cross_entropy": cross_entropy_terms,
    "z_loss": z_loss_terms,
    "grpo": grpo_terms,
    "cispo": cispo_terms,
    "gspo": gspo_terms,
}
