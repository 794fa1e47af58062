"""Split-KV decode attention (full cache and sliding ring) against an FP64 reference.

Every case draws fresh random non-zero inputs, poisons the output with NaN, poisons every cache
slot the kernel must not read (capacity past the valid extent; ring slots outside every row's
window) with NaN, and checks the max over (row, head) of the relative error. Negative controls: the
sink omitted, and a ring of R = window slots (the verification's own writes evict keys that earlier
rows still need) must fail the same check.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

from ._checks import captured, first_catch, max_row_rel_err
from .conftest import HAS_CUDA, cpu_only, load_kernels

TOL = 2e-2  # BF16 P and BF16 output: ~3e-3 typical (5e-3 in the interpreter, which truncates)

Q1 = dict(nh=6, nkv=1, d=128, window=4096)
MINI = dict(nh=6, nkv=1, d=64, window=512)
VARIANTS = ["v1", "fused", "v2"]


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _sinks(nh, n_visible, gen, dev):
    # Around log(#keys) so that the sink takes a visible share of the softmax mass.
    return (torch.randn(nh, generator=gen) + math.log(max(n_visible, 1))).to(dev)


def make_full(w, nh, nkv, d, start, seed, extra=96):
    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    cap = start + w + extra
    q = torch.randn(w, nh, d, generator=g).to(torch.bfloat16).to(dev)
    k = torch.randn(nkv, cap, d, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(nkv, cap, d, generator=g).to(torch.bfloat16).to(dev)
    k[:, start + w:] = float("nan")  # preallocated capacity: never read
    v[:, start + w:] = float("nan")
    sinks = _sinks(nh, start + w, g, dev)
    return q, k, v, sinks


def make_ring(w, nh, nkv, d, start, window, slots, seed):
    """Logical history (by position) and the ring written in position order (slot = p % slots)."""
    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    L = start + w
    lo = max(0, start - window + 1)
    q = torch.randn(w, nh, d, generator=g).to(torch.bfloat16).to(dev)
    hk = torch.full((nkv, L, d), float("nan"), dtype=torch.bfloat16, device=dev)
    hv = torch.full((nkv, L, d), float("nan"), dtype=torch.bfloat16, device=dev)
    first = max(0, L - slots)  # oldest position still in the ring
    h0 = min(first, lo)  # history the reference needs (and what the ring holds)
    hk[:, h0:] = torch.randn(nkv, L - h0, d, generator=g).to(torch.bfloat16).to(dev)
    hv[:, h0:] = torch.randn(nkv, L - h0, d, generator=g).to(torch.bfloat16).to(dev)
    kr = torch.full((nkv, slots, d), float("nan"), dtype=torch.bfloat16, device=dev)
    vr = torch.full((nkv, slots, d), float("nan"), dtype=torch.bfloat16, device=dev)
    pos = torch.arange(first, L, device=dev)
    kr[:, pos % slots] = hk[:, pos]
    vr[:, pos % slots] = hv[:, pos]
    if slots >= window + w - 1:
        old = torch.arange(first, lo, device=dev)  # still in the ring but outside every window
        kr[:, old % slots] = float("nan")
        vr[:, old % slots] = float("nan")
    sinks = _sinks(nh, min(window, L), g, dev)
    return q, hk, hv, kr, vr, sinks


def _start(start, dev, as_int64=False):
    return torch.tensor([start] if as_int64 else start, dtype=torch.int64 if as_int64 else torch.int32,
                        device=dev)


def run_full(A, shape, w, start, seed, num_splits=None, sinks_override=None, **kw):
    """kw: variant=, workspace=, _drop_last= (passed to the launcher)."""
    q, k, v, sinks = make_full(w, shape["nh"], shape["nkv"], shape["d"], start, seed)
    out = torch.full_like(q, float("nan"))
    use = sinks if sinks_override is None else sinks_override
    A._launch(q, k, v, _start(start, q.device, seed % 2 == 0), use, out, ring=False, window=0,
              num_splits=num_splits, **kw)
    ref = A.attention_reference(q, k, v, start, sinks)
    return max_row_rel_err(out, ref)


def run_ring(A, shape, w, start, seed, slots=None, num_splits=None, **kw):
    window = shape["window"]
    slots = window + 64 if slots is None else slots
    q, hk, hv, kr, vr, sinks = make_ring(w, shape["nh"], shape["nkv"], shape["d"], start, window,
                                         slots, seed)
    out = torch.full_like(q, float("nan"))
    A._launch(q, kr, vr, _start(start, q.device, seed % 2 == 1), sinks, out, ring=True,
              window=window, num_splits=num_splits, validate=slots >= window + w - 1, **kw)
    ref = A.attention_reference(q, hk, hv, start, sinks, window=window)
    return max_row_rel_err(out, ref)


# ----------------------------------------------------------------------------------------- GPU
def _split_edges(A):
    """Context lengths just below / at / above the split boundaries of the default grid."""
    s = A.SPLITS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    edge = A.BLOCK_N * s  # one block per split exactly
    return [edge - 1, edge, edge + 1, 2 * edge + 1]


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("ctx", [0, 1, 63, 64, 65, 4096, 65536, 196608])
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_q1(w, ctx, variant):
    A = load_kernels("attention")
    start = max(0, ctx - w)
    assert run_full(A, Q1, w, start, seed=ctx * 10 + w, variant=variant) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 6, 8])
@pytest.mark.parametrize("ctx", [1, 65, 4096, 65536, 196608])
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_full_and_ring_q1_pdl(w, ctx, variant):
    """The combine launched as a programmatic dependent (griddepcontrol) reads complete partials."""
    A = load_kernels("attention")
    assert run_full(A, Q1, w, ctx - w if ctx > w else 0, seed=ctx + w, variant=variant, pdl=True) < TOL
    assert run_ring(A, Q1, w, ctx + 5000, seed=ctx + w + 1, variant=variant, pdl=True) < TOL


V2_OPTIONS = [dict(tma=True), dict(tail_prefetch=False), dict(combine_one_load=False),
              dict(combine_num_warps=4), dict(tma=True, num_stages=5, combine_num_warps=8),
              dict(kv_first=1), dict(kv_first=3), dict(kv_first=0), dict(ml_by_row=False),
              dict(partials="bfloat16")]


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 6, 8])
@pytest.mark.parametrize("ctx", [1, 65, 4096, 65536 + 3, 196608])
@pytest.mark.parametrize("opts", V2_OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_full_and_ring_q1_v2_options(w, ctx, opts):
    """v2's options (TMA tiles, L2 prefetch of the boundary blocks, the two-round-trip combine) at
    the q1 shard, full and ring; the sinkless negative control must fail the same bound."""
    A = load_kernels("attention")
    start = ctx - w if ctx > w else 0
    assert run_full(A, Q1, w, start, seed=ctx + 7 * w, variant="v2", **opts) < TOL
    assert run_ring(A, Q1, w, ctx + 5000, seed=ctx + w + 3, variant="v2", **opts) < TOL
    no_sink = torch.full((Q1["nh"],), float("-inf"), device="cuda")
    assert run_full(A, Q1, w, start, seed=ctx + 7 * w, variant="v2", sinks_override=no_sink, **opts) > TOL


@pytest.mark.gpu
@pytest.mark.parametrize("edge", range(4))
@pytest.mark.parametrize("opts", V2_OPTIONS[:2] + V2_OPTIONS[5:7],
                         ids=["tma", "no_tail_prefetch", "kv_first1", "kv_first3"])
def test_v2_options_split_boundaries(edge, opts):
    A = load_kernels("attention")
    ctx = _split_edges(A)[edge]
    assert run_full(A, Q1, 8, ctx - 8, seed=edge + 40, variant="v2", **opts) < TOL


def _pdl_case_error(A, no_wait):
    """Worst error over six replays (new start_pos each) of v2 with PDL in one CUDA graph; no_wait:
    the combine skips griddepcontrol.wait (``_pdl_no_wait``)."""
    w = 8
    q, k, v, sinks = make_full(w, 6, 1, 128, 196608, seed=11)
    sp = torch.zeros((), dtype=torch.int32, device="cuda")
    kw = dict(ring=False, window=0, variant="v2", pdl=True, num_splits=64, _pdl_no_wait=no_wait)
    out = torch.empty_like(q)
    g = captured(lambda: A._launch(q, k, v, sp, sinks, out, **kw))
    worst = 0.0
    for start in (196608 - w, 1000, 150000, 5, 196608 - w, 90000):
        sp.fill_(start)
        out.fill_(float("nan"))
        g.replay()
        ref = A.attention_reference(q, k, v, start, sinks)
        worst = max(worst, max_row_rel_err(out, ref))
    return worst


@pytest.mark.gpu
def test_pdl_without_the_wait_is_caught():
    """Negative control of the PDL tests: v2's combine is launched early (the splits release their
    dependent at their start) and must wait for the partials; one that skips griddepcontrol.wait
    (``_pdl_no_wait``) merges the previous replay's partials. In a CUDA graph the launches are back
    to back (eagerly, the first call of a variant compiles it and the race never happens); 64 splits
    leave SMs free for the early combine programs. The race is caught in one of ``RACE_ATTEMPTS``."""
    A = load_kernels("attention")
    assert _pdl_case_error(A, False) < TOL
    assert first_catch(lambda: _pdl_case_error(A, True) > TOL)


@triton.jit
def _late_rows_writer(NEW_K, NEW_V, K, V, START, W, R, SPIN_NS, D: tl.constexpr):
    """What rope_kv_write does, late: releases its programmatic dependent at its start, spins SPIN_NS
    of the global timer, then writes the W new K/V rows (positions start_pos + i, slots mod R)."""
    gdc_launch_dependents()
    t0 = globaltimer()
    t = globaltimer()
    while t - t0 < SPIN_NS:
        t = globaltimer()
    rows = tl.arange(0, 8)
    ok = rows < W
    slot = ((tl.load(START) + rows) % R).to(tl.int64)
    offs_d = tl.arange(0, D)
    src = rows[:, None] * D + offs_d[None, :]
    dst = slot[:, None] * D + offs_d[None, :]
    tl.store(K + dst, tl.load(NEW_K + src, mask=ok[:, None], other=0.0), mask=ok[:, None])
    tl.store(V + dst, tl.load(NEW_V + src, mask=ok[:, None], other=0.0), mask=ok[:, None])


def _late_rows_error(A, ring, bug):
    """Max relative error of a call launched (PDL) behind ``_late_rows_writer`` in one CUDA graph, with
    kv_before_wait: the new rows dominate the softmax (keys along each row's query, large values) and
    the cache first holds stale rows at their slots. 8K full cache / 4K ring at start 100000: every
    split has one key block."""
    w, d, window = 8, Q1["d"], Q1["window"]
    if ring:
        start = 100000
        q, hk, hv, k, v, sinks = make_ring(w, Q1["nh"], 1, d, start, window, window + 64, seed=21)
    else:
        start = 8192 - w
        q, k, v, sinks = make_full(w, Q1["nh"], 1, d, start, seed=21)
        hk, hv = k, v
    g = torch.Generator().manual_seed(22)
    new_k = (q[:, 0].float() * 4).to(torch.bfloat16).contiguous()           # large logits for row i's head 0
    new_v = (torch.randn(w, d, generator=g) * 8).to(torch.bfloat16).cuda()
    R = k.shape[1]
    slots = (start + torch.arange(w, device="cuda")) % R
    k[0, slots] = (torch.randn(w, d, generator=g) * 0.01).to(torch.bfloat16).cuda()   # stale rows
    v[0, slots] = torch.zeros(w, d, dtype=torch.bfloat16, device="cuda")
    hk, hv = hk.clone(), hv.clone()
    hk[0, start:start + w] = new_k
    hv[0, start:start + w] = new_v
    sp = torch.tensor(start, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    k0, v0 = k.clone(), v.clone()
    kw = dict(ring=ring, window=window if ring else 0, variant="v2", pdl=True, num_splits=None,
              kv_before_wait=True, _early_bug=bug)
    A._launch(q, k, v, sp, sinks, out, **kw)   # compile outside the capture
    torch.cuda.synchronize()
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        _late_rows_writer[(1,)](new_k, new_v, k, v, sp, w, R, 20000, D=d)
        A._launch(q, k, v, sp, sinks, out, **kw)
    worst = 0.0
    for _ in range(3):
        k.copy_(k0)
        v.copy_(v0)
        out.fill_(float("nan"))
        g_.replay()
        torch.cuda.synchronize()
        ref = A.attention_reference(q, hk, hv, start, sinks, window=window if ring else None)
        worst = max(worst, max_row_rel_err(out, ref))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("ring", [False, True], ids=["full8K", "ring4K"])
def test_kv_before_wait_reads_new_rows_after_the_wait(ring):
    """kv_before_wait reads only blocks wholly below start_pos before the wait: behind a predecessor
    that writes the new rows 20 us after releasing the call, the result is right; the negative
    control (``_early_bug``: the block holding the new rows read early too) reads the stale rows."""
    A = load_kernels("attention")
    assert _late_rows_error(A, ring, bug=False) < TOL
    assert first_catch(lambda: _late_rows_error(A, ring, bug=True) > TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 8])
@pytest.mark.parametrize("edge", range(4))
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_split_boundaries(w, edge, variant):
    A = load_kernels("attention")
    L = _split_edges(A)[edge]
    assert run_full(A, Q1, w, L - w, seed=L + w, variant=variant) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7, 500])
@pytest.mark.parametrize("variant", VARIANTS)
def test_full_other_split_counts(num_splits, variant):
    A = load_kernels("attention")
    assert run_full(A, Q1, 8, 20000, seed=num_splits, num_splits=num_splits, variant=variant) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 6, 8])
@pytest.mark.parametrize("start", [0, 5, 4090, 4095, 4096, 4159, 4160, 4161, 3 * 4160 + 17, 200003])
@pytest.mark.parametrize("variant", VARIANTS)
def test_ring_q1(w, start, variant):
    A = load_kernels("attention")
    assert run_ring(A, Q1, w, start, seed=start * 10 + w, variant=variant) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 8])
@pytest.mark.parametrize("start", [0, 300, 511, 575, 576, 1300, 70001])
@pytest.mark.parametrize("variant", VARIANTS)
def test_mini(w, start, variant):
    A = load_kernels("attention")
    assert run_full(A, MINI, w, start, seed=start + w, variant=variant) < TOL
    assert run_ring(A, MINI, w, start, seed=start + w + 1, variant=variant) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("cd,cs", [(32, 256), (64, 64), (64, 256), (128, 16)])
@pytest.mark.parametrize("w,ctx", [(4, 1), (6, 65536), (8, 196608), (5, 4096 * 3 + 17)])
def test_full_q1_combine_tiles(cd, cs, w, ctx):
    """v1 combine with other head-dim slices / splits per load (incl. all splits at once)."""
    A = load_kernels("attention")
    kw = dict(variant="v1", combine_block_d=cd, combine_block_s=cs)
    assert run_full(A, Q1, w, ctx, seed=ctx + w + cd, **kw) < TOL
    assert run_ring(A, Q1, w, ctx + 4160, seed=ctx + w + cs, **kw) < TOL
    no_sink = torch.full((Q1["nh"],), float("-inf"), device="cuda")
    assert run_full(A, Q1, w, ctx + 5000, seed=1, sinks_override=no_sink, **kw) > TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_negative_controls(shape, variant):
    A = load_kernels("attention")
    nh = shape["nh"]
    no_sink = torch.full((nh,), float("-inf"), device="cuda")
    assert run_full(A, shape, 8, 5000, seed=1, sinks_override=no_sink, variant=variant) > TOL
    assert run_ring(A, shape, 8, 3 * shape["window"] + 5, seed=2, slots=shape["window"],
                    variant=variant) > TOL
    if variant == "fused":  # the merge skips the last active split
        assert run_full(A, shape, 8, 20000, seed=3, variant=variant, _drop_last=True) > TOL


@pytest.mark.gpu
def test_fused_counter_reset_and_repeat():
    """Two fused calls in a row (eager) give identical outputs and leave the counters at zero."""
    A = load_kernels("attention")
    ws = torch.zeros(2, dtype=torch.int32, device="cuda")
    q, k, v, sinks = make_full(8, 6, 1, 128, 70000, seed=5)
    sp = _start(70000, q.device)
    o1 = A.decode_attention_full(q, k, v, sp, sinks, variant="fused", workspace=ws)
    torch.cuda.synchronize()
    assert ws.tolist() == [0, 0]
    o2 = A.decode_attention_full(q, k, v, sp, sinks, variant="fused", workspace=ws)
    torch.cuda.synchronize()
    assert ws.tolist() == [0, 0]
    assert torch.equal(o1, o2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,pdl", [(v, False) for v in VARIANTS] + [("v1", True), ("v2", True)])
def test_graph_capture_replays_with_new_positions(variant, pdl):
    """Captured once; start_pos changed on the device; replays read the new extent. The graph holds
    two calls of each kind (fused: consecutive calls share one counter buffer; pdl: the combine
    kernels are programmatic dependents, captured as programmatic edges)."""
    A = load_kernels("attention")
    kw = dict(variant=variant, pdl=pdl)
    w, d = 8, 128
    q, k, v, sinks = make_full(w, 6, 1, d, 70000, seed=3)
    kr = k[:, :4160].contiguous()
    vr = v[:, :4160].contiguous()
    sp = torch.zeros((), dtype=torch.int32, device="cuda")
    out_f = torch.empty_like(q)
    out_r = torch.empty_like(q)
    out_f2 = torch.empty_like(q)
    out_r2 = torch.empty_like(q)
    A.decode_attention_full(q, k, v, sp, sinks, out_f, **kw)  # compile outside capture
    A.decode_attention_ring(q, kr, vr, sp, sinks, 4096, out_r, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.decode_attention_full(q, k, v, sp, sinks, out_f, **kw)
        A.decode_attention_ring(q, kr, vr, sp, sinks, 4096, out_r, **kw)
        A.decode_attention_full(q, k, v, sp, sinks, out_f2, **kw)
        A.decode_attention_ring(q, kr, vr, sp, sinks, 4096, out_r2, **kw)
    for start in (0, 1000, 69999 - w, 70000, 70000):
        sp.fill_(start)
        for o in (out_f, out_r, out_f2, out_r2):
            o.fill_(float("nan"))
        g.replay()
        ref_f = A.attention_reference(q, k, v, start, sinks)
        ref_r = A.attention_reference(q, kr, vr, start, sinks, window=4096, ring=True)
        for o, ref in ((out_f, ref_f), (out_f2, ref_f), (out_r, ref_r), (out_r2, ref_r)):
            assert max_row_rel_err(o, ref) < TOL


# ------------------------------------------------------------------------------ CPU interpreter
@cpu_only
@pytest.mark.parametrize("w,start,splits", [(8, 0, 3), (5, 700, 3), (8, 64 * 3 * 2 - 8, 3),
                                            (6, 64 * 3 * 2 - 5, 3)])
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_interp_full_mini(w, start, splits, variant):
    A = load_kernels("attention")
    assert run_full(A, MINI, w, start, seed=start + w, num_splits=splits, variant=variant) < TOL


@cpu_only
@pytest.mark.parametrize("w,start", [(8, 1300), (4, 3), (7, 575)])
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_interp_ring_mini(w, start, variant):
    A = load_kernels("attention")
    assert run_ring(A, MINI, w, start, seed=start + w, num_splits=3, variant=variant) < TOL


@cpu_only
@pytest.mark.parametrize("min_block_m", [16, 32])
def test_interp_small_row_tiles(min_block_m):
    """The packed-row tile below the default 64 rows (w * G = 24 rows at w = 4: 32 rows, or 24
    padded to 32 from a 16 minimum); with the sinkless negative control."""
    A = load_kernels("attention")
    kw = dict(num_splits=3, min_block_m=min_block_m)
    assert run_full(A, MINI, 4, 700, seed=min_block_m, **kw) < TOL
    assert run_ring(A, MINI, 4, 1300, seed=min_block_m + 1, **kw) < TOL
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    assert run_full(A, MINI, 4, 700, seed=min_block_m, sinks_override=no_sink, **kw) > TOL


@cpu_only
@pytest.mark.parametrize("w,start", [(8, 700), (5, 64 * 4 - 2)])
def test_interp_v2_mid_bug_is_caught(w, start):
    """v2's unmasked loop must stop below the causal boundary: letting it run to the range's end
    (``_mid_bug``) leaks future keys into the earlier rows and must fail the bound."""
    A = load_kernels("attention")
    assert run_full(A, MINI, w, start, seed=start, num_splits=2, variant="v2") < TOL
    assert run_full(A, MINI, w, start, seed=start, num_splits=2, variant="v2", _mid_bug=True) > TOL


@cpu_only
@pytest.mark.parametrize("opts", [dict(tma=True), dict(combine_one_load=False), dict(combine_num_warps=8),
                                  dict(kv_first=1), dict(kv_first=4), dict(kv_first=0),
                                  dict(kv_first=4, kv_before_wait=True), dict(kv_first=4, kv_before_wait=False),
                                  dict(ml_by_row=False), dict(partials="bfloat16")],
                         ids=["tma", "two_loads", "combine_8warps", "kv_first1", "kv_first4", "kv_first0",
                              "kv_before_wait", "kv_after_wait", "ml_by_split", "bf16_partials"])
def test_interp_v2_options(opts):
    """TMA tiles (the interpreter runs descriptor loads), the two-round-trip combine, the short
    splits' K/V-before-Q path (kv_first 4: every split of these shapes takes it; 1: none of the full
    shape's; 0: off) and its first block split into a load before the wait and one after
    (kv_before_wait; the interpreter has no wait, so only the values are checked), full and ring,
    with the sinkless negative control."""
    A = load_kernels("attention")
    kw = dict(num_splits=3, variant="v2", **opts)
    assert run_full(A, MINI, 8, 700, seed=3, **kw) < TOL
    assert run_ring(A, MINI, 6, 1300, seed=4, **kw) < TOL
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    assert run_full(A, MINI, 8, 700, seed=3, sinks_override=no_sink, **kw) > TOL


def _ml_by_row_same_bits(A, shape, dev, seed, cases=((False, 900), (False, 40), (True, 1300))):
    """The v2 call's output with the partials' m / l stored by row, against the layout by split: the
    same bits (full and ring, several splits, short and long ranges), right against the reference; the
    negative control, the combine reading the by-row buffer in the other layout, is far off."""
    common = dict(num_splits=5, variant="v2")
    for ring, start in cases:
        if ring:
            q, hk, hv, k, v, sinks = make_ring(6, shape["nh"], shape["nkv"], shape["d"], start, shape["window"],
                                                shape["window"] + 64, seed)
        else:
            q, k, v, sinks = make_full(6, shape["nh"], shape["nkv"], shape["d"], start, seed)
        outs = []
        for kw in (dict(ml_by_row=False), dict(ml_by_row=True), dict(ml_by_row=True, _ml_bug=True)):
            out = torch.full_like(q, float("nan"))
            A._launch(q, k, v, _start(start, dev), sinks, out, ring=ring, window=shape["window"] if ring else 0,
                      **common, **kw)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        ref = (A.attention_reference(q, hk, hv, start, sinks, window=shape["window"]) if ring
               else A.attention_reference(q, k, v, start, sinks))
        assert max_row_rel_err(outs[1], ref) < TOL
        assert not torch.allclose(outs[0].float(), outs[2].float(), rtol=0.1, atol=0.1, equal_nan=False)


def _bf16_partials_case(A, shape, dev, seed, starts=(900, 40), ring_start=1300, num_splits=5):
    """The v2 call with BF16 partials (acc / l) against FP32 ones, full and ring, both combine forms:
    right against the reference and at most 2^-7 further from it (relative: one BF16 rounding of each
    split's output, truncated in the interpreter, which need not cancel against the output's own; the
    interpreter measured up to 0.0055 more at start 40); negative control: the combine merging them as if un-normalised
    (``_partials_bug``) is far off."""
    for ring, start in [(False, s) for s in starts] + [(True, ring_start)]:
        if ring:
            q, hk, hv, k, v, sinks = make_ring(6, shape["nh"], shape["nkv"], shape["d"], start, shape["window"],
                                                shape["window"] + 64, seed)
            ref = A.attention_reference(q, hk, hv, start, sinks, window=shape["window"])
        else:
            q, k, v, sinks = make_full(6, shape["nh"], shape["nkv"], shape["d"], start, seed)
            ref = A.attention_reference(q, k, v, start, sinks)
        for one_load in (True, False):
            errs = {}
            for name, kw in (("fp32", {}), ("bf16", dict(partials="bfloat16")),
                             ("bug", dict(partials="bfloat16", _partials_bug=True))):
                out = torch.full_like(q, float("nan"))
                A._launch(q, k, v, _start(start, dev), sinks, out, ring=ring, window=shape["window"] if ring else 0,
                          num_splits=num_splits, variant="v2", combine_one_load=one_load, **kw)
                errs[name] = max_row_rel_err(out, ref)
            assert errs["bf16"] < TOL and errs["bf16"] < errs["fp32"] + 2.0 ** -7, (ring, start, errs)
            assert errs["bug"] > TOL, (ring, start, errs)


@pytest.mark.gpu
def test_bf16_partials_q1():
    _bf16_partials_case(load_kernels("attention"), Q1, "cuda", seed=14, starts=(65536 + 3, 40, 196608 - 6),
                        ring_start=70000, num_splits=None)


@cpu_only
def test_interp_bf16_partials():
    _bf16_partials_case(load_kernels("attention"), MINI, "cpu", seed=15)


@pytest.mark.gpu
def test_ml_by_row_same_bits_q1():
    _ml_by_row_same_bits(load_kernels("attention"), Q1, "cuda", seed=11)


@cpu_only
def test_interp_ml_by_row_same_bits():
    _ml_by_row_same_bits(load_kernels("attention"), MINI, "cpu", seed=12)
    # two KV heads (3 query heads each): the per-head offset of the by-row layout
    _ml_by_row_same_bits(load_kernels("attention"), dict(MINI, nkv=2), "cpu", seed=13, cases=((False, 900),))


@cpu_only
def test_interp_measurement_flags_skip_their_part():
    """``_launch``'s measurement-only flags (experiments/ab_attention.py's no_store / empty_merge) skip
    exactly their part: with ``_no_combine`` the split stores its partials (the combine run on them
    afterwards gives the right output) and ``out`` is never written; with ``_no_store`` the split leaves
    the partial buffers as they were (NaN here) while the call's shapes and launches are the default's."""
    A = load_kernels("attention")
    w, start = 6, 700
    q, k, v, sinks = make_full(w, MINI["nh"], MINI["nkv"], MINI["d"], start, seed=21)
    sp = _start(start, q.device)
    ref = A.attention_reference(q, k, v, start, sinks)
    bufs = {}
    real_empty = torch.empty

    def nan_empty(*a, **kw):   # the partial buffers _launch allocates, poisoned and kept
        t = real_empty(*a, **kw)
        if t.dtype == torch.float32:
            t.fill_(float("nan"))
            bufs.setdefault("acc" if t.dim() == 4 and "acc" not in bufs else "ml", t)
        return t
    for no_store, no_combine in ((False, True), (True, True), (True, False)):
        bufs.clear()
        out = torch.full_like(q, float("nan"))
        torch.empty = nan_empty
        try:
            A._launch(q, k, v, sp, sinks, out, ring=False, window=0, num_splits=3, variant="v2",
                      _no_store=no_store, _no_combine=no_combine)
        finally:
            torch.empty = real_empty
        acc, ml = bufs["acc"], bufs["ml"]
        assert torch.isnan(acc).all() == no_store and torch.isnan(ml).all() == no_store
        if no_combine:
            assert torch.isnan(out).all()
        else:
            assert torch.isnan(out).all() or max_row_rel_err(out, ref) > TOL   # merged NaN partials
        if not no_store:   # the stored partials are the default's: the combine on them is right
            A._combine(acc, ml, sinks, out, sp, w=w, ring=False, window=0, block_n=A.BLOCK_N, pdl=False,
                       ml_by_row=A.ML_BY_ROW)
            assert max_row_rel_err(out, ref) < TOL


@cpu_only
@pytest.mark.parametrize("block_n,num_stages", [(32, 2), (16, 3)])
def test_interp_public_block_options(block_n, num_stages):
    """decode_attention_full / _ring pass the split's block_n and num_stages through (the runtime's
    attention_options, bench_step's attn_bn* variants): with 32 / 16 keys per block the same mini
    calls use two / four times as many blocks, several per split; the sinkless control is rejected."""
    A = load_kernels("attention")
    w, start = 6, 700
    q, k, v, sinks = make_full(w, MINI["nh"], MINI["nkv"], MINI["d"], start, seed=5)
    kw = dict(num_splits=3, block_n=block_n, num_stages=num_stages)
    out = A.decode_attention_full(q, k, v, _start(start, q.device), sinks, **kw)
    assert max_row_rel_err(out, A.attention_reference(q, k, v, start, sinks)) < TOL
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    out = A.decode_attention_full(q, k, v, _start(start, q.device), no_sink, **kw)
    assert max_row_rel_err(out, A.attention_reference(q, k, v, start, sinks)) > TOL
    window = MINI["window"]
    q, hk, hv, kr, vr, sinks = make_ring(w, MINI["nh"], MINI["nkv"], MINI["d"], 1300, window, window + 64, seed=6)
    out = A.decode_attention_ring(q, kr, vr, _start(1300, q.device), sinks, window, **kw)
    assert max_row_rel_err(out, A.attention_reference(q, hk, hv, 1300, sinks, window=window)) < TOL


@cpu_only
@pytest.mark.parametrize("cd,cs", [(64, 16), (16, 64)])
def test_interp_combine_tiles(cd, cs):
    A = load_kernels("attention")
    kw = dict(num_splits=5, combine_block_d=cd, combine_block_s=cs)
    assert run_full(A, MINI, 6, 900, seed=cd + cs, **kw) < TOL
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    assert run_full(A, MINI, 6, 900, seed=cd + cs, sinks_override=no_sink, **kw) > TOL


@cpu_only
def test_interp_negative_controls():
    A = load_kernels("attention")
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    assert run_full(A, MINI, 8, 300, seed=1, num_splits=3, sinks_override=no_sink) > TOL
    assert run_ring(A, MINI, 8, 1300, seed=2, slots=MINI["window"], num_splits=3) > TOL


# Fused variant (one launch, arrival counter). The interpreter runs programs one after another in
# grid order (splits before combine programs), so the wait loop never spins here: it checks the
# arithmetic, the counting (a combine that waited for too few splits or merged too few fails) and
# the counter reset, not the GPU memory ordering (the GPU tests and graph test do).
@cpu_only
@pytest.mark.parametrize("w,start,splits", [(4, 0, 3), (5, 700, 3), (8, 64 * 3 * 2 - 8, 3),
                                            (6, 64 * 3 * 2 - 5, 3), (7, 64 * 3 + 1 - 7, 3),
                                            (8, 1000, 5)])
def test_interp_fused_full_mini(w, start, splits):
    A = load_kernels("attention")
    ws = torch.zeros(2, dtype=torch.int32)
    assert run_full(A, MINI, w, start, seed=start + w, num_splits=splits, variant="fused",
                    workspace=ws) < TOL
    assert ws.tolist() == [0, 0]


@cpu_only
@pytest.mark.parametrize("w,start", [(8, 1300), (4, 3), (6, 575)])
def test_interp_fused_ring_mini(w, start):
    A = load_kernels("attention")
    ws = torch.zeros(2, dtype=torch.int32)
    assert run_ring(A, MINI, w, start, seed=start + w, num_splits=3, variant="fused",
                    workspace=ws) < TOL
    assert ws.tolist() == [0, 0]


@cpu_only
@pytest.mark.parametrize("splits,combine_block_d", [(300, None), (5, 64)])
def test_interp_fused_many_splits_and_wide_combine(splits, combine_block_d):
    """300 active splits: two chunks of 256 in the combine (online merge across chunks);
    combine_block_d = 64: one combine program per packed row at d = 64."""
    A = load_kernels("attention")
    start = 64 * splits - 8 if splits > 16 else 900
    assert run_full(A, MINI, 8, start, seed=splits, num_splits=splits, variant="fused",
                    combine_block_d=combine_block_d) < TOL


@cpu_only
def test_interp_fused_gqa_two_kv_heads():
    """nkv = 2: per-KV-head counters (arrival [0, 1], done [2, 3])."""
    A = load_kernels("attention")
    ws = torch.zeros(4, dtype=torch.int32)
    shape = dict(nh=4, nkv=2, d=32, window=64)
    assert run_full(A, shape, 8, 400, seed=9, num_splits=3, variant="fused", workspace=ws) < TOL
    assert ws.tolist() == [0, 0, 0, 0]


@cpu_only
def test_interp_fused_repeat_and_default_counters():
    """Twice in a row with the cached counter buffer: identical outputs, counters back at zero."""
    A = load_kernels("attention")
    q, k, v, sinks = make_full(8, 6, 1, 64, 700, seed=4)
    sp = _start(700, q.device)
    o1 = A.decode_attention_full(q, k, v, sp, sinks, num_splits=3, variant="fused")
    o2 = A.decode_attention_full(q, k, v, sp, sinks, num_splits=3, variant="fused")
    assert torch.equal(o1, o2)
    assert max_row_rel_err(o1, A.attention_reference(q, k, v, 700, sinks)) < TOL
    assert A._fused_counters(q.device, 1, None).eq(0).all()


@cpu_only
def test_interp_fused_negative_controls():
    A = load_kernels("attention")
    no_sink = torch.full((MINI["nh"],), float("-inf"))
    assert run_full(A, MINI, 8, 300, seed=1, num_splits=3, sinks_override=no_sink,
                    variant="fused") > TOL
    assert run_ring(A, MINI, 8, 1300, seed=2, slots=MINI["window"], num_splits=3,
                    variant="fused") > TOL
    # Combine that skips the last active split (3 splits active at 700 + 8 keys).
    assert run_full(A, MINI, 8, 700, seed=3, num_splits=3, variant="fused", _drop_last=True) > TOL
