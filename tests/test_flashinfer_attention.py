"""experiments/flashinfer_attention.py: FlashInfer's attention as ab_attention replays it beside the
runtime's. On the CPU: the sink applied from a base-2 log-sum-exp gives the runtime's reference output
(negative control: the same lse read in the natural base does not), the page view is the cache's
bytes, config names parse. On a GPU with FlashInfer installed: every config against the reference,
with the module's own negative control (skipped where FlashInfer is not importable)."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "experiments"))

import flashinfer_attention as FI  # noqa: E402
from runtime.kernels.attention import attention_reference  # noqa: E402


def _inputs(w=6, nh=6, d=64, start=300, cap=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(w, nh, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, cap, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, cap, d, generator=g, dtype=torch.float64)
    sinks = torch.randn(nh, generator=g, dtype=torch.float64) + math.log(start)
    return q, k, v, sinks


def _lse2(q, k, start):
    """log2 sum_j e^{s_j} over each row's visible keys: what FlashInfer's prefill returns as lse."""
    w, nh, d = q.shape
    n = start + w
    s = torch.einsum("whd,nd->whn", q, k[0, :n]) / math.sqrt(d)
    vis = torch.arange(n)[None, :] <= (start + torch.arange(w))[:, None]
    s = s.masked_fill(~vis[:, None, :], float("-inf"))
    return torch.logsumexp(s, -1) / math.log(2.0)


def test_apply_sink_from_a_base2_lse_is_the_reference():
    q, k, v, sinks = _inputs()
    start = 300
    o = attention_reference(q, k, v, start, None)
    want = attention_reference(q, k, v, start, sinks)
    got = FI.apply_sink(o, _lse2(q, k, start), sinks)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)   # apply_sink works in FP32, as on the GPU
    # the sinks take a visible share of the mass here, so leaving them out is far off
    assert (o - want).abs().max() > 1e-2


def test_apply_sink_rejects_a_natural_base_reading():   # negative control
    q, k, v, sinks = _inputs(seed=1)
    start = 300
    o = attention_reference(q, k, v, start, None)
    want = attention_reference(q, k, v, start, sinks)
    bad = FI.apply_sink(o, _lse2(q, k, start), sinks, lse_base2=False)
    assert (bad - want).abs().max() > 1e-2


def test_page_view_is_the_cache_in_order():
    k = torch.randn(1, 96, 8)
    pv = FI.paged(k, 16)
    assert pv.shape == (6, 16, 1, 8) and pv.data_ptr() == k.data_ptr()
    assert torch.equal(pv[2, 5, 0], k[0, 2 * 16 + 5])
    with pytest.raises(ValueError, match="one KV head"):
        FI.paged(torch.randn(2, 96, 8), 16)
    with pytest.raises(ValueError, match="multiple of the page size"):
        FI.paged(torch.randn(1, 100, 8), 16)


def test_config_names():
    assert FI.parse("fi_fa3_p16_sink") == ("fa3", 16, True)
    assert FI.parse("fi_auto_p1") == ("auto", 1, False)
    assert FI.parse("fi_holistic_p64_sink") == ("holistic", 64, True)
    for bad in ("fi_fa4_p16", "fi_holistic", "fi_fa2", "fa2_p16", "fi_fa2_p16_sinks"):
        with pytest.raises(ValueError):
            FI.parse(bad)


@pytest.mark.gpu
def test_flashinfer_configs_match_the_reference_on_the_gpu():
    if FI.available() is None:
        pytest.skip("FlashInfer is not installed (flashinfer_attention.py says how to carry it)")
    rows = FI.check(["fi_fa2_p16", "fi_fa2_p16_sink"], contexts=(4096 + 64,), widths=(6,))
    ctl = [r for r in rows if "control" in r["config"]]
    assert len(ctl) == 1 and ctl[0]["err"] > 2e-2
    assert all(r["err"] < 2e-2 for r in rows if "control" not in r["config"])


def test_report_lines_name_flashinfer_times():
    import copy
    import kernel_report as K
    _, rows, _ = K.load(os.path.join(HERE, "..", "experiments", "results", "kernels_s28", "call8", "bench"))
    rows = copy.deepcopy(rows)
    for r in rows:
        if r["kernel"] == "attention" and r["variant"] == "default" and r["shape"].startswith("full"):
            r.update(torch_flex_us=5 * r["graph_us"], fi_us=1.5 * r["graph_us"], fi_sink_us=2.25 * r["graph_us"])
    line = [x for x in K.torch_lines(rows) if x.startswith("attention full64K_w6 ")][0]
    assert "against torch and FlashInfer" in line
    assert "FA2, 64-token pages (no sink): " in line and "(1.5x the runtime's time)" in line
    assert "the same with the sink: " in line and "(2.2x the runtime's time)" in line
    # negative control: without FlashInfer times (NaN, as a run without it would have none) the line
    # names torch alone and no FlashInfer figure
    for r in rows:
        for key in ("fi_us", "fi_sink_us"):
            if key in r:
                r[key] = math.nan
    line = [x for x in K.torch_lines(rows) if x.startswith("attention full64K_w6 ")][0]
    assert "against torch:" in line and "FlashInfer" not in line
