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

``route_folded`` (``kernels.routing=folded``, the fast backend's default since session 44) is the routing
folded into the output projection: ``linear.skinny_linear(fold=)`` writes per column block the router's
product with the residual times the norm weight, and one launch sums those partials per row, scales them
by the row's RMS, selects the top k (``_topk_store``, shared with ``_router_kernel``) and writes h / h16.
Its logits are those of the unrounded normalised input, not ``Model.route``'s (see there).

``route_topk``: same contract as ``Model.route`` (FP32 logits of the BF16-rounded input; ids of the top k; weights
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
        _topk_store(logits, offs_t, t_ok, IDS, WTS, stride_ids, stride_w, E, K, BLOCK_T, E_POW2, ORDER_BUG)
        tl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")   # re-armed for the next call


@triton.jit
def _topk_store(logits, offs_t, t_ok, IDS, WTS, stride_ids, stride_w, E, K: tl.constexpr, ROWS: tl.constexpr,
                E_POW2: tl.constexpr, ORDER_BUG: tl.constexpr):
    """Rows offs_t (live where t_ok) of logits [ROWS, E_POW2] (experts past E ignored): the ids of the
    K largest (largest first; among equal logits the lower index first) into IDS, softmax over them
    into WTS."""
    offs_a = tl.arange(0, E_POW2)
    # the sampler's int64 keys: order-preserving bits of the value (+ 0.0: -0 and +0 tie), then the
    # index inverted, so that one max picks the largest value and, among equal ones, the lower
    # index (ORDER_BUG, negative control: the index not inverted, the higher first)
    keys = _keys(logits + 0.0, offs_a[None, :])
    if ORDER_BUG:
        keys = keys ^ 0x7FFFFFFF
    keys = tl.where((offs_a < E)[None, :], keys, _KEY_MIN)
    offs_k = tl.arange(0, K)
    top = tl.full([ROWS, K], _KEY_MIN, tl.int64)
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


@triton.jit(launch_metadata=launch_signature)
def _route_folded_kernel(PL, SSQ, RES, WT, OUT, OUT16, IDS, WTS, stride_res, stride_out, stride_o16, stride_ids,
                         stride_w, eps, T, H: tl.constexpr, E: tl.constexpr, K: tl.constexpr, NB: tl.constexpr,
                         NB_POW2: tl.constexpr, PL_ROWS: tl.constexpr, E_POW2: tl.constexpr, NS: tl.constexpr,
                         NS_POW2: tl.constexpr, HS: tl.constexpr, BLOCK_T: tl.constexpr,
                         HAS16: tl.constexpr, PDL: tl.constexpr, ORDER_BUG: tl.constexpr = False,
                         SCALE_BUG: tl.constexpr = False):
    """Programs 0 .. T-1: row p's logits = rsqrt(sum of squares / H + eps) x the sum over the NB column
    blocks of the projection's partials PL[b, p, :] (a fixed tree order), its top K and their softmax.
    Programs T ..: one H slice each of h = RMSNorm(res) * weight (and h16), as ``route_topk(norm=)``
    writes it. SCALE_BUG (negative control): the per-row scale left out."""
    p = tl.program_id(0)
    # a norm program's slice of the norm weight before the wait (a weight: no predecessor writes it;
    # masked off in the routing programs)
    kk = (p - T) * HS + tl.arange(0, HS)   # (HS: a power of two)
    k_ok = (kk < H) & (p >= T)
    wt = load_weight(WT, kk, k_ok)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()   # the projection's residual, sums of squares and partials from here
    if p < T:
        offs_s = tl.arange(0, NS_POW2)
        ss = tl.sum(tl.load(SSQ + p * NS + offs_s, mask=offs_s < NS, other=0.0), 0)
        offs_b = tl.arange(0, NB_POW2)
        offs_e = tl.arange(0, E_POW2)
        part = tl.load(PL + offs_b[:, None] * (PL_ROWS * E_POW2) + p * E_POW2 + offs_e[None, :],
                       mask=(offs_b < NB)[:, None] & (offs_e < E)[None, :], other=0.0)
        logits = tl.sum(part, 0)
        if not SCALE_BUG:
            logits = logits * tl.math.rsqrt(ss / H + eps)
        row = p + tl.arange(0, 1)
        _topk_store(logits[None, :], row, row < T, IDS, WTS, stride_ids, stride_w, E, K, 1, E_POW2, ORDER_BUG)
    else:
        offs_t = tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        offs_s = tl.arange(0, NS_POW2)
        ssv = tl.load(SSQ + offs_t[:, None] * NS + offs_s[None, :], mask=t_ok[:, None] & (offs_s < NS)[None, :],
                      other=0.0)
        res = _tile(RES, offs_t, t_ok, stride_res, kk, k_ok)
        _norm_tile(res, offs_t, t_ok, kk, k_ok, tl.sum(ssv, 1), wt, OUT, stride_out, OUT16, stride_o16, eps, True,
                   H, HAS16)


def _outputs(T, k, ids, weights, dev):
    """(ids [T, k] int32, weights [T, k] FP32): the given ones checked, or new ones."""
    if ids is None:
        ids = torch.empty((T, k), dtype=torch.int32, device=dev)
    if weights is None:
        weights = torch.empty((T, k), dtype=torch.float32, device=dev)
    check(ids.shape == (T, k) and ids.dtype == torch.int32 and ids.stride(1) == 1, "ids [T, k] int32")
    check(weights.shape == (T, k) and weights.dtype == torch.float32 and weights.stride(1) == 1,
          "weights [T, k] fp32")
    return ids, weights


def _check_norm(T, H, ssq, nw, out, out16, dev):
    """The norm inputs and outputs that ``route_topk(norm=)`` and ``route_folded`` share."""
    check(ssq.dim() == 2 and ssq.shape[0] == T and ssq.dtype == torch.float32 and ssq.is_contiguous()
          and ssq.device == dev, "norm: ssq [T, S] FP32, contiguous, on the residual's device")
    check(nw.shape == (H,) and nw.stride(0) == 1 and nw.device == dev, "norm: weight [H]")
    check(out.shape == (T, H) and out.dtype == torch.bfloat16 and out.stride(1) == 1 and out.device == dev,
          "norm: out [T, H] BF16 with contiguous rows")
    check(out16 is None or (out16.shape == (T, H) and out16.dtype == torch.float16 and out16.stride(1) == 1
                            and out16.device == dev), "norm: out16 [T, H] FP16 with contiguous rows")


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
    ids, weights = _outputs(T, k, ids, weights, dev)
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
        _check_norm(T, H, ssq, nw, out, out16, dev)
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


FOLD_SLICE = 512   # route_folded: H columns of h per norm program (12 programs at q1's H = 6,144)
FOLD_NUM_WARPS = 4


def route_folded(pl, ssq, experts, k, norm, *, ids=None, weights=None, pdl=None, slice_h=None, num_warps=None,
                 _order_bug=False, _scale_bug=False):
    """(ids [T, k] int32, weights [T, k] FP32) of the routing folded into the output projection
    (DESIGN.md, "routing folded into the attention tail"): ``pl`` = the router-logit partials that
    ``skinny_linear(residual=(res, ssq), fold=(router, weight, pl))`` wrote, ``ssq`` its per-block
    sums of squares, ``experts`` the router's row count E, ``norm`` = (res [T, H] BF16, weight [H], eps, out [T, H] BF16, out16 [T, H] FP16
    or None) as ``route_topk(norm=)``'s.

    logits[t] = rsqrt(sum(ssq[t]) / H + eps) * sum_b pl[b, t]: the router's product with
    RMSNorm(res) * weight in FP32, without rounding h to BF16 first. So this is *not* ``Model.route``'s
    contract (FP32 logits of the BF16-rounded h): the logits differ from it by about one BF16 rounding
    of h, and near ties may pick other experts (tests/kernels/test_router_fold.py measures how often).
    One launch: T programs route one row each (after one wait; no arrival counter), the others write
    h and h16 (``slice_h`` columns each, default FOLD_SLICE) for the MoE. ``pdl``: programmatic
    dependent launch of the projection (default PDL). ``_order_bug`` / ``_scale_bug``: negative
    controls (equal logits in the wrong order; the per-row scale left out)."""
    res, nw, eps, out, out16 = norm
    T, H = res.shape
    check(res.dtype == torch.bfloat16 and res.stride(1) == 1 and 1 <= T <= BLOCK_T, f"norm: res [T <= {BLOCK_T}, H] BF16")
    check(pl.dim() == 3 and pl.dtype == torch.float32 and pl.is_contiguous() and pl.shape[1] >= T
          and pl.shape[2] >= 16 and pl.shape[2] & (pl.shape[2] - 1) == 0, "pl: FP32 [blocks, rows >= T, E_pow2]")
    dev = res.device
    check(pl.device == dev, "pl on the residual's device")
    _check_norm(T, H, ssq, nw, out, out16, dev)
    E = int(experts)
    e_pow2 = pl.shape[2]
    check(k >= 1 and k & (k - 1) == 0 and k <= E and e_pow2 == max(16, next_pow2(E)),
          "k a power of two <= experts; pl's last dimension max(16, the experts' power of two)")
    ids, weights = _outputs(T, k, ids, weights, dev)
    hs = int(slice_h or FOLD_SLICE)
    check(hs >= 16 and hs & (hs - 1) == 0, "slice_h: a power of two >= 16")
    use_pdl = pdl_supported(dev) and (PDL if pdl is None else bool(pdl))
    n_b = pl.shape[0]
    _route_folded_kernel[(T + triton.cdiv(H, hs),)](
        pl, ssq, res, nw, out, out16 if out16 is not None else out, ids, weights, res.stride(0), out.stride(0),
        out16.stride(0) if out16 is not None else 0, ids.stride(0), weights.stride(0), float(eps), T,
        H=H, E=E, K=k, NB=n_b, NB_POW2=next_pow2(n_b), PL_ROWS=pl.shape[1], E_POW2=e_pow2, NS=ssq.shape[1],
        NS_POW2=next_pow2(ssq.shape[1]), HS=hs, BLOCK_T=BLOCK_T, HAS16=out16 is not None, PDL=use_pdl,
        ORDER_BUG=bool(_order_bug), SCALE_BUG=bool(_scale_bug), num_warps=int(num_warps or FOLD_NUM_WARPS),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return ids, weights


def route_reference(x, router, k):
    """``Model.route``'s arithmetic: (ids int64, weights FP32, logits FP32) of x (BF16-rounded) @ router^T."""
    logits = x.to(torch.bfloat16).float() @ router.float().T
    top, ids = logits.topk(k, dim=-1)
    return ids, torch.softmax(top, dim=-1), logits
