"""One MLflow run per replay: revisions, environment, command and configuration as params, the
paired effects as metrics, and the run directory (raw output, manifest, diffs, report) as artifacts.

The tracking store is ``sqlite:///$IQUESTRT_HOME/mlflow.db`` by default (artifacts under
``$IQUESTRT_HOME/mlartifacts``), or any tracking URI (``tracking.uri=http://host:port``). Where MLflow is
not installed (the GPU hosts) the run directory is complete on its own and is recorded later::

    python -m analysis.tracking log RUN_DIR [tracking.uri=URI] [experiment=NAME] [force=true]

Only a complete run is recorded (``allow_incomplete=true`` records an interrupted one with status
KILLED). A run directory remembers its record (``manifest.json`` → ``mlflow``); logging it again to the
same store returns that run instead of making a second one, unless ``force=true``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path

EXPERIMENT = "iquestrt-replay"
_KEY_BAD = re.compile(r"[^\w./\- :]")


class TrackingError(RuntimeError):
    """The run cannot be recorded (MLflow missing, run incomplete, store unreachable)."""


def home() -> Path:
    return Path(os.environ.get("IQUESTRT_HOME") or Path.home() / ".cache" / "iquestrt").expanduser()


def default_uri() -> str:
    return f"sqlite:///{home() / 'mlflow.db'}"


def _flatten(d, prefix: str = "") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)


def params_from_manifest(m: dict) -> dict[str, str]:
    """Revisions, SHAs, dirty diffs, environment, hashes, command and the flattened resolved config."""
    p: dict[str, str] = {"command": m.get("command", ""), "run_id": m.get("run_id", ""),
                         "expect_bit_exact": _value(m.get("expect_bit_exact", False))}
    for arm, rec in (m.get("arms") or {}).items():
        for k in ("rev", "sha", "dirty_diff", "module", "overrides"):
            if k in rec:
                p[f"arm.{arm}.{k}"] = _value(rec[k])
    for section in ("environment", "hashes", "instrument", "placement", "analysis", "arm_orders"):
        for k, v in _flatten(m.get(section) or {}).items():
            if section == "hashes" and k.startswith("snapshot_files"):
                continue   # one hash per request: in the manifest artifact, not as params
            p[f"{section}.{k}"] = _value(v)
    for k, v in _flatten(m.get("config") or {}).items():
        p[f"config.{k}"] = _value(v)
    return p


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def metrics_from_analysis(summary: dict) -> dict[str, float]:
    """Effects (percent, CI, p, MDE), A/A offsets, bit-exactness and per-arm means from a report's
    summary.json (``analysis.report``)."""
    out: dict[str, float] = {}
    a = summary.get("analysis") or {}
    for group, effects in (("effect", a.get("effects") or {}), ("aa", a.get("aa") or {})):
        for metric, e in effects.items():
            out[f"{group}.{metric}.pct"] = e.get("pct")
            lo, hi = (e.get("pct_ci") or [None, None])[:2]
            out[f"{group}.{metric}.ci_lo_pct"], out[f"{group}.{metric}.ci_hi_pct"] = lo, hi
            out[f"{group}.{metric}.p"] = e.get("p")
            out[f"{group}.{metric}.mde_pct"] = e.get("mde_pct")
    adj = a.get("adjusted")
    if adj:
        out["adjusted.tpot.pct"] = adj.get("pct")
        lo, hi = (adj.get("pct_ci") or [None, None])[:2]
        out["adjusted.tpot.ci_lo_pct"], out["adjusted.tpot.ci_hi_pct"] = lo, hi
    be = a.get("bit_exact") or {}
    for k in ("n_requests", "candidate_exact", "aa_exact", "aa_compared", "control_reproducible"):
        if k in be:
            out[f"bit_exact.{k}"] = be[k]
    out["n_requests"] = a.get("n_requests")
    out["n_clusters"] = (a.get("settings") or {}).get("clusters")    # placement epochs resampled (absent: none)
    return {k: float(v) for k, v in out.items() if _finite(v)}


def arm_means(run_dir: Path) -> dict[str, float]:
    from analysis import rawio, stats

    run = rawio.read_run(run_dir)
    dec = stats.decode_metrics(run.steps)
    out = {}
    for arm, d in dec.groupby("arm"):
        out[f"arm.{arm}.tpot_ms"] = d["tpot_ns"].mean() / 1e6
        out[f"arm.{arm}.step_ms"] = d["step_ns"].mean() / 1e6
        out[f"arm.{arm}.tokens_per_step"] = d["tokens_per_step"].mean()
        out[f"arm.{arm}.accepted_per_step"] = d["accepted"].mean()
        out[f"arm.{arm}.decodes"] = float(len(d))
    return {k: float(v) for k, v in out.items() if _finite(v)}


def _summary(run_dir: Path) -> dict:
    f = run_dir / "report" / "summary.json"
    if f.is_file():
        return json.loads(f.read_text())
    try:
        from analysis import report

        return json.loads(report.build_report(run_dir, mlflow=False)["paths"]["summary"].read_text())
    except Exception:   # e.g. no matplotlib for the plots: the statistics alone
        from analysis import rawio, stats, verdict

        run = rawio.read_run(run_dir)
        a = stats.analyze(run)
        return json.loads(json.dumps({"verdict": verdict.decide(a, run.manifest).to_dict(), "analysis": a.to_dict()},
                                     default=str))


def _experiment_id(client, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    kw = {}
    if uri.startswith("sqlite:"):   # otherwise MLflow would put artifacts under ./mlruns of the cwd
        kw["artifact_location"] = (home() / "mlartifacts").as_uri()
    return client.create_experiment(name, **kw)


def log_run(run_dir: str | Path, uri: str | None = None, experiment: str = EXPERIMENT, force: bool = False,
            allow_incomplete: bool = False) -> tuple[str, str]:
    """Record a run directory as one MLflow run; returns (MLflow run id, tracking URI)."""
    run_dir = Path(run_dir).resolve()
    mpath = run_dir / "manifest.json"
    if not mpath.is_file():
        raise TrackingError(f"{mpath} missing: not a replay run directory")
    m = json.loads(mpath.read_text())
    status = m.get("status")
    if status != "complete" and not allow_incomplete:
        raise TrackingError(f"run status is {status!r}: only a complete run is recorded "
                            f"(resume it: python -m replay.paired resume=true RUN_DIR={run_dir})")
    try:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise TrackingError(f"mlflow is not installed ({e})") from None
    from replay import rawout

    try:
        rawout.convert(run_dir)   # parts written as JSON Lines on a host without pyarrow
    except RuntimeError as e:
        raise TrackingError(str(e)) from None
    uri = uri or default_uri()
    for name in ("mlflow.store.db.utils", "alembic"):   # the store's first-use migration chatter
        logging.getLogger(name).setLevel(logging.WARNING)
    if uri.startswith("sqlite:"):
        home().mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    prev = m.get("mlflow") or {}
    if prev.get("run_id") and prev.get("tracking_uri") == uri and not force:
        try:
            client.get_run(prev["run_id"])
            return prev["run_id"], uri
        except Exception:
            pass   # recorded in another store that was since removed: record again
    summary = _summary(run_dir) if status == "complete" else {}
    verdict = summary.get("verdict") or {}
    exp_id = _experiment_id(client, experiment, uri)
    arms = m.get("arms") or {}
    tags = {"mlflow.runName": m.get("run_id", run_dir.name), "run_dir": str(run_dir), "status": str(status),
            "control": f"{arms.get('control', {}).get('rev')}@{str(arms.get('control', {}).get('sha'))[:12]}",
            "candidate": f"{arms.get('candidate', {}).get('rev')}@{str(arms.get('candidate', {}).get('sha'))[:12]}",
            "verdict": verdict.get("call", ""), "mlflow.note.content": verdict.get("headline", "")}
    sha = (m.get("instrument") or {}).get("sha")
    if sha:
        tags["mlflow.source.git.commit"] = sha
    run = client.create_run(exp_id, tags=tags)
    rid = run.info.run_id
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:
        limit = 500
    params = [Param(_KEY_BAD.sub("_", k)[:250], (v if len(v) <= limit else v[:limit - 1] + "…"))
              for k, v in params_from_manifest(m).items()]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    metrics = metrics_from_analysis(summary) if summary else {}
    try:
        metrics.update(arm_means(run_dir))
    except Exception:
        pass
    now = int(time.time() * 1000)
    ms = [Metric(_KEY_BAD.sub("_", k)[:250], v, now, 0) for k, v in sorted(metrics.items())]
    for i in range(0, len(ms), 500):
        client.log_batch(rid, metrics=ms[i:i + 500])
    m["mlflow"] = {"tracking_uri": uri, "run_id": rid, "experiment": experiment, "experiment_id": exp_id}
    tmp = mpath.with_name(".manifest.json.tmp")
    tmp.write_text(json.dumps(m, indent=2, default=str) + "\n")
    os.replace(tmp, mpath)
    client.log_artifacts(rid, str(run_dir))
    client.set_terminated(rid, "FINISHED" if status == "complete" else "KILLED")
    return rid, uri


HELP = """python -m analysis.tracking log RUN_DIR [tracking.uri=URI] [experiment=NAME] [force=true]
                                    [allow_incomplete=true]

Record a replay run directory as one MLflow run (params: revisions, SHAs, environment, command,
resolved config; metrics: effects and CIs, A/A offsets, bit-exactness, per-arm means; artifacts: the
whole run directory). Default store: sqlite:///$IQUESTRT_HOME/mlflow.db (IQUESTRT_HOME defaults to
~/.cache/iquestrt). Exit status: 0 recorded (or already recorded), 1 not recorded, 2 bad arguments."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    pos = [a for a in rest if "=" not in a]
    opts = dict(a.split("=", 1) for a in rest if "=" in a)
    known = {"tracking.uri", "uri", "experiment", "force", "allow_incomplete"}
    bad = sorted(set(opts) - known)
    if cmd != "log" or len(pos) != 1 or bad:
        print(f"error: expected `log RUN_DIR [key=value ...]`{f'; unknown keys {bad}' if bad else ''}\n\n{HELP}",
              file=sys.stderr)
        return 2
    truthy = lambda s: str(s).lower() in ("1", "true", "yes")  # noqa: E731
    try:
        rid, uri = log_run(pos[0], opts.get("tracking.uri") or opts.get("uri") or None,
                           opts.get("experiment", EXPERIMENT), truthy(opts.get("force", "false")),
                           truthy(opts.get("allow_incomplete", "false")))
    except TrackingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"recorded {pos[0]} as MLflow run {rid} at {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
