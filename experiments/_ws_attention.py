"""A warp-specialized attention split (session 34): the one lever sessions 31-33 left untried. Result
(experiments/notes/kernels.md "Session 34"): no config beats the runtime's split; one consumer at three
blocks in flight matches it, two consumers lose 0.15-1.4 us. Kept as a measurement tool: its per-block
timeline places the split's time (arithmetic per block, the last block, the partial's store).

Session 32 reproduced the 64K split's extra time over a bare TMA stream with a stream that holds each
key block ~700 ns (the split's per-block arithmetic): at the end of the stream each SM still has the
blocks that landed last to compute, one after another on one warpgroup. This probe shortens that
chain by running the arithmetic on two consumer warpgroups that take alternate key blocks, each with
its own online-softmax state (m, l, acc), fed by a one-warp TMA producer through a ring of STAGES
K / V slots; the two states are merged once in shared memory at the end and stored as one partial in
the runtime's layout (``attention.ML_BY_ROW``), then merged with the others by the runtime's own
combine launch (``attention._combine``). ``ws1_s{S}`` is the same kernel with one consumer (the
warp-specialized producer alone).

Scope: full (non-ring) caches, BF16, the v2 split's partition (``per = ceil(blocks / splits)`` of 64
keys), PDL as the v2 split (waits, then releases the combine). Simplification, stated: key rows past
the valid extent are read as they are (the causal mask gives them p = 0 exactly), so they must be
finite; ``bench_kernels.attention_sets`` fills the capacity with random values, and a runtime version
would zero them (as ``_masked_kv`` does). Measurement only, not a runtime option.

Configs (``options``): ``ws{1|2}_s{stages}[_d][_n][_r{regs}]``, timed by ``ab_attention.py --configs``. On
an H200, from the repository root:

    python3 experiments/_ws_attention.py               # correctness against the FP64 reference
    OUT=/tmp/o python3 experiments/_ws_attention.py --timeline    # per-block timeline at 64K / 192K
"""
from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":   # run as a script: the repository root (runtime) and experiments/ (_tma_read)
    sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.path.dirname(os.path.abspath(__file__))]

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:   # a triton without Gluon: the probe is unavailable
    gluon = None
else:
    from _tma_read import _gl_now

from _tma_read import _partials  # noqa: E402

PATTERN = re.compile(r"ws([12])_s(\d+)(_d)?(_n)?(?:_r(\d+))?")
BN = 64
# timeline records (``TIMELINE``): one row per (split, consumer), int64 [entry, end, the consumers' loops
# done (and, with two, their states merged: consumer 0's row), then per block j of the consumer's: global
# timer before and after its wait for block j]; MAX_BLOCKS blocks at most
MAX_BLOCKS = 32
TL_WORDS = 3 + 2 * MAX_BLOCKS

if gluon is not None:
    _TLW = gl.constexpr(TL_WORDS)

    @gluon.jit
    def _ws_producer(k_desc, v_desc, ks, vs, ready, empty, row0, nb, STAGES: gl.constexpr):
        """One warp: block j of the split into slot j % STAGES once the consumers have released it."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        for j in range(nb):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, 0], bar, ks.index(slot))
            tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], bar, vs.index(slot))

    @gluon.jit
    def _ws_consume(Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs, ready, empty,
                    TL, tl_row, PAR: gl.constexpr, NCONS: gl.constexpr, G: gl.constexpr, BLOCK_M: gl.constexpr,
                    STAGES: gl.constexpr, TIMELINE: gl.constexpr, NOMATH: gl.constexpr = False):
        """One consumer warpgroup: blocks PAR, PAR + NCONS, ... of the split; returns its (m, l, acc)
        (m in log2 units of the scaled logits, as the runtime's partials)."""
        BLOCK_N: gl.constexpr = ks.type.shape[1]
        D: gl.constexpr = ks.type.shape[2]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        q_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        head = kvh * G + offs_m % G
        q = gl.load(Q + (offs_m // G)[:, None] * stride_qw + head[:, None] * stride_qh + offs_d[None, :],
                    mask=(offs_m < W * G)[:, None], other=0.0)
        q = gl.convert_layout(q, q_l)
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_l)
        q_pos = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_l)) // G
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
        for j in range(PAR, nb, NCONS):
            slot = j % STAGES
            if TIMELINE:
                gl.store(TL + tl_row * _TLW + 3 + 2 * (j // NCONS), _gl_now())
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            if TIMELINE:
                gl.store(TL + tl_row * _TLW + 4 + 2 * (j // NCONS), _gl_now())
            if not NOMATH:
                s = warpgroup_mma(q, ks.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l),
                                  use_acc=False)
                s = s * qk_scale_log2
                b = b_begin + j
                if (b + 1) * BLOCK_N > start:   # the causal boundary (and the extent's end) lies in this block
                    kpos = b * BLOCK_N + cols
                    s = gl.where(kpos[None, :] <= q_pos[:, None], s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                p = gl.exp2(s - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_l), vs.index(slot), acc)
                m_i = m_new
            gl.thread_barrier()   # every warp of the group is past its reads of the slot
            mbarrier.arrive(empty.index(slot), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _ws_consumer1(Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs, ready, empty,
                      TL, tl_row, xacc, xm, xl, done, G: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      TIMELINE: gl.constexpr, NOMATH: gl.constexpr):
        """The second consumer: its state into shared memory for the first, then ``done``."""
        m_i, l_i, acc = _ws_consume(Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs,
                                    ready, empty, TL, tl_row, 1, 2, G, BLOCK_M, STAGES, TIMELINE, NOMATH)
        xacc.store(acc)
        xm.store(m_i)
        xl.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done, count=1)
        if TIMELINE:
            gl.store(TL + tl_row * _TLW + 1, _gl_now())

    @gluon.jit
    def _ws_split_kernel(Q, k_desc, v_desc, ACC, ML, START, stride_qw, stride_qh, stride_ah, stride_as,
                         stride_mh, qk_scale_log2, W, R, NUM_SPLITS, G: gl.constexpr, BLOCK_M: gl.constexpr,
                         STAGES: gl.constexpr, NCONS: gl.constexpr, TL, CONS_REGS: gl.constexpr = 232,
                         TIMELINE: gl.constexpr = False, DIRECT: gl.constexpr = False, NOMATH: gl.constexpr = False):
        split = gl.program_id(0)
        kvh = gl.program_id(1)
        tl_row = (kvh * NUM_SPLITS + split) * NCONS
        if TIMELINE:
            gl.store(TL + tl_row * _TLW, _gl_now())
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        start = gl.load(START)
        n_blocks = gl.cdiv(start + W, BLOCK_N)
        per = gl.cdiv(n_blocks, NUM_SPLITS)
        b_begin = split * per
        nb = gl.minimum(b_begin + per, n_blocks) - b_begin
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        if nb > 0:
            ks = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
            vs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            xacc = gl.allocate_shared_memory(gl.float32, [BLOCK_M, D], flat)
            flat1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            xm = gl.allocate_shared_memory(gl.float32, [BLOCK_M], flat1)
            xl = gl.allocate_shared_memory(gl.float32, [BLOCK_M], flat1)
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=1)
            mbarrier.init(done, count=1)
            row0 = kvh * R + b_begin * BLOCK_N
            if NCONS == 2:
                m0, l0, acc0 = gl.warp_specialize([
                    (_ws_consume, (Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs,
                                   ready, empty, TL, tl_row, 0, NCONS, G, BLOCK_M, STAGES, TIMELINE, NOMATH)),
                    (_ws_consumer1, (Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs,
                                     ready, empty, TL, tl_row + 1, xacc, xm, xl, done, gl.constexpr(G),
                                     gl.constexpr(BLOCK_M), gl.constexpr(STAGES), gl.constexpr(TIMELINE),
                                     gl.constexpr(NOMATH))),
                    (_ws_producer, (k_desc, v_desc, ks, vs, ready, empty, row0, nb, gl.constexpr(STAGES))),
                ], [4, 1], [CONS_REGS, 24])
                mbarrier.wait(done, 0)
                m1 = xm.load(gl.SliceLayout(1, s_l))
                l1 = xl.load(gl.SliceLayout(1, s_l))
                acc1 = xacc.load(o_l)
                m = gl.maximum(m0, m1)
                a0 = gl.exp2(m0 - m)
                a1 = gl.exp2(m1 - m)
                l_i = l0 * a0 + l1 * a1
                acc = (acc0 * gl.convert_layout(a0, gl.SliceLayout(1, o_l))[:, None]
                       + acc1 * gl.convert_layout(a1, gl.SliceLayout(1, o_l))[:, None])
                m_i = m
            else:
                m_i, l_i, acc = gl.warp_specialize([
                    (_ws_consume, (Q, kvh, W, stride_qw, stride_qh, qk_scale_log2, start, b_begin, nb, ks, vs,
                                   ready, empty, TL, tl_row, 0, NCONS, G, BLOCK_M, STAGES, TIMELINE, NOMATH)),
                    (_ws_producer, (k_desc, v_desc, ks, vs, ready, empty, row0, nb, gl.constexpr(STAGES))),
                ], [1], [24])
            if TIMELINE:
                gl.store(TL + tl_row * _TLW + 2, _gl_now())
            # the partial: acc [nkv, splits, BLOCK_M, D], ML [nkv, 2, BLOCK_M, splits] (ML_BY_ROW)
            if DIRECT:   # straight from the MMA layouts: no shared-memory round trip, no CTA barrier
                offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_l))
                offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
                gl.store(ACC + kvh * stride_ah + split * stride_as + offs_m[:, None] * D + offs_d[None, :], acc,
                         mask=(offs_m < W * G)[:, None])
                offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_l))
                okm = offs < W * G
                gl.store(ML + kvh * stride_mh + split + offs * NUM_SPLITS, m_i, mask=okm)
                gl.store(ML + kvh * stride_mh + split + (BLOCK_M + offs) * NUM_SPLITS, l_i, mask=okm)
            else:        # through a coalescing layout (as Triton's own split stores)
                st: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
                acc = gl.convert_layout(acc, st)
                offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st))
                offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, st))
                ok = offs_m < W * G
                gl.store(ACC + kvh * stride_ah + split * stride_as + offs_m[:, None] * D + offs_d[None, :], acc,
                         mask=ok[:, None])
                ml_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                offs = gl.arange(0, BLOCK_M, layout=ml_l)
                okm = offs < W * G
                gl.store(ML + kvh * stride_mh + split + offs * NUM_SPLITS, gl.convert_layout(m_i, ml_l), mask=okm)
                gl.store(ML + kvh * stride_mh + split + (BLOCK_M + offs) * NUM_SPLITS, gl.convert_layout(l_i, ml_l),
                         mask=okm)
        if TIMELINE:
            gl.store(TL + tl_row * _TLW + 1, _gl_now())


def descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int = BN):
    """TMA descriptors of K / V [nkv, cap, d] BF16 as [nkv * cap, d] rows in block_n x d tiles."""
    nkv, cap, d = k.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    return (TensorDescriptor.from_tensor(k.reshape(nkv * cap, d), [block_n, d], layout),
            TensorDescriptor.from_tensor(v.reshape(nkv * cap, d), [block_n, d], layout))


def launch(q, k, v, start_pos, sinks, out, *, kd, vd, stages=4, consumers=2, num_splits=None, cons_regs=232,
           combine=True, timeline=None, direct=False, nomath=False):
    """One call: the warp-specialized split, then the runtime's combine (a programmatic dependent).
    ``timeline``: int64 [splits * nkv * consumers, TL_WORDS] records (see TL_WORDS), or None. ``direct``:
    the partial stored straight from the MMA layouts (``_d`` configs); ``nomath``: see ``options``."""
    from runtime.kernels import attention as A
    from runtime.kernels._common import device_sm_count

    if consumers == 2 and stages % 2:
        raise ValueError("two consumers need an even stage count (each slot then has one consumer; with an odd "
                         "count a consumer can pass its wait on a slot one phase early: call 1's ws2_s5)")
    w, nh, d = q.shape
    nkv, cap, _ = k.shape
    G = nh // nkv
    splits = num_splits or A.SPLITS_PER_SM * device_sm_count(q.device)
    block_m, acc, ml = _partials(q, splits, by_row=True, nkv=nkv)
    qk_scale_log2 = A._LOG2E / d ** 0.5
    _ws_split_kernel[(splits, nkv)](q, kd, vd, acc, ml, start_pos, q.stride(0), q.stride(1), acc.stride(0),
                                    acc.stride(1), ml.stride(0), qk_scale_log2, w, cap, splits, G=G, BLOCK_M=block_m,
                                    STAGES=stages, NCONS=consumers, CONS_REGS=cons_regs,
                                    TL=acc if timeline is None else timeline, TIMELINE=timeline is not None,
                                    DIRECT=direct, NOMATH=nomath, num_warps=4, launch_pdl=True)
    if combine:
        A._combine(acc, ml, sinks, out, start_pos, w=w, ring=False, window=0, block_n=BN, pdl=True, ml_by_row=True)
    return out


def options(name: str) -> dict:
    """``launch`` keywords of config ``name``: ws{consumers}_s{stages}, then ``_d`` (the partial stored from
    the MMA layouts), ``_n`` (measurement only, the result is wrong: the consumers only wait for each block
    and release it, no arithmetic: the same kernel's bare stream), ``_r{n}`` (the consumers' registers)."""
    m = PATTERN.fullmatch(name)
    if m is None:
        raise ValueError(f"{name}: not a ws config ({PATTERN.pattern})")
    return dict(consumers=int(m.group(1)), stages=int(m.group(2)), direct=bool(m.group(3)), nomath=bool(m.group(4)),
                cons_regs=int(m.group(5) or 232))


def calls(name: str, data) -> list | None:
    """Calls of config ``name`` (see ``options``) over ``bench_kernels.attention_sets`` data; None where Gluon
    or an sm_90 GPU is missing."""
    m = PATTERN.fullmatch(name)
    if m is None or gluon is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return None
    kw = options(name)
    out = []
    for q, k, v, s, sp, o in data:
        kd, vd = descriptors(k, v)
        out.append(lambda q=q, k=k, v=v, s=s, sp=sp, o=o, kd=kd, vd=vd: launch(
            q, k, v, sp, s, o, kd=kd, vd=vd, **kw))
    return out


def check(contexts=(16384, 65536, 196608 + 5), widths=(4, 6, 8),
          configs=("ws1_s2", "ws1_s3", "ws1_s4", "ws1_s6", "ws2_s4", "ws1_s3_d", "ws2_s4_d")):
    """Max |error| against ``attention.attention_reference`` (FP64) of each config and of the runtime's
    default call, on one fresh random set per shape; the negative control is the runtime's output for
    a start_pos one block earlier (the check must see it as wrong). Returns the rows."""
    from bench_kernels import attention_sets
    from runtime.kernels import attention as A

    rows = []
    for ctx in contexts:
        for w in widths:
            torch.manual_seed(ctx + w)
            start = ctx - w
            ((q, k, v, sinks, sp, _),) = attention_sets(1, w, 6, 1, 128, ctx + 64, start, ctx)
            kd, vd = descriptors(k, v)
            ref = A.attention_reference(q, k, v, start, sinks)
            err = {}
            out = torch.full_like(q, float("nan"))
            A.decode_attention_full(q, k, v, sp, sinks, out)
            err["default"] = (out.double() - ref).abs().max().item()
            out = torch.full_like(q, float("nan"))
            A.decode_attention_full(q, k, v, sp - BN, sinks, out)
            err["neg_control"] = (out.double() - ref).abs().max().item()
            for name in configs:
                out = torch.full_like(q, float("nan"))
                launch(q, k, v, sp, sinks, out, kd=kd, vd=vd, **options(name))
                torch.cuda.synchronize()
                err[name] = (out.double() - ref).abs().max().item()
            bound = 4 * err["default"]
            ok = {n: e <= bound for n, e in err.items() if n not in ("default", "neg_control")}
            rows.append(dict(ctx=ctx, w=w, bound=bound, err=err, ok=ok, neg_rejected=not err["neg_control"] <= bound))
            print(f"ctx {ctx:>6} w {w}: " + "  ".join(f"{n} {e:.2e}" for n, e in err.items())
                  + f"  | pass {all(ok.values())} neg rejected {rows[-1]['neg_rejected']}", flush=True)
    return rows


def _summary(rec, splits, cons):
    """One call's records (int64 [splits * cons, TL_WORDS], one KV head) in us after the call's first
    program entered, medians over the busy splits (``_max``: the latest): the first block landed (its
    wait ended), each block's arithmetic (a wait's end to the next wait's start), the split's last block
    landed, its consumers' loops done (with two: and merged), the end (partial stored), ``last_block`` =
    loops done - last landed, ``epilogue`` = end - loops done, and how many of each consumer's last three
    blocks had landed before it asked (wait < 50 ns)."""
    import statistics as st

    t0 = rec[:, 0][rec[:, 0] > 0].min().item()
    us = lambda x: (x - t0) / 1e3   # noqa: E731
    keys = ("first_landed", "block_us", "last_landed", "loops_done", "end", "last_block", "epilogue", "ready_of_last3")
    got = {k: [] for k in keys}
    for sp in range(splits):
        lands = []
        for row in range(sp * cons, (sp + 1) * cons):
            r = rec[row]
            n = int((r[3::2] > 0).sum().item())
            if n == 0:
                continue
            wb = [us(r[3 + 2 * j].item()) for j in range(n)]
            we = [us(r[4 + 2 * j].item()) for j in range(n)]
            got["first_landed"].append(we[0])
            got["block_us"] += [wb[j + 1] - we[j] for j in range(n - 1)]
            got["ready_of_last3"].append(sum(1 for j in range(max(0, n - 3), n) if we[j] - wb[j] < 0.05))
            lands.append(we[-1])
        r0 = rec[sp * cons]
        if not lands or r0[1] == 0 or r0[2] == 0:
            continue
        done, end = us(r0[2].item()), us(r0[1].item())
        got["last_landed"].append(max(lands))
        got["loops_done"].append(done)
        got["end"].append(end)
        got["last_block"].append(done - max(lands))
        got["epilogue"].append(end - done)
    out = {"programs": len(got["end"])}
    for k in keys:
        out[k] = st.median(got[k])
    for k in ("last_landed", "end"):
        out[k + "_max"] = max(got[k])
    return out


def timeline(contexts=(65536, 196608), w=6, configs=("ws1_s3_n", "ws1_s3", "ws1_s3_d", "ws1_s4_n", "ws1_s4", "ws1_s6_n",
                                                   "ws1_s6", "ws2_s4", "ws2_s4_d"), reps=5):
    """Per config and context: records of every call of a CUDA graph over rotating input sets (as
    ab_attention.py), replayed ``reps`` times; prints the medians over the last replay's calls of
    ``_summary``. Returns {f"{config}_{ctx}": [per-call summaries]}."""
    import statistics as st

    from bench_kernels import attention_sets, n_sets
    from runtime.kernels._common import device_sm_count

    splits = device_sm_count(torch.device("cuda"))
    res = {}
    for ctx in contexts:
        cap = ctx + 64
        data = attention_sets(n_sets(2 * cap * 128 * 2, 60 * 2**20), w, 6, 1, 128, cap, ctx - w, ctx)
        for name in configs:
            kw = options(name)
            recs = [torch.zeros(splits * kw["consumers"], TL_WORDS, dtype=torch.int64, device="cuda") for _ in data]
            descs = [descriptors(k, v) for _, k, v, _, _, _ in data]

            def run():
                for (q, k, v, s, sp, o), (kd, vd), r in zip(data, descs, recs):
                    launch(q, k, v, sp, s, o, kd=kd, vd=vd, timeline=r, **kw)
            run()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
            sums = [_summary(r.cpu(), splits, kw["consumers"]) for r in recs]
            res[f"{name}_{ctx}"] = sums
            med = {key: st.median(x[key] for x in sums) for key in sums[0]}
            print(f"{name:>8} {ctx // 1024:>4}K w{w}: " + "  ".join(f"{k_} {v_:.2f}" for k_, v_ in med.items()),
                  flush=True)
    return res


if __name__ == "__main__":
    import json

    out_dir = os.environ.get("OUT")
    if "--timeline" in sys.argv:
        res = timeline()
        if out_dir:
            with open(os.path.join(out_dir, "ws_timeline.json"), "w") as f:
                json.dump(res, f, indent=1)
        sys.exit(0)
    res = check()
    if out_dir:
        with open(os.path.join(out_dir, "ws_check.json"), "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(0 if all(all(r["ok"].values()) and r["neg_rejected"] for r in res) else 1)
