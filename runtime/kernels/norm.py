"""Fused residual add + RMSNorm for the decode round ([w, H], w <= 8 rows).

Algorithm (``_add_rmsnorm_kernel``, grid (w,), program = one row)
-----------------------------------------------------------------
The program loads its whole row of x and of the residual (H <= BLOCK_H elements, one pass),
forms residual_out = residual + x in FP32, rounds it to the residual's dtype and writes it back into
``residual``; it then normalises exactly that stored value (so the normalised output is a function
of the residual stream as stored): ss = sum(r^2) in FP32 (a tree inside the program),
out = r * rsqrt(ss / H + eps) * weight, written in BF16, and optionally the same BF16 values as FP16
(``out16``: exact wherever FP16 can hold them, which is what the MoE's Gate/Up would convert them to
on every tile: it reads this copy instead). Under tensor parallelism the all-reduce of x comes before
this kernel (the lead's fused path may replace it).

``rmsnorm`` is the same kernel with a zero residual that it neither reads nor writes (a pass's first
norm, the MTP layer's input norms, the LM head's norm).

Programmatic dependent launch (``PDL``, sm_90+ CUDA): the kernel releases its own dependent at its
start (the next kernel, a projection or the router, launches while this one runs) and waits
(griddepcontrol.wait) for its predecessor before reading anything but the norm weight (WEIGHT_FIRST).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, launch_signature, next_pow2, pdl_supported

# Warps per row: 16 warps x 32 threads x 16 B loads cover a 6,144-wide BF16 row in under two
# vector loads per thread, so each row's single pass is latency-, not issue-bound.
NUM_WARPS = 16
PDL = True
# The norm weight is loaded at the program's start, before griddepcontrol.wait (keyword weight_first;
# also the MoE reduce's fused norm). It is a weight, never written by a predecessor, and evicted from
# L2 by every layer's expert stream, so its load is a DRAM round trip: issued after the sum of
# squares (the way until session 17) it was the last link of the kernel's chain. Same values.
WEIGHT_FIRST = True


def num_warps(block_h: int) -> int:
    """Warps per row program at a row width of ``block_h`` (a power of two): the layout of the sum of
    squares, which every kernel that must give this module's bits shares (peer.py)."""
    return NUM_WARPS if block_h >= 4096 else 4


def resolve_weight_first(flag) -> bool:
    """A launch's ``weight_first`` keyword resolved (None: WEIGHT_FIRST)."""
    return WEIGHT_FIRST if flag is None else bool(flag)


@triton.jit
def load_weight(WT, offs, ok):
    """The norm weight at ``offs`` in FP32 (zero outside ``ok``)."""
    return tl.load(WT + offs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def rms_scale(r, ss, wt, H: tl.constexpr, eps):
    """r * rsqrt(ss / H + eps) * wt in FP32 (r: the stored row in FP32, ss: its sum of squares, wt:
    ``load_weight``'s values): the normalisation every RMSNorm kernel here ends with (also the MoE
    reduce's)."""
    inv = tl.math.rsqrt(ss / H + eps)
    return r * inv * wt


@triton.jit(launch_metadata=launch_signature)
def _add_rmsnorm_kernel(X, RES, WT, OUT, OUT16, IDS, stride_x, stride_r, stride_o, stride_o16, eps, VSTART, VSIZE,
                        H: tl.constexpr, BLOCK_H: tl.constexpr, NORM_BUG: tl.constexpr,
                        HAS16: tl.constexpr = False, ROUND16_BUG: tl.constexpr = False,
                        PDL: tl.constexpr = False, LOAD_RES: tl.constexpr = True,
                        STORE_RES: tl.constexpr = True, GATHER: tl.constexpr = False,
                        WEIGHT_FIRST: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    if WEIGHT_FIRST:   # a weight: no predecessor writes it, so it may be read before the wait
        wt = load_weight(WT, offs, ok)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()   # the predecessor's x and residual are complete and visible from here
    if GATHER:   # x = the embedding row of token IDS[row] (zero outside this rank's vocabulary slice)
        local = tl.load(IDS + row).to(tl.int64) - VSTART
        inside = ((local >= 0) & (local < VSIZE)).to(tl.float32)
        local = tl.minimum(tl.maximum(local, 0), VSIZE - 1)
        x = tl.load(X + local * stride_x + offs, mask=ok, other=0.0).to(tl.float32) * inside
    else:
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    res_ptr = RES + row * stride_r + offs
    if LOAD_RES:
        r = (tl.load(res_ptr, mask=ok, other=0.0).to(tl.float32) + x).to(RES.dtype.element_ty)
    else:   # a zero residual: x rounded to the stream's dtype (the reference's norm of that tensor)
        r = x.to(RES.dtype.element_ty)
    if STORE_RES:
        tl.store(res_ptr, r, mask=ok)
    r = r.to(tl.float32)
    if NORM_BUG:
        ss = tl.sum(x * x, 0)
    else:
        ss = tl.sum(r * r, 0)
    if not WEIGHT_FIRST:
        wt = load_weight(WT, offs, ok)
    y = rms_scale(r, ss, wt, H, eps)
    o = y.to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + offs, o, mask=ok)
    if HAS16:   # the stored values, as FP16 (ROUND16_BUG, negative control: FP32 -> FP16 directly)
        if ROUND16_BUG:
            tl.store(OUT16 + row * stride_o16 + offs, y.to(tl.float16), mask=ok)
        else:
            tl.store(OUT16 + row * stride_o16 + offs, o.to(tl.float32).to(tl.float16), mask=ok)


def fused_add_rmsnorm(x, residual, weight, eps, out=None, *, out16=None, pdl=None, weight_first=None,
                      _norm_bug=False, _round16_bug=False):
    """residual += x (in residual's dtype); out = RMSNorm(residual) * weight in BF16. Returns out.

    x [w, H] (bf16/fp32), residual [w, H] (bf16/fp32, updated in place), weight [H].
    ``out16`` [w, H] FP16 (optional): also written, out's BF16 values converted to FP16 (the MoE's
    input: its Gate/Up then skips a per-tile conversion). ``pdl``: launched as a programmatic
    dependent that releases its own dependent at its start (default PDL; sm_90+ CUDA only).
    ``weight_first``: the weight loaded before the wait (default WEIGHT_FIRST).
    ``_norm_bug`` is the tests' negative control (normalises by the RMS of x, not of the sum);
    ``_round16_bug`` another (out16 rounded from FP32, not from the BF16 values).
    """
    check(x.dim() == 2 and residual.shape == x.shape, "x, residual [w, H]")
    w, H = x.shape
    check(weight.shape == (H,), "weight [H]")
    check(x.stride(1) == 1 and residual.stride(1) == 1 and weight.stride(0) == 1, "contiguous rows")
    check(x.device == residual.device == weight.device, "one device")
    if out is None:
        out = torch.empty((w, H), device=x.device, dtype=torch.bfloat16)
    check(out.shape == (w, H) and out.stride(1) == 1, "out [w, H]")
    has16 = out16 is not None
    if has16:
        check(out16.shape == (w, H) and out16.stride(1) == 1 and out16.dtype == torch.float16
              and out16.device == x.device, "out16 [w, H] fp16 on the device of x")
    block_h = next_pow2(H)
    check(block_h <= 32768, "H <= 32768")
    use_pdl = pdl_supported(x.device) and (PDL if pdl is None else bool(pdl))
    _add_rmsnorm_kernel[(w,)](
        x, residual, weight, out, out16 if has16 else out, x, x.stride(0), residual.stride(0), out.stride(0),
        out16.stride(0) if has16 else 0, float(eps), 0, 1,
        H=H, BLOCK_H=block_h, NORM_BUG=_norm_bug, HAS16=has16, ROUND16_BUG=bool(_round16_bug), PDL=use_pdl,
        WEIGHT_FIRST=resolve_weight_first(weight_first),
        num_warps=num_warps(block_h), **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def rmsnorm(x, weight, eps, out=None, *, x_out=None, ids=None, vocab_start=0, vocab_size=None, pdl=None,
            weight_first=None, _stale_bug=False):
    """out = RMSNorm(x) * weight in BF16 (x rounded to BF16 first), with no residual: the kernel of
    ``fused_add_rmsnorm`` with a zero residual that it neither reads nor writes (no zero tensor to
    fill). ``x_out`` [w, H] BF16 (optional) also receives x's BF16 values (a residual stream's start).
    x [w, H] BF16 (an FP32 x is rounded by the caller: the interpreter's conversion truncates).
    ``ids`` [w] integer: x is instead an embedding table [V, H] BF16 and row r is its row
    ids[r] - vocab_start, zero where that falls outside [0, vocab_size) (default V; the reference's
    ``embed_tokens`` of one rank's vocabulary slice: the gather, the mask and the norm in one launch).
    ``weight_first``: as ``fused_add_rmsnorm``'s. ``_stale_bug``: the tests' negative control (the
    kernel adds what ``x_out`` held before the call)."""
    check(x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1, "x [w, H] bf16, contiguous rows")
    w, H = x.shape
    gather = ids is not None
    if gather:
        check(ids.dim() == 1 and not ids.is_floating_point() and ids.device == x.device, "ids [w] integer")
        w = ids.shape[0]
    vocab_size = x.shape[0] if vocab_size is None else int(vocab_size)
    check(1 <= vocab_size <= x.shape[0], "vocab_size within the table's rows")
    check(weight.shape == (H,) and weight.stride(0) == 1 and weight.device == x.device, "weight [H]")
    if out is None:
        out = torch.empty((w, H), device=x.device, dtype=torch.bfloat16)
    check(out.shape == (w, H) and out.stride(1) == 1, "out [w, H]")
    if x_out is not None:
        check(x_out.shape == (w, H) and x_out.stride(1) == 1 and x_out.dtype == torch.bfloat16
              and x_out.device == x.device, "x_out [w, H] bf16")
    block_h = next_pow2(H)
    check(block_h <= 32768, "H <= 32768")
    use_pdl = pdl_supported(x.device) and (PDL if pdl is None else bool(pdl))
    res = out if x_out is None else x_out     # (RES: the dtype x is rounded to; written only as x_out)
    _add_rmsnorm_kernel[(w,)](
        x, res, weight, out, out, ids if gather else x, x.stride(0), res.stride(0), out.stride(0), 0, float(eps),
        int(vocab_start), vocab_size,
        H=H, BLOCK_H=block_h, NORM_BUG=False, HAS16=False, PDL=use_pdl, LOAD_RES=bool(_stale_bug),
        STORE_RES=x_out is not None, GATHER=gather, num_warps=num_warps(block_h),
        WEIGHT_FIRST=resolve_weight_first(weight_first),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def add_rmsnorm_reference(x, residual, weight, eps):
    """(residual_out in residual's dtype, normed in FP64): the oracle of the tests."""
    r = (residual.float() + x.float()).to(residual.dtype)
    rd = r.double()
    normed = rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return r, normed
