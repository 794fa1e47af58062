"""The prefill snapshot store: layout, manifests, checksums, atomic writes, and its command line.

A snapshot is one request's state right after the target prefill (see :mod:`snapshots.capture`)::

    <store>/<model>-<checkpoint hash[:12]>/<trace>/<request_id>/
        state.safetensors    prompt ids, full-layer K/V up to the prompt length, every ring's
                             contents and labels, the hidden rows the draft prefill consumes
        manifest.json        schema, model + checkpoint hash, tokenizer hash, trace + corpus hash,
                             capturing revision, runtime dtype/device, file checksums and sizes,
                             request (prompt length, seed, budget), capture time, qualification

Store: ``store=`` > ``$IQUESTRT_HOME/snapshots`` > ``~/.cache/iquestrt/snapshots`` (outside the
repository: a full claude400 capture is gigabytes). Directories are written under a ``.tmp-`` name
and renamed into place, so a snapshot directory without that prefix is complete or was damaged
afterwards; :func:`load_manifest` with ``check_files=True`` tells which.

Command line::

    python -m snapshots.store ls    [store=DIR] [model=q1-mini] [check=true]
    python -m snapshots.store du    [store=DIR] [model=q1-mini]
    python -m snapshots.store prune [store=DIR] [model=..] [older_than_days=N] [invalid=true] [dry_run=true]

The ``key=value`` parser here (:func:`parse_cli`) is shared by every snapshot command. It reads
``conf/snapshots/<command>.yaml`` with PyYAML rather than Hydra because the GPU hosts have no Hydra
(see runtime/config.py); ``runtime.a.b=v`` overrides are merged into ``conf/runtime/default.yaml``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import yaml

from .traces import ArgumentError

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

SCHEMA = "iquestrt-snapshot"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.safetensors"
TMP_PREFIX = ".tmp-"


class SnapshotError(ValueError):
    """A snapshot that cannot be used: missing, corrupt, of another model/tokenizer/trace, unknown
    schema. The message names the file and the problem."""


# ---- layout -------------------------------------------------------------------------------------
def default_store() -> Path:
    """`$IQUESTRT_HOME/snapshots` if IQUESTRT_HOME is set, else `~/.cache/iquestrt/snapshots`."""
    home = os.environ.get("IQUESTRT_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "iquestrt").expanduser() / "snapshots"


def resolve_store(store: str | os.PathLike | None) -> Path:
    return Path(store).expanduser() if store else default_store()


def hash12(h: str) -> str:
    """12 characters naming a checkpoint in a path: the hash itself when it is hex, else a digest of
    it (random checkpoints are named ``random:<model>:seed<N>``)."""
    return h[:12] if re.fullmatch(r"[0-9a-f]{12,}", h) else hashlib.sha256(h.encode()).hexdigest()[:12]


def group_dir(store, model_name: str, checkpoint_hash: str, trace: str) -> Path:
    return resolve_store(store) / f"{model_name}-{hash12(checkpoint_hash)}" / trace


def snapshot_dir(store, model_name: str, checkpoint_hash: str, trace: str, request_id: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", request_id):
        raise SnapshotError(f"request id {request_id!r} cannot name a snapshot directory")
    return group_dir(store, model_name, checkpoint_hash, trace) / request_id


# ---- files --------------------------------------------------------------------------------------
def sha256_file(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON to a temporary file beside `path`, fsync, then rename over it."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def new_tmp_dir(final: Path) -> Path:
    """A fresh temporary directory beside `final` (same filesystem, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}-{time.time_ns()}")
    tmp.mkdir()
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename a completed temporary directory into place; refuses to replace an existing one."""
    for p in tmp.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise SnapshotError(f"{final}: appeared while this snapshot was written (another capture?); "
                            "left as it was")
    os.rename(tmp, final)
    _fsync_dir(final.parent)


# ---- manifests ----------------------------------------------------------------------------------
def load_manifest(path: str | os.PathLike, check_files: bool = True) -> dict:
    """The manifest of snapshot directory `path`, checked: it exists, parses, has this schema and a
    known version, and (check_files) every file it lists has its recorded size and sha256.

    Refuses (SnapshotError, naming the file): a missing directory or manifest, unreadable JSON, an
    unknown schema or version, a missing, truncated or corrupted file."""
    d = Path(path)
    if not d.is_dir():
        raise SnapshotError(f"{d}: snapshot directory not found")
    mp = d / MANIFEST
    if not mp.is_file():
        raise SnapshotError(f"{mp}: manifest missing (an interrupted or foreign directory)")
    try:
        m = json.loads(mp.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{mp}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        raise SnapshotError(f"{mp}: not a snapshot manifest (schema {m.get('schema') if isinstance(m, dict) else None!r}, "
                            f"expected {SCHEMA!r})")
    if m.get("schema_version") != SCHEMA_VERSION:
        raise SnapshotError(f"{mp}: unknown schema version {m.get('schema_version')!r}; this checkout reads "
                            f"version {SCHEMA_VERSION} (recapture with python -m snapshots.capture)")
    for key in ("model", "tokenizer_hash", "trace", "request", "state", "files", "runtime"):
        if key not in m:
            raise SnapshotError(f"{mp}: manifest lacks {key!r}")
    if check_files:
        check_manifest_files(d, m)
    return m


def check_manifest_files(d: Path, m: dict) -> None:
    for name, entry in m["files"].items():
        f = d / name
        if not f.is_file():
            raise SnapshotError(f"{f}: file listed in the manifest is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise SnapshotError(f"{f}: {size} bytes, manifest records {entry['bytes']} (truncated or replaced)")
        got = sha256_file(f)
        if got != entry["sha256"]:
            raise SnapshotError(f"{f}: checksum mismatch (sha256 {got[:12]}…, manifest records "
                                f"{entry['sha256'][:12]}…): the file is corrupted")


def update_manifest(path: str | os.PathLike, **fields) -> dict:
    """Set top-level manifest fields (e.g. ``qualification``) atomically; the rest is unchanged."""
    d = Path(path)
    m = load_manifest(d, check_files=False)
    m.update(fields)
    write_json_atomic(d / MANIFEST, m)
    return m


# ---- revision -----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def git_revision(repo: str = str(REPO)) -> dict:
    """{"sha", "dirty"} of the checkout (tracked files only); nulls where git or .git is absent."""
    try:
        sha = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        st = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
        return {"sha": sha, "dirty": bool(st.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


# ---- walking the store --------------------------------------------------------------------------
def iter_snapshot_dirs(store=None, model: str | None = None) -> Iterator[tuple[str, str, Path]]:
    """(group "<model>-<hash12>", trace, directory) of every request directory in the store,
    including incomplete ``.tmp-`` ones; `model` keeps groups of that model name."""
    root = resolve_store(store)
    if not root.is_dir():
        return
    for g in sorted(p for p in root.iterdir() if p.is_dir()):
        if model and not re.fullmatch(re.escape(model) + r"-[0-9a-f]{12}", g.name):
            continue
        for t in sorted(p for p in g.iterdir() if p.is_dir()):
            for r in sorted(p for p in t.iterdir() if p.is_dir()):
                yield g.name, t.name, r


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# ---- command-line configuration (shared by every snapshot command) -----------------------------
def _set_dotted(d: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    for h in head:
        d = d.setdefault(h, {})
        if not isinstance(d, dict):
            raise ArgumentError(f"{dotted}: {h} is not a group")
    d[last] = value


def wants_help(argv: list[str] | None, usage: str) -> tuple[list[str], bool]:
    """``(argv, True)`` after printing ``usage`` when help was asked for; argv defaults to sys.argv[1:]."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(usage)
        return argv, True
    return argv, False


def parse_cli(command: str, argv: list[str]) -> dict:
    """``key=value`` arguments over conf/snapshots/<command>.yaml. Values are read as YAML scalars
    (``limit=5``, ``check=true``, ``store=null``); ``runtime.x.y=v`` goes to the runtime overrides.
    Refuses (ArgumentError) an argument without '=', an unknown key (listing the known ones), and a
    value whose type differs from a non-null default."""
    path = CONF_DIR / "snapshots" / f"{command}.yaml"
    cfg = yaml.safe_load(path.read_text()) or {}
    for a in argv:
        if "=" not in a:
            raise ArgumentError(f"expected key=value, got {a!r}")
        key, raw = a.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        if key.startswith("runtime.") and "runtime" in cfg:
            _set_dotted(cfg["runtime"], key[len("runtime."):], value)
            continue
        if key not in cfg or key == "runtime":
            known = ", ".join(sorted(k for k in cfg if k != "runtime"))
            extra = ", runtime.* (conf/runtime/default.yaml)" if "runtime" in cfg else ""
            raise ArgumentError(f"unknown key {key!r}; keys: {known}{extra}")
        default = cfg[key]
        if default is not None and value is not None:
            if isinstance(default, bool) != isinstance(value, bool) or (
                    isinstance(default, (int, float)) and not isinstance(value, (int, float))):
                raise ArgumentError(f"{key}={raw!r}: expected {type(default).__name__} like the default {default!r}")
            if isinstance(default, str) and not isinstance(value, str):
                value = raw
        cfg[key] = value
    return cfg


def runtime_settings(overrides: dict | None) -> dict:
    """conf/runtime/default.yaml with `overrides` (nested dict) merged in: the dict Engine.build takes."""
    base = yaml.safe_load((CONF_DIR / "runtime" / "default.yaml").read_text()) or {}

    def merge(a: dict, b: dict) -> dict:
        for k, v in b.items():
            a[k] = merge(dict(a[k]), v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return a

    return merge(base, overrides or {})


# ---- ls / du / prune ----------------------------------------------------------------------------
def _summary(d: Path, check: bool) -> dict:
    row = {"dir": d, "bytes": dir_bytes(d), "status": "ok", "error": None, "manifest": None}
    if d.name.startswith(TMP_PREFIX):
        row["status"] = "incomplete"
        return row
    try:
        row["manifest"] = load_manifest(d, check_files=check)
    except SnapshotError as e:
        row["status"], row["error"] = "invalid", str(e)
    return row


def cmd_ls(cfg: dict) -> int:
    rows = [(g, t, _summary(d, bool(cfg["check"]))) for g, t, d in iter_snapshot_dirs(cfg["store"], cfg["model"])]
    root = resolve_store(cfg["store"])
    if not rows:
        print(f"no snapshots under {root}")
        return 0
    print(f"store {root}{' (checksums verified)' if cfg['check'] else ''}")
    groups: dict[tuple[str, str], list[dict]] = {}
    for g, t, row in rows:
        groups.setdefault((g, t), []).append(row)
    print(f"{'model-checkpoint':<26} {'trace':<12} {'snapshots':>9} {'qualified':>9} {'failed':>6} "
          f"{'invalid':>7} {'tokens':>12} {'size':>10}  captured")
    for (g, t), rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        q = [r["manifest"].get("qualification") for r in ok]
        tokens = sum(r["manifest"]["request"]["prompt_len"] for r in ok)
        times = sorted(r["manifest"]["capture"]["time_utc"] for r in ok)
        span = f"{times[0][:10]}..{times[-1][:10]}" if times else "-"
        print(f"{g:<26} {t:<12} {len(ok):>9} {sum(1 for x in q if x and x.get('passed')):>9} "
              f"{sum(1 for x in q if x and not x.get('passed')):>6} {len(rs) - len(ok):>7} {tokens:>12,} "
              f"{_mb(sum(r['bytes'] for r in rs)):>10}  {span}")
        for r in rs:
            if r["status"] != "ok":
                print(f"    {r['status']}: {r['dir'].name}" + (f" — {r['error']}" if r["error"] else ""))
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def cmd_du(cfg: dict) -> int:
    root = resolve_store(cfg["store"])
    total, per = 0, {}
    for g, t, d in iter_snapshot_dirs(cfg["store"], cfg["model"]):
        n = dir_bytes(d)
        total += n
        per.setdefault(f"{g}/{t}", [0, 0])
        per[f"{g}/{t}"][0] += n
        per[f"{g}/{t}"][1] += 1
    for k, (n, c) in per.items():
        print(f"{_mb(n):>12}  {c:>5} dirs  {root / k}")
    print(f"{_mb(total):>12}  total  {root}")
    return 0


def cmd_prune(cfg: dict) -> int:
    days, invalid = cfg["older_than_days"], bool(cfg["invalid"])
    if days is None and not invalid:
        raise ArgumentError("prune needs older_than_days=N and/or invalid=true (nothing is removed otherwise)")
    now = time.time()
    doomed = []
    for g, t, d in iter_snapshot_dirs(cfg["store"], cfg["model"]):
        row = _summary(d, check=invalid)
        why = None
        if invalid and row["status"] != "ok":
            why = row["error"] or row["status"]
        elif days is not None and row["status"] == "ok":
            captured = row["manifest"]["capture"].get("unix_time", d.stat().st_mtime)
            if now - captured > float(days) * 86400:
                why = f"captured {(now - captured) / 86400:.1f} days ago"
        if why:
            doomed.append((d, row["bytes"], why))
    for d, n, why in doomed:
        print(f"{'would remove' if cfg['dry_run'] else 'remove'} {d} ({_mb(n)}): {why}")
        if not cfg["dry_run"]:
            shutil.rmtree(d)
    print(f"{len(doomed)} snapshot directories, {_mb(sum(n for _, n, _ in doomed))}"
          f"{' (dry run)' if cfg['dry_run'] else ' removed'}")
    return 0


USAGE = """\
usage: python -m snapshots.store COMMAND [key=value ...]

commands:
  ls     list snapshot groups (model-checkpoint / trace): counts, qualification, tokens, size;
         invalid and incomplete directories by name    [check=true: verify every checksum]
  du     disk use per group and in total
  prune  remove snapshot directories: older_than_days=N (by capture time) and/or invalid=true
         (unreadable manifest, unknown schema, bad checksum, interrupted .tmp- directories)
         [dry_run=true: only print]

every command takes store=DIR (default $IQUESTRT_HOME/snapshots or ~/.cache/iquestrt/snapshots)
and model=NAME (only that model's groups)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help") or any(a in ("-h", "--help") for a in argv[1:]):
        print(USAGE)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    commands = {"ls": cmd_ls, "du": cmd_du, "prune": cmd_prune}
    if command not in commands:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        cfg = parse_cli("store", args)
        return commands[command](cfg)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SnapshotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
