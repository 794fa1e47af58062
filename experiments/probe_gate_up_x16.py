"""Probe (session 12): v1 Gate/Up alone with BF16 x (cast to FP16 on every tile) against an FP16 copy
of the same values, and whether the activations are bit-identical.

    python3 experiments/probe_gate_up_x16.py        # on the GPU machine, from the repository root

q1 rank shard (H 6144, I 256, 128 experts), 6 rows, 38 distinct experts; three rotating weight sets
(3 x 384 MiB of Gate/Up weights, beyond the L2), CUDA-graph replay as bench_kernels.py. Result and
decision: experiments/notes/kernels.md, "Session 12".
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bench_kernels import graph_time, routing  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402

def main():
    H, I, E, w = 6144, 256, 128, 6
    sets = []
    for i in range(3):
        w13 = torch.randn(E, 2 * I, H, device="cuda").to(torch.float8_e4m3fn)
        s13 = (torch.rand(E, 2 * I // 128, H // 128, device="cuda") + 0.5) / math.sqrt(H)
        ids = routing(w, E, 38, seed=i).cuda()
        x = torch.randn(w, H, device="cuda").to(torch.bfloat16)
        act = torch.empty(w * 8, I, device="cuda", dtype=torch.float8_e4m3fn)
        asc = torch.empty(w * 8, I // 32, device="cuda")
        sets.append((x, x.to(torch.float16), ids, w13, s13, act, asc))
    for name, xi, kw in [("bf16_x", 0, {}), ("fp16_x", 1, {}), ("bf16_x_again", 0, {}), ("fp16_x_again", 1, {}),
                         ("bf16_x_st3", 0, dict(num_stages=3)), ("fp16_x_st3", 1, dict(num_stages=3)),
                         ("fp16_x_st6", 1, dict(num_stages=6))]:
        calls = [(lambda s=s, kw=kw, xi=xi: M._launch_gate_up(s[xi], s[2], s[3], s[4], s[5], s[6], w * 8, **kw)) for s in sets]
        t = graph_time(calls)[0]
        print(f"{name:>14} gate_up {t*1e6:7.2f} us", flush=True)
    # correctness: same activations from bf16 and fp16 x
    s = sets[0]
    M._launch_gate_up(s[0], s[2], s[3], s[4], s[5], s[6], w * 8); a1 = s[5].clone(); c1 = s[6].clone()
    M._launch_gate_up(s[1], s[2], s[3], s[4], s[5], s[6], w * 8); a2 = s[5].clone(); c2 = s[6].clone()
    print("identical activations:", torch.equal(a1.view(torch.uint8), a2.view(torch.uint8)), torch.equal(c1, c2))


if __name__ == "__main__":
    main()
