"""The pre-MoE add + RMSNorm without a launch of its own (``FastModel.fuse_router_norm``).

``skinny_linear(residual=(res, ssq))``: the output projection adds its result to the residual in its
epilogue, with the add + norm kernel's two roundings (y to BF16, res + y to BF16), and writes each
row's sum of squares per column block. ``route_topk(norm=(res, ssq, weight, eps, out, out16))``: the
router sums those in block order, normalises its slices of res with the norm kernel's arithmetic
(``norm.rms_scale``), writes h (BF16) and h16 (FP16), and routes h.

Checked on fresh random inputs with poisoned outputs, at the q1 rank's output projection (768 ->
6144, E = 128) and q1-mini-like shapes, one and several K slices (the last arriver's epilogue):
- the residual is bit-identical to ``fused_add_rmsnorm``'s after the plain projection, and ssq
  matches FP64 sums of squares of that residual; negative control ``_resid_bug`` (sums over y);
- h is within one BF16 rounding of the FP64 RMSNorm, h16 is h exactly, and the routing satisfies
  the router's own contract on h (``test_router``'s check); against the norm kernel, h differs in
  at most a few last bits; negative control ``_norm_bug`` (the last block left out of the sum);
- the two kernels captured in one CUDA graph, replayed with new inputs, stay right (GPU).
"""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels
from .test_router import _check_against_reference

Q1 = dict(K=768, H=6144, E=128)
MINI = dict(K=128, H=256, E=32)
WIDE = dict(K=128, H=1024, E=32)   # with split_h = 2: 512-column slices, the batched product's 4 chunks
EPS = 1e-6
# |h - RMSNorm_FP64| / |RMSNorm_FP64| per element: one BF16 ulp (the interpreter truncates where the
# GPU rounds to nearest)
H_TOL = 2.0 ** -7


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _inputs(shape, T, seed):
    g = torch.Generator().manual_seed(seed)
    K, H, E = shape["K"], shape["H"], shape["E"]
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    wo = (torch.randn(H, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    res = torch.randn(T, H, generator=g).to(torch.bfloat16)
    nw = (1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16)
    rw = (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    return [t.to(_dev()) for t in (x, wo, res, nw, rw)]


def _project(L, x, wo, res, tiling, bug=False):
    """(res after the fused add, ssq (poisoned first), the residual the apart form gives, block_n)."""
    T, H = res.shape
    bn, sk = tiling or L.plan(H, x.shape[1], L.device_sm_count(x.device))
    y = L.skinny_linear(x, wo, block_n=bn, split_k=sk)
    want = res.clone()
    load_kernels("norm").fused_add_rmsnorm(y, want, torch.ones_like(res[0]), EPS, torch.empty_like(res))
    r = res.clone()
    ssq = torch.full((T, H // bn), float("nan"), dtype=torch.float32, device=x.device)
    out = L.skinny_linear(x, wo, block_n=bn, split_k=sk, residual=(r, ssq), _resid_bug=bug)
    assert out is r
    return r, ssq, want, bn


def _ssq_err(r, ssq, bn):
    ref = r.double().view(r.shape[0], -1, bn).pow(2).sum(-1)
    return ((ssq.double() - ref).abs() / ref).max().item()


def _check_projection(L, shape, T, tiling, seed):
    x, wo, res, _, _ = _inputs(shape, T, seed)
    r, ssq, want, bn = _project(L, x, wo, res, tiling)
    assert torch.equal(r, want)
    assert _ssq_err(r, ssq, bn) < 1e-5
    r_bad, ssq_bad, _, _ = _project(L, x, wo, res, tiling, bug=True)
    assert torch.equal(r_bad, want)            # the control breaks only the sums
    assert _ssq_err(r_bad, ssq_bad, bn) > 1e-2


def _route_norm(R, r, ssq, nw, rw, bug=False, with16=True, split_h=None):
    T, H = r.shape
    h = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=r.device)
    h16 = torch.full((T, H), float("nan"), dtype=torch.float16, device=r.device) if with16 else None
    ids = torch.full((T, 8), -1, dtype=torch.int32, device=r.device)
    wts = torch.full((T, 8), float("nan"), dtype=torch.float32, device=r.device)
    R.route_topk(None, rw, 8, ids=ids, weights=wts, norm=(r, ssq, nw, EPS, h, h16), _poison=True, _norm_bug=bug,
                 split_h=split_h)
    return h, h16, ids, wts


def _h_err(r, nw, h):
    rd = r.double()
    ref = rd * torch.rsqrt(rd.pow(2).mean(1, keepdim=True) + EPS) * nw.double()
    return ((h.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()


def _check_router(L, R, N, shape, T, seed, with16=True, split_h=None):
    x, wo, res, nw, rw = _inputs(shape, T, seed)
    r, ssq, _, _ = _project(L, x, wo, res, None)
    h, h16, ids, wts = _route_norm(R, r, ssq, nw, rw, with16=with16, split_h=split_h)
    assert _h_err(r, nw, h) < H_TOL
    if with16:
        assert torch.equal(h16, h.to(torch.float16))
    _check_against_reference(R, h, rw, ids, wts)   # the router's own contract, on the h it wrote
    # against the norm kernel on the same residual (zero x: its add changes nothing): the same values
    # but where the other order of the sum of squares moves a rounding
    h_apart = torch.empty_like(h)
    N.fused_add_rmsnorm(torch.zeros_like(r), r.clone(), nw, EPS, h_apart)
    diff = (h.float() - h_apart.float()).abs()
    assert bool((diff <= h_apart.float().abs() * 2.0 ** -7).all())
    assert (diff > 0).float().mean().item() < 0.05
    # negative control, a block's sum of squares left out (at q1 1/96 of the sum: h 0.5 % off): most
    # of h moves off the norm kernel's values
    h_bad, _, _, _ = _route_norm(R, r, ssq, nw, rw, bug=True, with16=with16, split_h=split_h)
    assert (h_bad != h_apart).float().mean().item() > 0.25


def graph_replays(L, calls, x, wo, r, poisoned, ids):
    """Captures ``calls`` (eager once first) in a CUDA graph, then for 3 new q1 inputs copied into x and
    r, with ``poisoned`` filled with NaN and ids with -1, replays it and yields the residual the
    projection must leave in r (res + x @ wo^T, rounded as the fused add rounds it)."""
    calls()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    for seed in range(3):
        x2, _, res2, _, _ = _inputs(Q1, 6, 100 + seed)
        x.copy_(x2)
        r.copy_(res2)
        want = (res2.float() + L.skinny_linear(x2, wo).float()).to(torch.bfloat16)
        for t in poisoned:
            t.fill_(float("nan"))
        ids.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        yield want


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 6, 8])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
@pytest.mark.parametrize("tiling", [None, (64, 1), (64, 2)], ids=["plan", "one_slice", "split_k"])
def test_gpu_projection_residual(shape, T, tiling):
    _check_projection(load_kernels("linear"), shape, T, tiling, seed=T)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 6, 8])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
@pytest.mark.parametrize("weights_first", [True, False])
def test_gpu_router_norm(shape, T, weights_first, monkeypatch):
    R = load_kernels("router")
    monkeypatch.setattr(R, "WEIGHTS_FIRST", weights_first)
    _check_router(load_kernels("linear"), R, load_kernels("norm"), shape, T, seed=10 + T, with16=T != 4)


@pytest.mark.gpu
def test_gpu_graph_replays():
    """Projection (residual=) + router (norm=) captured in one graph: replays with new x and residual
    give the same results as eager calls, and the arrival counter stays zero."""
    L, R = load_kernels("linear"), load_kernels("router")
    x, wo, res, nw, rw = _inputs(Q1, 6, 3)
    nb = L.ssq_blocks(Q1["H"], Q1["K"], x.device)
    r = res.clone()
    ssq = torch.empty(6, nb, dtype=torch.float32, device="cuda")
    h = torch.empty_like(r)
    h16 = torch.empty(r.shape, dtype=torch.float16, device="cuda")
    ids = torch.empty(6, 8, dtype=torch.int32, device="cuda")
    wts = torch.empty(6, 8, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    lcnt = torch.zeros(Q1["H"] // 16, dtype=torch.int32, device="cuda")

    def calls():
        L.skinny_linear(x, wo, counter=lcnt, residual=(r, ssq))
        R.route_topk(None, rw, 8, counter=cnt, ids=ids, weights=wts, norm=(r, ssq, nw, EPS, h, h16))

    for want in graph_replays(L, calls, x, wo, r, (h, h16, ssq), ids):
        assert int(cnt.item()) == 0 and int(lcnt.abs().sum().item()) == 0
        assert torch.equal(r, want)
        assert _h_err(r, nw, h) < H_TOL and torch.equal(h16, h.to(torch.float16))
        _check_against_reference(R, h, rw, ids, wts)


# ------------------------------------------------------------------------------ CPU interpreter
@cpu_only
@pytest.mark.parametrize("tiling", [None, (32, 2)], ids=["plan", "split_k"])
def test_interp_projection_residual(tiling):
    _check_projection(load_kernels("linear"), MINI, 5, tiling, seed=7)


@cpu_only
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("shape,split_h", [(MINI, None), (WIDE, 2)], ids=["mini", "wide_slices"])
def test_interp_router_norm(T, shape, split_h):
    _check_router(load_kernels("linear"), load_kernels("router"), load_kernels("norm"), shape, T, seed=20 + T,
                  with16=T == 6, split_h=split_h)


@cpu_only
def test_interp_argument_checks():
    L, R = load_kernels("linear"), load_kernels("router")
    x, wo, res, nw, rw = _inputs(MINI, 4, 1)
    bn, _ = L.plan(MINI["H"], MINI["K"], L.device_sm_count(x.device))
    with pytest.raises(ValueError):   # ssq of the wrong width
        L.skinny_linear(x, wo, residual=(res, torch.empty(4, 3)))
    with pytest.raises(ValueError):   # one epilogue at a time
        L.skinny_linear(x, wo, partials=True, residual=(res, torch.empty(4, MINI["H"] // bn)))
    with pytest.raises(ValueError):   # out must be BF16
        R.route_topk(None, rw, 8, norm=(res, torch.zeros(4, 2), nw, EPS, torch.empty(4, MINI["H"]), None))
