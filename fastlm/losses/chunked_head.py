"""The LM head without full logits: projection, loss and both GEMM gradients over token chunks, in one
autograd node.

Per chunk c of the call's tokens (docs/design/losses.md, "The head without full logits"):

    Z_c = H_c W^T                      into one preallocated (chunk, V) buffer (`mm(out=)`)
    G_c = d loss / d Z_c               the loss implementation writes it over Z_c (`inplace`)
    dH[c] = G_c W,  dW += G_c^T H_c    into the gradients the node returns

all in the forward; backward only multiplies dH and dW by grad_output, on the device (no host read;
where Triton runs, a kernel that skips the pass when it is 1). Only (chunk, V) logits ever exist; the chunk
size comes from a memory budget (`chunking`).

- Each chunk is a complete loss call: losses and metrics are additive sums over the step, so the
  chunks' results add up. What depends on the whole call (loss_type grpo/bnpo token weights) the
  children `prepare` once, and every chunk reads its rows (`LossTargets.prepared`).
- A per-document child (GSPO) needs every token's log-prob before any coefficient: pass 1 over the
  chunks (GEMM + the implementation's stats phase, per-token state kept, logits dropped), its
  middle once on the whole call, pass 2 (GEMM again + the grad phase + dH, dW): 4 GEMMs, not 3.
- Distillation: the teacher's logits from its hidden states and head weight (`LossTargets.teacher_head`)
  into a second buffer, a piece of the chunk at a time (what the budget leaves beside a chunk from 4/5 of
  it, when the call's two logits do not both fit); each piece is one loss call, and the chunk's dH and dW
  GEMMs run once on all its rows.
  Full `teacher_logits` are sliced instead.
- Tensor parallelism: every chunk call all-reduces its statistics over the group (the
  implementations' TP form); dH is this rank's share, summed over the group by the caller's
  `copy_to_tp`.
- GEMMs run in the autocast dtype when autocast is on (as `hidden @ weight.t()` would), else in the
  inputs' dtype; dH and dW come back in hidden's and weight's dtypes. dW accumulates in the weight's
  dtype (fp32 for the trainer's fp32 weights: no buffer beyond the gradient itself), or, with
  `fp32_weight_grad`, in an fp32 buffer for a 16-bit weight (docs/losses.md states both errors).
- The value checks need only the targets: counted once on the whole call before its chunks, their copy
  to the host starts then and is read at the call's end (or joins the caller's `deferred_value_checks()`
  block), so that read does not wait for the chunks' GEMMs; the chunks' own counts are not read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import torch

from fastlm.losses.dispatch import get_implementation, get_phases
from fastlm.losses.spec import LossSpec
from fastlm.losses.tensors import LossNormalizers, LossResult, LossTargets, ProcessGroup, TeacherHead
from fastlm.losses.validation import (
    check_inputs,
    check_teacher_head,
    checked_from_targets,
    value_flags,
)

CHUNK_MULTIPLE = 128  # below GEMM_ROWS, chunk sizes are multiples of this many tokens (GEMM tiles)
# From GEMM_ROWS up, chunks are GEMM_ROWS x a power of two: the per-chunk dH GEMM (chunk x V) @ (V x H) has
# few output tiles, and on the H200 its rows cost least at 1024, 2048, 4096 (0.70-0.75 ms per 1k rows at
# H 2048, V 131072) against up to 0.94 between them; the whole head was fastest at 4096 (2048 with a
# teacher in two equal buffers, the rule then) in a sweep of budgets (docs/tuning-log.md, "Chunk size").
GEMM_ROWS = 1024
# With a teacher head, when the call's student and teacher logits do not both fit, the student's chunk
# takes up to TEACHER_PIECES / (TEACHER_PIECES + 1) of the budget and the teacher's logits the rest, a
# piece of the chunk at a time: the chunk's dH and dW GEMMs then run on twice the rows the budget would
# give two equal buffers (4096 + 1536 instead of 2048 + 2048 at 1408 MiB and V=131072: CE+kd's head 2-3%
# faster at 65536 tokens on the H100, docs/tuning-log.md, "The teacher's pieces").
TEACHER_PIECES = 4


@dataclass(frozen=True)
class Chunking:
    """Rows of the student's logits a chunk (one logits GEMM, one dH and one dW GEMM) and of the teacher's
    logits at a time within it (0 without a teacher head)."""

    tokens: int
    teacher_tokens: int = 0


def chunking(tokens: int, vocab: int, element_size: int, budget_mib: float, teacher: bool = False) -> Chunking:
    """The chunks of a call within `budget_mib` of (vocab)-column logits of `element_size` bytes. With a
    teacher head: the whole call at once when both its logits fit, else the student's chunk from
    TEACHER_PIECES / (TEACHER_PIECES + 1) of the budget and the teacher's pieces from the rest (at most
    a chunk, multiples of CHUNK_MULTIPLE from there up, at least one row)."""
    row_bytes = vocab * element_size
    limit = int(budget_mib * 2**20) // row_bytes
    if not teacher:
        return Chunking(chunk_tokens(tokens, limit))
    if 2 * tokens <= limit:
        return Chunking(max(tokens, 1), max(tokens, 1))
    chunk = chunk_tokens(tokens, limit * TEACHER_PIECES // (TEACHER_PIECES + 1))
    piece = max(1, min(chunk, limit - chunk))
    return Chunking(chunk, piece - piece % CHUNK_MULTIPLE if piece >= CHUNK_MULTIPLE else piece)


def chunk_tokens(tokens: int, limit: int) -> int:
    """Tokens per chunk when at most `limit` rows fit: all tokens when they fit, down to GEMM_ROWS x the
    largest power of two that fits; budgets under GEMM_ROWS rows take a multiple of CHUNK_MULTIPLE (at
    least one row), evened out so the call's chunks come out about equal (1100 tokens at 512 a chunk:
    3 x 384, not 2 x 512 + 76)."""
    limit = max(1, limit)
    if tokens <= limit:
        return max(tokens, 1)
    if limit >= GEMM_ROWS:
        return GEMM_ROWS * 2 ** ((limit // GEMM_ROWS).bit_length() - 1)
    if limit >= CHUNK_MULTIPLE:
        limit -= limit % CHUNK_MULTIPLE
    even = math.ceil(tokens / math.ceil(tokens / limit))
    if limit >= CHUNK_MULTIPLE:
        even = min(limit, math.ceil(even / CHUNK_MULTIPLE) * CHUNK_MULTIPLE)
    return even


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's when it is on for this device (float64 is never cast), else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"LMHead: hidden is {hidden.dtype} but weight is {weight.dtype}; outside autocast both need one dtype"
        )
    return hidden.dtype


@lru_cache(maxsize=8)
def _fp32_out_addmm(device: torch.device) -> bool:
    """Whether addmm writes fp32 from 16-bit inputs here (`addmm.dtype_out`: CUDA, not CPU)."""
    try:
        ones = torch.ones((2, 2), dtype=torch.bfloat16, device=device)
        out = torch.zeros((2, 2), dtype=torch.float32, device=device)
        torch.addmm(out, ones, ones, out_dtype=torch.float32, out=out)
        return bool(out[0, 0] == 2.0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class WeightGrad:
    """dW = sum over chunks of G_c^T H_c, accumulated in the weight's dtype or in fp32."""

    def __init__(self, weight: torch.Tensor, gemm_dtype: torch.dtype, fp32: bool) -> None:
        self.dtype = weight.dtype
        dtype = torch.float32 if fp32 else weight.dtype
        # A sum in the GEMMs' dtype starts with beta 0 (addmm_ then ignores the buffer); an fp32 sum of
        # 16-bit products (addmm's out_dtype, or the product + add) starts from zeros.
        self.same_dtype = dtype == gemm_dtype
        make = torch.empty if self.same_dtype else torch.zeros
        self.sum = make(weight.shape, dtype=dtype, device=weight.device)
        self.empty = True

    def add(self, grad: torch.Tensor, hidden: torch.Tensor) -> None:
        """sum += grad^T hidden."""
        if self.same_dtype:
            self.sum.addmm_(grad.t(), hidden, beta=0.0 if self.empty else 1.0)
        elif _fp32_out_addmm(grad.device):
            torch.addmm(self.sum, grad.t(), hidden, out_dtype=torch.float32, out=self.sum)
        else:  # CPU under autocast: the product in the GEMMs' dtype, then the fp32 sum
            self.sum.add_(torch.mm(grad.t(), hidden))
        self.empty = False

    def result(self) -> torch.Tensor:
        if self.empty:
            self.sum.zero_()
        return self.sum if self.sum.dtype == self.dtype else self.sum.to(self.dtype)


@dataclass
class _Call:
    """Everything of one head call but the two differentiable inputs."""

    targets: LossTargets
    normalizers: LossNormalizers
    spec: LossSpec
    implementation: str
    logits_memory_mib: float
    grad_scale: float
    group: ProcessGroup | None
    fp32_weight_grad: bool
    options: dict[str, Any]
    hidden_grad: bool
    weight_grad: bool


@dataclass
class _Chunks:
    """The call's token chunks: their logits (and teacher logits) in reused buffers, and the backprop of
    a chunk's logit gradient into dH and dW."""

    hidden: torch.Tensor
    weight: torch.Tensor  # in the GEMMs' dtype
    teacher: TeacherHead | None  # its weight in the GEMMs' dtype
    targets: LossTargets  # of the whole call, `prepare`d
    chunk: int
    dtype: torch.dtype
    grad_hidden: torch.Tensor | None
    grad_weight: WeightGrad | None
    teacher_chunk: int = 0  # rows of teacher logits at a time (`Chunking.teacher_tokens`)
    rows: list[slice] = field(init=False)

    def __post_init__(self) -> None:
        tokens, device = self.hidden.shape[0], self.hidden.device
        self.rows = _slices(0, max(tokens, 1), self.chunk)
        size = min(self.chunk, tokens)
        self.buffer = torch.empty((size, self.weight.shape[0]), dtype=self.dtype, device=device)
        self.teacher_buffer = None if self.teacher is None else torch.empty(
            (min(self.teacher_chunk, size), self.weight.shape[0]), dtype=self.dtype, device=device)
        self.teacher_rows: slice | None = None  # whose teacher logits the teacher buffer holds
        cast = self.hidden.dtype != self.dtype
        self.hidden_buffer = torch.empty((size, self.hidden.shape[1]), dtype=self.dtype, device=device) if cast else None
        cast_back = self.grad_hidden is not None and self.grad_hidden.dtype != self.dtype
        self.grad_buffer = torch.empty((size, self.hidden.shape[1]), dtype=self.dtype, device=device) if cast_back else None

    @property
    def backward(self) -> bool:
        return self.grad_hidden is not None or self.grad_weight is not None

    def logits(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(Z_c in the buffer, H_c in the GEMMs' dtype)."""
        count = rows.stop - rows.start
        hidden = self.hidden[rows] if self.hidden_buffer is None else self.hidden_buffer[:count].copy_(self.hidden[rows])
        return torch.mm(hidden, self.weight.t(), out=self.buffer[:count]), hidden

    def pieces(self, rows: slice, logits: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor, LossTargets]]:
        """The chunk's loss calls: (their rows, their logits, their targets); with a teacher head one per
        `teacher_chunk` rows, its teacher logits computed into the teacher buffer (unless it holds them)."""
        if self.teacher is None:
            yield rows, logits, self.targets.rows(rows)
            return
        for piece in _slices(rows.start, rows.stop, self.teacher_chunk):
            count = piece.stop - piece.start
            teacher_logits = self.teacher_buffer[:count]
            if self.teacher_rows != piece:
                self.teacher.rows(piece).logits(self.dtype, out=teacher_logits)
                self.teacher_rows = piece
            targets = replace(self.targets.rows(piece), teacher_logits=teacher_logits, teacher_head=None)
            yield piece, logits[piece.start - rows.start : piece.stop - rows.start], targets

    def backprop(self, grad: torch.Tensor, hidden: torch.Tensor, rows: slice) -> None:
        """dH[rows] = G_c W; dW += G_c^T H_c."""
        if self.grad_hidden is not None:
            if self.grad_buffer is None:
                torch.mm(grad, self.weight, out=self.grad_hidden[rows])
            else:
                self.grad_hidden[rows].copy_(torch.mm(grad, self.weight, out=self.grad_buffer[: grad.shape[0]]))
        if self.grad_weight is not None:
            self.grad_weight.add(grad, hidden)


def _slices(start: int, stop: int, size: int) -> list[slice]:
    return [slice(first, min(first + size, stop)) for first in range(start, stop, size)]


def _one_pass(chunks: _Chunks, call: _Call) -> LossResult:
    """Each piece of a chunk a whole loss call with its gradient written over its logits, then the
    chunk backpropagated."""
    implementation = get_implementation(call.implementation)
    results = []
    for rows in chunks.rows:
        logits, hidden = chunks.logits(rows)
        for _, piece_logits, targets in chunks.pieces(rows, logits):
            result, _ = implementation(piece_logits, targets, call.normalizers, call.spec, grad_scale=call.grad_scale,
                                       group=call.group, compute_grad=chunks.backward, inplace=True, **call.options)
            results.append(result)
        if chunks.backward:
            chunks.backprop(logits, hidden, rows)
    return _sum_results(results)


def _two_pass(chunks: _Chunks, call: _Call) -> LossResult:
    """Stats phase per piece, the middle on the whole call, then GEMM again + grad phase per piece (one
    chunk: its logits are still in the buffer; one piece: its teacher logits too)."""
    phases = get_phases(call.implementation)
    states, logits, hidden = [], None, None
    for rows in chunks.rows:
        logits, hidden = chunks.logits(rows)
        states += [phases.stats(piece_logits, targets, call.normalizers, call.spec, group=call.group, **call.options)
                   for _, piece_logits, targets in chunks.pieces(rows, logits)]
    result, coefficients, _ = phases.finish(states, logits, chunks.targets, call.normalizers, call.spec,
                                            grad_scale=call.grad_scale, group=call.group)  # counts: checked once, above
    if chunks.backward:
        for rows in chunks.rows:
            if len(chunks.rows) > 1:
                logits, hidden = chunks.logits(rows)
            for piece, piece_logits, targets in chunks.pieces(rows, logits):
                phases.grad(piece_logits, targets, call.normalizers, call.spec, coefficients.rows(piece), piece_logits,
                            group=call.group, **call.options)
            chunks.backprop(logits, hidden, rows)
    return result


def _sum_results(results: list[LossResult]) -> LossResult:
    """The chunks' additive results summed, one stack + sum for every value."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    losses, metrics = list(first.losses), list(first.metrics)
    dtype = first.loss.dtype
    table = torch.stack([
        torch.stack([r.loss.to(dtype), *(r.losses[k].to(dtype) for k in losses), *(r.metrics[k].to(dtype) for k in metrics)])
        for r in results
    ]).sum(0)
    values = table.unbind()
    return LossResult(values[0], dict(zip(losses, values[1 : 1 + len(losses)])), dict(zip(metrics, values[1 + len(losses) :])))


def _prepare(targets: LossTargets, normalizers: LossNormalizers, spec: LossSpec, dtype: torch.dtype) -> LossTargets:
    """The children's whole-call per-token tensors (`LossChild.prepare`), computed once."""
    prepared = {
        f"{child.name}/{name}": tensor
        for child in spec.children
        for name, tensor in child.prepare(targets, normalizers, dtype).items()
    }
    return replace(targets, prepared=prepared) if prepared else targets


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, call: _Call
) -> tuple[LossResult, torch.Tensor | None, WeightGrad | None]:
    spec, targets, normalizers, group = call.spec, call.targets, call.normalizers, call.group
    dtype = compute_dtype(hidden, weight)
    tokens, vocab = hidden.shape[0], weight.shape[0]
    teacher = None
    if spec.teacher is not None and targets.teacher_logits is None and targets.teacher_head is not None:
        check_teacher_head(targets.teacher_head, tokens, vocab, group)
        teacher = replace(targets.teacher_head, weight=targets.teacher_head.weight.to(dtype))
    plan = chunking(tokens, vocab, dtype.itemsize, call.logits_memory_mib, teacher is not None)
    # The whole call's host checks, on a shape-only stand-in for its (tokens, vocab) logits.
    stand_in = torch.empty((tokens, vocab), dtype=dtype, device="meta")
    check_inputs(stand_in, targets if teacher is None else replace(targets, teacher_logits=stand_in), normalizers, spec, group)
    targets = _prepare(targets, normalizers, spec, torch.promote_types(dtype, torch.float32))
    grad_hidden = torch.empty_like(hidden) if call.hidden_grad else None
    grad_weight = WeightGrad(weight, dtype, call.fp32_weight_grad) if call.weight_grad else None
    with torch.autocast(hidden.device.type, enabled=False):
        _, counts = value_flags(stand_in, targets, spec, group)
        with checked_from_targets(counts, stand_in, targets, normalizers, spec, group):
            chunks = _Chunks(hidden, weight.to(dtype), teacher, targets, plan.tokens, dtype, grad_hidden, grad_weight,
                             plan.teacher_tokens)
            result = (_two_pass if spec.whole_call else _one_pass)(chunks, call)
    return result, grad_hidden, grad_weight


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, call: _Call, holder: list[LossResult]) -> torch.Tensor:  # type: ignore[override]
        result, grad_hidden, grad_weight = _forward(hidden, weight, call)
        ctx.grads = (grad_hidden, None if grad_weight is None else grad_weight.result())
        ctx.triton = hidden.is_cuda or call.implementation == "triton"
        holder.append(result)
        return result.loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise RuntimeError(
                "the chunked LM head computes its gradients in the forward and hands them over once; a second "
                "backward through it (retain_graph) is not supported: set model.head.logits_memory_mib: 0"
            )
        grads, ctx.grads = ctx.grads, None  # released, so autograd may take them as .grad without a copy
        # Scaled on the device: reading grad_output to skip a multiply by 1 would make the host wait for the
        # forward once per micro-batch. Where Triton runs, a kernel reads it on the device and skips the pass
        # over dW when it is 1 (what loss.backward() passes): up to 1.4 ms a call on the H100 (head_chunks.py).
        if ctx.triton:
            from fastlm.losses.triton.scale import scale_unless_one as scale
        else:
            scale = torch.Tensor.mul_
        for grad in grads:
            if grad is not None:
                scale(grad, grad_output)
        return (*grads, None, None)


def chunked_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: LossTargets,
    normalizers: LossNormalizers,
    spec: LossSpec,
    implementation: str,
    logits_memory_mib: float,
    *,
    grad_scale: float = 1.0,
    group: ProcessGroup | None = None,
    fp32_weight_grad: bool = False,
    options: dict[str, Any] | None = None,
) -> LossResult:
    """The monolithic loss of `hidden @ weight.T` (hidden (T, H), weight (V or V_local, H)) without the
    full logits; `result.loss.backward()` sends the gradients to `hidden` and `weight`. `options` go to
    every Triton launch (max_block, num_warps, prefetch: tests and tuning)."""
    grad_enabled = torch.is_grad_enabled()
    call = _Call(targets, normalizers, spec, implementation, logits_memory_mib, grad_scale, group, fp32_weight_grad,
                 options or {}, grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad)
    holder: list[LossResult] = []
    loss = _ChunkedHead.apply(hidden, weight, call, holder)
    result = holder[0]
    return LossResult(loss, result.losses, result.metrics)
