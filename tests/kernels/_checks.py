"""Shared error measures for the kernel tests (a check returns a number; tests compare it with a
tolerance, and each negative control must exceed the same tolerance)."""
from __future__ import annotations

import math

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has a non-finite element."""
    if not torch.isfinite(out).all():
        return math.inf
    o = out.double()
    r = ref.double().to(o.device)
    return ((o - r).norm() / r.norm()).item()


def max_row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over leading indices of ||out[..., :] - ref[..., :]|| / ||ref[..., :]|| (last dim)."""
    if not torch.isfinite(out).all():
        return math.inf
    o = out.double()
    r = ref.double().to(o.device)
    return ((o - r).norm(dim=-1) / r.norm(dim=-1)).max().item()
