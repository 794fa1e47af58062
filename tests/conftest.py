import dataclasses
import functools
import importlib
import os

import pytest
import torch

from runtime.checkpoint import random_tensors
from runtime.config import TPConfig, load_model_config, runtime_config_from_dict
from runtime.engine import Engine

torch.set_num_threads(1)  # decode shapes are tiny: threads only add contention


# Modules whose longest CPU test is long (seconds on a 2-core sandbox like the CI host, session 52: 167,
# 136 / 76 / 52 / 48 / 39 / 28 / 25), in that order. They run first, each kept whole (their module-scoped
# fixtures are set up once), so that no long test starts at the end of the run while the other worker idles:
# under ``--dist worksteal`` a worker steals from the end of another's queue, which then holds short tests.
LONG_FIRST = ("test_tp2_fast.py", "test_stats.py", "test_replay.py", "test_fast_backend.py", "test_speculative.py",
              "test_verdict.py", "kernels/test_moe.py")


def long_first_key(nodeid: str) -> int:
    path = nodeid.split("::", 1)[0]
    return next((i for i, m in enumerate(LONG_FIRST) if path.endswith("tests/" + m)), len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: long_first_key(item.nodeid))   # (stable: the rest keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_cfg(**changes):
    return dataclasses.replace(load_model_config("q1-tiny"), **changes).validate()


@functools.lru_cache(maxsize=8)
def _tensors(cfg, seed, tp_size=1, tp_rank=0):
    return dict(random_tensors(cfg, TPConfig(size=tp_size, rank=tp_rank), seed=seed))


def make_engine(cfg=None, seed=0, **runtime):
    """An engine over a seeded random checkpoint (tensors cached across tests)."""
    cfg = cfg or tiny_cfg()
    rt = runtime_config_from_dict(runtime)
    return Engine(cfg, rt, _tensors(cfg, seed, rt.tp.size, rt.tp.local_rank))


@pytest.fixture(scope="session")
def tiny_engine():
    return make_engine(draft={"policy": "fixed", "fixed_depth": 5})


@pytest.fixture(scope="session")
def small_vocab_engine():
    """32-token vocabulary: random target and draft distributions overlap, so drafts are accepted
    often enough to exercise every branch of the round."""
    return make_engine(tiny_cfg(vocab_size=32, num_layers=2, layer_pattern=("sliding", "full")),
                       draft={"policy": "fixed", "fixed_depth": 5})


# the kernel modules runtime.fast calls (the ``interp`` fixture re-executes any imported under the compiler)
KERNEL_MODULES = ("attention", "moe", "norm", "sampler", "linear", "uniform", "rope", "router", "round_state")


@pytest.fixture(scope="module")
def interp():
    """CPU: the kernels in the Triton interpreter (TRITON_INTERPRET=1 and the shims set up at import by
    the test module that asks for this); kernel modules imported earlier under the compiler are
    re-executed in place so that runtime.fast sees interpreted ones."""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(std.cdiv, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 in this process")
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"runtime.kernels.{name}")
        jitted = [v for v in vars(mod).values() if hasattr(v, "fn") and hasattr(v, "arg_names")]
        if any(not isinstance(v, InterpretedFunction) for v in jitted):
            importlib.reload(mod)
