"""Read-floor probes on TMA (session 19): do the copy engines behind ``cp.async.bulk.tensor`` read an
attention call's K/V bytes faster than the register loads of ``bench_kernels._sol_flat_kernel``?

Session 17's read floor (the fastest one-launch reader of a 64K call's bytes, start_pos first) was a
flat grid of 1-warp programs loading 8-row tiles into registers: 11.3 us = 0.70 of copy bandwidth.
Its claim to be a floor rests on the readers tried; every one of them loaded into registers. These
two Gluon kernels load into shared memory through the tensor memory accelerator instead, where the
bytes in flight per SM are bounded by shared memory (228 KiB), not by registers:

* ``_tma_stream_kernel`` (``tmas{m}_{bn}_s{stages}``): m programs per SM, each owning a contiguous
  range of BN-row key blocks (the attention split's partition: per = ceil(blocks / programs)), a ring
  of ``stages`` K and V tiles, one mbarrier each, the next block's copy issued as soon as a tile has
  landed. What the split's stream could be with no arithmetic at all.
* ``_tma_stream_merge_kernel`` (``tmasm{m}_{bn}_s{stages}``, session 20): the stream, releasing the
  combine at its start as the attention split does, then a partial per program in the split kernels'
  layout, merged by the attention's own combine launch (``attention._combine``): a split + merge call
  with no arithmetic.
* ``_tma_stream_barrier_kernel`` (``tmasb{m}_{bn}_s{stages}``, session 21): the same split + merge with
  no arithmetic in ONE launch: the stream and partial, a grid-wide arrival counter (every program
  polls until all have arrived), then each program merges (row, 32-column) slices of all partials.
* ``tmase{m}_{bn}_s{stages}`` / ``tmasp{m}_{bn}_s{stages}`` (session 31): the split + merge call's
  launch structure with a merge that costs nothing: the stream releasing its programmatic dependent at
  its start (without / with its partial stores), then ``_empty_dependent_kernel``, a dependent on the
  combine's grid that only waits (griddepcontrol.wait) and stores one word per program. What two
  launches cost before the merge reads a byte.
* ``tmase{m}_{bn}_s{stages}[_d{ns}a|b][_g{ns}][_k]`` (session 32): ``tmase`` whose one warp holds every
  block ``ns`` nanoseconds (a spin on the global timer) before its slot is refilled (``b``) or after
  (``a``): a split's per-block arithmetic emulated; ``_g{ns}``: the prologue's first copy issued that
  long before the others; ``_k``: 4-warp programs with a CTA barrier per block (the split's loop has
  2-3). ``calls(..., records=)`` / ``without_merge(..., records=)`` run ``tmase`` / the attention's split
  with per-program timeline records for ``experiments/timeline_attention.py``.
* ``_tma_flat_kernel`` (``tmaf{bn}``): one 1-warp program per BN-row tile of the capacity (a fixed
  grid, as a captured launch needs); programs past the valid extent only read start_pos.

Both read start_pos first and derive the extent [0, start_pos + W) from it, as attention must; both
only wait for their tiles to land (nothing reads shared memory afterwards). They run on sm_90+
(CUDA); ``calls`` returns None elsewhere.

Answer (session 19, H200, calls 1 and 7 in experiments/notes/kernels.md): yes. At 64K the readers take
9.9-10.7 us (0.76-0.81 of copy bandwidth), ``tmaf128`` the fastest; the register floor 11.4 us.
Session 20 (call 8): with its partials and the combine, the same stream takes 14.35-14.47 us at 64K
(0.549-0.553), against 10.68 us without them and 15.55 us for the attention itself. Session 21
(call 5): in one launch (``tmasb``) 16.45-16.65 us at 64K, slower than the two launches (14.50 us).
"""
from __future__ import annotations

import re

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from runtime.kernels.attention import TIMELINE_FIELDS, _stamp

assert TIMELINE_FIELDS == 6, "_gl_stamp writes records of 6 words"

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:   # a triton without Gluon: the probes are unavailable, nothing else is
    gluon = None

PATTERN = re.compile(r"tmas([mbep]?)(\d+)_(\d+)_s(\d+)(?:_d(\d+)([ab]))?(?:_g(\d+))?(_k)?|tmaf(\d+)")


@triton.jit
def _empty_dependent_kernel(OUT, PDL: tl.constexpr = True, TL=None, TIMELINE: tl.constexpr = False,
                            TL_BASE: tl.constexpr = 0):
    """A merge that costs nothing: wait for the stream's grid (griddepcontrol.wait), store one word.
    (PDL off: no wait, for the CPU interpreter's dry runs.) ``TIMELINE``: attention.TIMELINE_FIELDS
    records from row TL_BASE, as the combine's (entry, wait, end; "den" and "num" = end)."""
    prog = TL_BASE + tl.program_id(0)
    _stamp(TL, prog, 1, TIMELINE)
    if PDL:
        gdc_wait()
    _stamp(TL, prog, 2, TIMELINE)
    tl.store(OUT + tl.program_id(0), 1.0)
    for f in tl.static_range(3, 6):
        _stamp(TL, prog, f, TIMELINE)

if gluon is not None:
    @gluon.jit
    def _tma_stream_kernel(k_desc, v_desc, OUT, START, W, NPROG, BN: gl.constexpr, STAGES: gl.constexpr):
        gl.store(OUT + gl.program_id(0), _stream(k_desc, v_desc, START, W, NPROG, BN, STAGES))

    @gluon.jit
    def _gl_stamp(TL, pid, field: gl.constexpr, TIMELINE: gl.constexpr):
        """Diagnostics (compiled out unless TIMELINE): the global timer (at field 1 also the SM) into
        program pid's record of attention.TIMELINE_FIELDS int64 words (the split's layout)."""
        if TIMELINE:
            rec = TL + pid.to(gl.int64) * 6
            if field == 1:
                sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
                gl.store(rec, sm.to(gl.int64))
            gl.store(rec + field, _gl_now())

    @gluon.jit
    def _gl_now():
        """The global timer (ns)."""
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _spin(NS: gl.constexpr):
        """Busy-wait NS nanoseconds on the global timer."""
        t0 = _gl_now()
        t = t0
        while t - t0 < NS:
            t = _gl_now()

    @gluon.jit
    def _stream(k_desc, v_desc, START, W, NPROG, BN: gl.constexpr, STAGES: gl.constexpr, TL=None,
                TIMELINE: gl.constexpr = False, DELAY_NS: gl.constexpr = 0, DELAY_AFTER: gl.constexpr = False,
                STAGGER_NS: gl.constexpr = 0, BLOCK_SYNC: gl.constexpr = False):
        """This program's share of the K/V blocks through a ring of STAGES TMA copies; returns its block
        count. ``TIMELINE``: field 2 of its record = its first block landed. ``DELAY_NS``: after each
        block lands, a spin of that many ns on the global timer before its slot is refilled (a split
        that computes on a block before reusing its buffer) or, ``DELAY_AFTER``, right after the refill
        (one that reuses the buffer first). ``STAGGER_NS``: the prologue's first copy issued, then a spin
        of that long before the others (every program's first block ahead of all programs' later ones
        in DRAM's queue). ``BLOCK_SYNC``: a CTA barrier (bar.sync) after each block's hold, before its
        refill, as the split's loop has (2-3 per block in its SASS)."""
        pid = gl.program_id(0)
        n_keys = gl.load(START) + W
        n_blocks = gl.cdiv(n_keys, BN)
        per = gl.cdiv(n_blocks, NPROG)
        b0 = pid * per
        nb = gl.minimum(b0 + per, n_blocks) - b0
        D: gl.constexpr = k_desc.block_type.shape[1]
        NBYTES: gl.constexpr = 2 * k_desc.block_type.nbytes
        ks = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
        vs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            if STAGGER_NS > 0 and i == 1:
                _spin(STAGGER_NS)
            ok = i < nb
            mbarrier.expect(bars.index(i), NBYTES, pred=ok)
            tma.async_copy_global_to_shared(k_desc, [(b0 + i) * BN, 0], bars.index(i), ks.index(i), pred=ok)
            tma.async_copy_global_to_shared(v_desc, [(b0 + i) * BN, 0], bars.index(i), vs.index(i), pred=ok)
        for j in range(0, nb):
            s = j % STAGES
            mbarrier.wait(bars.index(s), (j // STAGES) & 1)
            if j == 0:
                _gl_stamp(TL, pid, 2, TIMELINE)
            if DELAY_NS > 0 and not DELAY_AFTER:
                _spin(DELAY_NS)
            if BLOCK_SYNC:
                gl.thread_barrier()
            ok = j + STAGES < nb
            mbarrier.expect(bars.index(s), NBYTES, pred=ok)
            tma.async_copy_global_to_shared(k_desc, [(b0 + j + STAGES) * BN, 0], bars.index(s), ks.index(s),
                                            pred=ok)
            tma.async_copy_global_to_shared(v_desc, [(b0 + j + STAGES) * BN, 0], bars.index(s), vs.index(s),
                                            pred=ok)
            if DELAY_NS > 0 and DELAY_AFTER:
                _spin(DELAY_NS)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        return nb

    @gluon.jit
    def _tma_stream_merge_kernel(k_desc, v_desc, ACC, ML, START, W, NPROG, BN: gl.constexpr, STAGES: gl.constexpr,
                                 BLOCK_M: gl.constexpr, BY_ROW: gl.constexpr = False, PARTIAL: gl.constexpr = True,
                                 TL=None, TIMELINE: gl.constexpr = False, DELAY_NS: gl.constexpr = 0,
                                 DELAY_AFTER: gl.constexpr = False, STAGGER_NS: gl.constexpr = 0,
                                 BLOCK_SYNC: gl.constexpr = False):
        """``_tma_stream_kernel``, releasing its programmatic dependent (the combine) at its start as the
        v2 split does, then storing a partial in the split kernels' layout (ACC [NPROG, BLOCK_M, D]
        zeros, ML [NPROG, 2, BLOCK_M]: m = 0, l = 1; ``BY_ROW``: ML [2, BLOCK_M, NPROG], the
        attention's ML_BY_ROW): a split + merge call with no arithmetic. ``PARTIAL`` off: no partial
        stored (the ``tmase`` probe). ``TIMELINE``: records in the split's layout (entry, first block
        landed, end) into TL (experiments/timeline_attention.py)."""
        pid = gl.program_id(0)
        _gl_stamp(TL, pid, 1, TIMELINE)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        _stream(k_desc, v_desc, START, W, NPROG, BN, STAGES, TL, TIMELINE, DELAY_NS, DELAY_AFTER, STAGGER_NS,
                BLOCK_SYNC)
        if PARTIAL:
            _store_partial(ACC, ML, pid, k_desc.block_type.shape[1], BLOCK_M, 0.0, 1, BY_ROW, NPROG)
        _gl_stamp(TL, pid, 3, TIMELINE)

    @gluon.jit
    def _store_partial(ACC, ML, pid, D: gl.constexpr, BLOCK_M: gl.constexpr, VALUE: gl.constexpr,
                       WARPS: gl.constexpr, BY_ROW: gl.constexpr = False, NPROG=1):
        """Program pid's partial in the split kernels' layout: acc = VALUE, m = 0, l = 1 (``BY_ROW``: m
        and l by row, ML [2, BLOCK_M, NPROG])."""
        lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
        rows = gl.arange(0, 16, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, lay))
        for r0 in gl.static_range(0, BLOCK_M, 16):
            gl.store(ACC + (pid * BLOCK_M + r0 + rows)[:, None] * D + cols[None, :],
                     gl.full([16, D], VALUE, gl.float32, lay))
        lay1: gl.constexpr = gl.BlockedLayout([2], [32], [WARPS], [0])
        i = gl.arange(0, BLOCK_M, layout=lay1)
        if BY_ROW:
            gl.store(ML + i * NPROG + pid, gl.zeros([BLOCK_M], gl.float32, lay1))
            gl.store(ML + (BLOCK_M + i) * NPROG + pid, gl.full([BLOCK_M], 1.0, gl.float32, lay1))
        else:
            gl.store(ML + pid * 2 * BLOCK_M + i, gl.zeros([BLOCK_M], gl.float32, lay1))
            gl.store(ML + pid * 2 * BLOCK_M + BLOCK_M + i, gl.full([BLOCK_M], 1.0, gl.float32, lay1))

    @gluon.jit
    def _tma_stream_barrier_kernel(k_desc, v_desc, ACC, ML, OUT, CNT, START, W, NPROG, NROWS,
                                   BN: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                                   BLOCK_S: gl.constexpr, SLICE: gl.constexpr, num_warps: gl.constexpr):
        """A split + merge call in ONE launch, with no arithmetic (``tmasb{m}_{bn}_s{stages}``, session
        21): ``_tma_stream_merge_kernel``'s stream and partial, then a grid-wide arrival counter (CTA
        barrier, one release add; every program then polls with acquire loads until all NPROG have
        arrived: the grid must be co-resident, one program per SM here), then each program merges
        SLICE-column slices (row, slice) = pid, pid + NPROG, ... of all partials (max of m, 2^(m - M)
        weights, weighted sums, FP32) into OUT [NROWS, D]; the last to finish re-zeroes CNT[0:2]."""
        pid = gl.program_id(0)
        _stream(k_desc, v_desc, START, W, NPROG, BN, STAGES)
        D: gl.constexpr = k_desc.block_type.shape[1]
        _store_partial(ACC, ML, pid, D, BLOCK_M, 1.0, num_warps)   # (ones: a complete merge gives exactly 1)
        gl.thread_barrier()
        gl.atomic_add(CNT, 1, sem="release", scope="gpu")
        arrived = gl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        while arrived < NPROG:
            arrived = gl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
        ml_lay: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
        offs_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, ml_lay))
        offs_c = gl.arange(0, SLICE, layout=gl.SliceLayout(0, ml_lay))
        s_ok = offs_s < NPROG
        n_sl: gl.constexpr = D // SLICE
        for t in range(pid, NROWS * n_sl, NPROG):
            row = t // n_sl
            c0 = (t % n_sl) * SLICE
            m_s = gl.load(ML + offs_s * (2 * BLOCK_M) + row, mask=s_ok, other=-1.0e30, cache_modifier=".cg")
            l_s = gl.load(ML + offs_s * (2 * BLOCK_M) + BLOCK_M + row, mask=s_ok, other=0.0, cache_modifier=".cg")
            part = gl.load(ACC + (offs_s * BLOCK_M + row)[:, None] * D + (c0 + offs_c)[None, :],
                           mask=s_ok[:, None], other=0.0, cache_modifier=".cg")
            m_all = gl.max(m_s, 0)
            wgt = gl.exp2(m_s - m_all)
            den = gl.sum(wgt * l_s, 0)
            num = gl.sum(wgt[:, None] * part, 0)
            gl.store(OUT + row * D + c0 + offs_c, num / den)
        done = gl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu")
        if done == NPROG - 1:   # every program has passed its poll: re-arm for the next call
            gl.atomic_xchg(CNT, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(CNT + 1, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _tma_flat_kernel(k_desc, v_desc, OUT, START, W, BN: gl.constexpr):
        pid = gl.program_id(0)
        n_keys = gl.load(START) + W
        ok = pid * BN < n_keys
        D: gl.constexpr = k_desc.block_type.shape[1]
        ks = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
        vs = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred=ok)
        tma.async_copy_global_to_shared(k_desc, [pid * BN, 0], bar, ks, pred=ok)
        tma.async_copy_global_to_shared(v_desc, [pid * BN, 0], bar, vs, pred=ok)
        mbarrier.wait(bar, 0, pred=ok)
        mbarrier.invalidate(bar)
        gl.store(OUT + pid, ok.to(gl.int32))


def _descs(k: torch.Tensor, v: torch.Tensor, bn: int):
    """TMA descriptors of one KV head's K and V ([cap, d] BF16) in BN x d tiles."""
    k2, v2 = k[0], v[0]
    layout = gl.NVMMASharedLayout.get_default_for([bn, k2.shape[1]], gl.bfloat16)
    return (TensorDescriptor.from_tensor(k2, [bn, k2.shape[1]], layout),
            TensorDescriptor.from_tensor(v2, [bn, v2.shape[1]], layout))


def calls(name: str, data, records=None) -> list | None:
    """Calls of probe ``name`` (``PATTERN``) over ``bench_kernels.attention_sets`` data (one KV head);
    None when the name is not a TMA probe or Gluon / sm_90 is missing. ``tmasm...``: the stream, its
    partials and the attention's own combine launch (``attention._combine``, a programmatic dependent
    with the runtime's defaults) over them. ``records`` (``tmase`` probes only): one timeline buffer per
    set, the stream's programs' records (entry, first block landed, end) then the dependent's."""
    m = PATTERN.fullmatch(name)
    if m is None or gluon is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return None
    merge = barrier = empty = False
    delay_ns, after, stagger_ns = int(m.group(5) or 0), m.group(6) == "a", int(m.group(7) or 0)
    block_sync = bool(m.group(8))
    if (delay_ns or stagger_ns or block_sync or records is not None) and m.group(1) != "e":
        raise ValueError(f"{name}: a per-block delay (_d<ns>a|b), a staggered prologue (_g<ns>), a per-block "
                         "CTA barrier (_k) or timeline records only with tmase")
    if m.group(9):   # flat: one program per tile of the capacity
        bn = int(m.group(9))
        grid = triton.cdiv(data[0][1].shape[1], bn)

        def launch(kd, vd, o, sp, w):
            _tma_flat_kernel[(grid,)](kd, vd, o, sp, w, BN=bn, num_warps=1)
    else:            # stream: programs per SM, each its contiguous share
        merge, barrier, empty = m.group(1) == "m", m.group(1) == "b", m.group(1) in ("e", "p")
        per_sm, bn, stages = int(m.group(2)), int(m.group(3)), int(m.group(4))
        grid = torch.cuda.get_device_properties(0).multi_processor_count * per_sm

        def launch(kd, vd, o, sp, w):
            _tma_stream_kernel[(grid,)](kd, vd, o, sp, w, grid, BN=bn, STAGES=stages, num_warps=1)
    out = []
    for i, (q, k, v, _, sp, o_att) in enumerate(data):
        kd, vd = _descs(k, v, bn)
        if merge or empty:
            out.append(_merge_call(kd, vd, q, sp, o_att, grid, bn, stages,
                                   empty=m.group(1) if empty else None, delay_ns=delay_ns, after=after,
                                   stagger_ns=stagger_ns, block_sync=block_sync,
                                   records=None if records is None else records[i]))
            continue
        if barrier:
            out.append(_barrier_call(kd, vd, q, sp, grid, bn, stages))
            continue
        o = torch.empty(grid, dtype=torch.int32, device=k.device)
        out.append(lambda kd=kd, vd=vd, o=o, sp=sp, w=q.shape[0]: launch(kd, vd, o, sp, w))
    return out


def empty_dependent(q, pdl: bool = True, records=None, tl_base: int = 0):
    """A callable launching ``_empty_dependent_kernel`` on the attention combine's grid for q [w, nh, d]
    (one word per program), as a programmatic dependent (``pdl``; off for the CPU interpreter): what
    replaces the combine where a benchmark times a call without its merge. ``records``: int64 timeline
    records (attention.TIMELINE_FIELDS words per program), its programs' from row ``tl_base``."""
    from runtime.kernels import attention as A

    w, nh, d = q.shape
    words = torch.empty(w * nh * (d // min(A.COMBINE_BLOCK_D, d)), device=q.device, dtype=torch.float32)

    def launch():
        _empty_dependent_kernel[(words.numel(),)](words, PDL=pdl, num_warps=A.COMBINE_NUM_WARPS,
                                                  TL=words if records is None else records,
                                                  TIMELINE=records is not None, TL_BASE=tl_base,
                                                  **({"launch_pdl": True} if pdl else {}))
    return launch


def without_merge(data, pdl: bool = True, records=None, **kw) -> list:
    """The attention's full-cache calls over ``data`` (``bench_kernels.attention_sets``) without their
    merge: ``attention._launch(..., _no_combine=True, **kw)``, then ``empty_dependent`` on the combine's
    grid (measurement only: ``out`` is not written). ``records``: one timeline buffer per set (the
    split's programs' records, then the dependent's; experiments/timeline_attention.py), or None."""
    from runtime.kernels import attention as A
    from runtime.kernels._common import device_sm_count

    def call(q, k, v, s, sp, o, rec, dependent):
        A._launch(q, k, v, sp, s, o, ring=False, window=0, _no_combine=True, _timeline=rec,
                  **{"num_splits": None, **kw})
        dependent()
    out = []
    for i, d in enumerate(data):
        rec = None if records is None else records[i]
        base = 0   # the dependent's first record: after the split's (num_splits x nkv) programs'
        if rec is not None:
            base = (kw.get("num_splits") or A.SPLITS_PER_SM * device_sm_count(d[0].device)) * d[1].shape[0]
        out.append(lambda d=d, rec=rec, dep=empty_dependent(d[0], pdl=pdl, records=rec, tl_base=base):
                   call(*d, rec, dep))
    return out


def _barrier_call(kd, vd, q, sp, grid, bn, stages, num_warps=4, slice_=32):
    """One ``tmasb`` call: stream, partials, grid-wide arrival and the merge, in one launch (plain: a
    programmatic dependent could start before the previous call's programs leave their SMs)."""
    w, nh, d = q.shape
    block_m, acc, ml = _partials(q, grid)
    out = torch.empty((w * nh, d), device=q.device, dtype=torch.float32)
    cnt = torch.zeros(2, device=q.device, dtype=torch.int32)

    def call():
        _tma_stream_barrier_kernel[(grid,)](kd, vd, acc, ml, out, cnt, sp, w, grid, w * nh, BN=bn, STAGES=stages,
                                            BLOCK_M=block_m, BLOCK_S=max(16, triton.next_power_of_2(grid)),
                                            SLICE=slice_, num_warps=num_warps)
    call.check = lambda: (out, cnt)   # (a complete merge: every value exactly 1; counters back at 0)
    return call


def _partials(q, grid, by_row=False, nkv=1):
    """(block_m, acc [nkv, grid, block_m, d], ml [nkv, grid, 2, block_m] or, ``by_row``, [nkv, 2, block_m,
    grid]): the split kernels' partial buffers for ``nkv`` KV heads and ``grid`` programs each."""
    from runtime.kernels import attention as A

    w, nh, d = q.shape
    block_m = max(A.MIN_BLOCK_M, triton.next_power_of_2(w * nh // nkv))
    return (block_m, torch.empty((nkv, grid, block_m, d), device=q.device, dtype=torch.float32),
            torch.empty((nkv, 2, block_m, grid) if by_row else (nkv, grid, 2, block_m), device=q.device,
                        dtype=torch.float32))


def _merge_call(kd, vd, q, sp, out, grid, bn, stages, empty=None, delay_ns=0, after=False, stagger_ns=0,
                block_sync=False, records=None):
    """One ``tmasm`` call: the stream with its partials, then the attention's combine over them (in the
    runtime's default layout of m and l, attention.ML_BY_ROW). ``empty`` "e" / "p" (``tmase`` /
    ``tmasp``): the combine replaced by ``_empty_dependent_kernel`` on the combine's grid, the partials
    not stored ("e") or stored ("p"). ``delay_ns``: each block held that long (a spin on the global
    timer) before its slot is refilled, or after (``after``): a split's arithmetic emulated.
    ``stagger_ns``: the first block's copy issued that long before the rest of the prologue's.
    ``block_sync``: 4-warp programs with a CTA barrier per block before its refill (as the split's loop).
    ``records``: timeline records of the stream's programs, then of the dependent's (``empty`` only)."""
    from runtime.kernels import attention as A

    w = q.shape[0]
    by_row = bool(A.ML_BY_ROW)
    block_m, acc, ml = _partials(q, grid, by_row)
    dependent = empty_dependent(q, records=records, tl_base=grid)

    def call():
        _tma_stream_merge_kernel[(grid,)](kd, vd, acc, ml, sp, w, grid, BN=bn, STAGES=stages, BLOCK_M=block_m,
                                          BY_ROW=by_row, PARTIAL=empty != "e", num_warps=4 if block_sync else 1,
                                          TL=acc if records is None else records, TIMELINE=records is not None,
                                          DELAY_NS=delay_ns, DELAY_AFTER=after, STAGGER_NS=stagger_ns,
                                          BLOCK_SYNC=block_sync)
        if empty:
            dependent()
        else:
            A._combine(acc, ml, None, out, sp, w=w, ring=False, window=0, block_n=A.BLOCK_N, pdl=True,
                       ml_by_row=by_row)
    return call
