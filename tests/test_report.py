"""Run directories on disk: reading and validation (rawio), the report and the comparison CLIs."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis import compare, rawio, report, synthetic

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "faster"
    synthetic.write_run(d, synthetic.SyntheticSpec(seed=1, n_requests=40, latency_effect=-0.03,
                                                   output_max=128), parts=3)
    return d


def external_references(page: str) -> list[str]:
    """src/href attributes and url() references that point outside the page."""
    refs = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]+)""", page, flags=re.I)
    refs += re.findall(r"url\(([^)]*)\)", page, flags=re.I)
    return [r for r in refs if not r.startswith("data:") and not r.startswith("#")]


def test_external_reference_check_can_fail():
    assert external_references('<img src="plots/a.png"><link href="https://x/y.css">') == [
        "plots/a.png", "https://x/y.css"]
    assert external_references('<img src="data:image/png;base64,AAAA">') == []


def test_report_is_self_contained_with_plots_and_headline(run_dir):
    assert report.main([str(run_dir), "n_boot=500"]) == 0
    out = run_dir / "report"
    page = (out / "report.html").read_text()
    assert external_references(page) == []
    imgs = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) == 5 and all(len(i) > 1000 for i in imgs)
    summary = json.loads((out / "summary.json").read_text())
    headline = summary["verdict"]["headline"]
    assert summary["verdict"]["call"] == "faster"
    assert headline.startswith("candidate is ") and "faster per output token" in headline
    assert html.escape(headline) in page
    md = (out / "report.md").read_text()
    assert headline in md and "| time per output token |" in md
    # a run recorded without arm_orders (before session 58): its config's order, fixed
    assert "Arm order: imported and first built control, candidate, aa. " in md and "this order was fixed" in md
    for name in ("effects_sorted", "effect_vs_context", "latency_by_width", "accepted_hist", "drift"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
        assert f"plots/{name}.png" in md
    per = pd.read_csv(out / "per_request.csv")
    assert len(per) == 40 and {"tpot", "step", "tps", "bit_exact"} <= set(per.columns)
    # the requests with the largest effects: the five lowest and five highest per-request TPOT changes, in
    # order, each with its A/A change (the table's rows read back from the markdown)
    rows = md.split("## The requests with the largest effects")[1].split("\n## ")[0]
    listed = re.findall(r"^\| (\S+) \| [\d,]+ \| ([+-]\d+\.\d\d)% \| ([+-]\d+\.\d\d)% \|$", rows, flags=re.M)
    order = per.sort_values("tpot")
    expect = pd.concat([order.head(5), order.tail(5)])
    assert [r[0] for r in listed] == expect["request_id"].tolist()
    assert [float(r[2]) for r in listed] == [float(f"{100 * math.expm1(x):+.2f}") for x in expect["aa_tpot"]]


def test_extreme_requests_takes_both_ends_or_everything():
    per = pd.DataFrame({"request_id": list("abcdefghijkl"), "tpot": [0.05, -0.01, 0.0, 0.02, -0.04, 0.01,
                                                                       0.03, -0.02, 0.04, -0.03, 0.06, -0.05]})
    ext = report.extreme_requests(per, k=2)
    assert ext["request_id"].tolist() == ["l", "e", "a", "k"] and ext["aa_tpot"].isna().all()
    assert report.extreme_requests(per.head(4), k=2)["request_id"].tolist() == ["b", "c", "d", "a"]
    assert len(report.extreme_requests(per.iloc[:0])) == 0


def test_arm_offset_paragraph_names_what_widened_the_intervals():
    """The report says whether the candidate's intervals were widened by the A/A arm's offset or by the run's
    recorded floor (analysis.stats); a run without either says its intervals are the request ones."""
    from analysis import stats
    steps, req, man = synthetic.simulate(synthetic.SyntheticSpec(seed=4, n_requests=24, latency_effect=0.02))
    run = rawio.RunData(Path("<simulated>"), man, steps, req, [])
    plain = stats.analyze(run, n_boot=200)
    assert stats.arm_offset_sd(plain.aa["tpot"]) == 0.0     # this run's A/A arm shows no offset
    (text,) = [b[1] for b in report.arm_offset_blocks(plain)]
    assert "recorded no floor" in text and "request-resampling ones" in text
    floored = stats.analyze(run, n_boot=200, arm_sd_floor=0.0017)
    (text,) = [b[1] for b in report.arm_offset_blocks(floored)]
    assert "sd 0.17%" in text and "the run's floor (0.17%" in text and "shows none beyond" in text, text
    lo = stats.pct(floored.effects["tpot"].ci_requests[0])
    assert f"[{lo:+.1f}%" in text
    offset = rawio.RunData(Path("<simulated>"), man, *synthetic.simulate(synthetic.SyntheticSpec(
        seed=4, n_requests=24, latency_effect=0.02, aa_offset=0.03))[:2], [])
    a = stats.analyze(offset, n_boot=200, arm_sd_floor=0.0017)     # the A/A arm's offset exceeds the floor
    (text,) = [b[1] for b in report.arm_offset_blocks(a)]
    assert "floor" not in text and "this run's A/A arm shows" in text and a.effects["tpot"].arm_sd > 0.0017


def test_report_says_how_the_arms_were_ordered():
    m = {"arms": {"control": {}, "candidate": {}, "aa": {}}, "config": {"import_order": "random"},
         "arm_orders": {"import": ["aa", "control", "candidate"], "build": ["aa", "control", "candidate"]}}
    (kind, text), = report.arm_order_blocks(m)
    assert text.startswith("Arm order: imported and first built aa, control, candidate. ") and "drawn at random" in text
    m = {**m, "config": {"import_order": "[aa,control,candidate]", "build_order": "control,aa,candidate"},
         "arm_orders": None}
    (kind, text), = report.arm_order_blocks(m)
    assert "Arm order: imported aa, control, candidate, first built control, aa, candidate." in text
    assert "fixed, not drawn" in text
    (kind, text), = report.arm_order_blocks({**m, "config": {"import_order": "aa,aa,control"}})
    assert text.startswith("Arm order: unknown")
    # a warm copy ran first: said, and only then
    assert "imported first ran about 0.2 % slower" in report.arm_order_blocks(m)[0][1]
    (kind, text), = report.arm_order_blocks({**m, "config": {**m["config"], "warm_copy": True}})
    assert "A warm copy of the control was imported, built and run before every arm" in text
    assert "slower" not in text


def test_report_cli_subprocess_and_help(run_dir, tmp_path, capsys):
    assert report.main(["--help"]) == 0 and "n_boot=" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown option 'bogus'"):
        report.main([str(run_dir), "bogus=1"])
    assert report.main([]) == 2
    r = subprocess.run([sys.executable, "-m", "analysis.report", str(run_dir), f"out={tmp_path}/rep",
                        "n_boot=300", "mlflow=false"], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("candidate is ")
    assert (tmp_path / "rep" / "report.html").is_file()


def test_compare_one_row_per_run(run_dir, tmp_path, capsys):
    other = tmp_path / "aa"
    synthetic.write_run(other, synthetic.SyntheticSpec(seed=2, n_requests=30, aa_offset=0.04,
                                                       output_max=128))
    missing = tmp_path / "missing"
    assert compare.main([str(run_dir), str(other), str(missing), "n_boot=300",
                         f"out={tmp_path}/cmp.csv"]) == 0
    df = pd.read_csv(tmp_path / "cmp.csv")
    assert len(df) == 4                                  # the two runs of one pair of revisions pooled
    assert df.loc[0, "verdict"] == "faster" and df.loc[1, "verdict"].startswith("unstable")
    assert df.loc[2, "verdict"].startswith("error:")
    assert df.loc[3, "run"] == "pooled (2 runs)" and df.loc[3, "requests"] == df.loc[0, "requests"] + 30
    assert "| run | control | candidate |" in capsys.readouterr().out


def _pool_rows(means, ses, control="main@1", candidate="b@2", z=1.959963984540054):
    """compare's rows for runs whose TPOT effects are ``means`` with intervals of standard errors ``ses``."""
    from analysis import stats
    rows = []
    for m, se in zip(means, ses):
        e = stats.Effect(metric="tpot", arm="candidate", base="control", n=32, mean=m, ci=(m - z * se, m + z * se),
                         p=0.5, hl=m, hl_ci=(m - z * se, m + z * se), sd=se * math.sqrt(32), mde=3 * se,
                         before=1.0, after=1.0)
        rows.append({"control": control, "candidate": candidate, "requests": 32, "_tpot": e})
    return rows


def test_pooled_row_weights_runs_by_their_errors_and_tests_their_agreement():
    import numpy as np
    got = compare.pooled_row(_pool_rows([0.010, 0.004], [0.001, 0.002]))
    w = np.array([1 / 0.001 ** 2, 1 / 0.002 ** 2])
    mean = float(np.sum(w * [0.010, 0.004]) / w.sum())
    assert got["run"] == "pooled (2 runs)" and got["requests"] == 64
    assert got["_mean"] == pytest.approx(mean) and got["TPOT"].startswith(f"+{100 * math.expm1(mean):.1f}%")
    assert got["_ci"][1] - got["_ci"][0] == pytest.approx(2 * 1.959963984540054 / math.sqrt(w.sum()))
    # the runs disagree far beyond their errors: Q says so (control: the same means, errors 10x wider)
    assert got["_q_p"] < 0.01 and f"Q p={got['_q_p']:.2g}" in got["verdict"]
    wide = compare.pooled_row(_pool_rows([0.010, 0.004], [0.01, 0.02]))
    assert wide["_q_p"] > 0.5
    assert got["verdict"].startswith("slower") and wide["verdict"].startswith("inconclusive")
    # nothing to pool: one run, runs of other revisions, a run that failed to analyse
    assert compare.pooled_row(_pool_rows([0.01], [0.001])) is None
    assert compare.pooled_row(_pool_rows([0.01], [0.001]) + _pool_rows([0.01], [0.001], candidate="c@3")) is None
    assert compare.pooled_row(_pool_rows([0.01], [0.001]) + [{"verdict": "error: x", "control": "main@1",
                                                             "candidate": "b@2"}]) is None


def test_pooling_runs_averages_their_arm_offsets_when_each_interval_holds_its_offset():
    """Runs whose candidates carry a process-long offset (sd tau) beside request noise (se): pooling runs
    whose intervals were widened by tau (the floor) covers the truth ~95 %; the negative control, the same
    runs with request-only intervals, covers far less, and more runs make it worse."""
    import numpy as np
    rng = np.random.default_rng(3)
    truth, se, tau, runs = 0.01, 0.0015, 0.003, 8
    hits = {"floored": 0, "requests": 0}
    n = 400
    for _ in range(n):
        m = truth + rng.normal(0, tau, runs) + rng.normal(0, se, runs)
        for kind, s in (("floored", math.hypot(se, tau)), ("requests", se)):
            row = compare.pooled_row(_pool_rows(list(m), [s] * runs))
            hits[kind] += row["_ci"][0] <= truth <= row["_ci"][1]
    assert hits["floored"] / n >= 0.92 and hits["requests"] / n <= 0.85, hits


def test_pooling_cannot_average_away_a_fixed_arm_order_but_a_random_one_can():
    """The first arm imported and built runs slower by b (session 58: 0.067 % on the H200, se 0.024). Runs that all
    put the candidate first (a fixed order: the negative control) pool to an interval that misses the truth
    0 ever more surely with more runs; runs that each draw their order (import_order=random) carry +b, -b
    or 0 and pool to ~95 %. The pooled row marks the fixed case."""
    import itertools

    import numpy as np
    rng = np.random.default_rng(5)
    b, se, floor, runs, n = 0.0013, 0.0016, 0.0017, 20, 300
    orders = list(itertools.permutations(["control", "candidate", "aa"]))
    hits = {"fixed": 0, "random": 0}
    for _ in range(n):
        for kind in hits:
            drawn = [orders[2] if kind == "fixed" else orders[k] for k in rng.integers(0, 6, runs)]   # (cand first)
            m = [b * ((o[0] == "candidate") - (o[0] == "control")) + rng.normal(0, se) for o in drawn]
            rows = _pool_rows(m, [math.hypot(se, floor)] * runs)
            for r, o in zip(rows, drawn):
                r["_orders"] = (o, kind == "random")
            row = compare.pooled_row(rows)
            hits[kind] += row["_ci"][0] <= 0 <= row["_ci"][1]
            assert ("one fixed order (candidate, control, aa)" in row["verdict"]) == (kind == "fixed"), row["verdict"]
    assert hits["random"] / n >= 0.92 and hits["fixed"] / n <= 0.4, hits
    # runs of several fixed orders, or of unknown ones, are not marked
    rows = _pool_rows([0.001, 0.002], [0.002, 0.002])
    rows[0]["_orders"], rows[1]["_orders"] = (tuple(orders[0]), False), (tuple(orders[1]), False)
    assert "fixed order" not in compare.pooled_row(rows)["verdict"]
    assert "fixed order" not in compare.pooled_row(_pool_rows([0.001, 0.002], [0.002, 0.002]))["verdict"]


# ----------------------------------------------------------------------------- rawio

def test_reads_all_part_files(run_dir):
    run = rawio.read_run(run_dir, tokens=True)
    assert len(list((run_dir / "steps").glob("*.parquet"))) == 3
    assert run.requests.shape[0] == 40 * 3
    assert run.steps.groupby(["request_id", "arm"]).ngroups == 120
    assert (run.steps["tokens"].map(len) == run.steps["emitted"]).all()
    assert run.problems == []


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report"))
    return dst


def test_corrupt_part_file_is_a_clear_error(run_dir, tmp_path):
    d = _copy_run(run_dir, tmp_path / "corrupt")
    part = d / "steps" / "part-00002.parquet"
    part.write_bytes(part.read_bytes()[:200])  # a write cut short
    with pytest.raises(rawio.RunDataError, match="part-00002.parquet: unreadable"):
        rawio.read_run(d)
    run = rawio.read_run(d, allow_corrupt=True)
    assert any("part-00002.parquet" in p for p in run.problems)
    # the request rows whose steps were lost are dropped, nothing else
    assert any("request rows without any step rows" in p for p in run.problems)
    assert run.steps.groupby(["request_id", "arm", "rep"]).ngroups == len(run.requests)


def test_schema_errors_name_the_problem(run_dir, tmp_path):
    d = _copy_run(run_dir, tmp_path / "schema")
    part = d / "steps" / "part-00000.parquet"
    df = pd.read_parquet(part)
    df.drop(columns=["accepted"]).to_parquet(part)
    with pytest.raises(rawio.RunDataError, match=r"missing columns \['accepted'\]"):
        rawio.read_run(d)
    df.assign(width=df["width"] + 5).to_parquet(part)
    with pytest.raises(rawio.RunDataError, match="width outside 2..8"):
        rawio.read_run(d)
    df.assign(arm="treatment").to_parquet(part)
    with pytest.raises(rawio.RunDataError, match="arm not in"):
        rawio.read_run(d)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(rawio.RunDataError, match="manifest.json: not valid JSON"):
        rawio.read_run(d)


def test_interrupted_and_resumed_decodes(run_dir, tmp_path):
    """An interrupted decode (steps, no request row) and a re-run of a decode (same key, new order)
    are reconciled: only the completed attempt counts."""
    d = _copy_run(run_dir, tmp_path / "resumed")
    steps = pd.read_parquet(d / "steps" / "part-00002.parquet")
    reqs = pd.read_parquet(d / "requests" / "part-00002.parquet")
    last = int(reqs["order"].max())
    first_key = reqs.iloc[0]
    # attempt 1 of a decode, cut off: its steps were written, its request row never was
    cut = steps[steps["order"] == first_key["order"]].head(3).assign(order=last + 1)
    # interrupted decode of a new order with no request row at all
    orphan = steps[steps["order"] == first_key["order"]].assign(order=last + 2, request_id="req-orphan")
    pd.concat([cut, orphan]).to_parquet(d / "steps" / "part-00003.parquet", index=False)
    manifest = json.loads((d / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps(dict(manifest, status="interrupted")))
    run = rawio.read_run(d)
    assert run.requests.shape[0] == 120
    assert not (run.steps["order"] > last).any()
    assert any("incomplete or superseded" in p for p in run.problems)
    assert any("interrupted" in p for p in run.problems)


# ----------------------------------------------------------------------------- MLflow

def test_mlflow_missing_is_tolerated(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    msg = report.log_to_mlflow({"mlflow": {"run_id": "abc"}}, tmp_path)
    assert "not importable" in msg
    assert "no MLflow run id" in report.log_to_mlflow({}, tmp_path)


def test_report_logged_to_mlflow(run_dir, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("report-test", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    d = _copy_run(run_dir, tmp_path / "tracked")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["mlflow"] = {"run_id": run_id, "tracking_uri": uri}
    (d / "manifest.json").write_text(json.dumps(manifest))
    res = report.build_report(d, n_boot=300)
    assert res["mlflow"] == f"logged to MLflow run {run_id}"
    names = {f.path for f in client.list_artifacts(run_id, "report")}
    assert {"report/report.html", "report/report.md", "report/summary.json"} <= names
