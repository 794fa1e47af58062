"""The round's counter-based uniforms (``runtime.rng.uniform``) in one launch.

``rng.uniform(seed, positions, purpose, lane)`` is four 32-bit avalanche hashes of int64 tensors in
torch: about 50 elementwise launches of one to eight elements each (and, xor, shift, multiply), eight
calls per speculative round. In the q1 step's CUDA graph they were ~440 launches and ~0.45 ms
(``bench_step.py --profile``, session 13: the int64 xor / and / shift kernels).

``_uniform_kernel`` computes the same bits in uint32 arithmetic, one program per 1,024 positions:
the hash's products wrap modulo 2^32 exactly as the reference's int64 products masked to their low
32 bits, its shifts are logical on values below 2^32 in both, and the final ``(h >> 8) * 2^-24`` is
exact in FP32. The seed is read on the device (a () int64 tensor, as ``DecodeState.seed``) or
passed as an int; positions are int64 (their high 32 bits enter the key as in the reference). The
tests check bit equality with ``rng.uniform`` on the GPU and in the interpreter; the negative control
(``_bug``: one shift of the hash by 15 instead of 16) must differ.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import rng
from ._common import check, launch_signature

BLOCK = 1024
_M32 = rng.MASK32


@triton.jit
def _hash32(x, BUG: tl.constexpr = False):
    """lowbias32 of uint32 ``x`` (``rng.hash32``): products wrap modulo 2^32."""
    if BUG:
        x = x ^ (x >> 15)
    else:
        x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["N", "SEED_VAL", "PURPOSE_KEY", "LANE_KEY"], launch_metadata=launch_signature)
def _uniform_kernel(SEED, POS, OUT, N, SEED_VAL, PURPOSE_KEY, LANE_KEY,
                    SEED_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr, BUG: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    pos = tl.load(POS + offs, mask=ok, other=0).to(tl.int64)
    if SEED_ON_DEVICE:
        seed = tl.load(SEED).to(tl.int64)
    else:
        seed = SEED_VAL.to(tl.int64)
    h = _hash32(seed.to(tl.uint32) ^ tl.full([], 0x9E3779B9, tl.uint32), BUG)
    h = _hash32(h ^ pos.to(tl.uint32), BUG)
    h = _hash32(h ^ (pos >> 32).to(tl.uint32) ^ PURPOSE_KEY.to(tl.uint32), BUG)
    h = _hash32(h ^ LANE_KEY.to(tl.uint32), BUG)
    tl.store(OUT + offs, (h >> 8).to(tl.float32) * (1.0 / 16777216.0), mask=ok)


def uniform(seed, positions: torch.Tensor, purpose: int, lane: int = 0, out: torch.Tensor | None = None,
            _bug: bool = False) -> torch.Tensor:
    """``rng.uniform(seed, positions, purpose, lane)`` bit for bit, in one launch: FP32 uniforms in
    [0, 1) shaped like ``positions`` (integer, on the kernel's device). ``seed``: an int or a one-element
    integer tensor on that device (read there: no host synchronisation). ``_bug``: negative control."""
    check(not positions.is_floating_point() and not positions.is_complex(), "positions must be integers")
    pos = positions.reshape(-1)
    if pos.dtype != torch.int64 or not pos.is_contiguous():
        pos = pos.to(torch.int64).contiguous()
    n = pos.numel()
    if out is None:
        out = torch.empty(positions.shape, dtype=torch.float32, device=positions.device)
    check(out.shape == positions.shape and out.dtype == torch.float32 and out.is_contiguous()
          and out.device == positions.device, "out: contiguous float32 shaped like positions")
    on_device = isinstance(seed, torch.Tensor)
    if on_device:
        check(seed.numel() == 1 and not seed.is_floating_point() and seed.device == positions.device,
              "seed: one integer on the positions' device (or a Python int)")
        seed_t, seed_val = seed.reshape(1), 0
    else:
        seed_t, seed_val = pos, int(seed)
        check(-2**63 <= seed_val < 2**63, "seed must fit in int64")
    if n:
        _uniform_kernel[(triton.cdiv(n, BLOCK),)](
            seed_t, pos, out, n, seed_val, purpose * 0x85EBCA6B & _M32, lane * 0xC2B2AE35 & _M32,
            SEED_ON_DEVICE=on_device, BLOCK=BLOCK, BUG=bool(_bug), num_warps=4)
    return out
