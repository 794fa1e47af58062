"""Top-k / top-p sampler kernel against its definition ``sample_reference``.

Same ids (exactly, including the order of ties: lower id first), same chosen index and token
(exactly), same filtered probabilities (max abs difference <= 1e-6), given the same uniform u.
Inputs are drawn so that no top-p or draw boundary is hit exactly (an exact tie of c_i - p_i with
top_p, e.g. 20 equal logits, is decided by FP32 summation order, which a tree scan and torch's
cumsum do not share). Negative control: top-p keeping one token too few must fail the same check.
Every selection (``select``: rank, max, bitonic) is checked; the rank selection also with each of
its paths forced, and on ``clustered`` / ``grouped`` logits, where more than CMAX keys pass pass 2's /
pass 1's threshold: there the compacted path forced must fail (its negative control) and the default
must take the fallback and pass.
"""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels

PROB_TOL = 1e-6


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def make_logits(w, V, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, V, generator=g) * 3
    if kind == "peaked":  # top-p keeps one or a few tokens
        x = x * 4
    elif kind == "flat":  # top-p keeps (nearly) all 20
        x = x * 0.05
    elif kind == "ties":  # equal values straddling the top-20 boundary, and a tie at the top
        x[:, :] = torch.randn(w, V, generator=g)  # N(0, 1): hardly any value above 4
        cols = torch.randperm(V, generator=g)[:30]
        x[:, cols[:3]] = 6.0           # three equal leaders (p about 0.21 each)
        x[:, cols[3:30]] = 4.0         # 27 equal values: about 17 enter the top 20, lower ids first
    elif kind == "clustered":  # pass 2: five strided chunks full of large values, the top 20 in the
        # fifth (by chunk maximum): more than CMAX members pass pass 2's threshold, and the compacted
        # path's first CMAX slots (chunk by chunk) hold the first four chunks only
        nch = _nch(V)
        assert 4 * (V // nch) > 64        # the first four chunks overfill the CMAX = 64 slots
        maxima = (100.0, 99.0, 98.0, 97.0, 96.0)
        for c, top in zip(range(5, 10), maxima):
            ids = torch.arange(c, V, nch)
            lo, hi = (50.0, 80.0) if c == 9 else (10.0, 11.0)
            x[:, ids] = torch.linspace(lo, hi, len(ids)).expand(w, -1)
            x[:, ids[0]] = top
    elif kind == "grouped":  # pass 1 (when it groups its chunk maxima: V = 20000): 80 chunk maxima in
        # ten full groups, increasing with the chunk, so the top 20 chunks lie beyond the first CMAX
        # chunk maxima above the threshold
        assert _nch(V) > 128
        x[:, :80] = 20.0 + 0.1 * torch.arange(80.0)
    u = torch.rand(w, generator=g)
    u[0] = 0.0
    if w > 1:
        u[-1] = 0.9999999
    return x.to(dtype).to(_dev()), u.to(_dev())


def _nch(V):
    from runtime.kernels import sampler
    return sampler._chunk_count(V)


def mismatch(S, logits, u, temperature, **kw):
    """None when the kernel equals the reference, else a description of the first difference."""
    got = S.sample_topk_topp(logits, u, temperature, **kw)
    ref = S.sample_reference(logits, u, temperature)
    names = ("ids", "probs", "token", "index")
    for name, a, b in zip(names, got, ref):
        if name == "probs":
            diff = (a.float() - b.float()).abs().max().item()
            if not diff <= PROB_TOL:
                return f"probs differ by {diff}"
        elif not torch.equal(a.cpu().long(), b.cpu().long()):
            return f"{name} differ: {a.tolist()} vs {b.tolist()}"
    return None


def cross_rank_ties(logits, ranks):
    """Equal values across the ranks' slices: the two ids either side of each slice boundary lead the
    row (9.0), and id 3 of every slice is next (8.0): the ids must come out lower first."""
    x = logits.clone()
    n = x.shape[1] // ranks
    for r in range(1, ranks):
        x[:, r * n - 1] = x[:, r * n] = 9.0
    x[:, [r * n + 3 for r in range(ranks)]] = 8.0
    return x


def two_stage_mismatch(S, logits, u, temperature, ranks, order=None):
    """Tensor-parallel sampling against the kernel on the whole row (itself checked against the
    reference above): ``logits`` cut in ``ranks`` slices, each slice's ``rank_candidates``, concatenated
    in ``order`` (default: rank order, as the all-gather gives them), then ``sample_candidates``. Both
    compute the same z and the same top-p arithmetic, so everything must be equal, probabilities to the
    bit. (Against the reference, a 160,000-logit row's full softmax rounds its probabilities up to
    ~2e-6 differently, over the 1e-6 these tests allow at 20,000: the one-row kernel does the same.)"""
    n = logits.shape[1] // ranks
    parts = [S.rank_candidates(logits[:, r * n:(r + 1) * n].contiguous(), u, temperature, vocab_start=r * n)
             for r in range(ranks)]
    order = list(order or range(ranks))
    got = S.sample_candidates(torch.cat([parts[r][0] for r in order], 1), torch.cat([parts[r][1] for r in order], 1),
                              u)
    for name, a, b in zip(("ids", "probs", "token", "index"), got, S.sample_topk_topp(logits, u, temperature)):
        if not torch.equal(a, b):
            return f"{name} differ: {a.tolist()} vs {b.tolist()}"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("V", [20000, 4096])
@pytest.mark.parametrize("w", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "peaked", "flat", "ties", "clustered"])
@pytest.mark.parametrize("select", ["rank", "max", "bitonic"])
def test_gpu(V, w, dtype, kind, select):
    S = load_kernels("sampler")
    logits, u = make_logits(w, V, dtype, kind, seed=V + w + len(kind))
    assert mismatch(S, logits, u, 1.0, select=select) is None


def _rank_paths(S, V, dtype, rows):
    """The rank selection's paths: each forced, on every kind, equals the reference, except the
    compacted path forced on clustered / grouped logits (the negative controls: more than CMAX keys
    above pass 2's / pass 1's threshold there)."""
    for kind in ("normal", "peaked", "flat", "ties", "clustered") + (("grouped",) if _nch(V) > 128 else ()):
        logits, u = make_logits(rows, V, dtype, kind, seed=V + len(kind))
        for force in (0, 1, 2):
            got = mismatch(S, logits, u, 1.0, select="rank", _force=force)
            if kind in ("clustered", "grouped") and force == 1:
                assert got is not None, f"the compacted path forced must lose the {kind} top 20"
            else:
                assert got is None, (kind, force, got)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [20000, 4096])
def test_gpu_rank_paths(V):
    _rank_paths(load_kernels("sampler"), V, torch.float32, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.7, 1.3, "tensor", "per_row"])
def test_gpu_temperature(temperature):
    S = load_kernels("sampler")
    logits, u = make_logits(8, 20000, torch.float32, "normal", seed=11)
    if temperature == "tensor":
        temperature = torch.tensor(0.8, device="cuda")
    elif temperature == "per_row":
        temperature = torch.linspace(0.5, 2.0, 8, device="cuda")
    assert mismatch(S, logits, u, temperature) is None


@pytest.mark.gpu
def test_gpu_many_rows_statistics():
    """4,096 independent rows: every one must match (catches rare selection errors)."""
    S = load_kernels("sampler")
    for seed in range(4):
        logits, u = make_logits(1024, 20000, torch.float32, "normal", seed=100 + seed)
        assert mismatch(S, logits, u, 1.0) is None


TUNINGS = [dict(tile_elems=2048), dict(tile_elems=8192), dict(nch=256, num_warps=4), dict(nch=2048, num_warps=16),
           dict(nch=64, tile_elems=16384)]


def _tuning_id(kw):
    return "_".join(f"{k}{v}" for k, v in kw.items())


@pytest.mark.gpu
@pytest.mark.parametrize("kw", TUNINGS, ids=_tuning_id)
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_gpu_tunings(kw, kind):
    """Chunk counts, pass-1 tiles and warps change how the kernel works, not what it returns;
    negative control: top-p keeping one token too few, with the same tuning."""
    S = load_kernels("sampler")
    logits, u = make_logits(8, 20000, torch.float32, kind, seed=11 + len(kind))
    assert mismatch(S, logits, u, 1.0, **kw) is None
    assert mismatch(S, logits, u, 1.0, _topp_bug=True, **kw) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("V", [20000, 4096])
def test_gpu_negative_control(V):
    S = load_kernels("sampler")
    logits, u = make_logits(8, V, torch.float32, "normal", seed=3)
    assert mismatch(S, logits, u, 1.0, _topp_bug=True) is not None


@pytest.mark.gpu
def test_gpu_graph_capture():
    S = load_kernels("sampler")
    logits, u = make_logits(8, 20000, torch.float32, "normal", seed=5)
    outs = S.sample_topk_topp(logits, u, 1.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        S.sample_topk_topp(logits, u, 1.0, out=outs)
    for seed in (6, 7):
        new_logits, new_u = make_logits(8, 20000, torch.float32, "peaked", seed=seed)
        logits.copy_(new_logits)
        u.copy_(new_u)
        g.replay()
        ref = S.sample_reference(logits, u, 1.0)
        assert torch.equal(outs[0], ref[0]) and torch.equal(outs[2], ref[2])


@cpu_only
@pytest.mark.parametrize("V,dtype,kind,temperature,select", [
    (4096, torch.float32, "normal", 1.0, "bitonic"),
    (4096, torch.bfloat16, "ties", 0.7, "rank"),
    (20000, torch.float32, "peaked", 1.0, "max"),
    (20000, torch.bfloat16, "flat", 1.3, "rank"),
])
def test_interp(V, dtype, kind, temperature, select):
    S = load_kernels("sampler")
    logits, u = make_logits(3, V, dtype, kind, seed=V + len(kind))
    assert mismatch(S, logits, u, temperature, select=select) is None


@cpu_only
@pytest.mark.parametrize("V", [4096, 20000])
def test_interp_rank_paths(V):
    _rank_paths(load_kernels("sampler"), V, torch.float32, 2)


@cpu_only
def test_interp_negative_control():
    S = load_kernels("sampler")
    logits, u = make_logits(3, 4096, torch.float32, "normal", seed=3)
    assert mismatch(S, logits, u, 1.0, _topp_bug=True, select="max") is not None
    assert mismatch(S, logits, u, 1.0, _topp_bug=True) is not None


@cpu_only
@pytest.mark.parametrize("kw", TUNINGS[:3], ids=_tuning_id)
def test_interp_tunings(kw):
    S = load_kernels("sampler")
    logits, u = make_logits(3, 4096, torch.float32, "ties", seed=13)
    assert mismatch(S, logits, u, 1.0, **kw) is None
    assert mismatch(S, logits, u, 1.0, _topp_bug=True, **kw) is not None


# ------------------------------------------------------------ tensor parallelism: two stages
def check_two_stages(w, V, ranks, dtype, kind, temperatures, seed):
    """The two stages equal the one-row kernel at each temperature; on ``cross`` rows (``ties`` with
    ties placed across the slices) the candidates in reverse rank order must not (negative control)."""
    S = load_kernels("sampler")
    logits, u = make_logits(w, V, dtype, "ties" if kind == "cross" else kind, seed=seed)
    if kind == "cross":
        logits = cross_rank_ties(logits, ranks)
    for T in temperatures:
        assert two_stage_mismatch(S, logits, u, T, ranks) is None
    if kind == "cross":
        assert two_stage_mismatch(S, logits, u, temperatures[0], ranks, order=reversed(range(ranks))) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("V,ranks", [(160000, 8), (40000, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "cross"])
def test_gpu_two_stages(V, ranks, dtype, kind):
    """rank_candidates per slice + sample_candidates = the one-row kernel, ties across slices included;
    negative control: the candidates in the reverse rank order lose the cross-slice ties."""
    check_two_stages(6, V, ranks, dtype, kind, (1.0, 0.7), seed=V + ranks + len(kind))


@cpu_only
@pytest.mark.parametrize("ranks,dtype,kind", [(2, torch.float32, "normal"), (8, torch.bfloat16, "ties"),
                                              (2, torch.bfloat16, "cross"), (8, torch.float32, "cross")])
def test_interp_two_stages(ranks, dtype, kind):
    check_two_stages(3, 4096, ranks, dtype, kind, (0.7,), seed=ranks + len(kind))
