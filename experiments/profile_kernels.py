"""Hardware-counter profile of the two kernels that miss their bandwidth goals (issue 7), for ncu.

    ncu --clock-control none --profile-from-start off --set full -o $OUT/prof \
        python3 experiments/profile_kernels.py [--moe-only | --attn-only] [--attn-variants=v1,v2]

Runs, at the q1 rank-emulation shard: one MoE call (v1, default Down shape, 6 rows, 38 distinct experts)
and one split-KV attention call (v1, 64K context, 6 rows), each after a warm-up (compilation) outside
the profiled range (cudaProfilerStart / Stop around the measured calls). Without ncu it just runs.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_kernels import MOE, routing  # noqa: E402
from runtime.kernels import attention as A  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402


def moe_call():
    H, I, E, w = MOE["H"], MOE["I"], MOE["E"], MOE["w"]
    w13 = torch.randn(E, 2 * I, H, device="cuda").to(torch.float8_e4m3fn)
    s13 = (torch.rand(E, 2 * I // 128, H // 128, device="cuda") + 0.5) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda").to(torch.float8_e4m3fn)
    s2 = (torch.rand(E, H // 128, I // 128, device="cuda") + 0.5) / math.sqrt(I)
    ids = routing(w, E, MOE["realistic"], seed=0).cuda()
    tw = torch.softmax(torch.rand(w, 8, device="cuda"), 1)
    x = torch.randn(w, H, device="cuda").to(torch.bfloat16).to(torch.float16)   # the norm's FP16 copy (runtime)
    out = torch.empty(w, H, device="cuda", dtype=torch.bfloat16)
    return lambda: M.fused_moe_fp8(x, ids, tw, w13, s13, w2, s2, out)


def attn_call(ctx=65536, w=6, variant=None):
    q = torch.randn(w, 6, 128, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, ctx + 64, 128, device="cuda").to(torch.bfloat16)
    v = torch.randn(1, ctx + 64, 128, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(6, device="cuda") + math.log(ctx)
    sp = torch.tensor(ctx - w, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)
    return lambda: A.decode_attention_full(q, k, v, sp, sinks, o, variant=variant)


def main():
    calls = []
    if "--attn-only" not in sys.argv:
        calls.append(moe_call())
    if "--moe-only" not in sys.argv:
        # --attn-variants v1,v2: one call of each attention variant (default: the module default)
        names = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--attn-variants=")), None)
        calls += [attn_call(variant=v) for v in (names.split(",") if names else [None])]
    for c in calls:       # compile + warm
        c()
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", len(calls), "calls", flush=True)


if __name__ == "__main__":
    main()
