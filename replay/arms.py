"""Arms of a paired replay: git revisions materialised into a cache, their ``runtime`` imported
under unique module names in this process, and an engine built per arm.

A revision (branch, tag, SHA, or ``WORKTREE`` for the uncommitted state of the checkout) becomes a
directory holding only ``runtime/`` and ``conf/`` of that revision (``runtime/config.py`` finds
``conf/`` and its assets relative to its own file, so each arm reads its own configs and assets):

- a commit: ``git archive <sha> runtime conf`` extracted under ``<cache>/<sha>`` (atomically, once);
- ``WORKTREE``: a copy of the tracked and untracked-not-ignored files of ``runtime/`` and ``conf/``
  under ``<cache>/worktree-<hash>``, keyed by a hash of the HEAD commit and the changed files; the
  changes are recorded as a binary diff against HEAD beside the copy.

``replay``, ``snapshots`` and ``analysis`` are never taken per arm: they come from the running
checkout, so the instrument is the same for every arm. The A/A arm is the control revision imported
a second time through exactly the path used for the candidate (another module name).

Refused with an :class:`ArmError` (never a partial run): an unknown revision; a revision that is the
checked-out HEAD while ``runtime/`` or ``conf/`` hold uncommitted changes and no arm is WORKTREE (the
user meant WORKTREE, or the arm would silently measure the committed code); a revision without a ``runtime`` package;
an arm whose runtime fails to import or to build (the message carries the traceback).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

WORKTREE = "WORKTREE"
ARM_PATHS = ("runtime", "conf")   # what an arm takes from its revision
ARMS = ("control", "candidate", "aa")


class ArmError(RuntimeError):
    """A revision cannot be resolved, materialised, imported or built."""


def home() -> Path:
    """``$IQUESTRT_HOME``, else ``~/.cache/iquestrt`` (the same root as the trace store)."""
    return Path(os.environ.get("IQUESTRT_HOME") or Path.home() / ".cache" / "iquestrt").expanduser()


# ---- git -------------------------------------------------------------------------------------------
def git(repo: Path, *args: str, check: bool = True, binary: bool = False) -> Any:
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise ArmError("git is not installed: arms are materialised from git revisions "
                       "(prepare them elsewhere with `python -m replay.arms prepare ...`)") from None
    if check and p.returncode != 0:
        raise ArmError(f"git {' '.join(args)} failed in {repo}: {p.stderr.decode(errors='replace').strip()}")
    return p if not check else (p.stdout if binary else p.stdout.decode())


def repo_root(start: str | Path) -> Path:
    p = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if p.returncode != 0:
        raise ArmError(f"{start} is not inside a git repository: arms are git revisions of the checkout "
                       "that runs the replay")
    return Path(p.stdout.strip())


def head_sha(repo: Path) -> str:
    return git(repo, "rev-parse", "HEAD").strip()


def dirty_paths(repo: Path) -> list[str]:
    """Uncommitted changes under runtime/ and conf/ (modified, staged, deleted, untracked-not-ignored)."""
    out = git(repo, "status", "--porcelain=v1", "--untracked-files=all", "--", *ARM_PATHS)
    paths = [line[3:] for line in out.splitlines() if line.strip()]
    return [p for p in paths if "__pycache__" not in p and not p.endswith(".pyc")]


def _known_refs(repo: Path, n: int = 8) -> str:
    refs = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads", "refs/tags", check=False)
    names = refs.stdout.decode().split() if refs.returncode == 0 else []
    more = f", … ({len(names)} in all)" if len(names) > n else ""
    return ", ".join(names[:n]) + more if names else "none"


# ---- revisions -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Revision:
    """A resolved revision: what the user wrote, the commit, and the materialised directory."""

    rev: str
    sha: str                     # the commit (for WORKTREE: HEAD, the base of the diff)
    key: str                     # the cache key: the sha, or worktree-<hash of the changes>
    root: Path                   # holds runtime/ and conf/
    diff: Path | None = None     # WORKTREE: binary diff of runtime/ and conf/ against HEAD

    @property
    def short(self) -> str:
        return self.key[:12] if self.diff is None else self.key[:21]


def resolve(repo: Path | None, rev: str, cache: Path | None = None, dirty_ok: bool = False) -> Revision:
    """Resolve and materialise one revision (see the module docstring for what is refused).
    ``dirty_ok``: another arm replays the WORKTREE, so HEAD plainly means the committed code."""
    cache = Path(cache) if cache else home() / "arms"
    cache.mkdir(parents=True, exist_ok=True)
    rev = str(rev)
    if repo is None:
        return from_refs(rev, cache)
    if rev == WORKTREE:
        return materialise_worktree(repo, cache)
    p = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if p.returncode != 0 or not rev.strip():
        raise ArmError(f"unknown revision {rev!r}: not a branch, tag or commit of {repo} "
                       f"(branches and tags: {_known_refs(repo)}; or WORKTREE for uncommitted changes)")
    sha = p.stdout.decode().strip()
    if sha == head_sha(repo) and not dirty_ok:
        dirty = dirty_paths(repo)
        if dirty:
            shown = ", ".join(dirty[:5]) + (f", … ({len(dirty)} in all)" if len(dirty) > 5 else "")
            raise ArmError(
                f"revision {rev!r} is the checked-out HEAD ({sha[:12]}), but runtime/ or conf/ have "
                f"uncommitted changes ({shown}); an arm at {rev!r} would measure the committed code, "
                f"not what is in the tree. Commit them, or use {WORKTREE} to replay the tree as it is "
                f"(e.g. candidate={WORKTREE}; the diff is recorded with the run)")
    return materialise_commit(repo, rev, sha, cache)


def _finish(tmp: Path, dest: Path, meta: dict) -> None:
    if not (tmp / "runtime" / "__init__.py").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArmError(f"revision {meta['rev']!r} ({meta['sha'][:12]}) has no runtime package "
                       "(runtime/__init__.py): it cannot be an arm")
    (tmp / ".arm.json").write_text(json.dumps(meta, indent=1) + "\n")
    try:
        os.replace(tmp, dest)
    except OSError:   # another process materialised it first
        shutil.rmtree(tmp, ignore_errors=True)
    if not (dest / ".arm.json").is_file():
        raise ArmError(f"could not materialise {meta['rev']!r} into {dest}")


def materialise_commit(repo: Path, rev: str, sha: str, cache: Path) -> Revision:
    dest = cache / sha
    if not (dest / ".arm.json").is_file():
        present = set(git(repo, "ls-tree", "--name-only", sha).split())
        paths = [p for p in ARM_PATHS if p in present]
        if "runtime" not in paths:
            raise ArmError(f"revision {rev!r} ({sha[:12]}) has no runtime/ directory: it cannot be an arm")
        data = git(repo, "archive", "--format=tar", sha, "--", *paths, binary=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}.", dir=cache))
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            _extract(tf, tmp)
        _finish(tmp, dest, {"rev": rev, "sha": sha, "kind": "commit"})
    return Revision(rev=rev, sha=sha, key=sha, root=dest)


def _extract(tf: tarfile.TarFile, dest: Path) -> None:
    if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
        tf.extractall(dest, filter="data")
    else:  # pragma: no cover - old Pythons without extraction filters; git archive output is trusted
        tf.extractall(dest)


def worktree_diff(repo: Path) -> bytes:
    """Binary diff of runtime/ and conf/ against HEAD, untracked-not-ignored files included."""
    diff = git(repo, "diff", "--binary", "HEAD", "--", *ARM_PATHS, binary=True)
    untracked = git(repo, "ls-files", "-z", "--others", "--exclude-standard", "--", *ARM_PATHS).split("\0")
    for f in sorted(u for u in untracked if u and "__pycache__" not in u and not u.endswith(".pyc")):
        p = git(repo, "diff", "--binary", "--no-index", "--", "/dev/null", f, check=False)
        diff += p.stdout   # exit status 1 means "differs", which is the point
    return diff


def materialise_worktree(repo: Path, cache: Path) -> Revision:
    base = head_sha(repo)
    diff = worktree_diff(repo)
    files = [f for f in git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                             *ARM_PATHS).split("\0")
             if f and "__pycache__" not in f and not f.endswith(".pyc")]
    h = hashlib.sha256(f"{base}\n".encode())
    h.update(hashlib.sha256(diff).digest())
    key = f"worktree-{h.hexdigest()[:24]}"
    dest = cache / key
    if not (dest / ".arm.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache))
        for f in sorted(set(files)):
            src = repo / f
            if src.is_file():      # a tracked file deleted in the tree is absent from the arm too
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, tmp / f)
        (tmp / "worktree.diff").write_bytes(diff)
        _finish(tmp, dest, {"rev": WORKTREE, "sha": base, "kind": "worktree", "key": key})
    return Revision(rev=WORKTREE, sha=base, key=key, root=dest, diff=dest / "worktree.diff")


REFS = "refs.json"


def from_refs(rev: str, cache: Path) -> Revision:
    """A revision prepared earlier into ``cache`` (``python -m replay.arms prepare``), for a machine
    where the checkout has no git history."""
    refs_file = cache / REFS
    refs = json.loads(refs_file.read_text()) if refs_file.is_file() else {}
    if rev not in refs:
        raise ArmError(f"no git repository here, and revision {rev!r} was not prepared into {cache} "
                       f"(prepared: {sorted(refs) or 'none'}); on a machine with the history run "
                       f"`python -m replay.arms prepare control=REV candidate=REV cache=DIR` and carry DIR")
    e = refs[rev]
    root = cache / e["key"]
    if not (root / ".arm.json").is_file():
        raise ArmError(f"{refs_file}: revision {rev!r} names {root}, which is missing or incomplete")
    diff = root / "worktree.diff" if e.get("diff") else None
    return Revision(rev=rev, sha=e["sha"], key=e["key"], root=root, diff=diff)


def record_ref(cache: Path, r: Revision) -> None:
    refs_file = cache / REFS
    refs = json.loads(refs_file.read_text()) if refs_file.is_file() else {}
    refs[r.rev] = {"sha": r.sha, "key": r.key, "diff": r.diff is not None}
    refs_file.write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")


# ---- import and build ------------------------------------------------------------------------------
@dataclasses.dataclass
class Arm:
    """One arm: a revision, its runtime imported as ``module``, its overrides and its engine."""

    label: str
    revision: Revision
    module: str
    overrides: dict
    runtime: ModuleType | None = None
    engine: Any = None
    model_cfg: Any = None
    rt: Any = None

    def sub(self, name: str) -> ModuleType:
        return sys.modules[f"{self.module}.{name}"]

    def describe(self) -> str:
        return f"{self.label} = {self.revision.rev} @ {self.revision.short}"

    def record(self, run_dir: Path | None = None) -> dict:
        r = self.revision
        diff = None
        if r.diff is not None and run_dir is not None:
            diff = f"diffs/{self.label}.diff"   # relative to the run directory
        rec = {"rev": r.rev, "sha": r.sha, "key": r.key, "dirty_diff": diff, "module": self.module,
               "overrides": self.overrides, "root": str(r.root)}
        if getattr(self, "engine", None) is not None:
            rec["device"] = str(self.engine.device)
            rec["execution"] = getattr(self.engine, "execution", "eager")
            rec["step_clock"] = step_clock(self.engine)
        if dataclasses.is_dataclass(self.rt):
            # resolved: the revision's conf/runtime/default.yaml with the overrides (kernels included)
            rec["runtime"] = dataclasses.asdict(self.rt)
        return rec


LEGACY_STEP_CLOCK = "host perf_counter, the step's pieces and their sync only"


def step_clock(engine) -> str:
    """What the arm's recorded step durations cover (``Engine.step_clock``; a revision before it timed
    only each step's pieces, not the host's reads between steps)."""
    return getattr(engine, "step_clock", LEGACY_STEP_CLOCK)


def module_name(label: str, revision: Revision) -> str:
    """``iquestrt_arm_<label>_<sha[:12]>`` (WORKTREE: the hash of its changes); unique in sys.modules."""
    key = revision.key.replace("worktree-", "wt")[:12]
    base = f"iquestrt_arm_{label}_{key}"
    name, n = base, 1
    while name in sys.modules:
        n += 1
        name = f"{base}_{n}"
    return name


def _drop_modules(prefix: str) -> None:
    for k in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
        del sys.modules[k]


def import_runtime(label: str, revision: Revision) -> tuple[str, ModuleType]:
    """Import the revision's runtime package under a unique name (registered in sys.modules before
    it executes, so its relative imports resolve inside it)."""
    name = module_name(label, revision)
    pkg = revision.root / "runtime"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise ArmError(f"arm {label} ({revision.rev} @ {revision.short}): {pkg} is not importable")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        for sub in ("config", "checkpoint", "engine"):
            importlib.import_module(f"{name}.{sub}")
    except BaseException as e:
        _drop_modules(name)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ArmError(f"arm {label} ({revision.rev} @ {revision.short}): importing its runtime failed\n"
                       f"{traceback.format_exc()}") from None
    return name, mod


def flatten(d: dict | None, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _source_hash(arm: Arm, *names: str) -> str:
    h = hashlib.sha256()
    for n in names:
        p = arm.revision.root / "runtime" / f"{n}.py"
        h.update(p.read_bytes() if p.is_file() else b"")
    return h.hexdigest()


class WeightCache:
    """Checkpoint tensors loaded once and shared by arms whose checkpoint hash, model config, TP shard
    and loader source agree. Engines copy what they convert, so sharing the dict is safe; the stacked
    experts (``runtime.model.stacked_experts``) are the exception that saves memory: the first engine
    puts them back into the dict as views, same values, and later engines reuse them."""

    def __init__(self):
        self._tensors: dict[tuple, dict] = {}
        self.loads = 0

    def get(self, key: tuple, load) -> dict:
        if key not in self._tensors:
            self._tensors[key] = load()
            self.loads += 1
        return self._tensors[key]


def build(arm: Arm, model: str, runtime_overrides: dict, weights: WeightCache,
          checkpoint: str | None = None, random_seed: int = 0) -> Arm:
    """Build the arm's engine from its own configs: ``conf/model/<model>.yaml`` and
    ``conf/runtime/default.yaml`` of its revision, with the shared then the per-arm overrides."""
    where = f"arm {arm.label} ({arm.revision.rev} @ {arm.revision.short})"
    try:
        cfgmod, ck, eng = arm.sub("config"), arm.sub("checkpoint"), arm.sub("engine")
        mcfg = cfgmod.load_model_config(model)
        flat = {**flatten(runtime_overrides), **flatten(arm.overrides.get("runtime"))}
        rt = cfgmod.load_runtime_config("default", flat)
        path = Path(checkpoint) if checkpoint else eng.default_checkpoint(mcfg)
        tp = (rt.tp.size, rt.tp.local_rank)
        if path is not None:
            chash = ck.checkpoint_hash(path)
            key = ("file", chash, json.dumps(mcfg.to_dict(), sort_keys=True), tp,
                   _source_hash(arm, "checkpoint", "fp8"))
            tensors = weights.get(key, lambda: ck.load_checkpoint(path, mcfg, rt.tp))
        else:
            chash = f"random:{mcfg.name}:seed{random_seed}"
            dev = eng.resolve_device(rt.device)
            key = ("random", chash, json.dumps(mcfg.to_dict(), sort_keys=True), tp, str(dev),
                   _source_hash(arm, "checkpoint", "fp8", "rng"))
            tensors = weights.get(key, lambda: dict(ck.random_tensors(mcfg, rt.tp, seed=random_seed, device=dev)))
        arm.engine = eng.Engine(mcfg, rt, tensors, chash)
        arm.model_cfg, arm.rt = mcfg, rt
    except KeyboardInterrupt:
        raise
    except BaseException:
        raise ArmError(f"{where}: building its engine failed\n{traceback.format_exc()}") from None
    return arm


def load_arms(repo: Path, revs: dict[str, str], overrides: dict[str, dict], cache: Path | None = None,
              order: list[str] | None = None) -> dict[str, Arm]:
    """Resolve, materialise and import every arm (``revs``: label -> REV), in ``order`` (default ARMS:
    control, candidate, aa). The A/A arm, when asked for, takes the control's revision and overrides and
    is imported through the same function. The returned dict keeps the import order."""
    arms = {}
    resolved: dict[str, Revision] = {}
    for label in order or ARMS:
        if label not in revs:
            continue
        rev = revs[label]
        if rev not in resolved:
            resolved[rev] = resolve(repo, rev, cache, dirty_ok=WORKTREE in revs.values())
        r = resolved[rev]
        name, mod = import_runtime(label, r)
        arms[label] = Arm(label=label, revision=r, module=name, overrides=dict(overrides.get(label) or {}),
                          runtime=mod)
    return arms


# ---- command line: prepare an arms cache for a machine without git ----------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m replay.arms prepare control=REV candidate=REV [cache=DIR]``: materialise revisions
    into a cache (default ``$IQUESTRT_HOME/arms``) and record them in its refs.json, so that a replay
    on a machine whose checkout has no git history (``arms.cache=DIR``) finds them by name."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "prepare" or any(a in ("-h", "--help") for a in argv):
        print(main.__doc__)
        return 0 if any(a in ("-h", "--help") for a in argv) else 2
    opts = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    cache = Path(opts.pop("cache")).resolve() if "cache" in opts else home() / "arms"
    try:
        repo = repo_root(Path.cwd())
        for label, rev in opts.items():
            r = resolve(repo, rev, cache)
            record_ref(cache, r)
            print(f"{label}: {rev} -> {r.key} at {r.root}")
    except ArmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
