"""Per-document passes on the GPU: sums over each document's tokens, block-parallel, no sort, no sync.

A document is a run of equal ids in the flattened batch (`children.policy.document_slots` is the torch
form of the same numbering); masked tokens belong to their run but count for nothing. Each program
takes BLOCK consecutive tokens and gives every one of them the sums over its whole run (`_run_sums`):

- inside the block, a segmented scan backward from each run's last token sums to the run's end, and
  a forward scan carries the value at the run's first token (its sum in the block) to all its tokens;
- a run crossing the block's first (last) token adds the sums over its tokens before (after) the
  block, found by walking outward BLOCK tokens at a time until another id appears: the walk is as
  long as that run, so one launch costs O(T) for documents no longer than a block and grows with
  the square of the length in blocks beyond that (a 32k-token document in 1024-token blocks: 32
  programs walking up to 32 blocks each).

Sums of counts are exact (float32 holds integers up to 2^24); other sums are float32 in a fixed
order, deterministic, and the same for every token of a run within a program (a run split across
programs may differ between its parts in the last bit).

Two passes use it:
- `document_mean_weights`: loss_type grpo's w_t = scale / |i| (GRPO, CISPO), bit for bit the torch
  form's (`div_rn` rounds like torch's division);
- `gspo_seam`: GSPO's whole tail between the fused launch and the grad launch (children/gspo.py has
  the torch form and the formulas): the per-document ratio, the clipped surrogate, its per-token
  coefficient added to the fused launch's state rows, the loss and the document metrics written at
  each document's first unmasked token into its rows of the (K, T) term buffer, so the launcher's
  one row-sum launch reduces them with everything else.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from fastlm.losses.tensors import IGNORE_INDEX, LossNormalizers, LossTargets, safe_inverse
from fastlm.losses.triton.terms import expm1


class SeamChild(Protocol):
    """What `gspo_seam` reads of its child, children/gspo.py's `GSPO` (a protocol: the children reach this
    file through document_weights.py, so it names none of them back)."""

    @property
    def name(self) -> str: ...
    @property
    def weight(self) -> float: ...
    @property
    def loss_type(self) -> str: ...
    @property
    def beta(self) -> float: ...
    @property
    def entropy_coeff(self) -> float: ...
    @property
    def entropy_weighted_apart(self) -> bool: ...
    @property
    def eps_low(self) -> float: ...
    @property
    def eps_high(self) -> float: ...
    @property
    def delta(self) -> float: ...
    def call_weights(self, targets: LossTargets, normalizers: LossNormalizers) -> torch.Tensor | None: ...
    def call_entropy_weights(self, targets: LossTargets, normalizers: LossNormalizers) -> torch.Tensor: ...


class SeamRows(Protocol):
    """What `gspo_seam` reads of the fused launch's row layout, interface.py's `FusedLayout` (which imports this
    file for `SEAMS`)."""

    state: int
    state_names: tuple[str, ...]

    def row(self, child: str, name: str) -> int: ...

MAX_BLOCK = 1024  # tokens per program (one 16k-token call: 16 programs)
WARPS = 4
# How a policy pass gets w_t, its loss_type weight (children/policy.py): `w_scale` on every unmasked
# token (dapo), a per-token vector (`PolicyChild.call_weights`), or w_scale / |i| (loss_type grpo,
# computed here from the run's count, so GSPO needs no weights launch first). Globals a @triton.jit
# function reads are constexpr; the launcher passes `.value`.
CONSTANT = tl.constexpr(0)
VECTOR = tl.constexpr(1)
DOCUMENT_MEAN = tl.constexpr(2)


@triton.jit
def _segment_sum(count_a, x_a, y_a, w_a, edge_a, count_b, x_b, y_b, w_b, edge_b):
    """Combine of a segmented sum: the sum restarts at an element whose `edge` is set (a run's last
    token, scanning backward)."""
    restart = edge_b != 0
    return (tl.where(restart, count_b, count_a + count_b), tl.where(restart, x_b, x_a + x_b),
            tl.where(restart, y_b, y_a + y_b), tl.where(restart, w_b, w_a + w_b), edge_a | edge_b)


@triton.jit
def _segment_head(count_a, x_a, y_a, w_a, edge_a, count_b, x_b, y_b, w_b, edge_b):
    """Combine that carries the value of each segment's first element (`edge` set) forward."""
    restart = edge_b != 0
    return (tl.where(restart, count_b, count_a), tl.where(restart, x_b, x_a), tl.where(restart, y_b, y_a),
            tl.where(restart, w_b, w_a), edge_a | edge_b)


@triton.jit
def _segment_count(count_a, edge_a, count_b, edge_b):
    """Combine of a segmented count, restarting at a run's first token (scanning forward)."""
    return tl.where(edge_b != 0, count_b, count_a + count_b), edge_a | edge_b


@triton.jit
def _token_values(t, valid, labels_ptr, new_logp_ptr, old_logp_ptr, advantages_ptr, weights_ptr, w_scale,
                  POLICY: tl.constexpr, WEIGHTS: tl.constexpr, IGNORE: tl.constexpr):
    """What a run sums, per token (all 0 on masked tokens, whatever is stored there): 1 per unmasked
    token and, for a policy pass, new_logp - old_logp, the advantage and w_t (WEIGHTS; 0 with
    DOCUMENT_MEAN, whose run sum is w_scale)."""
    unmasked = valid & (tl.load(labels_ptr + t, mask=valid, other=IGNORE) != IGNORE)
    count = unmasked.to(tl.float32)
    if POLICY:
        new_logp = tl.load(new_logp_ptr + t, mask=unmasked, other=0.0)
        old_logp = tl.load(old_logp_ptr + t, mask=unmasked, other=0.0).to(tl.float32)
        log_ratio = tl.where(unmasked, new_logp - old_logp, 0.0)
        advantage = tl.where(unmasked, tl.load(advantages_ptr + t, mask=unmasked, other=0.0).to(tl.float32), 0.0)
        if WEIGHTS == VECTOR:
            w = tl.where(unmasked, tl.load(weights_ptr + t, mask=unmasked, other=0.0), 0.0)
        elif WEIGHTS == CONSTANT:
            w = count * w_scale
        else:
            w = tl.zeros_like(count)
        return count, log_ratio, advantage, w
    zero = tl.zeros_like(count)
    return count, zero, zero, zero


@triton.jit
def _outside_sums(ids_ptr, edge, n, step, labels_ptr, new_logp_ptr, old_logp_ptr, advantages_ptr, weights_ptr,
                  w_scale, BLOCK: tl.constexpr, POLICY: tl.constexpr, WEIGHTS: tl.constexpr,
                  IGNORE: tl.constexpr):
    """Sums over the tokens of token `edge`'s run beyond it in direction `step` (-1: before, +1:
    after), walking BLOCK tokens at a time until another id (or the call's end) stops the run."""
    offsets = tl.arange(0, BLOCK)
    run = tl.load(ids_ptr + edge)
    neighbour = edge + step
    inside = (neighbour >= 0) & (neighbour < n)
    more = inside & (tl.load(ids_ptr + tl.minimum(tl.maximum(neighbour, 0), n - 1)) == run)
    count = 0.0
    log_ratio = 0.0
    advantage = 0.0
    w = 0.0
    while more:
        t = neighbour + step * offsets  # walking away from `edge`
        valid = (t >= 0) & (t < n)
        other = valid & (tl.load(ids_ptr + t, mask=valid) != run)
        stop = tl.min(tl.where(other, offsets, BLOCK), 0)  # steps to the first token of another run
        c, x, y, z = _token_values(t, valid & (offsets < stop), labels_ptr, new_logp_ptr, old_logp_ptr,
                                   advantages_ptr, weights_ptr, w_scale, POLICY, WEIGHTS, IGNORE)
        count += tl.sum(c, 0)
        log_ratio += tl.sum(x, 0)
        advantage += tl.sum(y, 0)
        w += tl.sum(z, 0)
        neighbour += step * BLOCK
        more = (stop == BLOCK) & (neighbour >= 0) & (neighbour < n)
    return count, log_ratio, advantage, w


@triton.jit
def _run_sums(ids_ptr, labels_ptr, new_logp_ptr, old_logp_ptr, advantages_ptr, weights_ptr, w_scale, n,
              BLOCK: tl.constexpr, POLICY: tl.constexpr, WEIGHTS: tl.constexpr, IGNORE: tl.constexpr):
    """This program's tokens t, whether each is unmasked, its `_token_values` summed over its whole run
    (count, log_ratio, advantage, w: the same for every token of a run in this block), and the
    unmasked tokens of its run up to it (inclusive)."""
    start = tl.program_id(0) * BLOCK
    t = start + tl.arange(0, BLOCK)
    inside = t < n
    ids = tl.load(ids_ptr + t, mask=inside)
    first = inside & ((t == 0) | (ids != tl.load(ids_ptr + t - 1, mask=inside & (t > 0))))
    last = inside & ((t == n - 1) | (ids != tl.load(ids_ptr + t + 1, mask=t + 1 < n)))
    c, x, y, z = _token_values(t, inside, labels_ptr, new_logp_ptr, old_logp_ptr, advantages_ptr, weights_ptr,
                               w_scale, POLICY, WEIGHTS, IGNORE)
    # Backward from each run's last token: sums to the run's end (in the block); then the value at the
    # run's first token in the block (the run's sum there) carried forward to all its tokens.
    sc, sx, sy, sz, ended = tl.associative_scan((c, x, y, z, last.to(tl.int32)), 0, _segment_sum, reverse=True)
    head = (first | (t == start)).to(tl.int32)
    count, log_ratio, advantage, w, _ = tl.associative_scan((sc, sx, sy, sz, head), 0, _segment_head)
    prefix_count, started = tl.associative_scan((c, first.to(tl.int32)), 0, _segment_count)
    # The run holding the block's first (last) token may begin before (end after) the block: `started`
    # (`ended`) is 0 on that run's tokens.
    before = started == 0
    after = ended == 0
    bc, bx, by, bz = _outside_sums(ids_ptr, start, n, -1, labels_ptr, new_logp_ptr, old_logp_ptr, advantages_ptr,
                                   weights_ptr, w_scale, BLOCK, POLICY, WEIGHTS, IGNORE)
    ac, ax, ay, az = _outside_sums(ids_ptr, tl.minimum(start + BLOCK, n) - 1, n, 1, labels_ptr, new_logp_ptr,
                                   old_logp_ptr, advantages_ptr, weights_ptr, w_scale, BLOCK, POLICY,
                                   WEIGHTS, IGNORE)
    count += tl.where(before, bc, 0.0) + tl.where(after, ac, 0.0)
    log_ratio += tl.where(before, bx, 0.0) + tl.where(after, ax, 0.0)
    advantage += tl.where(before, by, 0.0) + tl.where(after, ay, 0.0)
    w += tl.where(before, bz, 0.0) + tl.where(after, az, 0.0)
    return t, inside & (c > 0.0), count, log_ratio, advantage, w, prefix_count + tl.where(before, bc, 0.0)


@triton.jit
def _mean_weights_kernel(ids_ptr, labels_ptr, weights_ptr, n, scale, BLOCK: tl.constexpr, IGNORE: tl.constexpr):
    """weights[t] = scale / (unmasked tokens of t's run) on unmasked tokens, else 0 (no policy values)."""
    t, unmasked, count, _, _, _, _ = _run_sums(ids_ptr, labels_ptr, labels_ptr, labels_ptr, labels_ptr, labels_ptr,
                                               0.0, n, BLOCK, False, CONSTANT, IGNORE)
    # count >= 1 on an unmasked token; div_rn rounds like torch's division
    weight = tl.math.div_rn(tl.full([BLOCK], scale, tl.float32), tl.maximum(count, 1.0))
    tl.store(weights_ptr + t, tl.where(unmasked, weight, 0.0), mask=t < n)


def _block(tokens: int, max_block: int) -> int:
    return min(max_block, triton.next_power_of_2(max(tokens, 1)))


def document_mean_weights(
    document_ids: torch.Tensor, labels: torch.Tensor, scale: float, max_block: int = MAX_BLOCK
) -> torch.Tensor:
    """(T,) float32: `scale` / (unmasked tokens of the token's document) on unmasked tokens, 0 on
    masked ones; documents are runs of equal `document_ids`, masked tokens are labels -100.
    `max_block` (a power of two) caps the tokens per program (tests use small ones)."""
    tokens = labels.numel()
    weights = torch.empty(tokens, dtype=torch.float32, device=labels.device)
    if tokens == 0:
        return weights
    block = _block(tokens, max_block)
    _mean_weights_kernel[(triton.cdiv(tokens, block),)](document_ids.contiguous(), labels.contiguous(), weights,
                                                        tokens, float(scale), BLOCK=block, IGNORE=IGNORE_INDEX,
                                                        num_warps=WARPS)
    return weights


@triton.jit
def _gspo_seam_kernel(
    ids_ptr, labels_ptr, terms_ptr, old_logp_ptr, advantages_ptr, ref_logp_ptr, weights_ptr, entropy_weights_ptr,
    n, w_scale, per_document, weight, eps_low, eps_high, delta, beta, entropy_coeff, first_row, lse_row,
    new_logp_row, entropy_row, prob_row, label_row, x_row,
    WEIGHTS: tl.constexpr, REF: tl.constexpr, ENTROPY: tl.constexpr, ENTROPY_WEIGHTS: tl.constexpr,
    GRAD: tl.constexpr, BLOCK: tl.constexpr, IGNORE: tl.constexpr,
):
    """GSPO's tail on the fused launch's (K, T) term buffer: rows `first_row`.. (loss, ratio, advantage,
    low, high, region, num_documents: `GSPO.slot` rows after the token metrics) for every token, the
    document's values at its first unmasked token and 0 elsewhere; with GRAD the coefficients added to
    the state rows prob/label (and x with ENTROPY) in place. The entropy bonus weighs a token by v_t, read
    from `entropy_weights_ptr` with ENTROPY_WEIGHTS (a token mean apart from w_t), else w_t."""
    t, unmasked, count, log_ratio, advantage_sum, document_w, prefix = _run_sums(
        ids_ptr, labels_ptr, terms_ptr + new_logp_row * n, old_logp_ptr, advantages_ptr, weights_ptr, w_scale, n,
        BLOCK, True, WEIGHTS, IGNORE)
    inside = t < n
    length = tl.maximum(count, 1.0)
    ratio = tl.where(unmasked, tl.exp(log_ratio / length), 0.0)
    advantage = advantage_sum / length
    clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
    document_loss = -tl.minimum(tl.minimum(ratio, delta) * advantage, clipped * advantage)
    active = tl.where(advantage >= 0.0, ratio <= 1.0 + eps_high, (ratio >= 1.0 - eps_low) & (ratio <= delta))
    slope = tl.where(active, ratio * advantage, 0.0)
    # w_t (the per-token regularisers' weight) and the document's W_i = sum of w_t
    if WEIGHTS == VECTOR:
        w = tl.where(unmasked, tl.load(weights_ptr + t, mask=unmasked, other=0.0), 0.0)
    elif WEIGHTS == CONSTANT:
        w = tl.where(unmasked, w_scale, 0.0)
    else:  # div_rn rounds like torch's division (`PolicyChild.token_weights`)
        w = tl.where(unmasked, tl.math.div_rn(tl.full([BLOCK], w_scale, tl.float32), length), 0.0)
        document_w = tl.where(unmasked, w_scale, 0.0)
    head = unmasked & (prefix == 1.0)  # the document's first unmasked token holds its values
    loss = tl.where(head, document_loss * document_w, 0.0)
    coefficient = slope * (document_w / length) * weight
    new_logp = tl.load(terms_ptr + new_logp_row * n + t, mask=inside, other=0.0)
    if REF:
        gap = tl.where(unmasked, tl.load(ref_logp_ptr + t, mask=unmasked, other=0.0).to(tl.float32) - new_logp, 0.0)
        loss += beta * (expm1(gap) - gap) * w
        coefficient += expm1(gap) * (w * beta * weight)
    v = w
    if ENTROPY_WEIGHTS:
        v = tl.where(unmasked, tl.load(entropy_weights_ptr + t, mask=unmasked, other=0.0), 0.0)
    if ENTROPY:
        entropy = tl.load(terms_ptr + entropy_row * n + t, mask=inside, other=0.0)
        loss -= entropy_coeff * entropy * v
    low = ((ratio < 1.0 - eps_low) & (advantage < 0.0)).to(tl.float32)
    high = ((ratio > 1.0 + eps_high) & (advantage > 0.0)).to(tl.float32)
    rows = terms_ptr + first_row * n + t
    tl.store(rows, loss, mask=inside)
    tl.store(rows + n, tl.where(head, ratio * per_document, 0.0), mask=inside)
    tl.store(rows + 2 * n, tl.where(head, advantage * per_document, 0.0), mask=inside)
    tl.store(rows + 3 * n, tl.where(head, low * per_document, 0.0), mask=inside)
    tl.store(rows + 4 * n, tl.where(head, high * per_document, 0.0), mask=inside)
    tl.store(rows + 5 * n, tl.where(head, tl.maximum(low, high) * per_document, 0.0), mask=inside)
    tl.store(rows + 6 * n, head.to(tl.float32), mask=inside)
    if GRAD:
        prob = tl.load(terms_ptr + prob_row * n + t, mask=inside, other=0.0) + coefficient
        label = tl.load(terms_ptr + label_row * n + t, mask=inside, other=0.0) + coefficient
        if ENTROPY:
            bonus = v * entropy_coeff * weight
            prob -= bonus * (tl.load(terms_ptr + lse_row * n + t, mask=inside, other=0.0) - entropy)
            x = tl.load(terms_ptr + x_row * n + t, mask=inside, other=0.0) + bonus
            tl.store(terms_ptr + x_row * n + t, x, mask=unmasked)
        tl.store(terms_ptr + prob_row * n + t, prob, mask=unmasked)
        tl.store(terms_ptr + label_row * n + t, label, mask=unmasked)


def gspo_seam(child: SeamChild, terms: torch.Tensor, layout: SeamRows, targets: LossTargets,
              normalizers: LossNormalizers, max_block: int = MAX_BLOCK) -> None:
    """GSPO's tail in one launch on the fused launch's term buffer `terms` (rows by `layout`): its loss
    and document metrics rows, its coefficients added to the state rows. `max_block`: tokens per program."""
    tokens = terms.shape[1]
    if tokens == 0:
        return
    if child.loss_type == "grpo":
        mode, w_scale, weights = DOCUMENT_MEAN.value, safe_inverse(normalizers.documents), None
    else:
        weights = child.call_weights(targets, normalizers)  # None for dapo
        mode, w_scale = (CONSTANT.value, safe_inverse(normalizers.tokens)) if weights is None else (VECTOR.value, 0.0)
    state = {name: layout.state + index for index, name in enumerate(layout.state_names)}
    apart = child.entropy_weighted_apart
    entropy_weights = child.call_entropy_weights(targets, normalizers).contiguous() if apart else terms
    block = _block(tokens, max_block)
    _gspo_seam_kernel[(triton.cdiv(tokens, block),)](
        targets.document_ids.contiguous(), targets.labels.contiguous(), terms, targets.old_logp.contiguous(),
        targets.advantages.contiguous(), targets.ref_logp.contiguous() if child.beta > 0 else terms,
        terms if weights is None else weights.contiguous(), entropy_weights, tokens, w_scale,
        safe_inverse(normalizers.documents),
        float(child.weight), float(child.eps_low), float(child.eps_high),
        min(float(child.delta), 3.0e38), float(child.beta), float(child.entropy_coeff),
        layout.row(child.name, "loss"), state["lse"], state["new_logp"],
        state["entropy"], state["prob_coeff"], state["label_coeff"], state["x_coeff"],
        WEIGHTS=mode, REF=child.beta > 0, ENTROPY=child.entropy_coeff > 0, ENTROPY_WEIGHTS=apart,
        GRAD=child.weight != 0, BLOCK=block, IGNORE=IGNORE_INDEX, num_warps=WARPS,
    )


# Slot kind (`KernelSlot.kind`) of a per-document child -> its tail on the fused launch's term buffer.
SEAMS = {"gspo": gspo_seam}
