"""The fused all-reduce + residual add + RMSNorm (runtime/kernels/peer.py) against all-reduce-then-norm; the
same exchange inside the MoE reduce (with the next norm) and inside the output projection's epilogue (with the
residual add and the per-block sums of squares the router normalises from).

Every rank's side of an exchange lives in this process (``PeerExchange.group``). Two ways to run them:

- staged (CPU in the interpreter, and the GPU): for each point, every rank's publication is written
  into its slot first (what each rank's kernel does first), then each rank's kernel runs in turn;
- concurrent (GPU): each rank's kernels on a stream of its own, one rank at a time held back by a
  device-side sleep, so that the others poll its slots while it lags.

Checks: each rank's residual and output against the rank-order FP32 sum of the partials rounded to BF16
and then ``fused_add_rmsnorm`` (bit for bit on the GPU; in the interpreter, whose FP32 -> BF16 conversion
truncates, within one BF16 step / TOL of the FP64 norm); every rank the same bits; after each point the
own slot holds the published row, the slot of REARM_LAG points back is re-armed (NaN) and the one
between not yet, the sequence number advanced.
A peer that never publishes ends in the failure exit, reported (``PeerTimeout``), not a hang.

Negative control (``_no_rearm``, slots never re-armed): the re-arm check fails, and a lagging peer's
stale row from K points earlier is read as its new one, with no failure reported: the result is wrong.
"""
from __future__ import annotations

import pytest
import torch

from ._checks import max_row_rel_err
from .conftest import HAS_CUDA, cpu_only, load_kernels

TOL = 1e-2
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
EPS = 1e-6


def parts_for(R, T, H, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV) for _ in range(R)]


def expected(Nm, Pm, parts, res, wt):
    """(residual, out, out16) of all-reduce-then-norm on a copy of ``res``."""
    r = res.clone()
    _, xs = Pm.peer_add_rmsnorm_reference(parts, res)
    out16 = torch.empty(r.shape, dtype=torch.float16, device=DEV)
    out = Nm.fused_add_rmsnorm(xs, r, wt, EPS, out16=out16)
    return r, out, out16


def stage(Pm, xchg, parts, seq):
    """What a rank's kernel publishes first: its partial rows into its slot seq mod K."""
    xchg.own[seq % Pm.K_SLOTS, :parts.shape[0]] = parts


def close(a, b, exact, xs=None):
    """a == b (exact), or within the interpreter's two truncations: the sum xs's and the residual's
    (a BF16 step of each); a rank's partial left out or counted twice is ~100x that."""
    if exact:
        return torch.equal(a, b)
    ulp = (b.float().abs() + xs.float().abs()) * 2.0 ** -7 + 1e-30
    return bool(((a.float() - b.float()).abs() <= ulp).all())


MODES = ("add_norm", "add_norm", "start", "add_only")   # by point, in turn
TOPK = 4   # (the MoE reduce's experts per row in these tests)


def reduce_inputs(Mm, R, T, H, seed):
    """Every rank's MoE reduce inputs (per-pair FP32 rows y [T * TOPK, H], routing weights [T, TOPK])
    and what each rank publishes: its reduce's sum, BF16 (the plain reduce's output)."""
    g = torch.Generator().manual_seed(seed)
    tw = torch.rand(T, TOPK, generator=g).to(DEV)
    ys = [torch.randn(T * TOPK, H, generator=g).to(DEV) for _ in range(R)]
    parts = [torch.empty(T, H, dtype=torch.bfloat16, device=DEV) for _ in range(R)]
    for y, m in zip(ys, parts):
        Mm._launch_reduce(y, tw, m)
    return [(y, tw) for y in ys], parts


# The output projection with the exchange in its epilogue (skinny_linear(residual=, peer=)): its tilings
# (split K 1: each program exchanges its column block; split K 2: each block's last arriving slice does)
LINEAR = {"linear": dict(split_k=1), "linear_sk": dict(split_k=2)}


def linear_tiling(kernel, H):
    return dict(LINEAR[kernel], block_n=64 if H >= 1024 else 32)


def linear_inputs(kernel, R, T, H, seed):
    """Every rank's output-projection inputs (x [T, KD] BF16, its weight shard [H, KD]) and what each
    rank publishes: the plain projection's BF16 output in the same tiling."""
    Lm = load_kernels("linear")
    kd = 768 if H >= 1024 else 128
    g = torch.Generator().manual_seed(seed)
    ins = [((torch.randn(T, kd, generator=g)).to(torch.bfloat16).to(DEV),
            (torch.randn(H, kd, generator=g) / kd ** 0.5).to(torch.bfloat16).to(DEV)) for _ in range(R)]
    return ins, [Lm.skinny_linear(x, w, **linear_tiling(kernel, H)) for x, w in ins]


def point_inputs(kernel, R, T, H, seed):
    """(every rank's inputs to ``launch_point``, what each rank publishes) for one point."""
    if kernel == "peer":
        parts = parts_for(R, T, H, seed)
        return parts, parts
    if kernel in LINEAR:
        return linear_inputs(kernel, R, T, H, seed)
    return reduce_inputs(load_kernels("moe"), R, T, H, seed)


def launch_point(kernel, inputs, res, wt, o, o16, xchg, mode, cnt=None, **kw):
    """One rank's launch of one point: the exchange's own kernel ("peer", inputs = the rank's partial
    rows), the MoE reduce with the exchange and the next add + norm ("moe_reduce", inputs = (y, tw):
    the add + norm form only; it writes no FP16 copy; ``cnt``: its counter, int32 zeros, left zero) or
    the output projection with the exchange and the add in its epilogue (``LINEAR``, inputs = (x, w);
    its per-block sums of squares normalised here in torch into ``o``, as the router does in its kernel)."""
    if kernel == "peer":
        load_kernels("peer").peer_add_rmsnorm(inputs, res, wt, EPS, xchg, out=o, out16=o16, add=mode != "start",
                                              norm=mode != "add_only", **kw)
    elif kernel in LINEAR:
        x, w = inputs
        tiling = linear_tiling(kernel, w.shape[0])
        ssq = torch.empty(x.shape[0], w.shape[0] // tiling["block_n"], dtype=torch.float32, device=DEV)
        cnt = torch.zeros(1024, dtype=torch.int32, device=DEV) if cnt is None else cnt
        load_kernels("linear").skinny_linear(x, w, residual=(res, ssq), peer=(xchg, kw), counter=cnt, **tiling)
        rf = res.float()
        o.copy_((rf * torch.rsqrt(ssq.sum(1, keepdim=True) / w.shape[0] + EPS) * wt.float()).to(o.dtype))
    else:
        y, tw = inputs
        cnt = torch.zeros(8, dtype=torch.int32, device=DEV) if cnt is None else cnt
        load_kernels("moe")._launch_reduce(y, tw, o, pdl=HAS_CUDA, norm=(res, wt, EPS, cnt), peer=(xchg, kw))


def run_staged(R, H, rows_seq, seed, exact, kernel="peer", **kw):
    """Points with the row counts ``rows_seq``, every rank staged then run; returns the problems found.
    The exchange's kernel in its three forms in turn (MODES): add + norm, a residual's start (add=False:
    the residual is the sum, then the norm) and the add alone (norm=False: the outputs stay as
    poisoned); the MoE reduce ("moe_reduce") in its one form, add + norm."""
    Nm, Pm = load_kernels("norm"), load_kernels("peer")
    ex = Pm.PeerExchange.group(R, max(rows_seq), H, DEV)
    g = torch.Generator().manual_seed(seed)
    res0 = (torch.randn(max(rows_seq), H, generator=g) * 4).to(torch.bfloat16).to(DEV)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    problems, prev = [], None
    for n, T in enumerate(rows_seq):
        inputs, parts = point_inputs(kernel, R, T, H, seed * 100 + n)
        mode = MODES[n % len(MODES)] if kernel == "peer" else "add_norm"
        for q in range(R):
            stage(Pm, ex[q], parts[q], n)
        base = torch.zeros_like(res0[:T]) if mode == "start" else res0[:T]
        r_exp, o_exp, o16_exp = expected(Nm, Pm, parts, base, wt)
        if mode == "add_only" or kernel != "peer":   # (outputs not written: they stay as poisoned)
            o16_exp = torch.full((T, H), float("nan"), dtype=torch.float16, device=DEV)
        if mode == "add_only":
            o_exp = o16_exp.to(torch.bfloat16)
        outs = []
        for q in range(R):
            res = res0[:T].clone()
            o16 = torch.full((T, H), float("nan"), dtype=torch.float16, device=DEV)
            o = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
            launch_point(kernel, inputs[q], res, wt, o, o16, ex[q], mode, **kw)
            outs.append((res, o, o16))
            if not close(res, r_exp, exact, Pm.peer_add_rmsnorm_reference(parts, base)[1]):
                problems.append(f"point {n} rank {q}: residual")
            same = [torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
                    for a, b in ((o, o_exp), (o16, o16_exp))]
            if kernel in LINEAR:   # (o normalised in torch from the kernel's block sums: within a BF16 step)
                same[0] = bool(((o.float() - o_exp.float()).abs() <= o_exp.float().abs() * 2.0 ** -7 + 1e-30).all())
            if mode == "add_only" and not all(same):
                problems.append(f"point {n} rank {q}: add alone wrote an output")
            elif exact and mode != "add_only" and not all(same):
                problems.append(f"point {n} rank {q}: output")
            if not exact and mode != "add_only":
                rd = res.double()
                n_ref = rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + EPS) * wt.double()
                if max_row_rel_err(o, n_ref) >= TOL:
                    problems.append(f"point {n} rank {q}: output off the FP64 norm")
            st = ex[q].state.tolist()
            if st[:ex[q].rows] != [n + 1] * ex[q].rows or ex[q].failure() is not None:
                problems.append(f"point {n} rank {q}: state {st}")
            if not torch.equal(ex[q].own[n % Pm.K_SLOTS, :T], parts[q]):
                problems.append(f"point {n} rank {q}: not published")
            lag = kw.get("rearm_lag", Pm.REARM_LAG)
            if n >= lag and not bool(ex[q].own[(n - lag) % Pm.K_SLOTS].isnan().all()):
                problems.append(f"point {n} rank {q}: slot n - {lag} not re-armed")
            if lag > 1 and n > 0 and not torch.equal(ex[q].own[(n - 1) % Pm.K_SLOTS, :rows_seq[n - 1]], prev[q]):
                problems.append(f"point {n} rank {q}: slot n - 1 re-armed early")
        if not all(torch.equal(outs[0][i].nan_to_num(), o[i].nan_to_num()) for o in outs[1:] for i in range(3)):
            problems.append(f"point {n}: ranks differ")
        prev = parts
    return problems


def lagging_peer(R, H, timeout_s, kernel="peer", **kw):
    """K points with every rank, then a point where rank R - 1 never publishes: (rank 0's failure
    message or None, whether its residual is the stale-read result)."""
    Pm = load_kernels("peer")
    ex = Pm.PeerExchange.group(R, 4, H, DEV, timeout_s=timeout_s)
    wt = torch.ones(H, dtype=torch.bfloat16, device=DEV)
    o = torch.empty(4, H, dtype=torch.bfloat16, device=DEV)

    def point(n, ranks, publish_only=()):
        inputs, parts = point_inputs(kernel, R, 4, H, 7 + n)
        for q in publish_only:
            stage(Pm, ex[q], parts[q], n)
        res = torch.zeros(4, H, dtype=torch.bfloat16, device=DEV)
        for q in ranks:
            res = torch.zeros(4, H, dtype=torch.bfloat16, device=DEV)
            launch_point(kernel, inputs[q], res, wt, o, None, ex[q], "add_norm", max_polls=2, **kw)
        return parts, res

    history = []
    for n in range(Pm.K_SLOTS):
        history.append(point(n, range(R), publish_only=range(R))[0])
    assert all(x.failure() is None for x in ex)
    # point K: the other peers publish, rank 0 runs, rank R - 1 lags (never publishes)
    new, res = point(Pm.K_SLOTS, [0], publish_only=range(1, R - 1))
    stale = [new[q] for q in range(R - 1)] + [history[0][R - 1]]          # its slot's old data, K points back
    r_stale, xs = Pm.peer_add_rmsnorm_reference(stale, torch.zeros_like(res))
    return ex[0].failure(), close(res, r_stale, HAS_CUDA, xs), ex[0]


# the kernel's forms that change what it computes or when it polls (the fence forms order the same
# accesses: one GPU cannot tell them apart, but the concurrent ranks run them)
# (lag1: the re-arm one point back, with the acquire fence it then needs)
FORMS = {"default": {}, "two_reduce": {"one_reduce": False}, "lag1": {"rearm_lag": 1, "fence": "sys_acq"}}
# (kernel, form): the exchange's own kernel in every form; the MoE reduce and the output projection (split K 1
# and 2) in those they have
CASES = ([("peer", f) for f in FORMS] + [("moe_reduce", "default"), ("moe_reduce", "lag1")]
         + [("linear", "default"), ("linear", "lag1"), ("linear_sk", "default")])
IDS = [f"{k}-{f}" for k, f in CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,form", CASES, ids=IDS)
@pytest.mark.parametrize("R,H", [(2, 6144), (4, 6144), (8, 6144), (3, 256)])
def test_gpu_staged_matches_all_reduce_then_norm(R, H, kernel, form):
    assert run_staged(R, H, [8, 1, 6, 8, 4, 8, 5], seed=R * H, exact=True, kernel=kernel, **FORMS[form]) == []


@cpu_only
@pytest.mark.parametrize("kernel,form", CASES, ids=IDS)
@pytest.mark.parametrize("R", [2, 3])
def test_interp_staged_matches_all_reduce_then_norm(R, kernel, form):
    assert run_staged(R, 256, [4, 1, 3, 4, 2, 4], seed=R, exact=False, kernel=kernel, **FORMS[form]) == []


def _no_rearm_caught(H, exact, kernel):
    problems = run_staged(2, H, [4, 2, 4], seed=5, exact=exact, kernel=kernel, _no_rearm=True)
    return any("re-armed" in p for p in problems)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["peer", "moe_reduce", "linear", "linear_sk"])
def test_gpu_no_rearm_control_fails_the_check(kernel):
    assert _no_rearm_caught(6144, exact=True, kernel=kernel)


@cpu_only
@pytest.mark.parametrize("kernel", ["peer", "moe_reduce", "linear", "linear_sk"])
def test_interp_no_rearm_control_fails_the_check(kernel):
    assert _no_rearm_caught(256, exact=False, kernel=kernel)


def _lagging_checks(H, timeout_s, **kw):
    Pm = load_kernels("peer")
    why, stale, xchg = lagging_peer(3, H, timeout_s, **kw)
    assert why is not None and "rank(s) [2]" in why and "point 4" in why, why
    with pytest.raises(Pm.PeerTimeout):
        xchg.check()
    assert not stale
    # negative control: without the re-arm the lagging rank's row from K points back is read as new
    why, stale, _ = lagging_peer(3, H, timeout_s, _no_rearm=True, **kw)
    assert why is None and stale


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,form", CASES, ids=IDS)
def test_gpu_lagging_peer_is_reported_not_read_stale(kernel, form):
    _lagging_checks(6144, timeout_s=0.02, kernel=kernel, **FORMS[form])


@cpu_only
@pytest.mark.parametrize("kernel,form", CASES, ids=IDS)
def test_interp_lagging_peer_is_reported_not_read_stale(kernel, form):
    _lagging_checks(256, timeout_s=1.0, kernel=kernel, **FORMS[form])


def run_concurrent(R, H, points, sleep_cycles, kernels=("peer",), **kw):
    """Each rank on its own stream; before each point one rank (rotating) sleeps on the device. Point
    n runs ``kernels[n % len(kernels)]`` (as a pass alternates the exchange's kernel after the
    attention and the MoE reduce's after the MoE, on one sequence). Returns (mismatches against the
    expected results, failures)."""
    Nm, Pm = load_kernels("norm"), load_kernels("peer")
    ex = Pm.PeerExchange.group(R, 8, H, DEV, timeout_s=2.0)
    g = torch.Generator().manual_seed(R)
    res0 = (torch.randn(8, H, generator=g) * 4).to(torch.bfloat16).to(DEV)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    rows = [(1 + (n * 5) % 8) for n in range(points)]
    kind = [kernels[n % len(kernels)] for n in range(points)]
    inputs, parts = zip(*[point_inputs(kind[n], R, rows[n], H, 1000 + n) for n in range(points)])
    want, r = [], res0.clone()
    for n in range(points):       # the residual carries from point to point, as in a pass
        T = rows[n]
        rt, o, _ = expected(Nm, Pm, parts[n], r[:T], wt)
        r[:T] = rt
        want.append((rt.clone(), o))
    streams = [torch.cuda.Stream(DEV) for _ in range(R)]
    res = [res0.clone() for _ in range(R)]
    cnts = [torch.zeros(1024, dtype=torch.int32, device=DEV) for _ in range(R)]
    # Nothing in the launch loop may wait for the device, or a rank's kernel spins for a peer whose launch
    # is behind that wait on this host thread: the outputs are allocated first, and every kernel the loop
    # launches has been loaded once (a module load waits for the device to idle). The exchange's kernels:
    # one binary for every rank (and row count: do_not_specialize), loaded by staged points on another exchange.
    warm = Pm.PeerExchange.group(R, 8, H, DEV)
    for n in range(len(kernels)):
        for q in range(R):
            stage(Pm, warm[q], parts[n][q], n)
        for q in range(R):
            launch_point(kind[n], inputs[n][q], res0[:rows[n]].clone(), wt, torch.empty_like(res0[:rows[n]]),
                         None, warm[q], "add_norm", cnt=cnts[q], **kw)
    torch.cuda._sleep(1)
    outs = [[(torch.empty(rows[n], H, dtype=torch.bfloat16, device=DEV),
              torch.empty(rows[n], H, dtype=torch.bfloat16, device=DEV)) for n in range(points)] for _ in range(R)]
    torch.cuda.synchronize(DEV)
    for n in range(points):
        for q in range(R):
            with torch.cuda.stream(streams[q]):
                if q == n % R:
                    torch.cuda._sleep(sleep_cycles)
                T = rows[n]
                launch_point(kind[n], inputs[n][q], res[q][:T], wt, outs[q][n][0], None, ex[q], "add_norm",
                             cnt=cnts[q], **kw)
                outs[q][n][1].copy_(res[q][:T])
    torch.cuda.synchronize(DEV)

    def ok(q, n):   # the residual bit for bit; the output too, but within a BF16 step after the MoE
        (o, r), (r_want, o_want) = outs[q][n], want[n]   # reduce (its norm's sum of squares in 16 warps'
        if kind[n] == "peer":                            # layout, fused_add_rmsnorm's in 4 below 4,096 wide)
            return torch.equal(r, r_want) and torch.equal(o, o_want)
        step = o_want.float().abs() * 2.0 ** -7 + 1e-30
        return torch.equal(r, r_want) and bool(((o.float() - o_want.float()).abs() <= step).all())

    bad = sum(not ok(q, n) for q in range(R) for n in range(points))
    return bad, [x.failure() for x in ex if x.failure()]


CONCURRENT_FORMS = {**FORMS, "fence_sys": {"fence": "sys"}, "fence_sys_one": {"fence": "sys_one"}}
# (the MoE reduce's grid is rows x H / 256 programs a rank, all spinning on one GPU here: at a width of
# 1,024 every rank's programs are resident together; on separate GPUs each rank has its own)
MIXED = {"default": {}, "lag1": FORMS["lag1"], "fence_sys": {"fence": "sys"}}


def _concurrent_checks(R, H, kernels, kw):
    bad, failed = run_concurrent(R, H, 48, sleep_cycles=1_000_000, kernels=kernels, **kw)
    assert failed == [] and bad == 0, (bad, failed)
    # negative control: without the re-arm, the ranks that run ahead read the sleeper's stale rows
    bad, failed = run_concurrent(R, H, 48, sleep_cycles=1_000_000, kernels=kernels, _no_rearm=True, **kw)
    assert bad > 0 and failed == [], (bad, failed)


@pytest.mark.gpu
@pytest.mark.parametrize("form", CONCURRENT_FORMS)
@pytest.mark.parametrize("R", [2, 4])
def test_gpu_concurrent_ranks_match(R, form):
    _concurrent_checks(R, 6144, ("peer",), CONCURRENT_FORMS[form])


@pytest.mark.gpu
@pytest.mark.parametrize("form", MIXED)
@pytest.mark.parametrize("R", [2, 4])
def test_gpu_concurrent_ranks_match_with_the_moe_reduce(R, form):
    _concurrent_checks(R, 1024, ("peer", "moe_reduce"), MIXED[form])


@pytest.mark.gpu
@pytest.mark.parametrize("form", MIXED)
@pytest.mark.parametrize("R", [2, 4])
def test_gpu_concurrent_ranks_match_with_the_projection_and_the_moe_reduce(R, form):
    """A pass's three exchange points in turn: the output projection's epilogue, the MoE reduce, and the
    exchange's own kernel (the embedding's, the pass's last), at 1,024 wide (16 programs a rank)."""
    _concurrent_checks(R, 1024, ("linear", "moe_reduce", "peer"), MIXED[form])


def test_exchange_shape_errors():
    Pm = load_kernels("peer")
    ex = Pm.PeerExchange.group(2, 4, 256, DEV)[0]
    x = torch.zeros(5, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="exchange's shape"):
        Pm.peer_add_rmsnorm(x, x.clone(), torch.ones(256, dtype=torch.bfloat16, device=DEV), EPS, ex)
