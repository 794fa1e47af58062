"""Expert prefetch: an L2 warm of the Gate/Up weights of predicted experts (DESIGN.md, "Kernels":
"expert prefetch ... only where a paired replay shows it pays"). Off by default; a measurement
option of the fast backend (``FastModel.expert_prefetch``, ``bench_step.py --ab xpf*``).

Verdict of session 45 (H200; experiments/notes/kernels.md): it does not pay, even with the oracle's
prediction. In isolation (``ab_moe.py``) the MoE call with 32-48 MiB of its own experts' Gate/Up bytes
read into L2 beforehand is only 1.4-2.9 us faster (of 56), while the prefetch's launch takes 14-25 us
to retire; in the q1 step every placement and budget was slower (1.009 to 1.18 of the default's time;
the side stream's fork alone 1.002-1.006). So no paired replay was run: there is nothing to qualify.

What it is for. In the decode step the Gate/Up kernel reads ~114 MiB of E4M3 weights per layer pass
(38 of the q1 shard's 128 experts at 3 MiB each) and nothing overlaps it, while the attention, the
projections and the router before it leave DRAM mostly idle (they move ~26 MB in ~35 us at 8K). If
part of the next Gate/Up's bytes is asked of L2 during that idle time, the Gate/Up reads that part
from L2.

Which experts: the ones the same layer chose in the previous pass that wrote its buffer (the caller
keeps one ids buffer per layer and hands it to the router as ``ids=``; -1 = no entry). In a CUDA
graph replayed on the same inputs (``bench_step.py``) that is exactly this pass's routing: the
probe's oracle. In decoding it is the previous step's routing of that layer (a temporal predictor,
as good as the model's routing is persistent).

What is asked for (``expert_prefetch``; kernel ``_expert_prefetch_kernel``): with n distinct predicted
experts and a budget of B bytes, rows_f = min(I, B / (2 n H)) rows of each expert's Gate half and
the same rows of its Up half (w13 [E, 2I, H] E4M3: rows [0, rows_f) and [I, I + rows_f), two
contiguous ranges of rows_f * H bytes; the Gate/Up program of those columns then finds all of its
tiles in L2). With ``k_first`` the budget goes instead to the first seg = min(H, B / (n 2I)) bytes
(a multiple of 16) of every one of the expert's 2I rows: every Gate/Up program then finds its first K
steps in L2 (the Gate/Up's programs are all resident at once and each is limited by its own stream's
rate, so warming some programs entirely leaves the others as slow as before: session 45). The ranges
are cut into chunks of CHUNK bytes and spread over the grid; each chunk is one
``cp.async.bulk.prefetch.L2.global`` (the TMA engine; no register written, nothing waited for, no
value returned: a prefetch can never hand a kernel stale data, so a prediction that is wrong or
racing the router's write costs bandwidth, never correctness). ``dry=`` (offsets, sizes) stores what
would be asked for instead (the interpreter has no inline PTX): the tests check the ranges there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, compiled_cuda, device_sm_count, next_pow2

CHUNK = 65536        # bytes per bulk prefetch (a multiple of 16)
ITEMS = 32           # chunks per program per loop iteration (one per thread of the one warp)


@triton.jit
def _bulk_prefetch_lanes(ptrs, nbytes, ok):
    """Per lane: ask L2 for ``nbytes`` bytes at ``ptrs`` (16-byte aligned, a multiple of 16) through
    the TMA engine where ``ok`` is non-zero (sm_90+ PTX, one instruction per lane)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.ne.u32 q, $3, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, nbytes, ok], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _expert_prefetch_kernel(ids_ptr, w_ptr, off_ptr, size_ptr, n_ptr, n_ids, budget, stride_e,
                            I: tl.constexpr, H: tl.constexpr, E_POW2: tl.constexpr, IDS_POW2: tl.constexpr,
                            CHUNK_B: tl.constexpr, NITEMS: tl.constexpr, K_FIRST: tl.constexpr, DRY: tl.constexpr,
                            BUG: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # the distinct predicted experts, in expert order: a presence mask over E_POW2 lanes
    j = tl.arange(0, IDS_POW2)
    e_ids = tl.load(ids_ptr + j, mask=j < n_ids, other=-1)
    lanes = tl.arange(0, E_POW2)
    present = tl.max((e_ids[:, None] == lanes[None, :]).to(tl.int32), axis=0)     # [E_POW2] 0 / 1
    rank = tl.cumsum(present, axis=0) - 1                                         # rank of present lanes
    n = tl.sum(present, axis=0)
    # each predicted expert's segments: K_FIRST, its 2I rows' first seg_b bytes (seg s at s * H);
    # otherwise its Gate and Up halves' first rows (seg s at s * I * H); each cut into chunks
    if K_FIRST:
        n_seg = 2 * I
        seg_b = (tl.minimum(budget // tl.maximum(n * 2 * I, 1), H) // 16 * 16).to(tl.int64)
        seg_stride = H
    else:
        n_seg = 2
        seg_b = tl.minimum(budget // tl.maximum(2 * n * H, 1), I).to(tl.int64) * H
        seg_stride = I * H
    chunks = (seg_b + CHUNK_B - 1) // CHUNK_B
    if BUG:   # negative control: the last chunk of every segment left out
        chunks = tl.maximum(chunks - 1, 0)
    total = n.to(tl.int64) * n_seg * chunks
    if DRY:
        if pid == 0:
            tl.store(n_ptr, n)
    it = tl.arange(0, NITEMS)
    for base in range(0, total, nprog * NITEMS):
        item = base + pid * NITEMS + it                                           # int64 [NITEMS]
        ok = item < total
        r = item // tl.maximum(n_seg * chunks, 1)                                 # expert rank
        rem = item - r * n_seg * chunks
        seg = rem // tl.maximum(chunks, 1)
        c = rem - seg * chunks
        hit = (present[None, :] != 0) & (rank[None, :] == r[:, None])             # [NITEMS, E_POW2]
        e = tl.sum(tl.where(hit, lanes[None, :], 0), axis=1).to(tl.int64)
        off = e * stride_e + seg * seg_stride + c * CHUNK_B
        size = tl.minimum(seg_b - c * CHUNK_B, CHUNK_B).to(tl.int32)
        if DRY:
            tl.store(off_ptr + item, off, mask=ok)
            tl.store(size_ptr + item, size, mask=ok)
        else:
            _bulk_prefetch_lanes(w_ptr + off, size, ok.to(tl.int32))


def max_items(n_ids: int, experts: int, inter: int, hidden: int, budget: int, chunk: int = CHUNK,
              k_first: bool = False) -> int:
    """An upper bound on the chunks ``expert_prefetch`` asks for (the size of ``dry``'s buffers)."""
    n = max(1, min(n_ids, experts))
    if k_first:   # m <= n experts' m * 2I segments of min(H, budget / (m 2I)) bytes: one partial chunk each
        return n * 2 * inter + budget // chunk + 1
    # n experts share the budget: at most budget / (2 H) rows in all, plus one partial chunk per range
    rows = min(n * inter, budget // (2 * hidden))
    return max(1, 2 * (-(-rows * hidden // chunk)) + 2 * n)


def expert_prefetch(ids: torch.Tensor, w13: torch.Tensor, budget: int, *, programs: int | None = None,
                    chunk: int = CHUNK, k_first: bool = False, dry: tuple | None = None, _bug: bool = False) -> None:
    """Ask L2 for ``budget`` bytes of the Gate/Up weights w13 [E, 2I, H] (E4M3, contiguous) of the
    distinct experts in ``ids`` (int32, any shape, contiguous; -1 entries ignored): see the module
    docstring. One launch of ``programs`` one-warp programs (default the SM count), no host
    synchronisation. ``chunk``: bytes per bulk prefetch (a multiple of 16). ``k_first``: the budget as the
    first columns of every row of each expert (every Gate/Up program's first K steps) instead of the
    first rows of its two halves (some programs' every step). ``dry`` = (offsets int64, sizes int32,
    n int32 [1]): store each chunk's byte offset into w13 and size instead (entries past the count are
    left as they were), and the count of distinct experts. ``_bug``: negative control (the last chunk of each range left out)."""
    check(ids.dtype == torch.int32 and ids.is_contiguous(), "ids: int32, contiguous")
    check(w13.dim() == 3 and w13.element_size() == 1 and w13.is_contiguous(), "w13: [E, 2I, H], one byte, contiguous")
    E, two_i, H = w13.shape
    check(two_i % 2 == 0 and H % 16 == 0, "w13: an even 2I and H a multiple of 16")
    check(ids.device == w13.device, "ids and w13 on one device")
    check(0 <= budget < 2 ** 40, "budget: bytes >= 0")
    check(chunk >= 16 and chunk % 16 == 0, "chunk: a multiple of 16 bytes")
    n_ids = ids.numel()
    check(1 <= n_ids <= 1024, "ids: 1 to 1024 entries")
    dev = w13.device
    if dry is None:
        check(compiled_cuda(dev), "expert_prefetch issues inline PTX: compiled CUDA only (dry= elsewhere)")
        off = size = n_out = ids            # unused pointers
    else:
        off, size, n_out = dry
        check(off.dtype == torch.int64 and size.dtype == torch.int32 and n_out.dtype == torch.int32
              and off.numel() == size.numel() >= max_items(n_ids, E, two_i // 2, H, budget, chunk, k_first),
              "dry: (offsets int64, sizes int32 of max_items entries, n int32)")
    grid = (int(programs or device_sm_count(dev)),)
    _expert_prefetch_kernel[grid](ids, w13, off, size, n_out, n_ids, int(budget), w13.stride(0), I=two_i // 2, H=H,
                                  E_POW2=max(16, next_pow2(E)), IDS_POW2=max(16, next_pow2(n_ids)), CHUNK_B=int(chunk),
                                  NITEMS=ITEMS, K_FIRST=bool(k_first), DRY=dry is not None, BUG=bool(_bug), num_warps=1)
