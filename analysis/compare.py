"""Several replay runs side by side, one row per run.

    python -m analysis.compare RUN_DIR [RUN_DIR ...] [out=FILE.md|FILE.csv] [n_boot=2000] ...

Columns: run id, revisions (control -> candidate), requests, TPOT effect with CI, tokens-per-step
effect with CI, A/A offset with CI, verdict call and flags. A run that cannot be read or analysed
gets a row saying why instead of stopping the comparison.

Where two or more runs compare the same control and candidate revisions, a last row pools their TPOT
effects (``pooled``): each run's mean weighted by the inverse square of its standard error, read from its
interval, which holds the arm offset it was widened by (``analysis.stats``: the A/A arm's, or the run's
floor). Each run is its own process, so its arms' offsets are drawn anew: pooling R runs shrinks the
offset's share of the error by sqrt(R), which more requests in one run cannot (on the H200 the floor alone
keeps one run's detectable effect near 0.5 %). Its verdict column gives Cochran's Q test of the runs
agreeing within their errors: a small p says they do not, and the pooled interval is too narrow. Pooling
averages only what varies between runs: on the H200 the arm imported and built first ran ~0.07 % slower
(session 58), so runs that all used one fixed arm order (``import_order`` other than ``random``, the
default since then) are marked in that column.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.stats

from analysis import rawio, stats, verdict
from analysis.report import parse_cli

COLUMNS = ["run", "control", "candidate", "requests", "TPOT", "tokens/step", "A/A", "verdict"]


def _rev(arms: dict, arm: str) -> str:
    info = arms.get(arm) or {}
    rev, sha = str(info.get("rev", "?")), str(info.get("sha", ""))[:8]
    dirty = "+dirty" if info.get("dirty_diff") else ""
    return f"{rev}@{sha}{dirty}" if sha else rev


def run_row(run_dir: str | Path, n_boot: int = 2000, seed: int = 0, alpha: float = verdict.ALPHA,
            allow_corrupt: bool = False) -> dict:
    """One comparison row for a run directory (never raises for a bad run: the row says why)."""
    row = dict.fromkeys(COLUMNS, "")
    row["run"] = str(run_dir)
    try:
        run = rawio.read_run(run_dir, allow_corrupt=allow_corrupt)
        row["run"] = str(run.manifest.get("run_id") or run_dir)
        row["control"] = _rev(run.manifest["arms"], "control")
        row["candidate"] = _rev(run.manifest["arms"], "candidate")
        a = stats.analyze(run, n_boot=n_boot, seed=seed, alpha=alpha)
        v = verdict.decide(a, run.manifest, alpha=alpha)
    except (rawio.RunDataError, ValueError) as e:
        row["verdict"] = f"error: {str(e).splitlines()[0]}"
        return row
    row["requests"] = a.n_requests
    row["TPOT"] = verdict.fmt_pct(a.effects["tpot"])
    row["_tpot"] = a.effects["tpot"]
    try:
        o = rawio.arm_orders(run.manifest)
        row["_orders"] = (tuple(o["import"]), o["random"])
    except rawio.RunDataError:
        row["_orders"] = None
    row["tokens/step"] = verdict.fmt_pct(a.effects["tps"])
    row["A/A"] = verdict.fmt_pct(a.aa["tpot"]) if "tpot" in a.aa else "no A/A arm"
    row["verdict"] = v.call + (f" ({', '.join(v.flags)})" if v.flags else "")
    return row


def pooled_row(rows: list[dict]) -> dict | None:
    """The inverse-variance pool of the runs' TPOT effects (module docstring), or None unless at least two
    analysed runs share one control and one candidate revision."""
    ok = [r for r in rows if isinstance(r.get("_tpot"), stats.Effect)]
    if len(ok) < 2 or len({(r["control"], r["candidate"]) for r in ok}) != 1:
        return None
    z = scipy.stats.norm.ppf(0.5 + stats.LEVEL / 2)
    m = np.array([r["_tpot"].mean for r in ok])
    se = np.array([(r["_tpot"].ci[1] - r["_tpot"].ci[0]) / (2 * z) for r in ok])
    if not (np.all(np.isfinite(se)) and np.all(se > 0)):
        return None
    w = 1 / se ** 2
    mean, se_p = float(np.sum(w * m) / np.sum(w)), float(1 / math.sqrt(np.sum(w)))
    q = float(np.sum(w * (m - mean) ** 2))
    p_q = float(scipy.stats.chi2.sf(q, len(ok) - 1))
    ci = (mean - z * se_p, mean + z * se_p)
    row = dict.fromkeys(COLUMNS, "")
    significant = not ci[0] <= 0 <= ci[1]
    orders = {r.get("_orders") for r in ok}
    fixed = ""
    if len(orders) == 1 and None not in orders and not next(iter(orders))[1]:
        fixed = (f"; every run imported its arms in one fixed order ({', '.join(next(iter(orders))[0])}): a bias of "
                 "the order does not pool away (import_order=random)")
    row.update(run=f"pooled ({len(ok)} runs)", control=ok[0]["control"], candidate=ok[0]["candidate"],
               requests=sum(int(r["requests"]) for r in ok),
               TPOT=verdict.fmt_pct_values(stats.pct(mean), stats.pct(ci[0]), stats.pct(ci[1])),
               verdict=(("faster" if mean < 0 else "slower") if significant else "inconclusive")
               + f" (interval only; the runs' agreement: Q p={p_q:.2g}{fixed})", _mean=mean, _ci=ci, _q_p=p_q)
    return row


def compare(run_dirs: list[str], **kw) -> pd.DataFrame:
    rows = [run_row(d, **kw) for d in run_dirs]
    pooled = pooled_row(rows)
    return pd.DataFrame(rows + ([pooled] if pooled else []), columns=COLUMNS)


def to_markdown(df: pd.DataFrame) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


HELP = """python -m analysis.compare RUN_DIR [RUN_DIR ...] [key=value ...]

One row per run: revisions, requests, TPOT effect [95% CI], tokens-per-step effect, A/A offset,
verdict (percent changes of candidate vs control; negative TPOT is faster). Runs of the same two
revisions also get a pooled row: their TPOT effects weighted by their errors, with a test of their
agreement (several runs, each its own process, average the arms' offsets, which one longer run cannot;
runs that all imported their arms in one fixed order are marked: a bias of the arm order does not pool away).
  out=FILE            also write the table (.md: Markdown, .csv: CSV)
  n_boot=2000         bootstrap resamples per effect
  seed=0              bootstrap seed
  alpha=0.05          significance level of the verdict rules
  allow_corrupt=false skip unreadable part files instead of reporting the run as an error"""


def main(argv: list[str] | None = None) -> int:
    defaults = {"out": "", "n_boot": 2000, "seed": 0, "alpha": verdict.ALPHA, "allow_corrupt": False}
    opts, positional = parse_cli(sys.argv[1:] if argv is None else argv, defaults, HELP)
    if opts is None:
        return 0
    if not positional:
        print("expected at least one RUN_DIR\n\n" + HELP, file=sys.stderr)
        return 2
    out = opts.pop("out")
    df = compare(positional, **opts)
    text = to_markdown(df)
    print(text, end="")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        if out.endswith(".csv"):
            df.to_csv(out, index=False)
        else:
            Path(out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
