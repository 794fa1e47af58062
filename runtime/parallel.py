"""Tensor-parallel communication, passed explicitly to the model (no process-global state).

- :class:`LocalComm`: one rank, nothing to do.
- :class:`EmulatedComm`: rank emulation (``tp.emulate_rank``): one rank's shard and shapes on one
  device; every collective is a local no-op whose would-be traffic is counted and reported as excluded.
- :class:`TorchDistComm`: ``torch.distributed`` (NCCL on GPUs, gloo on CPU) over the default group.

``peer_exchange`` builds the fused path's exchange (``runtime/kernels/peer.py``: NaN-armed buffers
that the ranks' kernels read from each other, the all-reduce inside the norm's kernel): real ranks
open each other's buffers through CUDA IPC (peer-to-peer loads over NVLink between GPUs; never
multicast); rank emulation reads static zero buffers in the peers' place.
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

    def peer_exchange(self, rows: int, width: int, device, timeout_s: float | None = None):
        """The fused all-reduce's :class:`~runtime.kernels.peer.PeerExchange` of this rank."""
        raise ValueError("the fused all-reduce (tp.fused_allreduce) needs tensor parallelism: tp.size > 1")


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

    def peer_exchange(self, rows: int, width: int, device, timeout_s: float | None = None):
        """This rank's buffer and the protocol in full; every peer's buffer a static zero one (its
        loads are made, never waited for; the traffic between GPUs is what emulation excludes)."""
        from .kernels import peer
        return peer.PeerExchange.emulated(self.size, self.rank, rows, width, device,
                                          peer.TIMEOUT_S if timeout_s is None else timeout_s)


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

    def peer_exchange(self, rows: int, width: int, device, timeout_s: float | None = None):
        """Every rank allocates its buffer on its own GPU and shares it through a CUDA IPC handle
        (exchanged over this group); a peer's buffer on another GPU is then read peer-to-peer, one on
        the same GPU (ranks sharing a device) directly. A collective: every rank must call it."""
        from .kernels import peer
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError("the fused all-reduce between processes needs CUDA (its buffers are shared "
                             f"through CUDA IPC); this rank's device is {device}")
        own = peer.PeerExchange.new_buffer(rows, width, device)
        torch.cuda.synchronize(device)      # armed before any peer can read it
        handles = [None] * self.size
        self._dist.all_gather_object(handles, own.untyped_storage()._share_cuda_(), group=self.group)
        bufs, keep = [], []
        for q, h in enumerate(handles):
            if q == self.rank:
                bufs.append(own)
                continue
            with torch.cuda.device(device):
                st = torch.UntypedStorage._new_shared_cuda(*h)
            keep.append(st)
            bufs.append(torch.empty(0, dtype=own.dtype, device=st.device).set_(
                st, 0, own.shape, own.stride()))
        xchg = peer.PeerExchange(bufs, self.rank, peer.TIMEOUT_S if timeout_s is None else timeout_s, keep=keep)
        torch.cuda.synchronize(device)
        self._dist.barrier(group=self.group)   # every rank's buffer armed and opened
        return xchg


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
