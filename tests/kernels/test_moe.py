"""Fused E4M3 MoE against FP32 references.

Two checks per case, on fresh random non-zero inputs with a NaN-poisoned output:
* against ``moe_reference(act_block=GU_BLOCK_N)`` (FP32, activations quantised like the kernel):
  relative error < TOL_EMU (what is left: FP32 summation order, BF16 output, BF16 dequantised
  activations, rare E4M3 rounding flips);
* against the plain FP32 oracle ``moe_reference`` (no activation quantisation): < TOL_FP32 (the
  E4M3 activations cost about 2% relative error).
Negative control: the kernel reading the next block's weight scale must fail both checks.

Every variant (``variant="v1"``: three launches; ``"v2"``: split-K Gate/Up + Down with the reduce
fused, two launches, cross-program sums by the last-arriving program) is held to the same references
and tolerances; v2 has a second negative control, ``_drop_split`` (the Down reduction leaves out one
expert split), which must fail too.
"""
from __future__ import annotations

import math

import pytest
import torch

from ._checks import captured, first_catch, max_row_rel_err, rel_err
from .conftest import HAS_CUDA, cpu_only, load_kernels

TOL_EMU = 1.5e-2
TOL_FP32 = 6e-2
# The wide Down alone against the exact sum of its own products (per pair, relative), by operand type:
# the activations' rounding to FP16 (11 bits) / BF16 (8 bits) and FP32 accumulation.
TOL_DOWN = {True: 1e-3, False: 1e-2}

Q1 = dict(H=6144, I=256, E=128)
MINI = dict(H=256, I=128, E=32)
MINI_K = dict(H=512, I=128, E=16)   # 4 H blocks: split-K with 4, and 3 (uneven: one empty split)
MINI_I = dict(H=256, I=256, E=16)   # 2 I blocks: the Down's wrong scale block is another block
VARIANTS = ("v1", "v2")


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def make_weights(H, I, E, seed):
    g = torch.Generator().manual_seed(seed)
    dev = _dev()
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.float8_e4m3fn).to(dev)
    s13 = ((torch.rand(E, -(-2 * I // 128), -(-H // 128), generator=g) + 0.5) / math.sqrt(H)).to(dev)
    w2 = torch.randn(E, H, I, generator=g).to(torch.float8_e4m3fn).to(dev)
    s2 = ((torch.rand(E, -(-H // 128), -(-I // 128), generator=g) + 0.5) / math.sqrt(I)).to(dev)
    return w13, s13, w2, s2


def make_routing(w, E, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(w)])
    elif kind == "shared":  # rows share some experts (grouping: one read, several rows)
        base = torch.randperm(E, generator=g)[:12]
        ids = torch.stack([base[torch.randperm(12, generator=g)[:8]] for _ in range(w)])
    elif kind == "same":  # every row the same 8 experts, in different orders
        base = torch.randperm(E, generator=g)[:8]
        ids = torch.stack([base[torch.randperm(8, generator=g)] for _ in range(w)])
    else:
        raise ValueError(kind)
    tw = torch.rand(w, 8, generator=g) + 0.05
    tw = tw / tw.sum(1, keepdim=True)
    return ids.to(torch.int32).to(_dev()), tw.to(_dev())


def run_case(M, shape, w, kind, seed, weights=None, **kw):
    H, I, E = shape["H"], shape["I"], shape["E"]
    w13, s13, w2, s2 = weights if weights is not None else make_weights(H, I, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(_dev())
    ids, tw = make_routing(w, E, kind, seed + 2)
    out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=_dev())
    M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out, **kw)
    ref32 = M.moe_reference(x, ids, tw, w13, s13, w2, s2)
    emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=kw.get("gu_block_n") or M.GU_BLOCK_N)
    return rel_err(out, emu), rel_err(out, ref32)


def _ok(errs):
    return errs[0] < TOL_EMU and errs[1] < TOL_FP32


def _rejected(errs):
    return errs[0] > TOL_EMU and errs[1] > TOL_FP32


# ----------------------------------------------------------------------------------------- GPU
_Q1_WEIGHTS = {}


def _q1_weights():
    if "w" not in _Q1_WEIGHTS:
        _Q1_WEIGHTS["w"] = make_weights(Q1["H"], Q1["I"], Q1["E"], seed=7)
    return _Q1_WEIGHTS["w"]


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("kind", ["random", "shared", "same"])
def test_q1_shard(w, kind):
    M = load_kernels("moe")
    errs = run_case(M, Q1, w, kind, seed=100 * w + len(kind), weights=_q1_weights())
    assert _ok(errs), errs


@pytest.mark.gpu
@pytest.mark.parametrize("gu,down", [(True, False), (False, True), (False, False), (True, True)])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same"), (7, "random")])
def test_q1_shard_operand_types(w, kind, gu, down):
    """FP16 or BF16 operands in Gate/Up (gu_f16) and the wide Down (down_f16); the negative control
    reads the wrong scale block."""
    M = load_kernels("moe")
    kw = dict(gu_f16=gu, down_f16=down, down_nb=8)
    errs = run_case(M, Q1, w, kind, seed=300 + w, weights=_q1_weights(), **kw)
    assert _ok(errs), errs
    assert _rejected(run_case(M, Q1, w, kind, seed=301 + w, weights=_q1_weights(), _scale_bug=True, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("bn", [16, 64])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_q1_shard_gu_block_n(w, kind, bn):
    """Other Gate/Up widths (= activation-scale blocks), with both Down kernels."""
    M = load_kernels("moe")
    for nb in (1, 8):
        errs = run_case(M, Q1, w, kind, seed=500 + w + bn, weights=_q1_weights(), gu_block_n=bn, down_nb=nb)
        assert _ok(errs), (nb, errs)
    assert _rejected(run_case(M, Q1, w, kind, seed=501 + w, weights=_q1_weights(), gu_block_n=bn,
                              _scale_bug=True))


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 8])
@pytest.mark.parametrize("kind", ["random", "shared"])
def test_mini(w, kind):
    M = load_kernels("moe")
    assert _ok(run_case(M, MINI, w, kind, seed=w + len(kind))), "mini"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
def test_negative_control_wrong_scale_block(shape):
    M = load_kernels("moe")
    weights = _q1_weights() if shape is Q1 else None
    errs = run_case(M, shape, 6, "shared", seed=5, weights=weights, _scale_bug=True)
    assert _rejected(errs), errs


def _captured_moe(M, w=6, **kw):
    """One fused_moe_fp8 call on the q1 shard captured in a CUDA graph (after a warm-up call);
    returns the graph, its inputs and output."""
    w13, s13, w2, s2 = _q1_weights()
    x = torch.randn(w, Q1["H"], device="cuda").to(torch.bfloat16)
    ids, tw = make_routing(w, Q1["E"], "random", 1)
    out = torch.empty((w, Q1["H"]), dtype=torch.bfloat16, device="cuda")
    g = captured(lambda: M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out, **kw))
    return g, x, ids, tw, out


ROUTINGS = ((2, "random"), (3, "same"), (4, "shared"))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl,table", [(False, False), (True, False), (False, True), (True, True)])
def test_graph_capture_replays_with_new_routing(pdl, table):
    """pdl: the Down and the reduce are captured as programmatic dependents; table: the Down reads
    its group from the Gate/Up's group table (group_table)."""
    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    g, x, ids, tw, out = _captured_moe(M, pdl=pdl, group_table=table)
    for seed, kind in ROUTINGS:
        new_ids, new_tw = make_routing(out.shape[0], Q1["E"], kind, seed)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        out.fill_(float("nan"))
        g.replay()
        emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=M.GU_BLOCK_N)
        assert rel_err(out, emu) < TOL_EMU


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch,red_block_h", [(0, None), (2, None), (8, 256), (3, 2048)])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same"), (5, "random")])
def test_q1_shard_pdl(w, kind, prefetch, red_block_h):
    """Gate/Up -> wide Down -> reduce as programmatic dependents (L2 prefetch before the Down's
    wait), against the reference; negative control: the wrong scale block (the missing wait's is
    ``test_pdl_without_the_wait_is_caught``)."""
    M = load_kernels("moe")
    kw = dict(pdl=True, down_prefetch=prefetch, red_block_h=red_block_h, down_nb=8)
    errs = run_case(M, Q1, w, kind, seed=700 + w, weights=_q1_weights(), **kw)
    assert _ok(errs), errs
    assert _rejected(run_case(M, Q1, w, kind, seed=701 + w, weights=_q1_weights(), _scale_bug=True, **kw))


def _down_pdl_error(M, table, no_wait):
    """Worst error over six replays (new routing and x each) of the q1-shard MoE with PDL in one CUDA
    graph; no_wait: the wide Down skips griddepcontrol.wait (``_pdl_no_wait``)."""
    w13, s13, w2, s2 = _q1_weights()
    g, x, ids, tw, out = _captured_moe(M, w=8, pdl=True, _pdl_no_wait=no_wait, group_table=table)
    worst = 0.0
    for seed, kind in ROUTINGS + ((5, "same"), (6, "same"), (7, "random")):
        new_ids, new_tw = make_routing(out.shape[0], Q1["E"], kind, seed)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        out.fill_(float("nan"))
        g.replay()
        emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=M.GU_BLOCK_N)
        worst = max(worst, rel_err(out, emu))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("table", [False, True])
def test_pdl_without_the_wait_is_caught(table):
    """Negative control of the PDL tests: the wide Down, launched while Gate/Up runs, must wait for
    the activations; one that skips griddepcontrol.wait (``_pdl_no_wait``) reads the previous
    replay's. In a CUDA graph the launches are back to back (eagerly, the first call of a variant
    compiles it and the race never happens); "same" routing leaves most SMs free for early Down
    programs. ``table`` (group_table): the Down's wait also guards the Gate/Up's group table. The race
    is caught in one of ``RACE_ATTEMPTS``."""
    M = load_kernels("moe")
    assert _down_pdl_error(M, table, False) < TOL_EMU
    assert first_catch(lambda: _down_pdl_error(M, table, True) > TOL_EMU)


def _router_chain_error(M, R, r, cnt, no_wait):
    """Worst error over six replays (new x, so new routing, each) of router -> MoE in one CUDA graph;
    no_wait: Gate/Up skips its griddepcontrol.wait (``_gu_no_wait``)."""
    w13, s13, w2, s2 = _q1_weights()
    w = 6
    x = torch.randn(w, Q1["H"], device="cuda").to(torch.bfloat16)
    # (valid routing to start from: the broken Gate/Up reads ids before the router writes them, and an
    # unwritten buffer's garbage expert ids would send it to any address)
    ids = torch.arange(8, dtype=torch.int32, device="cuda").repeat(w, 1)
    tw = torch.full((w, 8), 0.125, device="cuda")
    out = torch.empty(w, Q1["H"], dtype=torch.bfloat16, device="cuda")

    def run():
        R.route_topk(x, r, 8, counter=cnt, ids=ids, weights=tw)
        M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out, _gu_no_wait=no_wait)
    g = captured(run)
    worst = 0.0
    for _ in range(6):
        x.copy_(torch.randn(w, Q1["H"], device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        g.replay()
        emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=M.GU_BLOCK_N)
        e = rel_err(out, emu)
        worst = max(worst, e if e == e else float("inf"))
    return worst


@pytest.mark.gpu
def test_gate_up_waits_for_the_router():
    """The chain router -> MoE as the fast model launches it (both programmatic dependents; the router
    releases Gate/Up at its start) captured in a CUDA graph and replayed with new x, so new routing
    every replay: the output is the reference's for the router's ids. Negative control: Gate/Up
    launched early without its wait (``_gu_no_wait``) reads the previous replay's ids, and the same
    check catches it (in one of ``RACE_ATTEMPTS``)."""
    M = load_kernels("moe")
    R = load_kernels("router")
    r = (torch.randn(Q1["E"], Q1["H"], device="cuda") / math.sqrt(Q1["H"])).to(torch.bfloat16)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert _router_chain_error(M, R, r, cnt, False) < TOL_EMU
    assert first_catch(lambda: _router_chain_error(M, R, r, cnt, True) > TOL_EMU)


@pytest.mark.gpu
@pytest.mark.parametrize("nb", [2, 4, 8])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_q1_shard_wide_down(w, kind, nb):
    M = load_kernels("moe")
    errs = run_case(M, Q1, w, kind, seed=100 * w + len(kind), weights=_q1_weights(), down_nb=nb)
    assert _ok(errs), errs


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(gu_weights_a=False), dict(gu_num_stages=4), dict(gu_unroll=1, gu_num_stages=6),
                                  dict(down_weights_a=False), dict(gu_weights_a=False, down_weights_a=False),
                                  dict(down_nb=8), dict(gu_block_k=64), dict(gu_block_k=64, gu_unroll=4)])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same"), (7, "random")])
def test_q1_shard_operand_orders(w, kind, opts):
    """Both operand orders of the Gate/Up and the wide Down (gu_weights_a / down_weights_a: the
    weights as the MMA's A operand, the defaults; False: x / the activations, the forms before
    session 23) against the reference; negative control: the wrong weight-scale block."""
    M = load_kernels("moe")
    errs = run_case(M, Q1, w, kind, seed=900 + w, weights=_q1_weights(), **opts)
    assert _ok(errs), errs
    assert _rejected(run_case(M, Q1, w, kind, seed=900 + w, weights=_q1_weights(), _scale_bug=True, **opts))


@pytest.mark.gpu
def test_q1_shard_gate_up_carveout_reaches_its_function():
    """gu_carveout (the Gate/Up's preferred shared-memory carveout, which caps its programs per SM):
    after a default call the compiled Gate/Up function carries GU_CARVEOUT, set before its first
    launch (the cache of compiled functions fills on that call) and again before each launch; -1 puts
    the driver's default back on the same function; the output bits never change. Negative control:
    an explicit
    gu_carveout is what the function then carries (not a constant), and another stage count keeps
    the driver's default."""
    from runtime.kernels._common import function_carveout

    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    x = torch.randn(6, Q1["H"], device="cuda").to(torch.bfloat16)
    ids, tw = make_routing(6, Q1["E"], "random", 77)
    M._GU_FUNCTIONS.clear()
    a = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2)
    assert len(M._GU_FUNCTIONS) == 1
    fn = next(iter(M._GU_FUNCTIONS.values()))
    assert function_carveout(fn) == M.GU_CARVEOUT
    b = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, gu_carveout=-1)
    assert function_carveout(fn) == -1 and torch.equal(a, b)
    c = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, gu_carveout=71)
    assert function_carveout(fn) == 71 and torch.equal(a, c)
    M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2)
    assert function_carveout(fn) == M.GU_CARVEOUT
    d = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, gu_num_stages=4)
    others = [f for f in M._GU_FUNCTIONS.values() if f != fn]
    assert len(others) == 1 and function_carveout(others[0]) == -1 and torch.equal(a, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dwa", [True, False])
@pytest.mark.parametrize("w,kind", [(4, "random"), (5, "shared"), (6, "shared"), (7, "random"), (8, "same")])
def test_q1_shard_group_table(w, kind, dwa):
    """group_table (the wide Down reads its expert group from the table the Gate/Up writes instead of
    ranking the ids): the same bits as ranking them, both Down operand orders, against the reference;
    negative control: the wrong scale block."""
    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    kw = dict(pdl=True, group_table=True, down_weights_a=dwa)
    errs = run_case(M, Q1, w, kind, seed=1400 + w, weights=_q1_weights(), **kw)
    assert _ok(errs), errs
    x = torch.randn(w, Q1["H"], device="cuda").to(torch.bfloat16)
    ids, tw = make_routing(w, Q1["E"], kind, 1401 + w)
    a = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, **kw)
    b = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, pdl=True, group_table=False, down_weights_a=dwa)
    assert torch.equal(a, b)
    assert _rejected(run_case(M, Q1, w, kind, seed=1400 + w, weights=_q1_weights(), _scale_bug=True, **kw))


def test_group_table_options_are_checked():
    M = load_kernels("moe")
    w13, s13, w2, s2 = (t.to("cpu") for t in make_weights(256, 128, 4, seed=1))
    x = torch.randn(2, 256).to(torch.bfloat16)
    ids, tw = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2, dtype=torch.int32), torch.rand(2, 8)
    M.moe_plan(x, ids, tw, w13, s13, w2, s2, down_nb=2, group_table=True)
    with pytest.raises(ValueError, match="group_table"):
        M.moe_plan(x, ids, tw, w13, s13, w2, s2, down_nb=2, group_table=True, down_prefetch=2, pdl=True)


def test_gate_up_carveout_option_is_checked():
    """gu_carveout: a percent or -1, v1 only; under the interpreter (no driver) the launch is plain."""
    M = load_kernels("moe")
    w13, s13, w2, s2 = (t.to("cpu") for t in make_weights(256, 128, 4, seed=1))
    x = torch.randn(2, 256).to(torch.bfloat16)
    ids, tw = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2, dtype=torch.int32), torch.rand(2, 8)
    for good in (-1, 0, 57, 100):
        M.moe_plan(x, ids, tw, w13, s13, w2, s2, gu_carveout=good)
    for bad in (101, -2, 57.0, "57"):
        with pytest.raises(ValueError, match="gu_carveout"):
            M.moe_plan(x, ids, tw, w13, s13, w2, s2, gu_carveout=bad)
    with pytest.raises(ValueError, match="gu_carveout"):
        M.moe_plan(x, ids, tw, w13, s13, w2, s2, gu_carveout=57, variant="v2")


def _group_routings(E, seed, widths=(1, 3, 6, 8)):
    """Routings of 1-8 rows over E experts: random, sharing some experts, all the same 8."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in widths:
        out.append(torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(w)]))
        base = torch.randperm(E, generator=g)[:min(E, 10)]
        out.append(torch.stack([base[torch.randperm(len(base), generator=g)[:8]] for _ in range(w)]))
        base = torch.randperm(E, generator=g)[:8]
        out.append(torch.stack([base[torch.randperm(8, generator=g)] for _ in range(w)]))
    return out


@pytest.mark.parametrize("E", [16, 32, 128, 200, 256])
def test_group_bits_rank_like_the_comparisons(E):
    """The experts' bitmap (group_bits) gives every group's expert, group count and members in the same
    order as the P x P comparisons, for 1-8 rows of random, shared and identical routings (GPU, or the
    interpreter on the CPU). Negative control: a bitmap one word short (experts >= 32 (words - 1)
    missing) must differ."""
    # in the interpreter a launch over several bitmap words takes seconds: there the wide tables
    # (E > 32) take 8 rows of each kind (the word count, not the row count, is what E varies; the
    # row counts are covered at E <= 32), and 128 (four whole words) is left to the GPU: 256 (eight
    # whole words) and 200 (a partial last word) cover what it would
    if not HAS_CUDA and E == 128:
        pytest.skip("the interpreter covers whole words at E = 256 (CI time); the GPU runs 128")
    M = load_kernels("moe")
    widths = (1, 3, 6, 8) if HAS_CUDA or E <= 32 else (8,)
    for ids in _group_routings(E, seed=E, widths=widths):
        ids = ids.to(_dev())
        assert torch.equal(M.expert_groups(ids, E, bits=True), M.expert_groups(ids, E, bits=False)), ids
    if E > 32:
        ids = torch.tensor([[E - 1 - k for k in range(8)]], device=_dev())
        assert not torch.equal(M.expert_groups(ids, E, bits=True, _short=True), M.expert_groups(ids, E, bits=False))


@pytest.mark.gpu
@pytest.mark.parametrize("table", [True, False])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same"), (7, "random")])
def test_q1_shard_group_bits(w, kind, table):
    """group_bits in the Gate/Up (and the Down where it ranks, table=False): the same bits as the
    comparisons; negative control: the wrong scale block."""
    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    x = torch.randn(w, Q1["H"], device="cuda").to(torch.bfloat16)
    ids, tw = make_routing(w, Q1["E"], kind, 1500 + w)
    kw = dict(pdl=True, group_table=table)
    a = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, group_bits=True, **kw)
    b = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, group_bits=False, **kw)
    assert torch.equal(a, b)
    assert _ok(run_case(M, Q1, w, kind, seed=1500 + w, weights=_q1_weights(), group_bits=True, **kw))
    assert _rejected(run_case(M, Q1, w, kind, seed=1500 + w, weights=_q1_weights(), group_bits=True,
                              _scale_bug=True, **kw))


@pytest.mark.gpu
def test_wide_down_matches_v1_and_rejects_scale_bug():
    """Same products per output column as v1's Down; only the MMA's internal summation order may
    differ (the H200 showed differences in the last BF16 bit, not bit-identical output). Both with
    BF16 operands (v1's Down has no FP16 form); FP16 is checked against the reference elsewhere."""
    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    x = torch.randn(6, Q1["H"], device="cuda").to(torch.bfloat16)
    ids, tw = make_routing(6, Q1["E"], "shared", 3)
    a = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, down_nb=1)
    b = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, down_nb=4, down_f16=False)
    assert rel_err(b, a) < 2e-3
    assert _rejected(run_case(M, Q1, 6, "shared", seed=5, weights=_q1_weights(), down_nb=4, _scale_bug=True))


def down_case(M, shape, w, kind, seed, weights=None, **kw):
    """The wide Down alone on random E4M3 activations with random positive block scales: the worst
    per-pair relative error of its FP32 output y against the exact FP64 sum of its products. Every
    pair belongs to some expert group, so every row of y is written (NaN-poisoned first)."""
    H, I, E = shape["H"], shape["I"], shape["E"]
    w13, s13, w2, s2 = weights if weights is not None else make_weights(H, I, E, seed)
    g = torch.Generator().manual_seed(seed + 3)
    ids, _ = make_routing(w, E, kind, seed + 2)
    P, blk = w * 8, M.GU_BLOCK_N
    act = torch.randn(P, I, generator=g).mul(64).clamp(-448, 448).to(torch.float8_e4m3fn).to(_dev())
    act_scale = (torch.rand(P, -(-I // blk), generator=g) + 0.01).to(_dev())
    a = act.double() * act_scale.double().repeat_interleave(blk, 1)[:, :I]
    ref = torch.einsum("phi,pi->ph", M._dequant(w2, s2, H, I).double()[ids.view(-1).long()], a)
    y = torch.full((P, H), float("nan"), device=_dev())
    M._launch_down_wide(act, act_scale, ids, w2, s2, y, P, **kw)
    return max_row_rel_err(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("nb,stages,f16,w_a", [(8, None, True, False), (4, 2, True, False), (12, 4, True, False),
                                              (5, 3, False, False), (8, None, True, True), (4, 2, True, True),
                                              (5, 3, False, True)])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_q1_down_against_its_exact_products(w, kind, nb, stages, f16, w_a):
    """The wide Down alone against the exact sum of its products: only the operands' rounding (FP16:
    each activation rounded to 11 bits after the pair's scale, H200 session 18: 2.1-2.3e-4; BF16: 8
    bits) and FP32 accumulation are left, far below the whole MoE's tolerance; both operand orders
    (w_a: the weight tile as the MMA's A operand). Negative control: the wrong weight scale block."""
    M = load_kernels("moe")
    kw = dict(nb=nb, num_stages=stages, f16=f16, weights_a=w_a)
    assert down_case(M, Q1, w, kind, seed=40 + w + nb, weights=_q1_weights(), **kw) < TOL_DOWN[f16]
    assert down_case(M, Q1, w, kind, seed=41 + w, weights=_q1_weights(), scale_bug=True, **kw) > TOL_EMU


def _timeline_case(M, no_wait=False, **opts):
    """One q1-shard call with per-program records (``_timeline``) and one without: (records [n, 6]
    on the CPU, program counts, the two outputs). ``opts``: more fused_moe_fp8 keywords."""
    from runtime.kernels.attention import TIMELINE_FIELDS

    H, I, E = Q1["H"], Q1["I"], Q1["E"]
    w13, s13, w2, s2 = _q1_weights()
    g = torch.Generator().manual_seed(31)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16).to(_dev())
    ids, tw = make_routing(6, E, "shared", 32)
    counts = M.timeline_programs(6, H, I, E)
    rec = torch.zeros(sum(counts), TIMELINE_FIELDS, dtype=torch.int64, device=_dev())
    kw = dict(pdl=True, _pdl_no_wait=no_wait, **opts)
    plain = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, **kw)
    out = torch.empty_like(plain)
    # launched back to back in a graph, as in the step (eager launches trail the GPU)
    graph = captured(lambda: M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out, _timeline=rec, **kw))
    rec.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return rec.cpu(), counts, out, plain


@pytest.mark.gpu
@pytest.mark.parametrize("table", [False, True])
def test_timeline_records_the_launch_order(table):
    """The MoE's diagnostic timeline (experiments/timeline_moe.py): the same output with and without
    records; every program stamped in order (entry <= wait <= end); the wide Down's programs pass their
    wait only after every Gate/Up program has ended, the reduce's after every Down program. Negative
    control: the Down launched early without its wait (_pdl_no_wait) stamps 'waited' before the last
    Gate/Up program ends."""
    M = load_kernels("moe")
    rec, (n_gu, n_dn, n_red), out, plain = _timeline_case(M, group_table=table)
    assert torch.equal(out, plain)
    assert (rec[:, 1] > 0).all() and (rec[:, 3] >= rec[:, 1]).all()
    gu, dn, red = rec[:n_gu], rec[n_gu:n_gu + n_dn], rec[n_gu + n_dn:]
    dn_act = dn[dn[:, 4] == 1]
    # (a Down program without an expert group exits before its wait and stamps none)
    assert torch.equal(dn[:, 2] > 0, dn[:, 4] == 1)
    waited = rec[rec[:, 2] > 0]
    assert (waited[:, 2] >= waited[:, 1]).all() and (waited[:, 3] >= waited[:, 2]).all()
    assert int((gu[:, 4] == 1).sum()) % (Q1["I"] // M.GU_BLOCK_N) == 0 and dn_act.shape[0] > 0
    assert dn_act[:, 2].min() >= gu[:, 3].max()
    assert red[:, 2].min() >= dn[:, 3].max()
    assert first_catch(lambda: _down_waited_early(M, table))


def _down_waited_early(M, table, no_wait=True):
    """The timeline of a call whose Down skips its wait (no_wait; False: the right call): some Down
    program stamps 'waited' before the last Gate/Up program ends."""
    rec, (n_gu, n_dn, _), _, _ = _timeline_case(M, no_wait=no_wait, group_table=table)
    dn = rec[n_gu:n_gu + n_dn]
    return bool(dn[dn[:, 4] == 1][:, 2].min() < rec[:n_gu, 3].max())


def test_timeline_buffer_is_checked():
    M = load_kernels("moe")
    w13, s13, w2, s2 = (t.to("cpu") for t in make_weights(256, 128, 4, seed=1))
    x = torch.randn(2, 256).to(torch.bfloat16)
    ids, tw = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2, dtype=torch.int32), torch.rand(2, 8)
    n = sum(M.timeline_programs(2, 256, 128, 4, down_nb=2))
    M.moe_plan(x, ids, tw, w13, s13, w2, s2, down_nb=2, _timeline=torch.zeros(n, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="_timeline"):
        M.moe_plan(x, ids, tw, w13, s13, w2, s2, down_nb=2, _timeline=torch.zeros(n - 1, 6, dtype=torch.int64))


# ------------------------------------------------------------------------------ CPU interpreter
# The interpreter loads and upcasts E4M3 correctly; its FP32->E4M3 conversion is not used (the
# kernel encodes E4M3 with integer arithmetic), so the FP8 paths run on the CPU too.
@cpu_only
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_interp_mini(w, kind):
    M = load_kernels("moe")
    errs = run_case(M, MINI, w, kind, seed=w)
    assert _ok(errs), errs


@cpu_only
@pytest.mark.parametrize("nb,w,kind", [(2, 4, "random"), (3, 6, "shared")])
def test_interp_mini_wide_down(nb, w, kind):
    """down_nb > 1 (3 does not divide the column blocks: the last program is partly masked)."""
    M = load_kernels("moe")
    assert _ok(run_case(M, MINI, w, kind, seed=w, down_nb=nb))
    assert _rejected(run_case(M, MINI_K, w, kind, seed=5, down_nb=nb, _scale_bug=True))


@cpu_only
@pytest.mark.parametrize("w,kind", [(5, "random"), (8, "shared")])
def test_interp_mini_operand_types(w, kind):
    M = load_kernels("moe")
    for gu, down in ((True, True), (False, False)):
        kw = dict(gu_f16=gu, down_f16=down, down_nb=2)
        assert _ok(run_case(M, MINI, w, kind, seed=w, **kw))
        assert _rejected(run_case(M, MINI_K, w, kind, seed=5, _scale_bug=True, **kw))


@cpu_only
@pytest.mark.parametrize("bn", [16, 64])
def test_interp_mini_gu_block_n(bn):
    M = load_kernels("moe")
    assert _ok(run_case(M, MINI, 6, "shared", seed=bn, gu_block_n=bn, down_nb=2))
    assert _rejected(run_case(M, MINI_K, 6, "shared", seed=5, gu_block_n=bn, _scale_bug=True))


@cpu_only
@pytest.mark.parametrize("nb,w,kind,f16,w_a", [(2, 4, "random", True, False), (3, 6, "shared", False, False),
                                               (2, 8, "same", True, True), (3, 6, "shared", False, True)])
def test_interp_mini_down_against_its_exact_products(nb, w, kind, f16, w_a):
    M = load_kernels("moe")
    assert down_case(M, MINI, w, kind, seed=w, nb=nb, f16=f16, weights_a=w_a) < TOL_DOWN[f16]
    assert down_case(M, MINI_I, w, kind, seed=5, nb=nb, f16=f16, weights_a=w_a, scale_bug=True) > TOL_EMU


@cpu_only
@pytest.mark.parametrize("opts,shape,w,kind", [(dict(gu_weights_a=False), MINI, 6, "shared"),
                                               (dict(gu_num_stages=4, gu_carveout=57), MINI_K, 8, "same"),
                                               (dict(gu_unroll=1, down_weights_a=False), MINI, 4, "random"),
                                               (dict(gu_block_k=64), MINI_K, 6, "shared")])
def test_interp_operand_orders(opts, shape, w, kind):
    """Both operand orders (and 64-wide Gate/Up K steps) on the interpreter; the wrong weight-scale
    block is caught."""
    M = load_kernels("moe")
    assert _ok(run_case(M, shape, w, kind, seed=3, **opts))
    assert _rejected(run_case(M, shape, w, kind, seed=3, _scale_bug=True, **opts))


@cpu_only
def test_interp_negative_control():
    M = load_kernels("moe")
    errs = run_case(M, MINI, 6, "shared", seed=5, _scale_bug=True)
    assert _rejected(errs), errs


@cpu_only
@pytest.mark.parametrize("w,kind,dwa", [(6, "shared", True), (4, "same", False), (8, "random", True)])
def test_interp_group_table(w, kind, dwa):
    """group_table on the interpreter: the same bits as the Down ranking the ids itself; the wrong
    scale block still rejected."""
    M = load_kernels("moe")
    H, I, E = MINI["H"], MINI["I"], MINI["E"]
    w13, s13, w2, s2 = make_weights(H, I, E, seed=3)
    x = torch.randn(w, H).to(torch.bfloat16)
    ids, tw = make_routing(w, E, kind, 5)
    base = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, down_nb=2, down_weights_a=dwa)
    assert torch.equal(M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, down_nb=2, down_weights_a=dwa,
                                       group_table=True), base)
    assert _rejected(run_case(M, MINI, w, kind, seed=5, _scale_bug=True, down_nb=2, group_table=True))


# ------------------------------------------------------------------------------ v2 (all checks)
@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("kind", ["random", "shared", "same"])
def test_q1_shard_v2(w, kind):
    M = load_kernels("moe")
    errs = run_case(M, Q1, w, kind, seed=100 * w + len(kind), weights=_q1_weights(), variant="v2")
    assert _ok(errs), errs


@pytest.mark.gpu
@pytest.mark.parametrize("split_k,split_e", [(1, 1), (3, 5), (6, 16)])
def test_q1_shard_v2_splits(split_k, split_e):
    M = load_kernels("moe")
    errs = run_case(M, Q1, 6, "shared", seed=11, weights=_q1_weights(), variant="v2",
                    gu_split_k=split_k, down_split_e=split_e)
    assert _ok(errs), errs


@pytest.mark.gpu
@pytest.mark.parametrize("bug", ["_scale_bug", "_drop_split"])
def test_negative_controls_v2(bug):
    M = load_kernels("moe")
    errs = run_case(M, Q1, 6, "shared", seed=5, weights=_q1_weights(), variant="v2", **{bug: True})
    assert _rejected(errs), errs


@pytest.mark.gpu
def test_v2_graph_capture_deterministic_counters_stay_zero():
    M = load_kernels("moe")
    w13, s13, w2, s2 = _q1_weights()
    cnt = torch.zeros(M.counters_size(6, Q1["H"], Q1["I"], Q1["E"]), dtype=torch.int32, device="cuda")
    g, x, ids, tw, out = _captured_moe(M, 6, variant="v2", counters=cnt)
    for seed, kind in ROUTINGS:
        new_ids, new_tw = make_routing(out.shape[0], Q1["E"], kind, seed)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        outs = []
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            outs.append(out.clone())
        emu = M.moe_reference(x, ids, tw, w13, s13, w2, s2, act_block=M.GU_BLOCK_N)
        assert rel_err(out, emu) < TOL_EMU
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "v2 not deterministic"
        assert int(cnt.abs().sum()) == 0, "counters not reset"


@cpu_only
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_interp_mini_v2(w, kind):
    M = load_kernels("moe")
    errs = run_case(M, MINI, w, kind, seed=w, variant="v2")
    assert _ok(errs), errs


@cpu_only
@pytest.mark.parametrize("split_k,split_e", [(4, 8), (3, 3)])
def test_interp_v2_splits(split_k, split_e):
    M = load_kernels("moe")
    errs = run_case(M, MINI_K, 5, "shared", seed=3, variant="v2", gu_split_k=split_k,
                    down_split_e=split_e)
    assert _ok(errs), errs


@cpu_only
@pytest.mark.parametrize("bug", ["_scale_bug", "_drop_split"])
def test_interp_negative_controls_v2(bug):
    M = load_kernels("moe")
    errs = run_case(M, MINI, 6, "shared", seed=5, variant="v2", **{bug: True})
    assert _rejected(errs), errs


@cpu_only
def test_interp_v2_matches_v1_and_leaves_counters_zero():
    """Same inputs: v2 within the emulated tolerance of v1; a persistent counter buffer ends zero."""
    M = load_kernels("moe")
    H, I, E, w = MINI["H"], MINI["I"], MINI["E"], 6
    w13, s13, w2, s2 = make_weights(H, I, E, 9)
    x = torch.randn(w, H, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ids, tw = make_routing(w, E, "shared", 9)
    cnt = torch.zeros(M.counters_size(w, H, I, E), dtype=torch.int32)
    o1 = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, variant="v1")
    o2 = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, variant="v2", counters=cnt)
    assert int(cnt.abs().sum()) == 0
    o3 = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, variant="v2", counters=cnt)
    assert torch.equal(o2, o3)
    assert rel_err(o2, o1) < TOL_EMU


def _fp16_x_outputs(M, shape, weights, w, seed):
    """Outputs for BF16 x, for an FP16 copy of the same values, and for FP16 x rounded straight from
    FP32 (other values: the negative control, which must differ)."""
    H, E = shape["H"], shape["E"]
    w13, s13, w2, s2 = weights
    x32 = torch.randn(w, H, generator=torch.Generator().manual_seed(seed)).to(_dev())
    x = x32.to(torch.bfloat16)
    ids, tw = make_routing(w, E, "shared", seed)
    outs = []
    for xi in (x, x.to(torch.float16), x32.to(torch.float16)):
        out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=_dev())
        M.fused_moe_fp8(xi, ids, tw, w13, s13, w2, s2, out)
        outs.append(out)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 6, 8])
def test_q1_shard_fp16_x_same_output(w):
    """An FP16 copy of BF16 x (what the norm writes for the MoE) gives the BF16 call's output bit for
    bit; FP16 x rounded from FP32 (different values) does not."""
    M = load_kernels("moe")
    o_bf, o_16, o_other = _fp16_x_outputs(M, Q1, _q1_weights(), w, seed=60 + w)
    assert torch.equal(o_bf, o_16)
    assert not torch.equal(o_bf, o_other)


@cpu_only
def test_interp_mini_fp16_x_same_output():
    M = load_kernels("moe")
    o_bf, o_16, o_other = _fp16_x_outputs(M, MINI, make_weights(MINI["H"], MINI["I"], MINI["E"], 4), 6, seed=61)
    assert torch.equal(o_bf, o_16)
    assert not torch.equal(o_bf, o_other)


def _unroll_pair(M, shape, weights, w, kind, seed, unroll, **kw):
    """(output with one K step per Gate/Up iteration, output with ``unroll``) on the same inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, shape["H"], generator=g).to(torch.bfloat16).to(_dev())
    ids, tw = make_routing(w, shape["E"], kind, seed + 1)
    return [M.fused_moe_fp8(x, ids, tw, *weights, gu_unroll=u, **kw) for u in (1, unroll)]


@pytest.mark.gpu
@pytest.mark.parametrize("unroll,stages", [(2, 2), (2, 3), (2, 4)])
@pytest.mark.parametrize("w,kind", [(4, "random"), (8, "same")])
def test_q1_shard_gu_unroll(w, kind, unroll, stages):
    """Several K steps per Gate/Up iteration: the same products in the same order, so the same
    output bit for bit; the reference bound and the wrong-scale-block control as everywhere."""
    M = load_kernels("moe")
    a, b = _unroll_pair(M, Q1, _q1_weights(), w, kind, seed=70 + w, unroll=unroll, gu_num_stages=stages)
    assert torch.equal(a, b)
    assert _ok(run_case(M, Q1, w, kind, seed=71 + w, weights=_q1_weights(), gu_unroll=unroll, gu_num_stages=stages))
    assert _rejected(run_case(M, Q1, w, kind, seed=72 + w, weights=_q1_weights(), gu_unroll=unroll,
                              gu_num_stages=stages, _scale_bug=True))


@cpu_only
@pytest.mark.parametrize("unroll", [2, 3])
def test_interp_gu_unroll(unroll):
    """3 does not divide MINI_K's 4 H blocks: the last iteration's extra step is masked."""
    M = load_kernels("moe")
    weights = make_weights(MINI_K["H"], MINI_K["I"], MINI_K["E"], 5)
    a, b = _unroll_pair(M, MINI_K, weights, 6, "shared", seed=8, unroll=unroll)
    assert torch.equal(a, b)
    assert _rejected(run_case(M, MINI_K, 6, "shared", seed=5, gu_unroll=unroll, _scale_bug=True))



# ------------------------------------------------------------- the next add + RMSNorm in the reduce
def _norm_fused_same(M, shape, w, kind, seed, weights=None, **kw):
    """fused_moe_fp8(norm=(r, ln, eps, counter)) against the MoE then fused_add_rmsnorm on a copy of
    the same residual: (residual equal, output equal, output's max difference in BF16 steps, counter
    left zero). Both outputs start as NaN; the residual is BF16."""
    from runtime.kernels import norm as N

    H, I, E = shape["H"], shape["I"], shape["E"]
    w13, s13, w2, s2 = weights if weights is not None else make_weights(H, I, E, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(_dev())
    res = (torch.randn(w, H, generator=g) * 3).to(torch.bfloat16).to(_dev())
    ln = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(_dev())
    ids, tw = make_routing(w, E, kind, seed + 2)
    m = M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2)
    res_a = res.clone()
    out_a = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=_dev())
    N.fused_add_rmsnorm(m, res_a, ln, 1e-6, out_a)
    res_b = res.clone()
    out_b = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=_dev())
    cnt = torch.zeros(8, dtype=torch.int32, device=_dev())
    M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out_b, norm=(res_b, ln, 1e-6, cnt), **kw)
    step = (out_a.float().abs() * 2.0 ** -7).clamp_min(1e-30)
    steps = float(((out_b.float() - out_a.float()).abs() / step).max())
    return torch.equal(res_a, res_b), torch.equal(out_a, out_b), steps, int(cnt.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("first", [True, False], ids=["weight_first", "weight_after"])
@pytest.mark.parametrize("w,kind", [(4, "random"), (6, "shared"), (8, "same")])
def test_q1_shard_reduce_with_norm(w, kind, first):
    """The reduce with the next add + RMSNorm fused gives the residual and the normalised output of
    the two launches it replaces, bit for bit (the last program's sum of squares has the norm
    kernel's layout), with its norm weight loaded before the wait or by the last program; its counter
    is re-armed; the negative control (one block left out of the sum of squares) moves the output by
    more than a BF16 step."""
    M = load_kernels("moe")
    res_ok, out_ok, steps, cnt_ok = _norm_fused_same(M, Q1, w, kind, seed=w, weights=_q1_weights(),
                                                     norm_weight_first=first)
    assert res_ok and cnt_ok and out_ok, steps
    _, out_bug, steps_bug, _ = _norm_fused_same(M, Q1, w, kind, seed=w, weights=_q1_weights(), _norm_bug=True,
                                                norm_weight_first=first)
    assert not out_bug and steps_bug > 1.0, steps_bug


@cpu_only
def test_interp_reduce_with_norm():
    M = load_kernels("moe")
    res_ok, out_ok, steps, cnt_ok = _norm_fused_same(M, MINI, 6, "shared", seed=3)
    assert res_ok and cnt_ok and steps <= 1.0, steps
    _, _, steps_bug, _ = _norm_fused_same(M, MINI, 6, "shared", seed=3, _norm_bug=True)
    assert steps_bug > 1.0, steps_bug
