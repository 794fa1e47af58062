"""Skinny BF16 linear layer for the decode round: y = x @ W^T for at most 16 rows, launched while the
kernel before it still runs.

Why not cuBLAS: at 6 rows a projection is a pure weight stream (the q1 rank's fused Q/K/V weight is
12.6 MB, the output projection 9.4 MB: 3.0 and 2.2 us of bandwidth), but in the step's CUDA graph
cuBLAS takes ~7.6 us (split-K GEMM + its reduce) and ~5.0 us (``bench_step.py --profile``, session
13): each launch waits for its predecessor to complete. This kernel is a programmatic dependent
(griddepcontrol, sm_90+): it launches while the kernel before it (a norm, the attention combine)
still runs, releases its own dependent (RoPE, the norm) at its start, and waits for the
predecessor's output x only before reading it. In the q1 step's graph that is 1.2-1.8 % of the step
faster than cuBLAS (same-run A/B, ``bench_step.py --ab cublas_linear``, session 14); launched
plainly it is no faster than cuBLAS. Option ``prefetch``: ask L2 for the whole weight tile before the
wait (the weights do not depend on the step; a prefetch returns no data, so nothing stale can be
read). Measured slower in the step (0.6-1.2 %, session 14 call 4), so off by default
(``bench_step.py --ab linear_prefetch`` measures it against the default).

Algorithm (``_linear_kernel``, grid (N / BLOCK_N, SPLIT_K))
----------------------------------------------------------
Program (n, s) owns output columns [n * BLOCK_N, (n + 1) * BLOCK_N) and the s-th slice of K
(K_SLICE = K / SPLIT_K columns): a software-pipelined loop of BLOCK_K steps of x [16, BLOCK_K]
against W [BLOCK_N, BLOCK_K] (tensor cores, FP32 accumulation; at most 8 rows, by default, as
W [BLOCK_N, BLOCK_K] times x^T [BLOCK_K, 8]: WEIGHTS_A). With SPLIT_K = 1 it writes y
(BF16). Otherwise it stores its FP32 partial, takes a ticket on the column block's arrival counter
(release/acquire, after a CTA barrier), and the last of the SPLIT_K programs sums the partials in
slice order (deterministic) and writes y, then re-zeroes the counter (CUDA-graph replays).

Numerics: FP32 sums of BF16 products, rounded once to BF16, as cuBLAS does, in another order (so
results may differ from cuBLAS in the last bit; the tests compare against FP64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import (check, check_rows_by_weight, compiled_cuda, device_sm_count, launch_signature, next_pow2,
                      pdl_supported, prefetch_l2)
from .peer import _base, _fence, _publish_gather, _rearm, _record
from .peer import exchange_launch as _peer_launch

BLOCK_M = 16        # rows, padded (the tensor-core product's M >= 16)
BLOCK_K = 128       # K per loop step (the largest of 128, 64, 32, 16 that divides a slice)
NUM_STAGES = 6     # 4 until session 20: 6 measured the q1 step 0.9863-0.9885 (8K) / 0.9889-0.9896 (64K) of 4's time
NUM_WARPS = 4
PDL = True          # programmatic dependent launch (session 14, q1 step A/B: 1.2-2.0 % of the step)
PREFETCH = False    # the weight tile asked of L2 before the wait (session 14: the step 0.6-1.2 % slower)
MAX_ROWS = BLOCK_M
FOLD_ROWS = 16      # rows per column block in ``fold``'s router-logit partials (MAX_ROWS; the live ones written)
# With ``partials`` (the consumer, rope_kv_write(qkv_parts=), sums the split-K slices) the plan drops the
# last arriver's cost and takes at most this many slices. An empirical cap, not a modelled cost: in the
# q1 step (H200, session 24 call 8, Q/K/V tilings against 32 columns x 4 slices) 64 x 8 measured
# 0.9950 [0.9933, 0.9966] (8K) / 0.9973 [0.9955, 0.9987] (64K), but the 16-slice tilings the byte count
# prefers were slower: 128 x 16 1.0032 / 1.0060, 64 x 16 1.0034 / 1.0051 (32 x 8 1.0007 / 1.0000).
PARTIALS_MAX_SPLIT = 8
# ... and, where skinny_linear plans the tiling itself, K steps of this many columns (where they divide
# the slice). Session 27 (H200, q1 step A/B against 64 x 8 in steps of 128, calls 3 and 4): 0.9964
# [0.9952, 0.9991] / 0.9962 [0.9947, 0.9973] at 8K, 0.9992 / 0.9986 at 64K (that run's A/A at 64K:
# 1.0012-1.0021).
PARTIALS_BLOCK_K = 64
# The weight tile as the MMA's A operand times x^T (8 rows as N, no padding to 16), where M <= 8
# (keyword weights_a; the MoE's form since session 23). sm_90 compile: 768 against 816 instructions
# (Q/K/V tiling), 544 against 616 (output projection). H200, session 23 (q1 step A/B, alternating
# graphs, then measured as the variant against x as A): 0.9953 [0.9939, 0.9976] (8K), 0.9962
# [0.9944, 0.9988] (64K); `bench_step.py --ab linear_x_a` now measures the other way. False (and
# above 8 rows always): x [16 padded rows, K] times the tile transposed.
WEIGHTS_A = True
# ``peer=``: the memory semantics of the column blocks' arrival ticket (peer keyword ``ticket``). "acq_rel"
# orders each block's read of the sequence number before its ticket in the memory model's terms;
# "relaxed" (measurement) leaves that to the read's value having been used before the ticket is taken.
PEER_TICKET = "acq_rel"


@triton.jit
def _fold_tiles(WR, WG, offs_n, stride_wr, E, E_POW2: tl.constexpr):
    """``fold=``: this column block's router rows [E_POW2, BLOCK_N] (BF16, zero past E) and norm
    weight [BLOCK_N] (FP32): weights, so they may be loaded before the wait."""
    offs_e = tl.arange(0, E_POW2)
    wr = tl.load(WR + offs_e[:, None] * stride_wr + offs_n[None, :], mask=(offs_e < E)[:, None], other=0.0)
    return wr, tl.load(WG + offs_n).to(tl.float32)


@triton.jit
def _residual_epilogue(acc, res, res_ptrs, SSQ, offs_m, m_ok, pn, NB, y_ty, BUG: tl.constexpr,
                       FOLD: tl.constexpr = False, wr=None, wg=None, PL=None, E=0, E_POW2: tl.constexpr = 16,
                       PL_ROWS: tl.constexpr = 16, FOLD_BUG: tl.constexpr = False):
    """``residual=``: y = acc rounded to ``y_ty`` (the BF16 output the add + RMSNorm would read), the
    residual block r = res + y rounded to the residual's dtype and stored back (``fused_add_rmsnorm``'s
    add, the same two roundings), and each row's sum of squares of the stored r over the block into
    SSQ[row, pn] (FP32; NB blocks per row). BUG (negative control): the sum taken over y, not r.

    FOLD (``fold=``): also the block's router-logit partials PL[pn, row, e] = sum over the block's
    columns c of r[row, c] * wg[c] * wr[e, c] (FP32; r x wg rounded to TF32 for the tensor cores,
    the router rows exact in it), the pre-MoE RMSNorm's numerator without its per-row scale.
    FOLD_BUG (negative control): the norm weight left out."""
    y = acc.to(y_ty).to(tl.float32)
    r = (res.to(tl.float32) + y).to(res.dtype)
    tl.store(res_ptrs, r, mask=m_ok[:, None])
    rf = r.to(tl.float32)
    if FOLD:
        rg = rf if FOLD_BUG else rf * wg[None, :]
        pl_t = tl.dot(wr.to(tl.float32), tl.trans(rg), input_precision="tf32")   # [E_POW2, rows]
        offs_e = tl.arange(0, E_POW2)
        tl.store(PL + pn * (PL_ROWS * E_POW2) + offs_m[None, :] * E_POW2 + offs_e[:, None], pl_t,
                 mask=m_ok[None, :] & (offs_e < E)[:, None])
    if BUG:
        rf = y
    tl.store(SSQ + offs_m * NB + pn, tl.sum(rf * rf, 1), mask=m_ok)


@triton.jit
def _exchange_tile(acc, offs_n, M, PTRS, STATE, RANK, timeout_ns, seq, N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, ROWS: tl.constexpr, K: tl.constexpr, R: tl.constexpr, ON_GPU: tl.constexpr,
                   MAX_POLLS: tl.constexpr, LAG: tl.constexpr, ACQ: tl.constexpr, FENCE_ONE: tl.constexpr,
                   NO_REARM: tl.constexpr, NT: tl.constexpr):
    """``peer=``: the all-reduce of this column block's rank partial ``acc`` (FP32 [BLOCK_M, BLOCK_N], rounded
    to BF16 as the plain projection writes it) over the exchange (runtime/kernels/peer.py), at point
    ``seq``: published into this rank's slot, every rank's block gathered and summed in rank order in FP32
    (polled until ready or the bound), the failure record if any, and slot seq - LAG re-armed for every
    row of the exchange in this block's columns. Returns the FP32 sum [BLOCK_M, BLOCK_N].
    The tile goes through the exchange flat (BLOCK_M * BLOCK_N >= the program's threads: no element in two
    threads, see peer._poll)."""
    idx = tl.arange(0, BLOCK_M * BLOCK_N)
    rows = idx // BLOCK_N
    offs = rows * N + tl.program_id(0) * BLOCK_N + idx % BLOCK_N   # (row, column) in a slot of every buffer
    ok = rows < M
    off = (seq & (K - 1)) * (ROWS * N)
    y = tl.reshape(acc.to(tl.bfloat16), [BLOCK_M * BLOCK_N])
    own = _base(PTRS, RANK)
    tot, nan, yf = _publish_gather(PTRS, own, off, offs, ok, y, RANK, R, timeout_ns, ON_GPU, MAX_POLLS, NT, ACQ,
                                   FENCE_ONE)
    _record(PTRS, STATE, nan, seq, off, offs, ok, yf, RANK, R, ROWS)
    if not NO_REARM:   # this block's columns of every row of the slot
        _rearm(own, seq, offs_n, offs_n < N, 0, 1, ROWS, N, K, LAG)
    return tl.reshape(tot, [BLOCK_M, BLOCK_N])


@triton.jit
def _exchange_done(CNT, STATE, seq, NB: tl.constexpr, ROWS: tl.constexpr, ON_GPU: tl.constexpr, REL: tl.constexpr,
                   FENCE_ONE: tl.constexpr, TICKET_SEM: tl.constexpr):
    """``peer=``: the last of the NB column blocks to finish its exchange (a ticket on CNT[NB]) advances
    every row's sequence number: every block has read it by then."""
    tl.debug_barrier()
    ticket = tl.atomic_add(CNT + NB, 1, sem=TICKET_SEM, scope="gpu")
    if ticket == NB - 1:
        for rr in range(0, ROWS):
            tl.store(STATE + rr, seq + 1)
        tl.atomic_xchg(CNT + NB, 0, sem="relaxed", scope="gpu")   # re-armed for the next call
    if ON_GPU:
        _fence(REL, FENCE_ONE)


# (RANK not specialized: one binary for every rank, as the exchange's own kernel: runtime/kernels/peer.py)
@triton.jit(do_not_specialize=["M", "RANK"], launch_metadata=launch_signature)
def _linear_kernel(X, W, Y, PART, CNT, M, stride_x, stride_w, stride_y,
                   N: tl.constexpr, K_SLICE: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr, PF_CHUNK: tl.constexpr,
                   DROP_BUG: tl.constexpr = False, NO_WAIT: tl.constexpr = False, WEIGHTS_A: tl.constexpr = False,
                   FINALIZE: tl.constexpr = True, RES=None, SSQ=None, stride_r=0,
                   RESID: tl.constexpr = False, RESID_BUG: tl.constexpr = False,
                   WR=None, WG=None, PL=None, stride_wr=0, E=0, E_POW2: tl.constexpr = 16,
                   PL_ROWS: tl.constexpr = 16, FOLD: tl.constexpr = False, FOLD_BUG: tl.constexpr = False,
                   PTRS=None, STATE=None, RANK=0, timeout_ns=0, PEER: tl.constexpr = False, ROWS: tl.constexpr = 8,
                   K: tl.constexpr = 4, R: tl.constexpr = 1, ON_GPU: tl.constexpr = False,
                   MAX_POLLS: tl.constexpr = 1, LAG: tl.constexpr = 2, ACQ: tl.constexpr = 0, REL: tl.constexpr = 0,
                   FENCE_ONE: tl.constexpr = False, NO_REARM: tl.constexpr = False, NT: tl.constexpr = 128,
                   TICKET_SEM: tl.constexpr = "acq_rel"):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = ps * K_SLICE
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    if PREFETCH:   # the weight tile into L2 (128-byte lines) while the predecessor still runs
        LINES: tl.constexpr = max(1, K_SLICE * 2 // 128)
        for c in range(0, BLOCK_N * LINES, PF_CHUNK):
            idx = tl.minimum(c + tl.arange(0, PF_CHUNK), BLOCK_N * LINES - 1)
            prefetch_l2(W + (pn * BLOCK_N + idx // LINES).to(tl.int64) * stride_w + k0 + (idx % LINES) * 64)
    wr = None
    wg = None
    if FOLD and SPLIT_K == 1:   # the block's router rows and norm weight before the wait
        wr, wg = _fold_tiles(WR, WG, offs_n, stride_wr, E, E_POW2)
    if PDL:
        gdc_launch_dependents()
        if not NO_WAIT:   # (NO_WAIT: negative control of the tests)
            gdc_wait()   # the predecessor's x is complete and visible from here
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    seq = 0
    if PEER:   # the exchange's sequence number (every row's the same between points; final after the wait)
        seq = tl.load(STATE, volatile=True)
    if RESID:
        res_ptrs = RES + offs_m[:, None] * stride_r + offs_n[None, :]
        if SPLIT_K == 1:   # the residual block, in flight during the loop (its writer precedes the wait)
            res = tl.load(res_ptrs, mask=m_ok[:, None], other=0.0)
    if WEIGHTS_A:   # the weight tile as the MMA's A operand: [BLOCK_N, K] x [K, rows]
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    start = BLOCK_K if DROP_BUG else 0   # negative control: the first K step of every slice skipped
    for kk in range(start, K_SLICE, BLOCK_K):
        x = tl.load(X + offs_m[:, None] * stride_x + (k0 + kk + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(w_rows + (k0 + kk + offs_k)[None, :])
        if WEIGHTS_A:
            acc_t += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w))
    if WEIGHTS_A:
        acc = tl.trans(acc_t)
    y_ptrs = Y + offs_m[:, None] * stride_y + offs_n[None, :]
    if SPLIT_K == 1:
        if RESID:
            if PEER:   # the rank's partial block all-reduced first
                acc = _exchange_tile(acc, offs_n, M, PTRS, STATE, RANK, timeout_ns, seq, N, BLOCK_M, BLOCK_N, ROWS, K,
                                     R, ON_GPU, MAX_POLLS, LAG, ACQ, FENCE_ONE, NO_REARM, NT)
            _residual_epilogue(acc, res, res_ptrs, SSQ, offs_m, m_ok, pn, N // BLOCK_N, Y.dtype.element_ty,
                               RESID_BUG, FOLD, wr, wg, PL, E, E_POW2, PL_ROWS, FOLD_BUG)
            if PEER:
                _exchange_done(CNT, STATE, seq, N // BLOCK_N, ROWS, ON_GPU, REL, FENCE_ONE, TICKET_SEM)
        else:
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None])
    else:
        part = PART + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + ps * (BLOCK_M * N), acc)
    if SPLIT_K > 1 and FINALIZE:   # (not FINALIZE: the consumer sums the partials, see ``partials``)
        # every thread's stores precede (bar.sync) the one release-add that publishes them
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + pn, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:   # the last slice of this column block: all partials visible
            tot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):   # slice order: deterministic
                tot += tl.load(part + s * (BLOCK_M * N), cache_modifier=".cg")
            if RESID:
                if FOLD:   # (only the last arriver needs them)
                    wr, wg = _fold_tiles(WR, WG, offs_n, stride_wr, E, E_POW2)
                if PEER:   # the column block's sum all-reduced first
                    tot = _exchange_tile(tot, offs_n, M, PTRS, STATE, RANK, timeout_ns, seq, N, BLOCK_M, BLOCK_N, ROWS,
                                         K, R, ON_GPU, MAX_POLLS, LAG, ACQ, FENCE_ONE, NO_REARM, NT)
                _residual_epilogue(tot, tl.load(res_ptrs, mask=m_ok[:, None], other=0.0), res_ptrs, SSQ, offs_m,
                                   m_ok, pn, N // BLOCK_N, Y.dtype.element_ty, RESID_BUG, FOLD, wr, wg, PL, E,
                                   E_POW2, PL_ROWS, FOLD_BUG)
            else:
                tl.store(y_ptrs, tot.to(Y.dtype.element_ty), mask=m_ok[:, None])
            tl.atomic_xchg(CNT + pn, 0, sem="relaxed", scope="gpu")   # re-armed for the next call
            if PEER:
                _exchange_done(CNT, STATE, seq, N // BLOCK_N, ROWS, ON_GPU, REL, FENCE_ONE, TICKET_SEM)


def _block_k(k_slice: int) -> int:
    return next(b for b in (BLOCK_K, 64, 32, 16, 0) if b == 0 or k_slice % b == 0)


def unsupported(N: int, K: int) -> str | None:
    """None when an [N, K] weight can be tiled; otherwise why not."""
    if N % 16 or K % 16:
        return f"an [{N}, {K}] weight: skinny_linear needs N and K multiples of 16"
    return None


def plan(N: int, K: int, sms: int, partials: bool = False) -> tuple[int, int]:
    """(block_n, split_k) for an [N, K] weight on ``sms`` multiprocessors: the fewest bytes one
    multiprocessor reads after the wait (all from L2 once the weights are prefetched: its programs'
    weight tiles and x slices, ~8 rows; with split K the last arriver's partials plus one round trip,
    counted as 16 KiB), programs spread evenly over the SMs; ties to fewer programs, then to wider
    column blocks.

    ``partials`` (the consumer sums the split-K partials, ``skinny_linear(partials=True)``): a split
    costs only the consumer's round trip (the 16 KiB), not the last arriver's partials, and at most
    PARTIALS_MAX_SPLIT slices (see there): at the q1 Q/K/V projection 64 columns x 8 slices instead of
    32 x 4; q1-mini's projections stay unsplit."""
    best = None
    for bn in (16, 32, 64, 128):
        if N % bn:
            continue
        for sk in (1, 2, 3, 4, 6, 8, 12, 16):
            if K % sk or not _block_k(K // sk) or (partials and sk > PARTIALS_MAX_SPLIT):
                continue
            progs = N // bn * sk
            ks = K // sk
            per_sm = (-(-progs // sms) * (bn + 8) * ks * 2            # weight tile + ~8 rows of x
                      + (16384 + (0 if partials else sk * BLOCK_M * bn * 4) if sk > 1 else 0))   # the sum
            key = (per_sm, progs, -bn)
            if best is None or key < best[0]:
                best = (key, bn, sk)
    check(best is not None, unsupported(N, K) or f"no tiling of an [{N}, {K}] weight")
    return best[1], best[2]


def skinny_linear(x, w, out=None, *, block_n=None, split_k=None, counter=None, pdl=None, prefetch=None,
                  num_stages=None, block_k=None, num_warps=None, weights_a=None, partials=False, residual=None,
                  fold=None, peer=None, _drop_bug=False, _poison=False, _no_wait=False, _resid_bug=False,
                  _fold_bug=False):
    """y = x @ w^T in BF16 (FP32 accumulation) for x [M, K] BF16 (M <= 16) and w [N, K] BF16.

    ``out`` [M, N] BF16 to write into (row stride free). ``block_n`` / ``split_k``: the tiling
    (default ``plan``). ``counter``: int32 device tensor of at least N / block_n zeros, left zero by
    every call (pass a persistent one for CUDA-graph capture; by default one is zeroed per call).
    ``pdl``: programmatic dependent launch (default PDL; sm_90+ CUDA only, ignored elsewhere);
    ``prefetch``: with PDL, the L2 prefetch of the weight tile before the wait (default PREFETCH).
    ``num_stages`` / ``block_k`` / ``num_warps``: the pipeline's depth, K per step and warps per
    program (defaults NUM_STAGES; the largest of BLOCK_K, 64, 32, 16 that divides the slice, except
    PARTIALS_BLOCK_K for the planned tiling with ``partials``; NUM_WARPS).
    ``weights_a``: the weight tile as the MMA's A operand times x^T (at most 8 rows; default
    WEIGHTS_A where M <= 8).
    ``partials``: with split K, skip the last arriver's sum and return the FP32 partials [split_k, R,
    N] (R >= M rows, the first M live) for the consumer to add in slice order (``sum_partials``: the
    same FP32 additions and BF16 rounding as the last arriver, so the same bits), which takes the
    arrival counter's round trip and the sum's loads and store off the critical path; with split_k 1
    it returns y as usual.
    ``residual`` = (res [M, N] BF16, ssq [M, N / block_n] FP32): instead of writing y, the kernel does
    the add of ``fused_add_rmsnorm`` (res += y, y rounded to BF16 first, the sum rounded to res's
    dtype: the same values) in its epilogue and writes each row's sum of squares of the stored res
    over each column block into ssq (FP32, block order = column order), from which a consumer
    normalises any slice (``router.route_topk(norm=)``: the pre-MoE add + RMSNorm without a launch of
    its own). Returns res. ``ssq_blocks(N, K, device)`` gives ssq's width for the default tiling.
    ``fold`` = (router [E, N] BF16, norm weight [N], pl FP32 [N / block_n, FOLD_ROWS, E_pow2]), with
    ``residual`` only: the epilogue also writes the router-logit partials of the routing folded into
    the projection (``router.route_folded``): pl[b, m, e] = sum over column block b of res[m, c] *
    weight[c] * router[e, c] (FP32, the products' r x weight in TF32), i.e. the router's product with
    RMSNorm(res) * weight before the per-row scale. ``fold_shape(N, K, E, device)`` gives pl's shape
    for the default tiling. ``_fold_bug``: its negative control (the norm weight left out).
    ``peer`` = (a ``peer.PeerExchange``, keywords of ``peer.exchange_launch``), with ``residual`` only: x @ w^T
    is this rank's partial sum (tensor parallelism), all-reduced over the exchange inside the epilogue
    before the add (the fused all-reduce, one point of the exchange's sequence: each column block's
    rank partials in BF16, summed in rank order in FP32 and rounded, as ``peer.peer_add_rmsnorm`` sums
    them). ``counter`` then needs N / block_n + 1 entries (the last holds the blocks' arrivals). Besides
    the exchange's keywords: ``ticket``, the arrival ticket's semantics (default PEER_TICKET).
    ``_drop_bug`` (negative control: the first K step of every slice skipped), ``_poison`` (the
    partials start as NaN) and ``_no_wait`` (negative control: launched early, never waits for x)
    are the tests', as is ``_resid_bug`` (the sums of squares taken over y instead of res + y)."""
    M, K, N = check_rows_by_weight(x, w, MAX_ROWS)
    dev = x.device
    planned = block_n is None and split_k is None
    if block_n is None or split_k is None:
        bn, sk = plan(N, K, device_sm_count(dev), partials=bool(partials) and residual is None)
        block_n = bn if block_n is None else int(block_n)
        split_k = sk if split_k is None else int(split_k)
    check(block_n in (16, 32, 64, 128) and N % block_n == 0, f"block_n {block_n}: 16-128, dividing N = {N}")
    check(split_k >= 1 and K % split_k == 0 and _block_k(K // split_k) > 0,
          f"split_k {split_k}: K = {K} in slices of a multiple of 16")
    if out is None:   # (with residual= nothing is written to out: res stands in for it)
        out = residual[0] if residual is not None else torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    check(out.shape == (M, N) and out.dtype == torch.bfloat16 and out.stride(1) == 1 and out.device == dev,
          "out [M, N] BF16 with contiguous rows")
    n_blocks = N // block_n
    if residual is not None:
        res, ssq = residual
        check(not partials, "residual= and partials=: one epilogue")
        check(res.shape == (M, N) and res.dtype == torch.bfloat16 and res.stride(1) == 1 and res.device == dev,
              "residual: res [M, N] BF16 with contiguous rows on x's device")
        check(ssq.shape == (M, n_blocks) and ssq.dtype == torch.float32 and ssq.is_contiguous()
              and ssq.device == dev, f"residual: ssq [M, {n_blocks}] FP32, contiguous, on x's device")
    fold_kw = {}
    if fold is not None:
        check(residual is not None, "fold= needs residual=: the partials are of the stored residual")
        wr, wg, pl = fold
        check(wr.dim() == 2 and wr.shape[1] == N and wr.dtype == torch.bfloat16 and wr.stride(1) == 1
              and wr.device == dev and 1 <= wr.shape[0] <= 1024, f"fold: router [E, {N}] BF16 (E <= 1024), rows contiguous")
        check(wg.shape == (N,) and wg.stride(0) == 1 and wg.device == dev, f"fold: norm weight [{N}]")
        e_pow2 = max(16, next_pow2(wr.shape[0]))
        check(tuple(pl.shape) == (n_blocks, FOLD_ROWS, e_pow2) and pl.dtype == torch.float32 and pl.is_contiguous()
              and pl.device == dev, f"fold: pl FP32 [{n_blocks}, {FOLD_ROWS}, {e_pow2}], contiguous")
        fold_kw = dict(WR=wr, WG=wg, PL=pl, stride_wr=wr.stride(0), E=wr.shape[0], E_POW2=e_pow2,
                       PL_ROWS=FOLD_ROWS, FOLD=True, FOLD_BUG=bool(_fold_bug))
    fin = not (partials and split_k > 1)
    wa = (WEIGHTS_A and M <= 8) if weights_a is None else bool(weights_a)
    check(M <= 8 or not wa, "weights_a: at most 8 rows")
    warps = NUM_WARPS if num_warps is None else int(num_warps)
    peer_kw = {}
    if peer is not None:
        xchg, popts = peer
        popts = dict(popts)
        ticket = popts.pop("ticket", PEER_TICKET)
        check(ticket in ("acq_rel", "relaxed"), "peer keyword ticket: 'acq_rel' or 'relaxed'")
        check(residual is not None, "peer= needs residual=: the all-reduced sum is added to the residual")
        check(N == xchg.width and M <= xchg.rows and xchg.own.device == dev,
              f"peer: y [M <= {xchg.rows}, {xchg.width}] (the exchange's shape), one device")
        # (the tile goes through the exchange flat: at least one element per thread, none in two)
        check((8 if wa else BLOCK_M) * block_n >= 32 * warps, f"peer: block_n {block_n} too narrow for {warps} warps")
        xargs, xconst = _peer_launch(xchg, dev, **popts)
        peer_kw = dict(zip(("PTRS", "STATE", "RANK", "timeout_ns"), xargs), PEER=True, NT=32 * warps,
                       TICKET_SEM=ticket, **xconst)
    need = n_blocks + (1 if peer is not None else 0)
    if (split_k > 1 and fin) or peer is not None:
        if counter is None:
            counter = torch.zeros(need, dtype=torch.int32, device=dev)
        check(counter.dtype == torch.int32 and counter.device == dev and counter.numel() >= need,
              f"counter: int32, at least {need} on x's device")
    if split_k > 1:
        part = (torch.full((split_k, BLOCK_M, N), float("nan"), dtype=torch.float32, device=dev) if _poison
                else torch.empty((split_k, BLOCK_M, N), dtype=torch.float32, device=dev))
        if not fin:
            counter = part   # (unused: no arrival counter without the last arriver's sum)
    else:
        part = out
        if peer is None:
            counter = out
    use_pdl = pdl_supported(dev) and (PDL if pdl is None else bool(pdl))
    use_pf = use_pdl and compiled_cuda(dev) and (PREFETCH if prefetch is None else bool(prefetch))
    k_slice = K // split_k
    bk = _block_k(k_slice) if block_k is None else int(block_k)
    if block_k is None and planned and not fin and k_slice % PARTIALS_BLOCK_K == 0:
        bk = PARTIALS_BLOCK_K   # (the planned tiling for a consumer that sums the partials)
    check(bk in (16, 32, 64, 128) and k_slice % bk == 0, f"block_k {block_k}: 16-128, dividing the slice {k_slice}")
    _linear_kernel[(n_blocks, split_k)](
        x, w, out, part, counter, M, x.stride(0), w.stride(0), out.stride(0),
        N=N, K_SLICE=k_slice, SPLIT_K=split_k, BLOCK_M=8 if wa else BLOCK_M, BLOCK_N=block_n, BLOCK_K=bk,
        PDL=use_pdl, PREFETCH=use_pf, PF_CHUNK=min(1024, next_pow2(block_n * max(1, k_slice * 2 // 128))),
        DROP_BUG=bool(_drop_bug), NO_WAIT=bool(_no_wait), WEIGHTS_A=wa, num_warps=warps,
        num_stages=NUM_STAGES if num_stages is None else int(num_stages), FINALIZE=fin,
        **(dict(RES=residual[0], SSQ=residual[1], stride_r=residual[0].stride(0), RESID=True,
                RESID_BUG=bool(_resid_bug)) if residual is not None else {}),
        **fold_kw, **peer_kw, **({"launch_pdl": True} if use_pdl else {}),
    )
    if residual is not None:
        return residual[0]
    if not fin:   # the kernel's layout: slice s, row m at s * rows * N + m * N (rows = its BLOCK_M)
        rows = 8 if wa else BLOCK_M
        return part.view(-1)[:split_k * rows * N].view(split_k, rows, N)
    return out


def ssq_blocks(N: int, K: int, device) -> int:
    """Column blocks of an [N, K] weight under the default tiling on ``device``: the width of
    ``skinny_linear(residual=)``'s ssq."""
    return N // plan(N, K, device_sm_count(device))[0]


def fold_shape(N: int, K: int, E: int, device) -> tuple[int, int, int]:
    """The shape of ``skinny_linear(fold=)``'s router-logit partials for an [N, K] weight under the
    default tiling on ``device`` and E experts."""
    return ssq_blocks(N, K, device), FOLD_ROWS, max(16, next_pow2(E))


def sum_partials(parts: torch.Tensor) -> torch.Tensor:
    """BF16 [R, N] of ``skinny_linear(..., partials=True)``'s [S, R, N]: the last arriver's arithmetic
    (FP32 sums in slice order from zero, one rounding), in torch (the tests' oracle; rope_kv_write's
    ``qkv_parts`` does the same in its kernel)."""
    tot = torch.zeros_like(parts[0])
    for s in range(parts.shape[0]):
        tot = tot + parts[s]
    return tot.to(torch.bfloat16)


def linear_reference(x, w):
    """FP64 x @ w^T (the tests' oracle)."""
    return x.double() @ w.double().T
