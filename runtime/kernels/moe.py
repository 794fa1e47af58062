"""Fused MoE on E4M3 expert weights with 128 x 128 block scales, for the decode round (w <= 8 rows).

Algorithm (three launches, all grids fixed on the host; no host synchronisation)
-------------------------------------------------------------------------------
The w x 8 (row, expert) pairs are numbered p = row * 8 + k. Every program first derives, on the
device and with no sort, the grouping of the pairs by expert (``_expert_group``): pair p's rank
among the pairs of its expert and whether it is the first one, from a P x P comparison (P <= 64), or
by default (GROUP_BITS, at most 256 experts) from a bitmap of the experts present and popcounts;
group g is the g-th smallest distinct expert; its members are its pairs in increasing p. By default
(GROUP_TABLE) only the Gate/Up ranks: its programs (g, 0) write group g's row of a small table, which
the wide Down reads after its wait. So every
distinct expert is handled by exactly one group, and its weights are read once per step however
many rows chose it. Groups past the device-side count do nothing (the grid is sized for the worst
case, min(P, E) groups).

1. ``_moe_gate_up_kernel``, grid (min(P, E), ceil(I / GU_BLOCK_N)). Program (g, n) owns columns
   [n * GU_BLOCK_N, (n + 1) * GU_BLOCK_N) of Gate and the same columns of Up for expert group g:
   it gathers the group's rows of x (BF16, up to GU_BLOCK_M), streams the two E4M3 weight tiles along
   H in GU_BLOCK_K steps (upcast to FP16 or BF16, exact), and keeps FP32 accumulators
   acc_g += (x @ Wg^T) * s_g, acc_u += (x @ Wu^T) * s_u (one weight scale per 128 x 128 block). By
   default (GU_WEIGHTS_A, at most 8 rows) the product is computed transposed, [Wg; Wu] @ x^T, the
   weights as the MMA's A operand: one M = 2 x GU_BLOCK_N product per K step with x's 8 rows as N.
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

v2 (``fused_moe_fp8(..., variant="v2")``; two launches, same grouping, same activation quantisation)
---------------------------------------------------------------------------------------------------
1. ``_moe_gate_up_v2_kernel``, grid (min(P, E), ceil(I / 32), GU2_SPLIT_K): split along H; each
   program accumulates a 64-row A tile (32 Gate + the same 32 Up rows: one warpgroup MMA) against x^T
   over its H blocks and writes FP32 partials; an atomic counter per (group, 32 columns) picks the
   last program to arrive, which sums the partials in split order (deterministic), then SiLU * mul and
   E4M3 exactly as v1, and resets the counter. Program (g, 0, 0) also writes the group table
   [n_groups, expert of each group] for the Down kernel.
2. ``_moe_down_v2_kernel``, grid (ceil(H / 64), DOWN2_SPLIT_E): program (n, j) owns 64 output
   columns of every row and the groups j, j + SPLIT_E, ...; per group the B operand holds each row's
   activation for that expert (zeros for rows that did not choose it), so each expert's tile is read
   once and the routing weight multiplies the row's column of the product. The SPLIT_E partials are
   summed by the last program to arrive in split order and written once in BF16 (no per-pair buffer,
   no reduce launch).
Both use FP16 tensor-core operands (E4M3 -> FP16 exact; x converted to FP16, |x| <= 65504; the
activations divided by their pair's largest block scale, so |a| <= 448) where v1 uses BF16: on sm_90
E4M3 -> BF16 costs an extra per-value F2F conversion, about one per weight byte.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, launch_carved, launch_signature, next_pow2, pdl_supported, prefetch_l2
from .attention import _TL_FIELDS, TIMELINE_FIELDS, _stamp, _stamp_after
from . import norm as _norm
from .norm import load_weight, rms_scale
from .peer import _base, _fence, _publish_gather, _record_and_rearm
from .peer import exchange_launch as _peer_launch

# Rows per expert group: at most w <= 8 pairs share an expert (each row picks 8 distinct experts);
# the tensor-core product needs M >= 16.
GU_BLOCK_M = 16
# Gate (and Up) columns per program: 8 programs per expert of width 256, about 300 programs for 38
# distinct experts (2+ per SM), each streaming 2 x 32 x 6144 B = 384 KiB of weights. Also the
# activation-scale block.
GU_BLOCK_N = 32
# H step = the weight scale block, so one scale per tile and step.
GU_BLOCK_K = 128
# Gate/Up pipeline stages (keyword gu_num_stages). 3 since session 24 (4 before): with the weights as
# the A operand (session 23) the q1 step took 0.9866 / 0.9880 of 4 stages' time at 8K / 64K (H200,
# call 8, bench_step.py --ab moe_gu_st3); the MoE alone 57.95 against 60.12 us at 38 experts, 68.83
# against 69.53 at 48 (call 7, bench_kernels' gu_unroll2_st3 row); 5 stages 1.07 in the step.
# 4 again since session 26, with GROUP_BITS (~71 registers): q1 step at 3 stages 1.035 of the old
# ranking's time, at 4 stages 0.995, at 5 stages 1.08. sm_90 compile: 40 / 60 / 80 KiB of shared memory
# at 3 / 4 / 5 stages. 3 again since session 28, with GU_CARVEOUT below: the loss at 3 stages was
# occupancy after all. At ~71 registers shared memory alone bounds the programs per SM, and 40 KiB
# lets 5 share one. In the step the Gate/Up is launched while the router's 96 programs still hold
# their SMs, so its programs piled 4-5 deep on the free SMs and 1 on the router's
# (timeline_step_moe.py, session 28 call 1: 18 SMs with 5 programs, the last ending 38.5 us after the
# router against 33.4 for 3); alone (the previous call's programs spread evenly) it never exceeded 3.
# Session 27's carveout cap had not been applied (bench_step installed the hook for carve_* names
# only).
GU_NUM_STAGES = 3
# Preferred shared-memory carveout of the Gate/Up at GU_NUM_STAGES, in percent of 228 KiB (keyword
# gu_carveout; -1: the driver's default). 57 % asks for the 132 KiB configuration: 3 programs of
# 40 + 1 KiB fit, 4 do not. Session 28 (H200, bench_step.py --ab, call 2): q1 step at 3 stages capped
# at 3 per SM 0.9878 / 0.9902 of 4 stages' time at 8K / 64K; capped at 4 (71 %) 1.020; uncapped 1.038.
# The timeline of the capped kernel in the step: at most 3 per SM, last end 34.5 us against 35.8.
GU_CARVEOUT = 57
GU_NUM_WARPS = 4
# launch_carved's cache: this copy of the package's compiled Gate/Up functions, by launch key
_GU_FUNCTIONS: dict = {}
# K steps per loop iteration of the v1 Gate/Up (keyword gu_unroll): the same products in the same
# order (the same output bit for bit), fewer loop and pipeline-wait instructions per weight byte (the
# kernel is issue-latency bound). Session 13, H200, same run: MoE 64.48 -> 62.30 us (38 experts),
# 85.88 -> 79.29 us (48) with 4 stages; 3 stages 63.02 / 84.10, 2 stages 66.85 / 82.56.
GU_UNROLL = 2
# v1 Gate/Up operand order (keyword gu_weights_a). True (since session 23): the Gate and Up rows of the
# program's columns as one [2 x BLOCK_N, K] A operand times x transposed (B: at most 8 rows, so no
# padding of the rows to 16). Triton 3.6 lowers this M = 64, N = 8 product to mma.sync (with x
# padded to 16 rows it chose wgmma, whose wait before each K step's scale lost in session 22; the
# sm_90 compile test checks that no wgmma appears). The converted weights land in the MMA's A
# registers; x's fragments need few moves. sm_90 loop (two K steps; experiments/sass_loop.py): 209
# instructions against 351, 16 HMMA against 32, 30 register moves against 114, 60 KiB of shared
# memory against 72. H200: MoE 0.965-0.973 of the x-as-A time (38 experts), 0.98 (48); q1 step
# 0.981-0.983 (experiments/notes/kernels.md, session 23). False: x [rows, K] times the Gate and Up
# tiles transposed, two products per K step (the form before; also used above 8 rows).
GU_WEIGHTS_A = True
# Two ways of balancing the Gate/Up's bytes over the SMs were built and measured slower (session 22,
# experiments/notes/kernels.md; patches in experiments/results/kernels_s22/rejected/): K shares per
# column block summed by the last to arrive (MoE 1.11-1.38x) and a stream-K grid of three programs per
# SM (MoE 1.07-1.09x, the q1 step 1.13x); so was its product on wgmma (Gate and Up rows as one
# M = 64 operand: MoE 1.08-1.35x), each step's wgmma waited for before its scale is applied.

# FP16 tensor-core operands in v1 Gate/Up (keyword gu_f16): E4M3 -> FP16 is one packed conversion
# per two weights, E4M3 -> BF16 several; x is converted to FP16 per tile (post-norm hidden states lie
# within +-65504). H200, 38 experts: Gate/Up 62.9 -> 42.7 us (experiments/notes/kernels.md).
GU_F16 = True
# Down: 128 output columns x 256 inputs = 32 KiB of E4M3 per program, about 1,800 programs.
DOWN_BLOCK_N = 128
DOWN_BLOCK_K = 128
DOWN_NUM_STAGES = 2
DOWN_NUM_WARPS = 4
# v1 Down: output column blocks per program (1: one block per program; > 1: the pipelined wide
# kernel, fewer and longer programs; used where I <= 256). Measured on the H200
# (experiments/notes/kernels.md): whole MoE 124.3 us (1) -> 100.4 us (8, 3 stages) at 38 experts.
DOWN_NB = 8
# FP16 operands in the wide Down (keyword down_f16): E4M3 weights -> FP16 in one conversion per two;
# the activations are divided by their pair's largest block scale (|a| <= 448) and the product is
# multiplied back.
DOWN_F16 = True
DOWN_WIDE_NUM_STAGES = 3
# The same for the weights-A form (the default, below). 2 since session 28, with 4 column blocks per
# program (DOWN_NB_WEIGHTS_A): 6 blocks x 3 stages took 74 KiB of shared memory, so beside the
# Gate/Up's programs in their 132 KiB carveout (GU_CARVEOUT) a Down program could join an SM holding
# at most one of them; 4 x 2 fits beside two and more Down programs share an SM (timeline_step_moe.py,
# call 6: the last Down end 55.0 against 55.9 us after the router). q1 step 0.9941 / 0.9956 of 6 x 3
# at 8K / 64K (bench_step --ab moe_dnb4_st2, call 6); 4 blocks at 3 stages 1.024, 6 at 2 stages 1.038.
DOWN_WIDE_NUM_STAGES_WEIGHTS_A = 2
# Wide Down operand order (keyword down_weights_a): True (since session 23) = the weight tile [128, I]
# times the activations transposed (at most 8 pairs), on mma.sync like the Gate/Up: 148 registers
# against 218, so three programs per SM instead of two, and then 6 column blocks per program
# (DOWN_NB_WEIGHTS_A; 8 keeps the x-as-A form's DOWN_NB). H200, session 23 (on top of the Gate/Up's
# weights-A form): MoE 0.994 of the x-as-A Down's time at 38 experts, 0.90 at 48 (its 288 programs
# then fit in one wave); q1 step 0.994 / 0.996 (8K / 64K). With 8 blocks: 1.009 / 0.91, step 1.007.
DOWN_WEIGHTS_A = True
DOWN_NB_WEIGHTS_A = 4   # 6 until session 28 (see DOWN_WIDE_NUM_STAGES_WEIGHTS_A)
# Warps of the reduce with the norm fused (``norm=``): the add + RMSNorm kernel's 16, so that the last
# program's sum of squares over the row has that kernel's layout and order.
RED_NORM_NUM_WARPS = 16
RED_BLOCK_H = 256   # 1024 until session 11: with PDL 256 measured MoE 67.5 -> 65.3 us (128: 65.5, 512: 65.9)
# Programmatic dependent launch in v1 (keyword ``pdl``; CUDA sm_90+ only): Gate/Up releases its
# dependents at its start, so the wide Down's programs are launched into the slots Gate/Up's
# finishing programs free; each computes its group and L2-prefetches its first DOWN_PREFETCH weight
# tiles (keyword ``down_prefetch``) before griddepcontrol.wait, behind which it reads the
# activations. The reduce is the Down's dependent in the same way (it waits before reading y).
PDL = True          # session 11: MoE 70.7 -> 67.5 us (38 experts, H200), the reduce width 256 -> 65.1 us
DOWN_PREFETCH = 0   # 2 / 4 / 8 tiles measured 65.3 / 68.1 / 70.2 us against 65.1 (the Down starts late anyway)
# The wide Down takes its expert group from a table the Gate/Up writes (keyword group_table) instead of
# ranking the ids itself (``_expert_group``, a P x P comparison): program (g, 0) of the Gate/Up stores
# group g's expert (-1: no group) and member pairs (-1: none) in row g of a [groups, GT_COLS] int32
# table; the Down reads its row after griddepcontrol.wait (the Gate/Up complete). Session 25-26's
# timelines: a Down program spends ~3.5 us from entry to wait ranking the ids on an SM that still
# streams Gate/Up weights, and the Down's last programs enter only as the Gate/Up ends, so that time
# sits on the MoE's path. Session 26 (H200, call 6): the q1 step 0.9925 / 0.9932 of the ranking
# Down's time at 8K / 64K (bench_step.py --ab moe_group_table); the MoE alone 0.993 / 0.975 at 38 / 48
# experts; the Down's waits return 1.0-1.3 us after the last Gate/Up end (ranking: 0.5-3.7 us); the
# Down needs 70 registers instead of 148. Same products, same bits.
GROUP_TABLE = True
GT_COLS = 32        # [0] expert, [16, 16 + GU / Down BLOCK_M) member pairs
# Expert groups ranked through a bitmap of the experts present (keyword group_bits; up to
# GROUP_BITS_MAX_E experts: E / 32 OR-reductions of P values and popcounts) instead of P x P
# comparisons (``_expert_group_bits``; the same groups). Every Gate/Up program ranks before it can
# address its first weight tile. Session 26 (H200): the Gate/Up's ranking 3.74 -> 1.66 us (median,
# timeline), the MoE alone 0.965 / 0.973 at 38 / 48 experts; the q1 step with 4 Gate/Up stages (see
# GU_NUM_STAGES) 0.9947 / 0.9955 of the comparisons' with 3 stages (call 8), the comparisons with 3
# stages 1.0054 / 1.0047 of it (call 9; bench_step.py --ab moe_group_cmp_st3).
GROUP_BITS = True
GROUP_BITS_MAX_E = 256

# v2 (``variant="v2"``): two launches. Gate/Up split along H (GU2_SPLIT_K programs per (group, 32
# columns): 1,824 programs of 8 H blocks for 38 experts instead of 304 of 48; 3 resident per SM at
# 156 registers, 396 slots: 4.6 waves of 8 steps), the last arriving program of each (group,
# columns) finalises SiLU * mul + E4M3 as v1. Down with the reduction fused: (64 output columns,
# expert split) programs, 96 x 5 = 480 (4 resident per SM at 112 registers: one wave), each ~8
# experts x 2 steps of 8 KiB.
MOE_VARIANT = "v1"
GU2_BLOCK_N = GU_BLOCK_N          # also the activation-scale block: same quantisation as v1
GU2_BLOCK_K = 128
GU2_SPLIT_K = 6
GU2_NUM_STAGES = 3
GU2_NUM_WARPS = 4
# Register cap (keyword gu_maxnreg): 128 would give 4 resident programs per SM instead of 3 (the
# 64 x 64 grouping prologue sets the 156-register peak, not the loop), at the cost of a 40-byte
# stack spill in sm_90 compiles: off by default (the no-spill rule of test_compile_sm90), in the sweep.
GU2_MAXNREG = None
DOWN2_BLOCK_N = 64
DOWN2_BLOCK_K = 128
DOWN2_SPLIT_E = 5
DOWN2_NUM_STAGES = 3
DOWN2_NUM_WARPS = 4
# FP16 tensor-core operands in v2 (E4M3 -> FP16 exact, one packed conversion per two values;
# E4M3 -> BF16 costs one more slow conversion per value, ~1 per weight byte: measured F2F in the
# v1 loops). Gate/Up converts x to FP16 (x must lie within +-65504: post-norm hidden states do).
GU2_F16 = True
DOWN2_F16 = True

_FP8_MAX = tl.constexpr(448.0)
_GT_COLS = tl.constexpr(GT_COLS)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _expert_group(IDS, g, P, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, E_WORDS: tl.constexpr = 0):
    """Group g of the (row, expert) pairs: (expert, number of groups, member pairs [BLOCK_M], mask).
    ``E_WORDS`` > 0 (``group_bits``, experts < 32 * E_WORDS): ``_expert_group_bits``, the same values."""
    if E_WORDS > 0:
        return _expert_group_bits(IDS, g, P, BLOCK_P, BLOCK_M, E_WORDS)
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
def _or(a, b):
    return a | b


@triton.jit
def _popc(x):
    """Set bits of each uint32 (SWAR: no inline assembly, so the interpreter runs it too)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _expert_group_bits(IDS, g, P, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, E_WORDS: tl.constexpr):
    """``_expert_group`` through a bitmap of the experts present (E_WORDS 32-bit words, OR-reduced over
    the pairs) instead of P x P comparisons: a pair's group is the number of present experts below its
    own (popcounts), group g's expert the one whose count is g, its members ranked by a prefix sum over
    p. The same expert, group count, members and order."""
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    e_p = tl.load(IDS + offs_p, mask=p_ok, other=0)
    word = e_p >> 5
    bit = tl.full([BLOCK_P], 1, tl.uint32) << (e_p & 31).to(tl.uint32)
    below = tl.zeros([BLOCK_P], tl.int32)       # present experts smaller than e_p
    n_groups = 0
    for k in tl.static_range(E_WORDS):
        wk = tl.reduce(tl.where(p_ok & (word == k), bit, 0), 0, _or)
        nk = _popc(wk)
        n_groups += nk
        below += tl.where(word > k, nk, 0) + tl.where(word == k, _popc(wk & (bit - 1)), 0)
    expert = tl.maximum(tl.max(tl.where(p_ok & (below == g), e_p, -1), 0), 0)
    member = (p_ok & (e_p == expert)).to(tl.int32)
    rank = tl.cumsum(member, 0) - member       # earlier members (p order)
    offs_r = tl.arange(0, BLOCK_M)
    hit = (member[None, :] == 1) & (rank[None, :] == offs_r[:, None])
    pair = tl.sum(tl.where(hit, offs_p[None, :], 0), 1)
    row_ok = tl.sum(hit.to(tl.int32), 1) > 0
    return expert, n_groups, pair, row_ok


@triton.jit
def _write_group_row(GT, g, expert, n_groups, pair, row_ok, BLOCK_M: tl.constexpr):
    """Row g of the group table: [0] = the group's expert (-1 past the group count), [16 + r] = its
    r-th member pair (-1 where none; all 16 slots written, whatever BLOCK_M)."""
    offs = tl.arange(0, 16)
    tl.store(GT + g * _GT_COLS + offs, tl.where(offs == 0, tl.where(g < n_groups, expert, -1), 0), mask=offs == 0)
    tl.store(GT + g * _GT_COLS + 16 + offs, tl.full([16], -1, tl.int32), mask=offs >= BLOCK_M)
    r = tl.arange(0, BLOCK_M)
    tl.store(GT + g * _GT_COLS + 16 + r, tl.where(row_ok, pair, -1))


@triton.jit
def _read_group_row(GT, g, BLOCK_M: tl.constexpr):
    """(expert, number of groups as far as g is concerned, member pairs, mask) from row g of the group
    table: the values ``_expert_group`` gives for g (n_groups: g + 1 if g has a group, else 0)."""
    expert = tl.load(GT + g * _GT_COLS)
    pr = tl.load(GT + g * _GT_COLS + 16 + tl.arange(0, BLOCK_M))
    return expert, tl.where(expert >= 0, g + 1, 0), tl.maximum(pr, 0), pr >= 0


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


@triton.jit
def _act_tile(ACT, ACT_SCALE, pair, row_ok, kk, I, stride_am, stride_asm, ACT_BLOCK: tl.constexpr,
              row_scale=None, F16: tl.constexpr = False):
    """The group's E4M3 activations at columns ``kk`` (rows ``pair``), dequantised to BF16, or with
    ``F16`` to FP16 divided by ``row_scale`` [BLOCK_M] (each pair's largest block scale, so that
    |value| <= 448 fits FP16; the caller multiplies the product back)."""
    a_ok = row_ok[:, None] & (kk < I)[None, :]
    a8 = tl.load(ACT + pair[:, None] * stride_am + kk[None, :], mask=a_ok, other=0.0)
    sa = tl.load(ACT_SCALE + pair[:, None] * stride_asm + (kk // ACT_BLOCK)[None, :], mask=a_ok, other=0.0)
    if F16:
        sa = sa / row_scale[:, None]
    return (a8.to(tl.float32) * sa).to(tl.float16 if F16 else tl.bfloat16)


@triton.jit
def _silu_mul_e4m3(hg, hu, ok, AXIS: tl.constexpr):
    """SiLU(gate) * up, zero outside ``ok``, quantised to E4M3 with one scale per pair (amax over
    ``AXIS``, the column axis): returns (E4M3 bits, scales). Shared by both Gate/Up variants so their
    activations are encoded identically."""
    h = tl.where(ok, hg * tl.sigmoid(hg) * hu, 0.0)
    amax = tl.max(tl.abs(h), AXIS)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    a = tl.math.div_rn(h, tl.broadcast_to(tl.expand_dims(scale, AXIS), h.shape))
    a = tl.minimum(tl.maximum(a, -_FP8_MAX), _FP8_MAX)
    return _e4m3_bits(a), scale


@triton.jit(do_not_specialize=["P"], launch_metadata=launch_signature)
def _moe_gate_up_kernel(
    X, IDS, W13, S13, ACT, ACT_SCALE,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_am, stride_asm, P,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, N_KB: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BUG: tl.constexpr, F16: tl.constexpr = False, PDL: tl.constexpr = False, UNROLL: tl.constexpr = 1,
    WAIT: tl.constexpr = False, TL=None, TIMELINE: tl.constexpr = False, WEIGHTS_A: tl.constexpr = False,
    GT=None, GROUP_TABLE: tl.constexpr = False, E_WORDS: tl.constexpr = 0,
):
    """``TIMELINE`` (diagnostics, ``moe_plan(_timeline=)``): program (g, nb) stamps record g * grid(1) +
    nb of ``TL`` (see ``attention.TIMELINE_FIELDS``: SM, entry, after the wait, end; field 4 = 1 for
    a program with an expert group; field 5: its group known). ``GROUP_TABLE``: program (g, 0) also
    writes group g's row of ``GT`` (``_write_group_row``) for the wide Down. ``E_WORDS``: see
    ``_expert_group``."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    prog = g * tl.num_programs(1) + nb
    _stamp(TL, prog, 1, TIMELINE)
    if WAIT:   # launched as a programmatic dependent of the router: its ids (and the norm's x) from here
        gdc_wait()
    _stamp(TL, prog, 2, TIMELINE)
    # The Down may launch now: it waits (griddepcontrol.wait) before reading what this writes, but
    # reads the ids before its wait, so it is released only once the router's ids are final (after
    # the wait above; released earlier, it read stale ids: the H200 showed illegal addresses).
    if PDL:
        gdc_launch_dependents()
    expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M, E_WORDS)
    _stamp_after(TL, prog, 5, expert.to(tl.float32), TIMELINE)   # (field 5: the group is known)
    if GROUP_TABLE:
        if nb == 0:
            _write_group_row(GT, g, expert, n_groups, pair, row_ok, BLOCK_M)
    op_ty = tl.float16 if F16 else tl.bfloat16
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
        if WEIGHTS_A:   # the Gate rows, then the Up rows of the same columns: one [2 BLOCK_N, K] operand
            r2 = tl.arange(0, 2 * BLOCK_N)
            cols2 = nb * BLOCK_N + r2 % BLOCK_N
            rows2 = cols2 + (r2 // BLOCK_N) * I
            ok2 = cols2 < I
            w_2 = W13 + expert.to(tl.int64) * stride_we + rows2[:, None] * stride_wn
            s_2 = s_base + (rows2 // 128) * stride_sn
            acc2 = tl.zeros([2 * BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k00 in range(0, H, BLOCK_K * UNROLL):   # UNROLL K steps per iteration (same products, same order)
            for u in tl.static_range(UNROLL):
                k0 = k00 + u * BLOCK_K
                kk = k0 + offs_k
                k_ok = kk < H
                kb = k0 // 128
                if SCALE_BUG:
                    kb = (kb + 1) % N_KB
                x = tl.load(x_ptr + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                x = x.to(op_ty)
                if WEIGHTS_A:
                    w2t = tl.load(w_2 + kk[None, :], mask=ok2[:, None] & k_ok[None, :], other=0.0)
                    s2t = tl.load(s_2 + kb * stride_sk, mask=ok2 & (k0 < H), other=0.0)
                    acc2 += tl.dot(w2t.to(op_ty), tl.trans(x)) * s2t[:, None]
                else:
                    wg = tl.load(w_g + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    wu = tl.load(w_u + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                    sg = tl.load(s_g + kb * stride_sk, mask=n_ok & (k0 < H), other=0.0)
                    su = tl.load(s_u + kb * stride_sk, mask=n_ok & (k0 < H), other=0.0)
                    acc_g += tl.dot(x, tl.trans(wg.to(op_ty))) * sg[None, :]
                    acc_u += tl.dot(x, tl.trans(wu.to(op_ty))) * su[None, :]
        if WEIGHTS_A:   # [2 BLOCK_N, rows] -> Gate and Up as [rows, BLOCK_N]
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc2, [2, BLOCK_N, BLOCK_M]), [2, 1, 0]))
        ok = row_ok[:, None] & n_ok[None, :]
        bits, scale = _silu_mul_e4m3(acc_g, acc_u, ok, 1)
        tl.store(ACT + pair[:, None] * stride_am + offs_n[None, :], bits, mask=ok)
        tl.store(ACT_SCALE + pair * stride_asm + nb, scale, mask=row_ok)
        if TIMELINE:
            tl.store(TL + prog.to(tl.int64) * _TL_FIELDS + 4, 1)
    _stamp(TL, prog, 3, TIMELINE)


@triton.jit(do_not_specialize=["P"], launch_metadata=launch_signature)
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
            a = _act_tile(ACT, ACT_SCALE, pair, row_ok, kk, I, stride_am, stride_asm, ACT_BLOCK)
            w = tl.load(w_ptr + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            kb = k0 // 128
            if SCALE_BUG:
                kb = (kb + 1) % N_KB
            sw = tl.load(s_ptr + kb * stride_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(w.to(tl.bfloat16))) * sw[None, :]
        tl.store(Y + pair[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(launch_metadata=launch_signature)
def _moe_down_wide_kernel(
    ACT, ACT_SCALE, IDS, W2, S2, Y,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ym, P,
    H: tl.constexpr, I: tl.constexpr, N_KB: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACT_BLOCK: tl.constexpr, NB: tl.constexpr, LOOP_STAGES: tl.constexpr, SCALE_BUG: tl.constexpr,
    F16: tl.constexpr = False, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
    NO_WAIT: tl.constexpr = False, TL=None, TIMELINE: tl.constexpr = False, TL_BASE=0,
    WEIGHTS_A: tl.constexpr = False, GT=None, GROUP_TABLE: tl.constexpr = False, E_WORDS: tl.constexpr = 0,
):
    """v1 Down with NB column blocks per program (``down_nb``): the group and its dequantised
    activations (I <= 256: one or two 128-wide K halves) are set up once, then the program streams
    NB weight tiles of BLOCK_N x I through a software-pipelined loop, so loads of the next column
    block are in flight while this one is multiplied. Same products as v1's Down (the MMA's internal
    summation order may differ in the last bit). H200: Down 59.1 -> 37.2 us at NB=8, 3 stages.

    ``GROUP_TABLE``: the group comes from row g of ``GT`` (written by the Gate/Up), read after the
    wait; every program waits (no L2 prefetch before it: the expert is not known yet)."""
    g = tl.program_id(0)
    prog = TL_BASE + g * tl.num_programs(1) + tl.program_id(1)
    _stamp(TL, prog, 1, TIMELINE)
    if PDL:
        gdc_launch_dependents()
    if GROUP_TABLE:   # the Gate/Up's table: complete once the Gate/Up grid is
        if PDL and not NO_WAIT:
            gdc_wait()
        expert, n_groups, pair, row_ok = _read_group_row(GT, g, BLOCK_M)
    else:   # IDS and the weights were final before Gate/Up released this kernel: safe before the wait
        expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M, E_WORDS)
    if g < n_groups:
        if PDL and not GROUP_TABLE:
            for j in tl.static_range(PREFETCH):
                rows = tl.minimum((tl.program_id(1) * NB + j) * BLOCK_N + tl.arange(0, BLOCK_N), H - 1)
                for kl in tl.static_range((I + 127) // 128):
                    prefetch_l2(W2 + expert.to(tl.int64) * stride_we + rows * stride_wn + kl * 128)
            if not NO_WAIT:   # (NO_WAIT: negative control of the tests)
                gdc_wait()   # Gate/Up complete: its activations and scales are visible from here
        _stamp(TL, prog, 2, TIMELINE)
        if TIMELINE:
            tl.store(TL + prog.to(tl.int64) * _TL_FIELDS + 4, 1)
        offs_k = tl.arange(0, 128)
        k1 = 128 + offs_k
        k0_ok = offs_k < I
        k1_ok = k1 < I
        op_ty = tl.float16 if F16 else tl.bfloat16
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
        if F16:   # each pair's largest activation block scale (I <= 256: at most 8 blocks of 32)
            offs_b = tl.arange(0, 256 // ACT_BLOCK)
            b_ok = row_ok[:, None] & (offs_b < tl.cdiv(I, ACT_BLOCK))[None, :]
            sab = tl.load(ACT_SCALE + pair[:, None] * stride_asm + offs_b[None, :], mask=b_ok, other=0.0)
            row_scale = tl.maximum(tl.max(sab, 1), 1e-30)
        a0 = _act_tile(ACT, ACT_SCALE, pair, row_ok, offs_k, I, stride_am, stride_asm, ACT_BLOCK,
                       row_scale, F16)
        a1 = _act_tile(ACT, ACT_SCALE, pair, row_ok, k1, I, stride_am, stride_asm, ACT_BLOCK,
                       row_scale, F16)
        kb0 = 0
        kb1 = 1
        if SCALE_BUG:
            kb0 = 1 % N_KB
            kb1 = 2 % N_KB
        w_base = W2 + expert.to(tl.int64) * stride_we
        s_base = S2 + expert * stride_se
        for j in tl.range(0, NB, num_stages=LOOP_STAGES):
            offs_n = (tl.program_id(1) * NB + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < H
            w_ptr = w_base + offs_n[:, None] * stride_wn
            s_ptr = s_base + (offs_n // 128) * stride_sn
            w0 = tl.load(w_ptr + offs_k[None, :], mask=n_ok[:, None] & k0_ok[None, :], other=0.0)
            sw0 = tl.load(s_ptr + kb0 * stride_sk, mask=n_ok, other=0.0)
            if WEIGHTS_A:   # the weight tile as the A operand: [BLOCK_N, K] x [K, pairs]
                acc = tl.dot(w0.to(op_ty), tl.trans(a0)) * sw0[:, None]
                if I > 128:
                    w1 = tl.load(w_ptr + k1[None, :], mask=n_ok[:, None] & k1_ok[None, :], other=0.0)
                    sw1 = tl.load(s_ptr + kb1 * stride_sk, mask=n_ok, other=0.0)
                    acc += tl.dot(w1.to(op_ty), tl.trans(a1)) * sw1[:, None]
                if F16:
                    acc = acc * row_scale[None, :]
                tl.store(Y + pair[None, :] * stride_ym + offs_n[:, None], acc,
                         mask=row_ok[None, :] & n_ok[:, None])
            else:
                acc = tl.dot(a0, tl.trans(w0.to(op_ty))) * sw0[None, :]
                if I > 128:
                    w1 = tl.load(w_ptr + k1[None, :], mask=n_ok[:, None] & k1_ok[None, :], other=0.0)
                    sw1 = tl.load(s_ptr + kb1 * stride_sk, mask=n_ok, other=0.0)
                    acc += tl.dot(a1, tl.trans(w1.to(op_ty))) * sw1[None, :]
                if F16:
                    acc = acc * row_scale[:, None]
                tl.store(Y + pair[:, None] * stride_ym + offs_n[None, :], acc,
                         mask=row_ok[:, None] & n_ok[None, :])
    _stamp(TL, prog, 3, TIMELINE)


# (RANK not specialized: one binary for every rank, as the exchange's own kernel: runtime/kernels/peer.py)
@triton.jit(launch_metadata=launch_signature, do_not_specialize=["RANK"])
def _moe_reduce_kernel(Y, TW, OUT, RES, WT, CNT, stride_ym, stride_tw, stride_om, stride_r, eps,
                       PTRS, STATE, RANK, timeout_ns,
                       H: tl.constexpr, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
                       NORM: tl.constexpr = False, BLOCK_ROW: tl.constexpr = 1, NORM_BUG: tl.constexpr = False,
                       WEIGHT_FIRST: tl.constexpr = False, TL=None, TIMELINE: tl.constexpr = False, TL_BASE=0,
                       PEER: tl.constexpr = False, ROWS: tl.constexpr = 8, K: tl.constexpr = 4, R: tl.constexpr = 1,
                       ON_GPU: tl.constexpr = False, MAX_POLLS: tl.constexpr = 1, LAG: tl.constexpr = 2,
                       ACQ: tl.constexpr = 0, REL: tl.constexpr = 0, FENCE_ONE: tl.constexpr = False,
                       NO_REARM: tl.constexpr = False, NT: tl.constexpr = 512):
    # It does not release the next kernel early (session 14, call 6: the chain of early launches then
    # reached the next layer's attention while the Down ran, and the step was 4 % slower).
    if NORM:
        full = tl.arange(0, BLOCK_ROW)
        fok = full < H
        if WEIGHT_FIRST:   # the norm weight before the wait (any program may be the row's last)
            wt = load_weight(WT, full, fok)
    prog = TL_BASE + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    _stamp(TL, prog, 1, TIMELINE)
    if PDL:
        gdc_wait()
    _stamp(TL, prog, 2, TIMELINE)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOPK):
        wk = tl.load(TW + r * stride_tw + k).to(tl.float32)
        acc += wk * tl.load(Y + (r * TOPK + k) * stride_ym + offs, mask=ok, other=0.0)
    if NORM:   # RES += m (m rounded to BF16 first, as the separate add + norm kernel reads it) ...
        m = acc.to(tl.bfloat16)
        if PEER:   # ... m all-reduced first: this block of it over the exchange (runtime/kernels/peer.py)
            seq = tl.load(STATE + r, volatile=True)
            own = _base(PTRS, RANK)
            off = ((seq & (K - 1)) * ROWS + r) * H
            acc, nan, mf = _publish_gather(PTRS, own, off, offs, ok, m, RANK, R, timeout_ns, ON_GPU, MAX_POLLS, NT,
                                           ACQ, FENCE_ONE)
            _record_and_rearm(PTRS, STATE, own, nan, seq, off, offs, ok, mf, RANK, R, r, tl.num_programs(0), ROWS, H,
                              K, LAG, NO_REARM)
            m = acc.to(tl.bfloat16)
        m = m.to(tl.float32)
        res_ptr = RES + r * stride_r + offs
        rv = (tl.load(res_ptr, mask=ok, other=0.0).to(tl.float32) + m).to(RES.dtype.element_ty)
        tl.store(res_ptr, rv, mask=ok)
        # ... then the row's last program to arrive normalises the whole stored row into OUT
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + r, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            if not WEIGHT_FIRST:
                wt = load_weight(WT, full, fok)
            rr = tl.load(RES + r * stride_r + full, mask=fok, other=0.0, cache_modifier=".cg").to(tl.float32)
            if NORM_BUG:   # negative control: the row's last block left out of the sum of squares
                ss = tl.sum(tl.where(full < H - BLOCK_H, rr * rr, 0.0), 0)
            else:
                ss = tl.sum(rr * rr, 0)
            tl.store(OUT + r * stride_om + full, rms_scale(rr, ss, wt, H, eps).to(OUT.dtype.element_ty),
                     mask=fok)
            tl.atomic_xchg(CNT + r, 0, sem="relaxed", scope="gpu")   # re-armed for the next call
            if PEER:   # the row's last program: every program of the row has read the sequence number
                for rr in range(r, ROWS, tl.num_programs(0)):
                    tl.store(STATE + rr, seq + 1)
        if PEER and ON_GPU:
            _fence(REL, FENCE_ONE)
    else:
        tl.store(OUT + r * stride_om + offs, acc.to(OUT.dtype.element_ty), mask=ok)
    _stamp(TL, prog, 3, TIMELINE)


# ----------------------------------------------------------------------------------------- v2
@triton.jit(do_not_specialize=["P"], launch_metadata=launch_signature)
def _moe_gate_up_v2_kernel(
    X, IDS, W13, S13, GPART, CNT, GROUPS, ACT, ACT_SCALE,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_ps, stride_pp,
    stride_am, stride_asm, P,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, N_KB: tl.constexpr,
    SPLIT_K: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BUG: tl.constexpr, F16: tl.constexpr,
):
    """Split-K Gate/Up: program (g, n, s) reduces H blocks [s * KB_PER_SPLIT, ...) of the group's
    Gate and Up columns [n * BLOCK_N, ...) into FP32 partials; the last of the SPLIT_K programs of
    (g, n) to arrive (atomic counter) sums the partials in the fixed order s = 0..SPLIT_K-1, applies
    SiLU * mul and writes the E4M3 activations exactly like v1. Weights are the A operand (rows = the
    tile's Gate then Up columns, K-contiguous as stored), x^T the B operand: acc is
    [2 * BLOCK_N, BLOCK_M]."""
    g = tl.program_id(0)
    nb = tl.program_id(1)
    sk = tl.program_id(2)
    n_nb = tl.num_programs(1)
    expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M)
    if (nb == 0) & (sk == 0):   # group table for the Down kernel: [n_groups, expert of group 0, ...]
        if g == 0:
            tl.store(GROUPS, n_groups)
        if g < n_groups:
            tl.store(GROUPS + 1 + g, expert)
    if g < n_groups:
        tok = pair // TOPK
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        x_ptr = X + tok[None, :] * stride_xm
        # One A tile of 2 * BLOCK_N weight rows: the Gate columns, then the same Up columns (M = 64:
        # one warpgroup MMA per 16 of K, each weight converted once, no duplication across warps).
        offs_i = tl.arange(0, 2 * BLOCK_N)
        col = nb * BLOCK_N + offs_i % BLOCK_N
        c_ok = col < I
        wrow = col + tl.where(offs_i >= BLOCK_N, I, 0)
        w_ptr = W13 + expert.to(tl.int64) * stride_we + wrow[:, None] * stride_wn
        s_ptr = S13 + expert * stride_se + (wrow // 128) * stride_sn
        acc = tl.zeros([2 * BLOCK_N, BLOCK_M], tl.float32)
        kb0 = sk * KB_PER_SPLIT
        kb1 = tl.minimum(kb0 + KB_PER_SPLIT, N_KB)
        for kb in range(kb0, kb1):
            kk = kb * BLOCK_K + offs_k
            k_ok = kk < H
            xt = tl.load(x_ptr + kk[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + kk[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            kbs = kb
            if SCALE_BUG:
                kbs = (kb + 1) % N_KB
            sw = tl.load(s_ptr + kbs * stride_sk, mask=c_ok, other=0.0)
            if F16:
                # E4M3 -> FP16 is one packed conversion per 2 values (exact); E4M3 -> BF16 is that
                # plus one FP16 -> BF16 conversion per value (the slow F2F pipe: ~1 per weight byte).
                acc += tl.dot(wt.to(tl.float16), xt.to(tl.float16)) * sw[:, None]
            else:
                acc += tl.dot(wt.to(tl.bfloat16), xt) * sw[:, None]
        part = GPART + pair[None, :] * stride_pp
        tl.store(part + sk * stride_ps + wrow[:, None], acc, mask=c_ok[:, None] & row_ok[None, :])
        ok = n_ok[:, None] & row_ok[None, :]
        part = part + offs_n[:, None]
        # Every thread's partial stores precede the release of the counter (classic split-K
        # semaphore: CTA barrier, then one acq_rel atomic at GPU scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + g * n_nb + nb, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            hg = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            hu = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                hg += tl.load(part + s * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
                hu += tl.load(part + s * stride_ps + I, mask=ok, other=0.0, cache_modifier=".cg")
            bits, scale = _silu_mul_e4m3(hg, hu, ok, 0)
            tl.store(ACT + pair[None, :] * stride_am + offs_n[:, None], bits, mask=ok)
            tl.store(ACT_SCALE + pair * stride_asm + nb, scale, mask=row_ok)
            tl.store(CNT + g * n_nb + nb, 0)     # self-resetting: zero again for the next call


@triton.jit(do_not_specialize=["W"], launch_metadata=launch_signature)
def _moe_down_v2_kernel(
    ACT, ACT_SCALE, IDS, TW, GROUPS, W2, S2, DPART, CNT, OUT,
    stride_am, stride_asm, stride_ids, stride_tw, stride_we, stride_wn, stride_se, stride_sn,
    stride_sk, stride_ps, stride_pm, stride_om, W,
    H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, N_KB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT_BLOCK: tl.constexpr,
    SPLIT_E: tl.constexpr, SCALE_BUG: tl.constexpr, DROP_SPLIT: tl.constexpr, F16: tl.constexpr,
    N_ABLK: tl.constexpr, NB_POW2: tl.constexpr,
):
    """Down with the routing-weighted reduction fused: program (n, j) owns output columns
    [n * BLOCK_N, ...) of every row and the expert groups j, j + SPLIT_E, j + 2 SPLIT_E, ... (each
    expert's tile read once for all the rows that chose it: the B operand holds, per row, that row's
    activation for the expert, or zeros). acc[col, row] += (W2_e @ a_e^T) * s2 * tw[row, e]. The
    SPLIT_E FP32 partials of a column block are summed by the last program to arrive, in the fixed
    order j = 0..SPLIT_E-1 (deterministic), and written once in BF16."""
    nb = tl.program_id(0)
    j = tl.program_id(1)
    n_groups = tl.load(GROUPS)
    offs_r = tl.arange(0, BLOCK_M)
    r_ok = offs_r < W
    offs_t = tl.arange(0, TOPK)
    ids_t = tl.load(IDS + offs_r[:, None] * stride_ids + offs_t[None, :], mask=r_ok[:, None], other=-1)
    tw_t = tl.load(TW + offs_r[:, None] * stride_tw + offs_t[None, :], mask=r_ok[:, None],
                   other=0.0).to(tl.float32)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, NB_POW2)
    KB: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K
    n_mine = tl.maximum((n_groups - j + SPLIT_E - 1) // SPLIT_E, 0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for gi in range(0, n_mine):
        # One expert per iteration; its KB blocks of I are unrolled so that all its weight loads
        # (KB x BLOCK_N x BLOCK_K bytes) are in flight together (the expert id comes from memory,
        # so the software pipeliner keeps a single buffer for this loop).
        e = tl.load(GROUPS + 1 + j + gi * SPLIT_E)
        match = ids_t == e                                            # [BLOCK_M, TOPK]
        has = tl.sum(match.to(tl.int32), 1) > 0
        kidx = tl.sum(tl.where(match, offs_t[None, :], 0), 1)
        twr = tl.sum(tl.where(match, tw_t, 0.0), 1)
        pair = offs_r * TOPK + kidx
        if F16:
            sa_all = tl.load(ACT_SCALE + pair[None, :] * stride_asm + offs_b[:, None],
                             mask=(offs_b < N_ABLK)[:, None] & has[None, :], other=0.0)
            smax = tl.maximum(tl.max(sa_all, 0), 1e-30)
            inv_smax = 1.0 / smax
        w_e = W2 + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
        s_e = S2 + e * stride_se + (offs_n // 128) * stride_sn
        for kb in tl.static_range(KB):
            kk = kb * BLOCK_K + offs_k
            k_ok = kk < I
            a_ok = k_ok[:, None] & has[None, :]
            a8 = tl.load(ACT + pair[None, :] * stride_am + kk[:, None], mask=a_ok, other=0.0)
            sa = tl.load(ACT_SCALE + pair[None, :] * stride_asm + (kk // ACT_BLOCK)[:, None],
                         mask=a_ok, other=0.0)
            w = tl.load(w_e + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            kbs = kb
            if SCALE_BUG:
                kbs = (kb + 1) % N_KB
            sw = tl.load(s_e + kbs * stride_sk, mask=n_ok, other=0.0)
            if F16:
                # FP16 operands (E4M3 -> FP16 is exact and avoids the per-value FP16 -> BF16 step).
                # The activations are divided by their pair's largest block scale (|a| <= 448: no
                # FP16 overflow whatever the activation range), which multiplies the product back.
                a = (a8.to(tl.float32) * (sa * inv_smax[None, :])).to(tl.float16)
                acc += tl.dot(w.to(tl.float16), a) * (sw[:, None] * (twr * smax)[None, :])
            else:
                a = (a8.to(tl.float32) * sa).to(tl.bfloat16)          # [BLOCK_K, BLOCK_M]
                acc += tl.dot(w.to(tl.bfloat16), a) * (sw[:, None] * twr[None, :])
    ok = n_ok[:, None] & r_ok[None, :]
    part = DPART + offs_r[None, :] * stride_pm + offs_n[:, None]
    tl.store(part + j * stride_ps, acc, mask=ok)
    tl.debug_barrier()
    arrived = tl.atomic_add(CNT + nb, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_E - 1:
        tot = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for s in tl.static_range(SPLIT_E - DROP_SPLIT):
            tot += tl.load(part + s * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(OUT + offs_r[None, :] * stride_om + offs_n[:, None], tot.to(OUT.dtype.element_ty),
                 mask=ok)
        tl.store(CNT + nb, 0)


@triton.jit
def _groups_kernel(IDS, OUT, P, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, E_WORDS: tl.constexpr):
    g = tl.program_id(0)
    expert, n_groups, pair, row_ok = _expert_group(IDS, g, P, BLOCK_P, BLOCK_M, E_WORDS)
    offs = tl.arange(0, 2)
    tl.store(OUT + g * (2 + BLOCK_M) + offs, tl.where(offs == 0, expert, n_groups))
    tl.store(OUT + g * (2 + BLOCK_M) + 2 + tl.arange(0, BLOCK_M), tl.where(row_ok, pair, -1))


def expert_groups(topk_ids, E, *, bits, block_m=16, _short=False):
    """What every MoE program derives from the ids, for each group g < min(P, E): int32 rows
    [expert, number of groups, member pairs (-1: none) x block_m], ranked by P x P comparisons
    (``bits=False``) or through the experts' bitmap (``bits=True``, E <= GROUP_BITS_MAX_E). Tests;
    ``_short``: their negative control (the bitmap one word short)."""
    ids = topk_ids.to(torch.int32).contiguous()
    P = ids.numel()
    check(P <= 64 and (not bits or E <= GROUP_BITS_MAX_E), "at most 64 pairs; bits: E <= GROUP_BITS_MAX_E")
    out = torch.empty((min(P, E), 2 + block_m), dtype=torch.int32, device=ids.device)
    _groups_kernel[(min(P, E),)](ids, out, P, BLOCK_P=max(16, next_pow2(P)), BLOCK_M=block_m,
                                 E_WORDS=triton.cdiv(E, 32) - int(_short) if bits else 0)
    return out


def _check_inputs(x, topk_ids, topk_weights, w13, s13, w2, s2):
    check(x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16), "x [w, H] bf16 (or fp16)")
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


def _launch_gate_up(x, ids, w13, s13, act, act_scale, P, *, num_stages=None, scale_bug=False, f16=None,
                    block_n=GU_BLOCK_N, pdl=False, unroll=None, wait=False, no_wait=False, tl_buf=None,
                    weights_a=False, maxnreg=None, table=None, e_words=0, block_k=None, carveout=None):
    """v1 Gate/Up + SiLU * mul + E4M3 activations (one launch); ``block_k``: H per K step (128, the
    weight scale block, or 64: each scale applies to two steps); ``weights_a``: the weights as the
    MMA's A operand (at most 8 rows); ``tl_buf``: timeline records (diagnostics); ``table``: the
    group table it also writes (int32 [grid(0), GT_COLS]) for the wide Down; ``carveout``: the
    preferred shared-memory carveout in percent (-1: the driver's default; None: GU_CARVEOUT at the
    default stages)."""
    grid = (min(P, w13.shape[0]), triton.cdiv(w13.shape[1] // 2, block_n))
    H = x.shape[1]
    bk = int(block_k or GU_BLOCK_K)
    stages = num_stages or GU_NUM_STAGES
    # the carveout (GU_CARVEOUT) belongs to the default stages; other stage counts keep the driver's
    # default unless asked for explicitly
    pct = (GU_CARVEOUT if stages == GU_NUM_STAGES else -1) if carveout is None else int(carveout)
    launch_carved(_moe_gate_up_kernel, grid, (
        x, ids, w13, s13, act.view(torch.uint8), act_scale,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
        act.stride(0), act_scale.stride(0), P), dict(
        H=H, I=w13.shape[1] // 2, TOPK=ids.shape[1], N_KB=s13.shape[2],
        BLOCK_P=max(16, next_pow2(P)), BLOCK_M=8 if weights_a else GU_BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=bk, SCALE_BUG=scale_bug, F16=GU_F16 if f16 is None else bool(f16), PDL=pdl,
        # (the default unroll was measured at the default width; at 64 columns two steps spill; and no
        # more K steps per iteration than leave the loop two iterations: at H = 256 (q1-mini) two steps
        # would make it run once, and with the cheap ranking (group_bits) ptxas then spilled 8 B; the
        # same products in the same order either way)
        UNROLL=max(1, min(int(unroll or (GU_UNROLL if block_n == GU_BLOCK_N else 1)), H // (2 * bk))),
        WAIT=wait and not no_wait,
        WEIGHTS_A=weights_a, TL=act_scale if tl_buf is None else tl_buf, TIMELINE=tl_buf is not None,
        GT=act_scale if table is None else table, GROUP_TABLE=table is not None, E_WORDS=e_words,
        num_warps=GU_NUM_WARPS, num_stages=stages,
        **({"launch_pdl": True} if wait else {}),
        **({} if _interpreting() or not maxnreg else dict(maxnreg=maxnreg))),
        pct, _GU_FUNCTIONS)


def _launch_down(act, act_scale, ids, w2, s2, y, P, *, num_stages=None, scale_bug=False, act_block=GU_BLOCK_N):
    """v1 Down: per-pair FP32 results y [P, H] (one launch)."""
    E, H, I = w2.shape
    _moe_down_kernel[(min(P, E), triton.cdiv(H, DOWN_BLOCK_N))](
        act, act_scale, ids, w2, s2, y,
        act.stride(0), act_scale.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        s2.stride(2), y.stride(0), P,
        H=H, I=I, N_KB=s2.shape[2],
        BLOCK_P=max(16, next_pow2(P)), BLOCK_M=GU_BLOCK_M, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=DOWN_BLOCK_K,
        ACT_BLOCK=act_block, SCALE_BUG=scale_bug,
        num_warps=DOWN_NUM_WARPS, num_stages=num_stages or DOWN_NUM_STAGES,
    )


def _launch_down_wide(act, act_scale, ids, w2, s2, y, P, *, nb, num_stages=None, scale_bug=False, f16=None,
                      act_block=GU_BLOCK_N, pdl=False, prefetch=0, no_wait=False, tl_buf=None, tl_base=0,
                      weights_a=False, table=None, e_words=0):
    """v1 Down with ``nb`` column blocks per program (one launch; I <= 256); ``weights_a``: the weight
    tile as the MMA's A operand (at most 8 pairs per expert); ``table``: the Gate/Up's group table,
    read instead of ranking the ids."""
    E, H, I = w2.shape
    check(I <= 256, "down_nb > 1 needs an expert width I <= 256")
    _moe_down_wide_kernel[(min(P, E), triton.cdiv(H, DOWN_BLOCK_N * nb))](
        act, act_scale, ids, w2, s2, y,
        act.stride(0), act_scale.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        s2.stride(2), y.stride(0), P,
        H=H, I=I, N_KB=s2.shape[2],
        BLOCK_P=max(16, next_pow2(P)), BLOCK_M=8 if weights_a else GU_BLOCK_M, BLOCK_N=DOWN_BLOCK_N,
        ACT_BLOCK=act_block, NB=nb, SCALE_BUG=scale_bug,
        LOOP_STAGES=num_stages or (DOWN_WIDE_NUM_STAGES_WEIGHTS_A if weights_a else DOWN_WIDE_NUM_STAGES),
        F16=DOWN_F16 if f16 is None else bool(f16), PDL=pdl, PREFETCH=min(int(prefetch), nb) if pdl else 0,
        NO_WAIT=no_wait, TL=y if tl_buf is None else tl_buf, TIMELINE=tl_buf is not None, TL_BASE=tl_base,
        WEIGHTS_A=weights_a, GT=y if table is None else table, GROUP_TABLE=table is not None,
        E_WORDS=e_words, num_warps=DOWN_NUM_WARPS, **({"launch_pdl": True} if pdl else {}),
    )


def _launch_reduce(y, tw, out, *, pdl=False, block_h=None, norm=None, norm_bug=False, weight_first=None,
                   tl_buf=None, tl_base=0, peer=None):
    """v1 reduce: out[r] = sum_k tw[r, k] y[r * 8 + k] (one launch). ``norm`` = (residual, weight, eps,
    counter): instead residual += that sum (rounded to BF16) and out = RMSNorm(residual) * weight,
    computed by each row's last program (``counter``: int32 zeros, at least w, left zero). Every program
    loads the norm weight before its wait (``weight_first``, default norm.WEIGHT_FIRST). ``peer`` =
    (exchange, keywords of ``peer.exchange_launch``), with ``norm``: the sum all-reduced over the
    exchange before the add (the fused all-reduce; one point of the exchange's sequence)."""
    w, H = out.shape
    block_h = block_h or RED_BLOCK_H
    if norm is not None:
        res, wt, eps, cnt = norm
    else:
        res = wt = cnt = out
        eps = 0.0
    xargs, xconst = (y, cnt, 0, 0), {}
    if peer is not None:
        xchg, popts = peer
        check(norm is not None and H == xchg.width and w <= xchg.rows and xchg.own.device == y.device,
              f"peer: with norm, out [w <= {xchg.rows}, {xchg.width}] (the exchange's shape), one device")
        # (one column per thread at least: a column held by two threads could be read twice while its
        # data lands, and the two could differ)
        block_h = max(block_h, 32 * RED_NORM_NUM_WARPS)
        xargs, xconst = _peer_launch(xchg, y.device, **popts)
        xconst.update(PEER=True, NT=32 * RED_NORM_NUM_WARPS)
    _moe_reduce_kernel[(w, triton.cdiv(H, block_h))](
        y, tw, out, res, wt, cnt, y.stride(0), tw.stride(0), out.stride(0), res.stride(0), float(eps), *xargs,
        H=H, TOPK=tw.shape[1], BLOCK_H=block_h, PDL=pdl, NORM=norm is not None, BLOCK_ROW=next_pow2(H),
        NORM_BUG=bool(norm_bug), num_warps=RED_NORM_NUM_WARPS if norm is not None else 4,
        WEIGHT_FIRST=norm is not None and _norm.resolve_weight_first(weight_first),
        TL=y if tl_buf is None else tl_buf, TIMELINE=tl_buf is not None, TL_BASE=tl_base, **xconst,
        **({"launch_pdl": True} if pdl else {}),
    )


def _launch_gate_up_v2(x, ids, w13, s13, gpart, cnt, groups, act, act_scale, P, *, split_k,
                       num_stages=None, scale_bug=False, maxnreg=None):
    """v2 Gate/Up, split along H; writes the activations and the group table (one launch)."""
    E, two_i, H = w13.shape
    I = two_i // 2
    n_kb = s13.shape[2]
    grid = (min(P, E), triton.cdiv(I, GU2_BLOCK_N), split_k)
    _moe_gate_up_v2_kernel[grid](
        x, ids, w13, s13, gpart, cnt, groups, act.view(torch.uint8), act_scale,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s13.stride(2),
        gpart.stride(0), gpart.stride(1), act.stride(0), act_scale.stride(0), P,
        H=H, I=I, TOPK=ids.shape[1], N_KB=n_kb, SPLIT_K=split_k, KB_PER_SPLIT=triton.cdiv(n_kb, split_k),
        BLOCK_P=max(16, next_pow2(P)), BLOCK_M=GU_BLOCK_M, BLOCK_N=GU2_BLOCK_N, BLOCK_K=GU2_BLOCK_K,
        SCALE_BUG=scale_bug, F16=GU2_F16, num_warps=GU2_NUM_WARPS, num_stages=num_stages or GU2_NUM_STAGES,
        **({} if _interpreting() or not maxnreg else dict(maxnreg=maxnreg)),
    )


def _launch_down_v2(act, act_scale, ids, tw, groups, w2, s2, dpart, cnt, out, *, split_e,
                    num_stages=None, scale_bug=False, drop_split=False):
    """v2 Down with the routing-weighted reduction fused; writes out [w, H] (one launch)."""
    E, H, I = w2.shape
    w = out.shape[0]
    _moe_down_v2_kernel[(triton.cdiv(H, DOWN2_BLOCK_N), split_e)](
        act, act_scale, ids, tw, groups, w2, s2, dpart, cnt, out,
        act.stride(0), act_scale.stride(0), ids.stride(0), tw.stride(0), w2.stride(0), w2.stride(1),
        s2.stride(0), s2.stride(1), s2.stride(2), dpart.stride(0), dpart.stride(1), out.stride(0), w,
        H=H, I=I, TOPK=ids.shape[1], N_KB=s2.shape[2],
        BLOCK_M=GU_BLOCK_M, BLOCK_N=DOWN2_BLOCK_N, BLOCK_K=DOWN2_BLOCK_K, ACT_BLOCK=GU2_BLOCK_N,
        SPLIT_E=split_e, SCALE_BUG=scale_bug, DROP_SPLIT=int(drop_split), F16=DOWN2_F16,
        N_ABLK=act_scale.shape[1], NB_POW2=next_pow2(act_scale.shape[1]),
        num_warps=DOWN2_NUM_WARPS, num_stages=num_stages or DOWN2_NUM_STAGES,
    )


def _down_form(w, I, down_nb=None, down_weights_a=None):
    """(weights as the A operand, output column blocks per program) of the v1 Down for these options."""
    dwa = (DOWN_WEIGHTS_A and w <= 8) if down_weights_a is None else bool(down_weights_a)
    return dwa, int(down_nb or ((DOWN_NB_WEIGHTS_A if dwa else DOWN_NB) if I <= 256 else 1))


def timeline_programs(w, H, I, E, topk=8, down_nb=None, red_block_h=None, down_weights_a=None):
    """(Gate/Up, wide Down, reduce) program counts of a v1 call: the ``_timeline`` records' layout."""
    P = w * topk
    nb = _down_form(w, I, down_nb, down_weights_a)[1]
    return (min(P, E) * triton.cdiv(I, GU_BLOCK_N), min(P, E) * triton.cdiv(H, DOWN_BLOCK_N * nb),
            w * triton.cdiv(H, red_block_h or RED_BLOCK_H))


def counters_size(w, H, I, E, topk=8):
    """int32 entries of the v2 counter buffer (``counters=``) for these shapes."""
    return min(w * topk, E) * triton.cdiv(I, GU2_BLOCK_N) + triton.cdiv(H, DOWN2_BLOCK_N)


def moe_plan(x, topk_ids, topk_weights, w13, s13, w2, s2, out=None, *, variant=None,
             gu_num_stages=None, down_num_stages=None, gu_split_k=None, down_split_e=None,
             counters=None, gu_maxnreg=None, down_nb=None, gu_f16=None, down_f16=None, gu_block_n=None,
             pdl=None, down_prefetch=None, red_block_h=None, gu_unroll=None, _scale_bug=False,
             gu_pdl=None, norm=None, norm_weight_first=None, _drop_split=False, _pdl_no_wait=False,
             _gu_no_wait=False, _norm_bug=False, _timeline=None, gu_weights_a=None, down_weights_a=None,
             group_table=None, group_bits=None, gu_block_k=None, gu_carveout=None, peer=None):
    """Buffers and the launches of one call: (out, [(name, launch), ...]); fused_moe_fp8 runs the
    launches in order. The benchmark times each launch alone (buffers are allocated here, outside
    the launches; v2's counters are zeroed here and left zero by every complete call)."""
    w, H, E, I, topk = _check_inputs(x, topk_ids, topk_weights, w13, s13, w2, s2)
    variant = variant or MOE_VARIANT
    check(variant in ("v1", "v2"), f"variant {variant!r}: 'v1' or 'v2'")
    P = w * topk
    check(P <= 64 and w <= GU_BLOCK_M, "at most 64 (row, expert) pairs and 16 rows")
    # the weights as the A operand (default or asked for) take at most 8 rows; above 8 the default
    # falls back to x as the A operand
    gwa = (GU_WEIGHTS_A and w <= 8) if gu_weights_a is None else bool(gu_weights_a)
    dwa, nb = _down_form(w, I, down_nb, down_weights_a)
    check(w <= 8 or not (gwa or dwa), "gu_weights_a / down_weights_a: at most 8 rows")
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.contiguous()
    dev = x.device
    bn = int(gu_block_n or GU_BLOCK_N)   # Gate/Up columns per program = the activation-scale block (v1)
    check(bn in (16, 32, 64, 128) and (variant == "v1" or bn == GU_BLOCK_N), "gu_block_n: 16/32/64/128, v1 only")
    check(gu_block_k in (None, 64, 128) and (variant == "v1" or gu_block_k is None), "gu_block_k: 64 or 128, v1 only")
    check(gu_carveout is None or (isinstance(gu_carveout, int) and -1 <= gu_carveout <= 100 and variant == "v1"),
          "gu_carveout: a percent in [0, 100] or -1 (the driver's default), v1 only")
    n_ablk = triton.cdiv(I, bn)
    act = torch.empty((P, I), device=dev, dtype=torch.float8_e4m3fn)
    act_scale = torch.empty((P, n_ablk), device=dev, dtype=torch.float32)
    if out is None:
        out = torch.empty((w, H), device=dev, dtype=torch.bfloat16)
    check(out.shape == (w, H) and out.stride(1) == 1, "out [w, H]")
    if variant == "v1":
        check(not _drop_split, "_drop_split is a v2 control")
        # the wide Down holds the whole expert width (I <= 256, a q1 shard under TP >= 8) in one
        # program; wider experts (unsharded q1) keep one column block per program by default
        # (nb from _down_form above)
        check(nb >= 1, "down_nb >= 1")
        y = torch.empty((P, H), device=dev, dtype=torch.float32)
        if norm is not None:
            res, wt, _, cnt = norm
            check(res.shape == (w, H) and res.stride(1) == 1 and wt.shape == (H,) and wt.stride(0) == 1
                  and cnt.dtype == torch.int32 and cnt.numel() >= w and res.device == wt.device == dev,
                  "norm: (residual [w, H], weight [H], eps, int32 counter of >= w zeros)")
            check(next_pow2(H) <= 32768, "norm: H <= 32768")
        # _timeline (diagnostics: experiments/timeline_moe.py): int64 [timeline_programs(...),
        # TIMELINE_FIELDS] records of the Gate/Up, then the wide Down's, then the reduce's programs
        n_gu = min(P, E) * triton.cdiv(I, bn)
        n_dn = min(P, E) * triton.cdiv(H, DOWN_BLOCK_N * nb)
        if _timeline is not None:
            check(nb > 1 and _timeline.dtype == torch.int64 and _timeline.is_contiguous()
                  and _timeline.numel() >= (n_gu + n_dn + w * triton.cdiv(H, red_block_h or RED_BLOCK_H))
                  * TIMELINE_FIELDS, "_timeline: wide Down; int64 [timeline_programs(...), TIMELINE_FIELDS]")
        # PDL chains Gate/Up -> wide Down -> reduce (the one-block Down is launched plainly; the
        # reduce still waits correctly behind it)
        use_pdl = pdl_supported(dev) and (PDL if pdl is None else bool(pdl))
        pf = DOWN_PREFETCH if down_prefetch is None else int(down_prefetch)
        # group_table: the wide Down reads its group from a table the Gate/Up writes (no prefetch then)
        # group_bits: the groups ranked through a bitmap of the experts (E <= GROUP_BITS_MAX_E)
        ew = (triton.cdiv(E, 32) if (GROUP_BITS if group_bits is None else bool(group_bits))
              and E <= GROUP_BITS_MAX_E else 0)
        # (by default only without down_prefetch, which needs the expert before the wait)
        check(not (group_table and pf), "group_table: no down_prefetch (the expert is known only after the wait)")
        table = None
        if (GROUP_TABLE and not pf if group_table is None else bool(group_table)) and nb > 1:
            # (_pdl_no_wait, the tests' broken Down, reads the table before the Gate/Up writes it: -1 = no
            # group keeps what it reads in bounds; an unwritten table's garbage expert / pair indices
            # made it fault, "operation not supported on global/shared address space", in session 37's
            # experiments/probe_races.py with 8 processes on the GPU)
            shape = (min(P, E), GT_COLS)
            table = (torch.full(shape, -1, device=dev, dtype=torch.int32) if _pdl_no_wait
                     else torch.empty(shape, device=dev, dtype=torch.int32))
        check(pf >= 0 and (red_block_h is None or red_block_h in (128, 256, 512, 1024, 2048)),
              "down_prefetch >= 0; red_block_h: a power of two in [128, 2048]")
        steps = [
            ("gate_up", lambda: _launch_gate_up(x, ids, w13, s13, act, act_scale, P,
                                                num_stages=gu_num_stages, scale_bug=_scale_bug, f16=gu_f16,
                                                block_n=bn, pdl=use_pdl and nb > 1, unroll=gu_unroll,
                                                wait=use_pdl and (gu_pdl is None or bool(gu_pdl)),
                                                no_wait=_gu_no_wait, tl_buf=_timeline, weights_a=gwa,
                                                maxnreg=gu_maxnreg, table=table, e_words=ew,
                                                block_k=gu_block_k, carveout=gu_carveout)),
            ("down", (lambda: _launch_down(act, act_scale, ids, w2, s2, y, P,
                                           num_stages=down_num_stages, scale_bug=_scale_bug, act_block=bn))
             if nb == 1 else
             (lambda: _launch_down_wide(act, act_scale, ids, w2, s2, y, P, nb=nb,
                                        num_stages=down_num_stages, scale_bug=_scale_bug, f16=down_f16,
                                        act_block=bn, pdl=use_pdl, prefetch=pf, no_wait=_pdl_no_wait,
                                        tl_buf=_timeline, tl_base=n_gu, weights_a=dwa, table=table,
                                        e_words=ew))),
            ("reduce", lambda: _launch_reduce(y, tw, out, pdl=use_pdl, block_h=red_block_h, norm=norm,
                                              norm_bug=_norm_bug, weight_first=norm_weight_first,
                                              tl_buf=_timeline, tl_base=n_gu + n_dn, peer=peer)),
        ]
        return out, steps
    check(norm is None and peer is None, "norm= (the reduce with the next add + RMSNorm) and peer= are v1 options")
    check(topk == 8, "v2 needs top-8 (power-of-two row tile)")
    split_k = max(1, min(gu_split_k or GU2_SPLIT_K, s13.shape[2]))
    split_e = max(1, down_split_e or DOWN2_SPLIT_E)
    n_cnt = counters_size(w, H, I, E, topk)
    if counters is None:
        counters = torch.zeros(n_cnt, device=dev, dtype=torch.int32)
    check(counters.dtype == torch.int32 and counters.numel() >= n_cnt and counters.is_contiguous(),
          f"counters: >= {n_cnt} contiguous int32 zeros")
    n_gu = n_cnt - triton.cdiv(H, DOWN2_BLOCK_N)
    gpart = torch.empty((split_k, P, 2 * I), device=dev, dtype=torch.float32)
    dpart = torch.empty((split_e, w, H), device=dev, dtype=torch.float32)
    groups = torch.empty(1 + min(P, E), device=dev, dtype=torch.int32)
    steps = [
        ("gate_up", lambda: _launch_gate_up_v2(x, ids, w13, s13, gpart, counters[:n_gu], groups, act,
                                               act_scale, P, split_k=split_k, num_stages=gu_num_stages,
                                               scale_bug=_scale_bug,
                                               maxnreg=gu_maxnreg or GU2_MAXNREG)),
        ("down_reduce", lambda: _launch_down_v2(act, act_scale, ids, tw, groups, w2, s2, dpart,
                                                counters[n_gu:], out, split_e=split_e,
                                                num_stages=down_num_stages, scale_bug=_scale_bug,
                                                drop_split=_drop_split)),
    ]
    return out, steps


def fused_moe_fp8(x, topk_ids, topk_weights, w13, s13, w2, s2, out=None, **options):
    """out[r] = sum_k topk_weights[r, k] * Down_e(SiLU(Gate_e x_r) * Up_e x_r), e = topk_ids[r, k].

    x [w, H] bf16, or fp16 (the FP16 operand paths then skip converting x on every tile: pass an FP16
    copy of BF16 values, ``fused_add_rmsnorm(..., out16=)``, for the same result as from BF16 x; the
    H200 measured Gate/Up 42.1 -> 39.8 us at 38 experts); topk_ids [w, 8] int32 (distinct per row); topk_weights [w, 8] fp32; w13 [E, 2I, H]
    E4M3 (rows 0..I-1 Gate, I..2I-1 Up) with s13 [E, ceil(2I/128), ceil(H/128)] fp32; w2 [E, H, I]
    E4M3 with s2 [E, ceil(H/128), ceil(I/128)]. Returns out [w, H] bf16. No host synchronisation.

    ``options`` are ``moe_plan``'s keywords (an unknown one is a TypeError there):
    ``variant``: "v1" (three launches) or "v2" (split-K Gate/Up + Down with the reduce fused: two
    launches); default ``MOE_VARIANT``. ``gu_num_stages`` / ``down_num_stages``: pipeline stages. v2 options: ``gu_split_k`` (default GU2_SPLIT_K),
    ``down_split_e`` (DOWN2_SPLIT_E), ``counters`` (a persistent int32 zero buffer of
    ``counters_size(...)`` entries, left zero by each call; otherwise one is zeroed per call),
    ``gu_maxnreg`` (register cap of the Gate/Up kernel, e.g. 128; default GU2_MAXNREG in v2, none in v1).
    v1 options: ``gu_weights_a`` / ``down_weights_a`` (the weights as the MMA's A operand of the
    Gate/Up / the wide Down, at most 8 rows; defaults GU_WEIGHTS_A / DOWN_WEIGHTS_A, off above 8
    rows); ``down_nb`` (output column blocks per Down program; default DOWN_NB_WEIGHTS_A or DOWN_NB
    by the Down's operand order, 1 where I > 256; > 1 selects the
    pipelined wide Down kernel); ``gu_f16`` / ``down_f16`` (FP16 instead of BF16 operands in Gate/Up /
    in the wide Down; defaults GU_F16 / DOWN_F16); ``gu_block_n`` (Gate/Up columns per program, also
    the activation-scale block; default GU_BLOCK_N); ``pdl`` (programmatic dependent launch of the
    wide Down and the reduce, and of Gate/Up behind the router: it waits before reading ids and x;
    CUDA sm_90+ only, ignored elsewhere; default PDL; ``gu_pdl=False`` launches Gate/Up plainly
    while the rest stays programmatic); ``down_prefetch``
    (weight tiles per Down program prefetched to L2 before its wait, with pdl; default DOWN_PREFETCH);
    ``red_block_h`` (reduce columns per program; default RED_BLOCK_H); ``group_table`` (the wide Down
    reads its expert group from a table the Gate/Up writes instead of ranking the ids; default
    GROUP_TABLE where no ``down_prefetch`` is asked for, which it excludes); ``group_bits`` (the groups
    ranked through a bitmap of the experts instead of P x P comparisons, E <= GROUP_BITS_MAX_E; default
    GROUP_BITS; the same groups); ``gu_unroll`` (K steps per Gate/Up loop iteration; default GU_UNROLL
    at the default width, else 1); ``gu_block_k`` (v1 Gate/Up H per K step: GU_BLOCK_K = 128 or 64, the
    scale applied per step, so other FP32 roundings); ``gu_carveout`` (the v1 Gate/Up's preferred
    shared-memory carveout in percent, which caps its programs per SM; -1: the driver's default;
    default GU_CARVEOUT at GU_NUM_STAGES, -1 at other stage counts; CUDA only, values unchanged);
    ``norm`` = (residual, weight, eps, counter): the next add + RMSNorm fused into the reduce (residual += the MoE output
    rounded to BF16; out = RMSNorm(residual) * weight in BF16, by each row's last reduce program;
    ``counter`` int32 zeros, at least w, left zero by each call) - the MoE output itself is then not
    written; ``norm_weight_first``: its weight loaded before the reduce's wait (default
    norm.WEIGHT_FIRST); ``_norm_bug``: its negative control (a block left out of the sum of squares).
    ``peer`` = (a ``peer.PeerExchange``, keywords of ``peer.exchange_launch``), with ``norm``: the MoE
    output is this rank's partial sum, all-reduced over the exchange inside the reduce before the add
    (the fused all-reduce, DESIGN.md "Tensor parallel": one point of the exchange's sequence).
    ``_scale_bug`` is the negative control of the tests (reads the next H/I block's weight scale);
    ``_drop_split`` (v2) leaves out the last expert split of the Down reduction; ``_pdl_no_wait``
    launches the wide Down early (pdl) without its wait; ``_gu_no_wait`` the same for Gate/Up.
    """
    out, steps = moe_plan(x, topk_ids, topk_weights, w13, s13, w2, s2, out, **options)
    for _, launch in steps:
        launch()
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
