"""The one-launch counter-based uniforms against ``runtime.rng.uniform``: the same bits.

Keys cover seeds on the device and as ints (negative, above 2^32, near 2^63), positions with high
32 bits set, every purpose, several lanes, 0-d / 1-d / 2-d shapes and more than one program. The
outputs start poisoned (NaN) where the kernel writes into ``out``. Negative control: the ``_bug``
hash (one shift by 15 instead of 16) must give different numbers for the same keys.
"""
from __future__ import annotations

import pytest
import torch

from runtime import rng

from .conftest import HAS_CUDA, cpu_only, load_kernels

SEEDS = [0, 1, 7, -5, 2**32 + 3, 2**63 - 1, -2**63, 123456789]


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _positions(n, seed, shape=None):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)
    pos[: min(n, 4)] = torch.tensor([0, 1, 2**32 - 1, 2**32], dtype=torch.int64)[: min(n, 4)]
    return pos.view(shape if shape is not None else (n,)).to(_dev())


def _check(U, seed, pos, purpose, lane, seed_on_device):
    ref = rng.uniform(seed, pos, purpose, lane)
    s = torch.tensor(seed, dtype=torch.int64, device=pos.device) if seed_on_device else seed
    out = torch.full(pos.shape, float("nan"), device=pos.device)
    got = U.uniform(s, pos, purpose, lane, out=out)
    assert got is out and got.shape == pos.shape and got.dtype == torch.float32
    assert torch.equal(got, ref), (seed, purpose, lane, (got != ref).sum().item())
    bad = U.uniform(s, pos, purpose, lane, _bug=True)
    assert not torch.equal(bad, ref)      # the negative control is caught by the same comparison
    return got


def _cases(U, seeds, n, shapes):
    for i, seed in enumerate(seeds):
        for purpose in (rng.TARGET, rng.ACCEPT, rng.RESIDUAL, rng.DRAFT, rng.WEIGHTS):
            for lane in (0, 3):
                for on_dev in (True, False):
                    _check(U, seed, _positions(n, i * 31 + purpose), purpose, lane, on_dev)
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        _check(U, 42, _positions(n, n, shape), rng.ACCEPT, 0, True)


@pytest.mark.gpu
def test_uniform_matches_rng_bit_for_bit():
    U = load_kernels("uniform")
    _cases(U, SEEDS, 7, [(), (1,), (5,), (3, 4), (U.BLOCK + 5,), (3 * U.BLOCK,)])


@pytest.mark.gpu
def test_uniform_in_a_cuda_graph_reads_the_seed_and_positions_on_the_device():
    U = load_kernels("uniform")
    seed = torch.tensor(11, dtype=torch.int64, device="cuda")
    pos = torch.arange(5, dtype=torch.int64, device="cuda") + 1000
    out = torch.empty(5, device="cuda")
    U.uniform(seed, pos, rng.DRAFT, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        U.uniform(seed, pos, rng.DRAFT, out=out)
    for s, p0 in ((12, 7), (2**40, 2**33)):
        seed.fill_(s)
        pos.copy_(torch.arange(5, device="cuda") + p0)
        out.fill_(float("nan"))
        g.replay()
        assert torch.equal(out, rng.uniform(s, pos, rng.DRAFT))


def test_uniform_rejects_float_positions_and_host_seed_tensors_on_another_device():
    U = load_kernels("uniform")
    with pytest.raises(ValueError):
        U.uniform(0, torch.zeros(3, device=_dev()), rng.TARGET)
    if HAS_CUDA:
        with pytest.raises(ValueError):
            U.uniform(torch.tensor(1), torch.zeros(3, dtype=torch.int64, device="cuda"), rng.TARGET)


@cpu_only
def test_interp_uniform_matches_rng_bit_for_bit():
    U = load_kernels("uniform")
    _cases(U, SEEDS[:4] + [2**63 - 1], 5, [(), (3, 2), (U.BLOCK + 3,)])
