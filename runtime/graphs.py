"""The captured execution: the round's pieces as CUDA graphs, replayed by the engine's host loop.

DESIGN.md, "One step function, three executions": eager, **captured** (this module), and the device
loop (``runtime/devloop.py``: these graphs cloned into one parent graph with conditional nodes). Per
request, after the restore or the prefill and the first drafts, each piece the request can run is
captured once, at every width or depth it can take:

  verify[w]   ``rnd.verify(st, w)``                                     w = 1 + drafts
  draft[w]    ``rnd.draft_first(st, w)``, then ``draft_next(st, k)`` for k = 2..min_depth
  depth[k]    ``rnd.draft_next(st, k)``                                 k = min_depth+1..max depth

The host loop (``Engine.decode``) reads the same three control values at the same points as the
eager loop (the width before verify, ``done`` after it, ``cont`` before each extra depth) and
replays the piece's graph where the eager loop calls the piece. So a captured decode launches the
eager decode's work in the eager decode's order: the same tokens and the same result log, bit for
bit (``tests/test_graphs.py``). What it removes is the host's per-launch cost (Python, the
dispatcher, Triton's launcher), which on a GPU is most of an eager step.

Graphs hold the addresses of the request's own state and caches, hence one set per request. Before
capturing, every piece runs once eagerly (Triton compiles; workspaces and cuBLAS handles are created on
first use, which must not happen inside a capture): for each width, from the request's own state, a
whole step as a real one would run it (verify, its drafts, every extra depth), after which the decode
state is put back. After the capture each graph is replayed once the same way (a graph's first launch
uploads it). On the H200 this costs q1-mini ~0.23-0.27 s per request and q1 1.6 s (session 53),
outside the steps' times. (The device loop keeps its graphs across requests: ``devloop.LoopSlot``.)
The caches are not put back: the warm-up writes K/V rows only at positions past the state's start
(target) or its start + 1 (draft layer), which every real step writes again before any row can read
them, just as the eager loop leaves a rejected draft's rows behind.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import fields

import torch

def resolve_execution(execution: str, device: torch.device, capturable_comm: bool,
                      device_loop: str | None = None) -> str:
    """``auto``: the device loop (``devloop.py``) on a CUDA device when the collectives can be captured
    (one rank, or rank emulation), the captured execution there if the device loop cannot run here
    (``device_loop``: why not, e.g. no cuda-python), else eager. ``captured`` or ``device`` without
    CUDA, and ``device`` where it cannot run, are configuration errors."""
    if execution == "auto":
        if device.type != "cuda" or not capturable_comm:
            return "eager"
        return "device" if device_loop is None else "captured"
    if execution in ("captured", "device") and device.type != "cuda":
        raise ValueError(f"runtime.execution={execution} needs a CUDA device (this engine is on {device}); "
                         "use runtime.execution=eager or auto")
    if execution == "device" and device_loop is not None:
        raise ValueError(f"runtime.execution=device cannot run here: {device_loop}; "
                         "use runtime.execution=captured or auto")
    return execution


def reachable(draft) -> tuple[list[int], list[int]]:
    """(widths, extra depths) a decode under this draft policy can take: widths 1 + drafts, drafts in
    [min_depth, max_depth] (the fixed policy: fixed_depth); extra depths min_depth+1 up to the last."""
    if draft.policy == "fixed":     # every round drafts exactly fixed_depth
        return [draft.fixed_depth + 1], list(range(draft.min_depth + 1, draft.fixed_depth + 1))
    return (list(range(draft.min_depth + 1, draft.max_depth + 2)),
            list(range(draft.min_depth + 1, draft.max_depth + 1)))


def fork_request(rnd, st):
    """A second copy of a started request, in new memory: its decode state and its caches (a Round over
    the same model). Tests and benchmarks decode one request twice, eagerly and captured."""
    def clone_cache(c):
        c2 = copy.copy(c)
        for name, t in c.tensors().items():
            setattr(c2, name, t.clone())
        return c2

    st2 = dataclasses.replace(st, **{f.name: getattr(st, f.name).clone() for f in fields(st)})
    cache2 = dataclasses.replace(rnd.cache, layers=[clone_cache(c) for c in rnd.cache.layers],
                                 mtp=[clone_cache(c) for c in rnd.cache.mtp])
    return type(rnd)(rnd.model, cache2, rnd.s, rnd.draft), st2


def _state_tensors(st) -> dict[str, torch.Tensor]:
    return {f.name: getattr(st, f.name) for f in fields(st) if isinstance(getattr(st, f.name), torch.Tensor)}


class EagerPieces:
    """The pieces as calls (the eager execution); what ``CapturedPieces`` captures."""

    def __init__(self, rnd, st, draft):
        self.rnd, self.st, self.min_depth = rnd, st, draft.min_depth

    def verify(self, w: int) -> None:
        self.rnd.verify(self.st, w)

    def draft(self, w: int) -> None:
        self.rnd.draft_first(self.st, w)
        for k in range(2, self.min_depth + 1):
            self.rnd.draft_next(self.st, k)

    def depth(self, k: int) -> None:
        self.rnd.draft_next(self.st, k)


class CapturedPieces:
    """The pieces of one request's round as CUDA graphs, one per piece and width or depth (one memory
    pool for the set: they replay one after another on one stream and pass values only through the
    state and the caches)."""

    def __init__(self, rnd, st, draft, *, keep_graph: bool = False, _restore: bool = True):
        """``keep_graph``: keep each piece's ``cudaGraph_t`` and do not instantiate or upload it (the
        device loop, ``runtime/devloop.py``, clones the graphs into its own parent graph)."""
        eager = EagerPieces(rnd, st, draft)
        widths, depths = reachable(draft)
        saved = {k: v.clone() for k, v in _state_tensors(st).items()}

        def every_width(run):
            """Each width from the request's own state, as a real step would run it (verify, its
            drafts, every extra depth), the decode state put back after each."""
            for w in widths:
                run.verify(w)
                run.draft(w)
                for k in depths:
                    run.depth(k)
                if _restore:   # (the tests' negative control skips it: the decode starts from a wrong state)
                    for k, v in _state_tensors(st).items():
                        v.copy_(saved[k])

        # Warm-up: every piece once, eagerly, outside any capture (Triton compiles; workspaces and
        # cuBLAS handles are created on first use).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            every_width(eager)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pieces = {("verify", w): (lambda w=w: eager.verify(w)) for w in widths}
        pieces.update({("draft", w): (lambda w=w: eager.draft(w)) for w in widths})
        pieces.update({("depth", k): (lambda k=k: eager.depth(k)) for k in depths})
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        with torch.no_grad():
            for key, fn in pieces.items():   # a capture records the launches; it runs none of them
                g = torch.cuda.CUDAGraph(keep_graph=keep_graph)
                with torch.cuda.graph(g, pool=self.pool):
                    fn()
                self.graphs[key] = g
        if keep_graph:      # (the device loop uploads its parent graph itself)
            return
        # Every graph replayed once the same way: a graph's first launch uploads it to the device
        # (measured in session 53: the first two captured steps 735 / 597 us against 410 after).
        every_width(self)
        torch.cuda.synchronize()

    def _replay(self, key) -> None:
        g = self.graphs.get(key)
        if g is None:
            raise RuntimeError(f"no captured graph for {key[0]} {key[1]} (captured: {sorted(self.graphs)}); "
                               "the draft settings changed after the capture")
        g.replay()

    def verify(self, w: int) -> None:
        self._replay(("verify", w))

    def draft(self, w: int) -> None:
        self._replay(("draft", w))

    def depth(self, k: int) -> None:
        self._replay(("depth", k))
