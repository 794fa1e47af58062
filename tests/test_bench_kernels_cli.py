"""experiments/bench_kernels.py as a command (CPU, ``--dry-run``: the Triton interpreter at toy shapes; its
timings mean nothing): ``--only`` is checked before any work, and a run cut off by SIGTERM (what ``timeout``
sends) keeps the kernels it finished, marked partial, while an uninterrupted run is marked complete."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "experiments", "bench_kernels.py")
REPORT = os.path.join(HERE, "..", "experiments", "kernel_report.py")


def _run(tmp_path, *args, env_extra=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "BENCH_KERNELS_SIGTERM_AFTER"}
    env.update(OUT=str(tmp_path), PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.run([sys.executable, SCRIPT, "--dry-run", "--no-sweep", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("only, message", [
    ("norm,attn", "unknown kernel(s) attn; choose from attention, moe,"),
    ("norm,norm", "a kernel named twice"),
    (",", "unknown kernel(s) (none given)"),
])
def test_only_is_checked_before_any_work(tmp_path, only, message):
    p = _run(tmp_path, "--only", only)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr
    assert "copy bandwidth" not in p.stdout      # refused before the copy probe and any kernel
    assert not (tmp_path / "bench_kernels.json").exists()


def _payload(tmp_path):
    with open(tmp_path / "bench_kernels.json") as f:
        return json.load(f)


def test_sigterm_keeps_the_finished_kernels_marked_partial(tmp_path):
    p = _run(tmp_path, "--only", "norm,uniform", env_extra={"BENCH_KERNELS_SIGTERM_AFTER": "norm"})
    assert p.returncode == 143, p.stdout[-2000:] + p.stderr[-2000:]
    payload = _payload(tmp_path)
    env = payload["env"]
    assert env["status"].startswith("interrupted by SIGTERM"), env["status"]
    assert env["kernels"] == ["norm", "uniform"] and env["kernels_done"] == ["norm"]
    kernels = {r["kernel"] for r in payload["rows"]}
    assert kernels == {"norm"}
    assert "PARTIAL RUN (interrupted by SIGTERM" in p.stdout and "not finished: uniform" in p.stdout
    assert "norm H256_w8 faster than reference" in p.stdout       # the measured kernel's goals are still reported
    # kernel_report re-reads the saved run and says it is partial
    r = subprocess.run([sys.executable, REPORT, str(tmp_path), "--no-figures"], capture_output=True, text=True,
                       timeout=120)
    assert "PARTIAL RUN (interrupted by SIGTERM" in r.stdout, r.stdout + r.stderr


def test_uninterrupted_run_is_complete(tmp_path):
    """The negative control of the test above: the same command without the signal runs both kernels and
    is not marked partial."""
    p = _run(tmp_path, "--only", "norm,uniform")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    env = _payload(tmp_path)["env"]
    assert env["status"] == "complete" and env["kernels_done"] == ["norm", "uniform"]
    assert {r["kernel"] for r in _payload(tmp_path)["rows"]} == {"norm", "uniform"}
    assert "PARTIAL RUN" not in p.stdout
    r = subprocess.run([sys.executable, REPORT, str(tmp_path), "--no-figures"], capture_output=True, text=True,
                       timeout=120)
    assert "PARTIAL RUN" not in r.stdout and "rows;" in r.stdout, r.stdout + r.stderr
