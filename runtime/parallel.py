"""Tensor-parallel communication, passed explicitly to the model (no process-global state).

- :class:`LocalComm`: one rank, nothing to do.
- :class:`EmulatedComm`: rank emulation (``tp.emulate_rank``): one rank's shard and shapes on one
  device; every collective is a local no-op whose would-be traffic is counted and reported as excluded.
- :class:`TorchDistComm`: ``torch.distributed`` (NCCL on GPUs, gloo on CPU) over the default group.
"""
from __future__ import annotations

import torch


class LocalComm:
    size = 1
    rank = 0
    emulated = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[participants, *x.shape]; participants is 1 without peers."""
        return x.unsqueeze(0)


class EmulatedComm(LocalComm):
    """One rank of ``size`` emulated: shapes are a real rank's, collectives are excluded no-ops."""

    emulated = True

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank
        self.excluded_bytes = 0
        self.excluded_calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Counting uses shapes only (host-known), never tensor values.
        self.excluded_calls += 1
        self.excluded_bytes += 2 * (self.size - 1) * x.numel() * x.element_size() // self.size
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.excluded_calls += 1
        self.excluded_bytes += (self.size - 1) * x.numel() * x.element_size()
        return x.unsqueeze(0)


class TorchDistComm(LocalComm):
    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(out, x.contiguous(), group=self.group)   # list form: NCCL and gloo alike
        return torch.stack(out)


def make_comm(tp) -> LocalComm:
    if tp.size == 1:
        return LocalComm()
    if tp.emulate_rank is not None:
        return EmulatedComm(tp.size, tp.emulate_rank)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"tp.size={tp.size} without emulation needs torch.distributed initialised "
                           "(launch with torchrun) or tp.emulate_rank=<rank>")
    return TorchDistComm()
