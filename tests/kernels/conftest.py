"""Kernel tests: GPU tests (``@pytest.mark.gpu``, skipped without CUDA) and CPU tests that run the
same Triton kernels in the interpreter (``TRITON_INTERPRET=1``, only on machines without CUDA).

On a machine without CUDA this conftest sets TRITON_INTERPRET=1 before the kernel modules are used
and installs the interpreter shims of ``_interp.py``; ``load_kernels`` re-executes a kernel module
whose kernels were created before the variable was set (so they are interpreted).
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from . import _interp

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    _interp.install()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def load_kernels(name: str):
    """Import runtime.kernels.<name>; on CPU make sure its kernels are interpreted ones."""
    mod = importlib.import_module(f"runtime.kernels.{name}")
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        jitted = [v for v in vars(mod).values() if hasattr(v, "fn") and hasattr(v, "arg_names")]
        if any(not isinstance(v, InterpretedFunction) for v in jitted):
            mod = importlib.reload(mod)
    return mod


cpu_only = pytest.mark.skipif(
    HAS_CUDA, reason="interpreter tests run where there is no CUDA; the GPU tests cover the same checks")
