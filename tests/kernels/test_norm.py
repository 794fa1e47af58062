"""Fused residual add + RMSNorm against an FP64 reference.

The residual written back must equal the residual sum rounded to its dtype (exactly on the GPU;
within one BF16 step in the interpreter, whose FP32->BF16 conversion truncates); the normalised
output is checked by the max per-row relative error. Negative control: normalising by the RMS of
x instead of the RMS of the sum must fail the same check. ``rmsnorm`` (no residual): the output
against the reference with a zero residual, ``x_out`` exactly x; negative control: a kernel that adds
the (poisoned) old contents of ``x_out``. ``rmsnorm`` with ``ids`` (embedding rows of a vocabulary
slice): x_out exactly the reference's masked gather; negative control: a wrong slice start.
"""
from __future__ import annotations

import pytest
import torch

from ._checks import max_row_rel_err
from .conftest import HAS_CUDA, cpu_only, load_kernels

TOL = 1e-2


def run_case(Nm, w, H, res_dtype, seed, **kw):
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(dev)
    res = (torch.randn(w, H, generator=g) * 4).to(res_dtype).to(dev)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    r_ref, n_ref = Nm.add_rmsnorm_reference(x, res, wt, 1e-6)
    out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=dev)
    Nm.fused_add_rmsnorm(x, res, wt, 1e-6, out, **kw)
    return res, r_ref, max_row_rel_err(out, n_ref)


def _residual_ok(res, r_ref, exact):
    if exact:
        return torch.equal(res, r_ref)
    ulp = r_ref.float().abs() * 2.0 ** -7 + 1e-30
    return bool(((res.float() - r_ref.float()).abs() <= ulp).all())


@pytest.mark.gpu
@pytest.mark.parametrize("w", [4, 5, 6, 7, 8])
@pytest.mark.parametrize("H", [6144, 256])
@pytest.mark.parametrize("res_dtype", [torch.bfloat16, torch.float32])
def test_gpu(w, H, res_dtype):
    Nm = load_kernels("norm")
    res, r_ref, err = run_case(Nm, w, H, res_dtype, seed=w * H)
    assert _residual_ok(res, r_ref, exact=True)
    assert err < TOL


def _weight_first_same(Nm, w, H, res_dtype):
    """The weight loaded before the wait or after the sum of squares: the same residual and output,
    bit for bit (only the load moves). Both are also checked against the FP64 reference."""
    outs = []
    for first in (True, False):
        res, r_ref, err = run_case(Nm, w, H, res_dtype, seed=11, weight_first=first)
        assert err < TOL
        outs.append(res)
    dev = outs[0].device
    g = torch.Generator().manual_seed(12)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(dev)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    o = [Nm.rmsnorm(x, wt, 1e-6, weight_first=first) for first in (True, False)]
    return torch.equal(outs[0], outs[1]) and torch.equal(o[0], o[1])


@pytest.mark.gpu
@pytest.mark.parametrize("H,res_dtype", [(6144, torch.bfloat16), (6144, torch.float32), (256, torch.bfloat16)])
def test_gpu_weight_first_same_values(H, res_dtype):
    assert _weight_first_same(load_kernels("norm"), 6, H, res_dtype)


@cpu_only
def test_interp_weight_first_same_values():
    assert _weight_first_same(load_kernels("norm"), 4, 256, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [6144, 256])
def test_gpu_negative_control(H):
    Nm = load_kernels("norm")
    _, _, err = run_case(Nm, 8, H, torch.bfloat16, seed=1, _norm_bug=True)
    assert err > TOL


@cpu_only
@pytest.mark.parametrize("H,res_dtype", [(256, torch.bfloat16), (6144, torch.float32)])
def test_interp(H, res_dtype):
    Nm = load_kernels("norm")
    res, r_ref, err = run_case(Nm, 6, H, res_dtype, seed=H)
    assert _residual_ok(res, r_ref, exact=res_dtype == torch.float32)
    assert err < TOL


@cpu_only
def test_interp_negative_control():
    Nm = load_kernels("norm")
    _, _, err = run_case(Nm, 6, 256, torch.bfloat16, seed=1, _norm_bug=True)
    assert err > TOL


def _out16_case(Nm, w, H, seed, **kw):
    """(out, out16) of one call with the FP16 copy requested."""
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(w, H, generator=g).to(torch.bfloat16).to(dev)
    res = (torch.randn(w, H, generator=g) * 4).to(torch.bfloat16).to(dev)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=dev)
    out16 = torch.full((w, H), float("nan"), dtype=torch.float16, device=dev)
    Nm.fused_add_rmsnorm(x, res, wt, 1e-6, out, out16=out16, **kw)
    return out, out16


def _check_out16(Nm, w, H, seed):
    """out16 holds exactly out's BF16 values (what the MoE would convert them to); the negative
    control (rounded from FP32 instead) differs from them."""
    out, out16 = _out16_case(Nm, w, H, seed)
    assert torch.equal(out16, out.to(torch.float16))
    out_b, out16_b = _out16_case(Nm, w, H, seed, _round16_bug=True)
    assert torch.equal(out_b, out)
    assert not torch.equal(out16_b, out.to(torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("w,H", [(6, 6144), (8, 256)])
def test_gpu_out16_is_the_bf16_output(w, H):
    _check_out16(load_kernels("norm"), w, H, seed=w + H)


@cpu_only
def test_interp_out16_is_the_bf16_output():
    _check_out16(load_kernels("norm"), 6, 256, seed=3)


def _rmsnorm_ok(Nm, w, H, seed, **kw):
    """rmsnorm's output within TOL of the FP64 reference (zero residual) and x_out exactly x, both
    written over NaN."""
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(w, H, generator=g) * 3).to(torch.bfloat16).to(dev)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    _, n_ref = Nm.add_rmsnorm_reference(x, torch.zeros_like(x), wt, 1e-6)
    out = torch.full((w, H), float("nan"), dtype=torch.bfloat16, device=dev)
    x_out = torch.full_like(out, float("nan"))
    Nm.rmsnorm(x, wt, 1e-6, out, x_out=x_out, **kw)
    out2 = Nm.rmsnorm(x, wt, 1e-6)                # without x_out: the same output
    return bool(max_row_rel_err(out, n_ref) < TOL and torch.equal(x_out, x) and torch.equal(out2, out))


@pytest.mark.gpu
@pytest.mark.parametrize("w,H", [(1, 6144), (6, 6144), (8, 256)])
def test_gpu_rmsnorm(w, H):
    Nm = load_kernels("norm")
    assert _rmsnorm_ok(Nm, w, H, seed=w + H)
    assert not _rmsnorm_ok(Nm, w, H, seed=w + H, _stale_bug=True)


@cpu_only
def test_interp_rmsnorm():
    Nm = load_kernels("norm")
    assert _rmsnorm_ok(Nm, 6, 256, seed=5)
    assert not _rmsnorm_ok(Nm, 6, 256, seed=5, _stale_bug=True)


def _gather_ok(Nm, H, vocab_start, kernel_start):
    """rmsnorm with ids (the embedding rows of one vocabulary slice, zero outside it, then the norm):
    x_out equals the reference's embed_tokens exactly and the output is within TOL of the FP64 norm
    of it. ``kernel_start`` is what the kernel is told (the negative control: a wrong slice start)."""
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    g = torch.Generator().manual_seed(H + vocab_start)
    V = 96
    table = torch.randn(V, H, generator=g).to(torch.bfloat16).to(dev)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(dev)
    ids = torch.tensor([vocab_start, vocab_start + 5, vocab_start + V - 1, vocab_start + V, 3, vocab_start + 40],
                       device=dev)
    local = ids - vocab_start
    inside = (local >= 0) & (local < V)
    e = table[local.clamp(0, V - 1)] * inside[:, None].to(torch.bfloat16)
    _, n_ref = Nm.add_rmsnorm_reference(e, torch.zeros_like(e), wt, 1e-6)
    out = torch.full((6, H), float("nan"), dtype=torch.bfloat16, device=dev)
    x_out = torch.full_like(out, float("nan"))
    Nm.rmsnorm(table, wt, 1e-6, out, x_out=x_out, ids=ids, vocab_start=kernel_start)
    err = max_row_rel_err(out[inside], n_ref[inside])
    return bool(torch.equal(x_out, e) and err < TOL and (out[~inside] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("H", [6144, 256])
def test_gpu_rmsnorm_gathers_embedding_rows(H):
    Nm = load_kernels("norm")
    assert _gather_ok(Nm, H, 200, 200) and _gather_ok(Nm, H, 0, 0)
    assert not _gather_ok(Nm, H, 200, 0)


@cpu_only
def test_interp_rmsnorm_gathers_embedding_rows():
    Nm = load_kernels("norm")
    assert _gather_ok(Nm, 256, 200, 200) and _gather_ok(Nm, 256, 0, 0)
    assert not _gather_ok(Nm, 256, 200, 0)
