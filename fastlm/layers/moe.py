"""Mixture-of-experts MLP: an fp32 softmax top-k router and dropless SwiGLU experts.

Every token goes to its top-k experts (no capacity, nothing dropped). The assignments are sorted by
expert and the experts run as grouped GEMMs over the sorted rows (`torch._grouped_mm`, or fastlm's Triton
kernels in `triton_grouped_mm.py`, offsets kept on the device) where they support the dtype and shapes; a
per-expert loop is the reference. `dispatch` (sort, permute, expert MLP, unpermute) is one function so
that an all-to-all can later wrap it.

The router's losses (Switch/Mixtral load balancing, ST-MoE z-loss) need sums over every MoE layer of a
forward, so each layer keeps its `RouterSums` of the last forward and `router_losses` combines them. Padding
is routed like any token (fixed shapes) but left out of the sums: the forward's `real_tokens` weights
(1 real, 0 padding) multiply each token's terms, as transformers' `attention_mask` does.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.init import init_linear

if TYPE_CHECKING:
    from fastlm.layers.triton_grouped_mm import Blocks

ExpertBackend = Literal["auto", "grouped", "triton", "gather", "loop"]
"""How the experts' GEMMs run: `grouped` (`torch._grouped_mm`), `triton` (fastlm's Triton grouped GEMMs,
`triton_grouped_mm.py`), `gather` (each assignment's weights gathered into one batched matmul: fixed shapes
for CUDA graphs where grouped GEMMs are unsupported, memory grows with tokens, so decode only), `loop` (one
GEMM per expert, the reference; reads the counts on the host). `auto`: grouped where supported on CUDA,
gather inside a CUDA graph capture, else the loop; never triton until a GPU measurement says it is faster."""


@dataclass
class Routing:
    """One forward's routing of T tokens over E experts, top k."""

    logits: torch.Tensor  # (T, E), fp32 (fp64 for fp64 inputs)
    probs: torch.Tensor  # (T, E) softmax of the logits
    weights: torch.Tensor  # (T, k) the chosen experts' probabilities (renormalised if the family says so)
    experts: torch.Tensor  # (T, k) int64 expert ids, by descending probability


@dataclass
class RouterSums:
    """A layer's sufficient statistics for the router losses: sums over its routed real (non-padding) tokens."""

    counts: torch.Tensor  # (E,) fp32 assignments per expert (no gradient)
    probs: torch.Tensor  # (E,) sum over tokens of the router probabilities (differentiable)
    z: torch.Tensor  # () sum over tokens of logsumexp(logits)^2 (differentiable)
    tokens: int | torch.Tensor  # the real tokens summed over: a count, or a device scalar under a padding mask


def router_sums(routing: Routing, counts: torch.Tensor, real_tokens: torch.Tensor | None = None) -> RouterSums:
    """The sums of one routing: over every token (`counts` its (E,) assignments), or weighted by
    `real_tokens` (T,) (1 real, 0 padding): multiplies, not indexing, so shapes stay fixed and nothing
    is read to the host."""
    z = torch.logsumexp(routing.logits, dim=-1).float().square()
    probs = routing.probs.float()
    if real_tokens is None:
        return RouterSums(counts.float(), probs.sum(dim=0), z.sum(), probs.shape[0])
    weights = real_tokens.reshape(-1).to(probs.dtype)
    top_k = routing.experts.shape[1]
    real_counts = probs.new_zeros(probs.shape[1]).scatter_add_(0, routing.experts.reshape(-1),
                                                                 weights.repeat_interleave(top_k))
    return RouterSums(real_counts, (probs * weights.unsqueeze(-1)).sum(dim=0), (z * weights).sum(), weights.sum())


def replayed(experts: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """(T, k) chosen experts with a recorded choice `replay` (T, k) put in their place (routing replay, RL): a
    token whose record is -1 (not routed when it was sampled) keeps its own choice; None: `experts` as they are."""
    if replay is None:
        return experts
    replay = replay.reshape(experts.shape).to(device=experts.device, dtype=torch.int64)
    return torch.where(replay >= 0, replay, experts)


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
          bias: torch.Tensor | None = None, replay: torch.Tensor | None = None) -> Routing:
    """(T, H) tokens, (E, H) router weight [+ (E,) bias: GPT-OSS] -> softmax top-k routing, in fp32 even
    under autocast. `replay` (T, k): the experts to use instead of the top-k (`replayed`); their weights are
    still the current router's probabilities (the gate trains), only the selection is replayed."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        logits = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if replay is not None:
        experts = replayed(experts, replay)
        if normalize:  # the renormalised probabilities as a softmax of the chosen logits: no 0 / 0 where the
            return Routing(logits, probs, logits.gather(-1, experts).softmax(dim=-1), experts)  # router moved off them
        weights = probs.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, weights, experts)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N,) expert ids -> (E,) int64 counts, without bincount's device->host read of the maximum."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, hidden_size: int, ffn_size: int) -> bool:
    """Whether `torch._grouped_mm` takes the experts' GEMMs in `dtype` on `device`: bf16 on CUDA (SM >= 80),
    fp32/bf16 on CPU (eager), with hidden and ffn sizes multiples of 16 bytes (the kernels' stride alignment)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return False
    elif device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    align = 16 // dtype.itemsize
    return hidden_size % align == 0 and ffn_size % align == 0


def triton_grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fastlm's Triton grouped GEMMs run in `dtype` on `device`: bf16/fp16 (SM >= 80) or fp32 on CUDA;
    on the CPU only under TRITON_INTERPRET=1, in fp32 or fp64 (the interpreter's bf16 `tl.dot` is wrong).
    Masked tiles: any hidden and expert width."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return dtype == torch.float32 or (dtype in (torch.bfloat16, torch.float16)
                                          and torch.cuda.get_device_capability(device) >= (8, 0))
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and dtype in (torch.float32, torch.float64)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """(N, 2F) gate then up -> (N, F) silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma 4's expert activation: (N, 2F) gate then up -> (N, F) gelu_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's expert activation: (N, 2F) gate then up -> (up + 1) * g * sigmoid(alpha * g), with
    g = min(gate, limit) and up clamped to [-limit, limit]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


ExpertBiases = tuple[torch.Tensor, torch.Tensor]  # gate_up (E, 2F) and down (E, H) biases


def combine(unsorted: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(T * k, H) expert outputs in (token, slot) order, (T, k) routing weights -> (T, H) their weighted sum."""
    tokens, top_k = weights.shape
    return (unsorted.view(tokens, top_k, -1) * weights.to(unsorted.dtype).unsqueeze(-1)).sum(dim=1)


@functools.cache
def fused(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """One of the dispatch's elementwise steps (`swiglu`, `combine`) compiled, into one kernel forward and
    one backward: eager, each is 2-4 passes over (T * k) rows (the MoE layer runs outside the blocks'
    torch.compile in training). Compiled on first use: `torch.compile` at import costs every command ~1 s."""
    return torch.compile(fn)


def _elementwise(fn: Callable[..., torch.Tensor], x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`fn`, compiled (`fused`) in a CUDA training forward; eager elsewhere: on the CPU (no compile per
    new shape in tests and laptop runs), inside an outer trace and in the generator (no grad: its decode
    step is traced whole or captured in a CUDA graph, where a first compile must not run)."""
    if x.is_cuda and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return fused(fn)
    return fn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' GEMMs run in: autocast's when it is on (grouped GEMMs are not autocast ops)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def pick_backend(rows: torch.Tensor, down: torch.Tensor) -> ExpertBackend:
    """`auto`'s choice for these operands (see `ExpertBackend`). Off the grouped path a CUDA training step
    takes the loop (it reads the counts: one host sync per MoE layer); gather would hold N x 2F x H. Traced
    by torch.compile (the generator's decode step) or captured in a CUDA graph, shapes must stay fixed:
    gather where grouped GEMMs cannot."""
    fixed_shapes = torch.compiler.is_compiling() or (rows.is_cuda and torch.cuda.is_current_stream_capturing())
    if rows.is_cuda and grouped_mm_supported(rows.device, _compute_dtype(rows), down.shape[1], down.shape[2]):
        return "grouped"
    return "gather" if fixed_shapes else "loop"


def expert_mlp(
    rows: torch.Tensor,
    row_experts: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    backend: ExpertBackend = "auto",
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """SwiGLU (or `activation`) of each row through its expert: rows (N, H) sorted by expert (`row_experts`
    (N,), `counts` (E,)), gate_up (E, 2F, H) gate then up, down (E, H, F) [+ `biases` after each GEMM,
    gathered per row] -> (N, H)."""
    if backend == "auto":
        backend = pick_backend(rows, down)
    dtype = _compute_dtype(rows)
    plain = biases is None and activation is swiglu
    if not plain and backend == "triton":
        raise ValueError("moe.backend triton has no expert biases or other activations; use backend auto")
    gate_up_bias, down_bias = (None, None) if biases is None else (b.to(dtype) for b in biases)

    def act(h: torch.Tensor) -> torch.Tensor:
        if plain:
            return _elementwise(swiglu, rows)(h)
        return activation(h if gate_up_bias is None else h + gate_up_bias[row_experts])

    def out(h: torch.Tensor) -> torch.Tensor:
        return h if down_bias is None else h + down_bias[row_experts]

    if backend == "grouped":
        if not grouped_mm_supported(rows.device, dtype, down.shape[1], down.shape[2]):
            raise ValueError(f"moe.backend grouped: torch._grouped_mm does not take {dtype} on {rows.device.type} with "
                             f"hidden {down.shape[1]} and expert width {down.shape[2]}; use backend auto")
        rows, gate_up, down = rows.to(dtype), gate_up.to(dtype), down.to(dtype)
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = act(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets))
        return out(torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets))
    if backend == "triton":
        return triton_expert_mlp(rows.to(dtype), counts, gate_up.to(dtype), down.to(dtype))
    if backend == "gather":
        hidden = act(torch.bmm(gate_up[row_experts].to(dtype), rows.to(dtype).unsqueeze(-1)).squeeze(-1))
        return out(torch.bmm(down[row_experts].to(dtype), hidden.unsqueeze(-1)).squeeze(-1))
    outputs = []
    for expert, chunk in enumerate(rows.split(counts.tolist())):
        if chunk.shape[0]:
            hidden = F.linear(chunk, gate_up[expert], None if biases is None else biases[0][expert])
            outputs.append(F.linear(activation(hidden), down[expert], None if biases is None else biases[1][expert]))
    return torch.cat(outputs) if outputs else rows.new_zeros(0, down.shape[1], dtype=dtype)


def triton_expert_mlp(rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      blocks: Blocks | None = None) -> torch.Tensor:
    """`expert_mlp` on the Triton grouped GEMMs (operands in one dtype): one row-tile map for both GEMMs and
    their gradients; `blocks` the kernels' tiles (default `default_blocks`; tools/bench_moe.py sweeps them)."""
    if not triton_grouped_mm_supported(rows.device, rows.dtype):
        raise ValueError(f"moe.backend triton: the Triton grouped GEMMs do not take {rows.dtype} on {rows.device.type} "
                         "(CUDA: bf16/fp16 on SM >= 80, fp32; CPU: fp32/fp64 under TRITON_INTERPRET=1); use backend auto")
    from fastlm.layers.triton_grouped_mm import default_blocks, grouped_linear, row_groups

    blocks = blocks or default_blocks(rows.shape[0], counts.shape[0], rows.device)
    groups = row_groups(counts.cumsum(0).to(torch.int32), rows.shape[0], blocks)
    return grouped_linear(_elementwise(swiglu, rows)(grouped_linear(rows, gate_up, groups)), down, groups)


class SortedRows(torch.autograd.Function):
    """x (T, H) -> the rows of the expert-sorted assignments, x[order // k], already in the experts' dtype
    (T rows cast, not T * k). The backward puts each assignment's gradient back in (token, slot) order (a
    permutation) and sums a token's k slots in fp32 (fp64 for fp64): no atomics, no k roundings in bf16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k, ctx.x_dtype = top_k, x.dtype
        return x.to(dtype)[order // top_k]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (order,) = ctx.saved_tensors
        by_slot = torch.empty_like(grad).index_copy_(0, order, grad).view(-1, ctx.top_k, grad.shape[-1])
        summed = by_slot.sum(dim=1, dtype=torch.promote_types(grad.dtype, torch.float32))
        return summed.to(ctx.x_dtype), None, None, None


def dispatch(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    backend: ExpertBackend = "auto",
    counts: torch.Tensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """(T, H) tokens -> (T, H) sum over each token's k experts of weight * expert(x): sort the T*k
    assignments by expert, gather their rows, run the experts, put the rows back in (token, slot) order
    and add the slots. Fixed shapes and device-side offsets: nothing is read to the host (the loop
    backend aside), so a CUDA graph can hold it. This is the piece an expert-parallel all-to-all wraps."""
    top_k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order inside a group
    if counts is None:
        counts = expert_counts(flat, gate_up.shape[0])
    rows = SortedRows.apply(x, order, top_k, _compute_dtype(x))
    expert_out = expert_mlp(rows, flat[order], counts, gate_up, down, backend, activation, biases)
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)  # a permutation: no atomics
    return _elementwise(combine, unsorted)(unsorted, routing.weights)


class RoutingRecorder:
    """Where the MoE layers of a generating model write each token's chosen experts: `buffer` (B, C, M, k) int16
    by batch row, cache column, MoE layer and slot; `columns` (B, S) the cache columns of the forward's tokens
    (set by the generator before each forward; a static tensor on the CUDA-graph path). Shapes stay fixed and
    nothing is read to the host, so a captured decode step records too."""

    def __init__(self, buffer: torch.Tensor, columns: torch.Tensor) -> None:
        self.buffer, self.columns = buffer, columns

    def write(self, layer: int, experts: torch.Tensor) -> None:
        """(B * S, k) experts of MoE layer `layer` for the tokens at `columns`."""
        batch, width = self.columns.shape
        top_k = experts.shape[-1]
        index = self.columns[:, :, None].expand(batch, width, top_k)
        self.buffer[:, :, layer].scatter_(1, index, experts.view(batch, width, top_k).to(self.buffer.dtype))


@dataclass
class RoutingTap:
    """An MoE layer's place in a `RoutingRecorder`: its index among the model's MoE layers."""

    recorder: RoutingRecorder
    layer: int


def attach_recorder(layers: list[MoEMLP], recorder: RoutingRecorder | None) -> None:
    """Point every MoE layer at `recorder` (None: stop recording)."""
    for index, layer in enumerate(layers):
        layer.tap = None if recorder is None else RoutingTap(recorder, index)


class MoEMLP(nn.Module):
    """Router + E SwiGLU experts (a shared expert beside them: `fastlm.layers.shared_expert.SharedExpertMLP`);
    GPT-OSS's options: a router bias, expert biases (`gate_up_bias` (E * 2F,), `down_bias` (E * H,)) and
    another `activation` (`clamped_swiglu`).

    Parameters: `router.weight` (E, H); the experts' weights stacked along rows as a checkpoint lists
    them, `gate_up_proj` (E * 2F, H) (per expert its gate rows, then its up rows) and `down_proj`
    (E * H, F), viewed as (E, 2F, H) and (E, H, F) in the forward; 2-D, so checkpoint conversion is
    row concatenation and FSDP shards them like any linear weight."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        normalize_top_k: bool,
        backend: ExpertBackend = "auto",
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.normalize_top_k, self.backend = num_experts, top_k, normalize_top_k, backend
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef  # read by `add_router_losses`
        self.router = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * ffn_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, ffn_size))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts * 2 * ffn_size)) if expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts * hidden_size)) if expert_bias else None
        self.activation = activation
        self.router_sums: RouterSums | None = None  # the last forward's, for `router_losses`
        self.tap: RoutingTap | None = None  # set while a generator records the routing (rl.routing_replay)

    def forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None,
                experts: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) tokens [+ (...) `real_tokens`, 1 real, 0 padding: what the router sums count; None:
        every token] [+ (..., k) `experts` to route to instead of the router's top-k, -1: the router's own].
        Training runs eagerly under torch.compile (`_eager`: data-dependent routing, and grouped GEMMs have
        no fp32 meta kernel); without grad (the generator's compiled decode step) the forward traces into
        one graph on fixed shapes."""
        return self._eager(x, real_tokens, experts) if torch.is_grad_enabled() else self._forward(x, real_tokens, experts)

    @torch._disable_dynamo  # torch.compiler.disable, applied at the first call (its import of dynamo costs ~1 s)
    def _eager(self, x: torch.Tensor, real_tokens: torch.Tensor | None, experts: torch.Tensor | None) -> torch.Tensor:
        return self._forward(x, real_tokens, experts)

    def _forward(self, x: torch.Tensor, real_tokens: torch.Tensor | None = None,
                 experts: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.route(flat, None if experts is None else experts.reshape(flat.shape[0], self.top_k))
        if self.tap is not None:
            self.tap.recorder.write(self.tap.layer, routing.experts)
        counts = expert_counts(routing.experts, self.num_experts)
        self.router_sums = router_sums(routing, counts, real_tokens)
        biases = None if self.gate_up_bias is None or self.down_bias is None else (
            self.gate_up_bias.view(self.num_experts, -1), self.down_bias.view(self.num_experts, -1))
        return dispatch(self.expert_input(flat), routing, *self.expert_weights(), self.backend, counts,
                        self.activation, biases).reshape(x.shape)

    def route(self, flat: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """(T, H) tokens [+ (T, k) experts to replay] -> their routing (softmax top-k, GPT-OSS's router bias; a
        subclass may route otherwise)."""
        return route(flat, self.router.weight, self.top_k, self.normalize_top_k, self.router.bias, replay)

    def expert_input(self, flat: torch.Tensor) -> torch.Tensor:
        """What the experts read of the (T, H) tokens the router read: the same (a subclass may norm them)."""
        return flat

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the last forward's sums (autograd graph tensors) and any tap behind."""
        return {**self.__dict__, "router_sums": None, "tap": None}

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up (E, 2F, H) and down (E, H, F) views of the stacked parameters."""
        experts = self.num_experts
        return (self.gate_up_proj.view(experts, 2 * self.ffn_size, self.hidden_size),
                self.down_proj.view(experts, self.hidden_size, self.ffn_size))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        init_linear(self.router, std)
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=residual_std)
        for bias in (self.gate_up_bias, self.down_bias):
            if bias is not None:
                nn.init.zeros_(bias)


def _at_least_one(tokens: int | torch.Tensor) -> int | torch.Tensor:
    """A token count as a divisor: a forward of padding alone sums zeros over zero tokens, and its losses
    and loads are then 0, not NaN (its share of the step is 0 too)."""
    return tokens.clamp(min=1) if isinstance(tokens, torch.Tensor) else max(tokens, 1)


def load_balancing_loss(sums: list[RouterSums]) -> torch.Tensor:
    """Switch/Mixtral balance loss over the layers, as transformers' `load_balancing_loss_func`:
    E * sum_e f_e P_e, with f_e the share of top-k assignments and P_e the mean router probability of
    expert e, both averaged over every layer's real tokens (so a perfectly even router gives k); with
    padding, transformers given the `attention_mask`."""
    rows = _at_least_one(sum(s.tokens for s in sums))
    counts = torch.stack([s.counts for s in sums]).sum(0)
    probs = torch.stack([s.probs for s in sums]).sum(0)
    return counts.numel() * ((counts / rows) * (probs / rows)).sum()


def router_z_loss(sums: list[RouterSums]) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over every layer's real tokens of logsumexp(router logits)^2."""
    return torch.stack([s.z for s in sums]).sum() / _at_least_one(sum(s.tokens for s in sums))


def expert_load_metrics(sums: list[RouterSums], top_k: int) -> dict[str, torch.Tensor]:
    """Per layer (device scalars, no host read): the busiest expert's real tokens over the mean (1 is
    even) and the fraction of experts that got no real token."""
    metrics = {}
    for index, layer in enumerate(sums):
        mean = _at_least_one(layer.tokens) * top_k / layer.counts.numel()
        metrics[f"moe/layer{index}/max_over_mean_load"] = layer.counts.max() / mean
        metrics[f"moe/layer{index}/idle_experts"] = (layer.counts == 0).float().mean()
    return metrics


def router_losses(
    sums: list[RouterSums], top_k: int, aux_coef: float, z_coef: float, share: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weighted router loss to add to the step's loss, the unweighted losses (`moe_aux`,
    `moe_router_z`) and the load metrics, each times `share`, this forward's fraction of the step's real
    (non-padding) routed tokens, so that summing over micro-batches and ranks gives the step's token-weighted
    mean (the z-loss is then exactly the big batch's; the balance loss, a product of two batch means, is
    each micro-batch's own, weighted: Megatron's micro-batch balancing, as transformers on one batch)."""
    aux, z = load_balancing_loss(sums), router_z_loss(sums)
    losses = {"moe_aux": aux.detach() * share, "moe_router_z": z.detach() * share}
    metrics = {name: value * share for name, value in expert_load_metrics(sums, top_k).items()}
    return (aux_coef * aux + z_coef * z) * share, losses, metrics


def add_router_losses(result: Any, layers: list[MoEMLP], step_positions: float) -> Any:
    """A training forward's `LossResult` with the router losses and load metrics of its MoE `layers` added
    (unchanged when none has run a forward): the real tokens routed here (`RouterSums.tokens`, the same in
    every layer) of the step's `step_positions` (`LossNormalizers.positions`, counted alike; 0: this call
    is the whole step)."""
    sums = [layer.router_sums for layer in layers if layer.router_sums is not None]
    if not sums:
        return result
    first = layers[0]
    share = sums[0].tokens / step_positions if step_positions else 1.0
    total, losses, metrics = router_losses(sums, first.top_k, first.aux_loss_coef, first.z_loss_coef, share)
    return replace(result, loss=result.loss + total, losses={**result.losses, **losses},
                   metrics={**result.metrics, **metrics})
