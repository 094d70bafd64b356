"""The MoE layer against transformers' own sparse MoE blocks (float64, same weights), its expert backends
against the per-expert loop, and the router losses against transformers' `load_balancing_loss_func`."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeSparseMoeBlock,
    load_balancing_loss_func,
)

from fastlm.layers.mlp import GatedMLP
from fastlm.layers.moe import (
    MoEMLP,
    combine,
    dispatch,
    expert_counts,
    fused,
    grouped_mm_supported,
    load_balancing_loss,
    route,
    router_losses,
    router_z_loss,
    swiglu,
)
from fastlm.layers.shared_expert import SharedExpertMLP
from fastlm.models.moe_family import MoESettings

HIDDEN, FFN, EXPERTS, TOP_K = 16, 12, 8, 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _hf_block(kind: str, normalize: bool):
    common = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K, "hidden_act": "silu"}
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(moe_intermediate_size=FFN, num_experts=EXPERTS, norm_topk_prob=normalize, **common)
        return Qwen3MoeSparseMoeBlock(cfg), None
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=FFN, num_local_experts=EXPERTS, **common)
        return MixtralSparseMoeBlock(cfg), None
    if kind == "olmoe":
        cfg = OlmoeConfig(intermediate_size=FFN, num_experts=EXPERTS, norm_topk_prob=normalize, **common)
        return OlmoeSparseMoeBlock(cfg), None
    cfg = Qwen2MoeConfig(moe_intermediate_size=FFN, num_experts=EXPERTS, norm_topk_prob=normalize,
                         shared_expert_intermediate_size=20, **common)
    return Qwen2MoeSparseMoeBlock(cfg), 20


def _copy_into(ours: MoEMLP, hf: torch.nn.Module, shared: SharedExpertMLP | None = None) -> None:
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.gate_up_proj.copy_(hf.experts.gate_up_proj.reshape(-1, HIDDEN))
        ours.down_proj.copy_(hf.experts.down_proj.reshape(-1, FFN))
        if shared is not None:
            theirs = hf.shared_expert
            shared.shared.gate_up_proj.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
            shared.shared.down_proj.weight.copy_(theirs.down_proj.weight)
            shared.gate.weight.copy_(hf.shared_expert_gate.weight)


@pytest.mark.parametrize(
    ("kind", "normalize"),
    [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True), ("olmoe", False), ("qwen2_moe", True)],
)
def test_layer_equals_transformers_block(kind: str, normalize: bool) -> None:
    """Output, input and weight gradients, router probabilities and chosen experts, in float64. transformers
    takes the router softmax in fp32 even for float64 weights (ours follows the input up to float64), so
    the outputs agree to fp32's rounding of the routing weights, not to float64's."""
    torch.manual_seed(0)
    hf, shared = _hf_block(kind, normalize)
    hf = hf.double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = MoEMLP(HIDDEN, FFN, EXPERTS, TOP_K, normalize, backend="loop").double()
    with_shared = None if shared is None else SharedExpertMLP(  # Qwen2-MoE: + sigmoid(gate(x)) * shared(x)
        ours, GatedMLP(HIDDEN, shared), torch.nn.Linear(HIDDEN, 1, bias=False)).double()
    _copy_into(ours, hf, with_shared)
    x = torch.randn(3, 7, HIDDEN, dtype=torch.float64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out = hf(x_hf), (ours if with_shared is None else with_shared)(x_ours)
    grad = torch.randn_like(out)
    out_hf.backward(grad)
    out.backward(grad)
    print(f"{kind}: out rel err {_rel(out, out_hf):.2e}, dx {_rel(x_ours.grad, x_hf.grad):.2e}")
    assert _rel(out, out_hf) < 1e-6
    assert _rel(x_ours.grad, x_hf.grad) < 1e-6
    assert _rel(ours.router.weight.grad, hf.gate.weight.grad) < 1e-6
    assert _rel(ours.gate_up_proj.grad, hf.experts.gate_up_proj.grad.reshape(-1, HIDDEN)) < 1e-6
    assert _rel(ours.down_proj.grad, hf.experts.down_proj.grad.reshape(-1, FFN)) < 1e-6
    hf_logits, _, hf_experts = hf.gate(x.reshape(-1, HIDDEN))
    routing = route(x.reshape(-1, HIDDEN), ours.router.weight, TOP_K, normalize)
    assert torch.equal(routing.experts, hf_experts)
    torch.testing.assert_close(routing.probs, hf_logits.double().softmax(-1), rtol=0, atol=1e-7)  # HF's softmax is fp32


def _random_layer(dtype: torch.dtype, experts: int = EXPERTS, hidden: int = HIDDEN, ffn: int = FFN) -> MoEMLP:
    layer = MoEMLP(hidden, ffn, experts, TOP_K, True).to(dtype)
    layer.reset_parameters(0.3, 0.3)
    return layer


def _outputs_and_grads(layer: MoEMLP, x: torch.Tensor, grad: torch.Tensor, backend: str) -> list[torch.Tensor]:
    layer.zero_grad()
    x = x.clone().requires_grad_()
    layer.backend = backend
    layer(x).backward(grad)
    return [layer(x.detach()).detach(), x.grad, layer.router.weight.grad, layer.gate_up_proj.grad, layer.down_proj.grad]


@pytest.mark.parametrize(("backend", "dtype", "tol"), [("gather", torch.float64, 1e-12), ("grouped", torch.float32, 1e-5)])
def test_backends_equal_the_loop(backend: str, dtype: torch.dtype, tol: float) -> None:
    """64 experts for 10 tokens, so most get none: empty groups included. `torch._grouped_mm` takes no
    float64 on CPU (fp32/bf16 only), so the grouped path is checked in float32; the gather path in float64."""
    torch.manual_seed(1)
    layer = _random_layer(dtype, experts=64)
    x = torch.randn(2, 5, HIDDEN, dtype=dtype)
    if backend == "grouped":
        assert grouped_mm_supported(x.device, dtype, HIDDEN, FFN)
        assert not grouped_mm_supported(x.device, torch.float64, HIDDEN, FFN)
        assert not grouped_mm_supported(x.device, dtype, HIDDEN, FFN + 2)  # 56-byte rows: misaligned
    grad = torch.randn_like(x)
    reference = _outputs_and_grads(layer, x, grad, "loop")
    assert int((expert_counts(route(x.reshape(-1, HIDDEN), layer.router.weight, TOP_K, True).experts, 64) == 0).sum()) > 40
    for name, got, want in zip(
        ["out", "dx", "d_router", "d_gate_up", "d_down"], _outputs_and_grads(layer, x, grad, backend), reference
    ):
        print(f"{backend} {name}: rel err {_rel(got, want):.2e}")
        assert _rel(got, want) < tol, name


def test_dispatch_reads_nothing_to_the_host_off_the_loop() -> None:
    """The grouped and gather dispatch run on device offsets: a counts tensor that refuses host reads is fine."""

    class NoHostRead(torch.Tensor):
        def tolist(self):
            raise AssertionError("dispatch read expert counts to the host")

    torch.manual_seed(2)
    layer = _random_layer(torch.float32)
    x = torch.randn(6, HIDDEN)
    routing = route(x, layer.router.weight, TOP_K, True)
    counts = expert_counts(routing.experts, EXPERTS).as_subclass(NoHostRead)
    expected = dispatch(x, routing, *layer.expert_weights(), "loop")
    for backend in ("grouped", "gather"):
        got = dispatch(x, routing, *layer.expert_weights(), backend, counts)
        torch.testing.assert_close(got.as_subclass(torch.Tensor), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="host"):
        dispatch(x, routing, *layer.expert_weights(), "loop", counts)


def test_inference_forward_traces_into_one_graph() -> None:
    """Without grad (the generator's compiled decode step, `fullgraph=True`) the layer traces whole: `auto`
    takes the fixed-shape gather path under the compiler instead of the loop's host read."""
    torch.manual_seed(4)
    layer = _random_layer(torch.float32)
    x = torch.randn(3, 1, HIDDEN)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_router_losses_equal_transformers() -> None:
    """Three layers' routing: the balance loss equals `load_balancing_loss_func` on their logits, the z-loss
    its definition; `share` scales every reported value and the weighted total."""
    torch.manual_seed(3)
    layers = [_random_layer(torch.float64) for _ in range(3)]
    logits = []
    for layer in layers:
        x = torch.randn(4, 5, HIDDEN, dtype=torch.float64)
        layer(x)
        logits.append(layer.router(x.reshape(-1, HIDDEN)))
    sums = [layer.router_sums for layer in layers]
    expected = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    print(f"aux {float(load_balancing_loss(sums).detach()):.6f} vs transformers {float(expected):.6f}")
    torch.testing.assert_close(load_balancing_loss(sums).float(), expected.float(), rtol=1e-6, atol=0)
    z = torch.logsumexp(torch.cat(logits), dim=-1).square().mean()
    torch.testing.assert_close(router_z_loss(sums).double(), z, rtol=1e-6, atol=0)
    total, losses, metrics = router_losses(sums, TOP_K, aux_coef=0.01, z_coef=0.001, share=0.25)
    torch.testing.assert_close(total.double(), 0.25 * (0.01 * expected.double() + 0.001 * z), rtol=1e-6, atol=0)
    torch.testing.assert_close(losses["moe_aux"].float(), 0.25 * expected.float(), rtol=1e-6, atol=0)
    counts = sums[1].counts
    torch.testing.assert_close(metrics["moe/layer1/max_over_mean_load"], 0.25 * counts.max() / (20 * TOP_K / EXPERTS))
    torch.testing.assert_close(metrics["moe/layer1/idle_experts"], 0.25 * (counts == 0).float().mean())
    total.backward()
    assert layers[0].router.weight.grad.abs().sum() > 0  # the router learns from its losses


def test_router_z_loss_coefficient_converts_from_megatron() -> None:
    """The z-loss is a mean over the MoE layers; Megatron-LM adds each layer's token mean (a sum over the
    layers): the documented conversion, z_loss_coef = Megatron's moe_z_loss_coeff x the MoE layers, gives
    Megatron's weighted loss and gradient, and the config's description says so."""
    torch.manual_seed(8)
    layers = [_random_layer(torch.float64) for _ in range(3)]
    logits = []
    for layer in layers:
        x = torch.randn(2, 5, HIDDEN, dtype=torch.float64)
        layer(x)
        logits.append(layer.router(x.reshape(-1, HIDDEN)))
    megatron_coeff = 1e-3
    megatron = megatron_coeff * sum(torch.logsumexp(layer_logits, dim=-1).square().mean() for layer_logits in logits)
    total, _, _ = router_losses([layer.router_sums for layer in layers], TOP_K, aux_coef=0.0,
                                z_coef=megatron_coeff * len(layers))
    print(f"fastlm {float(total):.9f} vs Megatron {float(megatron):.9f}")
    torch.testing.assert_close(total.double(), megatron, rtol=1e-6, atol=0)  # the router sums are fp32
    assert "Megatron" in MoESettings.model_fields["z_loss_coef"].description


def test_padded_router_losses_equal_transformers_with_an_attention_mask() -> None:
    """Right-padded rows (float32): padding is routed, but the balance loss equals `load_balancing_loss_func`
    given the attention mask, the z-loss and the load metrics count the real tokens alone, and the expert
    outputs of every token are those of the unmasked forward."""
    torch.manual_seed(6)
    layers = [_random_layer(torch.float32) for _ in range(2)]
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] + [0] * 4, [1] * 4 + [0]])
    logits, outputs = [], []
    for layer in layers:
        x = torch.randn(4, 5, HIDDEN)
        outputs.append((layer(x), layer(x, real_tokens=mask.float())))  # the last forward's sums are the masked ones
        logits.append(layer.router(x.reshape(-1, HIDDEN)))
    sums = [layer.router_sums for layer in layers]
    expected = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, attention_mask=mask)
    unmasked = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    print(f"aux {float(load_balancing_loss(sums).detach()):.6f} vs transformers masked {float(expected.detach()):.6f}, "
          f"unmasked {float(unmasked.detach()):.6f}")
    torch.testing.assert_close(load_balancing_loss(sums), expected, rtol=1e-6, atol=0)
    assert abs(float(expected.detach()) - float(unmasked.detach())) > 1e-3  # the mask matters for these rows
    real = mask.reshape(-1).bool()
    z = torch.logsumexp(torch.cat([layer_logits[real] for layer_logits in logits]), dim=-1).square().mean()
    torch.testing.assert_close(router_z_loss(sums), z, rtol=1e-6, atol=0)
    _, _, metrics = router_losses(sums, TOP_K, aux_coef=0.01, z_coef=0.001)
    chosen = logits[0][real].topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.zeros(EXPERTS).scatter_add_(0, chosen, torch.ones(chosen.numel()))
    torch.testing.assert_close(sums[0].counts, counts)
    torch.testing.assert_close(metrics["moe/layer0/max_over_mean_load"], counts.max() / (real.sum() * TOP_K / EXPERTS))
    for plain_out, masked_out in outputs:
        torch.testing.assert_close(masked_out, plain_out, rtol=0, atol=0)
    with torch.no_grad():  # the masked sums trace whole too (fixed shapes, no host read)
        torch.compile(layers[1], fullgraph=True, backend="eager")(x, mask.float())
    torch._dynamo.reset()
    torch.testing.assert_close(layers[1].router_sums.z, sums[1].z.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fn", [swiglu, combine])
def test_fused_elementwise_steps_equal_eager_in_float64(fn) -> None:
    """The compiled SwiGLU and weighted slot sum (what a CUDA training forward runs) against eager float64,
    forward and gradients, on fresh random inputs."""
    torch.manual_seed(8)
    inputs = ([torch.randn(40, 2 * FFN, dtype=torch.float64)] if fn is swiglu else
              [torch.randn(40, HIDDEN, dtype=torch.float64), torch.rand(20, 2, dtype=torch.float64)])
    runs = {}
    for name, function in (("eager", fn), ("fused", fused(fn))):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = function(*leaves)
        out.backward(torch.ones_like(out) + out.detach())
        runs[name] = (out.detach(), *(t.grad for t in leaves))
    torch._dynamo.reset()
    for eager, compiled in zip(runs["eager"], runs["fused"], strict=True):
        print(f"{fn.__name__}: relative error {float((compiled - eager).norm() / eager.norm()):.2e}")
        torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)


def test_a_forward_of_padding_alone_adds_zero_losses_not_nan() -> None:
    """A micro-batch whose rows are all padding: its router losses, loads and router gradient are 0."""
    torch.manual_seed(7)
    layer = _random_layer(torch.float32)
    x = torch.randn(2, 5, HIDDEN)
    layer(x, real_tokens=torch.zeros(2, 5))
    total, losses, metrics = router_losses([layer.router_sums], TOP_K, aux_coef=0.01, z_coef=0.001, share=0.0)
    print(f"total {float(total.detach())}, losses {[float(v) for v in losses.values()]}")
    assert float(total.detach()) == 0.0 and all(float(v) == 0.0 for v in losses.values())
    assert all(torch.isfinite(v).all() for v in metrics.values())
    total.backward()
    assert float(layer.router.weight.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (grouped GEMMs in bf16)")])])
def test_grouped_equals_the_loop_in_bf16(device: str) -> None:
    """The grouped GEMMs (and on CUDA fastlm's Triton ones) against the per-expert loop under bf16 autocast,
    forward and gradients, uneven groups and idle experts included, against a float64 loop as the reference
    for all (the token rows are gathered in bf16; their gradient sums a token's k slots in fp32)."""
    torch.manual_seed(5)
    layer = MoEMLP(256, 128, 32, 4, True).to(device)
    layer.reset_parameters(0.05, 0.05)
    x = torch.randn(300, 256, device=device)
    grad = torch.randn_like(x)
    reference = _outputs_and_grads(layer.double(), x.double(), grad.double(), "loop")
    layer.float()
    for backend in ("grouped", "loop") + (("triton",) if device == "cuda" else ()):
        with torch.autocast(device, torch.bfloat16):
            got = _outputs_and_grads(layer, x, grad, backend)
        errors = [_rel(g.double(), r) for g, r in zip(got, reference)]
        print(f"{device} {backend} bf16 vs float64 loop: " + ", ".join(f"{e:.1e}" for e in errors))
        assert all(g.dtype == torch.float32 for g in got[1:])  # gradients land in the fp32 parameters and input
        assert max(errors) < 3e-2
