"""Fused MoE on E4M3 expert weights with 128 x 128 block scales, for the decode round (w <= 8 rows).

Algorithm (three launches, all grids fixed on the host; no host synchronisation)
-------------------------------------------------------------------------------
The w x 8 (row, expert) pairs are numbered p = row * 8 + k. Every program first derives, on the
device and with no sort, the grouping of the pairs by expert (``_expert_group``): pair p's rank
among the pairs of its expert and whether it is the first one, from a P x P comparison (P <= 64);
group g is the g-th smallest distinct expert; its members are its pairs in increasing p. So every
distinct expert is handled by exactly one group, and its weights are read once per step however
many rows chose it. Groups past the device-side count do nothing (the grid is sized for the worst
case, min(P, E) groups).

1. ``_moe_gate_up_kernel``, grid (min(P, E), ceil(I / GU_BLOCK_N)). Program (g, n) owns columns
   [n * GU_BLOCK_N, (n + 1) * GU_BLOCK_N) of Gate and the same columns of Up for expert group g:
   it gathers the group's rows of x (BF16, up to GU_BLOCK_M), streams the two E4M3 weight tiles along
   H in GU_BLOCK_K steps (upcast to BF16, exact), and keeps two FP32 accumulators
   acc_g += (x @ Wg^T) * s_g, acc_u += (x @ Wu^T) * s_u (one weight scale per 128 x 128 block).
   Then h = SiLU(acc_g) * acc_u, and per (pair, GU_BLOCK_N-column block) a scale
   sa = amax|h| / 448; it writes E4M3(h / sa) (round to nearest even, encoded with integer
   arithmetic) and sa. The activation scale block is therefore GU_BLOCK_N = 32 columns (finer than
   128): a 128-column block would need 128-wide programs, i.e. only 2 programs per expert, about 76
   programs for 38 experts on a 132-SM GPU, or a cross-program amax reduction.
2. ``_moe_down_kernel``, grid (min(P, E), ceil(H / DOWN_BLOCK_N)). Program (g, n) owns output columns
   [n * DOWN_BLOCK_N, ...) of expert group g's Down projection for all the group's pairs: the E4M3
   activations are dequantised (x sa, to BF16), the E4M3 Down tile is upcast, and
   acc += (a @ W2^T) * s2 in FP32 over I in DOWN_BLOCK_K steps; it writes y[pair, cols] in FP32. All
   8 experts of a row are processed in parallel by different programs.
3. ``_moe_reduce_kernel``, grid (w, ceil(H / RED_BLOCK_H)): out[r] = sum_k topk_weights[r, k] *
   y[r * 8 + k] in FP32, in the fixed order k = 0..7 (deterministic, no atomics), written in BF16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2

# Rows per expert group: at most w <= 8 pairs share an expert (each row picks 8 distinct experts);
# the tensor-core product needs M >= 16.
GU_BLOCK_M = 16
# Gate (and Up) columns per program: 8 programs per expert of width 256, about 300 programs for 38
# distinct experts (2+ per SM), each streaming 2 x 32 x 6144 B = 384 KiB of weights. Also the
# activation-scale block.
GU_BLOCK_N = 32
# H step = the weight scale block, so one scale per tile and step.
GU_BLOCK_K = 128
GU_NUM_STAGES = 4
GU_NUM_WARPS = 4
# Down: 128 output columns x 256 inputs = 32 KiB of E4M3 per program, about 1,800 programs.
DOWN_BLOCK_N = 128
DOWN_BLOCK_K = 128
DOWN_NUM_STAGES = 2
DOWN_NUM_WARPS = 4
RED_BLOCK_H = 1024

_FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _expert_group(IDS, g, P, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Group g of the (row, expert) pairs: (expert, number of groups, member pairs [BLOCK_M], mask)."""
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    e_p = tl.load(IDS + offs_p, mask=p_ok, other=-1)
    e_q = tl.load(IDS + offs_p, mask=p_ok, other=-2)
    same = (e_p[:, None] == e_q[None, :]) & p_ok[:, None] & p_ok[None, :]
    earlier = offs_p[None, :] < offs_p[:, None]
    rank = tl.sum((same & earlier).to(tl.int32), 1)          # rank of p among its expert's pairs
    first = p_ok & (rank == 0)
    first_q = tl.sum((same & (offs_p[:, None] < offs_p[None, :])).to(tl.int32), 0) == 0
    first_q = first_q & p_ok
    smaller = first_q[None, :] & (e_q[None, :] < e_p[:, None])
    grp = tl.sum(smaller.to(tl.int32), 1)                    # distinct experts smaller than e_p
    n_groups = tl.sum(first.to(tl.int32), 0)
    expert = tl.sum(tl.where(first & (grp == g), e_p, 0), 0)
    member = p_ok & (e_p == expert)
    offs_r = tl.arange(0, BLOCK_M)
    hit = member[None, :] & (rank[None, :] == offs_r[:, None])
    pair = tl.sum(tl.where(hit, offs_p[None, :], 0), 1)
    row_ok = tl.sum(hit.to(tl.int32), 1) > 0
    return expert, n_groups, pair, row_ok


@triton.jit
def _e4m3_bits(a):
    """FP32 values with |a| <= 448 -> E4M3 (fn) bit patterns, round to nearest even, as uint8."""
    mag = tl.abs(a)
    bits = mag.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = ((rounded >> 23) - 120) * 8 + ((rounded >> 20) & 7)
    t = mag * 512.0                       # subnormals: multiples of 2^-9
    ti = t.to(tl.int32)
    fr = t - ti.to(tl.float32)
    up = (fr > 0.5) | ((fr == 0.5) & ((ti & 1) == 1))
    sub = ti + up.to(tl.int32)
    code = tl.where(mag >= 0.015625, normal, sub)
    code = code + tl.where(a < 0, 128, 0)
    return code.to(tl.uint8)


@triton.jit(do_not_specialize=["P"])
def _moe_gate_up_kernel(
    X, IDS, W13, S13, ACT, ACT_SCALE,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_am, stride_asm, P,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, N_KB: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BUG: tl.constexpr,
):
    g = tl.program_id(0)
    nb = tl.program_id(1)
    expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M)
    if g < n_groups:
        tok = pair // TOPK
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        w_g = W13 + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        w_u = w_g + I * stride_wn
        s_base = S13 + expert * stride_se
        s_g = s_base + (offs_n // 128) * stride_sn
        s_u = s_base + ((offs_n + I) // 128) * stride_sn
        x_ptr = X + tok[:, None] * stride_xm
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < H
            x = tl.load(x_ptr + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_g + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(w_u + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            kb = k0 // 128
            if SCALE_BUG:
                kb = (kb + 1) % N_KB
            sg = tl.load(s_g + kb * stride_sk, mask=n_ok, other=0.0)
            su = tl.load(s_u + kb * stride_sk, mask=n_ok, other=0.0)
            acc_g += tl.dot(x, tl.trans(wg.to(tl.bfloat16))) * sg[None, :]
            acc_u += tl.dot(x, tl.trans(wu.to(tl.bfloat16))) * su[None, :]
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        ok = row_ok[:, None] & n_ok[None, :]
        h = tl.where(ok, h, 0.0)
        amax = tl.max(tl.abs(h), 1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full([BLOCK_M], 448.0, tl.float32)), 1.0)
        a = tl.math.div_rn(h, tl.broadcast_to(scale[:, None], [BLOCK_M, BLOCK_N]))
        a = tl.minimum(tl.maximum(a, -_FP8_MAX), _FP8_MAX)
        tl.store(ACT + pair[:, None] * stride_am + offs_n[None, :], _e4m3_bits(a), mask=ok)
        tl.store(ACT_SCALE + pair * stride_asm + nb, scale, mask=row_ok)


@triton.jit(do_not_specialize=["P"])
def _moe_down_kernel(
    ACT, ACT_SCALE, IDS, W2, S2, Y,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ym, P,
    H: tl.constexpr, I: tl.constexpr, N_KB: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT_BLOCK: tl.constexpr, SCALE_BUG: tl.constexpr,
):
    g = tl.program_id(0)
    nb = tl.program_id(1)
    expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M)
    if g < n_groups:
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        w_ptr = W2 + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        s_ptr = S2 + expert * stride_se + (offs_n // 128) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < I
            a_ok = row_ok[:, None] & k_ok[None, :]
            a8 = tl.load(ACT + pair[:, None] * stride_am + kk[None, :], mask=a_ok, other=0.0)
            sa = tl.load(ACT_SCALE + pair[:, None] * stride_asm + (kk // ACT_BLOCK)[None, :],
                         mask=a_ok, other=0.0)
            a = (a8.to(tl.float32) * sa).to(tl.bfloat16)
            w = tl.load(w_ptr + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            kb = k0 // 128
            if SCALE_BUG:
                kb = (kb + 1) % N_KB
            sw = tl.load(s_ptr + kb * stride_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(w.to(tl.bfloat16))) * sw[None, :]
        tl.store(Y + pair[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_reduce_kernel(Y, TW, OUT, stride_ym, stride_tw, stride_om, H: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOPK):
        wk = tl.load(TW + r * stride_tw + k).to(tl.float32)
        acc += wk * tl.load(Y + (r * TOPK + k) * stride_ym + offs, mask=ok, other=0.0)
    tl.store(OUT + r * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def _check_inputs(x, topk_ids, topk_weights, w13, s13, w2, s2):
    check(x.dim() == 2 and x.dtype == torch.bfloat16, "x [w, H] bf16")
    w, H = x.shape
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == w, "topk_ids [w, k]")
    check(topk_weights.shape == topk_ids.shape, "topk_weights [w, k]")
    E, two_i, H2 = w13.shape
    I = two_i // 2
    check(H2 == H and two_i == 2 * I, f"w13 {tuple(w13.shape)} vs x {tuple(x.shape)}")
    check(w2.shape == (E, H, I), f"w2 {tuple(w2.shape)}, expected {(E, H, I)}")
    check(w13.dtype == torch.float8_e4m3fn and w2.dtype == torch.float8_e4m3fn, "E4M3 weights")
    check(s13.shape == (E, -(-2 * I // 128), -(-H // 128)), f"s13 {tuple(s13.shape)}")
    check(s2.shape == (E, -(-H // 128), -(-I // 128)), f"s2 {tuple(s2.shape)}")
    check(w13.stride(2) == 1 and w2.stride(2) == 1 and x.stride(1) == 1, "contiguous rows")
    return w, H, E, I, topk_ids.shape[1]


def fused_moe_fp8(x, topk_ids, topk_weights, w13, s13, w2, s2, out=None, *, _scale_bug=False,
                  gu_num_stages=None, down_num_stages=None):
    """out[r] = sum_k topk_weights[r, k] * Down_e(SiLU(Gate_e x_r) * Up_e x_r), e = topk_ids[r, k].

    x [w, H] bf16; topk_ids [w, 8] int32 (distinct per row); topk_weights [w, 8] fp32; w13 [E, 2I, H]
    E4M3 (rows 0..I-1 Gate, I..2I-1 Up) with s13 [E, ceil(2I/128), ceil(H/128)] fp32; w2 [E, H, I]
    E4M3 with s2 [E, ceil(H/128), ceil(I/128)]. Returns out [w, H] bf16. No host synchronisation.
    ``_scale_bug`` is the negative control of the tests (reads the next H/I block's weight scale).
    """
    w, H, E, I, topk = _check_inputs(x, topk_ids, topk_weights, w13, s13, w2, s2)
    P = w * topk
    check(P <= 64 and w <= GU_BLOCK_M, "at most 64 (row, expert) pairs and 16 rows")
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.contiguous()
    dev = x.device
    n_groups_max = min(P, E)
    n_ablk = triton.cdiv(I, GU_BLOCK_N)
    act = torch.empty((P, I), device=dev, dtype=torch.float8_e4m3fn)
    act_scale = torch.empty((P, n_ablk), device=dev, dtype=torch.float32)
    y = torch.empty((P, H), device=dev, dtype=torch.float32)
    if out is None:
        out = torch.empty((w, H), device=dev, dtype=torch.bfloat16)
    check(out.shape == (w, H) and out.stride(1) == 1, "out [w, H]")
    block_p = max(16, next_pow2(P))
    _moe_gate_up_kernel[(n_groups_max, n_ablk)](
        x, ids, w13, s13, act.view(torch.uint8), act_scale,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
        act.stride(0), act_scale.stride(0), P,
        H=H, I=I, TOPK=topk, N_KB=s13.shape[2],
        BLOCK_P=block_p, BLOCK_M=GU_BLOCK_M, BLOCK_N=GU_BLOCK_N, BLOCK_K=GU_BLOCK_K,
        SCALE_BUG=_scale_bug,
        num_warps=GU_NUM_WARPS, num_stages=gu_num_stages or GU_NUM_STAGES,
    )
    _moe_down_kernel[(n_groups_max, triton.cdiv(H, DOWN_BLOCK_N))](
        act, act_scale, ids, w2, s2, y,
        act.stride(0), act_scale.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        s2.stride(2), y.stride(0), P,
        H=H, I=I, N_KB=s2.shape[2],
        BLOCK_P=block_p, BLOCK_M=GU_BLOCK_M, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=DOWN_BLOCK_K,
        ACT_BLOCK=GU_BLOCK_N, SCALE_BUG=_scale_bug,
        num_warps=DOWN_NUM_WARPS, num_stages=down_num_stages or DOWN_NUM_STAGES,
    )
    _moe_reduce_kernel[(w, triton.cdiv(H, RED_BLOCK_H))](
        y, tw, out, y.stride(0), tw.stride(0), out.stride(0),
        H=H, TOPK=topk, BLOCK_H=RED_BLOCK_H, num_warps=4,
    )
    return out


def _dequant(wq, s, rows, cols):
    sf = s.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    return wq.float() * sf


def moe_reference(x, topk_ids, topk_weights, w13, s13, w2, s2, out=None, *, act_block=None):
    """FP32 oracle: dequantise the chosen experts (gathered by topk_ids on the device, no host sync).

    With ``act_block`` set, the SwiGLU activations are quantised like the kernel does (E4M3, one
    scale amax/448 per pair and act_block-column block) before Down; otherwise they stay FP32.
    Returns FP32 [w, H] (copied into ``out`` when given).
    """
    w, H, E, I, topk = _check_inputs(x, topk_ids, topk_weights, w13, s13, w2, s2)
    ids = topk_ids.long()
    W13 = _dequant(w13[ids], s13[ids], 2 * I, H)                     # [w, k, 2I, H]
    gu = torch.einsum("wh,wkoh->wko", x.float(), W13)
    del W13
    h = torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]          # [w, k, I]
    if act_block is not None:
        nb = -(-I // act_block)
        hp = torch.nn.functional.pad(h, (0, nb * act_block - I)).view(w, topk, nb, act_block)
        amax = hp.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (hp / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        h = (q * scale).view(w, topk, nb * act_block)[..., :I]
    W2 = _dequant(w2[ids], s2[ids], H, I)                            # [w, k, H, I]
    y = torch.einsum("wki,wkhi->wkh", h, W2)
    res = (topk_weights.float()[..., None] * y).sum(1)
    if out is not None:
        out.copy_(res)
        return out
    return res
