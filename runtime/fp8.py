"""E4M3 weights with 128x128 block scales (DeepSeek-style ``weight_scale_inv``).

A weight W [..., R, C] is stored as Q = e4m3(W / s_b) with one FP32 scale s_b per 128x128 block
(partial blocks at the edges included), so that dequantise(Q, s) = Q * s_b ≈ W. The scale is the
block's absolute maximum over 448, the largest finite E4M3 value, so no element saturates.
"""
from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    r, c = w.shape[-2:]
    pr, pc = (-r) % block, (-c) % block
    return torch.nn.functional.pad(w, (0, pc, 0, pr)) if pr or pc else w


def scale_shape(shape, block: int) -> tuple[int, ...]:
    *lead, r, c = shape
    return (*lead, math.ceil(r / block), math.ceil(c / block))


def quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 tensor shaped like w, FP32 scales [..., ceil(R/b), ceil(C/b)])."""
    *lead, r, c = w.shape
    wp = _pad_to_blocks(w.float(), block)
    rb, cb = wp.shape[-2] // block, wp.shape[-1] // block
    blocks = wp.reshape(*lead, rb, block, cb, block)
    amax = blocks.abs().amax(dim=(-3, -1))                       # [..., rb, cb]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.reshape(*lead, rb * block, cb * block)[..., :r, :c].contiguous()
    return q, scale.to(torch.float32).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q * s_b for every element; shapes as produced by :func:`quantize`. No host synchronisation."""
    r, c = q.shape[-2:]
    s = scale.to(dtype).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.to(dtype) * s[..., :r, :c]


def roundtrip_bound(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Elementwise error bound of quantize→dequantize: half an E4M3 ulp at the element's magnitude
    (3 mantissa bits → relative 2^-4), or half the smallest subnormal step (2^-10 · s_b)."""
    *lead, r, c = w.shape
    _, scale = quantize(w, block)
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :r, :c]
    return torch.maximum(w.abs().float() * 2.0 ** -4, s * 2.0 ** -10)
