"""Markdown and self-contained HTML report of one replay run.

    python -m analysis.report RUN_DIR [out=RUN_DIR/report] [n_boot=4000] [seed=0] ...

Writes into ``out`` (default ``RUN_DIR/report/``): ``report.md`` (plots beside it under
``plots/``), ``report.html`` (plots embedded as base64 PNG, no external references),
``summary.json`` (every statistic and the verdict) and ``per_request.csv``. When the manifest names
an MLflow run (``manifest["mlflow"]["run_id"]``, optional ``tracking_uri``) and mlflow is
importable, the report files are logged to that run as artifacts under ``report/``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import rawio, stats, verdict
from analysis.stats import METRIC_NAMES, Analysis, Effect

ARM_COLORS = {"control": "#4c72b0", "candidate": "#dd8452", "aa": "#8c8c8c"}


# --------------------------------------------------------------------------- command line

def _convert(value: str, default):
    if isinstance(default, bool):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {value!r}")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


def parse_cli(argv: list[str], defaults: dict, help_text: str):
    """Parse ``key=value`` arguments (typed by ``defaults``) and positional ones.

    Returns ``(options, positional)``, or ``(None, [])`` after printing ``help_text`` for
    ``--help``/``-h``. An unknown key or a bad value exits with status 2 and a message."""
    opts, positional = dict(defaults), []
    for arg in argv:
        if arg in ("-h", "--help", "help"):
            print(help_text)
            return None, []
        if "=" in arg and not arg.startswith("="):
            key, value = arg.split("=", 1)
            if key not in defaults:
                raise SystemExit(f"unknown option {key!r}; options: {', '.join(defaults)} "
                                 "(--help explains them)")
            try:
                opts[key] = _convert(value, defaults[key])
            except ValueError as e:
                raise SystemExit(f"option {key}: {e}") from None
        else:
            positional.append(arg)
    return opts, positional


# --------------------------------------------------------------------------- plots

def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return buf.getvalue()


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_effects_sorted(a: Analysis) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    per = a.per_request
    e = a.effects["tpot"]
    y = np.sort(100 * np.expm1(per["tpot"].to_numpy()))
    ax.axhspan(e.pct_ci[0], e.pct_ci[1], color=ARM_COLORS["candidate"], alpha=0.25,
               label=f"mean {e.pct:+.2f}%, {round(100 * e.level)}% CI")
    ax.axhline(e.pct, color=ARM_COLORS["candidate"], lw=1)
    if "aa_tpot" in per:
        ya = np.sort(100 * np.expm1(per["aa_tpot"].dropna().to_numpy()))
        ax.plot(np.linspace(0, len(y) - 1, len(ya)), ya, ".", ms=3, color=ARM_COLORS["aa"],
                label="A/A vs control, per request")
    ax.plot(np.arange(len(y)), y, ".", ms=4, color=ARM_COLORS["candidate"],
            label="candidate vs control, per request")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("requests, sorted by effect")
    ax.set_ylabel("TPOT change (%)")
    ax.set_title("Per-request effect on time per output token")
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig)


def plot_effect_vs_context(a: Analysis) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    per = a.per_request
    x = per["context_len"].to_numpy(dtype=float)
    ax.plot(x, 100 * np.expm1(per["tpot"].to_numpy()), ".", ms=4, alpha=0.6,
            color=ARM_COLORS["candidate"], label="per request")
    b = a.context_bins
    if len(b):
        mid = np.sqrt(b["context_min"].to_numpy(float) * b["context_max"].to_numpy(float))
        ax.errorbar(mid, b["pct"], yerr=[b["pct"] - b["pct_lo"], b["pct_hi"] - b["pct"]], fmt="o",
                    color="black", capsize=4, label="bin mean with CI")
    c = a.context_slope
    if c is not None and math.isfinite(c.slope) and len(x) > 2 and np.ptp(x) > 0:
        # the analysis's slope (over placement epochs where they hold several requests), through the medians
        y, lx = per["tpot"].to_numpy(), np.log2(x)
        b0 = float(np.median(y) - c.slope * np.median(lx))
        xs = np.geomspace(x.min(), x.max(), 50)
        ax.plot(xs, 100 * np.expm1(b0 + c.slope * np.log2(xs)), "-", color="black", lw=1,
                label="Theil-Sen fit" + (" (over placement epochs)" if a.settings.get("clusters") else ""))
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("TPOT change (%)")
    ax.set_title("Effect versus context length")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_latency_by_width(steps) -> bytes:
    plt = _plt()
    s = steps.loc[~steps["warmup"].astype(bool)]
    dur_ms = (s["t_end_ns"] - s["t_start_ns"]).to_numpy() / 1e6
    arms = [a for a in ("control", "candidate", "aa") if (s["arm"] == a).any()]
    widths = sorted(s["width"].unique())
    fig, ax = plt.subplots(figsize=(8, 4))
    k = len(arms)
    for i, arm in enumerate(arms):
        data, pos = [], []
        for j, w in enumerate(widths):
            sel = ((s["arm"] == arm) & (s["width"] == w)).to_numpy()
            if sel.any():
                data.append(dur_ms[sel])
                pos.append(j + (i - (k - 1) / 2) * 0.8 / k)
        if data:
            bp = ax.boxplot(data, positions=pos, widths=0.7 / k, showfliers=False, whis=(5, 95),
                            patch_artist=True)
            for box in bp["boxes"]:
                box.set_facecolor(ARM_COLORS[arm])
                box.set_alpha(0.7)
            ax.plot([], [], "s", color=ARM_COLORS[arm], label=arm)
    ax.set_xticks(range(len(widths)), [str(w) for w in widths])
    ax.set_xlabel("verified rows (width)")
    ax.set_ylabel("step latency (ms)")
    ax.set_title("Step latency by width per arm (whiskers 5-95%)")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_accepted_hist(steps) -> bytes:
    plt = _plt()
    s = steps.loc[~steps["warmup"].astype(bool)]
    arms = [a for a in ("control", "candidate", "aa") if (s["arm"] == a).any()]
    values = np.arange(0, int(s["accepted"].max()) + 1 if len(s) else 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    k = len(arms)
    for i, arm in enumerate(arms):
        acc = s.loc[s["arm"] == arm, "accepted"].to_numpy()
        frac = np.bincount(acc, minlength=len(values))[: len(values)] / max(len(acc), 1)
        ax.bar(values + (i - (k - 1) / 2) * 0.8 / k, frac, width=0.8 / k, color=ARM_COLORS[arm],
               label=f"{arm} (mean {acc.mean():.2f})" if len(acc) else arm)
    ax.set_xlabel("drafts accepted in a step")
    ax.set_ylabel("fraction of steps")
    ax.set_title("Accepted-length distribution per arm")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_drift(a: Analysis) -> bytes:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    per = a.per_request
    for col, arm, label in (("tpot", "candidate", "candidate/control"), ("aa_tpot", "aa", "A/A/control")):
        if col not in per:
            continue
        t = per[["order", col]].dropna()
        ax1.plot(t["order"], 100 * np.expm1(t[col]), ".", ms=3, color=ARM_COLORS[arm], label=label)
        if len(t) > 2 and np.ptp(t["order"]) > 0:
            import scipy.stats
            ts = scipy.stats.theilslopes(t[col], t["order"])
            xs = np.array([t["order"].min(), t["order"].max()])
            ax1.plot(xs, 100 * np.expm1(ts.intercept + ts.slope * xs), "-", color=ARM_COLORS[arm])
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_ylabel("TPOT change (%)")
    ax1.set_title("Effect versus run order (drift)")
    ax1.legend(fontsize=8)
    d = a.decodes
    # each decode against its request's mean over all decodes: context and width cancel, time stays
    rel = 100 * np.expm1(np.log(d["step_ns"]) - np.log(d["step_ns"]).groupby(d["request_id"]).transform("mean"))
    for arm in ("control", "candidate", "aa"):
        sel = (d["arm"] == arm).to_numpy()
        if sel.any():
            ax2.plot(d["order"][sel], rel[sel], ".", ms=3, color=ARM_COLORS[arm], label=arm)
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_xlabel("run order (decode index)")
    ax2.set_ylabel("step latency vs request mean (%)")
    ax2.legend(fontsize=8)
    return _png(fig)


def make_plots(a: Analysis, run: rawio.RunData) -> list[tuple[str, str, bytes]]:
    """(file name, title, PNG bytes) for every plot of the report."""
    return [
        ("effects_sorted.png", "Per-request effects, sorted, with the CI of the mean", plot_effects_sorted(a)),
        ("effect_vs_context.png", "Effect versus context length", plot_effect_vs_context(a)),
        ("latency_by_width.png", "Step latency by width per arm", plot_latency_by_width(run.steps)),
        ("accepted_hist.png", "Accepted-length histograms per arm", plot_accepted_hist(run.steps)),
        ("drift.png", "Run-order drift", plot_drift(a)),
    ]


# --------------------------------------------------------------------------- content

def _fmt_value(metric: str, v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    if metric in ("tpot", "step"):
        return f"{v / 1e6:.4g} ms"
    if metric == "tps":
        return f"{v:.3f}"
    return f"{v:.1f}"


def _sig(e: Effect, alpha: float) -> str:
    if not verdict.is_significant(e, alpha):
        return "no"
    return "yes" + (" (lower)" if e.mean < 0 else " (higher)")


def effect_row(e: Effect, alpha: float) -> list[str]:
    d = verdict.pct_digits(e.pct, *e.pct_ci)
    return [METRIC_NAMES.get(e.metric, e.metric), _fmt_value(e.metric, e.before),
            _fmt_value(e.metric, e.after), f"{e.ratio:.4f}", f"{e.pct:+.{d}f}%",
            f"[{e.pct_ci[0]:+.{d}f}%, {e.pct_ci[1]:+.{d}f}%]", f"{e.p:.2g}", _sig(e, alpha)]


def _p_fmt(v):
    return f"{v:.2g}" if math.isfinite(v) else "n/a"


def extreme_requests(per: pd.DataFrame, k: int = 5) -> pd.DataFrame:
    """The k requests with the most negative and the k with the most positive TPOT effect (all of them
    when there are at most 2k), most negative first; ``aa_tpot`` NaN where there is no A/A arm."""
    if not len(per) or "tpot" not in per:
        return per.iloc[:0]
    if "request_id" not in per:            # analyze's per_request: indexed by request_id
        per = per.reset_index()
    t = per.assign(aa_tpot=per["aa_tpot"] if "aa_tpot" in per else np.nan).sort_values("tpot")
    return t if len(t) <= 2 * k else pd.concat([t.head(k), t.tail(k)])


def arm_offset_blocks(a: Analysis) -> list[tuple]:
    """What the candidate's intervals were widened by: the A/A arm's offset beyond its own noise, or the
    run's recorded floor (``arm_sd_floor``), whichever is larger (``analysis.stats``)."""
    t, floor = a.effects["tpot"], float(a.settings.get("arm_sd_floor") or 0.0)
    own = stats.arm_offset_sd(a.aa["tpot"]) if a.aa else None
    seen = ("this run's A/A arm shows none beyond its own request noise" if own == 0 else
            "this run has no A/A arm" if own is None else
            f"this run's A/A arm shows {100 * own:.2f}% beyond its own request noise")
    if t.ci_requests is None:
        return [("p", f"Arm offset: {seen}, and the run recorded no floor; the intervals are the "
                      f"request-resampling ones.")] if (own == 0 or own is None) else []
    lo, hi = (stats.pct(v) for v in t.ci_requests)
    why = (f"the run's floor ({100 * floor:.2f}%, `arm_sd_floor`: the offset a candidate identical to control "
           f"showed across calibration replays; {seen})" if t.arm_sd <= floor else seen)
    return [("p", f"Arm offset: every candidate interval above is widened in quadrature by an arm offset "
                  f"of sd {100 * t.arm_sd:.2f}% on the log scale, {why}. The TPOT interval from resampling "
                  f"requests alone is [{lo:+.1f}%, {hi:+.1f}%].")]


def arm_order_blocks(m: dict) -> list[tuple]:
    """How the run imported and built its arms, and what that means for its offsets (sessions 58-60: on the
    H200 the arm imported first ran ~0.2 % slower than the other two in requests of 47K-190K context, ~0.05 %
    over all, the arm imported second ~0.08 % faster; the build order does not matter), and whether a warm
    copy ran before them (``warm_copy``)."""
    try:
        o = rawio.arm_orders(m)
    except rawio.RunDataError as e:
        return [("p", f"Arm order: unknown ({e}).")]
    if not o["import"]:
        return []
    how = ("drawn at random for this run, so over runs the bias falls on each arm alike" if o["random"] else
           "fixed, not drawn: every run in this order shares the bias, and pooling runs does not remove it "
           "(import_order=random)")
    order = (f"imported and first built {', '.join(o['import'])}" if o["build"] == o["import"] else
             f"imported {', '.join(o['import'])}, first built {', '.join(o['build'])}")
    warm = bool((m.get("config") or {}).get("warm_copy"))
    first = ("A warm copy of the control was imported, built and run before every arm (warm_copy), so none "
             "of them was the process's first copy" if warm else
             "The arm imported first ran about 0.2 % slower than the other two in requests of 47K-190K context "
             "on the H200, and the arm imported second about 0.08 % faster over all (sessions 58-60)")
    return [("p", f"Arm order: {order}. {first}; this order was {how}.")]


def build_blocks(run: rawio.RunData, a: Analysis, v: verdict.Verdict,
                 plots: list[tuple[str, str, bytes]]) -> list[tuple]:
    m = run.manifest
    alpha = a.settings["alpha"]
    lvl = f"{round(100 * a.settings['level'])}% CI"
    B: list[tuple] = [("h", 1, f"Replay report: {m.get('run_id', run.run_dir.name)}"),
                      ("headline", v.call, v.headline)]
    head = ["metric", "control", "candidate", "ratio", "change", lvl, "p (Wilcoxon)", "significant"]
    B += [("h", 2, "Summary: candidate vs control (geometric means over requests)"),
          ("table", head, [effect_row(a.effects[k], alpha) for k in stats.METRICS])]
    k = a.effects["tpot"].n_clusters
    if k:
        pl = m.get("placement") or {}
        B.append(("p", f"Placement epochs: every arm's engine was built again at a new place in memory "
                       f"{pl.get('epochs', k)} times ({pl.get('requests_per_epoch', '?')} request(s) each), "
                       f"so an arm's placement offset is shared by an epoch's requests only. Intervals "
                       f"resample the {k} epochs (distinct sets of epochs a request ran in), and p-values, "
                       f"Hodges–Lehmann estimates and detectable effects are those of the epochs' means."))
    B += arm_order_blocks(m)
    if a.aa:
        head_aa = ["metric", "control", "A/A", "ratio", "change", lvl, "p (Wilcoxon)", "significant"]
        rows = [effect_row(a.aa[k], alpha) for k in ("tpot", "step", "tps")]
        B += [("h", 2, "A/A: control loaded again through the candidate's path"),
              ("table", head_aa, rows)]
        if a.adjusted is not None:
            e = a.adjusted
            B.append(("p", f"A/A-adjusted TPOT effect (per request log(cand/ctrl) − log(aa/ctrl)): "
                           f"{verdict.fmt_pct(e)} {lvl}, p={_p_fmt(e.p)}, n={e.n}."))
    B += arm_offset_blocks(a)
    t, s, q = a.effects["tpot"], a.effects["step"], a.effects["tps"]
    B += [("h", 2, "Decomposition"),
          ("p", f"log TPOT ratio = log step-latency ratio − log tokens-per-step ratio: "
                f"{t.mean:+.5f} = {s.mean:+.5f} − ({q.mean:+.5f}); largest per-request violation of "
                f"the identity {a.identity_residual:.1e}. Step latency {verdict.fmt_pct(s)}, tokens per "
                f"step {verdict.fmt_pct(q)} (an acceptance change has its own effect and interval).")]
    rob = [[METRIC_NAMES[k], f"{a.effects[k].pct:+.3f}%",
            f"{stats.pct(a.effects[k].hl):+.3f}% [{stats.pct(a.effects[k].hl_ci[0]):+.3f}, "
            f"{stats.pct(a.effects[k].hl_ci[1]):+.3f}]",
            f"{100 * a.effects[k].sd:.3f}", f"±{stats.pct(a.effects[k].mde):.3f}%"] for k in stats.METRICS]
    B += [("h", 2, "Robust estimates and sensitivity"),
          ("table", ["metric", "mean", f"Hodges–Lehmann [{lvl}]", "sd of per-request log-ratio (×100)",
                     f"min. detectable (α={alpha}, power 0.8)"], rob)]
    be = a.bit_exact
    lines = [f"candidate identical to control: {be['candidate_exact']}/{be['n_requests']} requests",
             f"A/A identical to control: {be['aa_exact']}/{be['aa_compared']} requests",
             f"control reproducible across its reps: {be['control_reproducible']} requests",
             f"bit-exactness expected by the manifest: {bool(m.get('expect_bit_exact', False))}"]
    if be["n_differing"]:
        lines.append("first differing requests: " + ", ".join(map(str, be["differing"][:20])))
    B += [("h", 2, "Bit-exactness (identical token sequences)"), ("ul", lines)]
    host = getattr(a, "host", None)
    if host:
        by_arm = ", ".join(f"{k} {v}" for k, v in host["contended_by_arm"].items())
        B += [("h", 2, "Host contention (CPU runs)"),
              ("ul", [f"decodes with less than {round(100 * host['threshold'])}% of a core (thread CPU "
                      f"time / wall time): {host['contended']}/{host['n_decodes']} ({by_arm})",
                      f"CPU time / wall time: median {host['median_ratio']:.3f}, lowest {host['min_ratio']:.3f}"])]
    drows = []
    for key, sl in a.drift.items():
        drows.append([key, sl.y, f"{stats.pct(sl.total):+.3f}%",
                      f"[{stats.pct(sl.total_ci[0]):+.3f}%, {stats.pct(sl.total_ci[1]):+.3f}%]",
                      _p_fmt(sl.p)])
    if a.context_slope is not None:
        c = a.context_slope
        drows.append(["context", f"{c.y} per doubling of context", f"{stats.pct(c.slope):+.3f}%",
                      f"[{stats.pct(c.ci[0]):+.3f}%, {stats.pct(c.ci[1]):+.3f}%]", _p_fmt(c.p)])
    B += [("h", 2, "Drift and context length"),
          ("p", ("Theil–Sen slopes over requests" if not a.settings.get("clusters") else
                 f"Theil–Sen slopes over the {a.settings['clusters']} placement epochs (each epoch's mean: "
                 "its requests share the arms' placement)") + " (environment: least squares with context "
                "length held fixed); for run order the change is over the whole run."),
          ("table", ["slope", "of", "change", lvl, "p"], drows)]
    if len(a.context_bins):
        B.append(("table", ["context length", "requests", "TPOT change", lvl],
                  [[f"{r.context_min:,}–{r.context_max:,}", str(r.n), f"{r.pct:+.2f}%",
                    f"[{r.pct_lo:+.2f}%, {r.pct_hi:+.2f}%]"] for r in a.context_bins.itertuples()]))
    ext = extreme_requests(a.per_request)
    if len(ext):
        ep = "epoch" in ext
        B += [("h", 2, "The requests with the largest effects"),
              ("p", "Per-request TPOT change, the most negative and the most positive. An A/A change of the "
                    "same size in the same request points at the request's noise (e.g. one arm's placement), "
                    "not at the candidate."),
              ("table", ["request", "context", "candidate vs control", "A/A vs control"] + (["epoch"] if ep else []),
               [[r.request_id, f"{int(r.context_len):,}", f"{stats.pct(r.tpot):+.2f}%",
                 "–" if not np.isfinite(r.aa_tpot) else f"{stats.pct(r.aa_tpot):+.2f}%"]
                + ([str(int(r.epoch))] if ep else []) for r in ext.itertuples()])]
    B.append(("h", 2, "Plots"))
    for name, title, png in plots:
        B.append(("img", name, title, png))
    B += [("h", 2, "Verdict rules applied"), ("ul", v.reasons or ["(none)"])]
    if run.problems:
        B += [("h", 2, "Data problems found while reading"), ("ul", run.problems)]
    arms = [[arm, str(info.get("rev", "")), str(info.get("sha", ""))[:12],
             "yes" if info.get("dirty_diff") else "no"] for arm, info in m.get("arms", {}).items()]
    B += [("h", 2, "Run"),
          ("ul", [f"run id: {m.get('run_id')}", f"status: {m.get('status')}",
                  f"command: {m.get('command', '')}", f"raw output: {run.run_dir}",
                  f"requests analysed: {a.n_requests} ({a.n_unpaired} left out for lack of a "
                  f"control or candidate decode); decodes: {len(a.decodes)}",
                  f"statistics: {a.settings}"]),
          ("table", ["arm", "revision", "sha", "dirty"], arms)]
    env = m.get("environment") or {}
    if env:
        B.append(("table", ["environment", "value"], [[str(k), str(val)] for k, val in env.items()]))
    if m.get("config"):
        B += [("h", 3, "Resolved config"), ("pre", json.dumps(m["config"], indent=2, default=str))]
    return B


def render_markdown(blocks: list[tuple], plot_dir: str = "plots") -> str:
    out = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append("#" * b[1] + " " + b[2])
        elif kind == "headline":
            out.append(f"**{b[2]}**")
        elif kind == "p":
            out.append(b[1])
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in b[1]))
        elif kind == "pre":
            out.append("```\n" + b[1] + "\n```")
        elif kind == "table":
            esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            rows = ["| " + " | ".join(esc(c) for c in b[1]) + " |",
                    "|" + "|".join("---" for _ in b[1]) + "|"]
            rows += ["| " + " | ".join(esc(c) for c in r) + " |" for r in b[2]]
            out.append("\n".join(rows))
        elif kind == "img":
            out.append(f"![{b[2]}]({plot_dir}/{b[1]})")
    return "\n\n".join(out) + "\n"


CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1000px;margin:2em auto;
padding:0 1em;color:#222}table{border-collapse:collapse;margin:.5em 0 1em}th,td{border:1px solid #ccc;
padding:.25em .6em;text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.headline{font-size:1.15em;padding:.7em 1em;border-radius:6px;margin:1em 0;border-left:6px solid #888;
background:#f5f5f5}.faster{border-color:#2a9d3a;background:#eef8ef}.slower{border-color:#c0392b;
background:#fbeeed}.unstable,.insufficient{border-color:#b8860b;background:#fdf6e3}
img{max-width:100%}pre{background:#f7f7f7;padding:.7em;overflow:auto;font-size:.85em}"""


def render_html(blocks: list[tuple], title: str) -> str:
    e = html.escape
    out = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{e(title)}</title>",
           f"<style>{CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append(f"<h{b[1]}>{e(b[2])}</h{b[1]}>")
        elif kind == "headline":
            out.append(f"<div class=\"headline {e(b[1])}\" id=\"headline\">{e(b[2])}</div>")
        elif kind == "p":
            out.append(f"<p>{e(b[1])}</p>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{e(str(x))}</li>" for x in b[1]) + "</ul>")
        elif kind == "pre":
            out.append(f"<pre>{e(b[1])}</pre>")
        elif kind == "table":
            head = "".join(f"<th>{e(str(c))}</th>" for c in b[1])
            body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in b[2])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(b[3]).decode("ascii")
            out.append(f"<figure><img alt=\"{e(b[2])}\" src=\"data:image/png;base64,{data}\">"
                       f"<figcaption>{e(b[2])}</figcaption></figure>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- MLflow

def log_to_mlflow(manifest: dict, report_dir: Path) -> str:
    """Log the report files as artifacts of the run's MLflow run, if there is one. Never raises:
    returns what happened, in words."""
    info = manifest.get("mlflow") or {}
    run_id = info.get("run_id") if isinstance(info, dict) else None
    if not run_id:
        return "no MLflow run id in the manifest: not logged"
    try:
        from mlflow.tracking import MlflowClient
    except Exception as e:  # mlflow is optional (absent on the GPU machines)
        return f"mlflow not importable ({type(e).__name__}): not logged"
    try:
        client = MlflowClient(tracking_uri=info.get("tracking_uri"))
        client.log_artifacts(run_id, str(report_dir), artifact_path="report")
    except Exception as e:
        return f"MLflow logging failed ({type(e).__name__}: {e})"
    return f"logged to MLflow run {run_id}"


# --------------------------------------------------------------------------- entry points

def build_report(run_dir: str | Path, out: str | Path | None = None, n_boot: int = stats.N_BOOT,
                 seed: int = 0, level: float = stats.LEVEL, method: str = "BCa",
                 alpha: float = verdict.ALPHA, aa_fraction: float = verdict.AA_FRACTION,
                 allow_corrupt: bool = False, mlflow: bool = True) -> dict:
    """Read, analyse, decide and write the report. Returns paths, verdict and analysis."""
    run = rawio.read_run(run_dir, allow_corrupt=allow_corrupt)
    a = stats.analyze(run, level=level, n_boot=n_boot, seed=seed, method=method, alpha=alpha)
    v = verdict.decide(a, run.manifest, alpha=alpha, aa_fraction=aa_fraction)
    out = Path(out) if out else Path(run_dir) / "report"
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plots = make_plots(a, run)
    for name, _, png in plots:
        (out / "plots" / name).write_bytes(png)
    blocks = build_blocks(run, a, v, plots)
    paths = {"markdown": out / "report.md", "html": out / "report.html",
             "summary": out / "summary.json", "per_request": out / "per_request.csv"}
    paths["markdown"].write_text(render_markdown(blocks))
    paths["html"].write_text(render_html(blocks, f"Replay report {a.run_id}"))
    summary = {"verdict": v.to_dict(), "analysis": a.to_dict(), "problems": run.problems,
               "manifest": {k: run.manifest.get(k) for k in ("run_id", "arms", "status", "command",
                                                              "expect_bit_exact")}}
    paths["summary"].write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    a.per_request.to_csv(paths["per_request"])
    logged = log_to_mlflow(run.manifest, out) if mlflow else "MLflow logging disabled"
    return {"paths": paths, "verdict": v, "analysis": a, "mlflow": logged, "run": run}


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


HELP = """python -m analysis.report RUN_DIR [key=value ...]

Analyse a replay run directory and write report.md, report.html (self-contained), summary.json and
per_request.csv into RUN_DIR/report/ (or out=DIR). Prints the one-line verdict.
  out=DIR             where to write the report (default RUN_DIR/report)
  n_boot=4000         bootstrap resamples of requests
  seed=0              seed of the bootstrap's numpy Generator
  level=0.95          confidence level of every interval
  method=BCa          bootstrap interval: BCa or percentile
  alpha=0.05          significance level of the verdict rules
  aa_fraction=0.5     A/A rule: flag when the A/A CI bound exceeds this fraction of |effect|
  allow_corrupt=false skip unreadable part files (listed in the report) instead of failing
  mlflow=true         log the report as artifacts of manifest["mlflow"]["run_id"] if mlflow is installed
Exit status: 0 report written, 2 bad arguments or invalid run directory."""


def main(argv: list[str] | None = None) -> int:
    defaults = {"out": "", "n_boot": stats.N_BOOT, "seed": 0, "level": stats.LEVEL, "method": "BCa",
                "alpha": verdict.ALPHA, "aa_fraction": verdict.AA_FRACTION,
                "allow_corrupt": False, "mlflow": True}
    opts, positional = parse_cli(sys.argv[1:] if argv is None else argv, defaults, HELP)
    if opts is None:
        return 0
    if len(positional) != 1:
        print("expected exactly one RUN_DIR\n\n" + HELP, file=sys.stderr)
        return 2
    try:
        res = build_report(positional[0], **opts)
    except (rawio.RunDataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res["verdict"].headline)
    for kind, p in res["paths"].items():
        print(f"{kind}: {p}")
    print(res["mlflow"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
