"""Read a replay's raw output (a run directory) into pandas DataFrames, and validate it.

A run directory holds ``manifest.json``, ``steps/*.parquet`` (one row per decode step) and
``requests/*.parquet`` (one row per completed decode of a (request, arm, rep)). Part files are
append-only; all of them are read, in name order.

Schema violations (missing or mistyped columns, unknown arms, impossible values) raise
``RunDataError`` naming the file or the offending rows. Conditions an interrupted or resumed replay
leaves behind are repaired and listed in ``RunData.problems`` instead, losing nothing that was
complete:

- steps of a decode that has no request row (interrupted before it finished) are dropped;
- steps of an earlier attempt at the same (request, arm, rep) (a resumed run redid it) are dropped:
  the request row's ``order`` names the attempt that counts;
- a request row without steps is dropped; when a (request, arm, rep) has several request rows, the
  last in run order is kept;
- an unreadable part file (a write cut short) is an error unless ``allow_corrupt=True``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd

ARMS = ("control", "candidate", "aa")
WIDTH_RANGE = (2, 8)  # one committed token plus 1..7 drafts (runtime.draft: 1 <= min_depth <= max_depth <= 7)

STEP_COLUMNS = {  # column -> kind: "str", "int", "bool", "list"
    "request_id": "str", "arm": "str", "rep": "int", "order": "int", "step": "int",
    "width": "int", "drafts": "int", "accepted": "int", "emitted": "int", "tokens": "list",
    "t_start_ns": "int", "t_end_ns": "int", "warmup": "bool",
}
REQUEST_COLUMNS = {
    "request_id": "str", "arm": "str", "rep": "int", "context_len": "int", "order": "int",
    "n_steps": "int", "n_tokens": "int", "tokens_sha": "str", "decode_ns": "int",
}
# Columns a run may lack (written by later revisions of the harness); checked when present.
OPTIONAL_REQUEST_COLUMNS = {"cpu_ns": "int",    # the decoding thread's CPU time (-1: not measured)
                            "loop_ns": "int",   # host time, first step's start to last step's end (-1: none)
                            "epoch": "int"}     # placement epoch of the arm's engine (-1: kept all run)
MANIFEST_KEYS = ("run_id", "arms", "status")
DECODE_KEY = ["request_id", "arm", "rep"]


class RunDataError(ValueError):
    """The run directory does not hold valid raw output; the message says where and why."""


@dataclasses.dataclass
class RunData:
    run_dir: Path
    manifest: dict
    steps: pd.DataFrame
    requests: pd.DataFrame
    problems: list[str]

    @property
    def expect_bit_exact(self) -> bool:
        return bool(self.manifest.get("expect_bit_exact", False))


def read_manifest(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "manifest.json"
    if not path.is_file():
        raise RunDataError(f"{path}: missing (is {run_dir} a replay run directory?)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunDataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise RunDataError(f"{path}: expected a JSON object, got {type(manifest).__name__}")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise RunDataError(f"{path}: missing keys {missing}")
    if not isinstance(manifest["arms"], dict) or "control" not in manifest["arms"]:
        raise RunDataError(f"{path}: 'arms' must be an object with at least a 'control' arm")
    unknown = sorted(set(manifest["arms"]) - set(ARMS))
    if unknown:
        raise RunDataError(f"{path}: unknown arms {unknown}; expected some of {list(ARMS)}")
    return manifest


def parse_arm_order(value, labels: list[str], key: str) -> list[str] | None:
    """An arm-order setting (``import_order`` / ``build_order``): a list, or a comma-separated string with or
    without brackets, naming each of ``labels`` once; None when unset or ``random`` (drawn, not given)."""
    if not value or (isinstance(value, str) and value.strip().lower() == "random"):
        return None
    order = ([a.strip() for a in value.strip().strip("[]").split(",")] if isinstance(value, str)
             else [str(a) for a in value])
    if sorted(order) != sorted(labels):
        raise RunDataError(f"{key}={order} must name each of the arms {list(labels)} once")
    return order


def arm_orders(manifest: dict) -> dict:
    """The order a run imported and built its arms in, and whether it was drawn at random
    (``import_order=random``): the manifest's ``arm_orders`` record; for a run recorded before it existed,
    its config's ``import_order`` / ``build_order`` (unset: control, candidate, aa; the build follows the
    import)."""
    cfg = manifest.get("config") or {}
    drawn = str(cfg.get("import_order")).strip().lower() == "random"
    rec = manifest.get("arm_orders")
    if rec:
        return {"import": [str(a) for a in rec["import"]], "build": [str(a) for a in rec["build"]], "random": drawn}
    labels = [a for a in ARMS if a in (manifest.get("arms") or {})]
    if drawn:
        raise RunDataError("import_order=random in the manifest's config, but no arm_orders record of the order drawn")
    imp = parse_arm_order(cfg.get("import_order"), labels, "import_order") or labels
    return {"import": imp, "build": parse_arm_order(cfg.get("build_order"), imp, "build_order") or imp,
            "random": False}


def _read_parts(folder: Path, columns: dict, wanted: list[str], allow_corrupt: bool,
                problems: list[str]) -> pd.DataFrame:
    files = sorted(folder.glob("*.parquet"))
    if not files:
        raise RunDataError(f"{folder}: no *.parquet part files")
    frames = []
    for f in files:
        try:
            df = pd.read_parquet(f, columns=None)
        except Exception as e:  # pyarrow raises several types for a truncated or foreign file
            if allow_corrupt:
                problems.append(f"{f.name}: unreadable part file skipped ({type(e).__name__}: {e})")
                continue
            raise RunDataError(f"{f}: unreadable part file ({type(e).__name__}: {e}); "
                               "pass allow_corrupt=True to skip it") from None
        _check_columns(df, columns, f)
        frames.append(df[[c for c in wanted if c in df.columns]])
    if not frames:
        raise RunDataError(f"{folder}: no readable part files")
    out = pd.concat(frames, ignore_index=True)
    return out


def _check_columns(df: pd.DataFrame, columns: dict, where: Path) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise RunDataError(f"{where}: missing columns {missing}; has {list(df.columns)}")
    bad = []
    for col, kind in columns.items():
        s = df[col]
        if kind == "int" and not pd.api.types.is_integer_dtype(s):
            bad.append(f"{col} should be integer, is {s.dtype}")
        elif kind == "bool" and not pd.api.types.is_bool_dtype(s):
            bad.append(f"{col} should be bool, is {s.dtype}")
        elif kind == "str" and not (pd.api.types.is_string_dtype(s) or s.dtype == object):
            bad.append(f"{col} should be a string, is {s.dtype}")
        elif kind == "str" and len(s) and not all(isinstance(v, str) for v in s.iloc[:1000]):
            bad.append(f"{col} should hold strings")
    if bad:
        raise RunDataError(f"{where}: wrong column types: " + "; ".join(bad))


def _fail_rows(df: pd.DataFrame, mask: pd.Series, what: str, where: str) -> None:
    if mask.any():
        sample = df.loc[mask, [c for c in DECODE_KEY + ["step"] if c in df.columns]].head(3)
        raise RunDataError(f"{where}: {int(mask.sum())} rows with {what}, e.g.\n{sample.to_string(index=False)}")


def validate_steps(steps: pd.DataFrame, where: str = "steps") -> None:
    """Value checks on step rows; raises RunDataError."""
    _fail_rows(steps, ~steps["arm"].isin(ARMS), f"arm not in {list(ARMS)}", where)
    lo, hi = WIDTH_RANGE
    _fail_rows(steps, (steps["width"] < lo) | (steps["width"] > hi), f"width outside {lo}..{hi}", where)
    _fail_rows(steps, steps["step"] < 0, "negative step", where)
    _fail_rows(steps, (steps["accepted"] < 0) | (steps["accepted"] > steps["width"] - 1),
               "accepted outside 0..width-1", where)
    _fail_rows(steps, (steps["emitted"] < 1) | (steps["emitted"] > steps["accepted"] + 1),
               "emitted outside 1..accepted+1", where)
    _fail_rows(steps, steps["drafts"] < 0, "negative drafts", where)
    _fail_rows(steps, steps["t_end_ns"] < steps["t_start_ns"], "t_end_ns before t_start_ns", where)
    if "tokens" in steps.columns:
        lens = steps["tokens"].map(lambda t: -1 if t is None else len(t))
        _fail_rows(steps, lens != steps["emitted"], "len(tokens) != emitted", where)
    dup = steps.duplicated(DECODE_KEY + ["order", "step"], keep=False)
    _fail_rows(steps, dup, "duplicate (request_id, arm, rep, order, step)", where)


def validate_requests(requests: pd.DataFrame, where: str = "requests") -> None:
    _fail_rows(requests, ~requests["arm"].isin(ARMS), f"arm not in {list(ARMS)}", where)
    _fail_rows(requests, requests["context_len"] < 1, "context_len < 1", where)
    _fail_rows(requests, requests["tokens_sha"].str.len() == 0, "empty tokens_sha", where)


def reconcile(steps: pd.DataFrame, requests: pd.DataFrame, problems: list[str]):
    """Keep exactly the steps of completed decodes (see the module docstring); note what was dropped."""
    requests = requests.sort_values("order", kind="stable")
    dup = requests.duplicated(DECODE_KEY, keep="last")
    if dup.any():
        problems.append(f"{int(dup.sum())} superseded request rows of re-run decodes dropped "
                        "(kept the last attempt in run order)")
        requests = requests[~dup]
    keys = requests[DECODE_KEY + ["order"]].assign(_complete=True)
    merged = steps.merge(keys, on=DECODE_KEY + ["order"], how="left")
    orphan = merged["_complete"].isna()
    if orphan.any():
        n_dec = merged.loc[orphan, DECODE_KEY + ["order"]].drop_duplicates().shape[0]
        problems.append(f"{int(orphan.sum())} step rows of {n_dec} incomplete or superseded decodes "
                        "dropped (no matching request row)")
    steps = merged.loc[~orphan].drop(columns="_complete")
    have = steps[DECODE_KEY + ["order"]].drop_duplicates().assign(_has=True)
    r = requests.merge(have, on=DECODE_KEY + ["order"], how="left")
    nosteps = r["_has"].isna()
    if nosteps.any():
        problems.append(f"{int(nosteps.sum())} request rows without any step rows dropped, e.g. "
                        + ", ".join(r.loc[nosteps, "request_id"].astype(str).head(3)))
    requests = r.loc[~nosteps].drop(columns="_has")
    # cross-check the request summaries against their steps
    agg = steps.groupby(DECODE_KEY, sort=False).agg(_n=("step", "size"), _t=("emitted", "sum"))
    chk = requests.merge(agg.reset_index(), on=DECODE_KEY, how="left")
    bad = (chk["_n"] != chk["n_steps"]) | (chk["_t"] != chk["n_tokens"])
    if bad.any():
        problems.append(f"{int(bad.sum())} request rows whose n_steps/n_tokens disagree with their "
                        "step rows (statistics use the step rows)")
    gaps = steps.groupby(DECODE_KEY, sort=False)["step"].agg(["min", "max", "size"])
    holes = (gaps["min"] != 0) | (gaps["max"] + 1 != gaps["size"])
    if holes.any():
        problems.append(f"{int(holes.sum())} decodes whose step indices are not 0..n-1")
    return steps.reset_index(drop=True), requests.reset_index(drop=True)


def read_run(run_dir: str | Path, tokens: bool = False, allow_corrupt: bool = False) -> RunData:
    """Read and validate a run directory. ``tokens=True`` also loads the per-step token lists."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDataError(f"{run_dir}: not a directory")
    manifest = read_manifest(run_dir)
    problems: list[str] = []
    step_cols = [c for c in STEP_COLUMNS if tokens or c != "tokens"]
    steps = _read_parts(run_dir / "steps", STEP_COLUMNS, step_cols, allow_corrupt, problems)
    requests = _read_parts(run_dir / "requests", REQUEST_COLUMNS,
                           list(REQUEST_COLUMNS) + list(OPTIONAL_REQUEST_COLUMNS), allow_corrupt, problems)
    for c in OPTIONAL_REQUEST_COLUMNS:   # parts written before the column existed (a resumed run)
        if c in requests.columns:
            requests[c] = requests[c].fillna(-1).astype("int64")
    _check_columns(requests, {k: v for k, v in OPTIONAL_REQUEST_COLUMNS.items() if k in requests.columns},
                   run_dir / "requests")
    steps = steps.astype({"request_id": object, "arm": object})
    requests = requests.astype({"request_id": object, "arm": object, "tokens_sha": object})
    validate_steps(steps, f"{run_dir}/steps")
    validate_requests(requests, f"{run_dir}/requests")
    steps, requests = reconcile(steps, requests, problems)
    if manifest.get("status") != "complete":
        problems.append(f"run status is {manifest.get('status')!r}, not 'complete': "
                        "results cover the decodes finished so far")
    if "expect_bit_exact" not in manifest:
        problems.append("manifest has no expect_bit_exact; bit-exactness is reported, not required")
    return RunData(run_dir, manifest, steps, requests, problems)


def from_frames(steps: pd.DataFrame, requests: pd.DataFrame, manifest: dict,
                run_dir: str | Path = "<memory>") -> RunData:
    """Validate in-memory frames (e.g. from analysis.synthetic.simulate) as read_run would."""
    _check_columns(steps, {k: v for k, v in STEP_COLUMNS.items()
                           if k != "tokens" or "tokens" in steps.columns}, Path(str(run_dir)))
    _check_columns(requests, REQUEST_COLUMNS, Path(str(run_dir)))
    validate_steps(steps)
    validate_requests(requests)
    problems: list[str] = []
    steps, requests = reconcile(steps, requests, problems)
    return RunData(Path(str(run_dir)), manifest, steps, requests, problems)

