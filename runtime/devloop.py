"""The device loop: a whole decode as one CUDA graph launch (DESIGN.md, "One step function, three
executions"; ``runtime.execution=device``).

The captured execution (``graphs.py``) replays one graph per piece, but its host loop still reads the
width, ``done`` and each depth decision from the device between pieces: a round trip each. Here the
host launches once per request and reads the result log at the end. The pieces' graphs (captured as
``CapturedPieces`` does, kept as ``cudaGraph_t``) are cloned into one parent graph, built for one
request or, with ``runtime.reuse_graphs``, kept across requests over fixed buffers (:class:`LoopSlot`):

    WHILE h_loop                                  one iteration = one step
      begin          control kernel: close the last step's times, open this one's (%globaltimer);
                     h_verify = the width's index (1 + n_drafts - the smallest width)
      SWITCH h_verify    verify[w] for every reachable width w
      verified       control kernel: h_loop = h_draft = not done; h_first = the width's index
      IF h_draft
        SWITCH h_first   draft[w]: depth 1 over the w rows, then depths 2..min_depth
        control kernel h_k = cont;  IF h_k: depth[k], then the next extra depth's kernel and IF inside
                         (nested: once cont is false, no further control kernel runs)
    end              control kernel: close the last step's times

which launches the eager loop's pieces in the eager loop's order (an extra depth that does not run
leaves ``cont`` false, so every later one is skipped as the eager loop's ``break`` skips it). Tokens and
the result log are therefore the eager decode's, bit for bit (``tests/test_devloop.py``).

A streaming caller (``Engine.decode(stream=...)``, the server) launches with a pause: the verified
kernel ends the WHILE after the round in which the emitted tokens reach ``pause_at``; the host reads
them, and launches again to resume (or not, to cancel).

Step times are measured on the device: the control kernels stamp ``%globaltimer`` (ns) at each step's
start and end into a buffer beside the decode state. ``debug.step_delay_fraction`` (the harness's
calibration) is a busy-wait in the control kernel, counted in the step or not (``step_delay_timed``),
as the host loop's is. Failure exits, reported by :meth:`DeviceLoop.check` (never a hang): a width
outside the captured set, or more steps than the output budget allows without ``done``.

The control kernels are CUDA C++ (``cudaGraphSetConditional`` is a device-runtime call Triton cannot
make), compiled once per process and device by NVRTC, or by ``nvcc`` where NVRTC's library is absent.
Graph construction uses ``cuda.bindings`` (the runtime API; the driver API for the kernel nodes).
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import subprocess
import tempfile

import torch

from .graphs import CapturedPieces, reachable

CONTROL_SOURCE = r"""
typedef unsigned long long u64;
#ifdef __CUDACC_RTC__
extern "C" __device__ void cudaGraphSetConditional(u64 handle, unsigned int value);
#endif

__device__ __forceinline__ long long iq_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

// Close step s-1 (if any and not closed yet: a launch that resumes after a pause finds it closed by the
// paused launch's end): its end stamp, after the calibration's busy-wait of delay x its duration when
// timed, before it when not.  stamps: [cap, 2] (start, end) per step, zeroed by a request's first launch.
__device__ void iq_close(long long s, long long* stamps, long long cap, float delay, int timed) {
    if (s < 1 || s > cap || stamps[2 * (s - 1) + 1] != 0) return;
    long long t0 = stamps[2 * (s - 1)], t = iq_now();
    if (!timed) stamps[2 * (s - 1) + 1] = t;
    if (delay > 0.f) {
        long long until = t + (long long)((double)(t - t0) * (double)delay);
        while (iq_now() < until) { }
    }
    if (timed) stamps[2 * (s - 1) + 1] = iq_now();
}

extern "C" __global__ void iq_loop_begin(u64 h_verify, const long long* n_drafts, const long long* step,
                                         long long* stamps, long long cap, int* cur, int* err,
                                         int w_min, int n_w, float delay, int timed) {
    long long s = *step;
    iq_close(s, stamps, cap, delay, timed);
    if (s < cap) stamps[2 * s] = iq_now();
    int i = (int)(*n_drafts) + 1 - w_min;
    if ((i < 0 || i >= n_w) && *err == 0) *err = 1;     // a width nothing was captured for
    if (*err) i = n_w;                                   // out of range: the SWITCH runs no body
    *cur = i;
    cudaGraphSetConditional(h_verify, (unsigned int)i);
}

// After the verification: draft on unless done or failed; loop on unless that, or the tokens emitted
// reached pause_at (a streaming pause: this step still drafts, so a relaunch resumes a whole round).
extern "C" __global__ void iq_loop_verified(u64 h_loop, u64 h_draft, u64 h_first, const bool* done,
                                            const long long* step, long long max_steps, const int* cur,
                                            int* err, int n_w, const long long* n_out,
                                            const long long* pause_at) {
    bool d = *done;
    if (!d && *err == 0 && *step >= max_steps) *err = 2;   // the budget is spent and still not done
    unsigned int go = (!d && *err == 0) ? 1u : 0u;
    cudaGraphSetConditional(h_loop, (go && *n_out < *pause_at) ? 1u : 0u);
    cudaGraphSetConditional(h_draft, go);
    cudaGraphSetConditional(h_first, go ? (unsigned int)*cur : (unsigned int)n_w);
}

extern "C" __global__ void iq_loop_depth(u64 h, const bool* cont) {
    cudaGraphSetConditional(h, *cont ? 1u : 0u);
}

extern "C" __global__ void iq_loop_end(const long long* step, long long* stamps, long long cap,
                                       float delay, int timed) {
    iq_close(*step, stamps, cap, delay, timed);
}
"""
KERNELS = ("iq_loop_begin", "iq_loop_verified", "iq_loop_depth", "iq_loop_end")
NO_PAUSE = 1 << 62
ERRORS = {1: "the next width has no captured graph (the draft settings changed after the capture)",
          2: "the output budget's steps ran out before the request was done"}


class DeviceLoopError(RuntimeError):
    """The device loop cannot be built or launched here, or it took a failure exit."""


def _bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError as e:     # pragma: no cover - the gpu extra installs it
        raise DeviceLoopError("runtime.execution=device needs cuda-python (pip install 'iquestrt[gpu]')") from e
    return driver, runtime


def _ok(res, what: str):
    """A cuda.bindings call's (error, *values) → values, raising on an error."""
    err, vals = res[0], res[1:]
    if int(err) != 0:
        raise DeviceLoopError(f"{what} failed: {err!r}")
    return vals[0] if len(vals) == 1 else vals


# ---- the control kernels ---------------------------------------------------------------------------
def _compile_nvrtc(arch: str) -> bytes:
    from cuda.bindings import nvrtc
    prog = _ok(nvrtc.nvrtcCreateProgram(CONTROL_SOURCE.encode(), b"iq_loop.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"-arch={arch}".encode(), b"-std=c++17"]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            n = _ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise DeviceLoopError(f"NVRTC could not compile the loop's control kernels: {log.decode(errors='replace')}")
        n = _ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * n
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvcc() -> str | None:
    """nvcc on the PATH, else under $CUDA_HOME, else None."""
    path = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    return path if path and os.path.exists(path) else None


def _compile_nvcc(arch: str) -> bytes:
    nvcc = _nvcc()
    if nvcc is None:
        raise DeviceLoopError("neither NVRTC nor nvcc is available to compile the loop's control kernels")
    with tempfile.TemporaryDirectory(prefix="iq_loop_") as d:
        src, out = os.path.join(d, "iq_loop.cu"), os.path.join(d, "iq_loop.cubin")
        with open(src, "w") as f:
            f.write(CONTROL_SOURCE)
        p = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", out, src], capture_output=True, text=True)
        if p.returncode != 0:
            raise DeviceLoopError(f"nvcc could not compile the loop's control kernels:\n{p.stderr}")
        with open(out, "rb") as f:
            return f.read()


def compile_control(arch: str) -> tuple[bytes, str]:
    """The control kernels' cubin for ``arch`` (e.g. sm_90) and the compiler that made it."""
    try:
        return _compile_nvrtc(arch), "nvrtc"
    except Exception as e:     # NVRTC's library not found, an old binding, a compile error: try nvcc
        first = f"{type(e).__name__}: {e}"
    try:
        return _compile_nvcc(arch), "nvcc"
    except DeviceLoopError as e:
        raise DeviceLoopError(f"{e} (NVRTC: {first})") from None


def unavailable() -> str | None:
    """Why the device loop cannot run in this process (None: it can): cuda-python, and NVRTC or nvcc
    to compile the control kernels."""
    try:
        _bindings()
    except DeviceLoopError:
        return "cuda-python is not installed (pip install 'iquestrt[gpu]')"
    try:
        from cuda.bindings import nvrtc
        if int(nvrtc.nvrtcVersion()[0]) == 0:
            return None
    except Exception:      # NVRTC's library not found: nvcc may still compile
        pass
    if _nvcc() is not None:
        return None
    return "neither NVRTC's library nor nvcc is available to compile the loop's control kernels"


_FUNCS: dict[int, dict] = {}      # device index → kernel name → CUfunction (this copy of runtime only)


def control_kernels(device: torch.device) -> dict:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _FUNCS:
        driver, _ = _bindings()
        major, minor = torch.cuda.get_device_capability(idx)
        cubin, how = compile_control(f"sm_{major}{minor}")
        with torch.cuda.device(idx):
            torch.cuda.init()
            mod = _ok(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            _FUNCS[idx] = {k: _ok(driver.cuModuleGetFunction(mod, k.encode()), f"cuModuleGetFunction({k})")
                           for k in KERNELS} | {"_module": mod, "_compiler": how}
    return _FUNCS[idx]


# ---- graph construction ----------------------------------------------------------------------------
class _Chain:
    """Nodes appended one after another to one graph (each depends on the previous)."""

    def __init__(self, graph):
        self.driver, self.rt = _bindings()
        self.graph, self.last = graph, []

    def _then(self, node):
        self.last = [node]

    def child(self, raw_graph: int) -> None:
        rt = self.rt
        g = rt.cudaGraph_t(init_value=int(raw_graph))
        self._then(_ok(rt.cudaGraphAddChildGraphNode(self.graph, self.last, len(self.last), g),
                       "cudaGraphAddChildGraphNode"))

    def kernel(self, func, args: list[tuple]) -> None:
        """One thread of ``func`` with arguments [(value, ctypes type)]."""
        drv, rt = self.driver, self.rt
        p = drv.CUDA_KERNEL_NODE_PARAMS()
        p.func = func
        p.gridDimX = p.gridDimY = p.gridDimZ = 1
        p.blockDimX = p.blockDimY = p.blockDimZ = 1
        p.sharedMemBytes = 0
        p.kernelParams = (tuple(v for v, _ in args), tuple(t for _, t in args))
        deps = [drv.CUgraphNode(int(n)) for n in self.last]
        node = _ok(drv.cuGraphAddKernelNode(drv.CUgraph(int(self.graph)), deps, len(deps), p), "cuGraphAddKernelNode")
        self._then(rt.cudaGraphNode_t(init_value=int(node)))

    def handle(self, default: int | None = None) -> int:
        """A conditional handle of this graph (for a node added to it later); ``default``: the value
        every launch assigns, else it keeps what a control kernel last set."""
        rt = self.rt
        flags = int(rt.cudaGraphConditionalHandleFlags.cudaGraphCondAssignDefault) if default is not None else 0
        return _ok(rt.cudaGraphConditionalHandleCreate(self.graph, default or 0, flags),
                   "cudaGraphConditionalHandleCreate")

    def conditional(self, kind: str, h, size: int = 1) -> list["_Chain"]:
        """A WHILE / IF / SWITCH node on handle ``h``: a chain for each of its bodies."""
        rt = self.rt
        p = rt.cudaGraphNodeParams()
        p.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        p.conditional.handle = h
        p.conditional.type = getattr(rt.cudaGraphConditionalNodeType, f"cudaGraphCondType{kind.title()}")
        p.conditional.size = size
        self._then(_ok(rt.cudaGraphAddNode(self.graph, self.last, None, len(self.last), p),
                       f"cudaGraphAddNode({kind})"))
        return [_Chain(p.conditional.phGraph_out[i]) for i in range(size)]


U64, PTR, I32, I64, F32 = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float


class DeviceLoop:
    """One request's decode as one parent graph (see the module's docstring): built (the pieces
    warmed up, captured and cloned in; the parent instantiated and uploaded) before the first step;
    :meth:`launch` runs the whole decode; :meth:`check` and :meth:`step_times` read what it left."""

    def __init__(self, rnd, st, draft, debug=None, *, budget: int | None = None, nested: bool = True,
                 _every_depth: bool = False, _restore: bool = True, _max_steps: int | None = None):
        """``budget``: the largest output budget the loop serves (its step bound and stamp buffer;
        default: the state's own). ``nested``: each extra depth's IF inside the previous one's body,
        so a step whose ``cont`` is false runs no further control kernel (else one after another, each
        evaluated; the same decode). ``_every_depth`` (the depth conditions read a constant true, not
        ``cont``), ``_restore`` (see CapturedPieces) and ``_max_steps`` (a lower step bound) are the
        tests' negative controls."""
        _, rt = _bindings()
        self.rt, self.st = rt, st
        dev = st.tokens.device
        funcs = control_kernels(dev)
        self.compiler = funcs["_compiler"]     # nvrtc | nvcc
        widths, depths = reachable(draft)
        if widths != list(range(widths[0], widths[0] + len(widths))):
            raise DeviceLoopError(f"the device loop indexes contiguous widths, got {widths}")
        # the pieces: CapturedPieces' warm-up and capture, graphs kept un-instantiated
        self.pieces = CapturedPieces(rnd, st, draft, keep_graph=True, _restore=_restore)
        raw = {k: g.raw_cuda_graph() for k, g in self.pieces.graphs.items()}
        # (each step emits at least one token until the budget is spent: budget steps reach done)
        budget = int(st.budget) if budget is None else budget
        self.max_steps = budget if _max_steps is None else _max_steps
        self.cap = budget + 2
        self.stamps = torch.zeros(self.cap, 2, dtype=torch.int64, device=dev)   # (start, end) ns per step
        self.cur = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.pause_at = torch.full((), NO_PAUSE, dtype=torch.int64, device=dev)   # tokens emitted: pause there
        delay = (float(getattr(debug, "step_delay_fraction", 0.0) or 0.0), F32)
        timed = (int(bool(getattr(debug, "step_delay_timed", True))), I32)
        a = lambda t: (t.data_ptr(), PTR)    # noqa: E731
        n_w = (len(widths), I32)

        self.graph = _ok(rt.cudaGraphCreate(0), "cudaGraphCreate")
        self.exec = None
        top = _Chain(self.graph)
        h_loop = top.handle(default=1)               # the host launches only a request not done
        (body,) = top.conditional("while", h_loop)
        top.kernel(funcs["iq_loop_end"], [a(st.step), a(self.stamps), (self.cap, I64), delay, timed])

        # (a handle belongs to the graph it is created in and may serve a node in any of its bodies:
        # every step's handles are the WHILE body's)
        h_verify, h_draft, h_first = body.handle(), body.handle(), body.handle()
        h_depth = {k: body.handle() for k in depths}
        body.kernel(funcs["iq_loop_begin"],
                    [(int(h_verify), U64), a(st.n_drafts), a(st.step), a(self.stamps), (self.cap, I64),
                     a(self.cur), a(self.err), (widths[0], I32), n_w, delay, timed])
        for b, w in zip(body.conditional("switch", h_verify, len(widths)), widths):
            b.child(raw[("verify", w)])
        body.kernel(funcs["iq_loop_verified"],
                    [(int(h_loop), U64), (int(h_draft), U64), (int(h_first), U64), a(st.done), a(st.step),
                     (self.max_steps, I64), a(self.cur), a(self.err), n_w, a(st.n_out), a(self.pause_at)])
        (drafting,) = body.conditional("if", h_draft)
        for b, w in zip(drafting.conditional("switch", h_first, len(widths)), widths):
            b.child(raw[("draft", w)])
        self._true = torch.ones((), dtype=torch.bool, device=dev)
        cont = self._true if _every_depth else st.cont
        chain = drafting
        for k in depths:     # (after a depth that did not run, cont stays false: the later ones skip too)
            chain.kernel(funcs["iq_loop_depth"], [(int(h_depth[k]), U64), a(cont)])
            (b,) = chain.conditional("if", h_depth[k])
            b.child(raw[("depth", k)])
            if nested:
                chain = b
        self.exec = _ok(rt.cudaGraphInstantiate(self.graph, 0), "cudaGraphInstantiate")
        self.stream = torch.cuda.current_stream(dev)
        _ok(rt.cudaGraphUpload(self.exec, self._stream()), "cudaGraphUpload")
        self.stream.synchronize()

    def _stream(self):
        return self.rt.cudaStream_t(init_value=self.stream.cuda_stream)

    def launch(self, pause_at: int | None = None, resume: bool = False) -> None:
        """The whole decode, asynchronously on the stream the loop was built on (a kept loop's last
        failure exit and step stamps cleared first). ``pause_at``: the loop stops, its round complete,
        once this many tokens are out (the state's ``n_out``; a streaming caller reads them and
        launches again with ``resume=True``, which keeps the stamps: the host's pause is in no step)."""
        with torch.cuda.stream(self.stream):
            if not resume:
                self.err.zero_()
                self.stamps.zero_()
            self.pause_at.fill_(NO_PAUSE if pause_at is None else int(pause_at))
        _ok(self.rt.cudaGraphLaunch(self.exec, self._stream()), "cudaGraphLaunch")

    def check(self) -> None:
        """Raise the loop's failure exit, if it took one (after the launch has finished)."""
        e = int(self.err[0])
        if e:
            raise DeviceLoopError(f"the device loop stopped at step {int(self.st.step)}: "
                                  f"{ERRORS.get(e, f'error {e}')}")

    def step_times(self, n_steps: int) -> tuple[list[int], list[int]]:
        """(duration ns, start ns relative to the first step's start) of each step, by %globaltimer."""
        s = self.stamps[:n_steps].cpu().tolist()
        if not s:
            return [], []
        return [e - b for b, e in s], [b - s[0][0] for b, _ in s]

    def __del__(self):
        try:
            if getattr(self, "exec", None) is not None:
                self.rt.cudaGraphExecDestroy(self.exec)
            if getattr(self, "graph", None) is not None:
                self.rt.cudaGraphDestroy(self.graph)
        except Exception:     # (interpreter shutdown: the bindings may be gone already)
            pass


# ---- graphs across requests ------------------------------------------------------------------------
def _full_slots(rnd) -> int:
    return max((c.slots for c in rnd.cache.all if c.kind == "full"), default=0)


class LoopSlot:
    """A device loop kept across requests (``runtime.reuse_graphs``): a decode state and caches at fixed
    addresses, which its graphs hold. :meth:`load` copies a request's state and caches in (the state's
    per-token buffers and the full layers' slots as a prefix; slots past it are labelled empty), and
    :meth:`store` copies them back after the decode, so the request's own objects end as a decode of
    their own would leave them. Built for a capacity (full-layer slots) and an output budget; a request
    that needs more, or other sampling or draft settings, needs a new slot (``fits``)."""

    def __init__(self, round_for, rnd, st, draft, debug, capacity: int, budget: int, *,
                 _stale_caches: bool = False, **loop_kw):
        """``_stale_caches``: the tests' negative control, every later request's caches not copied in
        (the previous request's left in the slot)."""
        self.capacity, self.budget, self.draft = capacity, budget, draft
        self.rnd = round_for(capacity)
        pad = {"out": budget + 8, "log": budget + 1}       # the state's per-token buffers, at this budget
        self.st = dataclasses.replace(st, **{
            f.name: (t.new_zeros((pad[f.name],) + tuple(t.shape[1:])) if f.name in pad else t.clone())
            for f in dataclasses.fields(st) for t in [getattr(st, f.name)]})
        self.load(rnd, st)
        self._stale_caches = _stale_caches
        self.loop = DeviceLoop(self.rnd, self.st, draft, debug, budget=budget, **loop_kw)

    def fits(self, rnd, st, draft) -> bool:
        return (draft == self.draft and _full_slots(rnd) <= self.capacity and int(st.budget) <= self.budget
                and st.stop_ids.shape == self.st.stop_ids.shape
                and [c.slots for c in rnd.cache.all if c.kind != "full"]
                == [c.slots for c in self.rnd.cache.all if c.kind != "full"])

    def load(self, rnd, st) -> None:
        for f in dataclasses.fields(st):
            src, dst = getattr(st, f.name), getattr(self.st, f.name)
            if src.dim() == 0 or src.shape == dst.shape:
                dst.copy_(src)
            else:
                n = src.shape[0]
                dst[:n].copy_(src)
                dst[n:].zero_()
        if getattr(self, "_stale_caches", False):
            return
        for src, dst in zip(rnd.cache.all, self.rnd.cache.all):
            n = src.slots
            dst.k[:, :n].copy_(src.k)
            dst.v[:, :n].copy_(src.v)
            dst.labels[:n].copy_(src.labels)
            dst.labels[n:].fill_(-1)

    def store(self, rnd, st) -> None:
        for f in dataclasses.fields(st):
            dst, src = getattr(st, f.name), getattr(self.st, f.name)
            dst.copy_(src if src.dim() == 0 else src[:dst.shape[0]])
        for dst, src in zip(rnd.cache.all, self.rnd.cache.all):
            n = dst.slots
            dst.k.copy_(src.k[:, :n])
            dst.v.copy_(src.v[:, :n])
            dst.labels.copy_(src.labels[:n])
