"""Calibration of the harness's statistics: does it call a difference where there is none, and does
it find one where there is?

    python experiments/harness_calibration.py [mode=simulate] [n_datasets=200] [n_requests=100] ...

mode=simulate (the only mode so far) draws synthetic run data (analysis.synthetic) for
- ``null``: candidate = control; the rate of faster/slower calls is the A/A false-positive rate
  and must lie in [0, 0.075] at alpha = 0.05;
- ``slow+X%``: an injected step-latency slowdown of X% (per-request spread ``request_effect_sd``);
  the rate of "slower" calls is the power, and the share of TPOT CIs containing the true effect is
  the coverage (it should be close to the nominal 95%);
- ``accept×M``: a candidate whose per-draft acceptance probability is multiplied by M; the rate of
  the "acceptance changed" flag is the power of that rule.
Every dataset goes through the same analysis.stats.analyze and analysis.verdict.decide as a real
run. Raw per-dataset results go to ``out/calibration.csv``, the summary to
``out/calibration.json``. Exit status 1 when the false-positive rate is out of bounds.

mode=replay (later): the same measurements from real A/A and injected-slowdown replays on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the analysis package is beside it

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import rawio, stats, synthetic, verdict  # noqa: E402
from analysis.report import parse_cli  # noqa: E402

FPR_BOUNDS = (0.0, 0.075)

HELP = """python experiments/harness_calibration.py [key=value ...]

  mode=simulate            simulate (synthetic run data); replay is not implemented yet
  n_datasets=200           datasets per scenario
  n_requests=100           requests per dataset (paired control/candidate/A/A)
  reps=1                   decodes per (request, arm)
  slowdowns=0.25,0.5,1.0   injected step-latency slowdowns, percent, one scenario each
  acceptance=1.05          per-draft acceptance multiplier of the acceptance scenario (1: none)
  request_effect_sd=0.005  per-request spread of the injected effect (log scale)
  arm_offset_sd=0          every arm's own random offset per run (log scale; analysis.synthetic)
  n_boot=1000              bootstrap resamples per interval
  alpha=0.05               significance level
  seed=0                   base seed (dataset i of every scenario uses seed+i)
  workers=2                processes
  out=experiments/results/harness_calibration   where calibration.csv/.json go"""


def one_dataset(job: tuple) -> dict:
    scenario, i, spec_kw, n_boot, alpha = job
    spec = synthetic.SyntheticSpec(**spec_kw)
    steps, requests, manifest = synthetic.simulate(spec)
    run = rawio.RunData(Path("<simulated>"), manifest, steps, requests, [])
    a = stats.analyze(run, n_boot=n_boot, seed=spec.seed, alpha=alpha)
    v = verdict.decide(a, manifest, alpha=alpha)
    e, aa = a.effects["tpot"], a.aa["tpot"]
    truth = spec.latency_effect if spec.acceptance_multiplier == 1.0 else float("nan")
    return {
        "scenario": scenario, "dataset": i, "seed": spec.seed, "n_requests": a.n_requests,
        "truth_log": truth, "mean_log": e.mean, "ci_lo": e.ci[0], "ci_hi": e.ci[1], "p": e.p,
        "covered": (e.ci[0] <= truth <= e.ci[1]) if math.isfinite(truth) else None,
        "mde_log": e.mde, "aa_mean_log": aa.mean, "aa_lo": aa.ci[0], "aa_hi": aa.ci[1], "aa_p": aa.p,
        "aa_covered": aa.ci[0] <= spec.aa_offset <= aa.ci[1],
        "tps_mean_log": a.effects["tps"].mean, "tps_p": a.effects["tps"].p,
        "call": v.call, "flags": ",".join(v.flags),
    }


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for scen, g in df.groupby("scenario", sort=False):
        truth = g["truth_log"].iloc[0]
        cov = g["covered"].dropna()
        rows.append({
            "scenario": scen, "datasets": len(g),
            "true effect %": stats.pct(truth) if math.isfinite(truth) else float("nan"),
            "mean estimate %": stats.pct(g["mean_log"].mean()),
            "coverage": float(cov.astype(float).mean()) if len(cov) else float("nan"),
            "A/A coverage": float(g["aa_covered"].astype(float).mean()),
            "faster": float((g["call"] == "faster").mean()),
            "slower": float((g["call"] == "slower").mean()),
            "inconclusive": float((g["call"] == "inconclusive").mean()),
            "unstable": float((g["call"] == "unstable").mean()),
            "acceptance flag": float(g["flags"].str.contains("acceptance_changed").mean()),
            "mean MDE %": stats.pct(g["mde_log"].mean()),
        })
    return pd.DataFrame(rows)


def _revision() -> dict:
    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except Exception:
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""
    return {"sha": git("rev-parse", "HEAD") or "no commit", "dirty": bool(git("status", "--porcelain"))}


def main(argv: list[str] | None = None) -> int:
    defaults = {"mode": "simulate", "n_datasets": 200, "n_requests": 100, "reps": 1,
                "slowdowns": "0.25,0.5,1.0", "acceptance": 1.05, "request_effect_sd": 0.005,
                "arm_offset_sd": 0.0, "n_boot": 1000, "alpha": 0.05, "seed": 0, "workers": 2,
                "out": "experiments/results/harness_calibration"}
    opts, positional = parse_cli(sys.argv[1:] if argv is None else argv, defaults, HELP)
    if opts is None:
        return 0
    if positional:
        print(f"unexpected arguments {positional}\n\n{HELP}", file=sys.stderr)
        return 2
    if opts["mode"] != "simulate":
        print(f"mode={opts['mode']}: only mode=simulate is implemented; real replays come with "
              "replay.paired", file=sys.stderr)
        return 2
    base = {"n_requests": opts["n_requests"], "reps": opts["reps"], "arm_offset_sd": opts["arm_offset_sd"]}
    scenarios = {"null": dict(base)}
    for s in [float(x) for x in str(opts["slowdowns"]).split(",") if x.strip()]:
        scenarios[f"slow+{s:g}%"] = dict(base, latency_effect=math.log1p(s / 100),
                                          request_effect_sd=opts["request_effect_sd"])
    if opts["acceptance"] != 1.0:
        scenarios[f"accept×{opts['acceptance']:g}"] = dict(
            base, acceptance_multiplier=opts["acceptance"], expect_bit_exact=False)
    jobs = [(name, i, dict(kw, seed=opts["seed"] + i), opts["n_boot"], opts["alpha"])
            for name, kw in scenarios.items() for i in range(opts["n_datasets"])]

    t0 = time.time()
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is a nicety
        tqdm = lambda it, **_: it  # noqa: E731
    if opts["workers"] > 1:
        with concurrent.futures.ProcessPoolExecutor(opts["workers"]) as pool:
            rows = list(tqdm(pool.map(one_dataset, jobs, chunksize=4), total=len(jobs),
                             desc="datasets", file=sys.stderr))
    else:
        rows = [one_dataset(j) for j in tqdm(jobs, desc="datasets", file=sys.stderr)]
    df = pd.DataFrame(rows)
    summary = summarize(df)
    fpr = float(summary.loc[summary["scenario"] == "null", ["faster", "slower"]].sum(axis=1).iloc[0])
    ok = FPR_BOUNDS[0] <= fpr <= FPR_BOUNDS[1]

    out = Path(opts["out"])
    if not out.is_absolute():
        out = ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "calibration.csv", index=False)
    record = {
        "settings": opts, "scenarios": scenarios, "summary": summary.to_dict(orient="records"),
        "false_positive_rate": fpr, "false_positive_bounds": list(FPR_BOUNDS), "pass": ok,
        "seconds": round(time.time() - t0, 1), "revision": _revision(),
        "environment": {"python": platform.python_version(), "numpy": np.__version__,
                        "pandas": pd.__version__, "scipy": __import__("scipy").__version__,
                        "host": platform.node(), "cpus": os.cpu_count()},
        "note": "simulated data: only rates and ratios mean anything here",
    }
    (out / "calibration.json").write_text(json.dumps(record, indent=2, default=str) + "\n")

    with pd.option_context("display.width", 200, "display.max_columns", 20,
                           "display.float_format", "{:.3f}".format):
        print(summary.to_string(index=False))
    print(f"\nA/A false-positive rate {fpr:.3f} (bounds {list(FPR_BOUNDS)}): {'PASS' if ok else 'FAIL'}")
    print(f"{len(df)} datasets in {record['seconds']} s; raw: {out / 'calibration.csv'}; "
          f"summary: {out / 'calibration.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
