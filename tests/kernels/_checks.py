"""Shared error measures for the kernel tests (a check returns a number; tests compare it with a
tolerance, and each negative control must exceed the same tolerance), and the attempts of a race's
negative control."""
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


def captured(run):
    """``run()`` once eagerly (Triton compiles outside the capture), then captured in a CUDA graph."""
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


# A race's negative control (a launch without its griddepcontrol.wait, reading what the kernel before
# it has not written yet) can only show that the check catches the race when the race happens. On a
# GPU shared by several test processes (pytest-xdist workers on one device time-slice it) one attempt
# may run with the two launches apart; so the control is existential: caught in one of RACE_ATTEMPTS
# attempts. The right variant is still checked in every replay of every attempt it makes.
RACE_ATTEMPTS = 8


def first_catch(attempt, attempts: int = RACE_ATTEMPTS):
    """Calls ``attempt()`` (True: the broken variant was caught) until it returns True: the 1-based
    number of that attempt, or None when all ``attempts`` missed."""
    for i in range(attempts):
        if attempt():
            return i + 1
    return None
