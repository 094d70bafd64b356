"""fastlm's Triton grouped GEMMs (fastlm/layers/triton_grouped_mm.py) against float64 PyTorch: the kernels
alone (forward, dx, dw) and the MoE layer on `moe.backend: triton` against the float64 per-expert loop.
Without CUDA they run on Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton
is imported) in float64 and float32, with CUDA compiled in float32 and bf16; shapes are small and not
multiples of the tiles, so every mask is hit."""

from __future__ import annotations

import pytest
import torch

from fastlm.layers.moe import MoEMLP, dispatch, expert_counts, route, triton_grouped_mm_supported
from fastlm.layers.triton_grouped_mm import Blocks, grouped_linear, row_groups
from fastlm.models.moe_family import MoESettings

HIDDEN, FFN, EXPERTS, TOP_K = 40, 24, 5, 2
IDLE = 3  # the expert the layer test's router never picks
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = ([(torch.float32, 1e-5), (torch.bfloat16, 3e-2)] if DEVICE.type == "cuda"  # (dtype, max rel err)
         else [(torch.float64, 1e-12), (torch.float32, 2e-6)])


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize(("dtype", "tol"), CASES)
def test_grouped_linear_equals_per_expert_matmuls(dtype: torch.dtype, tol: float) -> None:
    """Uneven groups with an empty expert in the middle and one at the end, rows and widths off the tile
    sizes (16 x 32 x 16 here): y, dx and dw against float64 per-expert matmuls; the empty experts' dw is 0."""
    counts = torch.tensor([5, 0, 37, 3, 0])
    rows, (n, k) = int(counts.sum()), (24, 40)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE, requires_grad=True)
    weight = torch.randn(len(counts), n, k, dtype=dtype, device=DEVICE, requires_grad=True)
    groups = row_groups(counts.cumsum(0).to(DEVICE, torch.int32), rows, Blocks(m=16, n=32, k=16, group_m=2))
    out = grouped_linear(x, weight, groups)
    grad = torch.randn_like(out)
    out.backward(grad)
    xs, grads, w = x.detach().double().split(counts.tolist()), grad.double().split(counts.tolist()), weight.detach().double()
    want_out = torch.cat([xs[e] @ w[e].T for e in range(len(counts))])
    want_dx = torch.cat([grads[e] @ w[e] for e in range(len(counts))])
    want_dw = torch.stack([grads[e].T @ xs[e] for e in range(len(counts))])
    errors = {"out": _rel(out, want_out), "dx": _rel(x.grad, want_dx), "dw": _rel(weight.grad, want_dw)}
    print(f"{dtype}: " + ", ".join(f"{name} rel err {error:.1e}" for name, error in errors.items()))
    assert max(errors.values()) < tol, errors
    assert weight.grad[1].abs().max() == 0 and weight.grad[4].abs().max() == 0


def test_row_tiles_cover_each_row_once() -> None:
    """The tile map: every expert's rows cut into whole tiles of its own, the idle tail past every end."""
    counts = torch.tensor([0, 33, 1, 16, 0, 2])
    offsets = counts.cumsum(0).to(torch.int32)
    groups = row_groups(offsets, int(counts.sum()), Blocks(m=16, n=16, k=16))
    starts = (offsets - counts).tolist()
    covered = []
    for expert, first in groups.tile_map.tolist():
        if first < offsets[expert]:
            assert starts[expert] <= first and (first - starts[expert]) % 16 == 0
            covered += range(first, min(first + 16, int(offsets[expert])))
    assert covered == list(range(int(counts.sum())))
    holding = sum(first < offsets[expert] for expert, first in groups.tile_map.tolist())
    assert holding == 3 + 1 + 1 + 1 and groups.tile_map.shape[0] == (52 + 6 * 15) // 16  # the static bound


def _layer(dtype: torch.dtype, device: torch.device) -> MoEMLP:
    """A layer whose router never picks expert IDLE (see `_tokens`): uneven groups and an empty one."""
    layer = MoEMLP(HIDDEN, FFN, EXPERTS, TOP_K, True).to(device=device, dtype=dtype)
    layer.reset_parameters(0.3, 0.3)
    with torch.no_grad():
        layer.router.weight[IDLE, 0] = -20.0
    return layer


def _tokens(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    x = torch.randn(count, HIDDEN, dtype=dtype, device=device)
    x[:, 0] = 3.0  # feature 0 pushes expert IDLE's logit far below every other
    return x


def _outputs_and_grads(layer: MoEMLP, x: torch.Tensor, grad: torch.Tensor, backend: str) -> dict[str, torch.Tensor]:
    layer.zero_grad()
    layer.backend = backend
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    return {"out": out.detach(), "dx": x.grad, "d_router": layer.router.weight.grad,
            "d_gate_up": layer.gate_up_proj.grad, "d_down": layer.down_proj.grad}


@pytest.mark.parametrize(("dtype", "tol"), CASES)
def test_triton_backend_equals_the_float64_loop(dtype: torch.dtype, tol: float) -> None:
    """The whole layer, top-2 of 5 experts over 13 tokens (one expert idle): output and the gradients of
    x, router, gate_up and down on `backend: triton` against the loop in float64 on the same weights."""
    layer = _layer(dtype, DEVICE)
    x = _tokens(13, dtype, DEVICE)
    counts = expert_counts(route(x, layer.router.weight, TOP_K, True).experts, EXPERTS)
    assert counts[IDLE] == 0 and len(set(counts.tolist())) > 2, counts
    grad = torch.randn_like(x)
    got = _outputs_and_grads(layer, x, grad, "triton")
    want = _outputs_and_grads(layer.double(), x.double(), grad.double(), "loop")
    errors = {name: _rel(got[name], want[name]) for name in want}
    print(f"triton {dtype} vs float64 loop: " + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
    assert max(errors.values()) < tol, errors


def test_triton_dispatch_reads_nothing_to_the_host() -> None:
    """Offsets and the tile map stay on the device: a counts tensor that refuses host reads is fine."""

    class NoHostRead(torch.Tensor):
        def tolist(self):
            raise AssertionError("dispatch read expert counts to the host")

        def item(self):
            raise AssertionError("dispatch read expert counts to the host")

    layer = _layer(torch.float32, DEVICE)
    x = _tokens(9, torch.float32, DEVICE)
    routing = route(x, layer.router.weight, TOP_K, True)
    counts = expert_counts(routing.experts, EXPERTS)
    got = dispatch(x, routing, *layer.expert_weights(), "triton", counts.as_subclass(NoHostRead))
    want = dispatch(x, routing, *layer.expert_weights(), "loop", counts)
    assert _rel(got.as_subclass(torch.Tensor), want) < 1e-5


def test_config_selects_the_triton_backend() -> None:
    """`moe.backend: triton` reaches the layer; an unknown backend is refused with the options listed."""
    settings = MoESettings.model_validate({"num_experts": EXPERTS, "ffn_size": FFN, "backend": "triton"})
    layer = settings.build(HIDDEN).to(DEVICE)
    layer.reset_parameters(0.3, 0.3)
    assert layer.backend == "triton" and layer(_tokens(3, torch.float32, DEVICE)).shape == (3, HIDDEN)
    with pytest.raises(ValueError, match="'grouped', 'triton', 'gather' or 'loop'"):
        MoESettings.model_validate({"backend": "cutlass"})


def test_triton_backend_refuses_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's bf16 dot is wrong and the CPU has no compiled Triton: both refused by name."""
    layer = _layer(torch.bfloat16, torch.device("cpu"))
    layer.backend = "triton"
    with pytest.raises(ValueError, match="moe.backend triton.*bfloat16 on cpu"):
        layer(torch.randn(4, HIDDEN, dtype=torch.bfloat16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_grouped_mm_supported(torch.device("cpu"), torch.float32)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_grouped_mm_supported(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_triton_dispatch_captures_in_a_cuda_graph() -> None:
    """The generator captures the MoE forward: the tile map is built on the device, so a captured dispatch
    replays on new routing (expert IDLE now picked too, other counts) and equals the eager result."""
    torch.manual_seed(6)
    layer = _layer(torch.bfloat16, torch.device("cuda"))
    static_x = _tokens(24, torch.bfloat16, torch.device("cuda"))

    def step() -> torch.Tensor:
        return dispatch(static_x, route(static_x, layer.router.weight, TOP_K, True), *layer.expert_weights(), "triton")

    with torch.no_grad():
        step()  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        static_x.copy_(torch.randn_like(static_x))
        graph.replay()
        torch.testing.assert_close(static_out, step())
