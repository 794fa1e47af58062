"""RoPE of the new query/key rows + their KV-cache write, in one launch (decode round, T <= 8 rows).

Algorithm (``_rope_kv_kernel``, grid (T, nh + 2 * nkv), program = one head row of d values)
------------------------------------------------------------------------------------------
Input: qkv [T, (nh + 2 nkv) d] BF16 (the fused Q/K/V projection), cos2 / sin2 [T, d] FP32 (both
halves, as the reference's tables). Program (t, j):
* j < nh (a query head) or nh <= j < nh + nkv (a key head): x = qkv[t, j*d : (j+1)*d] in FP32,
  rot = (-x[d/2:], x[:d/2]), y = x * cos2[t] + rot * sin2[t] with each product and the sum rounded
  in FP32 (the kernel is compiled without FMA contraction: the reference's operations, exactly),
  then BF16 (round to nearest even). Query heads go to q_out [T, nh, d]; key heads to
  k_cache[j - nh, slot[t], :].
* j >= nh + nkv (a value head): v_cache[j - nh - nkv, slot[t], :] = qkv[t, j*d : (j+1)*d].
* Ring caches: labels[slot[t]] = positions[t] (program (t, nh + nkv) does it).
slot = positions (full cache) or positions % R (ring), computed by the caller once per pass.

Programmatic dependent launch (``pdl``, sm_90+ CUDA): the kernel releases its dependents at its
start (the attention split launches during it and reads start_pos / asks L2 for its boundary blocks
before its own wait) and waits for the kernel before it (the Q/K/V projection) before reading qkv.

It replaces the reference-shaped torch sequence of the fast step (FP32 cast, negate, concatenate,
two products, sum, BF16 cast, two or three ``index_copy_``): about nine launches per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, launch_signature, next_pow2, pdl_supported

PDL = True


@triton.jit(launch_metadata=launch_signature)
def _rope_kv_kernel(QKV, COS, SIN, QOUT, KC, VC, SLOT, POS, LABELS,
                    stride_t, stride_ct, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HAS_LABELS: tl.constexpr,
                    PDL: tl.constexpr, ROPE_BUG: tl.constexpr = False, SLOT_BUG: tl.constexpr = False):
    t = tl.program_id(0)
    j = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, D)
    half: tl.constexpr = D // 2
    slot = tl.load(SLOT + t).to(tl.int64)
    if SLOT_BUG:
        slot = slot + 1
    row = QKV + t * stride_t + j * D
    if j < NH + NKV:
        x = tl.load(row + offs).to(tl.float32)
        partner = tl.load(row + (offs + half) % D).to(tl.float32)
        if ROPE_BUG:
            rot = tl.where(offs < half, partner, -partner)
        else:
            rot = tl.where(offs < half, -partner, partner)
        c = tl.load(COS + t * stride_ct + offs)
        s = tl.load(SIN + t * stride_ct + offs)
        y = (x * c + rot * s).to(tl.bfloat16)
        if j < NH:
            tl.store(QOUT + t * stride_qt + j * stride_qh + offs, y)
        else:
            tl.store(KC + (j - NH) * stride_kh + slot * stride_ks + offs, y)
            if HAS_LABELS:
                if j == NH:
                    tl.store(LABELS + slot, tl.load(POS + t).to(LABELS.dtype.element_ty))
    else:
        v = tl.load(row + offs)
        tl.store(VC + (j - NH - NKV) * stride_vh + slot * stride_vs + offs, v)


def rope_kv_write(qkv, cos2, sin2, nh, nkv, k_cache, v_cache, slots, q_out=None, *, labels=None,
                  positions=None, pdl=None, _rope_bug=False, _slot_bug=False):
    """q_out [T, nh, d] = RoPE(q); k_cache[:, slots] = RoPE(k); v_cache[:, slots] = v (and, for a ring,
    labels[slots] = positions). Returns q_out.

    qkv [T, (nh + 2 nkv) d] BF16 (contiguous rows); cos2 / sin2 [T, d] (or [T, 1, d]) FP32;
    k_cache / v_cache [nkv, slots, d] BF16; slots [T] integer (the cache rows to write); labels
    [slots] integer with positions [T] (ring caches). No host synchronisation.
    ``_rope_bug`` / ``_slot_bug``: negative controls of the tests (the rotation's signs swapped; every
    row written one slot late).
    """
    T, width = qkv.shape
    d = k_cache.shape[2]
    check(width == (nh + 2 * nkv) * d and qkv.dtype == torch.bfloat16 and qkv.stride(1) == 1,
          f"qkv [T, (nh + 2 nkv) d] bf16: {tuple(qkv.shape)} for nh {nh}, nkv {nkv}, d {d}")
    check(d == next_pow2(d) and d >= 16, "head_dim: a power of two >= 16")
    cos2 = cos2.reshape(T, d)
    sin2 = sin2.reshape(T, d)
    check(cos2.dtype == sin2.dtype == torch.float32 and cos2.stride(1) == 1 and sin2.stride() == cos2.stride(),
          "cos2 / sin2 [T, d] fp32, same layout")
    check(k_cache.shape == v_cache.shape and k_cache.shape[0] == nkv and k_cache.dtype == torch.bfloat16
          and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "k/v caches [nkv, slots, d] bf16")
    check(slots.shape == (T,) and not slots.is_floating_point(), "slots [T] integer")
    has_labels = labels is not None
    check(not has_labels or (positions is not None and positions.shape == (T,)), "labels need positions [T]")
    if q_out is None:
        q_out = torch.empty((T, nh, d), device=qkv.device, dtype=torch.bfloat16)
    check(q_out.shape == (T, nh, d) and q_out.stride(2) == 1, "q_out [T, nh, d]")
    use_pdl = pdl_supported(qkv.device) and (PDL if pdl is None else bool(pdl))
    _rope_kv_kernel[(T, nh + 2 * nkv)](
        qkv, cos2, sin2, q_out, k_cache, v_cache, slots,
        positions if has_labels else slots, labels if has_labels else slots,
        qkv.stride(0), cos2.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        NH=nh, NKV=nkv, D=d, HAS_LABELS=has_labels, PDL=use_pdl, ROPE_BUG=bool(_rope_bug),
        SLOT_BUG=bool(_slot_bug), num_warps=1, enable_fp_fusion=False,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return q_out
