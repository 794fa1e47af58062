"""Bad input is a clear error naming what is wrong."""
import subprocess
import sys

import pytest

from runtime.config import ConfigError, load_model_config, runtime_config_from_dict
from runtime.engine import RequestError


def test_unknown_model_lists_known_ones():
    with pytest.raises(ConfigError, match=r"unknown model 'q9'.*q1-mini"):
        load_model_config("q9")


def test_bad_runtime_settings():
    with pytest.raises(ConfigError, match="draft.policy"):
        runtime_config_from_dict({"draft": {"policy": "greedy"}})
    with pytest.raises(ConfigError, match="unknown keys in runtime.draft"):
        runtime_config_from_dict({"draft": {"depth": 3}})
    with pytest.raises(ConfigError, match="fixed_depth"):
        runtime_config_from_dict({"draft": {"policy": "fixed", "fixed_depth": 9}})


def test_request_errors(tiny_engine):
    with pytest.raises(RequestError, match="budget max_new_tokens=0"):
        tiny_engine.generate([1, 2, 3], max_new_tokens=0)
    with pytest.raises(RequestError, match="max_context=4096"):
        tiny_engine.generate([1] * 4090, max_new_tokens=10)
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.generate([], max_new_tokens=10)
    with pytest.raises(RequestError, match="outside"):
        tiny_engine.generate([1, 600], max_new_tokens=10)


def test_generate_cli_runs_and_reports(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runtime.generate", "model=q1-tiny", "seed=0", "max_new_tokens=12"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "mean tokens per step" in r.stdout and "width" in r.stdout
    r = subprocess.run([sys.executable, "-m", "runtime.generate", "model=nope"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "model/nope" in r.stderr
    r = subprocess.run([sys.executable, "-m", "runtime.generate", "model=q1-tiny", "max_new_tokens=0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "max_new_tokens=0" in r.stderr
