"""The one Triton kernel of the monolithic loss: the label-form children and distillation in one vocab
loop. It names no child: each label-form child comes as a slot (SLOT0..SLOT3), a flat namedtuple
constexpr built from the child's declared `KernelSlot` by interface.py, whose `terms` is the child's
per-token @triton.jit function (terms.py), called once per row after the statistics pass; the
children's numbers come from one fp32 buffer (`params_ptr`), the rows of every per-token buffer from
LAYOUT (interface.Rows), the teacher's slot is TEACHER.

Every label-based child has a gradient of the form `prob_coeff * p_j - label_coeff * d_jy`, so one
loss-agnostic gradient loop serves them all (see docs/design/losses.md, "Superposition").
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

`temperature_mode: both` (KD_TEMPERED, T != 1) puts the student at x/T in the KL: the stats pass
keeps a second sum-exp `sum_j exp((x_j - max_x)/T)` (the tempered max is max_x/T, so no second max)
and uses x/T in the cross sum (reverse: weighted by the tempered terms); the loss is `kd_scale` (T^2
for Hinton's, 1 for TRL's GKD) times the KL of p_T = softmax(x/T), and its gradient kd_scale/T*(p_T - q)
(reverse kd_scale/T*p_T*((x/T - u) - E_pT[x/T - u])) is written whole per element from p_T, next to the
untempered p the label children use.

The generalized JSD (TEACHER.jsd, 0 < beta < 1: M = beta*q + (1-beta)*p_s) has no online form, since M
mixes the two normalised softmaxes: it never runs FUSED. The launcher runs STATS, then `jsd_sums_kernel`
(a vocab pass from the merged log-partitions: the JSD and KL(p_s || M) per token), the torch tail, then
GRAD with KD_JSD, whose per-element term is k*(1-beta)*p_s*(log p_s - log M - KL(p_s || M)).

One program handles one token row; math is fp32 whatever the input dtypes, in base 2 inside (x*log2 e,
so each exponential is one `exp2`) and natural units at the interface. The row is walked in blocks:
every block but the last is read without a bounds check, running sums are per-thread vectors
(rescaled only when a block raises the max, reduced across threads once per row), and the gradient
pass walks backwards with evict-first loads so the re-read mostly hits L2. The gradient blocks leave
out the label term; the label element is rewritten once at the end (after a barrier, from a logit
read before any store, so in-place gradients are safe). Three constexpr modes share the body:

- `MODE_FUSED`: online softmax stats, in-kernel coefficients (each slot's function, then the
  teacher's), gradient; writes every per-token term the losses and metrics need into one (K, T) fp32
  buffer, already scaled, so the whole loss tail is one sum over T (interface.FusedLayout gives the
  rows: each child's slot rows, the weighted total, then the unscaled value-check counts of
  validation.py: label out of range, unmasked, non-finite old_logp / advantage). Out-of-range labels
  read no logit (masked load) and only raise that count. With a per-document child it runs without
  the gradient and also writes the per-token state its seam and the grad launch need
  (interface.STATE_ROWS).
- `MODE_STATS`: stats only, as mergeable pieces (max, sum-exp, label logit, shifted x-moment; teacher
  max, teacher sum-exp, cross sum; the tempered student's sum-exp) so a vocab-parallel group can
  all-reduce them; writes the label logit only where the label is in shard.
- `MODE_GRAD`: loads lse, both coefficients (the entropy coefficient with X_TERM, the teacher's grad
  stats) per token, computed in torch (or by a fused launch plus a per-document child's seam), and
  writes the gradient.

Masked rows (label -100) branch around the work and write a zero gradient; no early return.

`SPLIT` > 1 (FUSED, looped rows; by default with distillation on rows over 65536 columns,
launcher.default_split): SPLIT programs share a row, each owning a segment of whole blocks. Each runs
the stats pass over its segment, publishes its pieces (`_exchange_stats`), merges every segment's in
segment order, computes the same coefficients, and writes its segment's gradient, so a row's second
read follows its first by one segment, not one row (a row of student + teacher is 512 KiB at
V=131072, and one row per resident program is already more than L2). Segment 0 writes the per-token
terms; the label's owner rewrites its element. On the GPU the exchange is inside one launch
(SPLIT_EXCHANGE); the interpreter runs programs one at a time, so it launches twice (SPLIT_PUBLISH,
then SPLIT_READ), same arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fastlm.losses.triton.terms import non_finite, store_row

# Globals a @triton.jit function reads must be constexpr; the launcher passes `.value`.
MODE_FUSED = tl.constexpr(0)
MODE_STATS = tl.constexpr(1)
MODE_GRAD = tl.constexpr(2)
# SPLIT > 1 (FUSED, looped rows): SPLIT programs share a row, one vocab segment each, and merge their stats.
SPLIT_EXCHANGE = tl.constexpr(0)  # one launch: the row's programs publish, wait for each other, merge (GPU)
SPLIT_PUBLISH = tl.constexpr(1)  # first of two launches: the stats pass, published, nothing else
SPLIT_READ = tl.constexpr(2)  # second of two launches: merge what the first published, then terms and gradient
N_PIECES = tl.constexpr(8)  # published per program: m, s, t, mu, su, cross, ss (base 2), the label's x2
IGNORE_INDEX = tl.constexpr(-100)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(u):
    """tanh from exp (tl has no tanh); exp(-2|u|) never overflows."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _transform(z, x_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw logits -> x*log2(e), x = s*z or c*tanh(s*z/c) (`x_scale` = s*log2(e), or s/c with a softcap)."""
    if HAS_SOFTCAP:
        return (softcap * LOG2E) * _tanh(z * x_scale)
    return z * x_scale


@triton.jit
def _load_raw(row_ptr, offsets, n_cols, MASKED: tl.constexpr, EVICTION: tl.constexpr):
    """One block of a row in its stored dtype; -inf past the row end (MASKED: only the row's last,
    partial block pays for the bounds check)."""
    if MASKED:
        return tl.load(row_ptr + offsets, mask=offsets < n_cols, other=float("-inf"), eviction_policy=EVICTION)
    return tl.load(row_ptr + offsets, eviction_policy=EVICTION)


@triton.jit
def _load_pair(logits_row_ptr, teacher_row_ptr, offsets, n_cols, TEACHER: tl.constexpr, MASKED: tl.constexpr,
               EVICTION: tl.constexpr):
    """A block of the logits and (TEACHER) of the teacher logits, still in their stored dtypes: a
    prefetched block waits a whole iteration in registers, so it stays 16-bit until it is used."""
    z = _load_raw(logits_row_ptr, offsets, n_cols, MASKED, EVICTION)
    teacher = z
    if TEACHER:
        teacher = _load_raw(teacher_row_ptr, offsets, n_cols, MASKED, EVICTION)
    return z, teacher


@triton.jit
def _x2_of(z_raw, offsets, n_cols, x_scale, softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """A block of raw logits -> the transformed logits in base-2 units, x2 = x*log2(e); -inf past the
    row end. `x_scale` is logit_scale*log2(e) (logit_scale/softcap with a softcap)."""
    x2 = _transform(z_raw.to(tl.float32), x_scale, softcap, HAS_SOFTCAP)
    if HAS_SOFTCAP and MASKED:
        x2 = tl.where(offsets < n_cols, x2, float("-inf"))
    return x2


@triton.jit
def _load_x2(row_ptr, offsets, n_cols, x_scale, softcap, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
             EVICTION: tl.constexpr):
    """Load a block and transform it (`_x2_of`): the single-pass row and the label's element."""
    return _x2_of(_load_raw(row_ptr, offsets, n_cols, MASKED, EVICTION), offsets, n_cols, x_scale, softcap,
                  HAS_SOFTCAP, MASKED)


@triton.jit
def _load_u2(teacher_row_ptr, offsets, n_cols, u_scale, MASKED: tl.constexpr, EVICTION: tl.constexpr):
    """One block of teacher logits / temperature in base-2 units (`u_scale` = log2(e)/T); -inf past the end."""
    return _load_raw(teacher_row_ptr, offsets, n_cols, MASKED, EVICTION).to(tl.float32) * u_scale


@triton.jit
def _fold(v, ACC: tl.constexpr):
    """Sum a block down to ACC lanes: element j joins lane j % ACC. With ACC = the elements one pass of
    the CTA's vector loads covers, each lane lives in one thread, so these are in-thread adds (no
    shuffle); the accumulators stay vectors across blocks and are reduced across threads once per row."""
    return tl.sum(tl.reshape(v, (v.shape[0] // ACC, ACC)), 0)


@triton.jit
def _block_stats(
    x2, u2, m, s, t, mu, su, cross, ss, inv_t, MASKED: tl.constexpr, NEED_MOMENT: tl.constexpr, HAS_KD: tl.constexpr,
    KD_REVERSE: tl.constexpr, KD_TEMPERED: tl.constexpr, ACC: tl.constexpr,
):
    """Merge one block into the running stats (base 2): max m, s = sum 2^(x2-m), t = sum 2^(x2-m)*(x2-m)
    (entropy's shifted moment, exact for peaked rows); teacher max mu, su = sum 2^(u2-mu), cross = the
    KL cross sum (forward: weights 2^(u2-mu) on u2-x2; reverse: 2^(x2-m) on x2-u2). KD_TEMPERED (the
    student in the KL at x/T, inv_t = 1/T): ss = sum 2^((x2-m)/T), the tempered softmax's sum under
    its max m/T, and x2/T for x2 in cross (reverse: weights 2^((x2-m)/T)). The sums are ACC-lane
    vectors; they are rescaled only on blocks that raise a max. Returns the new state and 2^(x2-m)."""
    block_max = tl.max(x2, 0)
    if block_max > m:
        rescale = tl.exp2(m - block_max)  # 0 on the first block (m = -inf, sums 0)
        if NEED_MOMENT:
            t = rescale * (t + tl.maximum(m - block_max, -3.0e38) * s)
        s = s * rescale
        if HAS_KD and KD_TEMPERED:
            rescale_t = tl.exp2((m - block_max) * inv_t)
            ss = ss * rescale_t
            if KD_REVERSE:
                cross = cross * rescale_t
        elif HAS_KD and KD_REVERSE:
            cross = cross * rescale
        m = block_max
    shifted = x2 - m
    e = tl.exp2(shifted)
    s += _fold(e, ACC)
    x_kd, e_kd = x2, e  # the student in the KL: x2 and its softmax terms, or x2/T and 2^((x2-m)/T)
    if HAS_KD and KD_TEMPERED:
        x_kd = x2 * inv_t
        e_kd = tl.exp2(shifted * inv_t)  # 0 past the row end (shifted = -inf there)
        ss += _fold(e_kd, ACC)
    if NEED_MOMENT:
        if MASKED:  # past the row end e = 0 but shifted = -inf
            shifted = tl.where(x2 > float("-inf"), shifted, 0.0)
        t += _fold(e * shifted, ACC)
    if HAS_KD:
        teacher_max = tl.max(u2, 0)
        if teacher_max > mu:
            rescale_u = tl.exp2(mu - teacher_max)
            su = su * rescale_u
            if not KD_REVERSE:
                cross = cross * rescale_u
            mu = teacher_max
        e_q = tl.exp2(u2 - mu)
        su += _fold(e_q, ACC)
        if MASKED:  # no -inf - -inf past the row end
            valid = x2 > float("-inf")
            gap = tl.where(valid, x_kd, 0.0) - tl.where(valid, u2, 0.0)
        else:
            gap = x_kd - u2
        if KD_REVERSE:
            cross += _fold(e_kd * gap, ACC)
        else:
            cross -= _fold(e_q * gap, ACC)
    return m, s, t, mu, su, cross, ss, e


@triton.jit
def _merge_block(
    z_raw, teacher_raw, offsets, n_cols, x_scale, softcap, u_scale, m, s, t, mu, su, cross, ss, inv_t,
    HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr, NEED_MOMENT: tl.constexpr, HAS_KD: tl.constexpr,
    KD_REVERSE: tl.constexpr, KD_TEMPERED: tl.constexpr, ACC: tl.constexpr,
):
    """First pass: merge one loaded block of a looped row into the running stats."""
    x2 = _x2_of(z_raw, offsets, n_cols, x_scale, softcap, HAS_SOFTCAP, MASKED)
    u2 = x2
    if HAS_KD:
        u2 = teacher_raw.to(tl.float32) * u_scale
    m, s, t, mu, su, cross, ss, _ = _block_stats(x2, u2, m, s, t, mu, su, cross, ss, inv_t, MASKED, NEED_MOMENT, HAS_KD,
                                                 KD_REVERSE, KD_TEMPERED, ACC)
    return m, s, t, mu, su, cross, ss


@triton.jit
def _grad(p, x2, u2, prob_coeff, kd_coeff, x_coeff, teacher_lse2, inv_t, student_lse2, kd_gap2, log2_beta, log2_rest,
          label_term, inv_softcap2, HAS_SOFTCAP: tl.constexpr, KD_GRAD: tl.constexpr, KD_REVERSE: tl.constexpr,
          KD_TEMPERED: tl.constexpr, KD_JSD: tl.constexpr, X_TERM: tl.constexpr):
    """d loss / d z for a block (or the label element, `label_term` != 0) from the student softmax p.
    The coefficients already carry grad_scale and logit_scale (and ln 2 for the reverse-KL term), so
    without a softcap this is one multiply per element: (prob_coeff*p - label_term + kd term) * dx/dz.
    KD_TEMPERED: the whole KL term from the tempered softmax p_T = 2^(x2/T - student_lse2) (inv_t =
    1/T; kd_gap2 = E_pT[x/T - u] in base 2): k*(p_T - q), or k*p_T*((x2/T - u2) - kd_gap2) (reverse).
    KD_JSD (the generalized JSD, 0 < beta < 1): k*p_s*(l - kd_gap2), l = log2 p_s - log2 M, M = beta*q +
    (1-beta)*p_s (log2_beta, log2_rest: log2 beta, log2 (1-beta)), kd_gap2 = KL(p_s || M) in base 2; p_s is
    p_T with KD_TEMPERED, else p."""
    grad = prob_coeff * p - label_term
    if KD_GRAD and KD_JSD:
        x_s2 = x2
        if KD_TEMPERED:
            x_s2 = x2 * inv_t
        log_p2 = x_s2 - student_lse2
        student_part = log_p2 + log2_rest
        teacher_part = (u2 - teacher_lse2) + log2_beta
        top = tl.maximum(student_part, teacher_part)
        log_m2 = top + tl.log2(tl.exp2(student_part - top) + tl.exp2(teacher_part - top))
        grad += kd_coeff * tl.exp2(log_p2) * (log_p2 - log_m2 - kd_gap2)
    elif KD_GRAD and KD_TEMPERED:
        x_t2 = x2 * inv_t
        p_t = tl.exp2(x_t2 - student_lse2)
        if KD_REVERSE:
            grad += kd_coeff * p_t * (x_t2 - u2 - kd_gap2)
        else:
            grad += kd_coeff * (p_t - tl.exp2(u2 - teacher_lse2))
    elif KD_GRAD:
        if KD_REVERSE:
            grad += kd_coeff * p * (x2 - u2)
        else:
            grad -= kd_coeff * tl.exp2(u2 - teacher_lse2)
    if X_TERM:  # the entropy bonus: x_coeff carries ln 2, so x_coeff * x2 = e * x
        grad += x_coeff * p * x2
    if HAS_SOFTCAP:
        ratio = x2 * inv_softcap2  # x / c
        grad = grad * (1.0 - ratio * ratio)
    return grad


@triton.jit
def _write_grad_block(
    grad_row_ptr, offsets, n_cols, p, x2, u2, prob_coeff, kd_coeff, x_coeff, teacher_lse2, inv_t, student_lse2,
    kd_gap2, log2_beta, log2_rest, inv_softcap2, HAS_SOFTCAP: tl.constexpr, KD_GRAD: tl.constexpr,
    KD_REVERSE: tl.constexpr, KD_TEMPERED: tl.constexpr, KD_JSD: tl.constexpr, X_TERM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Store one block's gradient (without the label term) in the buffer's dtype, streaming past L2."""
    if MASKED:  # finite past the row end (those columns are not stored): no inf*0 in the softcap/KD terms
        x2 = tl.where(offsets < n_cols, x2, 0.0)
        u2 = tl.where(offsets < n_cols, u2, 0.0)
    grad = _grad(p, x2, u2, prob_coeff, kd_coeff, x_coeff, teacher_lse2, inv_t, student_lse2, kd_gap2, log2_beta,
                 log2_rest, 0.0, inv_softcap2, HAS_SOFTCAP, KD_GRAD, KD_REVERSE, KD_TEMPERED, KD_JSD, X_TERM)
    value = grad.to(grad_row_ptr.dtype.element_ty)
    if MASKED:
        tl.store(grad_row_ptr + offsets, value, mask=offsets < n_cols, cache_modifier=".cs")
    else:
        tl.store(grad_row_ptr + offsets, value, cache_modifier=".cs")


@triton.jit
def _store_grad_block(
    grad_row_ptr, z_raw, teacher_raw, offsets, n_cols, x_scale, softcap, u_scale, lse2, teacher_lse2, inv_t,
    student_lse2, kd_gap2, log2_beta, log2_rest, prob_coeff, kd_coeff, x_coeff, inv_softcap2, HAS_SOFTCAP: tl.constexpr,
    KD_GRAD: tl.constexpr, KD_REVERSE: tl.constexpr, KD_TEMPERED: tl.constexpr, KD_JSD: tl.constexpr,
    X_TERM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Second pass: the gradient of one loaded block."""
    x2 = _x2_of(z_raw, offsets, n_cols, x_scale, softcap, HAS_SOFTCAP, MASKED)
    u2 = x2
    if KD_GRAD:
        u2 = teacher_raw.to(tl.float32) * u_scale
    _write_grad_block(grad_row_ptr, offsets, n_cols, tl.exp2(x2 - lse2), x2, u2, prob_coeff, kd_coeff, x_coeff,
                      teacher_lse2, inv_t, student_lse2, kd_gap2, log2_beta, log2_rest, inv_softcap2, HAS_SOFTCAP,
                      KD_GRAD, KD_REVERSE, KD_TEMPERED, KD_JSD, X_TERM, MASKED)


@triton.jit
def _exchange_stats(
    split_ptr, sync_ptr, row, part, m, s, t, mu, su, cross, ss, x2_label, inv_t, SPLIT: tl.constexpr,
    SPLIT_PHASE: tl.constexpr, HAS_KD: tl.constexpr, KD_REVERSE: tl.constexpr, KD_TEMPERED: tl.constexpr,
):
    """A split row's stats (base 2, scalars): publish this segment's (PUBLISH, EXCHANGE), wait until
    the row's SPLIT programs have published (EXCHANGE: an arrival counter per row; the programs took
    tickets in launch order, so the ones a row waits for have started and none waits forever), then
    merge all segments in segment order (READ, EXCHANGE), so every program of the row holds the same
    stats. Returns them and the label's x2 (read by segment 0 before any gradient store)."""
    slots = split_ptr + row * (SPLIT * N_PIECES)
    if SPLIT_PHASE != SPLIT_READ:
        slot = slots + part * N_PIECES
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, t)
        tl.store(slot + 3, mu)
        tl.store(slot + 4, su)
        tl.store(slot + 5, cross)
        tl.store(slot + 6, ss)
        tl.store(slot + 7, x2_label)
    if SPLIT_PHASE == SPLIT_EXCHANGE:
        tl.debug_barrier()  # every thread's stores before the release
        arrived = tl.atomic_add(sync_ptr + row, 1, sem="release") + 1
        while arrived < SPLIT:
            arrived = tl.atomic_add(sync_ptr + row, 0, sem="acquire")
        tl.debug_barrier()
    if SPLIT_PHASE != SPLIT_PUBLISH:
        pieces = slots + tl.arange(0, SPLIT) * N_PIECES
        maxima = tl.load(pieces, cache_modifier=".cg")  # .cg: from L2, where the other programs' stores are
        m = tl.max(maxima, 0)
        gap = tl.maximum(maxima - m, -3.0e38)  # an empty segment has max -inf and sums 0
        weights = tl.exp2(gap)
        sums = tl.load(pieces + 1, cache_modifier=".cg")
        s = tl.sum(sums * weights, 0)
        t = tl.sum(weights * (tl.load(pieces + 2, cache_modifier=".cg") + gap * sums), 0)
        if HAS_KD:
            teacher_maxima = tl.load(pieces + 3, cache_modifier=".cg")
            mu = tl.max(teacher_maxima, 0)
            teacher_weights = tl.exp2(teacher_maxima - mu)
            su = tl.sum(tl.load(pieces + 4, cache_modifier=".cg") * teacher_weights, 0)
            tempered_weights = tl.exp2(gap * inv_t)
            ss = tl.sum(tl.load(pieces + 6, cache_modifier=".cg") * tempered_weights, 0)
            # The cross sum is weighted like the softmax it sums under: the teacher's (forward), the KL
            # student's (reverse: x, or x/T when tempered).
            cross_weights = teacher_weights
            if KD_REVERSE:
                cross_weights = tempered_weights if KD_TEMPERED else weights
            cross = tl.sum(tl.load(pieces + 5, cache_modifier=".cg") * cross_weights, 0)
        x2_label = tl.load(slots + 7, cache_modifier=".cg")
    return m, s, t, mu, su, cross, ss, x2_label


@triton.jit
def _teacher_numbers(params_ptr, TEACHER: tl.constexpr):
    """The teacher slot's weight and kd_scale (the KL's multiplier with KD_TEMPERED: T^2 for Hinton's, 1 for
    GKD), loaded where they are used rather than held in registers across the vocab loops."""
    kd_weight = 0.0
    kd_scale = 1.0
    if TEACHER.present:
        kd_weight = tl.load(params_ptr + TEACHER.weight)
        kd_scale = tl.load(params_ptr + TEACHER.kd_scale)
    return kd_weight, kd_scale


@triton.jit
def _store_common_terms(
    token_rows, stride, lse, new_logp, entropy, in_vocab, old_logp, advantage, kl_kd, prob_coeff, label_coeff, x_coeff,
    teacher_lse, student_lse, kd_gap, token_scale, kd_weight, total, LAYOUT: tl.constexpr, TEACHER: tl.constexpr,
):
    """What a FUSED launch writes besides the slots' terms (segment 0, unmasked rows): the teacher's KL
    (scaled) and the weighted total; the value-check counts, unscaled (validation.value_flags' order);
    with a per-document child the per-token state its seam and the grad launch read, unscaled."""
    if TEACHER.loss_row >= 0:
        store_row(token_rows, TEACHER.loss_row, stride, kl_kd * token_scale)
        total += kd_weight * kl_kd * token_scale
    store_row(token_rows, LAYOUT.total, stride, total)
    store_row(token_rows, LAYOUT.bad_labels, stride, 1.0 - in_vocab.to(tl.float32))
    store_row(token_rows, LAYOUT.unmasked, stride, 1.0)
    if LAYOUT.bad_old_logp >= 0:  # a policy child's inputs
        store_row(token_rows, LAYOUT.bad_old_logp, stride, non_finite(old_logp))
        store_row(token_rows, LAYOUT.bad_advantages, stride, non_finite(advantage))
    if LAYOUT.lse >= 0:  # the state rows (interface.STATE_ROWS, then the teacher's grad stats)
        store_row(token_rows, LAYOUT.lse, stride, lse)
        store_row(token_rows, LAYOUT.new_logp, stride, new_logp)
        store_row(token_rows, LAYOUT.entropy, stride, entropy)
        store_row(token_rows, LAYOUT.prob_coeff, stride, prob_coeff)
        store_row(token_rows, LAYOUT.label_coeff, stride, label_coeff)
        store_row(token_rows, LAYOUT.x_coeff, stride, x_coeff)
        if LAYOUT.teacher_lse >= 0:
            store_row(token_rows, LAYOUT.teacher_lse, stride, teacher_lse)
        if LAYOUT.student_lse >= 0:
            store_row(token_rows, LAYOUT.student_lse, stride, student_lse)
        if LAYOUT.teacher_gap >= 0:
            store_row(token_rows, LAYOUT.teacher_gap, stride, kd_gap)


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
    softcap,  # 1 without a softcap
    inv_temperature,  # the teacher's 1/T (1 without one): the vocab loop's only number of a child, so an argument
    rows_ptr,  # the per-token (K, T) fp32 rows, laid out by LAYOUT: FUSED the terms; STATS the pieces; GRAD (read) coefficients
    rows_stride,
    params_ptr,  # fp32: every other number of the children's slots (interface.py), each read once per program
    token_scale,  # 1 / tokens of the step (0 when none)
    grad_scale,
    old_logp_ptr,  # FUSED, LAYOUT.policy_inputs: the per-token inputs of the policy slots
    advantages_ptr,
    ref_logp_ptr,  # LAYOUT.ref_input: the frozen reference's label log-prob
    weights_ptr,  # FUSED: per-token weights, rows `token_weights` (w_t) and `entropy_weights` (v_t) of a slot
    split_ptr,  # SPLIT > 1: (T, SPLIT, N_PIECES) fp32, each segment's published stats
    sync_ptr,  # SPLIT > 1 and EXCHANGE: T arrival counters, then the ticket counter (int32, zeroed)
    LAUNCH: tl.constexpr,  # what this launch does and how it walks a row (interface.LaunchConfig)
    LAYOUT: tl.constexpr,  # this launch's rows of `rows_ptr` and its per-token switches (interface.Rows)
    TEACHER: tl.constexpr,  # the distillation slot (interface.Teacher); `present` False without one
    SLOT0: tl.constexpr,  # the label-form children's slots (interface.py), in spec order: `terms` is the
    SLOT1: tl.constexpr,  # child's per-token @triton.jit function (terms.py), the other fields its rows,
    SLOT2: tl.constexpr,  # scalar offsets into params_ptr and switches; an unused slot runs `no_terms`
    SLOT3: tl.constexpr,
):
    MODE: tl.constexpr = LAUNCH.mode
    COMPUTE_GRAD: tl.constexpr = LAUNCH.grad
    HAS_SOFTCAP: tl.constexpr = LAUNCH.softcap
    BLOCK: tl.constexpr = LAUNCH.block
    ACC: tl.constexpr = LAUNCH.acc  # lanes of the running sums (one per thread)
    SPLIT: tl.constexpr = LAUNCH.split  # programs per row (FUSED, looped rows), one vocab segment of whole blocks each
    SPLIT_PHASE: tl.constexpr = LAUNCH.split_phase  # SPLIT > 1: SPLIT_EXCHANGE, or SPLIT_PUBLISH then SPLIT_READ
    SINGLE_PASS: tl.constexpr = LAUNCH.single_pass
    PREFETCH: tl.constexpr = LAUNCH.prefetch  # looped rows: load block b+1 before block b's math
    HAS_KD: tl.constexpr = TEACHER.stats  # teacher statistics in this launch (FUSED, STATS)
    KD_GRAD: tl.constexpr = TEACHER.grad  # distillation term in the gradient (FUSED, GRAD; weight != 0)
    KD_REVERSE: tl.constexpr = TEACHER.reverse
    KD_TEMPERED: tl.constexpr = TEACHER.tempered  # temperature_mode both at T != 1: the KL's student at x/T
    KD_JSD: tl.constexpr = TEACHER.jsd  # the generalized JSD (0 < beta < 1): GRAD only (jsd_sums_kernel before it)
    X_TERM: tl.constexpr = LAYOUT.x_term  # entropy bonus p_j * x_j in the gradient
    N_ROWS: tl.constexpr = LAYOUT.n_rows  # rows of the per-token buffer
    # Base-2 units inside (exp2 is one instruction); natural units in and out.
    x_scale = logit_scale / softcap if HAS_SOFTCAP else logit_scale * LOG2E
    u_scale = inv_temperature * LOG2E
    inv_softcap2 = LN2 / softcap
    offsets = tl.arange(0, BLOCK)
    n_full = n_cols // BLOCK  # blocks without a bounds check
    has_tail = n_full * BLOCK < n_cols
    grad_coeff = grad_scale * logit_scale  # d(loss)/dx -> d(loss)/dz (times 1 - (x/c)^2 with a softcap)
    n_rows = (tl.num_programs(0) // SPLIT).to(tl.int64)
    if SPLIT > 1 and SPLIT_PHASE == SPLIT_EXCHANGE:
        ticket = tl.atomic_add(sync_ptr + n_rows, 1).to(tl.int64)  # launch order, whatever the block ids
    else:
        ticket = tl.program_id(0).to(tl.int64)
    row = ticket // SPLIT
    part = (ticket % SPLIT).to(tl.int32)
    # This program's blocks: full ones [first, end_full), and the row's tail block when it falls in them.
    part_blocks = tl.cdiv(tl.cdiv(n_cols, BLOCK), SPLIT)
    first = part * part_blocks
    end_full = tl.minimum(first + part_blocks, n_full)
    own_tail = has_tail & (n_full >= first) & (n_full < first + part_blocks)
    logits_row = logits_ptr + row * logits_stride
    grad_row = grad_ptr + row * grad_stride
    teacher_row = teacher_ptr + row * teacher_stride
    label = tl.load(labels_ptr + row)
    local_label = label - vocab_start
    in_shard = (local_label >= 0) & (local_label < n_cols)
    owns_label = in_shard & (local_label >= first * BLOCK) & (local_label < (first + part_blocks) * BLOCK)
    if label != IGNORE_INDEX:
        if SINGLE_PASS:  # the whole row stays in registers for both passes
            x2 = _load_x2(logits_row, offsets, n_cols, x_scale, softcap, HAS_SOFTCAP, True, "evict_first")
            u2 = x2
            if HAS_KD or KD_GRAD:
                u2 = _load_u2(teacher_row, offsets, n_cols, u_scale, True, "evict_first")
        # Masked load: a label outside this shard (or outside the vocabulary) reads nothing. Read
        # before any gradient store: an in-place gradient overwrites the logits.
        z_label = tl.load(logits_row + local_label, mask=in_shard, other=0.0).to(tl.float32)
        x2_label = tl.where(in_shard, _transform(z_label, x_scale, softcap, HAS_SOFTCAP), 0.0)
        teacher_lse2 = 0.0
        student_lse2 = 0.0  # KD_TEMPERED: log-partition of x/T and E_pT[x/T - u], base 2
        kd_gap2 = 0.0
        log2_beta = 0.0  # KD_JSD: log2 beta and log2 (1 - beta), the mixture's weights
        log2_rest = 0.0
        x_coeff = 0.0
        if MODE == MODE_GRAD:
            token_rows = rows_ptr + row  # this token's column of the per-token rows
            lse = tl.load(token_rows + LAYOUT.lse * rows_stride)
            prob_coeff = tl.load(token_rows + LAYOUT.prob_coeff * rows_stride)
            label_coeff = tl.load(token_rows + LAYOUT.label_coeff * rows_stride)
            if X_TERM:
                x_coeff = tl.load(token_rows + LAYOUT.x_coeff * rows_stride)
            if KD_GRAD:
                teacher_lse2 = tl.load(token_rows + LAYOUT.teacher_lse * rows_stride) * LOG2E
                if KD_TEMPERED or KD_JSD:
                    student_lse2 = tl.load(token_rows + LAYOUT.student_lse * rows_stride) * LOG2E
                    if KD_REVERSE or KD_JSD:
                        kd_gap2 = tl.load(token_rows + LAYOUT.teacher_gap * rows_stride) * LOG2E
                if KD_JSD:
                    kd_beta = tl.load(params_ptr + TEACHER.beta)
                    log2_beta = tl.log2(kd_beta)
                    log2_rest = tl.log2(1.0 - kd_beta)
        else:
            m = float("-inf")
            s = tl.zeros([ACC], dtype=tl.float32)
            t = tl.zeros([ACC], dtype=tl.float32)
            mu = float("-inf")
            su = tl.zeros([ACC], dtype=tl.float32)
            cross = tl.zeros([ACC], dtype=tl.float32)
            ss = tl.zeros([ACC], dtype=tl.float32)
            need_moment = MODE == MODE_STATS or LAYOUT.reads_entropy
            if SINGLE_PASS:
                m, s, t, mu, su, cross, ss, e = _block_stats(
                    x2, u2, m, s, t, mu, su, cross, ss, inv_temperature, True, need_moment, HAS_KD, KD_REVERSE,
                    KD_TEMPERED, ACC)
            elif SPLIT_PHASE != SPLIT_READ:
                # Loads ask L2 to keep the row for the second pass. PREFETCH issues the next block's loads
                # before this block's math (the last iteration re-reads the last block, unused).
                if PREFETCH:
                    z_next, teacher_next = _load_pair(logits_row, teacher_row,
                                                      tl.minimum(first, n_full - 1) * BLOCK + offsets, n_cols, HAS_KD,
                                                      False, "evict_last")
                for block in range(first, end_full):
                    if PREFETCH:
                        z_raw, teacher_raw = z_next, teacher_next
                        z_next, teacher_next = _load_pair(logits_row, teacher_row,
                                                          tl.minimum(block + 1, end_full - 1) * BLOCK + offsets,
                                                          n_cols, HAS_KD, False, "evict_last")
                    else:
                        z_raw, teacher_raw = _load_pair(logits_row, teacher_row, block * BLOCK + offsets, n_cols, HAS_KD,
                                                        False, "evict_last")
                    m, s, t, mu, su, cross, ss = _merge_block(
                        z_raw, teacher_raw, block * BLOCK + offsets, n_cols, x_scale, softcap, u_scale, m, s, t, mu, su,
                        cross, ss, inv_temperature, HAS_SOFTCAP, False, need_moment, HAS_KD, KD_REVERSE, KD_TEMPERED,
                        ACC)
                if own_tail:
                    tail = n_full * BLOCK + offsets
                    z_raw, teacher_raw = _load_pair(logits_row, teacher_row, tail, n_cols, HAS_KD, True, "evict_last")
                    m, s, t, mu, su, cross, ss = _merge_block(
                        z_raw, teacher_raw, tail, n_cols, x_scale, softcap, u_scale, m, s, t, mu, su, cross, ss,
                        inv_temperature, HAS_SOFTCAP, True, need_moment, HAS_KD, KD_REVERSE, KD_TEMPERED, ACC)
            s = tl.sum(s, 0)
            t = tl.sum(t, 0)
            su = tl.sum(su, 0)
            cross = tl.sum(cross, 0)
            ss = tl.sum(ss, 0)
            if SPLIT > 1:
                m, s, t, mu, su, cross, ss, x2_label = _exchange_stats(
                    split_ptr, sync_ptr, row, part, m, s, t, mu, su, cross, ss, x2_label, inv_temperature, SPLIT,
                    SPLIT_PHASE, HAS_KD, KD_REVERSE, KD_TEMPERED)
            t = t * LN2  # natural units from here on
            m = m * LN2
            x_label = x2_label * LN2
            token_rows = rows_ptr + row  # this token's column of the per-token rows
            if SPLIT_PHASE == SPLIT_PUBLISH:
                pass  # the second launch does the rest
            elif MODE == MODE_STATS:
                store_row(token_rows, LAYOUT.max, rows_stride, m)
                store_row(token_rows, LAYOUT.sum_exp, rows_stride, s)
                store_row(token_rows, LAYOUT.label_logit, rows_stride, x_label)
                store_row(token_rows, LAYOUT.moment, rows_stride, t)
                if HAS_KD:
                    store_row(token_rows, LAYOUT.teacher_max, rows_stride, mu * LN2)
                    store_row(token_rows, LAYOUT.teacher_sum_exp, rows_stride, su)
                    store_row(token_rows, LAYOUT.cross, rows_stride, cross * LN2)
                    if KD_TEMPERED:  # its max is the student's over T
                        store_row(token_rows, LAYOUT.tempered_sum_exp, rows_stride, ss)
            else:
                log_s = tl.log(s)
                lse = m + log_s
                new_logp = x_label - lse
                entropy = log_s - t / s
                # In-kernel coefficients and terms: each slot's per-token function (terms.py), then the
                # teacher's; only segment 0 writes the terms.
                prob_coeff = 0.0
                label_coeff = 0.0
                old_logp = 0.0
                advantage = 0.0
                ratio = 1.0
                ref_gap = 0.0
                if LAYOUT.policy_inputs:
                    old_logp = tl.load(old_logp_ptr + row).to(tl.float32)
                    advantage = tl.load(advantages_ptr + row).to(tl.float32)
                    ratio = tl.exp(new_logp - old_logp)
                    if LAYOUT.ref_input:
                        ref_gap = tl.load(ref_logp_ptr + row).to(tl.float32) - new_logp
                write = part == 0
                total = 0.0
                token_weights = weights_ptr + row
                prob_coeff, label_coeff, x_coeff, total = SLOT0.terms(
                    token_rows, rows_stride, write, params_ptr, token_weights, lse, new_logp, entropy, old_logp,
                    advantage, ratio, ref_gap, token_scale, prob_coeff, label_coeff, x_coeff, total, SLOT0)
                prob_coeff, label_coeff, x_coeff, total = SLOT1.terms(
                    token_rows, rows_stride, write, params_ptr, token_weights, lse, new_logp, entropy, old_logp,
                    advantage, ratio, ref_gap, token_scale, prob_coeff, label_coeff, x_coeff, total, SLOT1)
                prob_coeff, label_coeff, x_coeff, total = SLOT2.terms(
                    token_rows, rows_stride, write, params_ptr, token_weights, lse, new_logp, entropy, old_logp,
                    advantage, ratio, ref_gap, token_scale, prob_coeff, label_coeff, x_coeff, total, SLOT2)
                prob_coeff, label_coeff, x_coeff, total = SLOT3.terms(
                    token_rows, rows_stride, write, params_ptr, token_weights, lse, new_logp, entropy, old_logp,
                    advantage, ratio, ref_gap, token_scale, prob_coeff, label_coeff, x_coeff, total, SLOT3)
                kl_kd = 0.0
                kd_weight, kd_scale = _teacher_numbers(params_ptr, TEACHER)
                kd_coeff = kd_weight * token_scale
                if HAS_KD:
                    teacher_sum = su
                    teacher_lse2 = mu + tl.log2(teacher_sum)
                    cross_sum = cross * LN2
                    if KD_TEMPERED:  # kd_scale KL(q || p_T) or kd_scale KL(p_T || q); every gradient term per element
                        student_sum = ss
                        student_lse = m * inv_temperature + tl.log(student_sum)
                        student_lse2 = student_lse * LOG2E
                        if KD_REVERSE:
                            kd_gap = cross_sum / student_sum  # E_pT[x/T - u]
                            kd_gap2 = kd_gap * LOG2E
                            kl_kd = kd_gap - student_lse + teacher_lse2 * LN2
                        else:
                            kl_kd = cross_sum / teacher_sum - teacher_lse2 * LN2 + student_lse
                        kl_kd = kl_kd * kd_scale
                    elif KD_REVERSE:
                        mean_gap = cross_sum / s  # E_p[x - u]
                        kl_kd = mean_gap - lse + teacher_lse2 * LN2
                        prob_coeff -= kd_coeff * mean_gap  # kd_coeff is 0 at weight 0
                    else:
                        kl_kd = cross_sum / teacher_sum - teacher_lse2 * LN2 + lse
                        prob_coeff += kd_coeff
                if write:
                    _store_common_terms(
                        token_rows, rows_stride, lse, new_logp, entropy, in_shard, old_logp, advantage, kl_kd,
                        prob_coeff, label_coeff, x_coeff, teacher_lse2 * LN2, student_lse2 * LN2, kd_gap2 * LN2,
                        token_scale, kd_weight, total, LAYOUT, TEACHER)
        if COMPUTE_GRAD and SPLIT_PHASE != SPLIT_PUBLISH:
            lse2 = lse * LOG2E
            prob_coeff = prob_coeff * grad_coeff
            label_coeff = label_coeff * grad_coeff
            kd_weight, kd_scale = _teacher_numbers(params_ptr, TEACHER)
            kd_grad_coeff = kd_weight * token_scale * grad_coeff * (LN2 if KD_REVERSE or KD_JSD else 1.0)
            if KD_JSD:  # d/dp_s of the JSD is (1 - beta) log(p_s / M)
                kd_grad_coeff = kd_grad_coeff * (1.0 - tl.exp2(log2_beta))
            if KD_TEMPERED:  # kd_scale * d/dx of a KL of x/T
                kd_grad_coeff = kd_grad_coeff * (kd_scale * inv_temperature)
            x_coeff = x_coeff * grad_coeff * LN2
            if SINGLE_PASS:
                # One row in one block: p = 2^(x2 - m) / s reuses the stats pass's exponentials.
                if MODE == MODE_GRAD:
                    p = tl.exp2(x2 - lse2)
                else:
                    p = e * (1.0 / s)
                _write_grad_block(grad_row, offsets, n_cols, p, x2, u2, prob_coeff, kd_grad_coeff, x_coeff,
                                  teacher_lse2, inv_temperature, student_lse2, kd_gap2, log2_beta, log2_rest,
                                  inv_softcap2, HAS_SOFTCAP, KD_GRAD, KD_REVERSE, KD_TEMPERED, KD_JSD, X_TERM, True)
            else:
                # Backwards, so the blocks the stats pass read last are the first re-read (L2 hits); the
                # re-read is evict-first. In place is safe: each thread stores only elements it loaded
                # earlier, and a prefetched block is loaded an iteration before its own store.
                if PREFETCH:
                    z_next, teacher_next = _load_pair(logits_row, teacher_row,
                                                      tl.maximum(end_full - 1, 0) * BLOCK + offsets, n_cols, KD_GRAD,
                                                      False, "evict_first")
                if own_tail:
                    tail = n_full * BLOCK + offsets
                    z_raw, teacher_raw = _load_pair(logits_row, teacher_row, tail, n_cols, KD_GRAD, True, "evict_first")
                    _store_grad_block(grad_row, z_raw, teacher_raw, tail, n_cols, x_scale, softcap, u_scale, lse2,
                                      teacher_lse2, inv_temperature, student_lse2, kd_gap2, log2_beta, log2_rest,
                                      prob_coeff, kd_grad_coeff, x_coeff, inv_softcap2, HAS_SOFTCAP, KD_GRAD,
                                      KD_REVERSE, KD_TEMPERED, KD_JSD, X_TERM, True)
                for step in range(0, end_full - first):
                    block_offsets = (end_full - 1 - step) * BLOCK + offsets
                    if PREFETCH:
                        z_raw, teacher_raw = z_next, teacher_next
                        z_next, teacher_next = _load_pair(logits_row, teacher_row,
                                                          tl.maximum(end_full - 2 - step, first) * BLOCK + offsets,
                                                          n_cols, KD_GRAD, False, "evict_first")
                    else:
                        z_raw, teacher_raw = _load_pair(logits_row, teacher_row, block_offsets, n_cols, KD_GRAD, False,
                                                        "evict_first")
                    _store_grad_block(grad_row, z_raw, teacher_raw, block_offsets, n_cols, x_scale, softcap, u_scale,
                                      lse2, teacher_lse2, inv_temperature, student_lse2, kd_gap2, log2_beta,
                                      log2_rest, prob_coeff, kd_grad_coeff, x_coeff, inv_softcap2, HAS_SOFTCAP,
                                      KD_GRAD, KD_REVERSE, KD_TEMPERED, KD_JSD, X_TERM, False)
            if owns_label:
                # The label's element: the blocks above left out -label_coeff; rewrite it once the
                # whole CTA's block stores are done (the barrier orders them before this one).
                tl.debug_barrier()
                u2_label = x2_label
                if KD_GRAD:
                    u2_label = _load_u2(teacher_row + local_label, 0, 1, u_scale, False, "evict_first")
                label_grad = _grad(tl.exp2(x2_label - lse2), x2_label, u2_label, prob_coeff, kd_grad_coeff, x_coeff,
                                   teacher_lse2, inv_temperature, student_lse2, kd_gap2, log2_beta, log2_rest,
                                   label_coeff, inv_softcap2, HAS_SOFTCAP, KD_GRAD, KD_REVERSE, KD_TEMPERED, KD_JSD,
                                   X_TERM)
                tl.store(grad_row + local_label, label_grad.to(grad_ptr.dtype.element_ty))
    else:
        # Neutral, finite values: a masked row contributes nothing and never makes a NaN.
        token_rows = rows_ptr + row
        if MODE == MODE_STATS:
            store_row(token_rows, LAYOUT.max, rows_stride, 0.0)
            store_row(token_rows, LAYOUT.sum_exp, rows_stride, 1.0)
            store_row(token_rows, LAYOUT.label_logit, rows_stride, 0.0)
            store_row(token_rows, LAYOUT.moment, rows_stride, 0.0)
            if HAS_KD:
                store_row(token_rows, LAYOUT.teacher_max, rows_stride, 0.0)
                store_row(token_rows, LAYOUT.teacher_sum_exp, rows_stride, 1.0)
                store_row(token_rows, LAYOUT.cross, rows_stride, 0.0)
                if KD_TEMPERED:
                    store_row(token_rows, LAYOUT.tempered_sum_exp, rows_stride, 1.0)
        if MODE == MODE_FUSED and SPLIT_PHASE != SPLIT_PUBLISH:
            if part == 0:
                for index in tl.static_range(N_ROWS):
                    store_row(token_rows, index, rows_stride, 0.0)
        if COMPUTE_GRAD and SPLIT_PHASE != SPLIT_PUBLISH:
            zeros = tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty)
            for block in range(first, end_full):
                tl.store(grad_row + block * BLOCK + offsets, zeros, cache_modifier=".cs")
            if own_tail:
                tail = n_full * BLOCK + offsets
                tl.store(grad_row + tail, zeros, mask=tail < n_cols, cache_modifier=".cs")


@triton.jit
def jsd_sums_kernel(
    logits_ptr, logits_stride, teacher_ptr, teacher_stride, labels_ptr, rows_ptr, rows_stride, n_cols, logit_scale,
    softcap, inv_temperature, beta, HAS_SOFTCAP: tl.constexpr, TEMPERED: tl.constexpr, BLOCK: tl.constexpr,
):
    """The generalized JSD's second vocab pass (0 < beta < 1), one program per token row, once the
    log-partitions are known: M = beta*q + (1-beta)*p_s is a mixture of the two normalised softmaxes, so
    unlike the KLs it has no online form. Reads rows 0 and 1 (the student's log-partition of its KL
    softmax p_s, at x/T with TEMPERED; the teacher's of u = t/T), writes row 2 = beta*KL(q || M) +
    (1-beta)*KL(p_s || M) (the loss) and row 3 = KL(p_s || M) (the gradient's mean term), both sums over
    this program's columns (additive over vocab shards); 0 on masked rows."""
    row = tl.program_id(0).to(tl.int64)
    token_rows = rows_ptr + row
    student_kl = 0.0
    teacher_kl = 0.0
    if tl.load(labels_ptr + row) != IGNORE_INDEX:
        x_scale = logit_scale / softcap if HAS_SOFTCAP else logit_scale * LOG2E
        u_scale = inv_temperature * LOG2E
        student_lse2 = tl.load(token_rows) * LOG2E
        teacher_lse2 = tl.load(token_rows + rows_stride) * LOG2E
        log2_beta = tl.log2(beta)
        log2_rest = tl.log2(1.0 - beta)
        offsets = tl.arange(0, BLOCK)
        student_lanes = tl.zeros([BLOCK], dtype=tl.float32)
        teacher_lanes = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            columns = start + offsets
            valid = columns < n_cols
            x2 = _x2_of(_load_raw(logits_ptr + row * logits_stride, columns, n_cols, True, "evict_first"), columns,
                        n_cols, x_scale, softcap, HAS_SOFTCAP, True)
            if TEMPERED:
                x2 = x2 * inv_temperature
            u2 = _load_u2(teacher_ptr + row * teacher_stride, columns, n_cols, u_scale, True, "evict_first")
            log_p2 = tl.where(valid, x2 - student_lse2, 0.0)
            log_q2 = tl.where(valid, u2 - teacher_lse2, 0.0)
            student_part = log_p2 + log2_rest
            teacher_part = log_q2 + log2_beta
            top = tl.maximum(student_part, teacher_part)
            log_m2 = top + tl.log2(tl.exp2(student_part - top) + tl.exp2(teacher_part - top))
            student_lanes += tl.where(valid, tl.exp2(log_p2) * (log_p2 - log_m2), 0.0)
            teacher_lanes += tl.where(valid, tl.exp2(log_q2) * (log_q2 - log_m2), 0.0)
        student_kl = tl.sum(student_lanes, 0) * LN2
        teacher_kl = tl.sum(teacher_lanes, 0) * LN2
    tl.store(token_rows + 2 * rows_stride, beta * teacher_kl + (1.0 - beta) * student_kl)
    tl.store(token_rows + 3 * rows_stride, student_kl)


@triton.jit
def row_sums_kernel(values_ptr, sums_ptr, n_cols, BLOCK: tl.constexpr):
    """sums[k] = sum over t of values[k, t] for a contiguous (K, T) fp32 buffer, one program per row,
    lanes accumulated in a fixed order then reduced once (deterministic): the fused call's tail."""
    row_ptr = values_ptr + tl.program_id(0).to(tl.int64) * n_cols
    offsets = tl.arange(0, BLOCK)
    lanes = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        lanes += tl.load(row_ptr + start + offsets, mask=start + offsets < n_cols, other=0.0)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(lanes, 0))
