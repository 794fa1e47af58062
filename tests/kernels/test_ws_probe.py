"""experiments/_ws_attention.py, session 34's warp-specialized split (a measurement probe, not a runtime
kernel): its record summary and config names on the CPU, and on the GPU its correctness check with the
negative control that check carries (the runtime's output for a start_pos one block early must fail it)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "experiments"))

import _ws_attention as WS  # noqa: E402


def _records(splits, cons, blocks, landed_wait, block_ns, epilogue_ns):
    """Synthetic timeline records: each consumer's blocks wait ``landed_wait`` ns and take ``block_ns`` ns."""
    rec = torch.zeros(splits * cons, WS.TL_WORDS, dtype=torch.int64)
    t0 = 10_000_000
    for sp in range(splits):
        ends = []
        for c in range(cons):
            row = sp * cons + c
            if c == 0:
                rec[row, 0] = t0 + 100 * sp
            t = t0 + 2_000 + 300 * c
            for j in range(blocks // cons):
                rec[row, 3 + 2 * j] = t
                rec[row, 4 + 2 * j] = t + landed_wait
                t = t + landed_wait + block_ns
            ends.append(t)
            rec[row, 1] = t + epilogue_ns
        rec[sp * cons, 2] = max(ends)
        rec[sp * cons, 1] = max(ends) + epilogue_ns
    return rec


def test_summary_places_the_last_block_and_the_epilogue():
    s = WS._summary(_records(3, 1, 8, 500, 700, 600), 3, 1)
    assert s["programs"] == 3
    assert s["block_us"] == pytest.approx(0.7)
    assert s["last_block"] == pytest.approx(0.7)   # loops done - last landing = the last block's arithmetic
    assert s["epilogue"] == pytest.approx(0.6)
    assert s["first_landed"] == pytest.approx(2.5)
    assert s["ready_of_last3"] == 0                # every block was waited for
    fast = WS._summary(_records(3, 1, 8, 10, 700, 600), 3, 1)
    assert fast["ready_of_last3"] == 3             # (negative control of the count: landed before asked)
    two = WS._summary(_records(3, 2, 8, 500, 700, 600), 3, 2)
    assert two["last_block"] == pytest.approx(0.7)   # from the later consumer's last landing
    # a split whose loops-done word is missing is left out, not read as zero
    broken = _records(3, 1, 8, 500, 700, 600)
    broken[1, 2] = 0
    assert WS._summary(broken, 3, 1)["programs"] == 2


def test_options_and_the_odd_stage_guard():
    assert WS.options("ws2_s4_d_n_r200") == dict(consumers=2, stages=4, direct=True, nomath=True, cons_regs=200)
    assert WS.options("ws1_s3") == dict(consumers=1, stages=3, direct=False, nomath=False, cons_regs=232)
    with pytest.raises(ValueError):
        WS.options("ws3_s4")
    with pytest.raises(ValueError, match="even stage count"):   # call 1's ws2_s5 fault
        WS.launch(None, None, None, None, None, None, kd=None, vd=None, stages=5, consumers=2)


@pytest.mark.gpu
def test_ws_split_matches_the_reference_and_rejects_the_control():
    if WS.gluon is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Gluon and sm_90+")
    rows = WS.check(contexts=(16384 + 3, 65536 + 5), widths=(6,), configs=("ws1_s3", "ws1_s3_d", "ws2_s4"))
    for r in rows:
        assert all(r["ok"].values()), r
        assert r["neg_rejected"], r
