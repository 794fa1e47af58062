"""Graph fingerprints of an arm: what one step of each width does, compared across arms.

A step is fingerprinted by its **operator trace** (also where the runtime captures the pieces as CUDA
graphs, ``runtime.execution``: the graphs hold exactly the launches the trace records, and a captured
or device-loop arm's trace starts with the line ``execution:captured`` or ``execution:device``, so the
executions differ): a
``TorchDispatchMode`` records every aten operator the step's pieces dispatch, with the shapes and
dtypes of its tensor arguments and its scalar arguments, while one step per width 4..8 runs on a
freshly restored request: ``verify(w)``, ``draft_first(w)`` and ``draft_next(k)`` for k = 2..w-1
(the work of a step that verifies w rows and drafts w-1). The pieces never read values on the host,
so the trace is a function of the code, the configuration and the shapes only: two arms with the
same trace launch the same work.

Hook for the graphs issue: an engine that exposes ``graph_fingerprint(rnd, st) -> {width: [node
signature, ...]}`` (CUDA-graph nodes: type, kernel name, launch geometry, topology) is fingerprinted
through it instead; :func:`fingerprint_arm` records which ``method`` produced a fingerprint, and
arms fingerprinted by different methods are never called identical. Triton launches do not pass
through the dispatcher; a Triton launch hook (:class:`TritonRecorder`) adds each one to the trace
with its kernel name and launch description (grid, warps, stages, programmatic launch, scalar and
constexpr arguments), so a kernel option or variant changed through ``runtime.kernels`` is a
difference too. (Kernels launched by other means remain invisible until the graph enumeration.)
"""
from __future__ import annotations

import collections
import difflib
import hashlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

WIDTHS = (4, 5, 6, 7, 8)


def _arg(a) -> str:
    if isinstance(a, torch.Tensor):
        return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
    if isinstance(a, float):
        return repr(round(a, 6))
    if isinstance(a, (bool, int, str)) or a is None:
        return repr(a)
    return str(a)


class OpRecorder(TorchDispatchMode):
    """Records ``op(args)`` signatures of every dispatched aten operator."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append(f"{func}({', '.join(_arg(a) for a in flat)})")
        return func(*args, **kwargs)


class TritonRecorder:
    """Records ``triton:<kernel>(<launch description>)`` for every compiled Triton launch while it is
    installed as a launch hook (``with TritonRecorder(ops):``). The description comes from the
    kernel's ``launch_metadata`` (``runtime.kernels._common.launch_signature``: grid, warps, stages,
    programmatic launch, scalar arguments), so it is the same in every copy of the runtime for the
    same code and shapes; a kernel without one is recorded by name. The interpreter runs no hooks."""

    def __init__(self, ops: list[str]):
        self.ops = ops
        self._knobs = None

    def __call__(self, metadata) -> None:
        d = metadata.get() if hasattr(metadata, "get") else dict(metadata or {})
        self.ops.append(f"triton:{d.get('name')}({d.get('signature', '')})")

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:      # no triton: nothing can be launched through it
            return self
        self._knobs = knobs
        knobs.runtime.launch_enter_hook.add(self)
        return self

    def __exit__(self, *exc):
        if self._knobs is not None:
            self._knobs.runtime.launch_enter_hook.remove(self)
        return False


def trace_width(rnd, st, w: int) -> list[str]:
    """Operator trace of one step of width ``w`` on a restored state (the state is consumed): the
    aten operators and, interleaved in launch order, the Triton launches."""
    st.n_drafts.fill_(w - 1)     # the width is a driver-side choice; forcing it touches no piece
    rec = OpRecorder()
    with torch.no_grad(), rec, TritonRecorder(rec.ops):
        rnd.verify(st, w)
        rnd.draft_first(st, w)
        for k in range(2, w):
            rnd.draft_next(st, k)
    return rec.ops


def fingerprint_arm(arm, restore) -> dict:
    """``{method, widths: {w: {hash, n_ops, ops}}}`` for one arm; ``restore()`` returns a fresh
    (rnd, st) of one request on the arm's engine."""
    widths = {}
    hook = getattr(arm.engine, "graph_fingerprint", None)
    method = "cuda-graph" if callable(hook) else "aten-trace"
    if callable(hook):
        rnd, st = restore()
        nodes = hook(rnd, st)
        widths = {int(w): list(v) for w, v in nodes.items()}
    else:
        # how the engine runs the traced pieces (runtime/graphs.py, devloop.py; a revision before them:
        # eager). The same launches run another way are a different step on the host's side, so the
        # execution is a line of the trace; the eager traces keep their hashes.
        execution = getattr(arm.engine, "execution", "eager")
        for w in WIDTHS:
            rnd, st = restore()
            widths[w] = ([] if execution == "eager" else [f"execution:{execution}"]) + trace_width(rnd, st, w)
    return {"method": method,
            "widths": {w: {"hash": hashlib.sha256("\n".join(ops).encode()).hexdigest(), "n_ops": len(ops),
                           "ops": ops} for w, ops in widths.items()}}


def identical(a: dict, b: dict) -> bool:
    return a["method"] == b["method"] and {w: v["hash"] for w, v in a["widths"].items()} == \
        {w: v["hash"] for w, v in b["widths"].items()}


def _name(sig: str) -> str:
    return sig.split("(", 1)[0]


def compare(base: dict, other: dict, max_lines: int = 12) -> dict:
    """What ``other`` adds, removes or changes relative to ``base``, per width."""
    out = {"identical": identical(base, other), "method": [base["method"], other["method"]], "widths": {}}
    for w in sorted(set(base["widths"]) | set(other["widths"])):
        a = base["widths"].get(w, {"ops": [], "hash": None})
        b = other["widths"].get(w, {"ops": [], "hash": None})
        if a["hash"] == b["hash"]:
            continue
        sm = difflib.SequenceMatcher(a=a["ops"], b=b["ops"], autojunk=False)
        added, removed, changed, lines = 0, 0, 0, []
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                continue
            if tag == "insert":
                added += j2 - j1
                lines += [f"  + [{j}] {b['ops'][j]}" for j in range(j1, j2)]
            elif tag == "delete":
                removed += i2 - i1
                lines += [f"  - [{i}] {a['ops'][i]}" for i in range(i1, i2)]
            else:
                changed += max(i2 - i1, j2 - j1)
                lines += [f"  - [{i}] {a['ops'][i]}" for i in range(i1, i2)]
                lines += [f"  + [{j}] {b['ops'][j]}" for j in range(j1, j2)]
        ca = collections.Counter(map(_name, a["ops"]))
        cb = collections.Counter(map(_name, b["ops"]))
        delta = {k: cb[k] - ca[k] for k in sorted(set(ca) | set(cb)) if cb[k] != ca[k]}
        out["widths"][w] = {"n_ops": [len(a["ops"]), len(b["ops"])], "added": added, "removed": removed,
                            "changed": changed, "op_count_delta": delta,
                            "diff": lines[:max_lines] + ([f"  … {len(lines) - max_lines} more lines"]
                                                         if len(lines) > max_lines else [])}
    return out


def describe(cmp: dict, what: str) -> str:
    """Readable lines for a comparison (``what``: e.g. 'candidate vs control'): per differing width the
    op counts and the change in op counts by operator, then the op-level diff of the narrowest one."""
    if cmp["identical"]:
        return f"{what}: identical step work at every width ({cmp['method'][0]})"
    if cmp["method"][0] != cmp["method"][1]:
        return f"{what}: fingerprinted by different methods {cmp['method']}: not comparable, treated as different"
    lines = [f"{what}: the step work differs at widths {sorted(cmp['widths'])}"]
    for w, d in cmp["widths"].items():
        delta = ", ".join(f"{v:+d} {k}" for k, v in d["op_count_delta"].items()) or "same op counts; order or shapes differ"
        lines.append(f"  width {w}: {d['n_ops'][0]} -> {d['n_ops'][1]} ops (+{d['added']} added, -{d['removed']} "
                     f"removed, ~{d['changed']} changed): {delta}")
    if cmp["widths"]:
        w = min(cmp["widths"])
        lines.append(f"  ops of width {w} (- control side, + this arm; [index] in the step's op sequence):")
        lines += ["  " + x for x in cmp["widths"][w]["diff"]]
    return "\n".join(lines)


def summary(fp: dict) -> dict:
    """The fingerprint without the op lists (for the manifest)."""
    return {"method": fp["method"], "widths": {str(w): {"hash": v["hash"], "n_ops": v["n_ops"]}
                                               for w, v in fp["widths"].items()}}
