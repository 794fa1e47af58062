"""Small helpers shared by the Triton kernels in this package (host side, plus one jit helper).

Nothing here holds state beyond per-module caches of device properties (keyed by device index), so
two copies of the package can be imported side by side.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


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


def cached_counters(cache: dict, device: torch.device, n: int, what: str, min_size: int = 16) -> torch.Tensor:
    """An int32 zero buffer of at least ``n`` entries for ``device``, kept in ``cache`` (a dict owned by
    the caller's function, so two imported copies of this package keep separate buffers). Kernels
    that take tickets on it re-zero what they use, so stream-ordered calls, graph replays included,
    share one buffer. It is created (torch.zeros) on first use, which must not be inside a CUDA-graph
    capture; ``what`` names the caller in that error."""
    key = (device.type, device.index if device.index is not None else
           (torch.cuda.current_device() if device.type == "cuda" else -1))
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        check(not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()),
              f"{what}: first call inside a CUDA-graph capture; call it once eagerly first")
        buf = cache[key] = torch.zeros(max(n, min_size), dtype=torch.int32, device=device)
    return buf


def check(cond: bool, msg: str) -> None:
    """Host-side argument check (shapes, dtypes, devices only: never a device value)."""
    if not cond:
        raise ValueError(msg)


def check_rows_by_weight(x, w, max_rows: int, names: str = "x [M, K], w [N, K]") -> tuple[int, int, int]:
    """(M, K, N) of a BF16 x [M, K] (1 <= M <= max_rows) against a BF16 weight w [N, K], both with
    contiguous rows on one device (a decode-round product: the router, the projections)."""
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], names)
    check(x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16, f"{names}: both in BF16")
    check(x.stride(1) == 1 and w.stride(1) == 1, f"{names}: contiguous rows")
    check(x.device == w.device, f"{names}: on one device")
    check(1 <= x.shape[0] <= max_rows, f"{names}: 1 to {max_rows} rows")
    return x.shape[0], x.shape[1], w.shape[0]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compiled_cuda(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled on a CUDA GPU (not under the Triton interpreter,
    which has no inline PTX)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependents (griddepcontrol):
    CUDA devices of compute capability 9.0 or later, not under the Triton interpreter."""
    if not compiled_cuda(device):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


# CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT of the CUDA driver API
_CARVEOUT_ATTR = 9


@functools.lru_cache(maxsize=1)
def _libcuda():
    import ctypes
    return ctypes.CDLL("libcuda.so.1")


def set_function_carveout(function: int, percent: int) -> None:
    """The preferred shared-memory carveout of a loaded kernel function (a CUfunction handle):
    percent of the SM's largest shared-memory configuration, or -1 for the driver's default. The
    driver takes the configuration at or above it; it holds while a block of the function is
    resident, so it caps how many of the function's blocks share an SM. A CUDA graph keeps the
    carveout its kernels were captured with."""
    import ctypes
    rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(_CARVEOUT_ATTR),
                                       ctypes.c_int(int(percent)))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(carveout {percent}) failed: CUresult {rc}")


def function_carveout(function: int) -> int:
    """The preferred carveout set on a loaded kernel function (-1: none, the driver's default)."""
    import ctypes
    out = ctypes.c_int(0)
    rc = _libcuda().cuFuncGetAttribute(ctypes.byref(out), ctypes.c_int(_CARVEOUT_ATTR), ctypes.c_void_p(function))
    if rc != 0:
        raise RuntimeError(f"cuFuncGetAttribute(carveout) failed: CUresult {rc}")
    return out.value


def launch_carved(jit_fn, grid, args: tuple, kw: dict, percent: int | None, functions: dict):
    """``jit_fn[grid](*args, **kw)`` with the compiled function's preferred shared-memory carveout at
    ``percent`` (``set_function_carveout``; None: launch as is). The carveout is set before every
    launch (a driver call, no synchronisation: whatever else set it since, this launch and a graph
    capturing it get ``percent``), the first launch of each compiled variant included: that variant is
    compiled and loaded through ``jit_fn.warmup`` first, so a CUDA graph captured even on the first
    call keeps it. ``functions`` (launch key -> CUfunction) is a dict owned by the caller's module,
    so two imported copies of this package keep their own (their kernels are distinct functions).
    Under the interpreter the launch is plain. Returns the compiled kernel."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    if percent is None or not compiled_cuda(dev):
        return jit_fn[grid](*args, **kw)
    key = (dev.index if dev.index is not None else torch.cuda.current_device(),
           tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args),
           tuple((k, (v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else v)
                 for k, v in kw.items()))
    fn = functions.get(key)
    if fn is None:
        k = jit_fn.warmup(*args, grid=grid, **kw)
        k._init_handles()   # loads the module: the function exists before its first launch
        fn = functions[key] = k.function
    set_function_carveout(fn, percent)
    k = jit_fn[grid](*args, **kw)
    if k.function != fn:   # specialised otherwise than the warm-up: carved from its next launch on
        functions[key] = k.function
    return k


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (sm_80+ PTX; no register written, nothing waited
    for, no value returned: a prefetch can never hand a kernel stale data)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def launch_signature(grid, metadata, args) -> dict:
    """Triton ``launch_metadata`` of every kernel here: a description of the launch that is the same
    for the same code and shapes in any copy of this package (grid, warps, stages, programmatic
    launch, and every scalar argument: constexprs, strides, sizes; never a pointer or a value read
    on the device). Triton computes it only for launch hooks: the harness's fingerprint installs
    one while it traces a step, so that a change in a Triton launch (an option, a constexpr, a
    grid) counts as different step work."""
    scalars = " ".join(f"{k}={v!r}" for k, v in sorted(args.items())
                       if isinstance(v, (bool, int, float, str)) and not isinstance(v, type(None)))
    return {"signature": f"grid={tuple(grid)} warps={metadata.num_warps} stages={metadata.num_stages} "
                         f"pdl={bool(getattr(metadata, 'launch_pdl', False))} {scalars}"}
