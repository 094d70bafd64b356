"""Triton grouped GEMMs for dropless MoE experts: rows sorted by expert, int32 `offsets` (E,) the
cumulative row count per expert (`torch._grouped_mm`'s convention), weights (E, out, in).

Two kernels serve the forward and both gradients of `y_e = x_e @ w_e^T` (x_e: expert e's rows):
- `grouped_rows_kernel`, grouped over rows: the forward (`w_e` transposed) and dx_e = dy_e @ w_e (not
  transposed). A program owns one (row tile, column tile); the row tiles come from a map built on the
  device (`row_groups`): each expert's rows cut into BLOCK_M tiles, numbered across experts, so no tile
  spans two experts and nothing is read to the host (the grid has the static upper bound of the tile
  count; programs past the last tile return at once). Tiles are swizzled in groups of GROUP_M row tiles
  so that programs running together share rows and one expert's weight tiles in L2.
- `grouped_experts_kernel`, grouped over the reduction: dw_e = dy_e^T @ x_e, one program per (expert,
  output tile) walking that expert's rows; an expert with no rows writes zeros.

`tl.dot` accumulates in fp32 (fp64 for fp64 inputs); inputs and outputs keep their dtype (bf16 on the
GPU). Importing this module imports triton and builds the kernels: set TRITON_INTERPRET=1 before it to
run on the CPU, where the interpreter's `tl.dot` takes float32 and float64 (its bf16 dot is wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch settings: output tiles of `m` rows by `n` columns, `k` deep per step (the
    weight-gradient kernel: `n` x `k` output tiles, `m` rows per reduction step)."""

    m: int
    n: int
    k: int
    group_m: int = 8
    warps: int = 4
    stages: int = 3


def default_blocks(rows: int, experts: int, device: torch.device) -> Blocks:
    """Not tuned yet on a GPU (tools/bench_moe.py --triton-sweep times alternatives): 64-128 row tiles by
    the mean rows per expert, 128 x 64 for the rest. In the interpreter every program costs Python time
    (a 128-wide layer's fwd+bwd: 39 s on 16 x 32 x 16 tiles, 6.5 s on these)."""
    if device.type != "cuda":
        return Blocks(m=32, n=64, k=32, group_m=4)
    mean_rows = rows // max(experts, 1)
    m = min(128, max(16, triton.next_power_of_2(max(mean_rows, 1))))
    return Blocks(m=m, n=128, k=64, warps=8 if m >= 128 else 4)


@dataclass(frozen=True)
class RowGroups:
    """The experts' row ranges and their row tiles, shared by every grouped GEMM over the same rows."""

    offsets: torch.Tensor  # (E,) int32 cumulative rows per expert
    tile_map: torch.Tensor  # (T, 2) int32: each row tile's expert and first row (past the end: idle)
    blocks: Blocks


def row_groups(offsets: torch.Tensor, rows: int, blocks: Blocks) -> RowGroups:
    """The tile -> (expert, first row) map on the device. T bounds the tile count from the shapes alone:
    sum_e ceil(c_e / m) <= (rows + min(E, rows) * (m - 1)) // m. A tile past the last one gets the last
    expert and a first row at or past its end, so its program returns."""
    experts, m = offsets.shape[0], blocks.m
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + m - 1) // m
    tile_ends = tiles.cumsum(0)
    tile = torch.arange((rows + min(experts, rows) * (m - 1)) // m, device=offsets.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp_max(experts - 1)
    first_row = ends[expert] - counts[expert] + (tile - tile_ends[expert] + tiles[expert]) * m
    return RowGroups(offsets, torch.stack([expert, first_row], dim=1).to(torch.int32), blocks)


def _accumulator(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    """`tl.dot`'s input precision, which only fp32 operands heed: 16-bit inputs keep Triton's default, fp32
    follows torch's TF32 switch on the GPU (as `F.linear` in the loop does), else exact."""
    if dtype in (torch.bfloat16, torch.float16):
        return "tf32"
    tf32 = device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "ieee"


@triton.jit
def grouped_rows_kernel(a_ptr, w_ptr, out_ptr, offsets_ptr, tile_map_ptr, num_tiles, N, K,
                        TRANSPOSE_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """out[r, :] = a[r, :] @ b_e for the rows r of expert e: a (rows, K), out (rows, N); b_e = w[e]^T with
    w (E, N, K) when TRANSPOSE_W, else w[e] with w (E, K, N)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_tile = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    expert = tl.load(tile_map_ptr + 2 * tile)
    first_row = tl.load(tile_map_ptr + 2 * tile + 1)
    row_end = tl.load(offsets_ptr + expert)
    if first_row >= row_end:
        return
    rows = first_row + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < row_end, cols < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * N * K
    if TRANSPOSE_W:
        w_ptrs = w_base + cols[None, :] * K + ks[:, None]
        w_step = BLOCK_K
    else:
        w_ptrs = w_base + ks[:, None] * N + cols[None, :]
        w_step = BLOCK_K * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for step in range(tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += w_step
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def grouped_experts_kernel(dy_ptr, x_ptr, dw_ptr, offsets_ptr, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """dw[e] (N, K) = dy_e^T @ x_e over the rows of expert e: dy (rows, N), x (rows, K)."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_expert = tl.cdiv(N, BLOCK_N) * tiles_k
    expert = pid // per_expert
    pid_n = (pid % per_expert) // tiles_k
    pid_k = pid % tiles_k
    row_start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    row_end = tl.load(offsets_ptr + expert)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = cols_n < N, cols_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=ACC)
    for first_row in range(row_start, row_end, BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        rows = rows.to(tl.int64)
        dy = tl.load(dy_ptr + rows[:, None] * N + cols_n[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * K + cols_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + expert.to(tl.int64) * N * K + cols_n[:, None] * K + cols_k[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


def grouped_rows_mm(a: torch.Tensor, weight: torch.Tensor, groups: RowGroups, transpose_weight: bool) -> torch.Tensor:
    """a (rows, K) sorted by expert -> (rows, N): a_e @ weight[e]^T (weight (E, N, K)) when
    `transpose_weight`, else a_e @ weight[e] (weight (E, K, N))."""
    a, weight = a.contiguous(), weight.contiguous()
    k, n = (weight.shape[2], weight.shape[1]) if transpose_weight else weight.shape[1:]
    out = a.new_empty(a.shape[0], n)
    tiles, blocks = groups.tile_map.shape[0], groups.blocks
    if tiles:
        grid = (tiles * triton.cdiv(n, blocks.n),)
        grouped_rows_kernel[grid](a, weight, out, groups.offsets, groups.tile_map, tiles, n, k, transpose_weight,
                                  blocks.m, blocks.n, blocks.k, blocks.group_m, _accumulator(a.dtype),
                                  _precision(a.dtype, a.device), num_warps=blocks.warps, num_stages=blocks.stages)
    return out


def grouped_experts_mm(dy: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """dy (rows, N), x (rows, K) sorted by expert -> (E, N, K): dy_e^T @ x_e, zeros for an expert without rows."""
    dy, x = dy.contiguous(), x.contiguous()
    experts, (n, k), blocks = groups.offsets.shape[0], (dy.shape[1], x.shape[1]), groups.blocks
    dw = dy.new_empty(experts, n, k)
    grid = (experts * triton.cdiv(n, blocks.n) * triton.cdiv(k, blocks.k),)
    grouped_experts_kernel[grid](dy, x, dw, groups.offsets, n, k, blocks.m, blocks.n, blocks.k, _accumulator(dy.dtype),
                                 _precision(dy.dtype, dy.device), num_warps=blocks.warps, num_stages=blocks.stages)
    return dw


class GroupedLinear(torch.autograd.Function):
    """y_e = x_e @ w_e^T for each expert's rows, with both gradients on the same kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.groups = groups
        return grouped_rows_mm(x, weight, groups, transpose_weight=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        dx = grouped_rows_mm(grad, weight, ctx.groups, transpose_weight=False) if ctx.needs_input_grad[0] else None
        dw = grouped_experts_mm(grad, x, ctx.groups) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """x (rows, K) sorted by expert, weight (E, N, K) -> (rows, N), differentiable in x and weight."""
    return GroupedLinear.apply(x, weight, groups)
