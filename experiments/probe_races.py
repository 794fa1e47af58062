"""Probe: how often does one attempt of each PDL race check catch its broken variant, and does the right
variant ever fail?

The GPU tests check every programmatic dependent launch (PDL) in a CUDA graph whose replays change
the inputs: the right variant must match the reference in every replay, and a broken one that skips
its griddepcontrol.wait must be caught. That catch needs the race to happen, i.e. the dependent to
run while its predecessor still writes. Session 37's first GPU run had one unexplained failure out of
1,114 tests (a cold run under pytest-xdist: 8 workers on one GPU); two reruns passed. This probe
repeats each check's single attempt, both arms, alone or in several processes at once (the xdist
case), and counts:

- ``miss``: attempts whose broken arm was not caught (the race did not happen);
- ``fail``: attempts whose right arm missed the reference (a real ordering bug: must be 0).

Each check is the tests' own helper (``tests/kernels``), so the probe and the tests cannot drift.

    OUT=... python3 experiments/probe_races.py [--budget-s 120] [--procs 8]

``--procs N`` runs N copies at once (each a subprocess with its own CUDA context) and sums them.
Writes ``probe_races.json`` (per process and summed counts, per-attempt errors) under OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def checks():
    """name -> (right(), broken()): each returns (caught / failed as a bool, the error measured)."""
    from tests.kernels import test_attention as TA, test_linear as TL, test_moe as TM
    from tests.kernels.conftest import load_kernels
    import torch

    A, M, R = load_kernels("attention"), load_kernels("moe"), load_kernels("router")
    L, Nm = load_kernels("linear"), load_kernels("norm")
    r = (torch.randn(TM.Q1["E"], TM.Q1["H"], device="cuda") / TM.Q1["H"] ** 0.5).to(torch.bfloat16)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")

    def arm(f, tol):
        def run(bug):
            e = f(bug)
            return (e > tol if bug else not e < tol), e
        return run

    out = {
        "attention_combine_pdl": arm(lambda b: TA._pdl_case_error(A, b), TA.TOL),
        "attention_kv_before_wait_full": arm(lambda b: TA._late_rows_error(A, False, bug=b), TA.TOL),
        "attention_kv_before_wait_ring": arm(lambda b: TA._late_rows_error(A, True, bug=b), TA.TOL),
        "moe_down_pdl": arm(lambda b: TM._down_pdl_error(M, False, b), TM.TOL_EMU),
        "moe_down_pdl_table": arm(lambda b: TM._down_pdl_error(M, True, b), TM.TOL_EMU),
        "moe_gate_up_after_router": arm(lambda b: TM._router_chain_error(M, R, r, cnt, b), TM.TOL_EMU),
        "linear_after_norm": arm(lambda b: TL._norm_then_linear_error(L, Nm, b), TL.TOL),
        "linear_after_late_writer": arm(lambda b: TL._late_x_linear_error(L, b), TL.TOL),
    }

    # (the right arm fails where its Down waited early, the broken one is caught where it did)
    for name, table in (("moe_timeline", False), ("moe_timeline_table", True)):
        out[name] = lambda bug, table=table: (TM._down_waited_early(M, table, no_wait=bug), None)
    return out


def run_one(budget_s: float):
    """Round-robin over the checks, both arms each, until the budget is spent."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("probe_races needs CUDA (the checks capture CUDA graphs)")
    cs = checks()
    counts = {n: dict(attempts=0, miss=0, fail=0, broken_errors=[], right_errors=[]) for n in cs}
    t0 = time.time()
    while time.time() - t0 < budget_s:
        for name, f in cs.items():
            c = counts[name]
            failed, e_right = f(False)
            caught, e_broken = f(True)
            c["attempts"] += 1
            c["fail"] += int(failed)
            c["miss"] += int(not caught)
            c["right_errors"].append(e_right)
            c["broken_errors"].append(e_broken)
    return dict(seconds=time.time() - t0, counts=counts)


def table(counts):
    lines = [f"{'check':32s} {'attempts':>8s} {'miss':>5s} {'miss %':>7s} {'fail':>5s}"]
    for n, c in counts.items():
        a = max(c["attempts"], 1)
        lines.append(f"{n:32s} {c['attempts']:8d} {c['miss']:5d} {100 * c['miss'] / a:7.1f} {c['fail']:5d}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds of attempts per process")
    ap.add_argument("--procs", type=int, default=1, help="processes at once on the one GPU (xdist-like)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.budget_s)))
        return
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--budget-s", str(args.budget_s)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(args.procs)]
    results, failed = [], 0
    for p in procs:
        o, _ = p.communicate()
        if p.returncode:   # (its traceback went to stderr; the others' counts still add up)
            failed += 1
            continue
        results.append(json.loads(o.strip().splitlines()[-1]))
    if failed:
        print(f"{failed} of {args.procs} probe processes failed (tracebacks above); counted: the others")
    if not results:
        raise SystemExit("every probe process failed")
    total = {}
    for res in results:
        for n, c in res["counts"].items():
            t = total.setdefault(n, dict(attempts=0, miss=0, fail=0))
            for k in ("attempts", "miss", "fail"):
                t[k] += c[k]
    print(f"{args.procs} process(es) at once, {args.budget_s:.0f} s of attempts each")
    print(table(total))
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"probe_races_p{args.procs}.json")
        with open(path, "w") as f:
            json.dump(dict(procs=args.procs, failed=failed, budget_s=args.budget_s, total=total,
                           per_process=results), f)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
