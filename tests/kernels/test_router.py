"""The one-launch MoE router against ``Model.route``'s arithmetic (FP32 logits of the BF16 input).

On fresh random inputs with poisoned outputs: the chosen experts are the reference's except at near
ties (two logits closer than the summation-order difference), and then both choices are among the
top k of the FP64 logits up to that tolerance; the weights match the reference's softmax. Exact ties
(shared router rows) go to the lower expert index; the negative control (``_order_bug``) breaks
that order and must be caught. The counter is left at zero by every call (CUDA-graph replays).
"""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels

Q1 = dict(H=6144, E=128)
MINI = dict(H=256, E=32)
TIE_TOL = 1e-4   # |logit difference| below which two experts count as tied (FP32 sums of ~6K terms)


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _inputs(shape, T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, shape["H"], generator=g).to(torch.bfloat16)
    r = (torch.randn(shape["E"], shape["H"], generator=g) / shape["H"] ** 0.5).to(torch.bfloat16)
    return x.to(_dev()), r.to(_dev())


def _route(R, x, r, k=8, **kw):
    T = x.shape[0]
    ids = torch.full((T, k), -1, dtype=torch.int32, device=x.device)
    wts = torch.full((T, k), float("nan"), dtype=torch.float32, device=x.device)
    R.route_topk(x, r, k, ids=ids, weights=wts, _poison=True, **kw)   # partials start as NaN
    return ids, wts


def _check_against_reference(R, x, r, ids, wts, k=8):
    assert bool(((ids >= 0) & (ids < r.shape[0])).all()) and bool(torch.isfinite(wts).all())   # written
    ref_ids, ref_w, logits = R.route_reference(x, r, k)
    exact = (x.double() @ r.double().T)
    kth = exact.topk(k, dim=-1).values[:, -1:]
    # every chosen expert is a top-k one of the FP64 logits, up to a near tie at the k-th place
    chosen = exact.gather(1, ids.long())
    assert bool((chosen >= kth - TIE_TOL).all())
    assert all(len(set(row)) == k for row in ids.tolist())   # k distinct experts per row
    same = ids.long() == ref_ids
    if not bool(same.all()):   # where the order differs, the two logits are a near tie
        a = logits.gather(1, ids.long())
        b = logits.gather(1, ref_ids)
        assert bool(((a - b).abs()[~same] < TIE_TOL).all())
    assert torch.allclose(wts, ref_w, rtol=1e-5, atol=1e-6)
    return bool(same.all())


def _cases(R, shape, T, seed):
    x, r = _inputs(shape, T, seed)
    ids, wts = _route(R, x, r)
    return _check_against_reference(R, x, r, ids, wts)


def _tie_case(R, shape, bug=False):
    """Experts 3, 5, 9 and 20 get one router row, along row 0 of x and large: their logits tie exactly
    and lead row 0's ranking. Returns (3 listed before 9, row 0's ids)."""
    x, r = _inputs(shape, 6, 11)
    lead = (x[0].float() / x[0].float().norm() * 4).to(torch.bfloat16)
    for e in (3, 5, 9, 20):
        r[e] = lead
    ids, _ = _route(R, x, r, _order_bug=bug)
    row = ids[0].tolist()
    assert {3, 5, 9, 20} <= set(row), row
    return row.index(3) < row.index(9), row


def _assert_tie_order_and_control(R, shape):
    ok, row = _tie_case(R, shape)
    assert ok is True, row
    bad, row_bad = _tie_case(R, shape, bug=True)   # negative control: higher index first
    assert bad is False, row_bad


def _assert_stale_counter_caught(R, shape):
    """A counter left one short of zero (-1): no program draws the last ticket, nothing finalises,
    the poisoned outputs stay, and the reference check must fail."""
    x, r = _inputs(shape, 6, 2)
    ids, wts = _route(R, x, r, counter=torch.full((1,), -1, dtype=torch.int32, device=_dev()))
    with pytest.raises(AssertionError):
        _check_against_reference(R, x, r, ids, wts)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 6, 8, 16])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
def test_matches_reference(shape, T):
    R = load_kernels("router")
    agree = [_cases(R, shape, T, seed) for seed in range(4)]
    assert sum(agree) >= 3   # near ties are rare: most cases agree exactly


@pytest.mark.gpu
@pytest.mark.parametrize("split_h", [1, 3, 8, 64])
def test_splits(split_h):
    """Any number of H slices (3: uneven; 64: slices past H do nothing) gives the same selection."""
    R = load_kernels("router")
    x, r = _inputs(Q1, 6, 5)
    ids, wts = _route(R, x, r, split_h=split_h)
    _check_against_reference(R, x, r, ids, wts)


def _assert_weights_first_same(R, shape, T):
    """The router slice loaded before the wait (one product over the zero-padded slice) against the
    BLOCK_K steps after it: both match the reference, with the same experts (these seeded inputs have
    no near tie) and weights equal up to FP32 summation order (the GPU's one long product and the six
    chained ones round their partial sums differently: session 17, call 4). The check can fail: a
    router row then made to lead row 0 (a new router tensor, same shapes) must come out first for
    row 0, so the path reads the router it is given."""
    x, r = _inputs(shape, T, 7)
    a_ids, a_w = _route(R, x, r, weights_first=True)
    b_ids, b_w = _route(R, x, r, weights_first=False)
    _check_against_reference(R, x, r, a_ids, a_w)
    _check_against_reference(R, x, r, b_ids, b_w)
    assert torch.equal(a_ids, b_ids) and torch.allclose(a_w, b_w, rtol=1e-5, atol=1e-6)
    r2 = r.clone()
    lead = (x[0].float() / x[0].float().norm() * 8).to(torch.bfloat16)
    loser = next(e for e in range(shape["E"]) if e not in a_ids[0].tolist())
    r2[loser] = lead
    c_ids, _ = _route(R, x, r2, weights_first=True)
    assert int(c_ids[0, 0].item()) == loser and not torch.equal(c_ids, a_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 6, 8])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
def test_weights_first_same_as_steps(shape, T):
    _assert_weights_first_same(load_kernels("router"), shape, T)


@pytest.mark.gpu
def test_ties_lower_index_first_and_negative_control():
    _assert_tie_order_and_control(load_kernels("router"), Q1)


@pytest.mark.gpu
def test_graph_replay_counter_stays_zero():
    R = load_kernels("router")
    x, r = _inputs(Q1, 6, 1)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    ids = torch.empty(6, 8, dtype=torch.int32, device="cuda")
    wts = torch.empty(6, 8, dtype=torch.float32, device="cuda")
    R.route_topk(x, r, 8, counter=cnt, ids=ids, weights=wts)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        R.route_topk(x, r, 8, counter=cnt, ids=ids, weights=wts)
    for seed in range(3):
        x2, _ = _inputs(Q1, 6, 100 + seed)
        x.copy_(x2)
        ids.fill_(-1)
        wts.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert int(cnt.item()) == 0
        _check_against_reference(R, x, r, ids, wts)


@pytest.mark.gpu
def test_stale_counter_is_caught():
    """Negative control of the arrival protocol."""
    _assert_stale_counter_caught(load_kernels("router"), Q1)


# ------------------------------------------------------------------------------ CPU interpreter
@cpu_only
@pytest.mark.parametrize("T", [1, 6, 8])
def test_interp_matches_reference(T):
    R = load_kernels("router")
    _cases(R, MINI, T, seed=T)   # asserts the selection and weights (exact agreement is counted on the GPU)


@cpu_only
@pytest.mark.parametrize("T", [1, 6])
def test_interp_weights_first_same_as_steps(T):
    _assert_weights_first_same(load_kernels("router"), MINI, T)


@cpu_only
def test_interp_ties_and_negative_control():
    _assert_tie_order_and_control(load_kernels("router"), MINI)


@cpu_only
def test_interp_stale_counter_is_caught():
    _assert_stale_counter_caught(load_kernels("router"), MINI)
