"""The tensor-parallel all-reduce fused into the residual add + RMSNorm that follows it
(DESIGN.md "Tensor parallel": the fused path, after NCCL).

Exchange (:class:`PeerExchange`)
--------------------------------
Every rank owns a buffer of ``K_SLOTS`` slots x ``rows`` x H (BF16), every element armed with NaN,
and a table of every rank's buffer address (its own included) that its kernels can load from: on
one GPU or over NVLink peer-to-peer (buffers opened through CUDA IPC; never multicast). A device
int32 ``state`` holds the exchange's sequence number (one per all-reduce point, the same on every
rank since every rank runs the same points in the same order; kept once per row), and the failure
record (bit q of its first word: a read of rank q's data stayed unready past the bound; its second:
the sequence number of the first such point plus one).

The kernel (``_peer_add_rmsnorm_kernel``, grid (T,), program = one row)
-----------------------------------------------------------------------
1. Waits for its predecessor (programmatic dependent launch), reads the sequence number n, slot
   s = n mod K.
2. Publishes its row of x (the rank's partial sum, BF16) into its own slot s: the store that
   overwrites the NaNs is the signal (no flag).
3. Loads every peer's row from the peer's slot s (volatile loads, all in flight together; its own
   row from registers) and sums the rows in FP32 in rank order. While any element is NaN (a peer has
   not published yet) it loads them all again, until the bound passes (``timeout_s``, the GPU's
   global timer; under the interpreter a number of polls; a NaN in any row makes its column's sum
   NaN, so one count covers every rank): then the bits of the unready ranks are
   set in the failure record and the kernel finishes with what it read (the host reports it:
   :meth:`PeerExchange.check`, never a hang). Every rank sums the same BF16 values in the same order
   and so gets the same bits; the sum is rounded to BF16 (what an all-reduce of BF16 tensors returns).
4. residual += sum; out = RMSNorm(residual) * weight (and out16), exactly as ``fused_add_rmsnorm``
   does with that sum as its x: the same bits as all-reduce-then-norm with a rank-order FP32 sum.
5. Re-arms its own slot (n - 2) mod K, every row of it, with NaN, and advances the sequence number
   (one counter per row of the exchange, each advanced by exactly one program: no atomics).

Why the re-arm is safe with no fence (K = 4, the re-arm two points back)
------------------------------------------------------------------------
Every ordering the exchange needs runs through kernel boundaries on both ranks: each rank's kernels
of successive points run in stream order, a kernel's work after its griddepcontrol.wait starts only
once the kernels before it have completed, and a completed kernel's stores to its GPU's memory are
visible to every later reader, a peer's included (the buffers live in the publishing rank's memory;
peers read them there).
- Nobody still needs the data a re-arm destroys. Rank r re-arms slot n - 2 in point n's kernel. That
  kernel runs after r's kernel of point n - 1, which read every peer's data of point n - 1; a peer
  published that in its kernel of point n - 1, which ran after its kernel of point n - 2 had read r's
  slot n - 2. (Re-arming slot n - 1 instead, ``rearm_lag=1``, orders the re-arm after a read of the
  same kernel: that needs a fence between them, ``fence="sys_acq"``.)
- Nobody reads stale data. A peer reads r's slot s = m mod K for point m only after it has read r's
  data of point m - 1, which r published in a kernel after the one that re-armed slot s (point m - 2,
  since m - K < m - 2). K >= lag + 2.

Kernels that all-reduce inside their own epilogue (the MoE reduce with the next norm,
``moe.fused_moe_fp8(peer=)``; the output projection with the residual add, ``linear.skinny_linear(peer=)``)
are points of the same sequence with the same steps (``_publish_gather``, ``_record``, ``_rearm``), each
program for its block of columns. The argument above holds for them unchanged (their reads and re-arms
sit in the point's kernel like this one's). Their programs share rows, so the sequence number is advanced
by the last of them to finish, which an arrival ticket names (acq_rel: every program's read of the number
precedes its ticket), not by each row's program.

The fences (``fence``, default "none"): "sys" / "gpu" put a fence.acq_rel (system / GPU scope) after
the gather and after the re-arm; "sys_acq" / "sys_rel" one of them; "sys_one" / "gpu_one" one thread
per program between barriers. With the re-arm two points back they order nothing that the kernel
boundaries above do not; they are measurement options (``experiments/ab_peer.py``, ``bench_step --ab
peer_fused_fence_*``).

A true NaN in a partial sum would look unpublished: it ends in the failure exit, reported as such.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import check, compiled_cuda, launch_signature, next_pow2, pdl_supported
from .norm import num_warps, resolve_weight_first, rms_scale

K_SLOTS = 4          # slots per rank's buffer (>= the re-arm's lag + 2, a power of two: see the module docstring)
PDL = True
TIMEOUT_S = 10.0     # the bound on one read of a peer's row (ranks' hosts may launch seconds apart)
INTERPRET_POLLS = 4  # the bound under the Triton interpreter (programs run one after another there)
# The state (int32): the sequence number once per row of the exchange (state[0:rows]: program p reads
# its own and advances p, p + T, ...: every counter once per point, with no atomics), then the failure
# record: state[rows + FAILED], state[rows + FAILED_AT].
FAILED, FAILED_AT = 0, 1
_FAILED, _FAILED_AT = tl.constexpr(FAILED), tl.constexpr(FAILED_AT)   # (in kernels)
# The fences around the exchange (keyword ``fence``): "none" (the re-arm two points back needs none),
# "sys" (fence.acq_rel.sys after the gather and after the re-arm), "gpu" (fence.acq_rel.gpu), or the
# forms below. See the module docstring.
FENCE = "none"
# name -> (the acquire fence's scope, the release fence's, one thread per program between barriers)
_FENCES = {"none": (0, 0, False), "gpu": (1, 1, False), "sys": (2, 2, False), "sys_acq": (2, 0, False),
           "sys_rel": (0, 2, False), "sys_one": (2, 2, True), "gpu_one": (1, 1, True)}
# The fast path's one reduction (keyword one_reduce): with every row ready, the sum of squares is the
# only reduction (an unready element makes it NaN; then the count of NaNs decides, as without it)
ONE_REDUCE = True
# The slot a point re-arms: its own slot of REARM_LAG points back (keyword rearm_lag; see the module docstring)
REARM_LAG = 2


class PeerTimeout(RuntimeError):
    """A rank's kernel read a peer's row that stayed unready past the bound (the peer never
    published it: it stopped, lags by more than the bound, or its partial sum held a NaN)."""


@triton.jit
def _fence(SCOPE: tl.constexpr, ONE: tl.constexpr = False):
    """fence.acq_rel at system scope (2: observers anywhere in the system, peer GPUs included) or GPU
    scope (1); nothing (0): this thread's earlier memory operations ordered before its later ones.
    ``ONE``: the program's threads meet at a barrier, one thread fences, and they meet again (the
    barrier orders every thread's accesses around the one fence: it is cumulative)."""
    if SCOPE > 0:
        if ONE:
            tl.debug_barrier()
            if SCOPE == 2:
                tl.inline_asm_elementwise("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                          "@p fence.acq_rel.sys; } mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                          "@p fence.acq_rel.gpu; } mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            tl.debug_barrier()
        elif SCOPE == 2:
            tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _base(PTRS, q):
    """Rank q's buffer (the buffers are 16-byte aligned allocations: the hint lets the loads be
    16-byte vectors)."""
    return tl.multiple_of(tl.load(PTRS + q).to(tl.pointer_type(tl.bfloat16)), 16)


@triton.jit
def _row(PTRS, q, off, offs, ok, x, RANK):
    """Rank q's row at element offset ``off`` of its buffer in FP32 (this rank's own: ``x``)."""
    v = tl.load(_base(PTRS, q) + off + offs, mask=ok & (q != RANK), other=0.0, volatile=True).to(tl.float32)
    return tl.where(q == RANK, x, v)


@triton.jit
def _sum_rows(PTRS, off, offs, ok, x, RANK, R: tl.constexpr):
    """The sum over ranks in rank order in FP32 of every rank's row. No branch between the peers'
    loads, so they are all in flight together."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for q in tl.static_range(R):
        acc += _row(PTRS, q, off, offs, ok, x, RANK)
    return acc


@triton.jit
def _gather(PTRS, off, offs, ok, x, RANK, R: tl.constexpr):
    """(``_sum_rows``, its NaN elements): a NaN anywhere (an unpublished element) makes its column's
    sum NaN, so one count covers every rank."""
    acc = _sum_rows(PTRS, off, offs, ok, x, RANK, R)
    return acc, tl.sum((acc != acc).to(tl.int32), 0)


@triton.jit
def _elapsed_ns(t0, NT: tl.constexpr):
    """Nanoseconds since ``t0`` by the GPU's global timer, the same value in every thread of the
    program (NT: its threads). Each thread reads the timer itself and the readings differ: a loop that
    each thread left by its own reading would leave some threads behind at the gather's barriers. The
    readings' maximum (one per thread, a reduction over the program) is one value for all."""
    now = tl.inline_asm_elementwise("{ .reg .b32 z; and.b32 z, $1, 0; mov.u64 $0, %globaltimer; }", "=l,r",
                                    [tl.arange(0, NT)], dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(now, 0) - t0


@triton.jit
def _poll(PTRS, off, offs, ok, x, RANK, R: tl.constexpr, acc, nan, timeout_ns, ON_GPU: tl.constexpr,
          MAX_POLLS: tl.constexpr, NT: tl.constexpr):
    """(acc, nan) of ``_gather`` once no element is NaN, or once the bound has passed (nan > 0 then).
    The program's layout of ``offs`` must hold each element in one thread only: a copy in a second
    thread could load another value than the one counted."""
    if nan > 0:   # a peer has not published yet: poll every rank's row again until the bound passes
        if ON_GPU:
            t0 = _elapsed_ns(0, NT)
        polls = 0
        late = 0
        while (nan > 0) & (late == 0):
            acc, nan = _gather(PTRS, off, offs, ok, x, RANK, R)
            polls += 1
            if ON_GPU:
                late = (_elapsed_ns(t0, NT) > timeout_ns).to(tl.int32)
            else:
                late = (polls >= MAX_POLLS).to(tl.int32)
    return acc, nan


@triton.jit
def _publish_gather(PTRS, own, off, offs, ok, y, RANK, R: tl.constexpr, timeout_ns, ON_GPU: tl.constexpr,
                    MAX_POLLS: tl.constexpr, NT: tl.constexpr, ACQ: tl.constexpr, FENCE_ONE: tl.constexpr):
    """A kernel's all-reduce of its block ``y`` (BF16, this rank's partial at ``offs``, slot offset ``off``)
    over the exchange: published into this rank's buffer ``own``, every rank's block gathered and summed in
    rank order in FP32 and polled until ready or the bound, then a fence form's acquire. Returns (the sum,
    its unready elements, y in FP32) for the failure record and the re-arm (``_record_and_rearm``)."""
    tl.store(own + off + offs, y, mask=ok)     # publish
    yf = y.to(tl.float32)
    acc, nan = _gather(PTRS, off, offs, ok, yf, RANK, R)
    acc, nan = _poll(PTRS, off, offs, ok, yf, RANK, R, acc, nan, timeout_ns, ON_GPU, MAX_POLLS, NT)
    if ON_GPU:
        _fence(ACQ, FENCE_ONE)
    return acc, nan, yf


@triton.jit
def _residual(acc, res, ADD: tl.constexpr, dtype: tl.constexpr):
    """(the residual as stored: res + the all-reduced x, or that x alone without ADD; its sum of
    squares in FP32). The sum is rounded to BF16 first, as a BF16 all-reduce returns it."""
    xs = acc.to(tl.bfloat16).to(tl.float32)
    if ADD:
        r = (res.to(tl.float32) + xs).to(dtype)
    else:   # the residual stream starts here (the embedding): r = the sum
        r = xs.to(dtype)
    rf = r.to(tl.float32)
    return r, tl.sum(rf * rf, 0)


@triton.jit
def _unready(PTRS, off, offs, ok, x, RANK, R: tl.constexpr):
    """Bit mask of the ranks whose row still holds a NaN (the failure record; the rare path)."""
    missing = RANK * 0
    for q in tl.static_range(R):
        v = _row(PTRS, q, off, offs, ok, x, RANK)
        missing = missing | tl.where(tl.sum((v != v).to(tl.int32), 0) > 0, 1 << q, 0)
    return missing


@triton.jit
def _record(PTRS, STATE, nan, seq, off, offs, ok, x, RANK, R: tl.constexpr, ROWS: tl.constexpr):
    """After a gather that ended with ``nan`` unready elements: the failure record (which ranks, and
    the first point plus one) if any."""
    if nan > 0:
        tl.atomic_or(STATE + ROWS + _FAILED, _unready(PTRS, off, offs, ok, x, RANK, R))
        tl.atomic_cas(STATE + ROWS + _FAILED_AT, 0, seq + 1)


@triton.jit
def _rearm(own, seq, cols, ok, row, T, ROWS: tl.constexpr, H: tl.constexpr, K: tl.constexpr, LAG: tl.constexpr):
    """Slot seq - LAG of this rank's buffer re-armed (NaN) at the columns ``cols`` of rows row, row + T, ...
    (every row: the pass of that point may have had more rows than this one)."""
    arm = tl.full(cols.shape, float("nan"), tl.float32).to(tl.bfloat16)
    prev = (seq + K - LAG) & (K - 1)
    for rr in range(row, ROWS, T):
        tl.store(own + (prev * ROWS + rr) * H + cols, arm, mask=ok)


@triton.jit
def _record_and_rearm(PTRS, STATE, own, nan, seq, off, offs, ok, x, RANK, R: tl.constexpr, row, T, ROWS: tl.constexpr,
                      H: tl.constexpr, K: tl.constexpr, LAG: tl.constexpr, NO_REARM: tl.constexpr):
    """``_record``, then (unless NO_REARM) ``_rearm`` at ``offs`` (a row's columns) for rows row, row + T, ..."""
    _record(PTRS, STATE, nan, seq, off, offs, ok, x, RANK, R, ROWS)
    if not NO_REARM:
        _rearm(own, seq, offs, ok, row, T, ROWS, H, K, LAG)


# (T and RANK not specialized: one binary for every rank and row count. A first launch of another
# specialization would load a module, which waits for the device to idle: behind a spinning kernel
# of another rank in the same process, a stall until the bound)
@triton.jit(launch_metadata=launch_signature, do_not_specialize=["T", "RANK"])
def _peer_add_rmsnorm_kernel(X, RES, WT, OUT, OUT16, PTRS, STATE, T, RANK, stride_x, stride_r, stride_o, stride_o16,
                             eps, timeout_ns, H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                             K: tl.constexpr, R: tl.constexpr, HAS16: tl.constexpr, PDL: tl.constexpr,
                             WEIGHT_FIRST: tl.constexpr, ON_GPU: tl.constexpr, MAX_POLLS: tl.constexpr,
                             NO_REARM: tl.constexpr, ADD: tl.constexpr = True, NORM: tl.constexpr = True,
                             ACQ: tl.constexpr = 0, REL: tl.constexpr = 0, FENCE_ONE: tl.constexpr = False,
                             ONE_REDUCE: tl.constexpr = True, SEQ_FIRST: tl.constexpr = False,
                             LAG: tl.constexpr = 2, NT: tl.constexpr = 512):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    if WEIGHT_FIRST and NORM:   # a weight: no predecessor writes it (held in its dtype across the gather)
        wt = tl.load(WT + offs, mask=ok, other=0.0)
    own = _base(PTRS, RANK)     # (the table is written once, at the exchange's construction)
    if SEQ_FIRST:   # measurement only: safe only while the previous point's kernel is sure to be complete
        seq = tl.load(STATE + row, volatile=True)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()   # x (the predecessor's output) and the state of the previous point are final
    if not SEQ_FIRST:
        seq = tl.load(STATE + row, volatile=True)     # (loaded together with x and the residual)
    x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
    res_ptr = RES + row * stride_r + offs
    res = x
    if ADD:
        res = tl.load(res_ptr, mask=ok, other=0.0)   # (held in its own dtype across the gather)
    off = ((seq & (K - 1)) * ROWS + row) * H     # this row in slot seq mod K, in every rank's buffer
    tl.store(own + off + offs, x, mask=ok)     # publish
    xf = x.to(tl.float32)
    if ONE_REDUCE and NORM:   # an unready element makes the sum of squares NaN: one reduction when all are ready
        nan = RANK * 0
        acc = _sum_rows(PTRS, off, offs, ok, xf, RANK, R)
        r, ss = _residual(acc, res, ADD, RES.dtype.element_ty)
        if ss != ss:   # a NaN: a peer's row not yet published (or a NaN in the data; the count tells)
            acc, nan = _gather(PTRS, off, offs, ok, xf, RANK, R)
            acc, nan = _poll(PTRS, off, offs, ok, xf, RANK, R, acc, nan, timeout_ns, ON_GPU, MAX_POLLS, NT)
            r, ss = _residual(acc, res, ADD, RES.dtype.element_ty)
    else:
        acc, nan = _gather(PTRS, off, offs, ok, xf, RANK, R)
        acc, nan = _poll(PTRS, off, offs, ok, xf, RANK, R, acc, nan, timeout_ns, ON_GPU, MAX_POLLS, NT)
        r, ss = _residual(acc, res, ADD, RES.dtype.element_ty)
    if ON_GPU:
        _fence(ACQ, FENCE_ONE)   # (a fence form's acquire: the gather before the re-arm)
    tl.store(res_ptr, r, mask=ok)
    if NORM:
        if not WEIGHT_FIRST:
            wt = tl.load(WT + offs, mask=ok, other=0.0)
        y = rms_scale(r.to(tl.float32), ss, wt.to(tl.float32), H, eps)
        o = y.to(OUT.dtype.element_ty)
        tl.store(OUT + row * stride_o + offs, o, mask=ok)
        if HAS16:
            tl.store(OUT16 + row * stride_o16 + offs, o.to(tl.float32).to(tl.float16), mask=ok)
    _record_and_rearm(PTRS, STATE, own, nan, seq, off, offs, ok, xf, RANK, R, row, T, ROWS, H, K, LAG, NO_REARM)
    for rr in range(row, ROWS, T):   # every row's sequence number advanced: this program's rows, row + T, ...
        tl.store(STATE + rr, seq + 1)
    if ON_GPU:
        _fence(REL, FENCE_ONE)   # (a fence form's release: the re-arm before what this rank publishes later)


class PeerExchange:
    """One rank's side of the exchange: its NaN-armed buffer ``own`` [K_SLOTS, rows, width] BF16,
    every rank's buffer (``buffers``, by rank, its own included; a peer's opened through CUDA IPC or
    shared within one process), their addresses on the device (``ptrs``), and the device ``state``.
    Build it with :meth:`group` (every rank in one process: the tests), :meth:`emulated` (rank
    emulation) or ``TorchDistComm.peer_exchange`` (real ranks); it holds no global state.
    ``static_peers``: the peers' buffers are never armed (rank emulation: their rows read as zeros at
    once, so the kernel does the loads a real rank does without waiting)."""

    def __init__(self, buffers: list[torch.Tensor], rank: int, timeout_s: float = TIMEOUT_S,
                 static_peers: bool = False, keep=()):
        own = buffers[rank]
        check(own.dim() == 3 and own.shape[0] == K_SLOTS and own.dtype == torch.bfloat16 and own.is_contiguous(),
              f"a rank's buffer: [{K_SLOTS}, rows, width] BF16, contiguous")
        check(all(b.shape == own.shape and b.dtype == own.dtype and b.is_contiguous() for b in buffers),
              "every rank's buffer of one shape")
        check(timeout_s > 0, "timeout_s > 0")
        self.buffers, self.rank, self.size = list(buffers), int(rank), len(buffers)
        self.own, self.rows, self.width = own, own.shape[1], own.shape[2]
        self.timeout_s, self.static_peers, self._keep = float(timeout_s), bool(static_peers), keep
        dev = own.device
        self.ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev)
        self.state = torch.zeros(self.rows + 8, dtype=torch.int32, device=dev)
        own.fill_(float("nan"))

    @staticmethod
    def new_buffer(rows: int, width: int, device) -> torch.Tensor:
        return torch.full((K_SLOTS, rows, width), float("nan"), dtype=torch.bfloat16, device=device)

    @classmethod
    def group(cls, size: int, rows: int, width: int, device, timeout_s: float = TIMEOUT_S) -> list["PeerExchange"]:
        """Every rank's side, in one process on one device (the tests: ranks launched on separate
        streams, or their peers' rows staged by hand)."""
        bufs = [cls.new_buffer(rows, width, device) for _ in range(size)]
        return [cls(bufs, r, timeout_s) for r in range(size)]

    @classmethod
    def emulated(cls, size: int, rank: int, rows: int, width: int, device,
                 timeout_s: float = TIMEOUT_S) -> "PeerExchange":
        """Rank emulation: one rank's buffer; every peer's is one shared zero buffer (static)."""
        zero = torch.zeros(K_SLOTS, rows, width, dtype=torch.bfloat16, device=device)
        bufs = [zero] * size
        bufs[rank] = cls.new_buffer(rows, width, device)
        return cls(bufs, rank, timeout_s, static_peers=True)

    def failure(self) -> str | None:
        """None, or what failed (reads the device state: a host synchronisation)."""
        failed, at = (int(v) for v in self.state[self.rows + FAILED:self.rows + FAILED_AT + 1].tolist())
        if not failed:
            return None
        peers = [q for q in range(self.size) if failed >> q & 1]
        return (f"rank {self.rank}: the fused all-reduce's read of rank(s) {peers} stayed unready past "
                f"its bound ({self.timeout_s:g} s on the GPU) at exchange point {at - 1} (a peer stopped, lags by more than the "
                "bound, or published a NaN); the exchange is inconsistent from there: rebuild the engine")

    def check(self) -> None:
        """Raises :class:`PeerTimeout` if any read failed since the exchange was built."""
        why = self.failure()
        if why:
            raise PeerTimeout(why)

    def reset(self) -> None:
        """Re-arms this rank's buffer and zeroes its state (every rank must do it, with no kernel of
        the exchange in flight anywhere: e.g. between a barrier and the next one)."""
        self.own.fill_(float("nan"))
        self.state.zero_()


def exchange_launch(xchg: PeerExchange, device, fence=None, rearm_lag=None, max_polls=None,
                    _no_rearm=False) -> tuple[tuple, dict]:
    """The exchange's launch arguments for a kernel that all-reduces over it (this module's, the MoE
    reduce's): (PTRS, STATE, RANK, timeout_ns) and its constexprs (ROWS, K, R, ON_GPU, MAX_POLLS, LAG,
    ACQ, REL, FENCE_ONE, NO_REARM). See ``peer_add_rmsnorm`` for the keywords."""
    check((FENCE if fence is None else fence) in _FENCES, f"fence: one of {sorted(_FENCES)}")
    lag = REARM_LAG if rearm_lag is None else int(rearm_lag)
    check(1 <= lag <= K_SLOTS - 2, f"rearm_lag: 1 to {K_SLOTS - 2}")
    acq, rel, one = _FENCES[FENCE if fence is None else fence]
    return ((xchg.ptrs, xchg.state, xchg.rank, int(xchg.timeout_s * 1e9)),
            dict(ROWS=xchg.rows, K=K_SLOTS, R=xchg.size, ON_GPU=compiled_cuda(device),
                 MAX_POLLS=int(INTERPRET_POLLS if max_polls is None else max_polls), LAG=lag, ACQ=acq, REL=rel,
                 FENCE_ONE=one, NO_REARM=bool(_no_rearm)))


def peer_add_rmsnorm(x, residual, weight, eps, xchg: PeerExchange, out=None, *, out16=None, add=True, norm=True,
                     pdl=None, weight_first=None, fence=None, one_reduce=None, rearm_lag=None, max_polls=None,
                     _no_rearm=False, _seq_first=False):
    """residual += all-reduce(x) over the exchange's ranks; out = RMSNorm(residual) * weight (BF16),
    ``out16`` as ``fused_add_rmsnorm``'s. x [T, H] BF16: this rank's partial sum (T <= the
    exchange's rows, H its width). One launch; see the module docstring. ``add=False``: residual =
    all-reduce(x) (not read: a residual stream's start). ``norm=False``: no norm (weight, out and
    out16 unused; returns residual). ``fence``: the fences' scope (default FENCE; see _FENCES).
    ``one_reduce``: default ONE_REDUCE. ``rearm_lag``: the slot re-armed at point n is n - lag's
    (default REARM_LAG; 1 <= lag <= K_SLOTS - 2). ``_seq_first``: the sequence number read before the wait
    (measurement only: correct only while the previous point's kernel is sure to be complete). ``max_polls``: the
    interpreter's bound (default INTERPRET_POLLS). ``_no_rearm``: the tests' negative control (slots
    never re-armed: a lagging peer's stale row is read as its new one)."""
    check(x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1, "x [T, H] BF16, contiguous rows")
    xargs, xconst = exchange_launch(xchg, x.device, fence, rearm_lag, max_polls, _no_rearm)
    T, H = x.shape
    check(residual.shape == x.shape and residual.stride(1) == 1, "residual [T, H]")
    if not norm:
        weight, out, out16 = residual[0], residual, None    # (not read or written)
    check(weight.shape == (H,) and weight.stride(0) == 1, "weight [H]")
    check(H == xchg.width and 1 <= T <= xchg.rows, f"x [T <= {xchg.rows}, {xchg.width}] (the exchange's shape)")
    check(x.device == residual.device == weight.device == xchg.own.device, "one device")
    if out is None:
        out = torch.empty((T, H), device=x.device, dtype=torch.bfloat16)
    check(out.shape == (T, H) and out.stride(1) == 1, "out [T, H]")
    has16 = out16 is not None
    if has16:
        check(out16.shape == (T, H) and out16.stride(1) == 1 and out16.dtype == torch.float16, "out16 [T, H] FP16")
    block_h = next_pow2(H)
    check(block_h <= 32768, "H <= 32768")
    use_pdl = pdl_supported(x.device) and (PDL if pdl is None else bool(pdl))
    ptrs, state, rank, timeout_ns = xargs
    _peer_add_rmsnorm_kernel[(T,)](
        x, residual, weight, out, out16 if has16 else out, ptrs, state, T, rank,
        x.stride(0), residual.stride(0), out.stride(0), out16.stride(0) if has16 else 0, float(eps), timeout_ns,
        H=H, BLOCK_H=block_h, HAS16=has16, PDL=use_pdl, WEIGHT_FIRST=resolve_weight_first(weight_first) and bool(norm),
        ADD=bool(add), NORM=bool(norm), **xconst,
        ONE_REDUCE=ONE_REDUCE if one_reduce is None else bool(one_reduce), SEQ_FIRST=bool(_seq_first),
        num_warps=num_warps(block_h), NT=32 * num_warps(block_h),   # fused_add_rmsnorm's warps (the same bits)
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out if norm else residual


def peer_add_rmsnorm_reference(parts: list[torch.Tensor], residual):
    """The kernel's contract in torch: (residual_out, the all-reduced BF16 x) of the ranks' partial
    sums ``parts`` (BF16, in rank order) summed in FP32 in that order, then rounded."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc += p.float()
    xs = acc.to(torch.bfloat16)
    return (residual.float() + xs.float()).to(residual.dtype), xs
