"""The run order of a paired replay. Decides; runs nothing.

Every (request, arm, rep) is one decode. Per request the arms run back to back, in one of the
permutations of the arms (6 for control/candidate/aa): the permutations are shuffled once with the
seed and then rotated across requests (and shifted by one per repetition), so over any block of
6 consecutive requests every arm runs first, second and third equally often and slow drifts of the
machine fall on every arm alike. Repetitions are the outer loop (all requests, then again).

The requests themselves run in the order given, or (``shuffle_requests``, replay.paired's
``request_order=shuffled``, the default since session 58) in one drawn from the seed: a selection comes
sorted by context length, and decoded in that order a drift of the machine over the run reads as a
dependence on context (session 58's first-arm penalty sat in the longest requests, which were also the
last).

``order`` is the global index of a decode in this plan; it is fixed by (requests, arms, reps,
seed, shuffle), so a resumed run gives a redone decode the same order it had in the interrupted one.
"""
from __future__ import annotations

import dataclasses
import itertools
import random


@dataclasses.dataclass(frozen=True)
class Decode:
    order: int
    request_id: str
    arm: str
    rep: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.request_id, self.arm, self.rep)


def permutations(arms: list[str] | tuple[str, ...], seed: int) -> list[tuple[str, ...]]:
    perms = list(itertools.permutations(arms))
    random.Random(f"replay-schedule:{seed}").shuffle(perms)
    return perms


def plan(request_ids: list[str], arms: list[str] | tuple[str, ...], reps: int, seed: int,
         shuffle_requests: bool = False) -> list[Decode]:
    """The decodes in run order. ``shuffle_requests``: the requests decoded in an order drawn from the seed
    rather than as given (a selection sorted by context would otherwise make run order, and any drift of
    the machine along it, indistinguishable from context length)."""
    if reps < 1:
        raise ValueError(f"reps={reps}: at least one repetition is needed")
    if not request_ids:
        raise ValueError("no requests to replay")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError("request ids repeat")
    if shuffle_requests:
        request_ids = list(request_ids)
        random.Random(f"replay-requests:{seed}").shuffle(request_ids)
    perms = permutations(arms, seed)
    out: list[Decode] = []
    for rep in range(reps):
        for i, rid in enumerate(request_ids):
            for arm in perms[(i + rep) % len(perms)]:
                out.append(Decode(len(out), rid, arm, rep))
    return out


def position_counts(decodes: list[Decode]) -> dict[str, list[int]]:
    """How often each arm ran first, second, ... within its request's block (balance check)."""
    counts: dict[str, list[int]] = {}
    block: dict[tuple[str, int], int] = {}
    for d in decodes:
        pos = block.get((d.request_id, d.rep), 0)
        block[(d.request_id, d.rep)] = pos + 1
        c = counts.setdefault(d.arm, [])
        c.extend([0] * (pos + 1 - len(c)))
        c[pos] += 1
    return counts
