"""Which placement is slow, and why: one attention call timed over many placements of its KV cache.

Session 55 found that where a decode's buffers land moves q1-mini's step time by up to ~3 % at 32K, and
session 56 that the paired replay's A/A noise grows with context (per-request sd 0.60 % under 4K, 1.30 %
above 48K). q1-mini's whole working set is small: its one full layer's K and V at 64K are 16 MiB, at
190K 47 MiB, beside an L2 of 50-60 MB that a decode step re-reads every round. The question here: does
the attention call alone change speed with the placement of its K/V, at which contexts, and does a plain
read of the same bytes change with it (the memory system) or only the attention (the kernel)?

Per context and placement: the caching allocator is emptied, a random pad (a multiple of 2 MiB up to
``--pad-mib``) is held, and K and V are allocated as the runtime's ``KVCache`` allocates them (k, then v,
then labels), filled with random values. Then, each from one CUDA graph of ``--calls`` back-to-back calls
on that one cache (steady state, as decode steps re-read the same cache):

- ``attn``: the runtime's decode attention (q1-mini shapes: ``--rows`` rows x 6 heads, one KV head, d = 64);
- ``read``: a read of the same K/V bytes in one launch (``bench_kernels.read_floor_calls``);
- ``attn_cold``: the attention after a write of ``--flush-mib`` MiB that evicts L2 (the pair's time less
  the flush's own, timed alone), i.e. the call with its K/V coming from DRAM.

Each is timed twice per placement (``a`` and ``b``, separated by the other timings): the SD of a - b gives
the within-placement noise, against which the spread between placements is judged (``ratio`` ~ 1: no
placement effect). Addresses are kept per placement (K's and V's offsets in their 2 MiB page, V - K).

    OUT=... python3 experiments/placement_kernels.py --contexts 4096,32768,65536,131072,190000 --placements 32
    python experiments/placement_kernels.py --dry-run        # CPU interpreter, toy shapes: checks the script

Writes ``$OUT/placement_kernels.json`` (every placement and timing) and prints a table per context.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics

from _bench import CUDA, DEV, DRY_RUN, capture_graph, write_results  # noqa: I001  (first: --dry-run)

import torch

from bench_kernels import read_floor_calls
from runtime.kernels.attention import decode_attention_full
from runtime.model import KVCache

MIB = 1 << 20


def graph_us(calls, reps: int) -> float:
    """Median microseconds per call over ``reps`` replays of one graph holding ``calls``."""
    if not CUDA:
        import time
        t0 = time.perf_counter()
        for c in calls[:1]:
            c()
        return (time.perf_counter() - t0) * 1e6
    g = capture_graph(calls)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in evs:
        e0.record()
        g.replay()
        e1.record()
    torch.cuda.synchronize()
    del g
    return statistics.median(e0.elapsed_time(e1) * 1e3 / len(calls) for e0, e1 in evs)


def spread(a: list[float], b: list[float]) -> dict:
    """Between-placement SD of the means (a+b)/2 against the SD a within-placement pair predicts."""
    means = [(x + y) / 2 for x, y in zip(a, b)]
    diffs = [x - y for x, y in zip(a, b)]
    between = statistics.stdev(means) if len(means) > 1 else 0.0
    within = statistics.stdev(diffs) / 2 if len(diffs) > 1 else 0.0   # SD of a mean of two = SD(a-b)/2
    lo, hi, med = min(means), max(means), statistics.median(means)
    return {"median_us": med, "min_us": lo, "max_us": hi, "range_pct": (hi / lo - 1) * 100 if lo > 0 else 0.0,
            "sd_between_us": between, "sd_within_us": within,
            "ratio": between / within if within > 0 else float("inf"),
            "slow_pct": 100 * sum(m > 1.015 * med for m in means) / len(means)}


def time_placement(n, cap, w, nh, nkv, d, flush, calls_n, reps) -> tuple[dict, int, int]:
    """One placement: a KV cache allocated as the runtime's, its timings (a and b of each kind) and its
    K and V addresses. The cache is freed on return."""
    cache = KVCache("full", nkv, cap, d, torch.bfloat16, DEV)
    cache.k.normal_()
    cache.v.normal_()
    q = torch.randn(w, nh, d, device=DEV).to(torch.bfloat16)
    sinks = torch.randn(nh, device=DEV) + math.log(n)
    sp = torch.tensor(n - w, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    attn = lambda: decode_attention_full(q, cache.k, cache.v, sp, sinks, out)   # noqa: E731
    read = read_floor_calls([(q, cache.k, cache.v, sinks, sp, out)], n)[0]
    fill = lambda: flush.fill_(1)                                               # noqa: E731
    t = {}
    for tag in ("a", "b"):
        t[f"attn_{tag}"] = graph_us([attn] * calls_n, reps)
        t[f"read_{tag}"] = graph_us([read] * calls_n, reps)
        pair = graph_us([fill, attn] * max(1, calls_n // 4), reps) * 2
        alone = graph_us([fill] * max(1, calls_n // 4), reps)
        t[f"cold_{tag}"] = pair - alone
    return t, cache.k.data_ptr(), cache.v.data_ptr()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768,65536,131072,190000", help="valid keys per call")
    ap.add_argument("--placements", type=int, default=32, help="placements per context")
    ap.add_argument("--rows", type=int, default=6, help="live rows (the device loop decodes 4-8)")
    ap.add_argument("--calls", type=int, default=16, help="calls per graph")
    ap.add_argument("--reps", type=int, default=9, help="graph replays per timing")
    ap.add_argument("--pad-mib", type=int, default=1024, help="largest random pad before a placement")
    ap.add_argument("--flush-mib", type=int, default=256, help="the L2-evicting write before a cold call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes: checks the script")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    contexts = [256, 600] if DRY_RUN else [int(c) for c in a.contexts.split(",")]
    placements = 2 if DRY_RUN else a.placements
    calls_n, reps = (1, 1) if DRY_RUN else (a.calls, a.reps)
    nh, nkv, d, w = 6, 1, 64, a.rows
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size if CUDA else 0
    print(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; L2 {l2 / MIB:.0f} MiB; rows {w}, "
          f"{placements} placements per context, {calls_n} calls per graph, {reps} replays per timing", flush=True)
    flush = torch.empty((a.flush_mib if CUDA else 1) * MIB, dtype=torch.uint8, device=DEV)
    rows, table = [], []
    for n in contexts:
        cap = 1 << math.ceil(math.log2(n))            # the kept loop's capacity: doubled at powers of two
        kv_mib = 2 * n * d * 2 / MIB
        per = {k: [] for k in ("attn_a", "attn_b", "read_a", "read_b", "cold_a", "cold_b")}
        for p in range(placements):
            if CUDA:
                torch.cuda.empty_cache()
            pad = torch.empty(rng.randrange(0, a.pad_mib // 2 + 1) * 2 * MIB, dtype=torch.uint8, device=DEV)
            t, kp, vp = time_placement(n, cap, w, nh, nkv, d, flush, calls_n, reps)
            for k, v in t.items():
                per[k].append(v)
            rows.append({"context": n, "capacity": cap, "placement": p, "pad_mib": pad.numel() // MIB,
                         "k_addr": kp, "v_addr": vp, "k_mod_2mib": kp % (2 * MIB), "v_mod_2mib": vp % (2 * MIB),
                         "v_minus_k": vp - kp, **{k: round(v, 4) for k, v in t.items()}})
            del pad
        for kind in ("attn", "read", "cold"):
            s = spread(per[f"{kind}_a"], per[f"{kind}_b"])
            table.append({"context": n, "kv_mib": kv_mib, "kind": kind, **s})
            print(f"{n:>7} {kv_mib:>7.1f} MiB {kind:>5}: median {s['median_us']:8.2f} us, placements "
                  f"{s['min_us']:.2f}..{s['max_us']:.2f} ({s['range_pct']:.2f} %), SD between {s['sd_between_us']:.3f} "
                  f"within {s['sd_within_us']:.3f} (ratio {s['ratio']:.1f}), >1.5 % slow: {s['slow_pct']:.0f} %",
                  flush=True)
    write_results("placement_kernels", {"args": vars(a), "l2_bytes": l2, "table": table}, rows)


if __name__ == "__main__":
    main()
