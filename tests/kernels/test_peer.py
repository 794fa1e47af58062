"""The fused all-reduce + residual add + RMSNorm (runtime/kernels/peer.py) against all-reduce-then-norm.

Every rank's side of an exchange lives in this process (``PeerExchange.group``). Two ways to run them:

- staged (CPU in the interpreter, and the GPU): for each point, every rank's publication is written
  into its slot first (what each rank's kernel does first), then each rank's kernel runs in turn;
- concurrent (GPU): each rank's kernels on a stream of its own, one rank at a time held back by a
  device-side sleep, so that the others poll its slots while it lags.

Checks: each rank's residual and output against the rank-order FP32 sum of the partials rounded to BF16
and then ``fused_add_rmsnorm`` (bit for bit on the GPU; in the interpreter, whose FP32 -> BF16 conversion
truncates, within one BF16 step / TOL of the FP64 norm); every rank the same bits; after each point the
own slot holds the published row, the previous slot is re-armed (NaN), the sequence number advanced.
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


def run_staged(R, H, rows_seq, seed, exact, **kw):
    """Points with the row counts ``rows_seq``, every rank staged then run; returns the problems found.
    The kernel's three forms in turn (MODES): add + norm, a residual's start (add=False: the residual
    is the sum, then the norm) and the add alone (norm=False: the outputs stay as poisoned)."""
    Nm, Pm = load_kernels("norm"), load_kernels("peer")
    ex = Pm.PeerExchange.group(R, max(rows_seq), H, DEV)
    g = torch.Generator().manual_seed(seed)
    res0 = (torch.randn(max(rows_seq), H, generator=g) * 4).to(torch.bfloat16).to(DEV)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    problems = []
    for n, T in enumerate(rows_seq):
        parts = parts_for(R, T, H, seed * 100 + n)
        for q in range(R):
            stage(Pm, ex[q], parts[q], n)
        mode = MODES[n % len(MODES)]
        base = torch.zeros_like(res0[:T]) if mode == "start" else res0[:T]
        r_exp, o_exp, o16_exp = expected(Nm, Pm, parts, base, wt)
        if mode == "add_only":
            o_exp = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
            o16_exp = o_exp.half()
        outs = []
        for q in range(R):
            res = res0[:T].clone()
            o16 = torch.full((T, H), float("nan"), dtype=torch.float16, device=DEV)
            o = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
            Pm.peer_add_rmsnorm(parts[q], res, wt, EPS, ex[q], out=o, out16=o16, add=mode != "start",
                                norm=mode != "add_only", **kw)
            outs.append((res, o, o16))
            if not close(res, r_exp, exact, Pm.peer_add_rmsnorm_reference(parts, base)[1]):
                problems.append(f"point {n} rank {q}: residual")
            if mode == "add_only" and not (o.isnan().all() and o16.isnan().all()):
                problems.append(f"point {n} rank {q}: add alone wrote an output")
            elif exact and mode != "add_only" and not (torch.equal(o, o_exp) and torch.equal(o16, o16_exp)):
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
            if n > 0 and not bool(ex[q].own[(n - 1) % Pm.K_SLOTS].isnan().all()):
                problems.append(f"point {n} rank {q}: previous slot not re-armed")
        if not all(torch.equal(outs[0][i].nan_to_num(), o[i].nan_to_num()) for o in outs[1:] for i in range(3)):
            problems.append(f"point {n}: ranks differ")
    return problems


def lagging_peer(R, H, timeout_s, **kw):
    """K points with every rank, then a point where rank R - 1 never publishes: (rank 0's failure
    message or None, whether its residual is the stale-read result)."""
    Pm = load_kernels("peer")
    ex = Pm.PeerExchange.group(R, 4, H, DEV, timeout_s=timeout_s)
    wt = torch.ones(H, dtype=torch.bfloat16, device=DEV)
    history = []
    for n in range(Pm.K_SLOTS):
        parts = parts_for(R, 4, H, 7 + n)
        history.append(parts)
        for q in range(R):
            stage(Pm, ex[q], parts[q], n)
        for q in range(R):
            Pm.peer_add_rmsnorm(parts[q], torch.zeros(4, H, dtype=torch.bfloat16, device=DEV), wt, EPS, ex[q],
                                max_polls=2, **kw)
    assert all(x.failure() is None for x in ex)
    new = parts_for(R, 4, H, 99)
    for q in range(1, R - 1):   # the other peers publish point K
        stage(Pm, ex[q], new[q], Pm.K_SLOTS)
    res = torch.zeros(4, H, dtype=torch.bfloat16, device=DEV)
    Pm.peer_add_rmsnorm(new[0], res, wt, EPS, ex[0], max_polls=2, **kw)     # rank R - 1 lags: never publishes
    stale = [new[q] for q in range(R - 1)] + [history[0][R - 1]]          # its slot's old data, K points back
    r_stale, xs = Pm.peer_add_rmsnorm_reference(stale, torch.zeros_like(res))
    return ex[0].failure(), close(res, r_stale, HAS_CUDA, xs), ex[0]


# the kernel's forms that change what it computes or when it polls (the fence forms order the same
# accesses: one GPU cannot tell them apart, but the concurrent ranks run them)
FORMS = {"default": {}, "one_reduce": {"one_reduce": True}, "two_reduce": {"one_reduce": False}}


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("R,H", [(2, 6144), (4, 6144), (8, 6144), (3, 256)])
def test_gpu_staged_matches_all_reduce_then_norm(R, H, form):
    assert run_staged(R, H, [8, 1, 6, 8, 4, 8, 5], seed=R * H, exact=True, **FORMS[form]) == []


@cpu_only
@pytest.mark.parametrize("form", ["one_reduce", "two_reduce"])
@pytest.mark.parametrize("R", [2, 3])
def test_interp_staged_matches_all_reduce_then_norm(R, form):
    assert run_staged(R, 256, [4, 1, 3, 4, 2, 4], seed=R, exact=False, **FORMS[form]) == []


def _no_rearm_caught(H, exact):
    problems = run_staged(2, H, [4, 2, 4], seed=5, exact=exact, _no_rearm=True)
    return any("re-armed" in p for p in problems)


@pytest.mark.gpu
def test_gpu_no_rearm_control_fails_the_check():
    assert _no_rearm_caught(6144, exact=True)


@cpu_only
def test_interp_no_rearm_control_fails_the_check():
    assert _no_rearm_caught(256, exact=False)


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
@pytest.mark.parametrize("form", ["one_reduce", "two_reduce"])
def test_gpu_lagging_peer_is_reported_not_read_stale(form):
    _lagging_checks(6144, timeout_s=0.02, **FORMS[form])


@cpu_only
@pytest.mark.parametrize("form", ["one_reduce", "two_reduce"])
def test_interp_lagging_peer_is_reported_not_read_stale(form):
    _lagging_checks(256, timeout_s=1.0, **FORMS[form])


def run_concurrent(R, H, points, sleep_cycles, **kw):
    """Each rank on its own stream; before each point one rank (rotating) sleeps on the device.
    Returns (mismatches against the expected results, failures)."""
    Nm, Pm = load_kernels("norm"), load_kernels("peer")
    ex = Pm.PeerExchange.group(R, 8, H, DEV, timeout_s=2.0)
    g = torch.Generator().manual_seed(R)
    res0 = (torch.randn(8, H, generator=g) * 4).to(torch.bfloat16).to(DEV)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    rows = [(1 + (n * 5) % 8) for n in range(points)]
    parts = [parts_for(R, rows[n], H, 1000 + n) for n in range(points)]
    want, r = [], res0.clone()
    for n in range(points):       # the residual carries from point to point, as in a pass
        T = rows[n]
        rt, o, _ = expected(Nm, Pm, parts[n], r[:T], wt)
        r[:T] = rt
        want.append((rt.clone(), o))
    streams = [torch.cuda.Stream(DEV) for _ in range(R)]
    res = [res0.clone() for _ in range(R)]
    # Nothing in the launch loop may wait for the device, or a rank's kernel spins for a peer whose launch
    # is behind that wait on this host thread: the outputs are allocated first, and every kernel the loop
    # launches has been loaded once (a module load waits for the device to idle). The peer kernel: one
    # binary for every rank and row count (do_not_specialize), loaded by a staged point on another exchange.
    warm = Pm.PeerExchange.group(R, 8, H, DEV)
    for q in range(R):
        stage(Pm, warm[q], parts[0][q], 0)
    for q in range(R):
        Pm.peer_add_rmsnorm(parts[0][q], res0[:rows[0]].clone(), wt, EPS, warm[q])
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
                Pm.peer_add_rmsnorm(parts[n][q], res[q][:T], wt, EPS, ex[q], out=outs[q][n][0], **kw)
                outs[q][n][1].copy_(res[q][:T])
    torch.cuda.synchronize(DEV)
    bad = sum(not (torch.equal(outs[q][n][0], want[n][1]) and torch.equal(outs[q][n][1], want[n][0]))
              for q in range(R) for n in range(points))
    return bad, [x.failure() for x in ex if x.failure()]


CONCURRENT_FORMS = {**FORMS, "fence_sys_one": {"fence": "sys_one"}, "fence_gpu": {"fence": "gpu"}}


@pytest.mark.gpu
@pytest.mark.parametrize("form", CONCURRENT_FORMS)
@pytest.mark.parametrize("R", [2, 4])
def test_gpu_concurrent_ranks_match(R, form):
    kw = CONCURRENT_FORMS[form]
    bad, failed = run_concurrent(R, 6144, 48, sleep_cycles=1_000_000, **kw)
    assert failed == [] and bad == 0, (bad, failed)
    # negative control: without the re-arm, the ranks that run ahead read the sleeper's stale rows
    bad, failed = run_concurrent(R, 6144, 48, sleep_cycles=1_000_000, _no_rearm=True, **kw)
    assert bad > 0 and failed == [], (bad, failed)


def test_exchange_shape_errors():
    Pm = load_kernels("peer")
    ex = Pm.PeerExchange.group(2, 4, 256, DEV)[0]
    x = torch.zeros(5, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="exchange's shape"):
        Pm.peer_add_rmsnorm(x, x.clone(), torch.ones(256, dtype=torch.bfloat16, device=DEV), EPS, ex)
