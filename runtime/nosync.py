"""A mode that raises on host synchronisation, so "the step reads nothing on the host" is checkable.

Inside :func:`forbid_host_sync`, any operation that needs a tensor value on the host raises
:class:`HostSyncError`: ``.item()``, ``bool()/int()/float()`` of a tensor (Python branches on tensor
values), ``.tolist()``, ``.numpy()``, copies from a CUDA tensor to the CPU, and operators whose
output shape depends on tensor values (``nonzero``, boolean-mask indexing, ``unique``, ...). On CUDA,
torch's own sync debug mode is raised to "error" as well.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(RuntimeError):
    """The step tried to read a device value on the host."""


_ATEN_FORBIDDEN = {
    "aten::_local_scalar_dense": "a tensor value read on the host (.item(), bool(), int(), float())",
    "aten::nonzero": "nonzero (output shape depends on values)",
    "aten::nonzero_static": None,
    "aten::masked_select": "masked_select (output shape depends on values)",
    "aten::unique_dim": "unique (output shape depends on values)",
    "aten::_unique2": "unique (output shape depends on values)",
    "aten::unique_consecutive": "unique_consecutive (output shape depends on values)",
    "aten::repeat_interleave.Tensor": "repeat_interleave with tensor repeats (shape depends on values)",
}

_FUNC_FORBIDDEN = {"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}


class _DispatchGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        overload = f"{name}.{func._overloadname}" if func._overloadname != "default" else name
        why = _ATEN_FORBIDDEN.get(overload, _ATEN_FORBIDDEN.get(name))
        if why:
            raise HostSyncError(f"host synchronisation inside the step: {why} [{overload}]")
        if name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in (args[1] if len(args) > 1 else []) if i is not None):
            raise HostSyncError("host synchronisation inside the step: boolean-mask indexing")
        if name in ("aten::_to_copy", "aten::copy_"):
            src = args[1] if name == "aten::copy_" else args[0]
            dst_dev = (args[0].device if name == "aten::copy_" else kwargs.get("device")) if kwargs is not None else None
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_dev is not None \
                    and torch.device(dst_dev).type == "cpu":
                raise HostSyncError("host synchronisation inside the step: device-to-host copy")
        return func(*args, **(kwargs or {}))


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _FUNC_FORBIDDEN:
            raise HostSyncError(f"host synchronisation inside the step: Tensor.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_host_sync():
    """Run a block under the guard; raises HostSyncError at the first host read."""
    cuda = torch.cuda.is_available()
    prev = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _FunctionGuard(), _DispatchGuard():
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(prev)
