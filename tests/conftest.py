import dataclasses
import functools

import pytest
import torch

from runtime.checkpoint import random_tensors
from runtime.config import TPConfig, load_model_config, runtime_config_from_dict
from runtime.engine import Engine

torch.set_num_threads(1)  # decode shapes are tiny: threads only add contention


def pytest_collection_modifyitems(config, items):
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
