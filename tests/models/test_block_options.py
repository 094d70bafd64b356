"""DecoderBlock's options against the formula in float64: no pre norms (OLMo 2's norms after attention and
MLP only) and a residual scale (Granite), outputs and gradients."""

from __future__ import annotations

import torch
from model_helpers import relative_error

from fastlm.layers.attention import Attention
from fastlm.layers.block import DecoderBlock
from fastlm.layers.mlp import GatedMLP
from fastlm.layers.norm import build_norm
from fastlm.layers.packed_attention import attention_layout


def test_post_norm_only_block_with_residual_scale_matches_the_formula() -> None:
    torch.manual_seed(0)
    hidden = 16
    attention = Attention(hidden, 4, 2, qkv_bias=False, out_bias=False, dropout=0.0).double()
    mlp = GatedMLP(hidden, 24).double()
    post_attn, post_mlp = (build_norm("rmsnorm", hidden, 1e-6).double() for _ in range(2))
    with torch.no_grad():
        for norm in (post_attn, post_mlp):
            norm.weight.normal_(1.0, 0.1)
    block = DecoderBlock(None, attention, None, mlp, 0.0, post_attn_norm=post_attn, post_mlp_norm=post_mlp,
                         residual_scale=0.3)
    x = torch.randn(2, 5, hidden, dtype=torch.float64, requires_grad=True)
    layout = attention_layout(2, 5, None, None, x.device)
    out = block(x, None, layout)
    middle = x + 0.3 * post_attn(attention(x, None, layout))
    expected = middle + 0.3 * post_mlp(mlp(middle))
    assert relative_error(out, expected) < 1e-15
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), [x, *block.parameters()])
    ref_grads = torch.autograd.grad((expected * weight).sum(), [x, *block.parameters()])
    errors = [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    print(f"post-norm block, residual scale 0.3: float64 worst gradient rel err {max(errors):.1e}")
    assert max(errors) < 1e-13
