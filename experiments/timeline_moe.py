"""Where the time of one fused MoE call goes: per-program timelines inside a CUDA graph.

    OUT=... python3 experiments/timeline_moe.py [--distinct 38] [--w 6] [--sets 6] [--dry-run]

Every program of the v1 MoE's three launches (Gate/Up, the wide Down, the reduce) records (SM,
t_entry, t_wait, t_end) from the GPU's global timer (``moe_plan(_timeline=)``: t_wait is after
griddepcontrol.wait; the Down's programs stamp it only if they own an expert group, field 4 marks
those). The calls are captured as ``bench_kernels.py`` / ``ab_moe.py`` time them: one graph holding
one call per rotating weight set (far beyond L2), replayed; the records of the last replay give, for
each call after the first, its phases relative to the end of the previous call's last reduce
program (the call boundary):

    gate/up: first / last entry, median / last wait, first / median / 90th-percentile / last end,
             median and longest busy time (end - wait) of a program with a group;
    down:    first / median entry, last wait, median / last end, median busy time;
    reduce:  first entry, last wait, last end (= the call's period).

It also times the same graph without records (the stamps' cost) and prints the DRAM-side reading:
the bytes of the distinct experts over the time between the Gate/Up's last wait and the Down's
last end, against the copy bandwidth; per SM, by how many Gate/Up programs it held, when its last
one ended (after the call's first Gate/Up wait) and the SM's rate; the same for the Down (after the
call's last Gate/Up end), and when the Down's programs entered and passed their wait. Prints a table; $OUT/timeline_moe.json / .csv hold the
summaries and the raw records of every call (per program: SM, entry, wait, end in ns after the
first call's first entry, has-work flag), from which per-SM loads can be read.
"""
from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import DEV, DRY_RUN, carveout_hook, copy_bandwidth, set_carveout, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402

from bench_kernels import MOE, graph_time, moe_bytes, moe_data, moe_sets  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402
from runtime.kernels.attention import TIMELINE_FIELDS  # noqa: E402


def _q(t, p):
    return float(torch.quantile(t, p)) if t.numel() else float("nan")


def phases(rec, n_gu, n_dn, prev_end):
    """Phase times (us) of one call relative to ``prev_end`` (ns); differences taken in int64."""
    rel = (rec[:, 1:4] - prev_end).double() * 1e-3
    gu_act = rec[:n_gu, 4] == 1
    gu, gua = rel[:n_gu], rel[:n_gu][gu_act]
    dn = rel[n_gu:n_gu + n_dn][rec[n_gu:n_gu + n_dn, 4] == 1]
    rd = rel[n_gu + n_dn:]
    return {
        "gu_entry_first": _q(gu[:, 0], 0), "gu_entry_last": _q(gu[:, 0], 1),
        "gu_wait_med": _q(gu[:, 1], 0.5), "gu_wait_last": _q(gu[:, 1], 1),
        "gu_end_first": _q(gua[:, 2], 0), "gu_end_med": _q(gua[:, 2], 0.5),
        "gu_end_p90": _q(gua[:, 2], 0.9), "gu_end_last": _q(gua[:, 2], 1),
        "gu_busy_med": _q(gua[:, 2] - gua[:, 1], 0.5), "gu_busy_max": _q(gua[:, 2] - gua[:, 1], 1),
        # from the wait's return to the expert group known (field 5, stamped after _expert_group)
        "gu_group_med": _q((rec[:n_gu, 5] - rec[:n_gu, 2]).double()[gu_act] * 1e-3, 0.5),
        "gu_group_max": _q((rec[:n_gu, 5] - rec[:n_gu, 2]).double()[gu_act] * 1e-3, 1),
        "dn_entry_first": _q(dn[:, 0], 0), "dn_entry_med": _q(dn[:, 0], 0.5),
        "dn_wait_last": _q(dn[:, 1], 1), "dn_end_med": _q(dn[:, 2], 0.5), "dn_end_last": _q(dn[:, 2], 1),
        "dn_busy_med": _q(dn[:, 2] - dn[:, 1], 0.5),
        "red_entry_first": _q(rd[:, 0], 0), "red_wait_last": _q(rd[:, 1], 1), "red_end_last": _q(rd[:, 2], 1),
        "gu_active": int(gu_act.sum()), "dn_active": int(dn.shape[0]),
    }


def _sm_last_ends(progs, t0, per_sm):
    """Add, per SM among ``progs`` (records with work), its last program's end after t0 (us) to
    per_sm[number of those programs on the SM]."""
    for sm in progs[:, 0].unique().tolist():
        mine = progs[progs[:, 0] == sm]
        per_sm.setdefault(mine.shape[0], []).append((int(mine[:, 3].max()) - t0) * 1e-3)


def _print_per_sm(per_sm, prog_bytes, n_calls):
    """Print per_sm's rows (programs, SMs per call, last end median (min-max), the SM's rate at
    ``prog_bytes`` per program); returns {programs: median last end}."""
    for k in sorted(per_sm):
        v = per_sm[k]
        print(f"    {k}  {len(v) / n_calls:5.1f}  {statistics.median(v):6.2f} us ({min(v):.2f}-{max(v):.2f})"
              f"  {k * prog_bytes / (statistics.median(v) * 1e-6) / 1e9:5.1f} GB/s")
    return {k: statistics.median(v) for k, v in per_sm.items()}


KEYS = ["gu_entry_first", "gu_wait_last", "gu_end_first", "gu_end_med", "gu_end_p90", "gu_end_last",
        "gu_busy_med", "gu_busy_max", "gu_group_med", "gu_group_max", "dn_entry_first", "dn_wait_last",
        "dn_end_med", "dn_end_last",
        "dn_busy_med", "red_wait_last", "red_end_last"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--distinct", type=int, default=MOE["realistic"], help="distinct experts per call")
    ap.add_argument("--w", type=int, default=MOE["w"])
    ap.add_argument("--sets", type=int, default=6, help="rotating weight sets = calls per graph")
    ap.add_argument("--opts", default="", help="fused_moe_fp8 keywords, e.g. gu_weights_a=False,down_nb=6 "
                    "(values read as Python literals)")
    ap.add_argument("--carveout", default="", help="preferred shared-memory carveouts set before the capture, "
                    "NAME=PERCENT,... (NAME: part of a kernel name, * for every kernel; -1: the driver's default), "
                    "e.g. _moe_down_wide_kernel=100 (see probe_carveout.py). The Gate/Up's own carveout is set "
                    "before each of its launches (since session 28): use --opts gu_carveout=PERCENT for it")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at toy shapes (no timer)")
    args = ap.parse_args()
    carve = [(k, int(v)) for k, v in (kv.split("=", 1) for kv in args.carveout.split(",") if kv)]
    if carve and not DRY_RUN:
        carveout_hook()
    opts = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.opts.split(",") if kv)}
    H, I, E, w = MOE["H"], MOE["I"], MOE["E"], args.w
    copy_bw = copy_bandwidth()[0]
    weights = moe_sets(args.sets)
    data = moe_data(weights, w, args.distinct)
    n_gu, n_dn, n_red = M.timeline_programs(w, H, I, E, down_nb=opts.get("down_nb"),
                                             down_weights_a=opts.get("down_weights_a"))
    bufs = [torch.zeros(n_gu + n_dn + n_red, TIMELINE_FIELDS, dtype=torch.int64, device=DEV) for _ in data]
    mk = lambda rec: [(lambda x=x, ids=ids, tw=tw, wt=wt, o=o, b=b: M.fused_moe_fp8(   # noqa: E731
        x, ids, tw, *wt, o, _timeline=b if rec else None, **opts)) for (x, ids, tw, wt, o), b in zip(data, bufs)]
    if carve and not DRY_RUN:   # every kernel loaded (eager calls), then the carveouts, then the captures
        for c in mk(False) + mk(True):
            c()
        torch.cuda.synchronize()
        for name, pct in carve:
            print(f"carveout {pct} for {set_carveout(pct, None if name == '*' else [name])} functions ({name})")
    t_plain = graph_time(mk(False))[0]
    t_rec = graph_time(mk(not DRY_RUN))[0]   # the interpreter has no global timer
    nbytes = moe_bytes(w, args.distinct)
    print(f"copy {copy_bw / 1e12:.3f} TB/s; MoE w {w}, {args.distinct} distinct experts: {t_plain * 1e6:.2f} us per "
          f"call ({nbytes['call'] / t_plain / copy_bw:.3f} of copy), {t_rec * 1e6:.2f} us with the records", flush=True)
    if DRY_RUN:
        return
    recs = [b.cpu() for b in bufs]
    per = []
    for c in range(1, len(recs)):
        prev_end = recs[c - 1][n_gu + n_dn:, 3].max()
        per.append(phases(recs[c], n_gu, n_dn, prev_end))
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    stream = med["dn_end_last"] - med["gu_wait_last"]
    row = dict(w=w, distinct=args.distinct, graph_us=t_plain * 1e6, graph_rec_us=t_rec * 1e6,
               frac=nbytes["call"] / t_plain / copy_bw, copy_Bps=copy_bw,
               weights_frac_wait_to_down_end=(nbytes["gate_up"] + nbytes["down"]) / (stream * 1e-6) / copy_bw, **med)
    print("\nus after the previous call's last reduce end (medians over calls):")
    for k in KEYS:
        print(f"  {k:16s} {med[k]:8.2f}")
    print(f"  programs with a group: Gate/Up {med['gu_active']:.0f} of {n_gu}, Down {med['dn_active']:.0f} of {n_dn}")
    print(f"  weights over [last Gate/Up wait, last Down end] = {stream:.2f} us: "
          f"{row['weights_frac_wait_to_down_end']:.3f} of copy bandwidth")
    # per SM: Gate/Up programs held, the SM's last end after the call's first wait, its rate
    per_sm = {}
    for r in recs[1:]:
        gu = r[:n_gu][r[:n_gu, 4] == 1]
        _sm_last_ends(gu, int(gu[:, 2].min()), per_sm)
    print("  Gate/Up per SM: programs, SMs per call, last end (median, min-max), SM rate")
    row["per_sm_last_end_us"] = _print_per_sm(per_sm, nbytes["gate_up"] / max(1, med["gu_active"]), len(recs) - 1)
    # the same for the Down, from the call's last Gate/Up end (its programs' wait returns just after);
    # and when its programs entered (resident early, or only once a Gate/Up program left its SM)
    dn_sm, dn_entry, dn_start = {}, [], []
    for r in recs[1:]:
        gu = r[:n_gu][r[:n_gu, 4] == 1]
        dn = r[n_gu:n_gu + n_dn][r[n_gu:n_gu + n_dn, 4] == 1]
        t_gu = int(gu[:, 3].max())
        dn_entry += ((dn[:, 1] - t_gu).double() * 1e-3).tolist()
        dn_start += ((dn[:, 2] - t_gu).double() * 1e-3).tolist()
        _sm_last_ends(dn, t_gu, dn_sm)
    q = lambda v, p: float(torch.quantile(torch.tensor(v), p))   # noqa: E731
    print("  Down programs' entry / wait return, us after the last Gate/Up end: "
          + ", ".join(f"p{int(p * 100)} {q(dn_entry, p):.2f} / {q(dn_start, p):.2f}" for p in (0.1, 0.5, 0.9, 1.0)))
    print("  Down per SM: programs, SMs per call, last end after the last Gate/Up end (median, min-max), SM rate")
    row["down_per_sm_last_end_us"] = _print_per_sm(dn_sm, nbytes["down"] / max(1, med["dn_active"]), len(recs) - 1)
    base = min(int(r[:, 1][r[:, 1] > 0].min()) for r in recs)
    # per program: SM, entry, wait, end (ns after the first entry; -1: not stamped), has work
    raw = [torch.cat([r[:, :1], torch.where(r[:, 1:4] > 0, r[:, 1:4] - base, -1), r[:, 4:5]], 1).tolist()
           for r in recs]
    write_results("timeline_moe", {"raw": raw, "programs": [n_gu, n_dn, n_red], "per_call": per}, [row])


if __name__ == "__main__":
    main()
