"""Raw output of a paired replay: a run directory written incrementally, resumable.

Layout (read by ``analysis.rawio``)::

    RUN_DIR/manifest.json            run id, command, resolved config, arms, environment, hashes,
                                     status (running | complete | interrupted), expect_bit_exact,
                                     fingerprints, mlflow
    RUN_DIR/steps/part-NNNNN.parquet one row per decode step (STEP_COLUMNS)
    RUN_DIR/requests/part-NNNNN.parquet one row per completed (request_id, arm, rep) (REQUEST_COLUMNS)
    RUN_DIR/diffs/<arm>.diff         WORKTREE arms: the uncommitted changes replayed

Only completed decodes are buffered, and a flush writes the steps part before the requests part
(each to a temporary name, then renamed), so a request row never exists without its steps; a crash
between the two leaves orphan step rows that the reader drops. Resuming reads the request parts to
skip decodes already complete.

Where pyarrow is missing (the GPU hosts) the parts are written as JSON Lines with the same columns
(``part-NNNNN.jsonl``); ``python -m replay.rawout convert RUN_DIR`` (also run by
``analysis.tracking log``) turns them into the Parquet parts the analysis reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:   # the GPU hosts: JSON Lines parts, converted to Parquet later (``convert``)
    pa = pq = None

STEP_COLUMNS = {"request_id": "string", "arm": "string", "rep": "int64", "order": "int64", "step": "int64",
                "width": "int64", "drafts": "int64", "accepted": "int64", "emitted": "int64",
                "tokens": "list<int64>", "t_start_ns": "int64", "t_end_ns": "int64", "warmup": "bool"}
REQUEST_COLUMNS = {"request_id": "string", "arm": "string", "rep": "int64", "context_len": "int64",
                   "order": "int64", "n_steps": "int64", "n_tokens": "int64", "tokens_sha": "string",
                   "decode_ns": "int64", "cpu_ns": "int64", "loop_ns": "int64", "epoch": "int64"}


def _schema(columns: dict):
    types = {"string": pa.string(), "int64": pa.int64(), "bool": pa.bool_(), "list<int64>": pa.list_(pa.int64())}
    return pa.schema([(k, types[v]) for k, v in columns.items()])


def tokens_sha(tokens) -> str:
    """sha256 of the emitted token ids as little-endian int64."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i8").tobytes()).hexdigest()


# perf_counter_ns (what the engine stamps) → epoch ns, fixed once per process
CLOCK_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def decode_rows(gen, request_id: str, arm: str, rep: int, order: int, context_len: int,
                warmup_steps: int, t_call_ns: int, decode_ns: int,
                cpu_ns: int = -1, epoch: int = -1) -> tuple[list[dict], dict]:
    """Step rows and the request row of one decode from the arm's ``Generation``.

    ``gen.step_t0_ns`` (perf_counter_ns at each step's start) is used when the arm records it; an
    older revision's Generation has only durations, and the starts are then laid end to end from
    ``t_call_ns`` (the perf_counter_ns just before ``decode`` was called). ``cpu_ns``: the decoding
    thread's CPU time over the decode (-1: not measured). ``epoch``: the placement epoch the arm's
    engine was built for (-1: the engines were kept for the whole run)."""
    steps, durs = gen.steps, list(gen.step_ns)
    if len(durs) != len(steps):
        raise ValueError(f"{arm}/{request_id}: {len(steps)} steps in the result log but "
                         f"{len(durs)} step timings")
    t0s = list(getattr(gen, "step_t0_ns", None) or [])
    if len(t0s) != len(steps):
        t0s = list(t_call_ns + np.concatenate([[0], np.cumsum(durs)[:-1]]).astype(np.int64)) if durs else []
    rows = []
    for s, t0, dt in zip(steps, t0s, durs):
        start = int(t0) + CLOCK_OFFSET_NS
        rows.append({"request_id": request_id, "arm": arm, "rep": rep, "order": order,
                     "step": int(s["step"]), "width": int(s["width"]),
                     "drafts": int(s.get("next_drafts", s.get("drafts", 0))),
                     "accepted": int(s["accepted"]), "emitted": int(s["emitted"]),
                     "tokens": [int(t) for t in s["tokens"]], "t_start_ns": start,
                     "t_end_ns": start + int(dt), "warmup": int(s["step"]) < warmup_steps})
    req = {"request_id": request_id, "arm": arm, "rep": rep, "context_len": int(context_len),
           "order": order, "n_steps": len(rows), "n_tokens": int(sum(r["emitted"] for r in rows)),
           "tokens_sha": tokens_sha(gen.tokens), "decode_ns": int(decode_ns), "cpu_ns": int(cpu_ns),
           # the host's time from the first step's start to the last one's end (-1: the arm's revision
           # does not record it): one clock for every execution, beside the steps' own
           "loop_ns": int(getattr(gen, "loop_ns", 0) or -1), "epoch": int(epoch)}
    return rows, req


def _write_part(rows: list[dict], columns: dict, path: Path) -> Path:
    """Rows as ``path`` (Parquet) or, without pyarrow, as ``path`` with suffix .jsonl; atomically."""
    if pq is None:
        path = path.with_suffix(".jsonl")
    tmp = path.with_name(f".{path.name}.tmp")
    if pq is not None:
        pq.write_table(pa.Table.from_pylist(rows, schema=_schema(columns)), tmp)
    else:
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps({k: r[k] for k in columns}) + "\n")
    os.replace(tmp, path)
    return path


def _read_part(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if pq is None:
        raise RuntimeError(f"{path}: reading Parquet needs pyarrow")
    return pq.read_table(path).to_pylist()


def parts(run_dir: Path, sub: str) -> list[Path]:
    d = Path(run_dir) / sub
    return sorted(list(d.glob("part-*.parquet")) + list(d.glob("part-*.jsonl")))


def convert(run_dir: str | Path) -> int:
    """JSON Lines parts (written where pyarrow was missing) → Parquet with the exact schema; returns
    how many were converted. Needs pyarrow; idempotent."""
    run_dir = Path(run_dir)
    todo = [(p, cols) for sub, cols in (("steps", STEP_COLUMNS), ("requests", REQUEST_COLUMNS))
            for p in sorted((run_dir / sub).glob("part-*.jsonl"))]
    if todo and pq is None:
        raise RuntimeError("converting JSON Lines parts to Parquet needs pyarrow")
    for p, cols in todo:
        _write_part(_read_part(p), cols, p.with_suffix(".parquet"))
        p.unlink()
    return len(todo)


def frames(run_dir: str | Path):
    """(steps, requests) DataFrames of every part file, Parquet or JSON Lines."""
    import pandas as pd

    out = []
    for sub, cols in (("steps", STEP_COLUMNS), ("requests", REQUEST_COLUMNS)):
        rows = [r for p in parts(run_dir, sub) for r in _read_part(p)]
        df = pd.DataFrame(rows, columns=list(cols))
        for k, v in cols.items():
            if v in ("int64", "bool"):
                df[k] = df[k].astype(v)
        out.append(df)
    return out[0], out[1]


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


class RunWriter:
    """Buffers completed decodes and writes them as numbered part files."""

    def __init__(self, run_dir: Path, flush_every: int = 16, flush_seconds: float = 30.0):
        self.run_dir = Path(run_dir)
        for sub in ("steps", "requests", "diffs"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self._steps: list[dict] = []
        self._reqs: list[dict] = []
        self._last = time.monotonic()
        existing = [int(p.stem.split("-")[1]) for sub in ("steps", "requests") for p in parts(self.run_dir, sub)]
        self._next = max(existing, default=-1) + 1

    @property
    def manifest_path(self) -> Path:
        return self.run_dir / "manifest.json"

    def read_manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text())

    def write_manifest(self, manifest: dict) -> None:
        write_json(self.manifest_path, manifest)

    def update_manifest(self, **changes) -> dict:
        m = self.read_manifest()
        m.update(changes)
        self.write_manifest(m)
        return m

    def add(self, step_rows: list[dict], request_row: dict) -> None:
        self._steps.extend(step_rows)
        self._reqs.append(request_row)
        if len(self._reqs) >= self.flush_every or time.monotonic() - self._last >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if not self._reqs:
            return
        name = f"part-{self._next:05d}.parquet"
        _write_part(self._steps, STEP_COLUMNS, self.run_dir / "steps" / name)
        _write_part(self._reqs, REQUEST_COLUMNS, self.run_dir / "requests" / name)
        self._next += 1
        self._steps, self._reqs = [], []
        self._last = time.monotonic()

    def completed(self) -> dict[tuple[str, str, int], dict]:
        """Decodes already complete in the part files: (request_id, arm, rep) -> request row."""
        done = {}
        for p in parts(self.run_dir, "requests"):
            for r in _read_part(p):
                done[(r["request_id"], r["arm"], int(r["rep"]))] = r
        return done


def main(argv: list[str] | None = None) -> int:
    """``python -m replay.rawout convert RUN_DIR``: JSON Lines parts → Parquet."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "convert":
        print(main.__doc__, file=sys.stderr)
        return 2
    try:
        n = convert(argv[1])
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{argv[1]}: {n} part files converted to Parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
