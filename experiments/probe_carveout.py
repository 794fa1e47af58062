"""Probe: does the shared-memory carveout keep a programmatic dependent's blocks off busy SMs?

Triton sets the largest shared-memory carveout only for kernels above 48 KiB (the wide Down: 74 KiB;
the attention split), not for the Gate/Up (40 KiB) and the small kernels. If an SM's L1 / shared
split is fixed while blocks of one kernel run on it, the Down's blocks can enter an SM only once its
Gate/Up blocks have all ended (session 26's timeline: no Down block entered before the first Gate/Up
block ended, though registers and shared memory leave room beside two Gate/Up blocks).

The MoE call (q1 shard, w = 6, 38 distinct experts, rotating weight sets as bench_kernels) is
captured in one graph per config, each config's carveouts set before its capture; rounds alternate
the configs (rotating order), with the config's carveouts set again before each replay ("set") and,
as a check of whether a graph keeps the carveout it was captured with, also replayed with every
carveout back at the driver's default ("reset").

    OUT=... python3 experiments/probe_carveout.py [--rounds 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench import (DEV, capture_graph, carveout_hook, copy_bandwidth, recorded_kernels, set_carveout,  # noqa: E402
                    time_call, write_results)

import torch  # noqa: E402

from bench_kernels import moe_bytes, moe_data, moe_sets, MOE  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402

# carveouts by kernel-name part; the Gate/Up's ("gu") is its own MoE keyword, gu_carveout, since
# session 28 (the MoE sets it before each Gate/Up launch, over anything set_carveout left: default 57)
CONFIGS = {
    "default": {},
    "gu100": {"gu": 100},
    "gu100_red100": {"gu": 100, "_moe_reduce_kernel": 100},
    "gu_driver_default": {"gu": -1},
    "all100": {"": 100, "gu": 100},
    "down_default": {"_moe_down_wide_kernel": -1},   # (Triton's PREFER_SHARED stays as the cache config)
    "default_again": {},
}


def apply(cfg: dict) -> None:
    set_carveout(-1)
    for name, pct in cfg.items():
        if name != "gu":
            set_carveout(pct, [name])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--distinct", default="38,48")
    args = ap.parse_args()
    carveout_hook()
    copy_bw = copy_bandwidth()[0]
    weights = moe_sets(MOE["sets"])
    rows, raw = [], {}
    for dist in [int(v) for v in args.distinct.split(",")]:
        data = moe_data(weights, MOE["w"], dist)

        def calls_of(cfg):
            opts = {"gu_carveout": cfg["gu"]} if "gu" in cfg else {}
            return [(lambda x=x, ids=ids, tw=tw, wt=wt, o=o: M.fused_moe_fp8(x, ids, tw, *wt, o, **opts))
                    for x, ids, tw, wt, o in data]
        calls = calls_of({})
        for c in calls:
            c()
        torch.cuda.synchronize()
        print("kernels recorded:", recorded_kernels(), flush=True)
        graphs = {}
        for name, cfg in CONFIGS.items():
            apply(cfg)
            graphs[name] = capture_graph(calls_of(cfg))
        times = {f"{n}/{m}": [] for n in CONFIGS for m in ("set", "reset")}
        names = list(CONFIGS)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                for mode in ("set", "reset"):
                    apply(CONFIGS[n] if mode == "set" else {})
                    torch.cuda.synchronize()
                    times[f"{n}/{mode}"].append(time_call(graphs[n].replay) / len(calls) * 1e6)
        apply({})
        nb = moe_bytes(MOE["w"], dist)["call"]
        base = times["default/set"]
        for k, v in times.items():
            ratio = statistics.median(b / a for a, b in zip(base, v))
            med = statistics.median(v)
            print(f"distinct {dist:3d}  {k:22s} {med:8.2f} us  frac {nb / (med * 1e-6) / copy_bw:.3f}  "
                  f"ratio {ratio:.4f} vs default/set", flush=True)
            rows.append(dict(distinct=dist, config=k, us=med, ratio=ratio, frac=nb / (med * 1e-6) / copy_bw))
            raw[f"{dist}_{k}"] = v
        del graphs, data, calls
        torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s ({DEV})")
    write_results("probe_carveout", {"copy_Bps": copy_bw, "configs": CONFIGS, "times_us": raw}, rows)


if __name__ == "__main__":
    main()
