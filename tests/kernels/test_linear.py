"""The skinny linear layer (decode projections) against FP64.

On fresh random non-zero inputs with poisoned outputs and partials: y = x @ w^T within the BF16
rounding of y (plus FP32 summation noise), at the q1 rank's Q/K/V (6144 -> 1024) and output
(768 -> 6144) projections and q1-mini shapes, 1-16 rows, one and several K slices. The counters are
left at zero (CUDA-graph replays give the same y for new x). Negative control: every K slice's first
step skipped (``_drop_bug``) must fail the same bound. With PDL, the weight prefetch before the wait
cannot hand out stale x: a graph whose predecessor rewrites x matches the reference every replay.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

from ._checks import captured, first_catch
from .conftest import HAS_CUDA, cpu_only, load_kernels

# (K, N): the q1 rank's fused Q/K/V and output projections; q1-mini-like shapes for the interpreter
Q1_SHAPES = [(6144, 1024), (768, 6144)]
MINI_SHAPES = [(256, 512), (384, 256)]
TOL = 8e-3    # |y - ref| / max|ref|: BF16 output rounding (2^-9 relative) plus FP32 sums


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _inputs(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    return x.to(_dev()), w.to(_dev())


def _err(L, x, w, **kw):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=torch.bfloat16, device=x.device)
    y = L.skinny_linear(x, w, out, _poison=True, **kw)
    assert y is out
    ref = L.linear_reference(x, w)
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def _check(L, M, K, N, seed, **kw):
    x, w = _inputs(M, K, N, seed)
    e = _err(L, x, w, **kw)
    assert e < TOL, (M, K, N, kw, e)
    eb = _err(L, x, w, _drop_bug=True, **kw)
    assert eb > TOL, (M, K, N, kw, eb)       # the negative control fails the same bound


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 6, 8, 16])
@pytest.mark.parametrize("K,N", Q1_SHAPES + MINI_SHAPES)
def test_q1_and_mini_shapes_default_plan(M, K, N):
    _check(load_kernels("linear"), M, K, N, seed=M * 7 + N)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 6, 8])
@pytest.mark.parametrize("K,N", Q1_SHAPES)
@pytest.mark.parametrize("block_n,split_k", [(None, None), (32, 4), (64, 1), (16, 16)])
@pytest.mark.parametrize("weights_a", [True, False])
def test_q1_operand_orders(M, K, N, block_n, split_k, weights_a):
    """Both operand orders (weights_a: the weight tile as the MMA's A operand times x^T, the default
    up to 8 rows; False: x as A) against FP64 with the negative control, at the default plan and
    other tilings."""
    if (block_n and N % block_n) or (split_k and K % split_k):
        pytest.skip("tiling does not divide the shape")
    _check(load_kernels("linear"), M, K, N, seed=M + K, weights_a=weights_a, block_n=block_n, split_k=split_k)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,split_k", [(16, 1), (32, 4), (64, 3), (128, 6), (16, 16)])
@pytest.mark.parametrize("pdl", [True, False])
def test_q1_qkv_tilings(block_n, split_k, pdl):
    _check(load_kernels("linear"), 6, 6144, 1024, seed=block_n + split_k, block_n=block_n, split_k=split_k,
           pdl=pdl, prefetch=pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", Q1_SHAPES)
@pytest.mark.parametrize("kw", [dict(num_stages=3), dict(num_stages=4), dict(num_stages=8), dict(num_warps=2),
                                dict(num_warps=8), dict(block_k=64), dict(block_k=32, num_stages=12)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_q1_pipeline_options(K, N, kw):
    """Pipeline depth, warps and K per step (the step benchmark's variants) against FP64, each with the
    negative control; depth and warps leave the same products in the same order: y bit for bit."""
    L = load_kernels("linear")
    _check(L, 6, K, N, seed=K + len(kw), **kw)
    if "block_k" not in kw:
        x, w = _inputs(6, K, N, 3)
        assert torch.equal(L.skinny_linear(x, w, **kw), L.skinny_linear(x, w))


@pytest.mark.gpu
def test_graph_replays_leave_the_counters_at_zero():
    """A captured call (split K, PDL) replayed with new x each time: y matches, counters stay zero."""
    L = load_kernels("linear")
    x, w = _inputs(6, 6144, 1024, 3)
    cnt = torch.zeros(1024 // 32, dtype=torch.int32, device="cuda")
    out = torch.empty(6, 1024, dtype=torch.bfloat16, device="cuda")
    g = captured(lambda: L.skinny_linear(x, w, out, block_n=32, split_k=4, counter=cnt))
    for seed in range(4):
        x.copy_(_inputs(6, 6144, 1024, 100 + seed)[0])
        out.fill_(float("nan"))
        g.replay()
        ref = L.linear_reference(x, w)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < TOL
        assert int(cnt.abs().sum()) == 0


def _linear_behind(L, writer, no_wait):
    """Worst error over four replays (new x0 each) of ``writer(x0, h)`` (a kernel that writes the linear
    layer's input h and releases its programmatic dependents), then the linear layer on h (prefetching
    its weight before its wait), in one CUDA graph; no_wait: the linear layer skips the wait
    (``_no_wait``). An unwritten (NaN) output counts as inf."""
    K, N = 6144, 1024
    x0, w = _inputs(6, K, N, 5)
    h = x0.clone()
    out = torch.empty(6, N, dtype=torch.bfloat16, device="cuda")
    cnt = torch.zeros(N // 16, dtype=torch.int32, device="cuda")

    def run():
        writer(x0, h)
        L.skinny_linear(h, w, out, counter=cnt, prefetch=True, _no_wait=no_wait)
    g = captured(run)
    worst = 0.0
    for seed in range(4):
        x0.copy_(_inputs(6, K, N, 200 + seed)[0])
        out.fill_(float("nan"))
        g.replay()
        ref = L.linear_reference(h, w)
        e = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, e if e == e else float("inf"))
    return worst


def _norm_then_linear_error(L, Nm, no_wait):
    """``_linear_behind`` a Triton add + RMSNorm (6 rows) that writes h from x0."""
    res = torch.zeros(6, 6144, dtype=torch.bfloat16, device="cuda")
    wt = torch.ones(6144, dtype=torch.bfloat16, device="cuda")

    def norm(x0, h):
        res.zero_()
        Nm.fused_add_rmsnorm(x0, res, wt, 1e-6, out=h, pdl=True)
    return _linear_behind(L, norm, no_wait)


@triton.jit
def _late_copy(SRC, DST, N, SPIN_NS, BLOCK: tl.constexpr):
    """A predecessor that releases its programmatic dependents at its start, spins SPIN_NS of the
    global timer, then copies N elements SRC -> DST (one program)."""
    gdc_launch_dependents()
    t0 = globaltimer()
    t = globaltimer()
    while t - t0 < SPIN_NS:
        t = globaltimer()
    for i in range(0, N, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(DST + offs, tl.load(SRC + offs, mask=offs < N), mask=offs < N)


def _late_x_linear_error(L, no_wait):
    """``_linear_behind`` ``_late_copy``, which writes h = x0 20 us after releasing the linear layer:
    without the wait the layer reads the previous replay's h."""
    return _linear_behind(L, lambda x0, h: _late_copy[(1,)](x0, h, x0.numel(), 20000, BLOCK=4096), no_wait)


@pytest.mark.gpu
@pytest.mark.parametrize("no_wait", [False, True])
def test_pdl_prefetch_never_reads_a_stale_x(no_wait):
    """In a graph, a Triton norm that writes x (and releases its dependents at its start) precedes the
    linear layer (a programmatic dependent, here prefetching its weight before its wait): y is the
    reference's of the new x in every replay; so behind a predecessor that writes x 20 us after
    releasing it. Negative control: the same launch without the wait behind that late writer reads
    the previous replay's x, and the same comparison catches it (in one of ``RACE_ATTEMPTS``). Behind
    the norm itself, the broken launch usually reads x after the norm has written it (session 37's
    experiments/probe_races.py, one process: caught in 0 of 18 attempts), so it is no control."""
    L = load_kernels("linear")
    if no_wait:
        assert first_catch(lambda: _late_x_linear_error(L, True) > TOL)
    else:
        assert _norm_then_linear_error(L, load_kernels("norm"), False) < TOL
        assert _late_x_linear_error(L, False) < TOL


def test_plan_and_argument_checks():
    L = load_kernels("linear")
    assert L.plan(1024, 6144, 132) == (32, 4)
    assert L.plan(6144, 768, 132) == (64, 1)
    # the consumer sums the partials (rope_kv_write(qkv_parts=)): q1's Q/K/V in 64 x 8 (at most
    # PARTIALS_MAX_SPLIT slices; the byte count alone would take 128 x 16), q1-mini's stays unsplit
    assert L.plan(1024, 6144, 132, partials=True) == (64, 8)
    assert L.plan(512, 256, 132, partials=True) == L.plan(512, 256, 132) == (16, 1)
    x, w = _inputs(4, 256, 512, 1)
    with pytest.raises(ValueError):
        L.skinny_linear(x.float(), w)
    with pytest.raises(ValueError):
        L.skinny_linear(x, w, block_n=48)
    for bk in (48, 256):
        with pytest.raises(ValueError):
            L.skinny_linear(x, w, block_k=bk)
    with pytest.raises(ValueError):
        L.skinny_linear(torch.cat([x] * 5), w)       # 20 rows
    with pytest.raises(ValueError):
        L.skinny_linear(torch.cat([x] * 3), w, weights_a=True)   # 12 rows: the weights-A form takes 8


@cpu_only
@pytest.mark.parametrize("K,N", MINI_SHAPES)
@pytest.mark.parametrize("tiling", ["plan", "one_slice", "every_step_a_slice", "x_a"])
def test_interp_mini_shapes(K, N, tiling):
    L = load_kernels("linear")
    kw = {"plan": {}, "one_slice": dict(block_n=32, split_k=1),
          "every_step_a_slice": dict(block_n=16, split_k=K // L.BLOCK_K),
          "x_a": dict(weights_a=False, block_n=32, split_k=2)}[tiling]
    _check(L, 5, K, N, seed=K + N, **kw)


@cpu_only
def test_interp_planned_partials_tiling(monkeypatch):
    """With ``partials`` and no tiling given, skinny_linear on a 132-SM device runs the q1 Q/K/V
    projection as 64 columns x 8 slices in K steps of PARTIALS_BLOCK_K: its partials equal, bit for
    bit, those of that tiling given explicitly, and (negative control) differ from the same tiling in
    K steps of 128 (another FP32 summation order in the interpreter)."""
    L = load_kernels("linear")
    monkeypatch.setattr(L, "device_sm_count", lambda device: 132)
    x, w = _inputs(6, 6144, 1024, 11)
    planned = L.skinny_linear(x, w, partials=True)
    assert planned.shape[0] == 8
    assert torch.equal(planned, L.skinny_linear(x, w, block_n=64, split_k=8, block_k=L.PARTIALS_BLOCK_K,
                                                partials=True))
    assert not torch.equal(planned, L.skinny_linear(x, w, block_n=64, split_k=8, block_k=128, partials=True))
