"""The attention computations, with no layer or cache state: SDPA with or without a mask, the scores
written out (a softcap, sinks), FlexAttention under a block mask, and where FlexAttention's kernels run.
A leaf: the layer (attention.py), the training layout (packed_attention.py) and the generation cache
(kv_cache.py) all call these, so none of them imports another to attend."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernels refuse q/k/v heads under 16 ("must be at least 16 but got E=8")


def flex_supported(device: torch.device | str, head_dim: int) -> bool:
    """FlexAttention's fused kernels run here: CUDA, heads of at least `FLEX_MIN_HEAD_DIM` (tiny test models
    have 8). Elsewhere a layout or cache that would use it takes SDPA (CPU callers may still force flex:
    its unfused reference, which the tests compare)."""
    return torch.device(device).type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM


def attention_mask(
    seq_len: int, positions: torch.Tensor | None, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean mask, True = may attend; None means plain causal (use `is_causal`).

    `positions` (B, S) are the in-document positions of packed documents (see `document_positions`):
    since documents are contiguous runs, key j is in query i's document iff 0 <= i - j <= positions[i].
    The sliding window keeps the last `sliding_window` tokens including the query: i - j < window.
    """
    if positions is None and sliding_window is None:
        return None
    index = torch.arange(seq_len, device=device)
    distance = index[:, None] - index[None, :]  # (S, S): query i, key j
    allowed = (distance >= 0)[None]
    if positions is not None:
        allowed = allowed & (distance[None] <= positions[:, :, None])
    if sliding_window is not None:
        allowed = allowed & (distance < sliding_window)[None]
    return allowed[:, None]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float = 0.0,
    scale: float | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q (B, Hq, S, D) and k, v (B, Hkv, S, D), Hq = g * Hkv
    (scale None: 1/sqrt(D)); with a `softcap` or `sinks`, `explicit_attention` (SDPA has neither).

    The causal path passes `enable_gqa` (flash attention handles grouped heads natively). On CUDA the
    masked path repeats k/v per group first, because the memory-efficient kernel that takes a mask does
    not accept `enable_gqa` and SDPA would fall back to the slow math kernel; the CPU kernels take both.
    """
    if softcap is not None or sinks is not None:
        if dropout_p:
            raise ValueError("attention softcapping and sinks have no attention dropout; set model.dropout: 0.0")
        return explicit_attention(q, k, v, mask, scale, softcap, sinks)
    groups = q.shape[1] // k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=groups > 1)
    if groups > 1 and q.device.type == "cuda":
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=groups > 1)


def softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma 2's attention logit softcapping: softcap * tanh(scores / softcap)."""
    return torch.tanh(scores / softcap) * softcap


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scores written out, for what SDPA cannot do: q (B, Hq, Sq, D), k, v (B, Hkv, Sk, D); `mask`
    boolean (True = may attend) or additive, broadcast to (B, Hq, Sq, Sk), None = causal (Sq = Sk).
    `softcap`: the scores are softcapped before the mask (Gemma 2). `sinks` (Hq,): a learned logit per
    head that joins each row's softmax denominator and attends to nothing (GPT-OSS). Softmax in fp32 at least."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcapped(scores, softcap)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return probs.to(v.dtype) @ v


@cache
def _compiled_flex_attention() -> Callable:
    """FlexAttention is only fused under torch.compile; eager callers (an uncompiled model) use this."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@cache
def softcap_score_mod(softcap: float) -> Callable:
    """FlexAttention score_mod of `softcapped` (applied before the mask, as in the explicit path); one object
    per value, so a compiled FlexAttention is not guarded on a new closure every forward."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                  k: torch.Tensor) -> torch.Tensor:
        return softcapped(score, softcap)

    return score_mod


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                scale: float | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """FlexAttention of q (B, Hq, S, D) over k, v (B, Hkv, S, D) under `block_mask`, grouped heads in place.
    `softcap` is a score_mod; `sinks` (Hq,) rescale the output by the share the keys keep of a softmax
    whose denominator also holds exp(sink): out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)."""
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        flex = _compiled_flex_attention()
    else:  # inside a compiled block, or CPU (tests: the unfused reference kernel, float64 included)
        from torch.nn.attention.flex_attention import flex_attention as flex
    options = {"score_mod": softcap_score_mod(softcap)} if softcap is not None else {}
    if sinks is None:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **options)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                    return_aux=AuxRequest(lse=True), **options)
    compute = torch.promote_types(out.dtype, torch.float32)
    kept = torch.sigmoid(aux.lse.to(compute) - sinks.to(compute).view(1, -1, 1))
    return (out.to(compute) * kept.unsqueeze(-1)).to(out.dtype)
