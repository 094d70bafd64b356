"""Rotary position embeddings (RoPE), half-split convention (as in the Hugging Face Llama code), with
optional frequency scaling (linear, llama3, yarn, longrope: `fastlm.layers.rope_scaling`).

Frequencies are recomputed from the positions on every call instead of a cached buffer: the cost is
tiny (S x head_dim/2), it works with per-document positions, and there is no buffer to re-create
after building on the meta device. The inverse frequencies follow transformers' `modeling_rope_utils`
operation for operation (fp32), so imported checkpoints give the same angles.
"""

from __future__ import annotations

import math

import torch

from fastlm.layers.rope_scaling import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                        device: torch.device | None = None, long: bool = False) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies theta^(-2i/head_dim), stretched by `scaling` (longrope: by its
    long factors when `long`, else its short ones)."""
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    if scaling is not None and scaling.type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        assert factors is not None
        if len(factors) != head_dim // 2:
            raise ValueError(f"longrope has {len(factors)} factors per set; head_dim {head_dim} needs {head_dim // 2}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling)
    return _yarn(inv_freq, head_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    context = scaling.original_max_seq_len
    assert context is not None
    low_freq_wavelen = context / scaling.low_freq_factor
    high_freq_wavelen = context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) below the correction range, extrapolated above, a linear ramp between."""
    context = scaling.original_max_seq_len
    assert context is not None

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=inv_freq.device).to(torch.float32) / head_dim)
    interpolated, extrapolated = 1.0 / (scaling.factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + extrapolated * extrapolation


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  longest: torch.Tensor | None = None, turning: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inverse frequency, fp32, shape positions.shape + (head_dim/2,)
    (times yarn's or longrope's attention factor when scaled so). longrope, as transformers does for one
    sequence: a row's positions take the long factors once the row's largest position passes the pretraining
    context, the short ones otherwise (chosen on the device, no host read; a packed row by its longest
    document; `longest` (rows, 1): each row's largest real position when padding follows it); the generator
    recomputes its cache where a row crosses (`DecoderLM.rope_switch_positions`), as transformers' Phi-3 does.
    `turning`: only the first `turning` frequencies turn, the rest are 0 (cos 1, sin 0: Gemma 4's proportional RoPE)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, positions.device)
    if turning is not None:
        inv_freq = torch.cat((inv_freq[:turning], torch.zeros_like(inv_freq[turning:])))
    if scaling is not None and scaling.type == "longrope":
        assert scaling.original_max_seq_len is not None
        long = inverse_frequencies(head_dim, theta, scaling, positions.device, long=True)
        largest = positions.amax(dim=-1, keepdim=True) if longest is None else longest
        past_context = largest[..., None] + 1 > scaling.original_max_seq_len
        inv_freq = torch.where(past_context, long, inv_freq)  # (rows, 1, head_dim/2)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    factor = 1.0 if scaling is None else scaling.cos_sin_scale
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, S, D) by per-position angles cos/sin (B or 1, S, R/2): R = D, or partial rotary
    (R < D: the first R dims turn, the rest pass unchanged; GLM-4).

    The math runs in at least fp32 (bf16 activations are upcast), in float64 for float64 inputs.
    """
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    cos, sin = cos[:, None].to(compute), sin[:, None].to(compute)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
