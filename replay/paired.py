"""``python -m replay.paired control=REV candidate=REV [key=value ...]``: the paired replay.

One process holds three arms — control, candidate and the A/A arm (control again, imported through
the candidate's path) — each a git revision's ``runtime`` imported under its own module name with
its own settings (:mod:`replay.arms`). Every selected request is restored from its prefill snapshot
into each arm in a balanced, seeded order (:mod:`replay.schedule`) and decoded with the same seed
and output budget; every step is written to the run directory (:mod:`replay.rawout`). Before any
decode, each arm's step work is fingerprinted per width and compared (:mod:`replay.fingerprint`):
a candidate doing exactly what control does is refused as an ineffective substitution. At the end
the run is analysed (``analysis.report``), summarised, and recorded in MLflow
(``analysis.tracking``).

Life of a run: arms → engines → requests → snapshots (captured if missing and allowed) → snapshot
checks against every arm → fingerprints → manifest (running) → decodes → manifest (complete) →
report → MLflow. Every refusal before the decodes leaves no manifest; an interruption (Ctrl-C,
SIGTERM) flushes what is complete and marks the manifest ``interrupted``, and
``resume=true RUN_DIR=DIR`` continues it with its recorded settings and revisions.

Configuration: Hydra over ``conf/paired.yaml`` (so ``-m`` sweeps and launchers work); where Hydra is
not installed (the GPU hosts) the same YAML is composed with plain ``key=value`` overrides.
``control=REV`` / ``candidate=REV`` are rewritten to ``control.rev=REV`` / ``candidate.rev=REV``,
and ``runtime.*``, ``control.runtime.*``, ``candidate.runtime.*`` may name any runtime setting
(they are passed to Hydra as ``++key=value``).
"""
from __future__ import annotations

import gc
import hashlib
import json
import random
import re
import shlex
import signal
import sys
import time
import traceback
import uuid
from datetime import datetime, timezone
from pathlib import Path

from . import arms as armsmod
from . import fingerprint as fpmod
from . import rawout, schedule
from .arms import ArmError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
EXIT_OK, EXIT_ERROR, EXIT_IDENTICAL, EXIT_INTERRUPTED = 0, 2, 3, 130
# settings a resumed run may take from the command line; everything else comes from its manifest
RESUME_FREE = ("resume", "RUN_DIR", "progress", "flush_every", "debug_interrupt_after", "tracking", "report")

HELP = """usage: python -m replay.paired [control=REV] [candidate=REV] [key=value ...]
       python -m replay.paired -m candidate=a,b,c ...        (Hydra multirun: one run per value)

Paired replay of prefill snapshots by a control, a candidate and an A/A arm in one process.
REV: a branch, tag, SHA, or WORKTREE (the uncommitted tree; its diff is recorded).
Defaults in conf/paired.yaml; common settings:
  model=q1-mini                      conf/model/<name>.yaml of each arm's revision
  candidate.runtime.draft.policy=fixed   per-arm runtime settings (also control.runtime.*)
  runtime.device=cuda                settings for every arm
  traces.name=claude400 requests.n=4 requests.select=shortest|first|spread requests.ids=[a,b]
  traces.name=synthetic              random prompts in the model's vocabulary (traces.synthetic.*)
  reps=1 seed=0 max_new_tokens=256 warmup_steps=1
  snapshots.auto_capture=true|false|auto   capture missing snapshots first (auto: on CPU only)
  allow_identical=true               run even if the candidate's step work equals control's
  expect_bit_exact=true              the candidate must not change tokens
  aa=false                           no A/A arm
  placement.epochs=16                rebuild every arm at a new place in memory 16 times over the run
                                     (auto: 64 on a GPU, 0 on the CPU); requests resampled by epoch
  import_order=random                the order the arms' runtimes are imported, fingerprinted and
                                     first built in (default random: drawn anew per run and recorded,
                                     since the first ran ~0.07 % slower on the H200; null: control,
                                     candidate, aa; or a list, e.g. [candidate,control,aa])
  build_order=[aa,candidate,control]   build the engines in another order than the import (random too)
  warm_copy=true                     import, build and run a throwaway copy of control before every
                                     arm, so the first copy's cost (+0.2 % at 47K-190K context on the
                                     H200) falls on no arm; default off until measured
  request_order=given                decode the requests as selected (spread/shortest: by context);
                                     default shuffled by the seed, so drift is not read as context
  arm_sd_floor=0.002                 widen every candidate interval by at least this arm offset (sd,
                                     natural log; auto: 0.0017 on a GPU, 0 on the CPU)
  tracking.uri=http://host:port      MLflow server (default sqlite:///$IQUESTRT_HOME/mlflow.db)
  RUN_DIR=DIR resume=true            continue an interrupted run
Exit status: 0 done; 2 refused (bad revision, dirty tree, missing or mismatching snapshots, arm
failed to import or build); 3 ineffective substitution refused; 130 interrupted (resumable)."""


class ReplayError(Exception):
    """A refusal with its message and exit status; nothing is recorded as a success."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


# ---- configuration ---------------------------------------------------------------------------------
_FREE_PREFIX = re.compile(r"^((control|candidate)\.)?runtime\.")


def rewrite_overrides(args: list[str]) -> list[str]:
    """``control=REV`` → ``control.rev=REV``; ``[control.|candidate.]runtime.k=v`` → ``++…`` (runtime
    settings are free-form: each arm validates them against its own runtime config)."""
    out = []
    for a in args:
        if a.startswith("-") or "=" not in a:
            out.append(a)
            continue
        key, val = a.split("=", 1)
        if key in ("control", "candidate"):
            out.append(f"{key}.rev={val}")
        elif _FREE_PREFIX.match(key):
            out.append(f"++{key}={val}")
        else:
            out.append(a)
    return out


def home() -> Path:
    return armsmod.home()


def short_id() -> str:
    return uuid.uuid4().hex[:6]


def new_run_dir() -> Path:
    return home() / "runs" / f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{short_id()}"


def _register_resolvers() -> None:
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return
    OmegaConf.register_new_resolver("iquestrt_home", lambda: str(home()), use_cache=True, replace=True)
    OmegaConf.register_new_resolver("iquestrt_short_id", short_id, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("iquestrt_run_dir", lambda d=None: str(d) if d else str(new_run_dir()),
                                    use_cache=True, replace=True)


def model_name(cfg: dict) -> str:
    """Hydra composes ``model`` as the group's config (its ``name`` is what each arm loads from its own
    revision); the plain-YAML path keeps the name."""
    m = cfg["model"]
    return m["name"] if isinstance(m, dict) else str(m)


def _set_dotted(d: dict, dotted: str, value) -> None:
    *head, last = dotted.split(".")
    for h in head:
        if not isinstance(d.get(h), dict):
            d[h] = {}
        d = d[h]
    d[last] = value


def _get_dotted(d: dict, dotted: str):
    for h in dotted.split("."):
        if not isinstance(d, dict) or h not in d:
            raise KeyError(dotted)
        d = d[h]
    return d


def compose_without_hydra(args: list[str]) -> dict:
    """conf/paired.yaml with ``key=value`` overrides (YAML values), for hosts without Hydra."""
    import yaml

    cfg = yaml.safe_load((CONF_DIR / "paired.yaml").read_text()) or {}
    cfg.pop("hydra", None)
    defaults = cfg.pop("defaults", None) or []
    for entry in defaults:   # the config groups of the defaults list: only their names are used
        if isinstance(entry, dict):
            for k, v in entry.items():
                if not k.startswith("override "):
                    cfg[k] = v
    for a in args:
        if a in ("-m", "--multirun"):
            raise ReplayError("multirun (-m) needs Hydra (pip install hydra-core); run one replay per command")
        if "=" not in a:
            raise ReplayError(f"expected key=value, got {a!r}")
        key, raw = a.split("=", 1)
        free = key.startswith("++")
        key = key.lstrip("+~")
        if key.startswith("hydra."):
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        if not free:
            try:
                old = _get_dotted(cfg, key)
            except KeyError:
                raise ReplayError(f"unknown setting {key!r} (conf/paired.yaml)") from None
            if isinstance(old, str) and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = raw   # e.g. candidate.rev=1234567 is a SHA prefix, not a number
        _set_dotted(cfg, key, value)
    return cfg


# ---- requests and snapshots ------------------------------------------------------------------------
class Request:
    def __init__(self, request_id: str, n_tokens: int, tokens, meta: dict):
        self.request_id, self.n_tokens, self._tokens, self.meta = request_id, n_tokens, tokens, meta

    def tokens(self) -> list[int]:
        return self._tokens() if callable(self._tokens) else self._tokens


def synthetic_requests(spec: dict, vocab_size: int, stop_ids) -> tuple[dict, list[Request]]:
    """Random prompts in the model's vocabulary (tests, smoke runs on random-weight models)."""
    n, lo, hi, seed = int(spec.get("n", 3)), int(spec.get("min_len", 32)), int(spec.get("max_len", 96)), \
        int(spec.get("seed", 0))
    if n < 1 or lo < 1 or hi < lo:
        raise ReplayError(f"traces.synthetic needs n >= 1 and 1 <= min_len <= max_len, got {spec}")
    bad = set(int(s) for s in stop_ids) | set(range(9))   # no stop or chat-template special ids
    allowed = [t for t in range(vocab_size) if t not in bad] or list(range(vocab_size))
    reqs = []
    for i in range(n):
        L = lo + (hi - lo) * i // max(1, n - 1)
        r = random.Random(f"synthetic:{seed}:{i}")
        toks = [r.choice(allowed) for _ in range(L)]
        reqs.append(Request(f"syn-{i:03d}", L, toks, {"request_id": f"syn-{i:03d}"}))
    h = hashlib.sha256(json.dumps([r.tokens() for r in reqs]).encode()).hexdigest()
    name = f"synthetic-{n}x{lo}-{hi}-v{vocab_size}-s{seed}"
    return {"name": name, "corpus_hash": h}, reqs


def load_requests(cfg: dict, engine) -> tuple[dict, list[Request], list[str]]:
    """(trace record, selected requests, notes) from the configured corpus."""
    tr, rq = cfg["traces"], cfg["requests"]
    notes = []
    budget = int(cfg["max_new_tokens"])
    if tr["name"] == "synthetic":
        trace, reqs = synthetic_requests(tr.get("synthetic") or {}, engine.cfg.vocab_size,
                                         engine.cfg.stop_token_ids)
    else:
        from snapshots.traces import CorpusError, load_corpus

        try:
            corpus = load_corpus(tr["name"], tr.get("store"))
        except (CorpusError, KeyError, OSError) as e:
            raise ReplayError(f"trace corpus {tr['name']!r}: {e}\n(build it with: python -m snapshots.traces "
                              f"build name={tr['name']})") from None
        trace = {"name": corpus.name, "corpus_hash": corpus.corpus_hash}
        reqs = [Request(r.request_id, r.n_tokens, (lambda r=r: corpus.tokens(r)),
                        {"request_id": r.request_id, "session_id": r.session_id, "n_messages": r.n_messages})
                for r in corpus.requests]
    if rq.get("ids"):
        by_id = {r.request_id: r for r in reqs}
        unknown = [i for i in rq["ids"] if str(i) not in by_id]
        if unknown:
            raise ReplayError(f"trace {trace['name']!r} has no requests {unknown[:5]}")
        return trace, [by_id[str(i)] for i in rq["ids"]], notes
    fits = [r for r in reqs if engine.capacity_for(r.n_tokens, budget) <= engine.cfg.max_context
            and (rq.get("max_context") is None or r.n_tokens <= int(rq["max_context"]))]
    if len(fits) < len(reqs):
        notes.append(f"{len(reqs) - len(fits)} requests longer than the model's context or max_context left out")
    n = len(fits) if rq.get("n") is None else min(int(rq["n"]), len(fits))
    sel = rq.get("select", "first")
    if sel == "first":
        chosen = fits[:n]
    elif sel == "shortest":
        chosen = sorted(fits, key=lambda r: (r.n_tokens, r.request_id))[:n]
    elif sel == "spread":
        s = sorted(fits, key=lambda r: (r.n_tokens, r.request_id))
        chosen = [s[round(i * (len(s) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 else s[:n]
        chosen = list(dict.fromkeys(chosen))
    else:
        raise ReplayError(f"requests.select={sel!r}: expected first | shortest | spread")
    if not chosen:
        raise ReplayError(f"no request of trace {trace['name']!r} fits (model max_context "
                          f"{engine.cfg.max_context}, budget {budget})")
    return trace, chosen, notes


def capture_command(cfg: dict, trace: dict, n: int) -> str:
    parts = [f"python -m snapshots.capture model={model_name(cfg)} traces={trace['name']}"]
    if cfg["traces"].get("store"):
        parts.append(f"traces_store={cfg['traces']['store']}")
    if cfg["snapshots"].get("store"):
        parts.append(f"store={cfg['snapshots']['store']}")
    parts.append(f"budget={cfg['max_new_tokens']}")
    if cfg["requests"].get("select") == "shortest" and not cfg["requests"].get("ids"):
        parts.append(f"limit={n}")
    for k, v in armsmod.flatten(cfg.get("runtime")).items():
        parts.append(f"runtime.{k}={v}")
    return " ".join(parts) + "   (or rerun with snapshots.auto_capture=true)"


def ensure_snapshots(cfg: dict, engine, trace: dict, reqs: list[Request], progress: bool) -> dict[str, Path]:
    """Snapshot directories of the requests (control's model and checkpoint); missing ones are
    captured with this checkout's capture code when allowed, else refused with the command to run."""
    from snapshots import capture, store

    sc = cfg["snapshots"]
    dirs = {r.request_id: store.snapshot_dir(sc.get("store"), engine.cfg.name, engine.checkpoint_hash,
                                             trace["name"], r.request_id) for r in reqs}
    missing = [r for r in reqs if not (dirs[r.request_id] / store.MANIFEST).is_file()]
    if not missing:
        return dirs
    auto = sc.get("auto_capture", "auto")
    if isinstance(auto, str) and auto.lower() in ("true", "false"):
        auto = auto.lower() == "true"
    if auto == "auto":
        auto = engine.device.type == "cpu"
    if not auto:
        raise ReplayError(
            f"{len(missing)} of {len(reqs)} snapshots missing for model {engine.cfg.name} "
            f"({engine.checkpoint_hash[:24]}), trace {trace['name']} under "
            f"{store.group_dir(sc.get('store'), engine.cfg.name, engine.checkpoint_hash, trace['name'])} "
            f"(e.g. {missing[0].request_id}); capture them first:\n  "
            + (capture_command(cfg, trace, len(reqs)) if not trace["name"].startswith("synthetic-")
               else "rerun with snapshots.auto_capture=true (synthetic requests are captured by the replay)"))
    from tqdm import tqdm

    budget = int(cfg["max_new_tokens"])
    bar = tqdm(missing, desc="capture snapshots", unit="req", disable=not progress, dynamic_ncols=True)
    for r in bar:
        meta = {"trace": dict(trace, **r.meta)}
        try:
            capture.capture_request(engine, r.tokens(), r.request_id, capture.request_seed(r.request_id), budget,
                                    dirs[r.request_id], meta)
            if sc.get("qualify_captured", True):
                from snapshots.verify import verify_snapshot

                q = verify_snapshot(engine, dirs[r.request_id], budget=budget)
                if not q["passed"]:
                    raise ReplayError(f"snapshot {dirs[r.request_id]} failed its qualification (restored "
                                      f"decode differs from real prefill: first mismatch at token "
                                      f"{q['first_mismatch']})")
        except ReplayError:
            raise
        except Exception as e:
            raise ReplayError(f"capturing {r.request_id} failed: {type(e).__name__}: {e}") from None
    bar.close()
    return dirs


def check_snapshots(arms: dict, dirs: dict[str, Path], require_qualified: bool) -> dict:
    """Every snapshot against every arm's engine (model, config, checkpoint, tokenizer, dtype, shard);
    returns the snapshot hashes. A mismatch or a failed qualification is refused."""
    from snapshots.restore import check_engine
    from snapshots.store import STATE, SnapshotError, load_manifest

    states = {}
    for rid, d in dirs.items():
        try:
            m = load_manifest(d, check_files=False)
        except SnapshotError as e:
            raise ReplayError(f"snapshot of {rid}: {e}") from None
        q = m.get("qualification")
        if q is not None and not q.get("passed"):
            raise ReplayError(f"{d}: this snapshot failed its qualification (a restored decode differed from "
                              "real prefill); recapture it (python -m snapshots.store prune invalid=true, then capture)")
        if q is None and require_qualified:
            raise ReplayError(f"{d}: not qualified (python -m snapshots.verify ...) and "
                              "snapshots.require_qualified=true")
        for label, arm in arms.items():
            try:
                check_engine(m, arm.engine, d)
            except SnapshotError as e:
                raise ReplayError(f"model/snapshot mismatch for arm {arm.describe()}: {e}") from None
        states[rid] = m["files"][STATE]["sha256"]
    h = hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(states.items())).encode()).hexdigest()
    return {"snapshots": h, "snapshot_files": states}


def restorer(arm, d: Path, budget: int, seed):
    from snapshots.restore import restore

    def go():
        return restore(arm.engine, d, budget=budget, seed=seed)
    return go


# ---- fingerprints ----------------------------------------------------------------------------------
def fingerprints(arms: dict, d: Path, budget: int, seed, allow_identical: bool) -> tuple[dict, list[str]]:
    """Fingerprint every arm on one snapshot; compare candidate and A/A with control. Refuses an
    identical candidate unless allowed. Returns (manifest section, printed lines)."""
    fps = {label: fpmod.fingerprint_arm(arm, restorer(arm, d, budget, seed)) for label, arm in arms.items()}
    section = {label: fpmod.summary(fp) for label, fp in fps.items()}
    lines = []
    if "candidate" in fps:
        c = fpmod.compare(fps["control"], fps["candidate"])
        section["candidate_vs_control"] = {k: v for k, v in c.items()}
        lines.append(fpmod.describe(c, "candidate vs control"))
        if c["identical"]:
            msg = ("ineffective substitution: the candidate's step work is identical to control's at every "
                   f"width ({fps['control']['method']} fingerprints of {arms['candidate'].describe()} and "
                   f"{arms['control'].describe()}): the change does not reach the step, so a replay can only "
                   "measure noise. Pass allow_identical=true to run it anyway (e.g. a host-loop or "
                   "calibration setting such as runtime.debug.step_delay_fraction)")
            if not allow_identical:
                raise ReplayError("\n".join(lines + [msg]), EXIT_IDENTICAL)
            lines.append("note: " + msg.split(":")[0] + " — running anyway (allow_identical=true)")
    if "aa" in fps:
        a = fpmod.compare(fps["control"], fps["aa"])
        section["aa_vs_control"] = a
        if a["identical"]:
            lines.append("A/A vs control: identical step work (as it must be)")
        else:
            lines.append("WARNING: build nondeterminism: the A/A arm (control loaded again) does different "
                         "step work than control\n" + fpmod.describe(a, "A/A vs control"))
    return section, lines


# ---- the run ---------------------------------------------------------------------------------------
def _utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _explicit_keys(args: list[str]) -> dict[str, str]:
    out = {}
    for a in args:
        if "=" in a and not a.startswith("-"):
            k, v = a.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def resume_config(cfg: dict, args: list[str], run_dir: Path) -> tuple[dict, dict]:
    mpath = run_dir / "manifest.json"
    if not mpath.is_file():
        raise ReplayError(f"resume=true: {mpath} does not exist (RUN_DIR must name the interrupted run)")
    manifest = json.loads(mpath.read_text())
    old = manifest["config"]
    conflicts = []
    for k, v in _explicit_keys(args).items():
        if k.split(".")[0] in RESUME_FREE or k.startswith("hydra."):
            continue
        try:
            recorded = _get_dotted(old, k)
        except KeyError:
            recorded = None
        cur = _get_dotted(cfg, k) if _has(cfg, k) else v
        if recorded != cur:
            conflicts.append(f"{k}={v} (recorded: {recorded!r})")
    if conflicts:
        raise ReplayError("resume takes its settings from the run's manifest; these differ: "
                          + ", ".join(conflicts))
    new = dict(old)
    for k in RESUME_FREE:
        if k in cfg:
            new[k] = cfg[k]
    new["resume"], new["RUN_DIR"] = True, str(run_dir)
    return new, manifest


def _has(d: dict, k: str) -> bool:
    try:
        _get_dotted(d, k)
        return True
    except KeyError:
        return False


def load_recorded_arms(manifest: dict, repo, cache, order: list[str] | None = None) -> dict:
    """The arms of a run being resumed, at the commits (or WORKTREE copies) it recorded, imported in
    ``order`` (default: the arms' own order)."""
    out = {}
    cache = Path(cache) if cache else home() / "arms"
    for label in order or armsmod.ARMS:
        rec = manifest["arms"].get("control" if label == WARM else label)
        if rec is None:
            continue
        root = cache / rec["key"]
        if (root / ".arm.json").is_file():
            diff = root / "worktree.diff" if rec.get("dirty_diff") else None
            r = armsmod.Revision(rev=rec["rev"], sha=rec["sha"], key=rec["key"], root=root, diff=diff)
        elif rec["key"] == rec["sha"] and repo is not None:
            r = armsmod.materialise_commit(repo, rec["rev"], rec["sha"], cache)
        else:
            raise ReplayError(f"cannot resume: arm {label} ({rec['rev']} @ {rec['key']}) is no longer in {cache}")
        name, mod = armsmod.import_runtime(label, r)
        out[label] = armsmod.Arm(label=label, revision=r, module=name, overrides=rec.get("overrides") or {},
                                 runtime=mod)
    return out


def _instrument(repo) -> dict:
    if repo is None:
        return {"sha": None, "dirty": None}
    sha = armsmod.head_sha(repo)
    st = armsmod.git(repo, "status", "--porcelain=v1", "--untracked-files=no", "--", "replay", "snapshots",
                     "analysis", check=False)
    dirty = [line[3:] for line in st.stdout.decode().splitlines()] if st.returncode == 0 else None
    return {"sha": sha, "dirty": dirty}


def run(cfg: dict, args: list[str], run_dir: Path, argv_display: list[str] | None = None) -> int:
    """One paired replay into ``run_dir``; returns the exit status (errors are printed)."""
    run_dir = Path(run_dir).expanduser().resolve()

    def on_term(signum, frame):   # SIGTERM (a scheduler, `timeout`) ends the run like Ctrl-C
        raise KeyboardInterrupt("SIGTERM")
    try:
        prev = signal.signal(signal.SIGTERM, on_term)
    except ValueError:   # not the main thread
        prev = None
    try:
        return _run(cfg, args, run_dir, argv_display or args)
    except (ReplayError, ArmError) as e:
        print(f"error: {e}", file=sys.stderr)
        if run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()   # refused before anything was recorded: leave no empty run behind
        return e.code if isinstance(e, ReplayError) else EXIT_ERROR
    except KeyboardInterrupt:
        mpath = run_dir / "manifest.json"
        status = json.loads(mpath.read_text()).get("status") if mpath.is_file() else None
        if status is None:
            print("interrupted before the first decode: nothing recorded", file=sys.stderr)
            if run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
        elif status == "running":
            rawout.write_json(mpath, {**json.loads(mpath.read_text()), "status": "interrupted"})
            print(f"interrupted; resume with: python -m replay.paired resume=true RUN_DIR={run_dir}",
                  file=sys.stderr)
        else:
            print(f"interrupted after the decodes; the run is {status} (report: python -m analysis.report "
                  f"{run_dir}; record: python -m analysis.tracking log {run_dir})", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


def _run(cfg: dict, args: list[str], run_dir: Path, argv_display: list[str]) -> int:
    import torch

    t_begin = time.time()
    manifest0 = None
    if cfg.get("resume"):
        cfg, manifest0 = resume_config(cfg, args, run_dir)
        if manifest0.get("status") == "complete":
            print(f"{run_dir}: run already complete; nothing to resume")
            return EXIT_OK
    elif (run_dir / "manifest.json").is_file():
        raise ReplayError(f"{run_dir} already holds a run (status {json.loads((run_dir / 'manifest.json').read_text()).get('status')!r}); "
                          "pass resume=true to continue it, or choose another RUN_DIR")
    cfg["RUN_DIR"] = str(run_dir)
    progress = bool(cfg.get("progress", True))
    command = "python -m replay.paired " + shlex.join(argv_display)
    shuffle_requests = request_order(cfg) == "shuffled"      # (checked before anything is loaded)

    # arms: revisions → modules → engines
    try:
        repo = armsmod.repo_root(Path.cwd())
    except ArmError as e:   # e.g. a copy of the tree on a GPU host: arms come from a prepared cache
        print(f"note: {e}; taking arms from the prepared cache (python -m replay.arms prepare)")
        repo = None
    cache = Path(cfg["arms_cache"]).expanduser() if cfg.get("arms_cache") else None
    warm = [WARM] if warm_copy(cfg) else []     # (imported, built and run before every arm)
    if manifest0 is not None:
        order, cfg_build = recorded_orders(manifest0, cfg)
        arms = load_recorded_arms(manifest0, repo, cache, order=warm + order)
    else:
        revs = {"control": str(cfg["control"]["rev"]), "candidate": str(cfg["candidate"]["rev"])}
        if cfg.get("aa", True):
            revs["aa"] = revs["control"]
        overrides = {"control": {"runtime": cfg["control"].get("runtime") or {}},
                     "candidate": {"runtime": cfg["candidate"].get("runtime") or {}},
                     "aa": {"runtime": cfg["control"].get("runtime") or {}}}
        if warm:
            revs[WARM], overrides[WARM] = revs["control"], overrides["control"]
        arms = armsmod.load_arms(repo, revs, overrides, cache, order=warm + arm_order(
            cfg, "import_order", [a for a in armsmod.ARMS if a in revs]))
        cfg_build = cfg
    warm_arm = arms.pop(WARM, None)
    threads = cfg.get("torch_threads", "auto")
    if threads == "auto":
        threads = 1 if not torch.cuda.is_available() else None
    if threads:
        torch.set_num_threads(int(threads))
    weights = armsmod.WeightCache()
    if warm_arm is not None:
        armsmod.build(warm_arm, model_name(cfg), cfg.get("runtime") or {}, weights, cfg.get("checkpoint"),
                      int(cfg.get("random_seed") or 0))
        print(f"warm copy: {warm_arm.describe()} (module {warm_arm.module}) imported and built before every arm")
    built = build_order(cfg_build, arms)
    orders = {"import": list(arms), "build": [arm.label for arm in built]}
    print(f"arm order: imported {', '.join(orders['import'])}; built {', '.join(orders['build'])}")
    for arm in built:
        armsmod.build(arm, model_name(cfg), cfg.get("runtime") or {}, weights, cfg.get("checkpoint"),
                      int(cfg.get("random_seed") or 0))
        print(f"{arm.describe()}: module {arm.module}, {arm.engine.cfg.name} "
              f"({arm.engine.checkpoint_hash[:24]}), {arm.engine.device}/{arm.rt.dtype}, "
              f"draft {arm.rt.draft.policy}, {getattr(arm.engine, 'execution', 'eager')}"
              + (f", overrides {arm.overrides['runtime']}" if arm.overrides.get("runtime") else ""))
    hashes = {label: arm.engine.checkpoint_hash for label, arm in arms.items()}
    if len(set(hashes.values())) > 1:
        raise ReplayError(f"the arms load different checkpoints {hashes}: a paired replay compares runtimes "
                          "of one model (snapshots belong to one checkpoint)")
    print(f"weights loaded {weights.loads}x for {len(arms)} arms")
    clocks = {label: armsmod.step_clock(arm.engine) for label, arm in arms.items()}
    if "candidate" in clocks and clocks["candidate"] != clocks["control"]:
        print(f"note: the arms' step clocks differ (control: {clocks['control']}; candidate: "
              f"{clocks['candidate']}): step latency and TPOT effects include the difference of the clocks")
    control = arms["control"].engine

    # requests and snapshots
    trace, reqs, notes = load_requests(cfg, control)
    for n in notes:
        print(f"note: {n}")
    budget = int(cfg["max_new_tokens"])
    # (missing snapshots are captured by the warm copy where there is one: it runs before every arm)
    dirs = ensure_snapshots(cfg, warm_arm.engine if warm_arm is not None else control, trace, reqs, progress)
    snap_hashes = check_snapshots(arms, dirs, bool(cfg["snapshots"].get("require_qualified", False)))
    seed = cfg.get("request_seed")
    print(f"{len(reqs)} requests of {trace['name']} (context {min(r.n_tokens for r in reqs):,}.."
          f"{max(r.n_tokens for r in reqs):,} tokens), budget {budget}, {cfg['reps']} rep(s)")

    if warm_arm is not None:     # its first decode before any arm's; then its engine goes, its modules stay
        shortest = min(reqs, key=lambda r: r.n_tokens)
        rnd, st = restorer(warm_arm, dirs[shortest.request_id], budget, seed)()
        warm_arm.engine.decode(rnd, st)
        del rnd, st
        warm_arm.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"warm copy: {warm_arm.describe()} decoded {shortest.request_id} before every arm; its engine "
              "dropped, its modules kept")

    # fingerprints (before anything is recorded: a refusal leaves no run behind)
    if manifest0 is not None:
        fp_section = manifest0.get("fingerprints") or {}
    elif cfg.get("fingerprint", True):
        shortest = min(reqs, key=lambda r: r.n_tokens)
        fp_section, lines = fingerprints(arms, dirs[shortest.request_id], budget, seed,
                                         bool(cfg.get("allow_identical")))
        print("\n".join(lines))
    else:
        fp_section = {"skipped": True}

    # the run directory
    epochs = Placement(cfg, arms, int(cfg["reps"]) * len(reqs), weights)
    floor = arm_sd_floor(cfg, epochs.cuda)
    writer = rawout.RunWriter(run_dir, flush_every=int(cfg.get("flush_every") or 16))
    if manifest0 is None:
        from snapshots import tokenizer as tk
        from .env import environment

        for label, arm in arms.items():
            if arm.revision.diff is not None:
                (run_dir / "diffs" / f"{label}.diff").write_bytes(arm.revision.diff.read_bytes())
        manifest = {
            "run_id": run_dir.name, "command": command, "config": cfg,
            "arms": {label: arm.record(run_dir) for label, arm in arms.items()},
            "instrument": _instrument(repo), "environment": environment(),
            "hashes": {"model_checkpoint": control.checkpoint_hash, "tokenizer": tk.tokenizer_hash(),
                       "trace_corpus": trace["corpus_hash"], "trace": trace["name"], **snap_hashes},
            "status": "running", "expect_bit_exact": bool(cfg.get("expect_bit_exact")),
            "fingerprints": fp_section, "mlflow": None,
            "placement": epochs.record(), "arm_orders": orders,
            "analysis": {"arm_sd_floor": floor},
            "requests": [{"request_id": r.request_id, "context_len": r.n_tokens} for r in reqs],
            "started_utc": _utc(), "finished_utc": None, "resumed_utc": [],
        }
        writer.write_manifest(manifest)
    else:
        manifest = manifest0
        manifest["status"] = "running"
        manifest["resumed_utc"] = manifest.get("resumed_utc", []) + [_utc()]
        writer.write_manifest(manifest)

    # the arms in their fixed order, not the import order: the schedule is a function of the seed alone
    plan = schedule.plan([r.request_id for r in reqs], [a for a in armsmod.ARMS if a in arms], int(cfg["reps"]),
                         int(cfg["seed"]), shuffle_requests=shuffle_requests)
    if epochs.per_epoch:
        print(f"placement: {epochs.describe()}")
    done = writer.completed()
    todo = [d for d in plan if d.key not in done]
    ctx = {r.request_id: r.n_tokens for r in reqs}
    print(f"run {run_dir}: {len(plan)} decodes" + (f", {len(plan) - len(todo)} already complete" if done else ""))
    code = _decode_all(cfg, arms, dirs, todo, ctx, budget, seed, writer, progress, epochs)
    if code == EXIT_INTERRUPTED:
        manifest = writer.update_manifest(status="interrupted")
        n_done = len(writer.completed())
        print(f"interrupted: {n_done}/{len(plan)} decodes complete and saved in {run_dir}\n"
              f"resume with: python -m replay.paired resume=true RUN_DIR={run_dir}", file=sys.stderr)
        return code
    manifest = writer.update_manifest(status="complete", finished_utc=_utc(),
                                      wall_seconds=round(time.time() - t_begin, 1))
    finish(run_dir, manifest, cfg)
    return EXIT_OK


def arm_order(cfg, key: str, labels: list[str], rng: random.Random | None = None) -> list[str]:
    """The labels in the order setting ``key`` gives (``analysis.rawio.parse_arm_order``: a list, or a
    comma-separated string with or without brackets, naming each label once; unset: ``labels`` as they are;
    ``random``: shuffled by ``rng``, default fresh entropy, so that separate runs of one command draw
    separate orders)."""
    from analysis.rawio import RunDataError, parse_arm_order

    try:
        order = parse_arm_order(cfg.get(key), labels, key)
    except RunDataError as e:
        raise ReplayError(str(e)) from None
    if order is not None:
        return order
    out = list(labels)
    if cfg.get(key):      # random
        (rng or random.SystemRandom()).shuffle(out)
    return out


def build_order(cfg, arms: dict) -> list:
    """The arms in the order their engines are built (``build_order``; default the arms' own order, i.e.
    the import order). Building allocates an engine's weights, caches and graphs: a diagnostic for an arm
    offset that follows allocation order rather than code."""
    return [arms[label] for label in arm_order(cfg, "build_order", list(arms))]


def request_order(cfg) -> str:
    """``request_order``: ``shuffled`` (the requests decoded in an order drawn from the seed) or ``given``
    (as selected: ``spread`` and ``shortest`` sort by context). Unset, as in a run recorded before the
    setting existed (a resume takes its config from the manifest): ``given``."""
    v = str(cfg.get("request_order") or "given").strip().lower()
    if v not in ("shuffled", "given"):
        raise ReplayError(f"request_order={cfg.get('request_order')!r}: shuffled or given")
    return v


WARM = "warm"     # the label of warm_copy's throwaway copy of the control


def warm_copy(cfg) -> bool:
    """``warm_copy``: a throwaway copy of the control's runtime imported, built and decoding (the shortest
    request) before every arm, then its engine dropped, so that whatever the process's first copy pays
    falls on none of the measured arms (the arm imported first ran +0.2 % slower in requests of 47K-190K
    on the H200, session 59; experiments/notes/placement.md). Off by default until measured."""
    v = cfg.get("warm_copy", False)
    if v in (None, False, True):
        return bool(v)
    raise ReplayError(f"warm_copy={v!r}: true or false")


def recorded_orders(manifest: dict, cfg) -> tuple[list[str], dict]:
    """A resumed run's import order, and the config that builds its arms in the order they were first built
    (``analysis.rawio.arm_orders``: the manifest's record, or the config of a run recorded before it)."""
    from analysis.rawio import RunDataError, arm_orders

    try:
        o = arm_orders(manifest)
    except RunDataError as e:
        raise ReplayError(f"cannot resume: {e}") from None
    return o["import"], {**cfg, "build_order": o["build"]}


GPU_ARM_SD_FLOOR = 0.0017   # arm_sd_floor=auto on a GPU: the candidate contrasts' pooled arm offset over 27 A/A
                            # replays on the H200 (session 57, experiments/notes/placement.md); 45 replays in
                            # session 58 read 0.164 % (0.102-0.211), and its 18 new ones, recorded with this
                            # floor, held 0 in 18 of 18; session 59's 20 with random arm orders read 0.061 %
                            # (0-0.129) and held 0 in 20 of 20: conservative there, kept; analysis.stats


def arm_sd_floor(cfg: dict, cuda: bool) -> float:
    """The run's arm-offset floor (``arm_sd_floor``: a number >= 0, or auto: GPU_ARM_SD_FLOOR on a GPU, 0
    on the CPU), recorded in the manifest for the analysis."""
    from analysis.stats import check_arm_sd_floor

    v = cfg.get("arm_sd_floor", "auto")
    if v in (None, "auto"):
        return GPU_ARM_SD_FLOOR if cuda else 0.0
    try:
        return check_arm_sd_floor(v)
    except ValueError as e:
        raise ReplayError(f"{e}, or auto") from None


AUTO_EPOCHS = 64    # placement.epochs=auto on a GPU (at most one per request): q1-mini rebuilds in ~0.1 s an arm


class Placement:
    """Placement epochs (``placement.epochs``): where an arm's weights, caches and graphs sit in GPU
    memory moves its step time (``experiments/placement.py``: up to 2 % between placements of one
    q1-mini request, each placement steady within 0.1-0.2 %), and an arm keeps its placement as long as
    its engine and kept device loop live, so every request of the run shared it. The run is cut into
    epochs of consecutive requests; at each epoch's start every arm's engine is dropped and built
    again, in a random order, each after a pad of random size (``placement.pad_mib``) that is held
    for the epoch: a new placement per arm and epoch. Each decode records its epoch; the statistics
    resample an epoch's requests together (``analysis.stats.request_clusters``)."""

    def __init__(self, cfg: dict, arms: dict, n_blocks: int, weights):
        pl = cfg.get("placement") or {"epochs": 0}      # (a run recorded before placement epochs: none)
        n = pl.get("epochs", "auto")
        self.cuda = any(a.engine.device.type == "cuda" for a in arms.values())
        if n == "auto":
            n = AUTO_EPOCHS if self.cuda else 0
        try:
            n = int(n)
        except (TypeError, ValueError):
            raise ReplayError(f"placement.epochs={n!r}: an integer >= 0, or auto") from None
        if n < 0:
            raise ReplayError(f"placement.epochs={n}: an integer >= 0, or auto")
        self.epochs = min(n, n_blocks)
        self.per_epoch = -(-n_blocks // self.epochs) if self.epochs else 0   # requests (x reps) per epoch
        self.n_arms, self.pad_mib = len(arms), int(pl.get("pad_mib", 512))
        self.cfg, self.weights, self.seed = cfg, weights, int(cfg.get("seed") or 0)
        self.current, self.pads, self.rebuilds, self.seconds = None, [], 0, 0.0

    def describe(self) -> str:
        return (f"{self.epochs} epochs of {self.per_epoch} request(s): every arm's engine built again at a "
                f"new place (a random pad of up to {self.pad_mib} MiB before each) at each epoch's start")

    def record(self) -> dict:
        return {"epochs": self.epochs, "requests_per_epoch": self.per_epoch, "pad_mib": self.pad_mib}

    def epoch(self, d) -> int:
        """The epoch of decode ``d`` (-1: no epochs): its (rep, request) block's index // per_epoch."""
        return (d.order // self.n_arms) // self.per_epoch if self.per_epoch else -1

    def enter(self, e: int, arms: dict) -> None:
        """Before a decode of epoch ``e``: the arms rebuilt at new places if ``e`` is not the current one."""
        if e < 0 or e == self.current:
            return
        import torch

        t0 = time.perf_counter()
        rng = random.Random(f"placement:{self.seed}:{e}")
        order = [arms[a] for a in armsmod.ARMS if a in arms]    # (the fixed order: the draw a function of the seed)
        rng.shuffle(order)
        for arm in order:
            arm.engine = None
        self.pads = []
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        for arm in order:
            size = rng.randrange(0, self.pad_mib + 1) << 20
            self.pads.append(torch.empty(size, dtype=torch.uint8, device="cuda" if self.cuda else "cpu"))
            armsmod.build(arm, model_name(self.cfg), self.cfg.get("runtime") or {}, self.weights,
                          self.cfg.get("checkpoint"), int(self.cfg.get("random_seed") or 0))
        self.current = e
        self.rebuilds += len(order)
        self.seconds += time.perf_counter() - t0


def _decode_all(cfg, arms, dirs, todo, ctx, budget, seed, writer, progress, epochs: Placement) -> int:
    from tqdm import tqdm

    from snapshots.restore import restore

    warmup = int(cfg.get("warmup_steps") or 0)
    stop_after = cfg.get("debug_interrupt_after")
    bar = tqdm(todo, desc="replay", unit="decode", disable=not progress, dynamic_ncols=True)
    n = 0
    try:
        for d in bar:
            e = epochs.epoch(d)
            if epochs.per_epoch and e != epochs.current:
                bar.set_postfix_str(f"epoch {e}: rebuilding the arms")
                epochs.enter(e, arms)
            arm = arms[d.arm]
            bar.set_postfix_str(f"{d.request_id} {d.arm} rep {d.rep}")
            rnd, st = restore(arm.engine, dirs[d.request_id], budget=budget, seed=seed)
            gc.collect()
            gc.disable()     # no collector pauses inside a timed decode
            try:
                c_call = time.thread_time_ns()
                t_call = time.perf_counter_ns()
                gen = arm.engine.decode(rnd, st)
                decode_ns = time.perf_counter_ns() - t_call
                cpu_ns = time.thread_time_ns() - c_call   # < decode_ns: the thread waited for a core
            finally:
                gc.enable()
            rows, req = rawout.decode_rows(gen, d.request_id, d.arm, d.rep, d.order, ctx[d.request_id],
                                           warmup, t_call, decode_ns, cpu_ns, e)
            writer.add(rows, req)
            del rnd, st, gen
            n += 1
            if stop_after is not None and n >= int(stop_after):
                raise KeyboardInterrupt(f"debug_interrupt_after={stop_after}")
    except KeyboardInterrupt:
        bar.close()
        writer.flush()
        return EXIT_INTERRUPTED
    except Exception:
        bar.close()
        writer.flush()   # what completed stays; the failing decode is not recorded
        writer.update_manifest(status="interrupted", error=traceback.format_exc())
        raise ReplayError(f"decode {d.request_id}/{d.arm}/rep {d.rep} failed in arm "
                          f"{arms[d.arm].describe()}:\n{traceback.format_exc()}"
                          f"the completed decodes are saved; after a fix of the instrument, resume with: "
                          f"python -m replay.paired resume=true RUN_DIR={writer.run_dir}", EXIT_ERROR) from None
    bar.close()
    writer.flush()
    if epochs.rebuilds:
        print(f"placement: the arms' engines built {epochs.rebuilds} times in {epochs.seconds:.1f} s")
    return EXIT_OK


# ---- the end: summary, report, record ------------------------------------------------------------
def summary_lines(run, an, v) -> list[str]:
    """Per-arm means (of per-decode values, warm-up steps excluded) and the paired effects."""
    from analysis import rawio, stats, verdict

    dec = an.decodes if an is not None else stats.decode_metrics(run.steps)
    lines = [f"{'arm':<10} {'decodes':>7} {'TPOT ms':>9} {'step ms':>9} {'tok/step':>9} {'accepted':>9}"]
    for arm in [a for a in rawio.ARMS if a in set(dec["arm"])]:
        a = dec[dec["arm"] == arm]
        lines.append(f"{arm:<10} {len(a):>7} {a['tpot_ns'].mean() / 1e6:>9.3f} {a['step_ns'].mean() / 1e6:>9.3f} "
                     f"{a['tokens_per_step'].mean():>9.3f} {a['accepted'].mean():>9.3f}")
    req = getattr(run, "requests", None)
    if req is not None and "loop_ns" in req.columns:
        loops = {arm: r for arm, r in req.groupby("arm") if (r["loop_ns"] > 0).all()}
        if loops:   # every step counted, on the host's clock whatever the arm's step clock
            lines.append("host loop per output token (first step's start to last one's end, every step): "
                         + ", ".join(f"{a} {loops[a]['loop_ns'].sum() / loops[a]['n_tokens'].sum() / 1e6:.3f} ms"
                                     for a in rawio.ARMS if a in loops))
    if an is None:
        return lines
    for label, effects in (("candidate vs control", an.effects), ("A/A vs control", an.aa)):
        if effects:
            parts = [f"{stats.METRIC_NAMES[m]} {verdict.fmt_pct(effects[m])}" for m in ("tpot", "step", "tps")
                     if m in effects]
            k = effects["tpot"].n_clusters if "tpot" in effects else None
            units = f"{an.n_requests} requests" + (f" in {k} placement epochs" if k else "")
            t = effects.get("tpot")
            if label.startswith("candidate") and t is not None and t.ci_requests is not None:
                units += f", widened by an arm offset of {100 * t.arm_sd:.2f}%"   # analysis.stats; the report says why
            lines.append(f"{label} ({units}, 95% CI): " + "; ".join(parts))
    be = an.bit_exact
    lines.append(f"identical tokens: candidate {be['candidate_exact']}/{be['n_requests']} requests, A/A "
                 f"{be['aa_exact']}/{be['aa_compared']}; control reproducible across reps: "
                 f"{be['control_reproducible']}/{be['n_requests']}")
    if v is not None:
        lines.append(f"verdict: {v.headline}")
    return lines


def _fallback_summary(run_dir: Path, why: str) -> list[str]:
    steps, _ = rawout.frames(run_dir)
    steps = steps[~steps["warmup"]]
    steps["dur"] = steps["t_end_ns"] - steps["t_start_ns"]
    lines = [f"({why}; minimal summary)"]
    for arm, s in steps.groupby("arm"):
        lines.append(f"{arm:<10} TPOT {s['dur'].sum() / s['emitted'].sum() / 1e6:.3f} ms, step "
                     f"{s['dur'].mean() / 1e6:.3f} ms, {s['emitted'].mean():.3f} tokens/step")
    return lines


def finish(run_dir: Path, manifest: dict, cfg: dict) -> None:
    """Summary, report and MLflow record of a complete run; a failure here never unmarks the run."""
    print()
    try:
        from analysis import rawio, stats, verdict

        if rawout.pq is None:   # JSON Lines parts: analyse the frames in memory
            steps, reqs = rawout.frames(run_dir)
            run = rawio.from_frames(steps, reqs, manifest, run_dir)
        else:
            run = rawio.read_run(run_dir)
        an = stats.analyze(run)
        v = verdict.decide(an, run.manifest)
        print("\n".join(summary_lines(run, an, v)))
    except Exception as e:
        why = f"analysis failed: {type(e).__name__}: {e}"
        try:
            print("\n".join(_fallback_summary(run_dir, why)))
        except Exception as e2:
            print(f"({why}; summary failed too: {e2})")
    if rawout.pq is None:
        print("raw output written as JSON Lines (no pyarrow here); on a machine with pyarrow, "
              f"`python -m analysis.tracking log {run_dir}` converts it to Parquet, reports and records it")
    elif cfg.get("report", True):
        try:
            from analysis.report import build_report

            print(f"report: {build_report(run_dir, mlflow=False)['paths']['markdown']}")
        except Exception as e:
            print(f"(report not written: {type(e).__name__}: {e}; later: python -m analysis.report {run_dir})")
    tr = cfg.get("tracking") or {}
    if tr.get("enabled", True):
        try:
            from analysis import tracking

            run_id, uri = tracking.log_run(run_dir, tr.get("uri"), tr.get("experiment") or tracking.EXPERIMENT)
            print(f"MLflow: run {run_id} at {uri}")
        except Exception as e:
            print(f"MLflow: not recorded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                  f"the run directory is complete on its own; record it later with:\n"
                  f"  python -m analysis.tracking log {run_dir}"
                  + (f" tracking.uri={tr['uri']}" if tr.get("uri") else ""))
    print(f"run directory: {run_dir}")


# ---- entry points ----------------------------------------------------------------------------------
_register_resolvers()

try:
    import hydra as _hydra
    from omegaconf import OmegaConf as _OmegaConf
except ImportError:   # the GPU hosts: plain YAML composition
    _hydra = None


class ReplayFailed(RuntimeError):
    """Raised in a Hydra multirun job so that the sweep reports the failing job."""


if _hydra is not None:
    @_hydra.main(config_path="../conf", config_name="paired", version_base=None)
    def _hydra_task(dcfg) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        cfg = _OmegaConf.to_container(dcfg, resolve=True)
        overrides = list(hc.overrides.task)
        run_dir = Path(cfg.get("RUN_DIR") or hc.runtime.output_dir)
        code = run(cfg, overrides, run_dir, _DISPLAY or overrides)
        if hc.mode == RunMode.MULTIRUN:
            if code not in (EXIT_OK,):
                raise ReplayFailed(f"replay in {run_dir} ended with status {code}")
            return
        if code:
            sys.exit(code)

_DISPLAY: list[str] = []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return EXIT_OK
    args = rewrite_overrides(argv)
    if _hydra is None:
        try:
            cfg = compose_without_hydra(args)
        except ReplayError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.code
        print("note: Hydra is not installed: conf/paired.yaml composed with plain key=value overrides")
        return run(cfg, args, Path(cfg.get("RUN_DIR") or new_run_dir()), argv)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if not multirun:
        _DISPLAY[:] = argv
    sys.argv = [sys.argv[0]] + args
    _hydra_task()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
