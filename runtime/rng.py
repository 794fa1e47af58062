"""Counter-based random numbers: a stateless integer hash of (seed, position, purpose, lane).

Every tensor-parallel rank and every execution (eager, graph, device loop) computes the same
uniform for the same key without a broadcast, and a replay is reproducible. Only 32-bit
multiply-low, xor and shifts are used, so the CPU reference, torch on CUDA and a Triton kernel
produce identical bits (the int64 products wrap, and only their low 32 bits are kept).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF

# Purposes: one stream per decision kind, so no two decisions ever share a number.
TARGET = 1      # sampling a target row (bonus token, autoregressive sampling)
ACCEPT = 2      # the acceptance test of a draft
RESIDUAL = 3    # the replacement drawn from normalise(max(0, p - q))
DRAFT = 4       # a draft token drawn from the draft's proposal distribution
WEIGHTS = 5     # random checkpoint generation


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32 constants) of int64 tensors holding values in [0, 2^32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    x = x ^ (x >> 16)
    return x


def key_hash(seed, positions: torch.Tensor, purpose: int, lane: int = 0) -> torch.Tensor:
    """Hash of the key (seed, position, purpose, lane); seed may be an int or an int64 tensor."""
    pos = positions.to(torch.int64)
    seed_t = seed if isinstance(seed, torch.Tensor) else torch.tensor(int(seed), dtype=torch.int64)
    seed_t = seed_t.to(device=pos.device, dtype=torch.int64)
    h = hash32(seed_t ^ 0x9E3779B9)
    h = hash32(h ^ (pos & MASK32))
    h = hash32(h ^ ((pos >> 32) & MASK32) ^ (purpose * 0x85EBCA6B & MASK32))
    h = hash32(h ^ (lane * 0xC2B2AE35 & MASK32))
    return h


def uniform(seed, positions: torch.Tensor, purpose: int, lane: int = 0) -> torch.Tensor:
    """Float32 uniforms in [0, 1) with 24 random bits (exactly representable), shaped like positions."""
    return (key_hash(seed, positions, purpose, lane) >> 8).to(torch.float32) * (1.0 / (1 << 24))
