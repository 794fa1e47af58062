"""The issue-7 goals, and figures, from the kernel benchmarks' raw results, on any machine (no GPU).

    python3 experiments/kernel_report.py experiments/results/kernels_s29/call4/bench \\
        --step experiments/results/kernels_s29/call4/stepprof --out /tmp/report

Reads a ``bench_kernels.json`` (a file, or the folder ``OUT=... bench_kernels.py`` wrote it to) and
prints every goal of the issue with PASS / FAIL, then writes (into ``--out``, default: beside the
JSON):

* ``attention.png``: per width, each full-cache attention shape's bytes per second as a fraction of
  the run's copy bandwidth, against context, beside what the same bytes cost without attention
  arithmetic: the split + merge skeleton (TMA stream, a partial per program, the runtime's combine),
  the TMA and the register readers (one launch, reading only) and a torch copy of the K rows; the
  goal (0.70) as a line at the contexts it applies to (64K, 192K); dotted, where the run has them
  (session 36 on), what a torch user would run instead: flex_attention compiled and SDPA's fastest
  fused backend (``torch_lines`` prints the same as times);
* ``kernels.png``: every kernel shape's fraction of copy bandwidth (its goal where it has one) and its
  speed-up over the eager torch reference (attention: also over torch's fastest fused attention, a
  black diamond);
* ``attention_model.png``: per width, each of those series' time against the bytes it reads, with
  the straight line ``t = f + bytes / B`` fitted over the contexts from 16K up (``attention_model``):
  ``f`` is what a call costs whatever it reads (launches, ramp, partials, merge), ``B`` the rate it
  streams at. The goal at 64K is a point on that plane; the lines say which fixed cost and which rate
  a design would need to reach it (``--holdout AB_JSON``: its predictions against an ``ab_attention.py``
  run at other contexts; ``--ab AB_JSON``: the same line for every config of such a run, e.g. the flat
  reader, the stream alone and the stream with partials and the combine);
* ``step.png`` (with ``--step``, a ``bench_step.py --profile`` JSON or its folder): the q1 step's
  critical path per part, per context, beside the step's graph time and its floor;
* ``step_sweep.png`` (with ``--step``, a ``bench_step.py --sweep`` JSON; the bench_kernels JSON may
  then be left out): the step's graph time against the K/V bytes it reads over several contexts, the
  line fitted per paired round (``sweep_fit``: what one more KV byte costs the whole step, as a
  fraction of copy bandwidth), and the step's floor beside it.

Several runs at once (``--runs``; folders, JSONs or a device call's ``results.tgz``, read in place):
how close each goal came in each, i.e. the default row's range, median and the runs under the goal,
and with ``--repeats attention=v2p_m64,...`` the same for rows that run the default's code under
another name (the spread between identical calls of one run):

    python3 experiments/kernel_report.py --runs experiments/results/kernels_s*/call*/{bench,results.tgz} \\
        --repeats attention=v2,v2_pdl,v2_pdl_pf0,v2p_m64

Exit status 1 when any goal fails (of the one run given positionally; ``--runs`` alone exits 0).
``bench_kernels.py`` prints its goals through ``goal_checks`` and ``attention_lines`` and writes the
first two figures itself. Nothing here imports torch; matplotlib
only when drawing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tarfile

ATTENTION_GOAL = 0.70       # of copy bandwidth, full-cache attention at >= 64K keys
ATTENTION_GOAL_KEYS = 65536
MOE_GOAL = 0.65             # of copy bandwidth, MoE at 6 live rows with realistic routing
# the attention series drawn beside the kernel: (row key holding microseconds, label)
FLOORS = (("skeleton_us", "split + merge skeleton, no arithmetic"),
          ("read_floor_tma_us", "TMA reader (one launch, reads only)"),
          ("read_floor_us", "register reader (one launch, reads only)"),
          ("copy_same_us", "torch copy of the K rows"),
          # session 31 (runs before it lack them): the skeleton's two launches with a merge that costs
          # nothing, and the attention without its merge (its split, then that empty dependent)
          ("structure_us", "two launches around the TMA stream, a merge that costs nothing"),
          ("nomerge_us", "attention without its merge (measurement only)"))
FLOOR_COLORS = ("C0", "C1", "C2", "C4", "C5", "C6")   # C3 is the kernel's
# what a torch user would run for the same call (session 36; runs before it lack them): not floors, drawn dotted
TORCH = (("torch_flex_us", "torch flex_attention, compiled (with the sink)"),
         ("torch_sdpa_us", "torch SDPA, fastest fused backend (no sink)"),
         ("fi_us", "FlashInfer batch prefill, FA2, 64-token pages (no sink)"),
         ("fi_sink_us", "FlashInfer, the same with the sink"))
TORCH_COLORS = ("C7", "C8", "C9", "black")


def load(path: str, name: str = "bench_kernels") -> tuple[dict, list[dict], str]:
    """(payload, rows, file) of ``path``: a ``<name>.json``, the folder holding one, or a device call's
    ``results.tgz`` holding one (read in place; ``file`` is then ``archive:member``). Raises SystemExit
    with what is wrong (missing file, no rows, no copy bandwidth)."""
    if path.endswith((".tgz", ".tar.gz")):
        if not os.path.isfile(path):
            raise SystemExit(f"{path}: no such file")
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and os.path.basename(m.name) == f"{name}.json"]
            if len(members) != 1:
                raise SystemExit(f"{path}: {len(members)} {name}.json in the archive (one is needed)")
            f = f"{path}:{members[0].name}"
            payload = json.load(tar.extractfile(members[0]))
    else:
        f = os.path.join(path, f"{name}.json") if os.path.isdir(path) else path
        if not os.path.isfile(f):
            raise SystemExit(f"{f}: no such file (give a {name}.json or the folder a run wrote it to)")
        with open(f) as fh:
            payload = json.load(fh)
    rows = payload.get("rows") if isinstance(payload, dict) else None
    if not rows:
        raise SystemExit(f"{f}: no 'rows': not the output of {name}.py")
    if name == "bench_kernels" and not (payload.get("env") or {}).get("copy_bw"):
        raise SystemExit(f"{f}: env.copy_bw missing: fractions of copy bandwidth cannot be checked")
    return payload, rows, f


def partial_line(env: dict) -> str:
    """What a bench_kernels run that did not complete (env.status) measured and did not."""
    done = env.get("kernels_done", [])
    missing = [k for k in env.get("kernels", []) if k not in done]
    return (f"PARTIAL RUN ({env.get('status')}): kernels finished: {', '.join(done) or 'none'}; not finished: "
            f"{', '.join(missing) or 'none'} (the first of them may have some rows). The goals below are those "
            "of the measured rows only.")


def _defaults(rows):
    return [r for r in rows if r.get("variant") == "default"]


def goal_checks(rows: list[dict]) -> list[dict]:
    """Every goal of the issue the run measured, in row order: {name, ok, value, need}. Attention at
    >= 64K keys and the MoE at realistic routing against their fractions of copy bandwidth; every
    kernel shape with a reference against it (the faster of its graph and eager times)."""
    goals = []
    for r in _defaults(rows):
        if r["kernel"] == "attention" and r.get("keys", 0) >= ATTENTION_GOAL_KEYS:
            goals.append(dict(name=f"attention {r['shape']} >= {ATTENTION_GOAL:.2f}", ok=r["frac"] >= ATTENTION_GOAL,
                              value=r["frac"], need=ATTENTION_GOAL))
        if r["kernel"] == "moe" and "realistic" in r["shape"]:
            goals.append(dict(name=f"moe {r['shape']} >= {MOE_GOAL:.2f}", ok=r["frac"] >= MOE_GOAL,
                              value=r["frac"], need=MOE_GOAL))
        if "ref_us" in r:
            t = min(r["graph_us"], r.get("eager_us", math.inf))
            goals.append(dict(name=f"{r['kernel']} {r['shape']} faster than reference", ok=t < r["ref_us"],
                              value=r["ref_us"] / t, need=1.0))
    return goals


def goal_summary(goals: list[dict]) -> str:
    """One line per goal, then the count of passes and failures."""
    lines = [f"{'PASS' if g['ok'] else 'FAIL'}  {g['name']}  ({g['value']:.3f}; needs "
             f"{'>=' if 'reference' not in g['name'] else '>'} {g['need']:.2f})" for g in goals]
    n_ok = sum(g["ok"] for g in goals)
    return "\n".join(lines + [f"{n_ok} PASS, {len(goals) - n_ok} FAIL"])


def margins(runs: list[tuple[str, list[dict]]], repeats: dict | None = None) -> list[dict]:
    """How close each goal came over several runs: per goal of ``goal_checks`` (in first-seen order)
    {name, need, values: [(run label, value)], repeat_values: [(run label, variant, value)]}. ``values``
    are each run's default row (its tree's defaults); ``repeat_values`` the fractions of copy
    bandwidth of the rows that ``repeats`` ({kernel: variants}) names, at the default's shape, for goals
    on a fraction (variants that run the default's code under another name, e.g. attention's
    ``v2p_m64``: the same run's spread between identical calls; a variant name means another code in
    another kernel, hence per kernel). A goal absent from a run is left out of that run."""
    repeats = repeats or {}
    by_name: dict[str, dict] = {}
    for label, rows in runs:
        for g in goal_checks(rows):
            m = by_name.setdefault(g["name"], dict(name=g["name"], need=g["need"], values=[], repeat_values=[]))
            m["values"].append((label, g["value"]))
        frac_goal = {(d["kernel"], d["shape"]): g["name"] for d in _defaults(rows) for g in goal_checks([d])
                     if "reference" not in g["name"]}
        for r in rows:
            name = frac_goal.get((r["kernel"], r["shape"]))
            if name and r.get("variant") in repeats.get(r["kernel"], ()):
                by_name[name]["repeat_values"].append((label, r["variant"], r["frac"]))
    return list(by_name.values())


def _named(items: list[str], most: int = 4) -> str:
    return " (" + ", ".join(items[:most]) + (f", ... {len(items) - most} more" if len(items) > most else "") + ")"


def _under(under: list[str], n: int, every: str, some: str) -> str:
    """``every`` when all n are under the goal, else the count with ``some`` and the first few named."""
    if under and len(under) == n:
        return every
    return f"{len(under)} {some}" + (_named(under) if under else "")


def margin_lines(ms: list[dict]) -> list[str]:
    """One line per goal of ``margins``: the default's range over the runs, its median, the runs under
    the goal (named, the first few); then the repeats' range and those of them under it. A goal
    is missed where a value is below its need (the goals' own test: >= for fractions, > for speed-ups,
    equality aside)."""
    out = []
    for m in ms:
        vals = [v for _, v in m["values"]]
        under = [lab for lab, v in m["values"] if v < m["need"]]
        line = (f"{m['name']}: default {min(vals):.3f}-{max(vals):.3f} over {len(vals)} runs (median "
                f"{statistics.median(vals):.3f}), " + _under(under, len(vals), "every run under the goal",
                                                              "under the goal"))
        if m["repeat_values"]:
            rv = [v for _, _, v in m["repeat_values"]]
            r_under = [f"{lab} {var} {v:.3f}" for lab, var, v in m["repeat_values"] if v < m["need"]]
            line += (f"; the same code under other names: {min(rv):.3f}-{max(rv):.3f} over {len(rv)} rows, "
                     + _under(r_under, len(rv), "every one under", "under"))
        out.append(line)
    return out


def _run_label(path: str) -> str:
    """A run's name in the margin lines: its path without the results folder and the file name."""
    p = os.path.normpath(path)
    for tail in ("results.tgz", "bench_kernels.json", "bench"):
        if os.path.basename(p) == tail:
            p = os.path.dirname(p)
    marker = os.path.join("experiments", "results") + os.sep
    return p.split(marker, 1)[1] if marker in p else p


def runs_report(paths: list[str], repeats: dict | None = None) -> list[str]:
    """--runs: the margin lines over every path that holds a bench_kernels.json (a folder, the file, a
    results.tgz), with the copy bandwidth the runs read and the paths that hold none (or one ``load``
    refuses) named."""
    runs, bws, skipped = [], [], []
    for path in paths:
        try:
            payload, rows, _ = load(path)
        except SystemExit:
            skipped.append(path)
            continue
        runs.append((_run_label(path), rows))
        bws.append(payload["env"]["copy_bw"])
    if not runs:
        raise SystemExit("--runs: none of the paths holds a bench_kernels.json")
    lines = [f"{len(runs)} runs; copy bandwidth read {min(bws) / 1e12:.3f}-{max(bws) / 1e12:.3f} TB/s"]
    if skipped:
        lines.append(f"no usable bench_kernels.json in {len(skipped)} of the paths" + _named(skipped, 3))
    return lines + margin_lines(margins(runs, repeats))


def parse_repeats(specs: list[str]) -> dict:
    """--repeats KERNEL=V1,V2 (repeatable) as {kernel: (variants)}; SystemExit on a malformed one."""
    out: dict[str, tuple] = {}
    for spec in specs or ():
        kernel, sep, variants = spec.partition("=")
        names = tuple(v for v in variants.split(",") if v)
        if not (sep and kernel and names):
            raise SystemExit(f"--repeats {spec!r}: give KERNEL=VARIANT[,VARIANT...], e.g. attention=v2p_m64")
        out[kernel] = out.get(kernel, ()) + names
    return out


def attention_lines(rows: list[dict], copy_bw: float) -> list[str]:
    """Per goal-bearing attention shape: its time and fraction, then each floor's time, fraction and
    the call's time over it (what the 64K verdict rests on)."""
    out = []
    for r in _defaults(rows):
        if r["kernel"] != "attention" or r.get("keys", 0) < ATTENTION_GOAL_KEYS:
            continue
        need_us = r["bytes"] / (ATTENTION_GOAL * copy_bw) * 1e6
        parts = [f"attention {r['shape']}: {r['graph_us']:.2f} us = {r['frac']:.3f} of copy bandwidth "
                 f"(the goal {ATTENTION_GOAL:.2f} is {need_us:.2f} us)"]
        for key, label in FLOORS:
            us = r.get(key, math.nan)
            if us == us:
                parts.append(f"{label}: {us:.2f} us (= {r['bytes'] / (us * 1e-6) / copy_bw:.3f}; the call "
                             f"takes {r['graph_us'] / us:.2f}x)")
        out.append("; ".join(parts))
    return out


def _torch_times(r: dict) -> dict:
    """{TORCH key: us} of a row, the torch attentions it timed (NaN or absent: left out)."""
    return {key: r[key] for key, _ in TORCH if r.get(key, math.nan) == r.get(key, math.nan)}


def torch_lines(rows: list[dict]) -> list[str]:
    """Per full-cache attention shape timed beside torch's own attentions (and FlashInfer's, session 39):
    the runtime's time, each other time and how many times the runtime's that is."""
    out = []
    for r in _defaults(rows):
        times = _torch_times(r) if r["kernel"] == "attention" else {}
        if not times:
            continue
        who = "torch and FlashInfer" if any(key.startswith("fi_") for key in times) else "torch"
        parts = [f"attention {r['shape']} against {who}: the runtime {r['graph_us']:.2f} us"]
        for key, label in TORCH:
            if key in times:
                name = label + (f", {r['torch_sdpa_backend']}" if key == "torch_sdpa_us" and "torch_sdpa_backend" in r
                                else "")
                parts.append(f"{name}: {times[key]:.2f} us ({times[key] / r['graph_us']:.1f}x the runtime's time)")
        out.append("; ".join(parts))
    return out


MODEL_MIN_KEYS = 16384     # the fixed-cost model's smallest context: below it the grid is not filled
MODEL_SERIES = (("graph_us", "attention (default)"),) + FLOORS


def attention_model(rows: list[dict]) -> dict:
    """{width: {label: {f_us, rate, points}}}: per series (the kernel and each floor measured beside
    it), the least-squares line t = f + bytes / rate over the full-cache contexts of at least
    MODEL_MIN_KEYS keys (at least two of them); rate in bytes per second, points [(bytes, us)]."""
    out: dict = {}
    for r in _defaults(rows):
        if r["kernel"] != "attention" or not r["shape"].startswith("full") or r.get("keys", 0) < MODEL_MIN_KEYS:
            continue
        for key, label in MODEL_SERIES:
            us = r.get(key, math.nan)
            if us == us and us > 0:
                out.setdefault(r["w"], {}).setdefault(label, []).append((r["bytes"], us))
    return _fit_series(out)


def _fit_series(out: dict) -> dict:
    """{width: {label: [(bytes, us), ...]}} -> {width: {label: {f_us, rate, points}}}: the least-squares
    line of each series with two distinct byte counts or more and a positive slope."""
    model: dict = {}
    for w, series in sorted(out.items()):
        for label, pts in series.items():
            if len({b for b, _ in pts}) < 2:
                continue
            pts.sort()
            f, slope = _line(pts)
            if slope <= 0:
                continue
            model.setdefault(w, {})[label] = dict(f_us=f, rate=1e6 / slope, points=pts)
    return model


def _p10_p90(xs: list) -> tuple:
    """The 10th and 90th percentile entries of a sorted list (the spreads this report prints)."""
    return xs[len(xs) // 10], xs[(9 * len(xs)) // 10]


def _line(pts) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through [(x, y), ...] (two distinct x or more)."""
    n = len(pts)
    mx = sum(b for b, _ in pts) / n
    my = sum(t for _, t in pts) / n
    slope = sum((b - mx) * (t - my) for b, t in pts) / sum((b - mx) ** 2 for b, _ in pts)
    return my - slope * mx, slope


def ab_model(ab_rows: list[dict]) -> dict:
    """The same line per config of an ab_attention.py run ({width: {config: fit}}), over its contexts of
    at least MODEL_MIN_KEYS keys: e.g. the flat reader, the stream alone, the stream with partials and
    the combine, to see which step of the split + merge form adds which fixed cost."""
    out: dict = {}
    for r in ab_rows:
        if r.get("ctx", 0) >= MODEL_MIN_KEYS and r.get("us", 0) > 0:
            out.setdefault(r["w"], {}).setdefault(r["config"], []).append((r["bytes"], r["us"]))
    return _fit_series(out)


def model_lines(rows: list[dict], copy_bw: float) -> list[str]:
    """Per width: each series' fixed cost and rate, then what the 64K goal asks of a design with the
    skeleton's fixed cost (the rate it would need, against the fastest rate measured), then the 64K
    call's parts where the run measured them (``parts_line``)."""
    model = attention_model(rows)
    goal_rows = {r.get("w"): r for r in _defaults(rows) if r["kernel"] == "attention"
                 and r.get("keys") == ATTENTION_GOAL_KEYS and r["shape"].startswith("full")}
    out = []
    for w, fits in model.items():
        parts = [f"{label} f = {m['f_us']:.2f} us, B = {m['rate'] / 1e12:.2f} TB/s" for label, m in fits.items()]
        lo = min(b for m in fits.values() for b, _ in m["points"])
        n_ctx = max(len(m["points"]) for m in fits.values())
        line = (f"attention w = {w}, t = f + bytes / B (least squares over {n_ctx} contexts from {lo / 1e6:.1f} "
                f"MB): " + "; ".join(parts))
        r = goal_rows.get(w)
        skel = fits.get(FLOORS[0][1])
        if r is not None and skel is not None:
            need_us = r["bytes"] / (ATTENTION_GOAL * copy_bw) * 1e6
            fastest_label, fastest = max(fits.items(), key=lambda kv: kv[1]["rate"])
            left = need_us - skel["f_us"]
            if left <= 0:
                line += (f". At 64K the goal's {need_us:.2f} us is below the skeleton's fixed cost alone "
                         f"({skel['f_us']:.2f} us)")
            else:
                rate = r["bytes"] / (left * 1e-6)
                line += (f". At 64K the goal's {need_us:.2f} us minus the skeleton's fixed cost "
                         f"({skel['f_us']:.2f} us) leaves {left:.2f} us for {r['bytes'] / 1e6:.2f} MB: "
                         f"{rate / 1e12:.2f} TB/s, {rate / fastest['rate']:.2f}x the fastest rate measured "
                         f"({fastest_label}, {fastest['rate'] / 1e12:.2f} TB/s)")
            budget = need_us - r["bytes"] / fastest["rate"] * 1e6
            line += (f". At that fastest rate the goal leaves {budget:.2f} us of fixed cost: "
                     f"{budget - fastest['f_us']:.2f} us above that reader's own {fastest['f_us']:.2f} us for "
                     f"the partials and the merge, which cost {skel['f_us'] - fastest['f_us']:.2f} us in the skeleton")
        if r is not None:
            line += parts_line(r, copy_bw)
        out.append(line)
    return out


def parts_line(r: dict, copy_bw: float) -> str:
    """The 64K call split into its parts, where the run measured them (session 31 on; else ""): the two
    launches around a TMA stream with a merge that costs nothing (structure_us), what the attention's
    split adds to them (nomerge_us - structure_us) and what its merge adds (graph_us - nomerge_us), and
    the time of a split as fast as that stream with today's merge, against the goal."""
    s_us, n_us, t_us = r.get("structure_us", math.nan), r.get("nomerge_us", math.nan), r["graph_us"]
    if not (s_us == s_us and n_us == n_us):
        return ""
    need_us = r["bytes"] / (ATTENTION_GOAL * copy_bw) * 1e6
    best = s_us + (t_us - n_us)
    return (f". The 64K call in parts: the two launches around the TMA stream with a merge that costs nothing "
            f"{s_us:.2f} us (= {r['bytes'] / (s_us * 1e-6) / copy_bw:.3f}); the attention's split adds "
            f"{n_us - s_us:.2f} us to them and its merge {t_us - n_us:.2f} us. A split as fast as that stream "
            f"with this merge: {best:.2f} us (= {r['bytes'] / (best * 1e-6) / copy_bw:.3f}) against the goal's "
            f"{need_us:.2f} us")


# ab_attention.py configs that time the model's series: (config, series label)
HOLDOUT_CONFIGS = (("default", "attention (default)"), ("tmasm1_128_s3", FLOORS[0][1]),
                   ("tmaf128", FLOORS[1][1]))


def holdout_lines(rows: list[dict], ab_rows: list[dict]) -> list[str]:
    """The model fitted on ``rows`` (bench_kernels) against an ab_attention.py run at other contexts
    (its ``default``, ``tmasm1_128_s3`` and ``tmaf128`` configs): per row, the predicted and the measured
    time. The TMA reader there is one of the readers bench_kernels takes the fastest of."""
    model = attention_model(rows)
    out = []
    for r in sorted(ab_rows, key=lambda r: (r.get("w", 0), r.get("ctx", 0))):
        label = dict(HOLDOUT_CONFIGS).get(r.get("config"))
        fit = model.get(r.get("w"), {}).get(label)
        if fit is None:
            continue
        pred = fit["f_us"] + r["bytes"] / fit["rate"] * 1e6
        out.append(f"{r['shape']} {r['config']:>14s} ({label}): predicted {pred:6.2f} us, measured "
                   f"{r['us']:6.2f} us ({r['us'] - pred:+.2f})")
    return out


def plot_model(rows: list[dict], env: dict, path: str) -> dict:
    """attention_model.png (see the module's doc); returns attention_model."""
    plt = _pyplot()
    model = attention_model(rows)
    if not model:
        raise SystemExit("no full-cache attention rows at two contexts from 16K up")
    fig, axes = plt.subplots(1, len(model), figsize=(5.2 * len(model), 4.4), sharey=True, squeeze=False)
    colors = {"attention (default)": "C3"}
    colors.update({label: c for (_, label), c in zip(FLOORS, FLOOR_COLORS)})
    for ax, (w, fits) in zip(axes[0], model.items()):
        top = max(b for m in fits.values() for b, _ in m["points"])
        for label, m in fits.items():
            xs = [b / 1e6 for b, _ in m["points"]]
            ax.plot(xs, [t for _, t in m["points"]], "o", color=colors[label], ms=4)
            ax.plot([0, top / 1e6], [m["f_us"], m["f_us"] + top / m["rate"] * 1e6], color=colors[label], lw=1.2,
                    label=f"{label}: {m['f_us']:.1f} us + {m['rate'] / 1e12:.2f} TB/s")
        skel = fits.get(FLOORS[0][1])
        for r in _defaults(rows):
            if r.get("w") == w and r["kernel"] == "attention" and r["shape"].startswith("full") \
                    and r.get("keys", 0) >= ATTENTION_GOAL_KEYS:
                need = r["bytes"] / (ATTENTION_GOAL * env["copy_bw"]) * 1e6
                ax.plot(r["bytes"] / 1e6, need, "k*", ms=10)
                if skel is not None and r.get("keys") == ATTENTION_GOAL_KEYS:
                    if need > skel["f_us"]:
                        rate = r["bytes"] / ((need - skel["f_us"]) * 1e-6)
                        ax.plot([0, r["bytes"] / 1e6], [skel["f_us"], need], ":", color="k", lw=1.2,
                                label=f"the skeleton's fixed cost, then the rate the 64K goal needs: "
                                      f"{rate / 1e12:.2f} TB/s")
        ax.plot([], [], "k*", label=f"the goal ({ATTENTION_GOAL:.2f} of copy) at 64K / 192K")
        ax.set_xlim(0, top / 1e6 * 1.05)
        ax.set_ylim(0)
        ax.grid(alpha=0.3)
        ax.set_title(f"w = {w} live rows")
        ax.set_xlabel("KV bytes read per call (MB)")
    axes[0][0].set_ylabel("time per call (us)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    _save(plt, fig, f"Attention time = fixed cost + bytes / rate: {_title(env)}", path)
    return model


def attention_series(rows: list[dict], copy_bw: float) -> dict:
    """{width: {label: [(keys, fraction of copy bandwidth), ...]}} of the full-cache attention rows:
    the kernel (default variant) and each floor measured beside it, sorted by keys."""
    out: dict = {}
    for r in _defaults(rows):
        if r["kernel"] != "attention" or not r["shape"].startswith("full"):
            continue
        s = out.setdefault(r["w"], {})
        s.setdefault("attention (default)", []).append((r["keys"], r["frac"]))
        for key, label in FLOORS + TORCH:
            us = r.get(key, math.nan)
            if us == us and us > 0:
                s.setdefault(label, []).append((r["keys"], r["bytes"] / (us * 1e-6) / copy_bw))
    for s in out.values():
        for pts in s.values():
            pts.sort()
    return dict(sorted(out.items()))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, title: str, path: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(env: dict) -> str:
    return ", ".join([f"{env.get('device', '?')}", f"copy {env.get('copy_bw', math.nan) / 1e12:.2f} TB/s"]
                     + ([env["time"]] if env.get("time") else []))


def plot_attention(rows: list[dict], env: dict, path: str) -> dict:
    """attention.png (see the module's doc); returns the series drawn."""
    plt = _pyplot()
    series = attention_series(rows, env["copy_bw"])
    if not series:
        raise SystemExit("no full-cache attention rows (run bench_kernels.py with --only attention)")
    fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 4.4), sharey=True, squeeze=False)
    styles = {"attention (default)": dict(color="C3", lw=2.4, marker="o")}
    for i, (_, label) in enumerate(FLOORS):
        styles[label] = dict(color=FLOOR_COLORS[i], lw=1.3, marker=".", ls="--" if i else "-")
    for i, (_, label) in enumerate(TORCH):
        styles[label] = dict(color=TORCH_COLORS[i], lw=1.3, marker="x", ls=":")
    for ax, (w, s) in zip(axes[0], series.items()):
        for label, pts in s.items():
            ax.plot([k for k, _ in pts], [f for _, f in pts], label=label, **styles[label])
        goal_keys = sorted({k for k, _ in s["attention (default)"] if k >= ATTENTION_GOAL_KEYS})
        if goal_keys:
            ax.hlines(ATTENTION_GOAL, goal_keys[0] / 1.3, goal_keys[-1] * 1.3, colors="k", lw=1.2,
                      label=f"goal {ATTENTION_GOAL:.2f} (>= 64K keys)")
        for k, f in s["attention (default)"]:
            if k >= ATTENTION_GOAL_KEYS:
                ax.annotate(f"{f:.3f}", (k, f), textcoords="offset points", xytext=(4, -12), fontsize=8,
                            color="C3" if f < ATTENTION_GOAL else "C2")
        ax.set_xscale("log", base=2)
        ax.set_xticks([k for k, _ in s["attention (default)"]])
        ax.set_xticklabels([f"{k // 1024}K" for k, _ in s["attention (default)"]])
        ax.set_ylim(0, 1.0)
        ax.grid(alpha=0.3)
        ax.set_title(f"w = {w} live rows")
        ax.set_xlabel("keys (context)")
    axes[0][0].set_ylabel("KV bytes / time, fraction of copy bandwidth")
    axes[0][-1].legend(fontsize=7.5, loc="lower right")
    _save(plt, fig, f"Full-cache decode attention against its floors: {_title(env)}", path)
    return series


def plot_kernels(rows: list[dict], env: dict, path: str) -> list[dict]:
    """kernels.png (see the module's doc); returns the rows drawn (default variants)."""
    plt = _pyplot()
    drawn = _defaults(rows)
    if not drawn:
        raise SystemExit("no default-variant rows to draw")
    labels = [f"{r['kernel']} {r['shape']}" for r in drawn]
    y = list(range(len(drawn)))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.28 * len(drawn) + 1.6), sharey=True)
    a1.barh(y, [r["frac"] for r in drawn], color=["C0" if r["kernel"] != "attention" else "C3" for r in drawn])
    for yi, r in zip(y, drawn):
        a1.text(r["frac"] + 0.01, yi, f"{r['frac']:.3f}", va="center", fontsize=7)
        need = (ATTENTION_GOAL if r["kernel"] == "attention" and r.get("keys", 0) >= ATTENTION_GOAL_KEYS
                else MOE_GOAL if r["kernel"] == "moe" and "realistic" in r["shape"] else None)
        if need is not None:
            a1.plot([need, need], [yi - 0.45, yi + 0.45], color="k", lw=2)
    a1.set_yticks(y)
    a1.set_yticklabels(labels, fontsize=7.5)
    a1.set_xlim(0, 1.05)
    a1.set_xlabel("minimum bytes / time, fraction of copy bandwidth (black: the goal)")
    a1.grid(axis="x", alpha=0.3)
    speed = [r["ref_us"] / min(r["graph_us"], r.get("eager_us", math.inf)) if "ref_us" in r else math.nan
             for r in drawn]
    a2.barh(y, speed, color="C2")
    for yi, r in zip(y, drawn):
        fused = _torch_times(r)
        if fused:
            a2.plot(min(fused.values()) / r["graph_us"], yi, "kD", ms=4)
    a2.axvline(1.0, color="k", lw=1.2)
    a2.set_xscale("log")
    a2.set_xlabel("speed-up over the eager torch reference (log; must exceed 1); diamonds: over torch's "
                  "fastest fused attention")
    a2.grid(axis="x", alpha=0.3)
    _save(plt, fig, f"Decode-round kernels, q1 rank-emulation shard: {_title(env)}", path)
    return drawn


def step_parts(payload: dict) -> dict:
    """{context: [(part, exposed ms), ...] largest first} of a bench_step.py --profile JSON."""
    out = {}
    for ctx, prof in sorted((payload.get("profiles") or {}).items(), key=lambda kv: int(kv[0])):
        parts = [(name, p["exposed_us"] / 1e3) for name, p in prof["parts"].items()]
        out[int(ctx)] = sorted(parts, key=lambda kv: -kv[1])
    if not out:
        raise SystemExit("the bench_step JSON has no profiles: run bench_step.py with --profile")
    return out


def plot_step(payload: dict, path: str) -> dict:
    """step.png (see the module's doc); returns step_parts."""
    plt = _pyplot()
    parts = step_parts(payload)
    graph = {(r["context"]): r for r in payload["rows"] if r.get("arm") == "fast-graph"}
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.6), squeeze=False)
    for ax, (ctx, pts) in zip(axes[0], parts.items()):
        names = [n for n, _ in pts][::-1]
        ax.barh(range(len(pts)), [v for _, v in pts][::-1], color="C0")
        ax.set_yticks(range(len(pts)))
        ax.set_yticklabels(names, fontsize=8)
        for i, (_, v) in enumerate(pts[::-1]):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
        r = graph.get(ctx)
        head = (f"graph {r['ms']:.2f} ms, floor {r['floor_ms']:.2f} ms ({r['frac_of_floor']:.3f})"
                if r else "")
        ax.set_title(f"q1 step at {ctx // 1024}K: {head}", fontsize=9)
        ax.set_xlabel("critical path per part (exposed ms per step)")
        ax.grid(axis="x", alpha=0.3)
    _save(plt, fig, f"Where the q1 step's time goes: {payload.get('env', {}).get('device', '?')}", path)
    return parts


# ------------------------------------------------------------------ the step's context sweep (--sweep)
def sweep_fit(kv_bytes: dict, times_ms: dict, copy_bw: float) -> dict:
    """The q1 step's graph time against the KV bytes its full-attention passes read (``bench_step.py
    --sweep``): what one more byte of context costs the whole step, fixed costs aside.

    ``kv_bytes``: {context: bytes of K/V the step reads at that context}; ``times_ms``: {context: [ms
    of one step, one per round]}, the rounds paired (round i replays every context's graph once, in a
    shuffled order), so drifts common to a round cancel in its slope. Per round, the least-squares
    line t = f + bytes / B over the contexts. Returns the median round's slope as ``rate`` (B, bytes
    per second), its 10-90 % range over the rounds (``rate_p10`` / ``rate_p90``, low to high),
    ``frac`` = B / copy_bw (1.0: each extra KV byte costs the step what it costs the copy; the floor's
    own line has exactly that slope), ``f_ms`` (the median times' line at zero bytes), per context
    the median ms and the 10-90 % range, and ``ok`` (False when the median slope is not positive: the
    contexts do not separate, e.g. wall-clock times of a dry run). Raises ValueError on fewer than two
    contexts or on contexts with unequal round counts."""
    ctx = sorted(times_ms)
    if len(ctx) < 2 or len({kv_bytes[c] for c in ctx}) < 2:
        raise ValueError(f"a sweep needs two contexts or more with different KV bytes, got {ctx}")
    rounds = {len(times_ms[c]) for c in ctx}
    if len(rounds) != 1 or 0 in rounds:
        raise ValueError(f"every context needs the same number of rounds (paired), got "
                         f"{ {c: len(times_ms[c]) for c in ctx} }")
    n = rounds.pop()
    slopes = sorted(_line([(kv_bytes[c], times_ms[c][i] * 1e-3) for c in ctx])[1] for i in range(n))
    med = [statistics.median(times_ms[c]) for c in ctx]
    f_s, slope_med = _line([(kv_bytes[c], m * 1e-3) for c, m in zip(ctx, med)])
    slope = statistics.median(slopes)
    ok = slope > 0
    hi, lo = _p10_p90(slopes)   # the largest slope is the lowest rate
    rate = 1 / slope if ok else math.nan
    per = {}
    for c, m in zip(ctx, med):
        p10, p90 = _p10_p90(sorted(times_ms[c]))
        per[c] = dict(kv_bytes=kv_bytes[c], ms=m, p10_ms=p10, p90_ms=p90)
    return dict(contexts=ctx, rounds=n, ok=ok, rate=rate, frac=rate / copy_bw if ok else math.nan,
                rate_p10=1 / lo if lo > 0 else math.nan, rate_p90=1 / hi if hi > 0 else math.nan,
                f_ms=f_s * 1e3, median_line_rate=1 / slope_med if slope_med > 0 else math.nan,
                copy_bw=copy_bw, per_context=per)


def sweep_lines(fit: dict, floor_ms: dict | None = None) -> list[str]:
    """The sweep's result as printed lines (``floor_ms``: {context: the step's floor}, optional)."""
    base = fit.get("base", "default")
    head = (f"the q1 step against its KV bytes ({len(fit['contexts'])} contexts, {fit['rounds']} paired "
            f"rounds{'' if base == 'default' else f', every arm with {base}'}): ")
    if not fit["ok"]:
        return [head + "no positive slope (the contexts' times do not separate)"]
    bw = fit["copy_bw"]
    lines = [head + f"t = {fit['f_ms']:.3f} ms + KV bytes / {fit['rate'] / 1e12:.2f} TB/s: each extra KV byte "
             f"costs the step {1 / fit['frac']:.3f}x what it costs the copy (B = {fit['frac']:.3f} of copy "
             f"bandwidth; rounds 10-90 %: {fit['rate_p10'] / bw:.3f}-{fit['rate_p90'] / bw:.3f})"]
    for c, p in fit["per_context"].items():
        fl = (floor_ms or {}).get(c)
        lines.append(f"  {c:>7} keys: KV {p['kv_bytes'] / 1e9:.3f} GB, step {p['ms']:.3f} ms "
                     f"[{p['p10_ms']:.3f}, {p['p90_ms']:.3f}]" + (f", floor {fl:.3f} ms" if fl else ""))
    return lines


def sweep_ratio_lines(payload: dict) -> list[str]:
    """Per non-default variant of a --sweep run and per context, the median of its per-round time over
    the default's in the same round (the rounds replay every graph once: a paired A/B at every context)
    with the ratios' 10-90 % range."""
    rows = [r for r in payload["rows"] if r.get("arm") == "sweep"]
    base = {r["context"]: r["times_ms"] for r in rows if r.get("variant", "default") == "default"}
    lines = []
    for r in rows:
        v = r.get("variant", "default")
        if v == "default" or r["context"] not in base:
            continue
        q = sorted(t / b for t, b in zip(r["times_ms"], base[r["context"]]))
        p10, p90 = _p10_p90(q)
        lines.append(f"[{v}] {r['context']:>7} keys: {statistics.median(q):.4f} of the default's step "
                     f"[{p10:.4f}, {p90:.4f}]")
    return lines


def plot_sweep(fits: dict, env: dict, path: str, floor_ms: dict | None = None) -> None:
    """step_sweep.png: per variant ({name: sweep_fit}), the step's time (median, 10-90 % bars) against
    its KV bytes with the line through the medians (labelled with the rounds' median B), and the floor
    (bytes over copy bandwidth) at the same contexts: equal slopes mean the step pays each extra KV
    byte at the copy's rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, fit) in enumerate(fits.items()):
        per, color = fit["per_context"], ("C3", "C1", "C2", "C4", "C5")[i % 5]
        x = [per[c]["kv_bytes"] / 1e9 for c in fit["contexts"]]
        y = [per[c]["ms"] for c in fit["contexts"]]
        err = [[m - per[c]["p10_ms"] for c, m in zip(fit["contexts"], y)],
               [per[c]["p90_ms"] - m for c, m in zip(fit["contexts"], y)]]
        ax.errorbar(x, y, yerr=err, fmt="o", color=color, capsize=3, label=f"{name}: step (graph), median, 10-90 %")
        if fit["ok"]:
            xs = [0.0, max(x) * 1.05]
            ax.plot(xs, [fit["f_ms"] + xb * 1e9 / fit["median_line_rate"] * 1e3 for xb in xs], "--", color=color,
                    label=f"{name}: B = {fit['frac']:.3f} of copy bandwidth per extra KV byte")
        if i == 0:
            for xi, yi, c in zip(x, y, fit["contexts"]):
                ax.annotate(f"{c // 1024}K", (xi, yi), textcoords="offset points", xytext=(4, -12), fontsize=8)
            if floor_ms:
                ax.plot(x, [floor_ms[c] for c in fit["contexts"]], "s-", color="C0",
                        label="floor (bytes / copy bandwidth)")
    ax.set_xlabel("K/V bytes the step reads (GB)")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    base = next(iter(fits.values())).get("base", "default") if fits else "default"
    _save(plt, fig, f"q1 step against context{'' if base == 'default' else f' (every arm with {base})'}: "
                    f"{_title(env)}", path)


def sweep_from_payload(payload: dict) -> tuple[dict, dict]:
    """({variant: sweep_fit}, {context: floor ms}) from a bench_step.json holding --sweep rows (the
    default first). Raises SystemExit when it has none."""
    rows = [r for r in payload["rows"] if r.get("arm") == "sweep"]
    if not rows:
        raise SystemExit("the bench_step JSON has no sweep rows: run bench_step.py with --sweep")
    names = sorted({r.get("variant", "default") for r in rows}, key=lambda v: (v != "default", v))
    fits = {}
    for v in names:
        mine = [r for r in rows if r.get("variant", "default") == v]
        fits[v] = sweep_fit({r["context"]: r["kv_bytes"] for r in mine}, {r["context"]: r["times_ms"] for r in mine},
                            payload["copy_bw"])
        fits[v]["base"] = mine[0].get("base", "default")   # --sweep-base: applied to every arm
    return fits, {r["context"]: r["floor_ms"] for r in rows}


def write_figures(rows: list[dict], env: dict, out: str) -> list[str]:
    """attention.png and attention_model.png (when the run timed full-cache attention) and kernels.png
    into ``out``."""
    os.makedirs(out, exist_ok=True)
    written = []
    if attention_series(rows, env["copy_bw"]):
        plot_attention(rows, env, os.path.join(out, "attention.png"))
        written.append(os.path.join(out, "attention.png"))
    if attention_model(rows):
        plot_model(rows, env, os.path.join(out, "attention_model.png"))
        written.append(os.path.join(out, "attention_model.png"))
    plot_kernels(rows, env, os.path.join(out, "kernels.png"))
    written.append(os.path.join(out, "kernels.png"))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="?",
                    help="bench_kernels.json, or the folder a run wrote it to ($OUT); may be left out with --step")
    ap.add_argument("--step", help="bench_step.json (or its folder) of a --profile run: also step.png; of a "
                                   "--sweep run: the sweep's line and step_sweep.png")
    ap.add_argument("--out", help="folder for the figures (default: the JSON's folder)")
    ap.add_argument("--no-figures", action="store_true", help="print the goals only")
    ap.add_argument("--ab", help="an ab_attention.py JSON (or its folder): the fixed-cost line of each of its "
                                 "configs (contexts from 16K)")
    ap.add_argument("--holdout", help="an ab_attention.py JSON (or its folder) at other contexts: the fixed-cost "
                                      "model's predictions against its times")
    ap.add_argument("--runs", nargs="+", metavar="RUN",
                    help="several bench_kernels runs (folders, JSONs or a device call's results.tgz): how close "
                         "each goal came in each (the default row's range, median and the runs under the goal)")
    ap.add_argument("--repeats", action="append", metavar="KERNEL=V1,V2",
                    help="with --runs: a kernel's variants that run its default's code under other names, their "
                         "range too (repeatable; e.g. attention=v2,v2_pdl,v2_pdl_pf0,v2p_m64 for the runs of "
                         "sessions 28-40)")
    args = ap.parse_args(argv)
    if not args.kernels and not args.step and not args.runs:
        ap.error("give a bench_kernels.json (or its folder), --step with a bench_step.json, or --runs")
    if args.repeats and not args.runs:
        ap.error("--repeats goes with --runs")
    written, status = [], 0
    if args.runs:
        print("\n".join(runs_report(args.runs, parse_repeats(args.repeats))))
    if args.kernels:
        status, out, written = _kernels_report(args)
    if args.step:
        step, _, sf = load(args.step, "bench_step")
        has_profiles = bool(step.get("profiles"))
        has_sweep = any(r.get("arm") == "sweep" for r in step["rows"])
        if not (has_profiles or has_sweep):
            raise SystemExit(f"{sf}: no profiles and no sweep rows: run bench_step.py with --profile or --sweep")
        out = args.out or (out if args.kernels else os.path.dirname(os.path.abspath(sf)))
        if has_sweep:
            fits, floors = sweep_from_payload(step)
            for v, fit in fits.items():
                print("\n".join(f"[{v}] {line}" for line in sweep_lines(fit, floors)))
            print("\n".join(sweep_ratio_lines(step)))
        if not args.no_figures:
            os.makedirs(out, exist_ok=True)
            if has_profiles:
                plot_step(step, os.path.join(out, "step.png"))
                written.append(os.path.join(out, "step.png"))
            if has_sweep:
                plot_sweep(fits, {**step.get("env", {}), "copy_bw": step["copy_bw"]},
                           os.path.join(out, "step_sweep.png"), floors)
                written.append(os.path.join(out, "step_sweep.png"))
    if written:
        print("wrote " + ", ".join(written))
    return status


def _kernels_report(args) -> tuple[int, str, list[str]]:
    """main's bench_kernels part: (exit status, figure folder, figures written)."""
    payload, rows, f = load(args.kernels)
    env = payload["env"]
    print(f"{f}: {len(rows)} rows; {_title(env)}")
    if env.get("status", "complete") != "complete":   # bench_kernels saves a run cut off midway
        print(partial_line(env))
    for line in attention_lines(rows, env["copy_bw"]) + model_lines(rows, env["copy_bw"]) + torch_lines(rows):
        print(line)
    if args.ab:
        _, ab_rows, _ = load(args.ab, "ab_attention")
        fits = ab_model(ab_rows)
        if not fits:
            raise SystemExit(f"{args.ab}: no config timed at two contexts from 16K up")
        for w, by_config in fits.items():
            print(f"{args.ab}, w = {w}, t = f + bytes / B: " + "; ".join(
                f"{c} f = {m['f_us']:.2f} us, B = {m['rate'] / 1e12:.2f} TB/s ({len(m['points'])} contexts)"
                for c, m in by_config.items()))
    if args.holdout:
        _, ab_rows, _ = load(args.holdout, "ab_attention")
        lines = holdout_lines(rows, ab_rows)
        if not lines:
            raise SystemExit(f"{args.holdout}: no rows of {', '.join(c for c, _ in HOLDOUT_CONFIGS)} at a "
                             "width the model has")
        print("\n".join(["the fixed-cost model at the held-out contexts:"] + lines))
    goals = goal_checks(rows)
    print(goal_summary(goals))
    status = 0 if all(g["ok"] for g in goals) else 1
    out = args.out or os.path.dirname(os.path.abspath(f))
    if args.no_figures:
        return status, out, []
    return status, out, write_figures(rows, env, out)


if __name__ == "__main__":
    sys.exit(main())
