"""Attention with a sink, and the sliding ring: every live row sees exactly its window."""
import random

import pytest
import torch

from runtime.model import KVCache, attend, visible_keys, write_decode


def _naive_sink_attention(q, k, v, visible, sinks):
    T, nh, d = q.shape
    nkv = k.shape[0]
    out = torch.empty(T, nh, d, dtype=torch.float64)
    for h in range(nh):
        kh, vh = k[h // (nh // nkv)].double(), v[h // (nh // nkv)].double()
        s = (q[:, h].double() @ kh.T) / d ** 0.5
        s = s.masked_fill(~visible, float("-inf"))
        s = torch.cat([s, sinks[h].double().expand(T, 1)], dim=1)   # the sink: one more logit…
        p = torch.softmax(s, dim=1)[:, :-1]                           # …whose value is zero
        out[:, h] = p @ vh
    return out


@pytest.mark.parametrize("T,S,nh,nkv", [(1, 7, 6, 1), (8, 50, 6, 2), (5, 300, 4, 4)])
def test_attention_with_sink_equals_naive_softmax(T, S, nh, nkv):
    g = torch.Generator().manual_seed(T * 1000 + S)
    q = torch.randn(T, nh, 16, generator=g)
    k, v = torch.randn(nkv, S, 16, generator=g), torch.randn(nkv, S, 16, generator=g)
    sinks = torch.randn(nh, generator=g) * 2
    visible = torch.rand(T, S, generator=g) < 0.7
    visible[:, 0] = True
    ref = _naive_sink_attention(q, k, v, visible, sinks)
    got = attend(q, k, v, visible, sinks).double()
    assert (got - ref).norm() / ref.norm() < 1e-6
    # negative control: without the sink the result is measurably different
    no_sink = attend(q, k, v, visible, torch.full_like(sinks, -1e9)).double()
    assert (no_sink - ref).norm() / ref.norm() > 1e-3


def _ring_sees_exact_window(window: int, slots: int, seed: int = 0) -> None:
    """Drive a ring through speculative rounds (widths 4..8, random rollbacks). K carries the
    position in an independent payload (not the slot labels); every live row must see exactly the
    payloads {p - window + 1, ..., p}."""
    rnd = random.Random(seed)
    cache = KVCache("sliding", 1, slots, 2, torch.float64, "cpu", window)
    start = 0
    # a prefill that fills the ring
    while start < window:
        pos = torch.arange(start, start + 8)
        write_decode(cache, pos, pos.double().view(1, -1, 1).expand(1, 8, 2), torch.zeros(1, 8, 2, dtype=torch.float64))
        start += 8
    for _ in range(3 * slots // 4):
        w = rnd.randint(4, 8)
        pos = torch.arange(start, start + w)
        payload = pos.double().view(1, -1, 1).expand(1, w, 2)
        keys, _, kpos = write_decode(cache, pos, payload, torch.zeros_like(payload))
        vis = visible_keys(cache, kpos, pos)
        for i in range(w):
            seen = sorted(keys[0, vis[i], 0].long().tolist())
            p = start + i
            assert seen == list(range(max(0, p - window + 1), p + 1)), f"row at {p} sees {seen[:3]}…"
        start += rnd.randint(1, w)   # accepted prefix + 1: the rest of the rows roll back


@pytest.mark.parametrize("window", [32, 4096])
def test_ring_every_row_sees_its_window(window):
    _ring_sees_exact_window(window, window + 64)


@pytest.mark.parametrize("window", [32, 4096])
def test_window_sized_ring_fails(window):
    """Negative control: a ring of exactly `window` slots loses history a live row still needs."""
    with pytest.raises(AssertionError):
        _ring_sees_exact_window(window, window)
