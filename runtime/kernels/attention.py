"""Split-KV decode attention for the speculative round (w <= 8 query rows), with learned sinks.

Algorithm (one kernel pair, two cache layouts)
----------------------------------------------
Inputs: q [w, nh, d] (RoPE applied), a KV cache per KV head, the device-side ``start_pos``; query row
i has position p_i = start_pos + i. GQA: query head h reads KV head h // G, G = nh // nkv.

Split kernel ``_attn_split_kernel``, grid (num_splits, nkv), fixed on the host (independent of any
device value, so the launch can be captured in a CUDA graph):

* Program (s, kvh) owns the G query heads of KV head ``kvh`` for all w rows, packed as
  ``w * G`` matrix rows (row m = i * G + g; 8 rows x 6 heads = 48 rows, padded to BLOCK_M = 64)
  against that one KV head, and one contiguous range of key blocks.
* It reads ``start_pos`` from the device and derives the key range to visit:
  full cache: logical positions [0, start_pos + w); sliding ring: [max(0, start_pos - window + 1),
  start_pos + w) stored at slot ``pos % R``. Only this valid extent is read: preallocated capacity
  (or ring slots outside the window) costs nothing.
  The range is cut into BLOCK_N-key blocks; split s takes blocks
  [s * per_split, min((s + 1) * per_split, n_blocks)), per_split = ceil(n_blocks / num_splits), so the
  whole grid shares the work at every context length and splits past the end do nothing.
* Loop over its key blocks: S = Q K^T (tensor cores, FP32 accumulation) in the log2 domain,
  mask (key j visible to row i iff j <= p_i, and for the ring also j > p_i - window), online softmax
  with FP32 running max ``m``, FP32 running denominator ``l`` and FP32 accumulator
  ``acc += P V`` (P rounded to BF16 for the tensor-core product).
* v2 (the default) runs the blocks wholly below start_pos in a software-pipelined loop without
  masks, and a split of at most KV_FIRST blocks (every split of a 4K ring or an 8K cache) requests
  its first block's K and V before Q, so its loads cost one memory round trip, not Q's then K/V's;
  with PDL, before its wait for the kernel that writes the new rows if the block lies below them.
* It writes its un-normalised partial (acc, m, l) for the valid packed rows; empty splits write
  nothing. The running max starts at a finite -1e30, so a row that sees no key in a split keeps
  l = 0 and acc = 0 without NaNs.

Combine kernel ``_attn_combine_kernel``, grid (w * nh, d / COMBINE_BLOCK_D): program (row, head,
d-slice) recomputes the number of active splits from ``start_pos``, takes M = max(sink, max_s m_s),
and sums  num = sum_s 2^(m_s - M) acc_s,  den = sum_s 2^(m_s - M) l_s + 2^(sink - M)  in FP32:
by default every split's m, l and acc slice is requested at once (one L2 round trip, a tree sum);
with fewer than all splits per load (COMBINE_BLOCK_S) in chunks, a tree inside each chunk and a fixed
sequential order across chunks: deterministic, no atomics. out = num / den in BF16. The sink is a per-head logit with zero value:
it only enters the denominator.

Fused variant ``_attn_fused_kernel`` (``variant="fused"``): one launch instead of two. The grid is
(num_splits + w * G * d / FUSED_BLOCK_D, nkv): the first num_splits programs are the splits above
(the Q load is issued before the start_pos-dependent work); each active split publishes its partial
with bar.sync + a release add on an arrival counter. The remaining programs are the combine: they
are resident while the splits run (prologue, sink load already done), wait with acquire loads until
the counter reaches the active split count, merge in a fixed order (online over chunks of splits,
FP32, sink in the denominator: deterministic) and write out. The last combine program to finish
(ticket on a second counter) re-zeroes both counters, so the int32 counter buffer (cached per
device, or ``workspace=``) is zero for the next call / graph replay. A single "last arriver merges
everything" program was rejected: at 132 splits it would pull 132 x 48 x 128 x 4 B = 3.2 MB of
partials through one SM (~25 us at ~130 GB/s per SM); the combine must stay spread over many
programs. Assumptions: calls sharing a counter buffer do not overlap (stream order); the combine
programs never prevent the splits from being scheduled (they come later in the grid and, in the
worst case, occupy fewer slots than the GPU has).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer, smid

from ._common import (cached_counters, check, compiled_cuda, device_sm_count, launch_signature, next_pow2,
                      pdl_supported, prefetch_l2)

# Keys per inner-loop iteration. K and V tiles of 64 x 128 BF16 are 16 KiB each, so one pipeline
# stage is 32 KiB; with NUM_STAGES = 3 and the Q tile the program fits in shared memory while the
# loads of two future blocks are in flight (what a memory-bound stream needs per SM).
BLOCK_N = 64
NUM_STAGES = 4   # 3 until session 10: with the one-load combine, 4 stages measured 64K 17.3 -> 16.8 us, 192K 36.2 -> 34.8 us
# The fused variant keeps 3: its combine programs wait on split programs, and at 4 stages (~144 KiB of
# shared memory) only one program fits per SM.
FUSED_NUM_STAGES = 3
# One warpgroup: the 64-row packed Q tile is exactly one Hopper wgmma M=64 tile.
NUM_WARPS = 4
# Smallest packed-row tile (keyword min_block_m): w * G rows padded to a power of two, at least this.
# 64 (one wgmma M tile) since session 11: at w = 4 (24 rows) a 32-row tile measured 192K 36.3 -> 33.2
# us, 64K 17.6 -> 16.0 us with v2 + PDL on the H200.
MIN_BLOCK_M = 64
# Splits per multiprocessor for the default num_splits: one long-running program per SM.
SPLITS_PER_SM = 1
# Combine: 32 head-dim columns per program (48 rows x 4 slices = 192 programs at d = 128) and up to
# 256 splits per load (256 x 32 FP32 = 32 KiB, 64 registers per thread). Keywords combine_block_d /
# combine_block_s (v1) override them; a combine_block_s >= the split count loads all partials at once.
COMBINE_BLOCK_D = 32
COMBINE_BLOCK_S = 256   # all of 132 splits in one load (was 32: 5 dependent loads; 64K 18.4 -> 17.3 us)
# Kernel variant: "v1" = split kernel + combine kernel (two launches); "fused" = one launch whose
# extra combine programs wait on a self-resetting arrival counter (``_attn_fused_kernel``).
VARIANT = "v2"   # since session 11 (v1 before): 192K 35.2 -> 33.7 us at w = 6/8 with PDL
VARIANTS = ("v1", "fused", "v2")
# v2 = v1's two launches with ``_attn_split_v2_kernel`` (mask work only at the range's end). PDL: the
# combine kernel is a programmatic dependent of the split kernel, and v2's split one of the kernel
# before the call (sm_90+, CUDA only; keyword ``pdl``), so launches and prologues overlap.
PDL = True
# v2 with PDL: key blocks per split asked of L2 before the split's wait (keyword ``prefetch``). 0: the
# H200 measured no gain from 2 and losses from 4 and 8 (64K w = 6: 16.4 / 16.0 / 17.2 / 19.9 us).
PREFETCH_BLOCKS = 0
# Combine: request every split's m, l and acc slice at once after the wait (one L2 round trip;
# keyword combine_one_load). Session 12, paired A/B (40 rounds, w = 6): the previous combine (m and
# l first, then acc) took 1.021 / 1.014 / 1.012 of this one's time at 4K / 64K / 192K.
COMBINE_ONE_LOAD = True
# Warps per combine program (keyword combine_num_warps). 2 since session 12 (paired A/B, 40 rounds:
# 4K 0.961 / 0.971 of 4 warps' time at w = 6 / 8; 64K and 192K within noise).
COMBINE_NUM_WARPS = 2
# v2 full layers: the split owning the boundary (masked) key blocks asks L2 for them at its start, so
# that the masked loop (not pipelined) does not pay a DRAM round trip per load (keyword tail_prefetch).
TAIL_PREFETCH = True   # session 12 (paired A/B): 4K 0.938 / 0.961, 64K 0.980 / 0.993 at w = 6 / 8
# v2: K/V tiles of the unmasked loop through TMA descriptors (keyword tma; caches whose first two
# dimensions flatten to [nkv * slots, d] rows). Off: session 12's paired A/B measured 64K / 192K
# within noise of the pointer loads (4K 0.96-0.97), so the simpler path stays.
TMA = False
# v2: a split of at most KV_FIRST key blocks loads its first block's K and V before Q and takes the
# masked path (keyword kv_first; 0: off). The pipelined loop issues its first loads only after Q's
# load and shared-memory store: two round trips where one suffices. Session 16 (H200, q1 step A/B,
# alternating graphs): 1 and 2 both 0.995 of the step's time at 8K (every split of a 4K ring or an
# 8K cache has one block), within noise at 64K; 8 made the 64K call 1.5x slower (eight unpipelined
# blocks).
KV_FIRST = 1
# v2 with PDL: a short split (KV_FIRST) whose first block lies wholly below start_pos reads that block's
# K and V before griddepcontrol.wait (keyword kv_before_wait), so its DRAM round trip overlaps the
# kernel before (rope_kv_write, which releases this one at its start). Safe: rows below start_pos were
# written by earlier passes, and every kernel of the runtime waits for its predecessor before it
# completes (or is launched plainly), so they are complete once the kernel before this one has begun;
# the rows at start_pos and after, which that kernel writes, are read after the wait.
KV_BEFORE_WAIT = True
# The partials' m and l stored by row (keyword ml_by_row, v2): ML [nkv, 2, BLOCK_M, splits] instead of
# [nkv, splits, 2, BLOCK_M], so that a combine program reads its row's m (and l) of all splits in
# ceil(splits / 8) 32-byte sectors instead of one sector per split (132 splits: 34 instead of 264 of
# its ~792). The split then stores them 4 bytes at a time. Same values. Session 29 (H200, call 3): the
# old layout took 1.042 / 1.032 of this one's time at 4K (w = 6 / 8), 16K 1.051 / 1.032, 64K 1.032 /
# 1.028, 192K 1.009 / 1.006 (ab_attention.py, 100 paired rounds; A/A 0.995-1.004), 0.25-0.5 us per
# call; the q1 step 1.0012 (8K) / 1.0030 (64K) (bench_step.py --ab attn_ml_by_split; A/A 0.9992 / 1.0012).
ML_BY_ROW = True
# v2: the partials' acc stored as acc / l in BF16 (keyword partials="bfloat16"; m and l stay FP32) instead of
# un-normalised in FP32: half the bytes the splits write and the combine reads (64K, 132 splits: 1.6 MB
# instead of 3.2 MB). Every sum stays FP32: the split's chain before the store, the combine's over the
# splits (weights 2^(m_s - M) l_s); what changes is one BF16 rounding of each split's output, the
# rounding the call's output has anyway. Rejected (session 38, H200, ab_attention.py, w = 6, 100-150 paired
# rounds; A/A 0.992-1.006): 1.045-1.066 of the FP32 partials' time at 16K, 1.040-1.050 at 64K, 1.012-1.028 at
# 192K. The split with BF16 partials and an empty merge takes what the FP32 one takes (16K 0.878 / 0.869,
# 64K 0.918 / 0.927 of the default), so the loss is the combine's (0.5-0.8 us), and 64 columns per combine
# program do not recover it (1.07-1.10). Kept as an option (keyword; tests) for whoever takes the combine up.
PARTIALS = "float32"
PARTIALS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Fused combine: BLOCK_D head-dim columns per combine program (w * G * d / 32 = 192 programs at
# w = 8, G = 6, d = 128) and up to FUSED_TILE / BLOCK_D splits per load (32: 256 splits, one round
# trip at 132 splits; 8192 FP32 = 64 registers per thread at 4 warps). Every program of the fused
# kernel reserves the split's shared memory (112 KiB at w = 8), so 2 fit per SM: at w = 8 and
# BLOCK_D = 32, 132 splits + 192 combine programs exceed the 264 slots and 60 combine programs start
# only when a slot frees; BLOCK_D = 64 (96 programs, all resident, two loads of 128 splits) is the
# other side of that trade (bench variant "fused_cd64").
FUSED_BLOCK_D = 32
FUSED_TILE = 8192

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)
# Timeline records (diagnostic keyword ``_timeline``): per program (smid, t_entry, t_wait, t_end, t_a,
# t_b) in globaltimer nanoseconds; combine only: t_a = m and l arrived and reduced (den), t_b = the
# weighted sum of the partials done (split: 0; stamps inside its loop cost more than they show). See
# ``experiments/timeline_attention.py``.
TIMELINE_FIELDS = 6
_TL_FIELDS = tl.constexpr(TIMELINE_FIELDS)


@triton.jit
def _stamp(TL, prog, field: tl.constexpr, TIMELINE: tl.constexpr):
    """Diagnostics only (compiled out unless TIMELINE): the global timer (and at field 1 the SM) of
    program ``prog`` into its timeline record."""
    if TIMELINE:
        rec = TL + prog.to(tl.int64) * _TL_FIELDS
        if field == 1:
            tl.store(rec, smid().to(tl.int64))
        tl.store(rec + field, globaltimer())


@triton.jit
def _stamp_after(TL, prog, field: tl.constexpr, x, TIMELINE: tl.constexpr):
    """``_stamp`` once the FP32 scalar ``x`` has been computed (the timer read takes it as an input)."""
    if TIMELINE:
        t = tl.inline_asm_elementwise(
            "{ .reg .b32 z; and.b32 z, $1, 0; mov.u64 $0, %globaltimer; }", "=l,r",
            [x.to(tl.int32, bitcast=True)], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(TL + prog.to(tl.int64) * _TL_FIELDS + field, t)


@triton.jit
def _key_range(start, W, WINDOW, IS_RING: tl.constexpr, BLOCK_N: tl.constexpr,
               NUM_SPLITS):
    """Logical key range [lo, seq_end), its block count and the blocks per split."""
    seq_end = start + W
    if IS_RING:
        lo = tl.maximum(start - WINDOW + 1, 0)
    else:
        lo = start * 0
    n_blocks = tl.cdiv(seq_end - lo, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    return lo, seq_end, n_blocks, per_split


@triton.jit
def _load_q(Q, kvh, W, stride_qw, stride_qh, G: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The packed Q tile of KV head ``kvh``: row m = (live row m // G, head kvh * G + m % G);
    rows past W * G are zero. Returns (q, live row of each packed row, row valid)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_i = offs_m // G
    head = kvh * G + offs_m % G
    row_ok = offs_m < W * G
    q = tl.load(Q + row_i[:, None] * stride_qw + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    return q, row_i, row_ok


@triton.jit
def _masked_kv(k_base, v_base, stride_kn, stride_vn, lo, seq_end, b, R, IS_RING: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, load_ok=True, k_other=0.0, v_other=0.0):
    """Key block ``b`` of the logical range starting at ``lo``: its K and V tiles (keys past the
    range's end read as zeros; ring slots pos % R), positions and validity. Both loads are issued
    before either is used, so the block costs one memory round trip, not two. ``load_ok`` false:
    nothing is read and the tiles are ``k_other`` / ``v_other`` (zeros past the range's end)."""
    offs_d = tl.arange(0, HEAD_DIM)
    pos = lo + b * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = pos < seq_end
    if IS_RING:
        slot = pos % R
    else:
        slot = pos
    k = tl.load(k_base + slot[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=key_ok[:, None] & load_ok, other=k_other)
    v = tl.load(v_base + slot[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
                mask=key_ok[:, None] & load_ok, other=v_other)
    return k, v, pos, key_ok


@triton.jit
def _masked_update(q, q_pos, k, v, pos, key_ok, qk_scale_log2, m_i, l_i, acc, WINDOW, IS_RING: tl.constexpr):
    """The online softmax state (m, l, acc) after one key block with every mask (range end, causal
    boundary, window)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale_log2
    vis = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    if IS_RING:
        vis = vis & (pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _masked_block(q, q_pos, k_base, v_base, stride_kn, stride_vn, qk_scale_log2, lo, seq_end, b, m_i, l_i,
                  acc, WINDOW, R, IS_RING: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One key block with every mask (range end, causal boundary, window, ring slots): the online
    softmax state (m, l, acc) after key block ``b`` of the logical range starting at ``lo`` (K and V
    requested together: until session 16 V's load followed QK^T, a second round trip)."""
    k, v, pos, key_ok = _masked_kv(k_base, v_base, stride_kn, stride_vn, lo, seq_end, b, R, IS_RING,
                                   BLOCK_N, HEAD_DIM)
    return _masked_update(q, q_pos, k, v, pos, key_ok, qk_scale_log2, m_i, l_i, acc, WINDOW, IS_RING)


@triton.jit
def _store_partial(ACC, ML, kvh, split, stride_ah, stride_as, stride_am, stride_mh, stride_ms, row_ok,
                   m_i, l_i, acc, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ML_BY_ROW: tl.constexpr = False,
                   NUM_SPLITS=1, SKIP: tl.constexpr = False):
    """A split's un-normalised partial (acc, m, l) for the valid packed rows. m and l go to ML
    [nkv, splits, 2, BLOCK_M] (stride_mh, stride_ms), or with ``ML_BY_ROW`` to ML [nkv, 2, BLOCK_M,
    NUM_SPLITS] (stride_mh): one row's m (and l) of every split side by side, as the combine reads them.
    ``SKIP`` (measurement only, the result is wrong): nothing stored, through a row mask that is false
    at run time (l >= 0) but not provably so, so that the compiler keeps the work the stores consume.
    A 16-bit ACC (keyword partials) receives acc / l (0 where the split saw no key: l = 0, acc = 0)."""
    if SKIP:
        row_ok = row_ok & (l_i < 0.0)
    if ACC.dtype.element_ty != tl.float32:   # one reciprocal per row, not a full division per element
        acc = acc * (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]   # (a division per element: 368 more instructions)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    acc_ptr = ACC + kvh * stride_ah + split * stride_as
    tl.store(acc_ptr + offs_m[:, None] * stride_am + offs_d[None, :], acc, mask=row_ok[:, None])
    if ML_BY_ROW:
        ml_ptr = ML + kvh * stride_mh + split
        tl.store(ml_ptr + offs_m * NUM_SPLITS, m_i, mask=row_ok)
        tl.store(ml_ptr + (BLOCK_M + offs_m) * NUM_SPLITS, l_i, mask=row_ok)
    else:
        ml_ptr = ML + kvh * stride_mh + split * stride_ms
        tl.store(ml_ptr + offs_m, m_i, mask=row_ok)
        tl.store(ml_ptr + BLOCK_M + offs_m, l_i, mask=row_ok)


@triton.jit
def _split_start(K, V, kvh, stride_kh, stride_vh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A split's K/V bases for KV head ``kvh`` and its empty online-softmax state (m, l, acc)."""
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    return k_base, v_base, m_i, l_i, acc


@triton.jit
def _split_partial(q, q_pos, row_ok, K, V, ACC, ML, kvh, split, stride_kh, stride_kn, stride_vh, stride_vn,
                   stride_ah, stride_as, stride_am, stride_mh, stride_ms, qk_scale_log2, lo, seq_end,
                   b_begin, b_end, WINDOW, R, IS_RING: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One split: online softmax of the packed Q tile over key blocks [b_begin, b_end) of the
    logical range starting at ``lo``; stores the un-normalised partial (acc, m, l) of ``split``."""
    k_base, v_base, m_i, l_i, acc = _split_start(K, V, kvh, stride_kh, stride_vh, BLOCK_M, HEAD_DIM)
    for b in range(b_begin, b_end):
        m_i, l_i, acc = _masked_block(q, q_pos, k_base, v_base, stride_kn, stride_vn, qk_scale_log2, lo,
                                      seq_end, b, m_i, l_i, acc, WINDOW, R, IS_RING, BLOCK_N, HEAD_DIM)
    _store_partial(ACC, ML, kvh, split, stride_ah, stride_as, stride_am, stride_mh, stride_ms, row_ok,
                   m_i, l_i, acc, BLOCK_M, HEAD_DIM)


@triton.jit(do_not_specialize=["W", "WINDOW", "R", "NUM_SPLITS"], launch_metadata=launch_signature)
def _attn_split_kernel(
    Q, K, V, ACC, ML, START,
    stride_qw, stride_qh,
    stride_kh, stride_kn,
    stride_vh, stride_vn,
    stride_ah, stride_as, stride_am,
    stride_mh, stride_ms,
    qk_scale_log2, W, WINDOW, R, NUM_SPLITS,
    G: tl.constexpr, IS_RING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    start = tl.load(START).to(tl.int32)
    lo, seq_end, n_blocks, per_split = _key_range(start, W, WINDOW, IS_RING, BLOCK_N, NUM_SPLITS)
    b_begin = split * per_split
    b_end = tl.minimum(b_begin + per_split, n_blocks)
    if b_begin < b_end:
        q, row_i, row_ok = _load_q(Q, kvh, W, stride_qw, stride_qh, G, BLOCK_M, HEAD_DIM)
        _split_partial(q, start + row_i, row_ok, K, V, ACC, ML, kvh, split, stride_kh, stride_kn,
                       stride_vh, stride_vn, stride_ah, stride_as, stride_am, stride_mh, stride_ms,
                       qk_scale_log2, lo, seq_end, b_begin, b_end, WINDOW, R,
                       IS_RING, BLOCK_M, BLOCK_N, HEAD_DIM)


@triton.jit
def _split_partial_v2(q, q_pos, row_ok, K, V, ACC, ML, kvh, split, stride_kh, stride_kn, stride_vh, stride_vn,
                      stride_ah, stride_as, stride_am, stride_mh, stride_ms, qk_scale_log2, start, lo, seq_end,
                      b_begin, b_end, WINDOW, R, IS_RING: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MID_BUG: tl.constexpr,
                      KD, VD, TMA: tl.constexpr, ML_BY_ROW: tl.constexpr = False, NUM_SPLITS=1,
                      NO_STORE: tl.constexpr = False):
    """``_split_partial`` with the mask work only where a mask can bind. In a full layer every key
    below ``start`` is visible to every row and lies inside the range, so the blocks wholly below
    it (all but the last one or two of the range) run a loop without masks, without the -inf
    select, with one pointer increment per block instead of per-key index arithmetic, and with the
    softmax scale folded into the exponent (exp2(s * scale - m): one FMA); the remaining blocks
    (and every block of a ring, whose window bound and slot wrap can bind anywhere) take
    ``_masked_block``. Same partials as v1 up to the rounding of s * scale. ``MID_BUG`` (negative
    control of the tests) runs every block below the range's end unmasked, the causal boundary too."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base, v_base, m_i, l_i, acc = _split_start(K, V, kvh, stride_kh, stride_vh, BLOCK_M, HEAD_DIM)
    if IS_RING:
        b_mid = b_begin
    else:   # lo = 0: block b is [b * BLOCK_N, (b + 1) * BLOCK_N), unmasked iff it ends at or below start
        if MID_BUG:
            b_mid = tl.maximum(tl.minimum(b_end, seq_end // BLOCK_N), b_begin)
        else:
            b_mid = tl.maximum(tl.minimum(b_end, start // BLOCK_N), b_begin)
    row0 = (b_begin * BLOCK_N + offs_n).to(tl.int64)
    k_ptrs = k_base + row0[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = v_base + row0[:, None] * stride_vn + offs_d[None, :]
    for b in range(b_begin, b_mid):
        if TMA:   # rows of the [nkv * R, d] views
            k = KD.load([kvh * R + b * BLOCK_N, 0])
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
        p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = VD.load([kvh * R + b * BLOCK_N, 0])
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    for b in tl.range(b_mid, b_end, num_stages=1):
        m_i, l_i, acc = _masked_block(q, q_pos, k_base, v_base, stride_kn, stride_vn, qk_scale_log2, lo,
                                      seq_end, b, m_i, l_i, acc, WINDOW, R, IS_RING, BLOCK_N, HEAD_DIM)
    _store_partial(ACC, ML, kvh, split, stride_ah, stride_as, stride_am, stride_mh, stride_ms, row_ok,
                   m_i, l_i, acc, BLOCK_M, HEAD_DIM, ML_BY_ROW, NUM_SPLITS, NO_STORE)


@triton.jit
def _prefetch_kv_rows(K, V, kvh, stride_kh, stride_kn, stride_vh, stride_vn, rows, HEAD_DIM: tl.constexpr):
    """Ask L2 for K and V rows ``rows`` of KV head ``kvh`` (every 128-byte line of a BF16 row)."""
    rows = rows.to(tl.int64)
    for c in tl.static_range(max(1, HEAD_DIM // 64)):
        prefetch_l2(K + kvh.to(tl.int64) * stride_kh + rows * stride_kn + c * 64)
        prefetch_l2(V + kvh.to(tl.int64) * stride_vh + rows * stride_vn + c * 64)


@triton.jit(do_not_specialize=["W", "WINDOW", "R", "NUM_SPLITS"], launch_metadata=launch_signature)
def _attn_split_v2_kernel(
    Q, K, V, ACC, ML, START, TL,
    stride_qw, stride_qh,
    stride_kh, stride_kn,
    stride_vh, stride_vn,
    stride_ah, stride_as, stride_am,
    stride_mh, stride_ms,
    qk_scale_log2, W, WINDOW, R, NUM_SPLITS,
    G: tl.constexpr, IS_RING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    MID_BUG: tl.constexpr = False, PREFETCH: tl.constexpr = 0, TIMELINE: tl.constexpr = False,
    TAIL_PREFETCH: tl.constexpr = False, KD=None, VD=None, TMA: tl.constexpr = False,
    KV_FIRST: tl.constexpr = 0, KV_BEFORE_WAIT: tl.constexpr = False, _EARLY_BUG: tl.constexpr = False,
    ML_BY_ROW: tl.constexpr = False, _NO_STORE: tl.constexpr = False,
):
    """v2 split: the key blocks go through ``_split_partial_v2``. Without ``PDL`` the Q tile's load
    is issued together with start_pos's (it does not depend on it). With ``PDL`` the kernel is a
    programmatic dependent of the previous kernel: before griddepcontrol.wait it reads start_pos and
    asks L2 for its first PREFETCH unmasked key blocks (K and V rows below start_pos, written by
    earlier steps; a prefetch returns no data, so it cannot read a stale value: the loop's loads come
    after the wait), then waits, releases its own dependent (the combine) and loads Q. Assumption
    (documented on ``decode_attention_full``): start_pos is not written by the kernel launched
    immediately before the call. ``TAIL_PREFETCH``: the split owning the boundary (masked) blocks
    asks L2 for them at its start (coherent: rows the previous kernel is still writing are updated
    in L2). ``TMA``: the unmasked loop's K/V tiles come through the descriptors ``KD`` / ``VD``.
    ``KV_FIRST`` (keyword ``kv_first``): a split of at most KV_FIRST key blocks (every split of a
    4K ring or an 8K cache) requests its first block's K and V before Q and runs every block with
    the masks: Q's round trip, which precedes the pipelined loop's first loads, overlaps the K/V one.
    ``ML_BY_ROW``: the partials' m and l in the combine's order (see ``_store_partial``).
    ``TIMELINE``: diagnostic records into ``TL`` (see TIMELINE_FIELDS)."""
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    prog = kvh * NUM_SPLITS + split
    _stamp(TL, prog, 1, TIMELINE)
    start = tl.load(START).to(tl.int32)
    lo, seq_end, n_blocks, per_split = _key_range(start, W, WINDOW, IS_RING, BLOCK_N, NUM_SPLITS)
    b_begin = split * per_split
    b_end = tl.minimum(b_begin + per_split, n_blocks)
    if TAIL_PREFETCH and not IS_RING:   # the boundary blocks (masked loop, not pipelined) into L2
        b_mid = tl.maximum(tl.minimum(b_end, start // BLOCK_N), b_begin)
        for j in tl.static_range(2):
            if b_mid + j < b_end:
                _prefetch_kv_rows(K, V, kvh, stride_kh, stride_kn, stride_vh, stride_vn,
                                  tl.minimum((b_mid + j) * BLOCK_N + tl.arange(0, BLOCK_N), seq_end - 1),
                                  HEAD_DIM)
    short = (b_begin < b_end) & (b_end - b_begin <= KV_FIRST)
    if KV_BEFORE_WAIT:   # a short split's first block, if every key in it lies below start_pos
        # (rows of earlier steps, complete before this kernel's predecessor began), before the wait
        # (_EARLY_BUG, the tests' negative control: also the block holding the new rows)
        early = short & ((lo + (b_begin + 1) * BLOCK_N <= start) | _EARLY_BUG)
        k_base, v_base, m_i, l_i, acc = _split_start(K, V, kvh, stride_kh, stride_vh, BLOCK_M, HEAD_DIM)
        k_e, v_e, pos_e, ok_e = _masked_kv(k_base, v_base, stride_kn, stride_vn, lo, seq_end, b_begin, R,
                                           IS_RING, BLOCK_N, HEAD_DIM, load_ok=early)
    if PDL:
        if not IS_RING:
            last = tl.maximum(tl.minimum(b_end, start // BLOCK_N) * BLOCK_N - 1, 0)
            for j in tl.static_range(PREFETCH):
                _prefetch_kv_rows(K, V, kvh, stride_kh, stride_kn, stride_vh, stride_vn,
                                  tl.minimum((b_begin + j) * BLOCK_N + tl.arange(0, BLOCK_N), last), HEAD_DIM)
        gdc_wait()
        gdc_launch_dependents()
    _stamp(TL, prog, 2, TIMELINE)
    if short:   # short split: K/V, then Q, all masked
        if KV_BEFORE_WAIT:   # (the block read before the wait is kept; any other is read now)
            k, v, pos, key_ok = _masked_kv(k_base, v_base, stride_kn, stride_vn, lo, seq_end, b_begin, R,
                                           IS_RING, BLOCK_N, HEAD_DIM, load_ok=early == 0, k_other=k_e,
                                           v_other=v_e)
        else:
            k_base, v_base, m_i, l_i, acc = _split_start(K, V, kvh, stride_kh, stride_vh, BLOCK_M, HEAD_DIM)
            k, v, pos, key_ok = _masked_kv(k_base, v_base, stride_kn, stride_vn, lo, seq_end, b_begin, R,
                                           IS_RING, BLOCK_N, HEAD_DIM)
        q, row_i, row_ok = _load_q(Q, kvh, W, stride_qw, stride_qh, G, BLOCK_M, HEAD_DIM)
        q_pos = start + row_i
        m_i, l_i, acc = _masked_update(q, q_pos, k, v, pos, key_ok, qk_scale_log2, m_i, l_i, acc, WINDOW, IS_RING)
        for b in tl.range(b_begin + 1, b_end, num_stages=1):
            m_i, l_i, acc = _masked_block(q, q_pos, k_base, v_base, stride_kn, stride_vn, qk_scale_log2,
                                          lo, seq_end, b, m_i, l_i, acc, WINDOW, R, IS_RING, BLOCK_N, HEAD_DIM)
        _store_partial(ACC, ML, kvh, split, stride_ah, stride_as, stride_am, stride_mh, stride_ms, row_ok,
                       m_i, l_i, acc, BLOCK_M, HEAD_DIM, ML_BY_ROW, NUM_SPLITS, _NO_STORE)
    else:
        q, row_i, row_ok = _load_q(Q, kvh, W, stride_qw, stride_qh, G, BLOCK_M, HEAD_DIM)
        if b_begin < b_end:
            _split_partial_v2(q, start + row_i, row_ok, K, V, ACC, ML, kvh, split, stride_kh, stride_kn,
                              stride_vh, stride_vn, stride_ah, stride_as, stride_am, stride_mh, stride_ms,
                              qk_scale_log2, start, lo, seq_end, b_begin, b_end, WINDOW, R,
                              IS_RING, BLOCK_M, BLOCK_N, HEAD_DIM, MID_BUG, KD, VD, TMA, ML_BY_ROW, NUM_SPLITS,
                              _NO_STORE)
    _stamp(TL, prog, 3, TIMELINE)


@triton.jit(do_not_specialize=["W", "WINDOW", "NUM_SPLITS"], launch_metadata=launch_signature)
def _attn_combine_kernel(
    ACC, ML, SINKS, OUT, START, TL,
    stride_ah, stride_as, stride_am,
    stride_mh, stride_ms,
    stride_ow, stride_oh,
    W, WINDOW, NUM_SPLITS,
    NH: tl.constexpr, G: tl.constexpr, IS_RING: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SUB_S: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False, TIMELINE: tl.constexpr = False,
    TL_BASE: tl.constexpr = 0, TRIGGER: tl.constexpr = False, ONE_LOAD: tl.constexpr = False,
    ML_BY_ROW: tl.constexpr = False, PARTIALS_BUG: tl.constexpr = False,
):
    """Program (row, d-slice) merges the splits' partials of one packed row. ``ONE_LOAD`` (needs
    SUB_S == BLOCK_S): every partial's m, l and acc slice is requested at once after the wait, so
    the merge costs one L2 round trip; otherwise m and l first (den), then acc in SUB_S-split chunks
    (m reloaded per chunk). ``ML_BY_ROW``: m and l in ``_store_partial``'s by-row layout (a row's
    values of every split contiguous: 2 x ceil(splits / 8) sectors instead of 2 x splits). A 16-bit
    ACC holds acc / l (``_store_partial``): each split's weight is then 2^(m_s - M) l_s, in FP32;
    ``PARTIALS_BUG`` (negative control of the tests) leaves l_s out, as if it held acc."""
    row = tl.program_id(0)
    dblk = tl.program_id(1)
    prog = TL_BASE + dblk * tl.num_programs(0) + row
    _stamp(TL, prog, 1, TIMELINE)
    if TRIGGER:   # (experiment) the next kernel may launch and run its prologue while this one runs
        gdc_launch_dependents()
    i = row // NH
    h = row % NH
    kvh = h // G
    m_row = i * G + h % G
    start = tl.load(START).to(tl.int32)
    lo, seq_end, n_blocks, per_split = _key_range(start, W, WINDOW, IS_RING, BLOCK_N, NUM_SPLITS)
    n_active = tl.cdiv(n_blocks, per_split)
    if HAS_SINK:   # a weight: not written by the split kernel
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    if PDL:   # launched as a programmatic dependent of the split kernel: its partials are complete
        gdc_wait()   # and visible past this point (start_pos was written before the split began)
    _stamp(TL, prog, 2, TIMELINE)

    if ML_BY_ROW:   # [nkv, 2, BLOCK_M, NUM_SPLITS]
        ml_ptr = ML + kvh * stride_mh + m_row * NUM_SPLITS
        step_s = 1
        l_off = BLOCK_M * NUM_SPLITS
    else:   # [nkv, NUM_SPLITS, 2, BLOCK_M]
        ml_ptr = ML + kvh * stride_mh + m_row
        step_s = stride_ms
        l_off = BLOCK_M
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < n_active
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    acc_ptr = ACC + kvh * stride_ah + m_row * stride_am
    m_s = tl.load(ml_ptr + offs_s * step_s, mask=s_ok, other=_NEG_BIG)
    l_s = tl.load(ml_ptr + offs_s * step_s + l_off, mask=s_ok, other=0.0)
    if ONE_LOAD:
        part = tl.load(acc_ptr + offs_s[:, None] * stride_as + offs_d[None, :], mask=s_ok[:, None],
                       other=0.0)
    m_all = tl.max(m_s, 0)
    if HAS_SINK:
        m_all = tl.maximum(m_all, sink)
    wgt_s = tl.exp2(m_s - m_all)
    den = tl.sum(wgt_s * l_s, 0)
    if HAS_SINK:
        den += tl.exp2(sink - m_all)
    _stamp_after(TL, prog, 4, den, TIMELINE)
    normalized: tl.constexpr = ACC.dtype.element_ty != tl.float32 and not PARTIALS_BUG
    if ONE_LOAD:
        if normalized:   # 16-bit partials hold acc / l
            wgt_s = wgt_s * l_s
        num = tl.sum(wgt_s[:, None] * part.to(tl.float32), 0)
        _stamp_after(TL, prog, 5, tl.sum(num), TIMELINE)
    else:
        num = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, n_active, SUB_S):
            sub = s0 + tl.arange(0, SUB_S)
            ok = sub < n_active
            wgt = tl.exp2(tl.load(ml_ptr + sub * step_s, mask=ok, other=_NEG_BIG) - m_all)
            if normalized:
                wgt *= tl.load(ml_ptr + sub * step_s + l_off, mask=ok, other=0.0)
            part = tl.load(acc_ptr + sub[:, None] * stride_as + offs_d[None, :], mask=ok[:, None],
                           other=0.0)
            num += tl.sum(wgt[:, None] * part.to(tl.float32), 0)
    tl.store(OUT + i * stride_ow + h * stride_oh + offs_d, (num / den).to(OUT.dtype.element_ty))
    _stamp(TL, prog, 3, TIMELINE)


@triton.jit(do_not_specialize=["W", "WINDOW", "R", "NUM_SPLITS"], launch_metadata=launch_signature)
def _attn_fused_kernel(
    Q, K, V, ACC, ML, SINKS, OUT, START, CNT,
    stride_qw, stride_qh,
    stride_kh, stride_kn,
    stride_vh, stride_vn,
    stride_ah, stride_as, stride_am,
    stride_mh, stride_ms,
    stride_ow, stride_oh,
    qk_scale_log2, W, WINDOW, R, NUM_SPLITS, NKV,
    G: tl.constexpr, IS_RING: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, DROP_LAST: tl.constexpr,
):
    """One launch: programs [0, NUM_SPLITS) are the splits of ``_attn_split_kernel``; programs
    [NUM_SPLITS, NUM_SPLITS + W * G * HEAD_DIM / BLOCK_D) are combine programs (one packed row, one
    BLOCK_D slice of d) that wait on the arrival counter ``CNT[kvh]`` and merge as soon as the last
    active split has published its partial; the last combine program to finish re-zeroes
    ``CNT[kvh]`` and ``CNT[NKV + kvh]``."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    start = tl.load(START).to(tl.int32)
    lo, seq_end, n_blocks, per_split = _key_range(start, W, WINDOW, IS_RING, BLOCK_N, NUM_SPLITS)
    n_active = tl.cdiv(n_blocks, per_split)
    arrive_ptr = CNT + kvh
    done_ptr = CNT + NKV + kvh
    if pid < NUM_SPLITS:
        # The Q tile does not depend on start_pos: its load is in flight together with START's.
        q, row_i, row_ok = _load_q(Q, kvh, W, stride_qw, stride_qh, G, BLOCK_M, HEAD_DIM)
        b_begin = pid * per_split
        b_end = tl.minimum(b_begin + per_split, n_blocks)
        if b_begin < b_end:
            _split_partial(q, start + row_i, row_ok, K, V, ACC, ML, kvh, pid, stride_kh, stride_kn,
                           stride_vh, stride_vn, stride_ah, stride_as, stride_am, stride_mh, stride_ms,
                           qk_scale_log2, lo, seq_end, b_begin, b_end, WINDOW, R,
                           IS_RING, BLOCK_M, BLOCK_N, HEAD_DIM)
            # Every thread's stores precede (bar.sync) the one release-add that publishes them.
            tl.debug_barrier()
            tl.atomic_add(arrive_ptr, 1, sem="release", scope="gpu")
    else:
        c = pid - NUM_SPLITS
        n_dblk: tl.constexpr = HEAD_DIM // BLOCK_D
        m_row = c // n_dblk
        dblk = c % n_dblk
        i = m_row // G
        h = kvh * G + m_row % G
        offs_dc = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
        if HAS_SINK:
            m_run = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
            den = m_run * 0.0 + 1.0  # the sink's own term 2^(sink - m_run)
        else:
            m_run = start.to(tl.float32) * 0.0 + _NEG_BIG
            den = m_run * 0.0
        num = tl.zeros([BLOCK_D], tl.float32)
        ml_ptr_c = ML + kvh * stride_mh + m_row
        acc_ptr_c = ACC + kvh * stride_ah + m_row * stride_am
        # Wait until every active split of this KV head has published (acquire pairs with the
        # splits' release). Combine programs come after all splits in the grid, and a waiting
        # program holds few resources, so the splits can always be scheduled (no deadlock).
        arrived = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        while arrived < n_active:
            arrived = tl.atomic_add(arrive_ptr, 0, sem="acquire", scope="gpu")
        n_used = n_active - DROP_LAST
        for s0 in range(0, n_used, BLOCK_S):
            sub_c = s0 + tl.arange(0, BLOCK_S)
            ok_c = sub_c < n_used
            m_sc = tl.load(ml_ptr_c + sub_c * stride_ms, mask=ok_c, other=_NEG_BIG,
                           cache_modifier=".cg")
            l_sc = tl.load(ml_ptr_c + sub_c * stride_ms + BLOCK_M, mask=ok_c, other=0.0,
                           cache_modifier=".cg")
            part_c = tl.load(acc_ptr_c + sub_c[:, None] * stride_as + offs_dc[None, :],
                             mask=ok_c[:, None], other=0.0, cache_modifier=".cg")
            m_new_c = tl.maximum(m_run, tl.max(m_sc, 0))
            scale = tl.exp2(m_run - m_new_c)
            wgt = tl.exp2(m_sc - m_new_c)
            den = den * scale + tl.sum(wgt * l_sc, 0)
            num = num * scale + tl.sum(wgt[:, None] * part_c, 0)
            m_run = m_new_c
        tl.store(OUT + i * stride_ow + h * stride_oh + offs_dc, (num / den).to(OUT.dtype.element_ty))
        # Last combine program of this KV head: no program is still waiting, re-arm the counters
        # for the next call (or the next CUDA-graph replay).
        done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if done == W * G * n_dblk - 1:
            tl.atomic_xchg(arrive_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")


def _fused_counters(device, nkv, workspace):
    """Arrival/done counters of the fused variant: ``workspace`` (int32, >= 2 * nkv elements,
    zero-initialised by the caller) or one buffer cached per device on this function.

    Every fused call leaves its counters at zero (the last combine program resets them), so one
    buffer serves any number of calls, including many inside one CUDA graph, PROVIDED the calls
    do not run concurrently: calls on one stream (or graph replays that are stream-ordered) are
    fine; concurrent calls on two streams, or PDL overlap with a previous call, need distinct
    ``workspace`` buffers. The cached buffer is created (torch.zeros) on the first call, which
    must not be inside a CUDA-graph capture (call once eagerly first, as the warm-up/compile call
    does, or pass ``workspace``)."""
    if workspace is not None:
        check(workspace.dtype == torch.int32 and workspace.device == device
              and workspace.numel() >= 2 * nkv and workspace.is_contiguous(),
              "workspace: contiguous int32 on the device of q, >= 2 * nkv elements, zeroed")
        return workspace
    return cached_counters(_fused_counters.__dict__.setdefault("cache", {}), device, 2 * nkv,
                           "fused attention (or pass workspace=torch.zeros(2 * nkv, dtype=torch.int32))")


def _kv_descriptors(k, v, block_n):
    """Host TMA descriptors of K and V as [nkv * slots, d] row matrices with [block_n, d] tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    nkv, slots, d = k.shape
    for t in (k, v):
        check(t.stride(0) == slots * t.stride(1) and t.data_ptr() % 16 == 0 and (t.stride(1) * 2) % 16 == 0,
              "tma: k/v must flatten to [nkv * slots, d] rows (stride(0) == slots * stride(1)), 16-byte aligned")
    return tuple(TensorDescriptor(t, [nkv * slots, d], [t.stride(1), 1], [block_n, d]) for t in (k, v))


def _launch(q, k, v, start_pos, sinks, out, *, ring: bool, window: int, num_splits, validate=True,
            block_n=None, num_stages=None, num_warps=None, variant=None, workspace=None,
            combine_block_d=None, combine_block_s=None, pdl=None, prefetch=None, min_block_m=None,
            _drop_last=False,
            combine_one_load=None, tail_prefetch=None, tma=None, combine_num_warps=None,
            _mid_bug=False, _pdl_no_wait=False, _timeline=None, _combine_trigger=False, _split_pdl=None,
            kv_first=None, kv_before_wait=None, _early_bug=False, ml_by_row=None, _ml_bug=False,
            _no_store=False, _no_combine=False, partials=None, _partials_bug=False):
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q [w, nh, d], k/v [nkv, slots, d]")
    w, nh, d = q.shape
    nkv, slots, dk = k.shape
    check(v.shape == k.shape and dk == d, f"k {tuple(k.shape)} / v {tuple(v.shape)} / q {tuple(q.shape)}")
    check(nh % nkv == 0, "nh must be a multiple of nkv")
    check(q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16),
          "q, k, v must share a 16-bit float dtype")
    check(q.device == k.device == v.device, "q, k, v on one device")
    check(q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous")
    check(d in (16, 32, 64, 128, 256), "head_dim must be a power of two in [16, 256]")
    check(start_pos.numel() == 1 and not start_pos.is_floating_point(), "start_pos: one integer")
    check(start_pos.device == q.device, "start_pos on the device of q")
    G = nh // nkv
    block_m = max(MIN_BLOCK_M if min_block_m is None else int(min_block_m), next_pow2(w * G))
    check(block_m <= 128 and block_m in (16, 32, 64, 128),
          f"w * nh / nkv = {w * G} packed rows (min_block_m {min_block_m}): a tile of 16-128 rows")
    if ring:
        check(window >= 1, "window >= 1")
        if validate:
            check(slots >= window + w - 1,
                  f"ring of {slots} slots cannot hold window {window} + {w - 1} new rows")
    has_sink = sinks is not None
    if has_sink:
        check(sinks.shape == (nh,) and sinks.device == q.device, "sinks [nh] on the device of q")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.stride(2) == 1, "out [w, nh, d], contiguous head_dim")
    if num_splits is None:
        num_splits = SPLITS_PER_SM * device_sm_count(q.device)
    num_splits = int(num_splits)
    check(num_splits >= 1, "num_splits >= 1")
    block_n = BLOCK_N if block_n is None else block_n
    variant = VARIANT if variant is None else variant
    check(variant in VARIANTS, f"variant {variant!r}: one of {VARIANTS}")
    ml_by_row = (ML_BY_ROW and variant == "v2") if ml_by_row is None else bool(ml_by_row)
    check(not ml_by_row or variant == "v2", "ml_by_row: v2 only")
    partials = PARTIALS if partials is None else partials
    check(partials in PARTIALS_DTYPES, f"partials {partials!r}: one of {tuple(PARTIALS_DTYPES)}")
    check(partials == "float32" or variant == "v2", "partials: 16-bit with v2 only")
    check(not _partials_bug or partials != "float32", "_partials_bug: with 16-bit partials")
    acc = torch.empty((nkv, num_splits, block_m, d), device=q.device, dtype=PARTIALS_DTYPES[partials])
    ml = torch.empty((nkv, 2, block_m, num_splits) if ml_by_row else (nkv, num_splits, 2, block_m),
                     device=q.device, dtype=torch.float32)
    qk_scale_log2 = _LOG2E / math.sqrt(d)
    if variant == "fused":
        cnt = _fused_counters(q.device, nkv, workspace)
        block_d = min(FUSED_BLOCK_D if combine_block_d is None else combine_block_d, d)
        n_comb = w * G * (d // block_d)
        _attn_fused_kernel[(num_splits + n_comb, nkv)](
            q, k, v, acc, ml, sinks if has_sink else acc, out, start_pos, cnt,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1),
            v.stride(0), v.stride(1),
            acc.stride(0), acc.stride(1), acc.stride(2),
            ml.stride(0), ml.stride(1),
            out.stride(0), out.stride(1),
            qk_scale_log2, w, int(window), int(slots), num_splits, nkv,
            G=G, IS_RING=ring, HAS_SINK=has_sink, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
            BLOCK_S=min(max(16, FUSED_TILE // block_d), max(16, next_pow2(num_splits))),
            BLOCK_D=block_d,
            DROP_LAST=1 if _drop_last else 0,
            num_warps=NUM_WARPS if num_warps is None else num_warps,
            num_stages=FUSED_NUM_STAGES if num_stages is None else num_stages,
        )
        return out
    check(not _drop_last, "_drop_last: fused variant only")
    pdl = pdl_supported(q.device) and (PDL if pdl is None else bool(pdl))
    check(not _mid_bug or variant == "v2", "_mid_bug: v2 only")
    check(not _no_store or variant == "v2", "_no_store: v2 only")
    # _pdl_no_wait (negative control of the tests): the combine is launched early but skips its wait.
    prefetch = PREFETCH_BLOCKS if prefetch is None else int(prefetch)
    check(prefetch >= 0, "prefetch >= 0")
    block_d = min(COMBINE_BLOCK_D if combine_block_d is None else combine_block_d, d)
    # _timeline (diagnostics, v2): int64 [num_splits * nkv + w * nh * d / block_d, TIMELINE_FIELDS]
    # records (see TIMELINE_FIELDS) per split program, then per combine program.
    timeline = _timeline is not None
    if timeline:
        check(variant == "v2" and _timeline.dtype == torch.int64 and _timeline.is_contiguous()
              and _timeline.numel() >= (num_splits * nkv + w * nh * (d // block_d)) * TIMELINE_FIELDS,
              f"_timeline: v2, contiguous int64 [num_splits * nkv + w * nh * d / combine_block_d, "
              f"{TIMELINE_FIELDS}]")
    tl_buf = _timeline if timeline else acc
    # (an L2 prefetch is inline PTX: compiled CUDA only; the interpreter skips it)
    tail_prefetch = (TAIL_PREFETCH if tail_prefetch is None else bool(tail_prefetch)) and compiled_cuda(q.device)
    tma = TMA if tma is None else bool(tma)
    kd = vd = None
    if tma and variant == "v2":
        kd, vd = _kv_descriptors(k, v, block_n)
    split_kernel, extra = ((_attn_split_v2_kernel, dict(PDL=pdl, MID_BUG=bool(_mid_bug), PREFETCH=prefetch,
                                                        TIMELINE=timeline, TAIL_PREFETCH=tail_prefetch,
                                                        KD=kd, VD=vd, TMA=kd is not None,
                                                        KV_FIRST=KV_FIRST if kv_first is None else int(kv_first),
                                                        KV_BEFORE_WAIT=(pdl and KV_BEFORE_WAIT) if kv_before_wait is None
                                                        else bool(kv_before_wait),
                                                        _EARLY_BUG=bool(_early_bug), ML_BY_ROW=ml_by_row,
                                                        _NO_STORE=bool(_no_store)))
                           if variant == "v2" else (_attn_split_kernel, {}))
    # v2's split is itself a programmatic dependent of the previous kernel. _split_pdl=False
    # (measurement only): launched plainly, it starts after the previous kernel has completed, so a
    # benchmark sees the call's latency without overlap with its predecessor.
    if pdl and variant == "v2" and (_split_pdl is None or _split_pdl):
        extra["launch_pdl"] = True
    split_kernel[(num_splits, nkv)](
        q, k, v, acc, ml, start_pos, *((tl_buf,) if variant == "v2" else ()),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1),
        qk_scale_log2, w, int(window), int(slots), num_splits,
        G=G, IS_RING=ring, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
        num_warps=NUM_WARPS if num_warps is None else num_warps,
        num_stages=NUM_STAGES if num_stages is None else num_stages, **extra,
    )
    # _no_store / _no_combine (measurement only, the result is wrong; experiments/ab_attention.py): the
    # split stores no partial / the combine is not launched, so that a benchmark can split a call's
    # time between the split's stream, its partials' stores and the merge.
    if _no_combine:
        return out
    # v1's split kernel does not signal its dependents early; its combine may still be a programmatic
    # dependent (it then starts when the last split exits, before the kernel's completion is flushed).
    _combine(acc, ml, sinks, out, start_pos, tl_buf, w=w, ring=ring, window=window, block_n=block_n,
             block_d=block_d, combine_block_s=combine_block_s, pdl=pdl, wait=not _pdl_no_wait,
             tl_base=num_splits * nkv if timeline else None, trigger=bool(_combine_trigger),
             one_load=combine_one_load, num_warps=combine_num_warps, ml_by_row=ml_by_row, _ml_bug=_ml_bug,
             _partials_bug=_partials_bug)
    return out


def _combine(acc, ml, sinks, out, start_pos, tl_buf=None, *, w, ring, window, block_n, block_d=None,
             combine_block_s=None, pdl, wait=True, tl_base=None, trigger=False, one_load=None, num_warps=None,
             ml_by_row=False, _ml_bug=False, _partials_bug=False):
    """The combine launch over partials ``acc`` [nkv, splits, block_m, d] / ``ml`` [nkv, splits, 2,
    block_m] (the split kernels' layout; ``ml_by_row``: [nkv, 2, block_m, splits]) into ``out`` [w, nh,
    d], a 16-bit ``acc`` holding acc / l (``_partials_bug``, the tests' negative control: merged as if
    un-normalised); ``_ml_bug`` (the tests' negative control): a by-row ``ml`` read in the other layout; ``pdl``:
    as a programmatic dependent (``wait``: its griddepcontrol.wait, off only in the tests' negative control);
    ``tl_base``: the first timeline record of its programs in ``tl_buf`` (None: no timeline). The
    options left None take the module's COMBINE_* defaults."""
    nkv, num_splits, block_m, d = acc.shape
    nh = out.shape[1]
    want = (nkv, 2, block_m, num_splits) if ml_by_row else (nkv, num_splits, 2, block_m)
    check(ml.shape == want and ml.is_contiguous(), f"ml {tuple(ml.shape)}: contiguous {want} (ml_by_row={ml_by_row})")
    if _ml_bug:
        check(ml_by_row, "_ml_bug: with ml_by_row")
        ml, ml_by_row = ml.view(nkv, num_splits, 2, block_m), False
    block_d = min(COMBINE_BLOCK_D if block_d is None else block_d, d)
    block_s = max(16, next_pow2(num_splits))
    sub_s = min(COMBINE_BLOCK_S if combine_block_s is None else combine_block_s, block_s)
    _attn_combine_kernel[(w * nh, d // block_d)](
        acc, ml, acc if sinks is None else sinks, out, start_pos, acc if tl_buf is None else tl_buf,
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1),
        out.stride(0), out.stride(1),
        w, int(window), num_splits,
        NH=nh, G=nh // nkv, IS_RING=ring, HAS_SINK=sinks is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_S=block_s,
        SUB_S=sub_s, BLOCK_D=block_d, PDL=pdl and wait, TIMELINE=tl_base is not None,
        ONE_LOAD=sub_s == block_s and (COMBINE_ONE_LOAD if one_load is None else bool(one_load)),
        TL_BASE=tl_base or 0, TRIGGER=pdl and trigger, ML_BY_ROW=bool(ml_by_row),
        PARTIALS_BUG=bool(_partials_bug),
        num_warps=COMBINE_NUM_WARPS if num_warps is None else int(num_warps),
        **({"launch_pdl": True} if pdl else {}),
    )


def decode_attention_full(q, k_cache, v_cache, start_pos, sinks, out=None, *, num_splits=None,
                          variant=None, workspace=None, pdl=None, prefetch=None, tail_prefetch=None,
                          tma=None, combine_num_warps=None, combine_one_load=None, release_next=None,
                          kv_first=None, kv_before_wait=None, block_n=None, num_stages=None, ml_by_row=None,
                          partials=None):
    """Decode attention over a full (non-sliding) KV cache.

    q [w, nh, d] BF16 (RoPE applied); k_cache, v_cache [nkv, capacity, d] with the w new rows already
    written at start_pos .. start_pos + w - 1; start_pos a 0-dim or [1] integer device tensor; sinks
    [nh] FP32 (or None for no sink). Row i (position start_pos + i) sees keys j <= start_pos + i.
    Returns out [w, nh, d] (written into ``out`` when given). No host synchronisation.
    ``variant``: "v1" (split + combine kernels), "v2" (v1 with the split kernel that masks only the
    boundary blocks) or "fused" (one launch); None: module ``VARIANT``.
    ``workspace``: fused only, see ``_fused_counters``. ``pdl``: launch the combine kernel as a
    programmatic dependent (v1/v2, CUDA sm_90+; ignored elsewhere); None: module ``PDL``. With v2
    the split kernel is a programmatic dependent of the kernel before the call too: it reads
    ``start_pos`` and L2-prefetches ``prefetch`` key blocks (None: PREFETCH_BLOCKS) before waiting for
    that kernel, so ``start_pos`` must not be written by the kernel launched immediately before
    (the runtime writes positions at the start of a round); q and the new K/V rows may be.
    ``tail_prefetch``, ``tma``, ``combine_num_warps``, ``combine_one_load``: v2 / combine options, None:
    the module's TAIL_PREFETCH, TMA, COMBINE_NUM_WARPS, COMBINE_ONE_LOAD. ``release_next`` (with PDL):
    the combine releases the kernel after the call at its start (griddepcontrol.launch_dependents), for
    a successor that is a programmatic dependent; off by default (the q1 step measured 0.6-0.8 %
    slower with it, session 14), and the benchmarks time a call without overlap with the next.
    ``kv_first`` (v2): splits of at most this many key blocks request K/V before Q (None: KV_FIRST);
    ``kv_before_wait`` (v2): such a split reads a first block that lies wholly below start_pos before
    its wait (None: KV_BEFORE_WAIT with PDL, off without), so rows below start_pos must not be written
    by a kernel that may still run when the call's predecessor begins. ``block_n`` / ``num_stages``:
    keys per block and pipeline stages of the split (None: BLOCK_N, NUM_STAGES). ``ml_by_row`` (v2):
    the partials' m and l stored in the combine's order (None: ML_BY_ROW; False: by split, the layout
    before session 29); the same values. ``partials`` (v2): "float32" (un-normalised acc) or "bfloat16"
    (acc / l; see PARTIALS); None: PARTIALS.
    """
    return _launch(q, k_cache, v_cache, start_pos, sinks, out, ring=False, window=0,
                   num_splits=num_splits, variant=variant, workspace=workspace, pdl=pdl, prefetch=prefetch,
                   tail_prefetch=tail_prefetch, tma=tma, combine_num_warps=combine_num_warps,
                   combine_one_load=combine_one_load, _combine_trigger=bool(release_next),
                   kv_first=kv_first, kv_before_wait=kv_before_wait, block_n=block_n, num_stages=num_stages,
                   ml_by_row=ml_by_row, partials=partials)


def decode_attention_ring(q, k_ring, v_ring, start_pos, sinks, window, out=None, *, num_splits=None,
                          variant=None, workspace=None, pdl=None, prefetch=None, tail_prefetch=None,
                          tma=None, combine_num_warps=None, combine_one_load=None, release_next=None,
                          kv_first=None, kv_before_wait=None, block_n=None, num_stages=None, ml_by_row=None,
                          partials=None):
    """Decode attention over a sliding-window ring: position p lives in slot p % R (R = k_ring.shape[1],
    normally window + 64). Row i (position p_i = start_pos + i) sees exactly positions
    max(0, p_i - window + 1) .. p_i. Requires R >= window + w - 1 (checked on the host). Keywords as
    ``decode_attention_full``.
    """
    return _launch(q, k_ring, v_ring, start_pos, sinks, out, ring=True, window=int(window),
                   num_splits=num_splits, variant=variant, workspace=workspace, pdl=pdl, prefetch=prefetch,
                   tail_prefetch=tail_prefetch, tma=tma, combine_num_warps=combine_num_warps,
                   combine_one_load=combine_one_load, _combine_trigger=bool(release_next),
                   kv_first=kv_first, kv_before_wait=kv_before_wait, block_n=block_n, num_stages=num_stages,
                   ml_by_row=ml_by_row, partials=partials)


def attention_reference(q, k, v, start_pos: int, sinks, *, window=None, ring=False,
                        dtype=torch.float64):
    """Higher-precision oracle with a host-known start_pos (tests and benchmarks only).

    k, v [nkv, slots, d]: indexed by position (``ring=False``) or by slot p % slots (``ring=True``).
    ``window``: row i sees positions max(0, p_i - window + 1) .. p_i; None: all positions <= p_i.
    sinks [nh] or None. Returns [w, nh, d] in ``dtype``.
    """
    w, nh, d = q.shape
    nkv, slots, _ = k.shape
    G = nh // nkv
    L = start_pos + w
    lo = 0 if window is None else max(0, start_pos - window + 1)
    pos = torch.arange(lo, L, device=q.device)
    idx = pos % slots if ring else pos
    kh = k[:, idx].to(dtype).repeat_interleave(G, 0)  # [nh, n, d]
    vh = v[:, idx].to(dtype).repeat_interleave(G, 0)
    qq = q.to(dtype).transpose(0, 1)  # [nh, w, d]
    s = torch.einsum("hwd,hnd->hwn", qq, kh) / math.sqrt(d)
    qpos = start_pos + torch.arange(w, device=q.device)
    vis = pos[None, :] <= qpos[:, None]
    if window is not None:
        vis &= pos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~vis[None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.to(dtype)[:, None, None])
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.to(dtype)[:, None, None] - m)
    o = torch.einsum("hwn,hnd->hwd", e, vh) / den
    return o.transpose(0, 1).contiguous()
