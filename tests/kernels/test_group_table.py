"""The MoE's routing grouping as a table written once per call (``moe.group_table``, and by the
router's last program: ``router.route_topk(groups=)``), which Gate/Up and the wide Down read
(``moe_plan(group_table=)``) instead of each program grouping the ids (``_expert_group``).

Checked on fresh routings (random, rows sharing experts, all rows the same experts; 1-8 rows): the
table holds the number of distinct experts and the experts ascending (the buffer starts poisoned);
the router writes the table of its own ids; the MoE's output with the table is bit-identical to its
output without. Negative controls: each expert one group late (``_bug`` / ``_group_bug``) is caught;
a table in which a group repeats another's expert changes the MoE's output beyond its error bound.
"""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels
from .test_moe import MINI, Q1, _ok, _rejected, make_routing, make_weights, rel_err


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _table_matches(M, gt, ids):
    n, experts = M.group_table_reference(ids)
    gt = gt.cpu()
    return int(gt[0]) == n and torch.equal(gt[1:1 + n].long(), experts)


def _check_table(M, w, kind, E, seed):
    ids, _ = make_routing(w, E, kind, seed)
    gt = torch.full((M.GT_SIZE,), 12345, dtype=torch.int32, device=_dev())
    assert _table_matches(M, M.group_table(ids, gt), ids)
    assert not _table_matches(M, M.group_table(ids, torch.full_like(gt, 12345), _bug=True), ids)


def _check_router_table(R, M, T, E, H, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(_dev())
    rw = (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(_dev())
    gt = torch.full((M.GT_SIZE,), 12345, dtype=torch.int32, device=_dev())
    ids, _ = R.route_topk(x, rw, 8, groups=gt)
    assert _table_matches(M, gt, ids)
    gt_bad = torch.full_like(gt, 12345)
    R.route_topk(x, rw, 8, groups=gt_bad, _group_bug=True)
    assert not _table_matches(M, gt_bad, ids)
    return M.group_table_reference(ids)[0] < ids.numel()   # some rows share an expert


def _moe_with_table(M, shape, w, kind, seed, weights=None):
    """(outputs without the table, with it, with a table whose group 1 repeats group 0's expert; errors
    of that one and of the right table against the reference)."""
    H, I, E = shape["H"], shape["I"], shape["E"]
    w13, s13, w2, s2 = weights if weights is not None else make_weights(H, I, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(_dev())
    ids, tw = make_routing(w, E, kind, seed + 2)
    outs = []
    gt = M.group_table(ids)
    swapped = gt.clone()   # (a swap of two groups' experts changes nothing: each group finds its own
    swapped[2] = gt[1]     # pairs) group 1 given group 0's expert: group 0's computed twice, 1's never
    for table in (None, gt, swapped):
        out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=_dev())
        M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out, group_table=table)
        outs.append(out)
    emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=M.GU_BLOCK_N)
    ref32 = M.moe_reference(x, ids, tw, w13, s13, w2, s2)
    return outs, (rel_err(outs[2], emu), rel_err(outs[2], ref32)), (rel_err(outs[1], emu), rel_err(outs[1], ref32))


def _check_moe(M, shape, w, kind, seed, weights=None):
    (plain, table, swapped), bad, good = _moe_with_table(M, shape, w, kind, seed, weights)
    assert torch.equal(plain, table)
    assert _ok(good) and _rejected(bad), (good, bad)


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("w", [1, 4, 6, 8])
@pytest.mark.parametrize("kind", ["random", "shared", "same"])
def test_gpu_table(w, kind):
    _check_table(load_kernels("moe"), w, kind, 128, seed=w)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 6, 8])
def test_gpu_router_writes_the_table(T):
    _check_router_table(load_kernels("router"), load_kernels("moe"), T, 128, 6144, seed=T)


@pytest.mark.gpu
def test_gpu_router_table_with_shared_experts():
    """Rows sharing experts (a group with several members, where the control's order shows)."""
    R, M = load_kernels("router"), load_kernels("moe")
    assert _check_router_table(R, M, 8, 16, 256, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_gpu_q1_moe_same_bits_with_the_table(w, kind):
    M = load_kernels("moe")
    _check_moe(M, Q1, w, kind, seed=w, weights=make_weights(Q1["H"], Q1["I"], Q1["E"], 0))


# ------------------------------------------------------------------------------ CPU interpreter
@cpu_only
@pytest.mark.parametrize("w,kind", [(1, "random"), (6, "shared"), (8, "same")])
def test_interp_table(w, kind):
    _check_table(load_kernels("moe"), w, kind, 32, seed=w)


@cpu_only
def test_interp_router_writes_the_table():
    assert _check_router_table(load_kernels("router"), load_kernels("moe"), 8, 16, 256, seed=3)


@cpu_only
@pytest.mark.parametrize("w,kind", [(6, "shared"), (8, "same")])
def test_interp_mini_moe_same_bits_with_the_table(w, kind):
    _check_moe(load_kernels("moe"), MINI, w, kind, seed=w)
