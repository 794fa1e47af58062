"""The paired replay harness end to end, on a temporary git repository holding this project.

Branches of the temporary repository: ``main`` (this checkout), ``extra-op`` (one more operator per
layer in ``Model.block``, values unchanged), ``reformat`` (comments and blank lines only) and
``tiny-theta`` (q1-tiny's RoPE base changed: its snapshots are of another model). Every replay runs
as a subprocess ``python -m replay.paired`` in that repository, on q1-tiny with two short synthetic
requests and an 8-token budget.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

SRC = Path(__file__).resolve().parents[1]
COMMON = ["model=q1-tiny", "traces.name=synthetic", "traces.synthetic.n=2", "traces.synthetic.min_len=24",
          "traces.synthetic.max_len=40", "max_new_tokens=8", "tracking.enabled=false", "progress=false",
          "report=false"]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
EXTRA_OP = "        x = x * 1.0   # one more operator per layer, no value changed\n"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def _project_files() -> list[str]:
    tracked = git(SRC, "ls-files", "-z").split("\0")
    extra = git(SRC, "ls-files", "-z", "--others", "--exclude-standard", "--", "replay", "snapshots",
                "analysis", "conf").split("\0")
    return sorted({f for f in tracked + extra if f and (SRC / f).is_file()})


def _add_extra_op(repo: Path) -> None:
    f = repo / "runtime" / "model.py"
    src = f.read_text()
    line = "        return x + self.moe(lw, rms_norm(x, lw.ln2, eps))\n"
    assert src.count(line) == 1, "Model.block changed: update the extra-op patch of this test"
    f.write_text(src.replace(line, EXTRA_OP + line))


def _commit_branch(repo: Path, name: str, change) -> None:
    git(repo, "checkout", "-q", "-b", name, "main")
    change(repo)
    git(repo, "commit", "-qam", name)
    git(repo, "checkout", "-q", "main")


def _reformat(repo: Path) -> None:
    f = repo / "runtime" / "speculative.py"
    src = f.read_text()
    src = src.replace("    def verify(self", "    # reformatted: a comment and a blank line, nothing else\n\n"
                                            "    def verify(self", 1)
    f.write_text(src + "\n# trailing comment\n")


def _tiny_theta(repo: Path) -> None:
    f = repo / "conf" / "model" / "q1-tiny.yaml"
    src = f.read_text()
    assert "rope_theta: 10000.0" in src
    f.write_text(src.replace("rope_theta: 10000.0", "rope_theta: 20000.0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An MLflow tracking server on loopback, started early (it takes a while on two cores)."""

    def __init__(self, root: Path):
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "mlflow-server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--default-artifact-root", str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                time.sleep(0.5)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    if shutil.which("git") is None or not (SRC / ".git").exists():
        pytest.skip("needs git and this project's git checkout")
    root = tmp_path_factory.mktemp("replay")
    server = None
    try:
        import mlflow  # noqa: F401
        server = Server(root)
    except ImportError:
        pass
    repo = root / "repo"
    for f in _project_files():
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(SRC / f, repo / f)
    git(repo.parent, "init", "-q", "-b", "main", str(repo))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "project")
    _commit_branch(repo, "extra-op", _add_extra_op)
    _commit_branch(repo, "reformat", _reformat)
    _commit_branch(repo, "tiny-theta", _tiny_theta)
    home = root / "home"
    home.mkdir()
    yield {"repo": repo, "home": home, "root": root, "server": server}
    if server is not None:
        server.stop()


def replay(env, *args, timeout=240) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(env["repo"]), "IQUESTRT_HOME": str(env["home"]),
         "HYDRA_FULL_ERROR": "1"}
    p = subprocess.run([sys.executable, "-m", "replay.paired", *COMMON, *args], cwd=env["repo"], env=e,
                       capture_output=True, text=True, timeout=timeout)
    p.out = p.stdout + p.stderr
    return p


def manifest(run_dir: Path) -> dict | None:
    f = run_dir / "manifest.json"
    return json.loads(f.read_text()) if f.is_file() else None


def requests_table(run_dir: Path):
    import pandas as pd

    df = pd.concat([pd.read_parquet(p) for p in sorted((run_dir / "requests").glob("*.parquet"))])
    return df.sort_values(["request_id", "arm", "rep"]).reset_index(drop=True)


def test_candidate_change_is_detected_and_aa_matches_control(env):
    run_dir = env["root"] / "run-extra-op"
    p = replay(env, "control=main", "candidate=extra-op", f"RUN_DIR={run_dir}", "report=true",
               "placement.epochs=2")
    assert p.returncode == 0, p.out
    assert "candidate vs control: the step work differs at widths [4, 5, 6, 7, 8]" in p.out
    # one aten.mul per target layer (4) per verify; the draft layer runs the same block
    assert re.search(r"\+\d+ aten\.mul\.Tensor", p.out), p.out
    assert "A/A vs control: identical step work" in p.out
    m = manifest(run_dir)
    assert m["status"] == "complete"
    sha = {b: git(env["repo"], "rev-parse", b) for b in ("main", "extra-op")}
    arms = m["arms"]
    assert (arms["control"]["sha"], arms["candidate"]["sha"], arms["aa"]["sha"]) == (sha["main"], sha["extra-op"],
                                                                                   sha["main"])
    assert len({a["module"] for a in arms.values()}) == 3
    assert m["fingerprints"]["candidate_vs_control"]["identical"] is False
    assert m["fingerprints"]["aa_vs_control"]["identical"] is True
    assert m["hashes"]["snapshots"] and m["environment"]["torch"] == torch.__version__
    req = requests_table(run_dir)
    assert len(req) == 2 * 3
    by = req.set_index(["request_id", "arm"])["tokens_sha"]
    for rid in req["request_id"].unique():   # x * 1.0 changes no value: every arm emits the same tokens
        assert by[(rid, "control")] == by[(rid, "aa")] == by[(rid, "candidate")]
    assert (run_dir / "report" / "report.md").is_file()
    assert "verdict:" in p.out and "TPOT ms" in p.out
    # host contention: every arm decodes on the CPU, each decode's thread CPU time is recorded
    assert {a["device"] for a in arms.values()} == {"cpu"}
    assert (req["cpu_ns"] > 0).all() and (req["cpu_ns"] <= 1.05 * req["decode_ns"]).all()
    assert "Host contention (CPU runs)" in (run_dir / "report" / "report.md").read_text()
    # the host loop's own time, inside the decode call's; the arms' step clocks in the manifest
    assert (req["loop_ns"] > 0).all() and (req["loop_ns"] <= req["decode_ns"]).all()
    assert "host loop per output token" in p.out
    assert {a["step_clock"] for a in arms.values()} == {"host perf_counter, step to step"}
    assert {a["execution"] for a in arms.values()} == {"eager"}
    # placement epochs: one request each, every arm's engine built again before each (2 x 3 builds)
    assert m["placement"] == {"epochs": 2, "requests_per_epoch": 1, "pad_mib": 512}
    assert m["analysis"] == {"arm_sd_floor": 0.0}     # auto on the CPU
    assert "placement: the arms' engines built 6 times" in p.out, p.out
    assert sorted(req.groupby("request_id")["epoch"].agg(lambda e: tuple(sorted(set(e)))).tolist()) == [(0,), (1,)]
    # import_order=random (the default): an order drawn for this run, recorded, the build following it
    o = m["arm_orders"]
    assert sorted(o["import"]) == ["aa", "candidate", "control"] and o["build"] == o["import"], o
    assert f"arm order: imported {', '.join(o['import'])}; built {', '.join(o['build'])}" in p.out
    assert m["config"]["import_order"] == "random"


def test_reformat_only_is_refused_as_ineffective(env):
    run_dir = env["root"] / "run-reformat"
    p = replay(env, "control=main", "candidate=reformat", f"RUN_DIR={run_dir}")
    assert p.returncode == 3, p.out
    assert "ineffective substitution" in p.out and "allow_identical=true" in p.out
    assert manifest(run_dir) is None


def test_resume_after_interruption_matches_uninterrupted_run(env):
    args = ["control=main", "candidate=main", "candidate.runtime.draft.policy=fixed", "reps=2"]
    a, b = env["root"] / "run-interrupted", env["root"] / "run-straight"
    # (this run with warm_copy, the straight one without: the throwaway copy changes no token)
    p = replay(env, *args, f"RUN_DIR={a}", "debug_interrupt_after=5", "warm_copy=true")
    assert p.returncode == 130, p.out
    assert manifest(a)["status"] == "interrupted"
    assert len(requests_table(a)) == 5
    assert f"resume=true RUN_DIR={a}" in p.out
    p = replay(env, "resume=true", f"RUN_DIR={a}")
    assert p.returncode == 0, p.out
    assert "5 already complete" in p.out
    assert "warm copy: warm = main" in p.out and set(manifest(a)["arms"]) == {"control", "candidate", "aa"}
    o = manifest(a)["arm_orders"]       # the resumed run imports and builds its arms as the first part did
    assert f"arm order: imported {', '.join(o['import'])}; built {', '.join(o['build'])}" in p.out, p.out
    assert manifest(a)["status"] == "complete"
    p = replay(env, *args, f"RUN_DIR={b}")
    assert p.returncode == 0, p.out
    assert "warm copy" not in p.out
    cols = ["request_id", "arm", "rep", "order", "n_steps", "n_tokens", "tokens_sha"]
    ta, tb = requests_table(a)[cols], requests_table(b)[cols]
    assert len(ta) == 2 * 3 * 2
    assert ta.equals(tb)
    from analysis import rawio

    assert rawio.read_run(a).problems == []


def test_refusals_are_clear_and_record_nothing(env, tmp_path):
    repo, root = env["repo"], env["root"]

    def refused(name, *args, code=2):
        run_dir = root / f"refused-{name}"
        p = replay(env, *args, f"RUN_DIR={run_dir}")
        assert p.returncode == code, p.out
        m = manifest(run_dir)
        assert m is None or m["status"] != "complete"
        return p.out

    out = refused("unknown", "control=main", "candidate=no-such-branch")
    assert "unknown revision 'no-such-branch'" in out and "Traceback" not in out

    out = refused("missing", "control=main", "candidate=extra-op", f"snapshots.store={tmp_path / 'empty'}",
                  "snapshots.auto_capture=false")
    assert "2 of 2 snapshots missing" in out and "auto_capture=true" in out
    from snapshots import traces

    data = SRC / "tests" / "data" / "claude_transcript.jsonl"
    traces.import_transcripts(data, "mini", store=tmp_path / "traces", skip_malformed=True, system_prompt=False)
    out = refused("missing-corpus", "control=main", "candidate=extra-op", "traces.name=mini",
                  f"traces.store={tmp_path / 'traces'}", f"snapshots.store={tmp_path / 'empty'}",
                  "snapshots.auto_capture=false")
    assert "python -m snapshots.capture model=q1-tiny traces=mini" in out

    out = refused("mismatch", "control=main", "candidate=tiny-theta")
    assert "model/snapshot mismatch for arm candidate" in out and "rope_theta" in out

    # a runtime change in the tree: HEAD alone is refused, WORKTREE replays it and records the diff
    _add_extra_op(repo)
    try:
        out = refused("dirty", "control=main", "candidate=extra-op")
        assert "uncommitted changes" in out and "runtime/model.py" in out and "WORKTREE" in out
        run_dir = root / "run-worktree"
        p = replay(env, "control=main", "candidate=WORKTREE", f"RUN_DIR={run_dir}")
        assert p.returncode == 0, p.out
        m = manifest(run_dir)
        assert m["status"] == "complete" and m["arms"]["candidate"]["rev"] == "WORKTREE"
        assert m["arms"]["candidate"]["sha"] == git(repo, "rev-parse", "HEAD")
        assert m["arms"]["control"]["dirty_diff"] is None
        diff = (run_dir / m["arms"]["candidate"]["dirty_diff"]).read_text()
        assert "+" + EXTRA_OP.rstrip("\n") in diff
    finally:
        git(repo, "checkout", "--", "runtime/model.py")


def test_mlflow_server_records_the_replay(env):
    pytest.importorskip("mlflow")
    server = env["server"]
    assert server.wait(), (env["root"] / "mlflow-server.log").read_text()[-3000:]
    run_dir = env["root"] / "run-tracked"
    p = replay(env, "control=main", "candidate=main", "candidate.runtime.draft.policy=fixed", f"RUN_DIR={run_dir}",
               "tracking.enabled=true", f"tracking.uri={server.uri}", "report=true")
    assert p.returncode == 0, p.out
    m = manifest(run_dir)
    assert m["mlflow"]["tracking_uri"] == server.uri
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    run = client.get_run(m["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    params, metrics = run.data.params, run.data.metrics
    assert params["arm.control.sha"] == git(env["repo"], "rev-parse", "main")
    assert params["arm.candidate.overrides"] == json.dumps({"runtime": {"draft": {"policy": "fixed"}}}, sort_keys=True)
    assert params["config.max_new_tokens"] == "8" and params["command"].startswith("python -m replay.paired")
    assert params["placement.epochs"] == "0"        # on the CPU, auto: the engines kept for the run
    assert params["analysis.arm_sd_floor"] == "0.0"  # on the CPU, auto: no arm-offset floor
    assert "environment.torch" in params
    assert metrics["arm.control.tpot_ms"] > 0 and "effect.tpot.pct" in metrics
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"manifest.json", "steps", "requests", "report"} <= names


def test_schedule_balances_arm_positions():
    from replay import schedule

    ids = [f"r{i}" for i in range(12)]
    plan = schedule.plan(ids, ["control", "candidate", "aa"], reps=2, seed=0)
    assert [d.order for d in plan] == list(range(72))
    assert {d.key for d in plan} == {(r, a, k) for r in ids for a in ("control", "candidate", "aa") for k in (0, 1)}
    for arm, counts in schedule.position_counts(plan).items():
        assert counts == [8, 8, 8], (arm, counts)          # 24 blocks: each arm 8x first, second, third
    other = schedule.plan(ids, ["control", "candidate", "aa"], reps=2, seed=1)
    assert [d.arm for d in other] != [d.arm for d in plan]


def test_shuffled_request_order_decouples_run_order_from_context():
    """request_order=shuffled: the requests (selected in context order, as spread and shortest give them)
    decode in an order drawn from the seed, the same for the same seed, every request and arm still once per
    rep and the arms still balanced; given (the negative control, and what a run recorded before the
    setting replays): run order is context order, so a drift would read as a context effect."""
    import scipy.stats

    from replay import paired, schedule

    ids = [f"r{i:02d}" for i in range(48)]          # r00 the shortest context ... r47 the longest
    arms = ["control", "candidate", "aa"]
    given = schedule.plan(ids, arms, reps=1, seed=0)
    shuffled = schedule.plan(ids, arms, reps=1, seed=0, shuffle_requests=True)

    def first_seen(plan):
        return list(dict.fromkeys(d.request_id for d in plan))
    assert first_seen(given) == ids
    assert sorted(first_seen(shuffled)) == ids and first_seen(shuffled) != ids
    assert {d.key for d in shuffled} == {d.key for d in given} and [d.order for d in shuffled] == list(range(144))
    assert shuffled == schedule.plan(ids, arms, reps=1, seed=0, shuffle_requests=True)      # a resume replans it
    assert first_seen(schedule.plan(ids, arms, reps=1, seed=1, shuffle_requests=True)) != first_seen(shuffled)
    for arm, counts in schedule.position_counts(shuffled).items():
        assert counts == [16, 16, 16], (arm, counts)
    rank = {r: k for k, r in enumerate(ids)}
    rho_given = scipy.stats.spearmanr(range(48), [rank[r] for r in first_seen(given)])[0]
    rho = scipy.stats.spearmanr(range(48), [rank[r] for r in first_seen(shuffled)])[0]
    assert rho_given == 1.0 and abs(rho) < 0.3, rho
    assert paired.request_order({}) == "given"                     # a manifest's config without the setting
    assert paired.request_order({"request_order": "Shuffled"}) == "shuffled"
    with pytest.raises(paired.ReplayError, match="request_order"):
        paired.request_order({"request_order": "by_context"})


def test_build_order_permutes_the_arms_and_refuses_anything_else():
    from replay import paired

    arms = {"control": "C", "candidate": "N", "aa": "A"}
    assert paired.build_order({}, arms) == ["C", "N", "A"]
    assert paired.build_order({"build_order": "aa,candidate,control"}, arms) == ["A", "N", "C"]
    assert paired.build_order({"build_order": ["candidate", "aa", "control"]}, arms) == ["N", "A", "C"]
    for bad in ("aa,control", "aa,aa,control", "aa,candidate,control,extra"):   # a missing, doubled, unknown arm
        with pytest.raises(paired.ReplayError, match="each of the arms"):
            paired.build_order({"build_order": bad}, arms)


def test_import_order_imports_the_arms_in_that_order(monkeypatch):
    """``import_order`` (a diagnostic like build_order: does an arm offset follow the position an arm is
    imported at?) permutes the imports and the arms dict; unset, the arms' own order; nonsense refused."""
    from replay import arms as armsmod
    from replay import paired

    labels = ["control", "candidate", "aa"]
    assert paired.arm_order({}, "import_order", labels) == labels
    for given in ("candidate,control,aa", "[candidate, control, aa]", ["candidate", "control", "aa"]):
        assert paired.arm_order({"import_order": given}, "import_order", labels) == ["candidate", "control", "aa"]
    with pytest.raises(paired.ReplayError, match="import_order"):
        paired.arm_order({"import_order": "candidate,control"}, "import_order", labels)
    imported = []
    monkeypatch.setattr(armsmod, "resolve", lambda repo, rev, cache, dirty_ok=False: armsmod.Revision(
        rev=rev, sha="0" * 40, key="0" * 40, root=Path("/nonexistent")))
    monkeypatch.setattr(armsmod, "import_runtime", lambda label, r: (imported.append(label) or (f"m_{label}", None)))
    revs = {"control": "main", "candidate": "b", "aa": "main"}
    got = armsmod.load_arms(Path("."), revs, {}, order=["candidate", "control", "aa"])
    assert imported == ["candidate", "control", "aa"] and list(got) == imported
    imported.clear()
    assert list(armsmod.load_arms(Path("."), revs, {})) == imported == labels       # the default


def test_random_arm_orders_are_drawn_per_run_and_a_resume_keeps_the_recorded_one():
    """``import_order=random`` / ``build_order=random`` draw every order of the arms (a bias of the first
    arm then falls on each arm alike over runs); a resumed run takes its manifest's record, and a run
    recorded before the record existed its config's orders."""
    import random

    from replay import paired

    labels = ["control", "candidate", "aa"]
    rng = random.Random(0)
    seen = {tuple(paired.arm_order({"import_order": "random"}, "import_order", labels, rng)) for _ in range(60)}
    assert len(seen) == 6, seen
    assert sorted(paired.arm_order({"build_order": "Random"}, "build_order", labels)) == sorted(labels)
    assert paired.arm_order({"import_order": None}, "import_order", labels) == labels     # null: the fixed order
    arms = {a: {} for a in labels}
    rec = {"import": ["aa", "control", "candidate"], "build": ["candidate", "aa", "control"]}
    order, cfg = paired.recorded_orders({"arms": arms, "arm_orders": rec, "config": {"import_order": "random"}},
                                        {"import_order": "random", "seed": 3})
    assert order == rec["import"] and cfg["build_order"] == rec["build"] and cfg["seed"] == 3
    built = paired.build_order(cfg, {a: a.upper() for a in order})
    assert built == ["CANDIDATE", "AA", "CONTROL"]
    legacy = {"arms": arms, "config": {"import_order": "[candidate,control,aa]"}}
    order, cfg = paired.recorded_orders(legacy, {"x": 1})
    assert order == ["candidate", "control", "aa"] and cfg == {"x": 1, "build_order": order}
    assert paired.recorded_orders({"arms": arms, "config": {}}, {})[0] == labels


def test_warm_copy_is_imported_built_and_run_before_every_arm(env, monkeypatch):
    """``warm_copy=true``: a throwaway copy of the control is imported first (here: the import calls in
    order), its engine built before every arm's and its decode run before the first fingerprint, and it is
    not an arm of the run (manifest, orders). A value other than true / false is refused."""
    from replay import arms as armsmod
    from replay import paired

    assert paired.warm_copy({}) is False and paired.warm_copy({"warm_copy": True}) is True
    with pytest.raises(paired.ReplayError, match="warm_copy"):
        paired.warm_copy({"warm_copy": "maybe"})
    imported = []
    monkeypatch.setattr(armsmod, "resolve", lambda repo, rev, cache, dirty_ok=False: armsmod.Revision(
        rev=rev, sha="0" * 40, key="0" * 40, root=Path("/nonexistent")))
    monkeypatch.setattr(armsmod, "import_runtime", lambda label, r: (imported.append(label) or (f"m_{label}", None)))
    revs = {"control": "main", "candidate": "b", "aa": "main", paired.WARM: "main"}
    armsmod.load_arms(Path("."), revs, {}, order=[paired.WARM, "aa", "control", "candidate"])
    assert imported == ["warm", "aa", "control", "candidate"]

    run_dir = env["root"] / "run-warm"
    p = replay(env, "control=main", "candidate=main", "allow_identical=true", "warm_copy=true", f"RUN_DIR={run_dir}")
    assert p.returncode == 0, p.out
    lines = p.out.splitlines()
    warm = [i for i, x in enumerate(lines) if x.startswith("warm copy: warm = main")]
    built = [i for i, x in enumerate(lines) if re.match(r"(control|candidate|aa) = main @ \S+: module", x)]
    fp = [i for i, x in enumerate(lines) if x.startswith("candidate vs control")]
    assert len(warm) == 2 and len(built) == 3 and fp, p.out
    assert warm[0] < built[0] and warm[1] < fp[0], p.out     # built before the arms, run before the fingerprints
    assert "module iquestrt_arm_warm_" in lines[warm[0]]
    m = manifest(run_dir)
    assert m["status"] == "complete" and m["config"]["warm_copy"] is True
    assert set(m["arms"]) == {"control", "candidate", "aa"} and sorted(m["arm_orders"]["import"]) == \
        ["aa", "candidate", "control"]


def test_arm_sd_floor_auto_follows_the_device_and_refuses_nonsense():
    from replay import paired

    assert paired.arm_sd_floor({}, cuda=False) == 0.0
    assert paired.arm_sd_floor({"arm_sd_floor": "auto"}, cuda=True) == paired.GPU_ARM_SD_FLOOR > 0
    assert paired.arm_sd_floor({"arm_sd_floor": 0.002}, cuda=False) == 0.002
    assert paired.arm_sd_floor({"arm_sd_floor": "0"}, cuda=True) == 0.0          # a GPU run may opt out
    for bad in (-0.001, "wide", float("inf")):
        with pytest.raises(paired.ReplayError, match="arm_sd_floor"):
            paired.arm_sd_floor({"arm_sd_floor": bad}, cuda=True)


def test_step_times_of_a_revision_without_start_stamps_are_derived_from_durations():
    from types import SimpleNamespace

    from replay import rawout

    steps = [{"step": i, "width": 4, "drafts": 3, "next_drafts": 3, "accepted": 1, "emitted": 2,
              "tokens": [5, 6]} for i in range(3)]
    old = SimpleNamespace(steps=steps, step_ns=[100, 200, 300], tokens=[5, 6] * 3)   # no step_t0_ns
    rows, req = rawout.decode_rows(old, "r", "control", 0, 7, 50, 1, t_call_ns=1_000, decode_ns=650)
    t0 = [r["t_start_ns"] - rawout.CLOCK_OFFSET_NS for r in rows]
    assert t0 == [1_000, 1_100, 1_300] and [r["t_end_ns"] - r["t_start_ns"] for r in rows] == [100, 200, 300]
    assert [r["warmup"] for r in rows] == [True, False, False]
    assert req["n_steps"] == 3 and req["n_tokens"] == 6 and req["tokens_sha"] == rawout.tokens_sha([5, 6] * 3)
    new = SimpleNamespace(steps=steps, step_ns=[100, 200, 300], step_t0_ns=[10, 500, 900], tokens=[5, 6] * 3)
    rows, _ = rawout.decode_rows(new, "r", "control", 0, 7, 50, 1, t_call_ns=1_000, decode_ns=650)
    assert [r["t_start_ns"] - rawout.CLOCK_OFFSET_NS for r in rows] == [10, 500, 900]
    # the loop's host time: recorded where the Generation has it, -1 for a revision without it
    assert req["loop_ns"] == -1
    new.loop_ns = 640
    assert rawout.decode_rows(new, "r", "control", 0, 7, 50, 1, t_call_ns=1_000, decode_ns=650)[1]["loop_ns"] == 640


def test_fingerprint_records_triton_launches_only_while_installed():
    """The Triton launch hook of the fingerprint (GPU launches call it; here it is called the way
    Triton's launcher calls it, with a LazyDict): a launch inside the ``with`` is recorded with its
    description, one after it is not (negative control: a hook left installed would leak records
    into every later trace), and the hook chain is left as it was."""
    from triton import knobs
    from triton.compiler.compiler import LazyDict

    from replay.fingerprint import TritonRecorder

    def launch(name, sig):
        md = LazyDict({"name": name, "function": 0, "stream": 0})
        md.add(lambda: {"signature": sig}, ())
        knobs.runtime.launch_enter_hook(md)

    before = list(knobs.runtime.launch_enter_hook.calls)
    ops: list[str] = []
    with TritonRecorder(ops):
        launch("_k1", "grid=(2, 1, 1) pdl=True W=6")
    launch("_k2", "grid=(1, 1, 1)")
    assert ops == ["triton:_k1(grid=(2, 1, 1) pdl=True W=6)"]
    assert knobs.runtime.launch_enter_hook.calls == before
