"""MoE router for the decode round in one launch: FP32 logits, top-k, softmax over the chosen k.

The reference routes with three to five torch launches per layer (an FP32 SGEMM of the BF16 input
against the upcast router weight, a split-K reduce, ``topk`` = a gather and a bitonic sort, a
softmax): about 25 us per layer on the H200 (``bench_step.py --profile``, session 13), for 1.5 MB of
router weight (0.4 us of bandwidth).

Algorithm (``_router_kernel``, grid (ceil(E / BLOCK_E), SPLIT_H))
------------------------------------------------------------------
Program (e, s) computes the partial logits of experts [e * BLOCK_E, ...) for all rows over the s-th
slice of H: BF16 x against the BF16 router rows (products exact in FP32, FP32 accumulation on the
tensor cores; by default the router slice is loaded before the program waits for the norm that
writes x, see WEIGHTS_FIRST), and stores the live rows' partials (FP32) to a workspace. Then it
takes a ticket on an arrival counter (release/acquire); the last program to arrive sums the SPLIT_H
partials in split order (a fixed order: deterministic), selects per row the K largest logits with K
max-reductions of the sampler's int64 keys (order-preserving value bits, then the inverted index:
largest first, among equal logits the lower expert index first) and writes their expert ids (int32,
what the MoE kernel reads) and softmax(top values) (FP32), then re-zeroes the counter for the next
call (CUDA-graph replay).

With ``norm=`` (``FastModel.fuse_router_norm``) the kernel is also the pre-MoE RMSNorm: x is not an
input but each program's slice of RMSNorm(res) * weight, from the residual that the output projection
updated (``linear.skinny_linear(residual=)``) and the per-column-block sums of squares it wrote
(summed here in block order: the same in every program); the programs of expert block 0 write their
slices of h (BF16) and h16 (FP16) for the MoE. The norm weight's slice is loaded before the wait with
the router's. One launch (the norm's) fewer per layer.

Same contract as ``Model.route`` (FP32 logits of the BF16-rounded input; ids of the top k; weights
renormalised over them). The logits are summed in a different order than cuBLAS's, so they differ
from the reference's in the last bits: ids agree except where two logits are that close (a near
tie), which the tests check explicitly. Assumption: calls sharing a counter buffer do not overlap
(stream order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, check_rows_by_weight, launch_signature, next_pow2, pdl_supported
from .norm import load_weight, rms_scale
from .sampler import _KEY_MIN, _keys

BLOCK_E = 16      # experts per program (the tensor-core product's N >= 16)
SPLIT_H = 12      # H slices: 8 x 12 = 96 programs at E = 128; each reads 16 x 512 BF16 = 16 KiB (8 until
                  # session 20: 12 measured the q1 step 0.9912 / 0.9953 of 8's time at 8K / 64K, 16 0.995,
                  # 24 1.013; call 4)
BLOCK_K = 128
BLOCK_T = 16      # rows, padded (the product's M >= 16)
NUM_WARPS = 4
# Warps per program with norm=. Its weights-first product runs as KC = slice / 128 batched products
# of 128 columns summed: one [16, 512] product made Triton normalise the slice in the MMA operand's
# layout, replicated per warp (255 registers and 208-368 B of stack at q1, sm_90 compile); batched,
# 162 registers at 8 warps (192 at 4), no stack.
NORM_NUM_WARPS = 8
# Programmatic dependent launch: the router launches while the norm before it runs, releases the MoE's
# Gate/Up at its start and waits for the norm before reading x (sm_90+ CUDA; keyword pdl).
PDL = True
# Each program loads its whole router slice (BLOCK_E rows x one H slice, 24 KiB at q1) into registers
# *before* griddepcontrol.wait, then x, then one product over the slice (keyword weights_first). The
# router rows are weights, never written by the kernel before, so their DRAM round trip overlaps the
# norm the router waits for instead of following it. Off: the slice streams in BLOCK_K steps after the
# wait (the way until session 17). The same exact FP32 products, summed in another order (one long
# product over the zero-padded slice instead of chained steps): logits may differ in the last bits.
# Session 17 (H200, q1 step graph, alternating A/B): the steps after the wait took 1.0106 / 1.0095 of
# the step's time at 8K / 64K; the router alone in a graph 6.9 us against 7.5 us.
WEIGHTS_FIRST = True


@triton.jit
def _tile(P, offs_r, r_ok, stride, kk, k_ok):
    """P[offs_r, kk] (rows of x or of the router), zero outside r_ok x k_ok."""
    return tl.load(P + offs_r[:, None] * stride + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _norm_tile(res, offs_t, t_ok, kk, k_ok, ss, wt, OUT, stride_out, OUT16, stride_o16, eps, store,
               H: tl.constexpr, HAS16: tl.constexpr):
    """norm=: x[offs_t, kk] = RMSNorm(res) * weight in BF16 from the stored residual's tile ``res``,
    each row's sum of squares ``ss`` and the weight's slice ``wt`` (``norm.rms_scale``: the norm
    kernel's arithmetic); where ``store`` (one program per H slice), also written to OUT (BF16) and
    OUT16 (the same values as FP16, as ``fused_add_rmsnorm(out16=)``)."""
    o = rms_scale(res.to(tl.float32), ss[:, None], wt[None, :], H, eps).to(tl.bfloat16)
    if store:
        ok = t_ok[:, None] & k_ok[None, :]
        tl.store(OUT + offs_t[:, None] * stride_out + kk[None, :], o, mask=ok)
        if HAS16:
            tl.store(OUT16 + offs_t[:, None] * stride_o16 + kk[None, :], o.to(tl.float32).to(tl.float16), mask=ok)
    return o


@triton.jit(launch_metadata=launch_signature)
def _router_kernel(X, R, PART, CNT, IDS, WTS, stride_x, stride_r, stride_ids, stride_w, T,
                   H: tl.constexpr, E: tl.constexpr, K: tl.constexpr, HS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_H: tl.constexpr, E_POW2: tl.constexpr, ORDER_BUG: tl.constexpr = False,
                   PDL: tl.constexpr = False, WEIGHTS_FIRST: tl.constexpr = False,
                   HS_POW2: tl.constexpr = 0, RES=None, SSQ=None, WT=None, OUT=None, OUT16=None,
                   stride_res=0, stride_out=0, stride_o16=0, eps=0.0, NS: tl.constexpr = 1,
                   NS_POW2: tl.constexpr = 1, NORM: tl.constexpr = False, HAS16: tl.constexpr = False,
                   NORM_BUG: tl.constexpr = False):
    eb = tl.program_id(0)
    hs = tl.program_id(1)
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    h_lo = hs * HS
    h_hi = tl.minimum(h_lo + HS, H)
    if WEIGHTS_FIRST:   # the router slice before the wait (weights: no predecessor writes them)
        kk = h_lo + tl.arange(0, HS_POW2)
        k_ok = kk < h_hi
        r = _tile(R, offs_e, e_ok, stride_r, kk, k_ok)
        if NORM:
            wt = load_weight(WT, kk, k_ok)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()   # the norm's x (NORM: the residual and its sums of squares) from here
    if NORM:   # each row's sum of squares: the projection's per-block sums, in block order
        offs_s = tl.arange(0, NS_POW2)
        s_ok = offs_s < (NS - 1 if NORM_BUG else NS)   # (NORM_BUG, negative control: the last block left out)
        ssv = tl.load(SSQ + offs_t[:, None] * NS + offs_s[None, :], mask=t_ok[:, None] & s_ok[None, :], other=0.0)
        if WEIGHTS_FIRST:   # the residual's slice requested before anything waits for the sums: one round trip
            res = _tile(RES, offs_t, t_ok, stride_res, kk, k_ok)
        ss = tl.sum(ssv, 1)
    if WEIGHTS_FIRST:
        if NORM:
            xt = _norm_tile(res, offs_t, t_ok, kk, k_ok, ss, wt, OUT, stride_out, OUT16, stride_o16,
                            eps, eb == 0, H, HAS16)
            KC: tl.constexpr = HS_POW2 // BLOCK_K   # (the slice is whole BLOCK_K steps)
            x3 = tl.permute(tl.reshape(xt, [BLOCK_T, KC, BLOCK_K]), [1, 0, 2])
            r3 = tl.permute(tl.reshape(r, [BLOCK_E, KC, BLOCK_K]), [1, 2, 0])
            acc = tl.sum(tl.dot(x3, r3), 0)
        else:
            acc = tl.dot(_tile(X, offs_t, t_ok, stride_x, kk, k_ok), tl.trans(r))
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for k0 in range(h_lo, h_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < h_hi
            if NORM:
                xt = _norm_tile(_tile(RES, offs_t, t_ok, stride_res, kk, k_ok), offs_t, t_ok, kk, k_ok, ss,
                                load_weight(WT, kk, k_ok), OUT, stride_out, OUT16, stride_o16, eps, eb == 0, H, HAS16)
            else:
                xt = _tile(X, offs_t, t_ok, stride_x, kk, k_ok)
            acc += tl.dot(xt, tl.trans(_tile(R, offs_e, e_ok, stride_r, kk, k_ok)))
    # only the T live rows' partials are stored and summed (BLOCK_T pads T to the product's M)
    part = PART + hs * (BLOCK_T * E_POW2)
    tl.store(part + offs_t[:, None] * E_POW2 + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    # every thread's stores precede (bar.sync) the one release-add that publishes them
    tl.debug_barrier()
    ticket = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
    if ticket == n_prog - 1:   # the last program: all partials are visible (acquire)
        offs_a = tl.arange(0, E_POW2)
        logits = tl.zeros([BLOCK_T, E_POW2], tl.float32)
        for s in tl.static_range(SPLIT_H):
            logits += tl.load(PART + s * (BLOCK_T * E_POW2) + offs_t[:, None] * E_POW2 + offs_a[None, :],
                              mask=t_ok[:, None] & (offs_a < E)[None, :], other=0.0, cache_modifier=".cg")
        # the sampler's int64 keys: order-preserving bits of the value (+ 0.0: -0 and +0 tie), then the
        # index inverted, so that one max picks the largest value and, among equal ones, the lower
        # index (ORDER_BUG, negative control: the index not inverted, the higher first)
        keys = _keys(logits + 0.0, offs_a[None, :])
        if ORDER_BUG:
            keys = keys ^ 0x7FFFFFFF
        keys = tl.where((offs_a < E)[None, :], keys, _KEY_MIN)
        offs_k = tl.arange(0, K)
        top = tl.full([BLOCK_T, K], _KEY_MIN, tl.int64)
        for j in tl.static_range(K):   # K max-reductions (keys are distinct)
            m = tl.max(keys, 1)
            top = tl.where(offs_k[None, :] == j, m[:, None], top)
            keys = tl.where(keys == m[:, None], _KEY_MIN, keys)
        ids = (top & 0x7FFFFFFF).to(tl.int32)
        if not ORDER_BUG:
            ids = 0x7FFFFFFF - ids
        vb = (top >> 32).to(tl.int32)
        vb = tl.where(vb < 0, vb ^ 0x7FFFFFFF, vb)
        val = vb.to(tl.float32, bitcast=True)
        p = tl.exp(val - tl.max(val, 1)[:, None])
        wts = p / tl.sum(p, 1)[:, None]
        ok = t_ok[:, None]
        tl.store(IDS + offs_t[:, None] * stride_ids + offs_k[None, :], ids, mask=ok)
        tl.store(WTS + offs_t[:, None] * stride_w + offs_k[None, :], wts, mask=ok)
        tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")   # re-armed for the next call


def route_topk(x, router, k, *, counter=None, ids=None, weights=None, split_h=None, pdl=None, weights_first=None,
               norm=None, num_warps=None, _order_bug=False, _poison=False, _norm_bug=False):
    """(ids [T, k] int32, weights [T, k] FP32) of the top-k experts of FP32 logits x @ router^T.

    x [T, H] BF16 (T <= 16), router [E, H] BF16 (E <= 1024, k a power of two <= E). ``counter``: an
    int32 device tensor holding zero, left zero by every call (pass a persistent one for CUDA-graph
    capture; otherwise one is zeroed per call). ``ids`` / ``weights``: outputs to write into.
    ``split_h``: H slices (default SPLIT_H, at most one per BLOCK_K columns). ``pdl``: programmatic
    dependent launch (default PDL; sm_90+ CUDA only). ``weights_first``: the router slice loaded
    before the wait (default WEIGHTS_FIRST; slices of at most 1024 columns, padded to a power of two,
    else the steps). ``_order_bug``: negative control of the tests (equal logits in the wrong order);
    ``_poison``: the partial-logit workspace starts as NaN (tests: a finalise that reads a partial
    before it is written shows).

    ``norm`` = (res [T, H] BF16, ssq [T, S] FP32, weight [H], eps, out [T, H] BF16, out16 [T, H] FP16
    or None): the router's input is RMSNorm(res) * weight, computed here (x is not read; pass None)
    from the residual as stored by ``skinny_linear(residual=(res, ssq))`` and its per-block sums of
    squares (summed in block order), and also written to ``out`` / ``out16`` as ``fused_add_rmsnorm``
    would (one program per H slice writes it): the pre-MoE norm without a launch of its own.
    ``num_warps``: warps per program (default NUM_WARPS, with norm NORM_NUM_WARPS).
    ``_norm_bug``: its negative control (the last block's sum of squares left out)."""
    if norm is not None:
        res, ssq, nw, eps, out, out16 = norm
        x = res
    T, H, E = check_rows_by_weight(x, router, BLOCK_T, "x [T, H], router [E, H]")
    check(k >= 1 and k & (k - 1) == 0 and k <= E <= 1024, "k a power of two, k <= E <= 1024")
    split = int(split_h) if split_h else min(SPLIT_H, triton.cdiv(H, BLOCK_K))   # (no empty slices)
    check(split >= 1, "split_h >= 1")
    dev = x.device
    if counter is None:
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
    check(counter.dtype == torch.int32 and counter.device == dev and counter.numel() >= 1, "counter: int32 on x's device")
    if ids is None:
        ids = torch.empty((T, k), dtype=torch.int32, device=dev)
    if weights is None:
        weights = torch.empty((T, k), dtype=torch.float32, device=dev)
    check(ids.shape == (T, k) and ids.dtype == torch.int32 and ids.stride(1) == 1, "ids [T, k] int32")
    check(weights.shape == (T, k) and weights.dtype == torch.float32 and weights.stride(1) == 1,
          "weights [T, k] fp32")
    e_pow2 = max(16, next_pow2(E))
    shape = (split, BLOCK_T, e_pow2)
    part = (torch.full(shape, float("nan"), dtype=torch.float32, device=dev) if _poison
            else torch.empty(shape, dtype=torch.float32, device=dev))
    hs = triton.cdiv(triton.cdiv(H, split), BLOCK_K) * BLOCK_K   # H per slice, whole BLOCK_K steps
    use_pdl = pdl_supported(dev) and (PDL if pdl is None else bool(pdl))
    hs_pow2 = next_pow2(hs)
    first = (WEIGHTS_FIRST if weights_first is None else bool(weights_first)) and hs_pow2 <= 1024
    extra = {}
    if norm is not None:
        check(ssq.dim() == 2 and ssq.shape[0] == T and ssq.dtype == torch.float32 and ssq.is_contiguous()
              and ssq.device == dev, "norm: ssq [T, S] FP32, contiguous, on the residual's device")
        check(nw.shape == (H,) and nw.stride(0) == 1 and nw.device == dev, "norm: weight [H]")
        check(out.shape == (T, H) and out.dtype == torch.bfloat16 and out.stride(1) == 1 and out.device == dev,
              "norm: out [T, H] BF16 with contiguous rows")
        check(out16 is None or (out16.shape == (T, H) and out16.dtype == torch.float16 and out16.stride(1) == 1
                                and out16.device == dev), "norm: out16 [T, H] FP16 with contiguous rows")
        n_s = ssq.shape[1]
        extra = dict(RES=res, SSQ=ssq, WT=nw, OUT=out, OUT16=out16 if out16 is not None else out,
                     stride_res=res.stride(0), stride_out=out.stride(0),
                     stride_o16=out16.stride(0) if out16 is not None else 0, eps=float(eps), NS=n_s,
                     NS_POW2=next_pow2(n_s), NORM=True, HAS16=out16 is not None, NORM_BUG=bool(_norm_bug))
    _router_kernel[(triton.cdiv(E, BLOCK_E), split)](
        x, router, part, counter, ids, weights, x.stride(0), router.stride(0), ids.stride(0),
        weights.stride(0), T,
        H=H, E=E, K=k, HS=hs, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, SPLIT_H=split,
        E_POW2=e_pow2, ORDER_BUG=bool(_order_bug), PDL=use_pdl, WEIGHTS_FIRST=first,
        HS_POW2=hs_pow2 if first else 0, num_warps=int(num_warps or (NUM_WARPS if norm is None else NORM_NUM_WARPS)), **extra,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return ids, weights


def route_reference(x, router, k):
    """``Model.route``'s arithmetic: (ids int64, weights FP32, logits FP32) of x (BF16-rounded) @ router^T."""
    logits = x.to(torch.bfloat16).float() @ router.float().T
    top, ids = logits.topk(k, dim=-1)
    return ids, torch.softmax(top, dim=-1), logits
