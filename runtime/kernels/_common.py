"""Small host-side helpers shared by the Triton kernels in this package.

Nothing here holds state beyond per-module caches of device properties (keyed by device index), so
two copies of the package can be imported side by side.
"""
from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device, cpu_default: int = 4) -> int:
    """Multiprocessor count of a CUDA device (a host-side property query, no synchronisation).

    On the CPU (Triton interpreter) a small number is returned so interpreted grids stay cheap.
    """
    if device.type != "cuda":
        return cpu_default
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def check(cond: bool, msg: str) -> None:
    """Host-side argument check (shapes, dtypes, devices only: never a device value)."""
    if not cond:
        raise ValueError(msg)
