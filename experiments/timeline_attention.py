"""Where the time of one split-KV attention call goes: per-program timelines inside a CUDA graph.

    OUT=... python3 experiments/timeline_attention.py [--contexts 4096,65536,196608] [--w 6]
                                                      [--configs default,trigger] [--dry-run]

Every split and combine program records (SM, t_entry, t_wait, t_end) from the GPU's global timer
(``_timeline`` of ``attention._launch``: t_wait is after griddepcontrol.wait, t_end after the
program's last store is issued). The calls are captured exactly as ``bench_kernels.py`` times them:
one graph holding one call per rotating input set (>= 3x L2 of KV), replayed; the records of the
last replay give, for each call after the first, the phases relative to the end of the previous
call's combine (the call boundary):

    split: first/last entry, median/last wait, first/median/90th-percentile/last end;
    combine: first entry, last wait, last "den" (m and l arrived and reduced), last "num" (the
    weighted sum of the partials done), last end  (= the next boundary: the call's period).

It also times the same graph without records, so the instrumentation's cost is visible, and
measures the copy and a read-only (sum) bandwidth. Prints a table; $OUT/timeline_attention.json
holds the records of the first eight calls per configuration (ns after the first call's first
entry), $OUT/timeline_attention.csv the summaries.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import DEV, DRY_RUN, copy_bandwidth, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402

import _tma_read  # noqa: E402
from bench_kernels import attention_sets, graph_time, n_sets  # noqa: E402
from runtime.kernels import attention as A  # noqa: E402
from runtime.kernels._common import device_sm_count  # noqa: E402

CONFIGS = {
    "default": {},
    "nopdl": dict(pdl=False),
    "two_loads": dict(combine_one_load=False),   # the combine before session 12
    "tailpf": dict(tail_prefetch=True),
    "tma": dict(tma=True),
    "tma_tailpf": dict(tma=True, tail_prefetch=True),
    "tma_st3": dict(tma=True, num_stages=3),
    "tma_st5": dict(tma=True, num_stages=5),
    "tma_st6": dict(tma=True, num_stages=6),
    "st5": dict(num_stages=5),
    "default_again": {},
    "ml_by_split": dict(ml_by_row=False),   # the partials' m and l in the layout before session 29
    "cnw1_cd8": dict(combine_num_warps=1, combine_block_d=8),
    "cnw2_cd16": dict(combine_num_warps=2, combine_block_d=16),
    "cnw8": dict(combine_num_warps=8),
    "cnw2": dict(combine_num_warps=2),
    # session 38: the partials as acc / l in BF16 (half the bytes), 0.5-0.8 us slower in ab_attention
    # with the split alone as fast: where in the combine the time goes
    "bf16_partials": dict(partials="bfloat16"),
    # the combine releases its dependent (the next call's split) at its start: the split's launch
    # and prologue overlap the previous kernel, as after a predecessor that triggers early
    "trigger": dict(_combine_trigger=True),
    "trigger_pf2": dict(_combine_trigger=True, prefetch=2),
    "tma_tailpf_trigger_pf2": dict(tma=True, tail_prefetch=True, _combine_trigger=True, prefetch=2),
    # session 32: the bare TMA stream (the probe tmase1_128_s3: its split-side field 2 is its first block
    # landed, not a wait) and the attention's split (field 2: its wait), each followed by a dependent that
    # only waits (_tma_read._empty_dependent_kernel) instead of the combine: where the split's own time
    # over the stream sits (sm_90+, not in dry runs)
    # (tmase64_s4: the stream in the split's buffers, 64-key tiles x 4 stages; _d700b: each block held 700 ns
    # before its slot's refill, a split's arithmetic emulated; tmase2_...: two such programs per SM)
    "tmase": dict(_probe="tmase1_128_s3"),
    "tmase64_s4": dict(_probe="tmase1_64_s4"),
    "tmase64_s4_d700b": dict(_probe="tmase1_64_s4_d700b"),
    "tmase2_64_s3_d700b": dict(_probe="tmase2_64_s3_d700b"),
    "split_empty_merge": dict(_probe="split"),
    "split_no_store_empty_merge": dict(_probe="split", _no_store=True),
}


def read_bandwidth(nbytes=2**31, reps=10):
    """Bytes per second of a read-only stream (a BF16 sum into FP32) over nbytes: the other ceiling."""
    from _bench import time_call
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEV).normal_()
    for _ in range(3):
        x.sum(dtype=torch.float32)
    t = statistics.median([time_call(lambda: x.sum(dtype=torch.float32)) for _ in range(reps)])
    return nbytes / t


def phases(rec_split, rec_comb, prev_end):
    """Phase times (us) of one call relative to ``prev_end`` (ns) from its records (differences
    taken in int64: the timer's absolute values do not fit a double's mantissa)."""
    s = (rec_split[rec_split[:, 1] > 0][:, 1:] - prev_end).double() * 1e-3
    c = (rec_comb[rec_comb[:, 1] > 0][:, 1:] - prev_end).double() * 1e-3
    q = lambda t, p: float(torch.quantile(t, p))   # noqa: E731
    return {
        "split_entry_first": q(s[:, 0], 0), "split_entry_last": q(s[:, 0], 1),
        "split_wait_med": q(s[:, 1], 0.5), "split_wait_last": q(s[:, 1], 1),
        "split_end_first": q(s[:, 2], 0), "split_end_med": q(s[:, 2], 0.5),
        "split_end_p90": q(s[:, 2], 0.9), "split_end_last": q(s[:, 2], 1),
        "comb_entry_first": q(c[:, 0], 0), "comb_wait_last": q(c[:, 1], 1),
        "comb_den_last": q(c[:, 3], 1), "comb_num_last": q(c[:, 4], 1), "comb_end_last": q(c[:, 2], 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,65536,196608")
    ap.add_argument("--w", type=int, default=6)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at toy shapes (no timer)")
    args = ap.parse_args()
    nh, nkv, d = (6, 1, 128) if not DRY_RUN else (6, 1, 64)
    w = args.w
    l2 = 60 * 2**20
    n_splits = device_sm_count(DEV)
    n_comb = w * nh * (d // 8) + n_splits   # room for the narrowest combine tile tried (and 2 streams per SM)
    rows, raw = [], {}
    bw = {}
    if not DRY_RUN:
        bw = dict(copy_Bps=copy_bandwidth()[0], read_Bps=read_bandwidth())
        print(f"copy {bw['copy_Bps'] / 1e12:.3f} TB/s (read + write), read-only sum {bw['read_Bps'] / 1e12:.3f} TB/s",
              flush=True)
    for ctx in [int(c) for c in args.contexts.split(",")]:
        ctx = ctx if not DRY_RUN else min(ctx, 512)
        cap = ctx + 64
        sets = n_sets(2 * nkv * cap * d * 2, l2) if not DRY_RUN else 2
        data = [(*s, torch.zeros(n_splits * nkv + n_comb, A.TIMELINE_FIELDS, dtype=torch.int64, device=DEV))
                for s in attention_sets(sets, w, nh, nkv, d, cap, ctx - w, ctx)]
        kv_bytes = 2 * nkv * ctx * d * 2
        for name in args.configs.split(","):
            kw = dict(CONFIGS[name])
            probe = kw.pop("_probe", None)
            if probe and DRY_RUN:
                print(f"{ctx} {name}: skipped in a dry run (sm_90+ probe)", flush=True)
                continue
            per_sm = 1
            if probe == "split":
                mk = lambda rec: _tma_read.without_merge(   # noqa: E731
                    [d[:6] for d in data], records=[d[6] for d in data] if rec else None, **kw)
            elif probe:
                per_sm = int(_tma_read.PATTERN.fullmatch(probe).group(2))
                mk = lambda rec: _tma_read.calls(   # noqa: E731
                    probe, [d[:6] for d in data], [d[6] for d in data] if rec else None)
            else:
                mk = lambda rec: [(lambda q=q, k=k, v=v, s=s, sp=sp, o=o, t=t: A._launch(   # noqa: E731
                    q, k, v, sp, s, o, ring=False, window=0, num_splits=n_splits, variant="v2",
                    _timeline=t if rec else None, **kw)) for q, k, v, s, sp, o, t in data]
            t_plain = graph_time(mk(False))[0]
            for *_, t in data:
                t.zero_()
            t_rec = graph_time(mk(not DRY_RUN))[0]   # the interpreter has no global timer
            if DRY_RUN:
                print(f"{ctx} {name}: dry run, {t_plain * 1e6:.0f} us wall", flush=True)
                continue
            recs = [t.cpu() for *_, t in data]
            n_first = n_splits * nkv * per_sm   # the split's (stream's) records, then the merge's
            per = []
            for c in range(1, sets):
                prev_end = recs[c - 1][n_first:, 3].max()
                per.append(phases(recs[c][:n_first], recs[c][n_first:], prev_end))
            avg = {key: statistics.median(p[key] for p in per) for key in per[0]}
            allt = torch.cat([r[:, 1:].flatten() for r in recs])
            allt = allt[allt > 0].sort().values
            dif = allt.diff()
            gran = int(dif[dif > 0].min()) if (dif > 0).any() else -1
            row = dict(ctx=ctx, w=w, config=name, graph_us=t_plain * 1e6, graph_rec_us=t_rec * 1e6,
                       frac=kv_bytes / t_plain / bw["copy_Bps"], timer_ns=gran, **avg)
            # per-split streaming rate: blocks / (end - wait)
            s1 = recs[sets // 2][:n_first]
            act = s1[s1[:, 1] > 0]
            dur = (act[:, 3] - act[:, 2]).double() * 1e-3
            row.update(split_busy_us_med=float(dur.median()), split_busy_us_max=float(dur.max()),
                       split_busy_us_min=float(dur.min()))
            rows.append(row)
            base = recs[0][:, 1][recs[0][:, 1] > 0].min()   # ns offsets: the absolute timer is 61 bits
            raw[f"{ctx}_{name}"] = [torch.where(r[:, 1:] > 0, r[:, 1:] - base, -1).tolist()
                                    for r in recs[:8]]
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
        del data
        if not DRY_RUN:
            torch.cuda.empty_cache()
    if rows:
        keys = ["graph_us", "frac", "graph_rec_us", "split_entry_first", "split_entry_last", "split_wait_med",
                "split_wait_last", "split_end_first", "split_end_med", "split_end_p90", "split_end_last",
                "comb_entry_first", "comb_wait_last", "comb_den_last", "comb_num_last", "comb_end_last",
                "split_busy_us_med", "split_busy_us_max"]
        print("\nus after the previous call's last combine end (medians over calls):")
        print(f"{'ctx':>7} {'config':>12} " + " ".join(f"{k[:14]:>14}" for k in keys))
        for r in rows:
            print(f"{r['ctx']:>7} {r['config']:>12} " + " ".join(f"{r[k]:>14.2f}" for k in keys))
    write_results("timeline_attention", {"raw": raw, "n_splits": n_splits, "n_comb": n_comb, **bw}, rows)


if __name__ == "__main__":
    main()
