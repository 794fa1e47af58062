"""RoPE of the new query/key rows + their KV-cache write, in one launch (decode round, T <= 8 rows).

Algorithm (``_rope_kv_kernel``, grid (T, nh + 2 * nkv), program = one head row of d values)
------------------------------------------------------------------------------------------
Input: qkv [T, (nh + 2 nkv) d] BF16 (the fused Q/K/V projection), cos2 / sin2 [T, d] FP32 (both
halves, as the reference's tables), or (``inv_freq``) the tables computed in the program as the
reference computes them: angle = float64(position) * inv_freq[i mod d/2] in FP64, cos / sin in FP64
(libdevice, the CUDA math library's functions that torch's FP64 cos / sin call), rounded to FP32.
Program (t, j):
* j < nh (a query head) or nh <= j < nh + nkv (a key head): x = qkv[t, j*d : (j+1)*d] in FP32,
  rot = (-x[d/2:], x[:d/2]), y = x * cos2[t] + rot * sin2[t] with each product and the sum rounded
  in FP32 (the kernel is compiled without FMA contraction: the reference's operations, exactly),
  then BF16 (round to nearest even). Query heads go to q_out [T, nh, d]; key heads to
  k_cache[j - nh, slot[t], :].
* j >= nh + nkv (a value head): v_cache[j - nh - nkv, slot[t], :] = qkv[t, j*d : (j+1)*d].
* Ring caches: labels[slot[t]] = positions[t] (program (t, nh + nkv) does it).
slot = positions (full cache) or positions % R (ring): given by the caller, or (``ring_slots=R``)
computed in the program from positions.

``rope_tables`` computes a pass's cos2 / sin2 tables exactly as the reference does (FP64 angle
position * inv_freq, FP64 libdevice cos / sin, FP32) in one launch, grid (T,), instead of torch's
eight (cast, product, cos, sin, two casts, two concatenations).

Programmatic dependent launch (``pdl``, sm_90+ CUDA): the kernel releases its dependents at its
start (the attention split launches during it and reads start_pos / asks L2 for its boundary blocks
before its own wait) and waits for the kernel before it (the Q/K/V projection) before reading qkv.

It replaces the reference-shaped torch sequence of the fast step (FP32 cast, negate, concatenate,
two products, sum, BF16 cast, two or three ``index_copy_``): about nine launches per layer; with
``inv_freq`` and ``ring_slots`` also the pass's eight table launches and its slot remainder.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, launch_signature, next_pow2, pdl_supported

PDL = True


@triton.jit
def _cos_sin(POS, INVF, t, offs, half: tl.constexpr, ANGLE_BUG: tl.constexpr):
    """The reference's RoPE tables at row t: FP64 angle float64(position) * inv_freq[offs mod half],
    FP64 cos / sin (libdevice), rounded to FP32. ANGLE_BUG (negative control): the angle in FP32."""
    ang = tl.load(POS + t).to(tl.float64) * tl.load(INVF + offs % half)
    if ANGLE_BUG:
        ang = ang.to(tl.float32).to(tl.float64)
    return libdevice.cos(ang).to(tl.float32), libdevice.sin(ang).to(tl.float32)


@triton.jit
def _qkv_vals(row, idx, NPARTS: tl.constexpr, stride_p):
    """The BF16 projection output at row[idx]: loaded (NPARTS 0), or the sum of NPARTS FP32 partials
    in slice order from zero, rounded once (skinny_linear's last arriver's arithmetic)."""
    if NPARTS == 0:
        return tl.load(row + idx)
    tot = tl.zeros(idx.shape, tl.float32)
    for s in tl.static_range(NPARTS):
        tot += tl.load(row + s * stride_p + idx)
    return tot.to(tl.bfloat16)


@triton.jit(launch_metadata=launch_signature)
def _rope_kv_kernel(QKV, COS, SIN, QOUT, KC, VC, SLOT, POS, LABELS, INVF, RING_R,
                    stride_t, stride_ct, stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
                    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HAS_LABELS: tl.constexpr,
                    PDL: tl.constexpr, ANGLES: tl.constexpr = False, SLOT_FROM_POS: tl.constexpr = False,
                    ROPE_BUG: tl.constexpr = False, SLOT_BUG: tl.constexpr = False,
                    ANGLE_BUG: tl.constexpr = False, NPARTS: tl.constexpr = 0, stride_p=0):
    t = tl.program_id(0)
    j = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, D)
    half: tl.constexpr = D // 2
    if SLOT_FROM_POS:   # positions and the ring size are not written by the predecessor
        slot = tl.load(POS + t).to(tl.int64) % RING_R
    else:
        slot = tl.load(SLOT + t).to(tl.int64)
    if SLOT_BUG:
        slot = slot + 1
    row = QKV + t * stride_t + j * D
    if j < NH + NKV:
        x = _qkv_vals(row, offs, NPARTS, stride_p).to(tl.float32)
        partner = _qkv_vals(row, (offs + half) % D, NPARTS, stride_p).to(tl.float32)
        if ROPE_BUG:
            rot = tl.where(offs < half, partner, -partner)
        else:
            rot = tl.where(offs < half, -partner, partner)
        if ANGLES:   # the reference's tables, computed here
            c, s = _cos_sin(POS, INVF, t, offs, half, ANGLE_BUG)
        else:
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
        v = _qkv_vals(row, offs, NPARTS, stride_p)
        tl.store(VC + (j - NH - NKV) * stride_vh + slot * stride_vs + offs, v)


@triton.jit(launch_metadata=launch_signature)
def _rope_tables_kernel(POS, INVF, COS, SIN, stride_t, D: tl.constexpr, ANGLE_BUG: tl.constexpr = False):
    t = tl.program_id(0)
    offs = tl.arange(0, D)
    c, s = _cos_sin(POS, INVF, t, offs, D // 2, ANGLE_BUG)
    tl.store(COS + t * stride_t + offs, c)
    tl.store(SIN + t * stride_t + offs, s)


def rope_tables(positions, inv_freq, *, _angle_bug=False):
    """(cos2, sin2) [T, 1, d] FP32 of integer positions [T] and inv_freq [d / 2] FP64, both halves:
    the reference's ``cos(float64(p) * inv_freq)`` rounded to FP32, in one launch (a plain launch:
    positions are written by an earlier torch op, not by a programmatic predecessor)."""
    check(positions.dim() == 1 and not positions.is_floating_point(), "positions [T] integer")
    check(inv_freq.dim() == 1 and inv_freq.dtype == torch.float64 and inv_freq.stride(0) == 1, "inv_freq [d / 2] fp64")
    check(positions.device == inv_freq.device, "one device")
    T, d = positions.shape[0], 2 * inv_freq.shape[0]
    check(d == next_pow2(d), "d a power of two")
    cos2 = torch.empty((T, 1, d), device=positions.device, dtype=torch.float32)
    sin2 = torch.empty_like(cos2)
    _rope_tables_kernel[(T,)](positions, inv_freq, cos2, sin2, cos2.stride(0), D=d, ANGLE_BUG=bool(_angle_bug),
                              num_warps=1, enable_fp_fusion=False)
    return cos2, sin2


def rope_kv_write(qkv, cos2, sin2, nh, nkv, k_cache, v_cache, slots, q_out=None, *, labels=None,
                  positions=None, inv_freq=None, ring_slots=None, pdl=None, qkv_parts=None, _rope_bug=False,
                  _slot_bug=False, _angle_bug=False):
    """q_out [T, nh, d] = RoPE(q); k_cache[:, slots] = RoPE(k); v_cache[:, slots] = v (and, for a ring,
    labels[slots] = positions). Returns q_out.

    qkv [T, (nh + 2 nkv) d] BF16 (contiguous rows); cos2 / sin2 [T, d] (or [T, 1, d]) FP32, or None
    with ``inv_freq`` [d / 2] FP64 (the tables computed in the kernel from ``positions``, as the
    reference computes them); k_cache / v_cache [nkv, slots, d] BF16; slots [T] integer (the cache rows
    to write), or None with ``ring_slots`` = R (slots = positions % R in the kernel); labels [slots]
    integer with positions [T] (ring caches). No host synchronisation.
    ``qkv_parts`` [S, R, (nh + 2 nkv) d] FP32 (R >= T; qkv None): the Q/K/V projection's split-K
    partials (``skinny_linear(..., partials=True)``), summed here in slice order and rounded to BF16
    exactly as the projection's last arriver would (the same qkv bits), so that the projection ends
    without its arrival counter and sum.
    ``_rope_bug`` / ``_slot_bug`` / ``_angle_bug``: negative controls of the tests (the rotation's signs
    swapped; every row written one slot late; the in-kernel angle rounded to FP32).
    """
    d = k_cache.shape[2]
    nparts, stride_p = 0, 0
    if qkv_parts is not None:
        check(qkv is None, "give qkv or qkv_parts, not both")
        check(positions is not None or slots is not None, "qkv_parts: the rows come from positions or slots")
        check(qkv_parts.dim() == 3 and qkv_parts.dtype == torch.float32 and qkv_parts.stride(2) == 1,
              "qkv_parts [S, R, (nh + 2 nkv) d] fp32")
        T = positions.shape[0] if positions is not None else slots.shape[0]
        check(qkv_parts.shape[1] >= T, f"qkv_parts: {qkv_parts.shape[1]} rows for {T}")
        nparts, stride_p = qkv_parts.shape[0], qkv_parts.stride(0)
        qkv = qkv_parts[0, :T]
        width = qkv.shape[1]
        check(width == (nh + 2 * nkv) * d, f"qkv_parts: width {width} for nh {nh}, nkv {nkv}, d {d}")
    else:
        T, width = qkv.shape
        check(width == (nh + 2 * nkv) * d and qkv.dtype == torch.bfloat16 and qkv.stride(1) == 1,
              f"qkv [T, (nh + 2 nkv) d] bf16: {tuple(qkv.shape)} for nh {nh}, nkv {nkv}, d {d}")
    check(d == next_pow2(d) and d >= 16, "head_dim: a power of two >= 16")
    angles = inv_freq is not None
    if angles:
        check(cos2 is None and sin2 is None, "give the tables (cos2 / sin2) or inv_freq, not both")
        check(inv_freq.shape == (d // 2,) and inv_freq.dtype == torch.float64 and inv_freq.stride(0) == 1,
              "inv_freq [d / 2] fp64")
        cos2 = sin2 = inv_freq     # (unused by the kernel)
        stride_ct = 0
    else:
        check(cos2 is not None and sin2 is not None, "cos2 / sin2, or inv_freq")
        cos2 = cos2.reshape(T, d)
        sin2 = sin2.reshape(T, d)
        check(cos2.dtype == sin2.dtype == torch.float32 and cos2.stride(1) == 1 and sin2.stride() == cos2.stride(),
              "cos2 / sin2 [T, d] fp32, same layout")
        stride_ct = cos2.stride(0)
    check(k_cache.shape == v_cache.shape and k_cache.shape[0] == nkv and k_cache.dtype == torch.bfloat16
          and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "k/v caches [nkv, slots, d] bf16")
    from_pos = slots is None
    if from_pos:
        check(ring_slots is not None and int(ring_slots) >= 1, "slots, or ring_slots (slots = positions % R)")
    else:
        check(ring_slots is None, "give slots or ring_slots, not both")
        check(slots.shape == (T,) and not slots.is_floating_point(), "slots [T] integer")
    has_labels = labels is not None
    check(not has_labels or (positions is not None and positions.shape == (T,)), "labels need positions [T]")
    check(not (angles or from_pos) or (positions is not None and positions.shape == (T,)
                                       and not positions.is_floating_point()),
          "inv_freq / ring_slots need positions [T] integer")
    if q_out is None:
        q_out = torch.empty((T, nh, d), device=qkv.device, dtype=torch.bfloat16)
    check(q_out.shape == (T, nh, d) and q_out.stride(2) == 1, "q_out [T, nh, d]")
    use_pdl = pdl_supported(qkv.device) and (PDL if pdl is None else bool(pdl))
    pos = positions if positions is not None else slots
    _rope_kv_kernel[(T, nh + 2 * nkv)](
        qkv, cos2, sin2, q_out, k_cache, v_cache, pos if from_pos else slots, pos,
        labels if has_labels else pos, inv_freq if angles else cos2, int(ring_slots or 1),
        qkv.stride(0), stride_ct, q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        NH=nh, NKV=nkv, D=d, HAS_LABELS=has_labels, PDL=use_pdl, ANGLES=angles, SLOT_FROM_POS=from_pos,
        ROPE_BUG=bool(_rope_bug), SLOT_BUG=bool(_slot_bug), ANGLE_BUG=bool(_angle_bug),
        NPARTS=nparts, stride_p=stride_p, num_warps=1, enable_fp_fusion=False,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return q_out
