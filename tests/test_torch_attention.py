"""experiments/torch_attention.py: torch's own attentions that bench_kernels times beside the runtime's
(what a torch user would run for the same call) compute that call, checked on the CPU against the
runtime's FP64 reference, each with a negative control; and kernel_report's lines and figures of them."""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "experiments"))

import kernel_report as K  # noqa: E402
import torch_attention as TA  # noqa: E402
from runtime.kernels.attention import attention_reference  # noqa: E402

RUN = os.path.join(HERE, "..", "experiments", "results", "kernels_s28", "call8", "bench")


def _inputs(w, nh=6, nkv=1, d=64, start=300, cap=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(w, nh, d, generator=g)
    k, v = torch.randn(nkv, cap, d, generator=g), torch.randn(nkv, cap, d, generator=g)
    sinks = torch.randn(nh, generator=g) + math.log(start)     # a visible share of the mass, as the bench's
    return q, k, v, sinks


def _err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("w,nkv", [(4, 1), (6, 1), (8, 2)])
def test_sdpa_is_the_call_without_its_sink(w, nkv):
    q, k, v, sinks = _inputs(w, nkv=nkv, seed=w)
    start = 300
    got = TA.sdpa_attention(q, k, v, start)
    assert got.shape == q.shape
    assert _err(got, attention_reference(q, k, v, start, None)) < 1e-6
    # SDPA has no sink: against the call with its sink it is measurably off (what the bench says of it)
    assert _err(got, attention_reference(q, k, v, start, sinks)) > 1e-2
    # negative control: the causal boundary one key early is caught
    early = TA.sdpa_attention(q, k, v, start, boundary_shift=-1)
    assert _err(early, attention_reference(q, k, v, start, None)) > 1e-3


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("w,nkv", [(4, 1), (6, 1), (8, 2)])
def test_flex_with_the_sink_from_its_lse_is_the_call(w, nkv, packed):
    q, k, v, sinks = _inputs(w, nkv=nkv, seed=10 + w)
    start = 300
    ref = attention_reference(q, k, v, start, sinks)
    got = TA.flex_attention_sink(q, k, v, start, sinks, packed=packed)
    assert got.shape == q.shape
    assert _err(got, ref) < 1e-6
    # negative controls: the sink left out; the causal boundary one key late (every row but the last
    # would see the next row's key)
    assert _err(TA.flex_attention_sink(q, k, v, start, sinks, apply_sink=False, packed=packed), ref) > 1e-2
    g = 6 // nkv if packed else 1
    late = TA.causal_block_mask(w, start + w, "cpu", group=g, boundary_shift=1)
    assert _err(TA.flex_attention_sink(q, k, v, start, sinks, block_mask=late, packed=packed), ref) > 1e-3


def test_flex_packed_rows_map_to_their_heads():
    """Negative control of the packing: the same packed rows with the heads' sinks permuted (each row's
    sink taken from another head) is caught; so is a mask built for one head's rows only."""
    q, k, v, sinks = _inputs(6, seed=3)
    ref = attention_reference(q, k, v, 300, sinks)
    assert _err(TA.flex_attention_sink(q, k, v, 300, sinks.roll(1)), ref) > 1e-3
    with pytest.raises(Exception):
        TA.flex_attention_sink(q, k, v, 300, sinks, block_mask=TA.causal_block_mask(6, 306, "cpu", group=1))


def test_calls_run_every_set_of_a_bench_shape():
    """``calls`` as bench_kernels builds them: one call per input set, each on its own set's inputs."""
    w, start = 6, 200
    data = []
    for seed in range(3):
        q, k, v, s = _inputs(w, start=start, cap=start + w + 16, seed=seed)
        data.append((q, k, v, s, torch.tensor(start), torch.empty_like(q)))
    for kind in ("sdpa", "flex"):
        fns = TA.calls(kind, data, start + w, backend="math", fn=TA.flex_attention)
        assert len(fns) == len(data)
        for fn, (q, k, v, s, *_) in zip(fns, data):
            ref = attention_reference(q, k, v, start, s if kind == "flex" else None)
            assert _err(fn(), ref) < 1e-6
    # negative control: set 0's call against set 1's inputs is not the same call
    fns = TA.calls("flex", data, start + w, fn=TA.flex_attention)
    q, k, v, s, *_ = data[1]
    assert _err(fns[0](), attention_reference(q, k, v, start, s)) > 1e-2


def test_sdpa_backends_lists_only_what_runs():
    q, k, v, _ = _inputs(6)
    names = TA.sdpa_backends(q, k, v, 300)
    assert set(names) <= set(TA.FUSED)
    for name in names:     # each listed backend really runs this shape
        assert _err(TA.sdpa_attention(q, k, v, 300, name), attention_reference(q, k, v, 300, None)) < 1e-3


def _with_torch(rows):
    """A copy of the session-28 run whose full-cache default attention rows carry torch times: flex
    5x and SDPA (flash) 12x the runtime's time."""
    rows = copy.deepcopy(rows)
    for r in rows:
        if r["kernel"] == "attention" and r["variant"] == "default" and r["shape"].startswith("full"):
            r.update(torch_flex_us=5 * r["graph_us"], torch_sdpa_us=12 * r["graph_us"], torch_sdpa_backend="flash")
    return rows


def test_torch_lines_and_series():
    payload, rows, _ = K.load(RUN)
    assert K.torch_lines(rows) == []      # runs before session 36 have no torch times: nothing printed
    rows = _with_torch(rows)
    lines = K.torch_lines(rows)
    assert len(lines) == 12               # 4 full-cache contexts x 3 widths
    line = [x for x in lines if x.startswith("attention full64K_w6 ")][0]
    assert "(5.0x the runtime's time)" in line and "(12.0x the runtime's time)" in line and "flash" in line
    series = K.attention_series(rows, payload["env"]["copy_bw"])
    flex = dict(series[6]["torch flex_attention, compiled (with the sink)"])
    default = dict(series[6]["attention (default)"])
    for keys, frac in default.items():    # a time 5x the kernel's is a fifth of its fraction
        assert flex[keys] == pytest.approx(frac / 5)
    # negative control: a row with only NaN torch times prints nothing
    for r in rows:
        for key, _ in K.TORCH:
            if key in r:
                r[key] = math.nan
    assert K.torch_lines(rows) == []


def test_figures_with_torch_rows(tmp_path):
    payload, rows, _ = K.load(RUN)
    written = K.write_figures(_with_torch(rows), payload["env"], str(tmp_path))
    assert len(written) == 3
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
