"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): a fixed-size state per head instead of a KV cache.

Per token t and value head h, with q, k L2-normalised and a state S (key_dim x value_dim):
    S = exp(g_t) S                      (decay, g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0)
    S = S + k_t (beta_t (v_t - S^T k_t))^T   (the delta rule, beta_t = sigmoid(b_t))
    o_t = S^T q_t / sqrt(key_dim)
q, k, v come from one projection through a short causal depthwise convolution and SiLU; the output goes
through an RMSNorm gated by silu(z) and the out projection. Key heads may be fewer than value heads: each
key head serves `value_heads / key_heads` consecutive value heads (grouped, as transformers repeats them).

Two forms of the rule, equal in exact arithmetic: `recurrent_gated_delta_rule` (token by token: decoding,
and the float64 reference) and `chunked_gated_delta_rule` (the WY/UT form over chunks of 64 tokens:
training and prefill). On CUDA the chunked form is fla-core's Triton kernel (`fla.ops.gated_delta_rule`,
forward and backward, varlen through `cu_seqlens`) when installed; the PyTorch forms run elsewhere.

Packed documents: the state and the convolution window restart at every document (fla's `cu_seqlens`
varlen form over the flattened rows; the PyTorch form runs document by document). The offsets come from the
layout (`AttentionLayout.segments`): one read of the device per forward, shared by every linear layer
(a varlen launch needs the document count on the host). Generation keeps the
state and the last `conv_kernel - 1` convolution inputs per row in the cache (`RecurrentLayerCache`):
tokens the cache marks as not real (padding, finished rows) leave both untouched.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.init import init_linear
from fastlm.layers.kv_cache import RecurrentLayerCache

if TYPE_CHECKING:
    from fastlm.layers.packed_attention import AttentionLayout

DeltaKernel = Literal["auto", "fla", "torch"]
"""`fla`: fla-core's Triton chunked kernel (CUDA only, refused when the package is missing); `torch`: the
PyTorch chunked form; `auto`: fla on CUDA when installed, else torch."""
CHUNK = 64
FLA_MISSING = ("linear_attention.kernel fla needs the fla-core package (pip install 'fastlm[fla]' or "
               "pip install fla-core); use kernel auto or torch")


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k (B, T, H, K) normalised, v (B, T, H, V), g, beta (B, T, H); state (B, H, K, V).
    -> output (B, T, H, V) and the final state, in q's dtype promoted to at least fp32."""
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    batch, steps, heads, key_dim = k.shape
    state = (torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=compute, device=q.device)
             if initial_state is None else initial_state.to(compute))
    outputs = []
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        update = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             initial_state: torch.Tensor | None = None,
                             chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over chunks of `chunk` tokens (shapes as `recurrent_gated_delta_rule`).

    Inside a chunk with cumulative log decay c_i and start state S0, the values written are
    u = (I + A)^-1 beta (v - exp(c) K S0) with A[i, j] = beta_i exp(c_i - c_j) k_i.k_j for j < i (a unit
    lower-triangular solve); then o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) u_j and
    S = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T. Only the state crosses chunks."""
    compute = torch.promote_types(q.dtype, torch.float32)
    batch, steps, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    pad = -steps % chunk
    # (B, H, chunks, chunk, D); padded tokens have g = 0, beta = 0: they change nothing.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.to(compute).transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, -1, chunk, *x.shape[3:])

    q, k, v, g, beta = chunks(q * q.shape[-1] ** -0.5), chunks(k), chunks(v), chunks(g), chunks(beta)
    decay = g.cumsum(dim=-1)  # (B, H, N, C)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strictly = pairwise.masked_fill(torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    system = torch.eye(chunk, dtype=compute, device=q.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * strictly
    values = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, beta[..., None] * decay.exp()[..., None] * k, upper=False,
                                              unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pairwise
    state = (torch.zeros(batch, heads, key_dim, value_dim, dtype=compute, device=q.device)
             if initial_state is None else initial_state.to(compute))
    outputs = []
    for index in range(q.shape[2]):
        written = values[:, :, index] - keys_read[:, :, index] @ state
        read = (q[:, :, index] * decay[:, :, index, :, None].exp()) @ state
        outputs.append(read + scores[:, :, index] @ written)
        last = decay[:, :, index, -1:]
        carried = k[:, :, index] * (last - decay[:, :, index]).exp()[..., None]
        state = state * last.exp()[..., None] + carried.transpose(-1, -2) @ written
    out = torch.cat(outputs, dim=2)[:, :, :steps]
    return out.transpose(1, 2), state


def grouped(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """(B, T, Hk, D) -> (B, T, Hv, D): each key head repeated for its Hv / Hk consecutive value heads."""
    return x.repeat_interleave(value_heads // x.shape[2], dim=2)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     kernel: DeltaKernel, initial_state: torch.Tensor | None = None,
                     segments: tuple[torch.Tensor, list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule on (B, T, ...) rows with unnormalised q, k of Hk heads and v, g, beta of Hv (a multiple:
    grouped value heads); `segments` (packed documents: the rows flattened, the documents' offsets on the
    device and the host, `AttentionLayout.segments`) restart the state at each document (no initial state
    then); fla on CUDA per `kernel`."""
    use_fla = kernel == "fla" or (kernel == "auto" and q.is_cuda and fla_available())
    if use_fla:
        if not fla_available():
            raise RuntimeError(FLA_MISSING)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        beta = beta.to(q.dtype)  # as transformers hands it over: the gate in the activations' dtype, g in fp32
        if segments is None:
            return chunk_gated_delta_rule(q, k, v, g.float(), beta, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        rows, steps = q.shape[:2]
        flat = [x.reshape(1, rows * steps, *x.shape[2:]) for x in (q, k, v, g.float(), beta)]
        offsets, host = segments
        out, _ = chunk_gated_delta_rule(*flat, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=offsets, cu_seqlens_cpu=torch.tensor(host))
        return out.reshape(rows, steps, *out.shape[2:]), torch.empty(0, device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # the PyTorch forms run in fp32 (fp64) throughout
        q, k = (l2_normalize(grouped(x, v.shape[2]).to(torch.promote_types(x.dtype, torch.float32))) for x in (q, k))
        if segments is None:
            return chunked_gated_delta_rule(q, k, v, g, beta, initial_state)
        rows, steps = q.shape[:2]
        bounds = segments[1]
        flat = [x.reshape(rows * steps, *x.shape[2:]) for x in (q, k, v, g, beta)]
        pieces = [chunked_gated_delta_rule(*(x[None, start:end] for x in flat))[0]
                  for start, end in zip(bounds[:-1], bounds[1:])]
        return torch.cat(pieces, dim=1).reshape(rows, steps, *pieces[0].shape[2:]), torch.empty(0, device=q.device)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None,
                window: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of x (B, S, C) with weight (C, K) (tap K-1 on the current token), after
    the K-1 inputs in `window` (B, K-1, C) (None: zeros). With in-document `positions` (B, S) (packed rows) a
    token reads no tap before its document's start: K shifted products, so no per-document loop."""
    taps, steps = weight.shape[1], x.shape[1]
    if window is None:
        window = x.new_zeros(x.shape[0], taps - 1, x.shape[2])
    extended = torch.cat([window.to(x.dtype), x], dim=1)
    weight = weight.to(x.dtype)
    if positions is None:
        return F.conv1d(extended.transpose(1, 2), weight[:, None], groups=weight.shape[0]).transpose(1, 2)
    out = x * weight[:, taps - 1]
    for back in range(1, taps):
        term = extended[:, taps - 1 - back: taps - 1 - back + steps] * weight[:, taps - 1 - back]
        out = out + term * (positions >= back)[..., None].to(x.dtype)
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * silu(z) over each head's values (w initialised to 1; transformers' order of casts)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size))
        self.reset_parameters()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        normed = F.rms_norm(x.to(compute), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return ((self.weight * normed).to(compute) * F.silu(gate.to(compute))).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The token mixer of a linear-attention layer (see the module docstring); called like `Attention`:
    `(x, rotary, layout, cache)` (no rotary: positions are implicit in the recurrence).

    Parameter names are the checkpoints': `in_proj_qkv` (q, k, v rows), `in_proj_z`, `in_proj_b`,
    `in_proj_a` (Qwen3.5), or `fused_projections` (Qwen3-Next): `in_proj_qkvz` and `in_proj_ba`, whose rows
    interleave per key head group (q, k, v, z of the group; b, a of the group); `conv1d.weight` (C, 1, K),
    `A_log`, `dt_bias`, `norm.weight`, `out_proj`."""

    def __init__(self, hidden_size: int, key_heads: int, value_heads: int, key_head_dim: int, value_head_dim: int,
                 conv_kernel: int, norm_eps: float, fused_projections: bool = False,
                 kernel: DeltaKernel = "auto") -> None:
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"linear value heads {value_heads} must be a multiple of key heads {key_heads}")
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.key_dim, self.value_dim = key_heads * key_head_dim, value_heads * value_head_dim
        self.conv_channels = 2 * self.key_dim + self.value_dim
        self.fused_projections, self.kernel = fused_projections, kernel
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * value_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_channels, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, value_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, conv_kernel, groups=self.conv_channels,
                                bias=False, padding=conv_kernel - 1)
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.norm = GatedRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, S, H) -> conv input (B, S, C) as q, k, v rows, z (B, S, Hv, Dv), b and a (B, S, Hv)."""
        batch, steps, _ = x.shape
        if not self.fused_projections:
            z = self.in_proj_z(x).view(batch, steps, self.value_heads, self.value_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        groups, per_group = self.key_heads, self.value_heads // self.key_heads
        grouped = self.in_proj_qkvz(x).view(batch, steps, groups, -1)
        q, k, v, z = grouped.split([self.key_head_dim, self.key_head_dim, per_group * self.value_head_dim,
                                    per_group * self.value_head_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, steps, groups, 2 * per_group).split([per_group, per_group], dim=-1)
        mixed = torch.cat([t.reshape(batch, steps, -1) for t in (q, k, v)], dim=-1)
        return (mixed, z.reshape(batch, steps, self.value_heads, self.value_head_dim),
                b.reshape(batch, steps, -1), a.reshape(batch, steps, -1))

    def forward(self, x: torch.Tensor, rotary: object, layout: AttentionLayout | None,
                cache: RecurrentLayerCache | None = None) -> torch.Tensor:
        batch, steps, _ = x.shape
        mixed, z, b, a = self.projections(x)
        weight = self.conv1d.weight[:, 0]
        positions = None if layout is None else layout.positions
        if cache is None:
            mixed = F.silu(causal_conv(mixed, weight, positions))
        else:
            real = cache.real[..., None].to(mixed.dtype)
            mixed = mixed * real
            window = cache.conv * cache.keep[:, None, None].to(cache.conv.dtype)
            cache.conv.copy_(cache.next_window(window, mixed))
            mixed = F.silu(causal_conv(mixed, weight, None, window))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, steps, self.key_heads, self.key_head_dim)
        k = k.reshape(batch, steps, self.key_heads, self.key_head_dim)
        v = v.reshape(batch, steps, self.value_heads, self.value_head_dim)
        compute = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(b.to(compute))
        g = -self.A_log.to(compute).exp() * F.softplus(a.to(compute) + self.dt_bias.to(compute))
        if cache is None:
            segments = None if positions is None else layout.segments  # type: ignore[union-attr]
            out, _ = gated_delta_rule(q, k, v, g, beta, self.kernel, segments=segments)
        else:
            real = cache.real.to(compute)[..., None]
            g, beta = g * real, beta * real  # not-real tokens: no decay, nothing written
            start = cache.state * cache.keep[:, None, None, None].to(cache.state.dtype)
            if steps == 1:  # a decode step: one token through the recurrence, fp32 (outside autocast)
                with torch.autocast(x.device.type, enabled=False):
                    q, k = (l2_normalize(grouped(t, self.value_heads).to(compute)) for t in (q, k))
                    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, start)
            else:
                out, state = gated_delta_rule(q, k, v, g, beta, self.kernel, start)
            cache.state.copy_(state)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(batch, steps, self.value_dim))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        """Projections normal(0, std), out projection residual_std; A = exp(A_log) uniform in [1, 16] and
        dt_bias 1 (transformers' init); the conv kernel normal(0, std)."""
        for linear in ((self.in_proj_qkvz, self.in_proj_ba) if self.fused_projections
                       else (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)):
            init_linear(linear, std)
        init_linear(self.out_proj, residual_std)
        nn.init.normal_(self.conv1d.weight, mean=0.0, std=std)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        nn.init.ones_(self.dt_bias)
        self.norm.reset_parameters()
