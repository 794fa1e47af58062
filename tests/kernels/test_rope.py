"""RoPE of the new q/k rows + the KV-cache write (``rope_kv_write``) against the fast step's former
torch sequence (the reference's RoPE in FP32, then ``index_copy_``).

Every case poisons the output and both caches with NaN: the written rows must equal the torch result
(exactly on the GPU; within one BF16 step in the interpreter, whose FP32 -> BF16 conversion
truncates), every other cache row must still be NaN (no stray write), a ring's labels must name the
positions. Negative controls: the rotation's signs swapped, and every row written one slot late,
must fail the same checks.
"""
from __future__ import annotations

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels

Q1 = dict(nh=6, nkv=1, d=128)
MINI = dict(nh=6, nkv=1, d=64)


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def run_case(R, shape, T, start, slots, ring, seed, in_kernel=False, **kw):
    """(q, reference q, k rows, reference k, v rows, v, labels ok, untouched ok). ``in_kernel``: the
    kernel computes the tables from the positions and inv_freq (and a ring's slots from the ring
    size) instead of reading the torch tables and slots."""
    nh, nkv, d = shape["nh"], shape["nkv"], shape["d"]
    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (nh + 2 * nkv) * d, generator=g).to(torch.bfloat16).to(dev)
    pos = torch.arange(start, start + T, device=dev)
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d)
    ang = pos.double()[:, None] * inv_freq[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    cos2, sin2 = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    kc = torch.full((nkv, slots, d), float("nan"), dtype=torch.bfloat16, device=dev)
    vc = torch.full_like(kc, float("nan"))
    sl = pos % slots if ring else pos
    labels = torch.full((slots,), -1, dtype=torch.int64, device=dev) if ring else None
    q = torch.full((T, nh, d), float("nan"), dtype=torch.bfloat16, device=dev)
    if in_kernel:
        R.rope_kv_write(qkv, None, None, nh, nkv, kc, vc, None if ring else pos, q, labels=labels, positions=pos,
                        inv_freq=inv_freq, ring_slots=slots if ring else None, **kw)
    else:
        R.rope_kv_write(qkv, cos2, sin2, nh, nkv, kc, vc, sl, q, labels=labels, positions=pos if ring else None,
                        **kw)
    from runtime.fast import FastModel   # the fast step's torch RoPE (its reference-attention path)

    ref = FastModel._rope(qkv[:, :(nh + nkv) * d].view(T, nh + nkv, d), cos2, sin2)
    v = qkv[:, (nh + nkv) * d:].view(T, nkv, d)
    others = torch.ones(slots, dtype=torch.bool, device=dev)
    others[sl] = False
    untouched = bool(kc[:, others].isnan().all() and vc[:, others].isnan().all())
    labels_ok = (not ring) or bool((labels[sl] == pos).all() and (labels[others] == -1).all())
    return q, ref[:, :nh], kc[:, sl].transpose(0, 1), ref[:, nh:], vc[:, sl].transpose(0, 1), v, labels_ok, untouched


def _close(a, b, exact):
    if exact:
        return torch.equal(a, b)
    ulp = b.float().abs() * 2.0 ** -7 + 1e-30
    return bool(((a.float() - b.float()).abs() <= ulp).all())


def passes(res, exact):
    q, q_ref, k, k_ref, v, v_ref, labels_ok, untouched = res
    return (_close(q, q_ref, exact) and _close(k, k_ref, exact) and torch.equal(v, v_ref)
            and labels_ok and untouched)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 6, 8])
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
@pytest.mark.parametrize("in_kernel", [False, True], ids=["tables", "angles"])
def test_gpu(T, ring, shape, in_kernel):
    R = load_kernels("rope")
    for start in (0, 4157, 70001, 1_000_003):
        slots = 4160 if ring else start + T + 64
        assert passes(run_case(R, shape, T, start, slots, ring, seed=start + T, in_kernel=in_kernel), exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("bug", ["_rope_bug", "_slot_bug", "_angle_bug"])
def test_gpu_negative_controls(bug):
    R = load_kernels("rope")
    assert not passes(run_case(R, Q1, 6, 70001, 4160, True, seed=1, in_kernel=True, **{bug: True}), exact=True)
    if bug != "_angle_bug":
        assert not passes(run_case(R, Q1, 6, 4157, 4160, True, seed=1, **{bug: True}), exact=True)


@cpu_only
@pytest.mark.parametrize("ring,start", [(False, 300), (True, 1000)])
@pytest.mark.parametrize("in_kernel", [False, True], ids=["tables", "angles"])
def test_interp(ring, start, in_kernel):
    R = load_kernels("rope")
    assert passes(run_case(R, MINI, 6, start, 576 if ring else start + 70, ring, seed=start, in_kernel=in_kernel),
                  exact=False)


@cpu_only
@pytest.mark.parametrize("bug", ["_rope_bug", "_slot_bug", "_angle_bug"])
def test_interp_negative_controls(bug):
    R = load_kernels("rope")
    # (at position ~3e6 an FP32 angle is off by up to ~0.1 rad: far past one BF16 step)
    start = 3_000_017 if bug == "_angle_bug" else 1000
    assert not passes(run_case(R, MINI, 6, start, 576, True, seed=2, in_kernel=True, **{bug: True}), exact=False)


def _tables_case(R, d, start, **kw):
    dev = _dev()
    pos = torch.arange(start, start + 8, device=dev)
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d)
    ang = pos.double()[:, None] * inv_freq[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    c2, s2 = R.rope_tables(pos, inv_freq, **kw)
    return c2, s2, torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]


@pytest.mark.gpu
@pytest.mark.parametrize("start", [0, 4157, 70001, 1_000_003])
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_tables(start, d):
    """rope_tables equals torch's FP64 tables rounded to FP32, bit for bit; the FP32-angle negative
    control does not (checked where its angle error shows: past a few thousand)."""
    R = load_kernels("rope")
    c2, s2, c_ref, s_ref = _tables_case(R, d, start)
    assert torch.equal(c2, c_ref) and torch.equal(s2, s_ref)
    if start > 4000:
        c2b, s2b, _, _ = _tables_case(R, d, start, _angle_bug=True)
        assert not (torch.equal(c2b, c_ref) and torch.equal(s2b, s_ref))


@cpu_only
def test_interp_tables():
    """In the interpreter (NumPy's FP64 cos / sin): within one FP32 ulp of torch's; the negative
    control (FP32 angle) far from them at position ~3e6."""
    R = load_kernels("rope")
    for start, bug, ok in ((300, False, True), (3_000_017, True, False)):
        c2, s2, c_ref, s_ref = _tables_case(R, 64, start, _angle_bug=bug)
        err = max((c2 - c_ref).abs().max().item(), (s2 - s_ref).abs().max().item())
        assert (err <= 2.0 ** -23) == ok, (start, err)


def parts_case(R, L, shape, T, start, ring, seed, drop=False, tiling=(32, 4)):
    """rope_kv_write fed the Q/K/V projection's split-K partials (``qkv_parts``) against the same
    call fed the projection's own BF16 output (its last arriver's sum): (q equal, K rows equal, V rows
    equal, untouched rows still NaN in both). ``drop``: negative control, the last slice left out.
    ``tiling``: the projection's (block_n, split_k[, block_k])."""
    nh, nkv, d = shape["nh"], shape["nkv"], shape["d"]
    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    n, k = (nh + 2 * nkv) * d, 512
    x = (torch.randn(T, k, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).to(dev)
    bn, sk, bk = (*tiling, None)[:3]
    qkv = L.skinny_linear(x, w, block_n=bn, split_k=sk, block_k=bk)
    parts = L.skinny_linear(x, w, block_n=bn, split_k=sk, block_k=bk, partials=True)
    assert parts.shape[0] == sk and parts.shape[1] >= T and parts.dtype == torch.float32
    assert torch.equal(L.sum_partials(parts)[:T], qkv) or not HAS_CUDA   # (the interpreter truncates)
    if drop:
        parts = parts[:-1]
    pos = torch.arange(start, start + T, device=dev)
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64, device=dev) / d)
    slots = 576 if ring else start + T + 16
    out = []
    for src in ({"qkv": qkv}, {"qkv": None, "qkv_parts": parts}):
        kc = torch.full((nkv, slots, d), float("nan"), dtype=torch.bfloat16, device=dev)
        vc = torch.full_like(kc, float("nan"))
        labels = torch.full((slots,), -1, dtype=torch.int64, device=dev) if ring else None
        q = torch.full((T, nh, d), float("nan"), dtype=torch.bfloat16, device=dev)
        R.rope_kv_write(**src, cos2=None, sin2=None, nh=nh, nkv=nkv, k_cache=kc, v_cache=vc,
                        slots=None if ring else pos, q_out=q, labels=labels, positions=pos, inv_freq=inv_freq,
                        ring_slots=slots if ring else None)
        out.append((q, kc, vc, labels))
    (q0, k0, v0, l0), (q1, k1, v1, l1) = out
    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))   # NaN rows: untouched in both
    return same(q0, q1), same(k0, k1), same(v0, v1), l0 is None or torch.equal(l0, l1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 6, 8])
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("shape", [Q1, MINI], ids=["q1", "mini"])
@pytest.mark.parametrize("tiling", [(32, 4), (64, 8), (64, 8, 64)], ids=["32x4", "64x8", "64x8_bk64"])
def test_gpu_qkv_parts(T, ring, shape, tiling):
    """(64 x 8 in K steps of 64: the q1 Q/K/V projection's planned tiling with partials.)"""
    R, L = load_kernels("rope"), load_kernels("linear")
    assert all(parts_case(R, L, shape, T, 4157, ring, seed=T, tiling=tiling))
    q_ok, k_ok, v_ok, _ = parts_case(R, L, shape, T, 4157, ring, seed=T, drop=True, tiling=tiling)
    assert not q_ok and not k_ok and not v_ok


@cpu_only
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("tiling", [(32, 4), (64, 8, 64)], ids=["32x4", "64x8_bk64"])
def test_interp_qkv_parts(ring, tiling):
    R, L = load_kernels("rope"), load_kernels("linear")
    assert all(parts_case(R, L, MINI, 6, 1000, ring, seed=3, tiling=tiling))
    q_ok, k_ok, v_ok, _ = parts_case(R, L, MINI, 6, 1000, ring, seed=3, drop=True, tiling=tiling)
    assert not q_ok and not k_ok and not v_ok
