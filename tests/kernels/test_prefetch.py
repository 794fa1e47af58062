"""The expert prefetch's ranges (runtime/kernels/prefetch.py): every chunk it asks L2 for, checked
against the ranges the module describes, on the interpreter (``dry=``: offsets and sizes stored) and
compiled on the GPU (the same stores, then the real prefetches in a graph replay, weights unchanged).
Negative control: ``_bug`` (the last chunk of each range left out) must be rejected by the same check."""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, load_kernels

pf = load_kernels("prefetch")


def expected_chunks(ids, E, I, H, budget, chunk, k_first=False):
    """(offset, size) of every chunk the module's description asks for, and the distinct count."""
    experts = sorted({int(e) for e in ids.flatten().tolist() if e >= 0})
    n = len(experts)
    if k_first:   # every row's first seg bytes
        seg = min(H, budget // max(n * 2 * I, 1)) // 16 * 16
        starts = [row * H for row in range(2 * I)]
    else:         # the first rows of the Gate and the Up half
        seg = min(I, budget // max(2 * n * H, 1)) * H
        starts = [0, I * H]
    out = []
    for e in experts:
        for s in starts:
            for c in range(0, seg, chunk):
                out.append((e * 2 * I * H + s + c, min(chunk, seg - c)))
    return sorted(out), n


def dry_chunks(ids, w13, budget, chunk, programs, bug=False, k_first=False):
    E, two_i, H = w13.shape
    m = pf.max_items(ids.numel(), E, two_i // 2, H, budget, chunk, k_first)
    off = torch.full((m + 5,), -7, dtype=torch.int64, device=w13.device)
    size = torch.full((m + 5,), -7, dtype=torch.int32, device=w13.device)
    n = torch.full((1,), -7, dtype=torch.int32, device=w13.device)
    pf.expert_prefetch(ids, w13, budget, programs=programs, chunk=chunk, k_first=k_first, dry=(off, size, n),
                       _bug=bug)
    written = off != -7
    # the chunks are written from entry 0 on, without gaps; nothing past the end
    k = int(written.sum())
    assert bool(written[:k].all()) and bool((size[:k] > 0).all()) and not bool(written[k:].any())
    return sorted(zip(off[:k].tolist(), size[:k].tolist())), int(n)


def check_chunks(got, want, w13):
    """The asked chunks are exactly the described ones: same set, 16-byte aligned, inside w13."""
    assert got == want
    assert all(o % 16 == 0 and s % 16 == 0 and 0 <= o and o + s <= w13.numel() for o, s in got)


CASES = [   # (E, I, H, ids, budget, chunk, programs[, k_first])
    (16, 64, 256, [[3, 7, 1, 3], [9, -1, 7, 15]], 40_000, 1024, 3),         # 5 experts, partial rows
    (16, 64, 256, [[3, 7, 1, 3], [9, -1, 7, 15]], 10 ** 9, 4096, 2),        # budget above the experts' size
    (32, 32, 128, [[31, 0]], 3 * 128 * 2 + 5, 128, 1),                       # 1 row per half: the tail chunk
    (16, 64, 256, [[-1, -1]], 40_000, 1024, 4),                             # no prediction: nothing asked
    (16, 64, 256, [[2, 5]], 0, 1024, 4),                                    # no budget: nothing asked
    (128, 16, 64, [list(range(0, 128, 2))], 50_000, 512, 5),                # 64 experts of 128
    (16, 64, 256, [[3, 7, 1, 3], [9, -1, 7, 15]], 40_000, 1024, 3, True),   # K first: 48-byte row heads
    (16, 64, 256, [[3, 7, 1, 3], [9, -1, 7, 15]], 10 ** 9, 64, 7, True),    # whole rows in 4 chunks each
    (16, 64, 256, [[2, 5]], 100, 1024, 2, True),                            # under 16 bytes a row: nothing
]


def _run_case(device, case, bug=False):
    E, I, H, ids, budget, chunk, programs, *kf = case
    k_first = bool(kf and kf[0])
    g = torch.Generator().manual_seed(0)
    w13 = torch.randint(0, 255, (E, 2 * I, H), generator=g, dtype=torch.uint8).to(device)
    ids_t = torch.tensor(ids, dtype=torch.int32, device=device)
    got, n = dry_chunks(ids_t, w13, budget, chunk, programs, bug=bug, k_first=k_first)
    want, n_want = expected_chunks(ids_t.cpu(), E, I, H, budget, chunk, k_first)
    assert n == n_want
    check_chunks(got, want, w13)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_interp_expert_prefetch_ranges(case):
    if HAS_CUDA:
        pytest.skip("interpreter test (CPU machines)")
    _run_case("cpu", case)


@pytest.mark.parametrize("case", [0, 7])
def test_interp_expert_prefetch_bug_rejected(case):
    """Negative control: the last chunk of each range left out fails the same check (both layouts)."""
    if HAS_CUDA:
        pytest.skip("interpreter test (CPU machines)")
    with pytest.raises(AssertionError):
        _run_case("cpu", CASES[case], bug=True)


def test_expert_prefetch_argument_checks():
    w13 = torch.zeros(4, 8, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="int32"):
        pf.expert_prefetch(torch.zeros(2, dtype=torch.int64), w13, 100, dry=(None, None, None))
    with pytest.raises(ValueError, match="chunk"):
        pf.expert_prefetch(torch.zeros(2, dtype=torch.int32), w13, 100, chunk=24, dry=(None, None, None))
    with pytest.raises(ValueError, match="dry"):   # buffers too small for what may be asked
        pf.expert_prefetch(torch.zeros(2, dtype=torch.int32), w13, 10 ** 6, chunk=16,
                           dry=(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                                torch.zeros(1, dtype=torch.int32)))
    if not HAS_CUDA:   # the real prefetch is inline PTX: refused on the CPU
        with pytest.raises(ValueError, match="compiled CUDA"):
            pf.expert_prefetch(torch.zeros(2, dtype=torch.int32), w13, 100)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_gpu_expert_prefetch_ranges(case):
    _run_case("cuda", case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 7])
def test_gpu_expert_prefetch_bug_rejected(case):
    with pytest.raises(AssertionError):
        _run_case("cuda", CASES[case], bug=True)


@pytest.mark.gpu
def test_gpu_expert_prefetch_in_graph_leaves_weights():
    """The real prefetches at q1's shard shapes (w13 [128, 512, 6144] E4M3), eagerly and replayed from
    a CUDA graph: no fault, the weights' bits unchanged (a prefetch writes nothing)."""
    torch.manual_seed(0)
    w13 = torch.randint(0, 255, (128, 512, 6144), dtype=torch.uint8, device="cuda")
    before = w13.clone()
    ids = torch.randint(0, 128, (8, 8), dtype=torch.int32, device="cuda")
    for k_first in (False, True):
        pf.expert_prefetch(ids, w13.view(torch.float8_e4m3fn), 32 << 20, k_first=k_first)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for k_first in (False, True):
            pf.expert_prefetch(ids, w13.view(torch.float8_e4m3fn), 32 << 20, k_first=k_first)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w13, before)
