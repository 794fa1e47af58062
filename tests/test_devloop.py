"""The device loop (runtime/devloop.py): one parent graph per request whose conditional nodes run the
whole decode must decode exactly what the eager host loop decodes.

GPU tests compare, from one started request, an eager decode with a device-loop decode: the same
tokens and the same result log (every column), for the fast backend and the reference, under the stop
rule (several widths and depths in one decode) and the fixed policy; the extra depths' IFs nested
(the default) and one after another. Negative controls: the depth
conditions wired to a constant true instead of the state's ``cont`` (every depth runs), and the
warm-up's state changes left in place; the comparison must reject both. The failure exits (a width
nothing was captured for; the step bound) must be reported, never hang. The step stamps must hold
the calibration's busy-wait where ``step_delay_timed`` says. CPU tests check the configuration and
that the control kernels' source compiles for sm_90 where nvcc is present.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from runtime.config import ConfigError, DraftConfig
from runtime.engine import Engine
from runtime.graphs import fork_request, resolve_execution

from tests.test_graphs import GPU_CASES, PROMPT, gpu_prompt, same_decode   # the captured execution's cases

HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ CPU tests
def test_device_execution_needs_cuda():
    assert resolve_execution("device", torch.device("cuda"), True) == "device"
    with pytest.raises(ValueError, match="execution=device needs a CUDA device"):
        resolve_execution("device", torch.device("cpu"), True)
    with pytest.raises(ConfigError, match="execution=device needs a CUDA device"):
        Engine.build("q1-tiny", {"device": "cpu", "execution": "device"})
    with pytest.raises(ConfigError, match=r"execution must be auto\|eager\|captured\|device"):
        Engine.build("q1-tiny", {"device": "cpu", "execution": "loop"})


def test_auto_falls_back_to_captured_where_the_device_loop_cannot_run(monkeypatch):
    """No cuda-python, or neither NVRTC nor nvcc: ``auto`` picks the captured execution on one GPU, and
    an explicit ``device`` is a configuration error naming why."""
    from runtime import devloop
    gpu = torch.device("cuda")
    assert resolve_execution("auto", gpu, True, "no cuda-python") == "captured"
    assert resolve_execution("auto", gpu, False, "no cuda-python") == "eager"
    with pytest.raises(ValueError, match="execution=device cannot run here: no cuda-python"):
        resolve_execution("device", gpu, True, "no cuda-python")
    if shutil.which("nvcc"):
        assert devloop.unavailable() is None
    monkeypatch.setattr(devloop.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)

    class NoNvrtc:
        @staticmethod
        def nvrtcVersion():
            raise RuntimeError("libnvrtc.so not found")
    import cuda.bindings
    monkeypatch.setattr(cuda.bindings, "nvrtc", NoNvrtc, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.nvrtc", NoNvrtc)
    assert "neither NVRTC's library nor nvcc" in devloop.unavailable()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_control_kernels_compile_for_sm90():
    from runtime import devloop
    cubin = devloop._compile_nvcc("sm_90")
    assert cubin[:4] == b"\x7fELF"
    for name in devloop.KERNELS:
        assert name.encode() in cubin
    # a broken source must be reported as such, with the compiler's message
    src = devloop.CONTROL_SOURCE
    try:
        devloop.CONTROL_SOURCE = src.replace("cudaGraphSetConditional(h, *cont", "cudaGraphSetConditional(h, *cnt")
        with pytest.raises(devloop.DeviceLoopError, match="nvcc could not compile"):
            devloop._compile_nvcc("sm_90")
    finally:
        devloop.CONTROL_SOURCE = src


# ------------------------------------------------------------------------------------------ GPU tests
def eager_and_device(eng, prompt, seed, budget, loop_kwargs=None, debug=None):
    """(eager decode, device-loop decode) of one started request; ``loop_kwargs`` go to DeviceLoop
    (the negative controls' switches)."""
    from runtime import devloop
    rnd, st = eng.start(prompt, seed=seed, max_new_tokens=budget)
    r2, s2 = fork_request(rnd, st)
    eng.execution = "eager"
    ref = eng.decode(rnd, st)
    eng.execution = "device"
    if loop_kwargs:
        real = devloop.DeviceLoop

        class Patched(real):
            def __init__(self, r, s, d, dbg=None, **kw):
                super().__init__(r, s, d, dbg, **{**kw, **loop_kwargs})
        devloop.DeviceLoop = Patched
    try:
        got = eng.decode(r2, s2)
    finally:
        if loop_kwargs:
            devloop.DeviceLoop = real
    return ref, got


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_device_loop_decode_is_the_eager_decode(case):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    model, rt = GPU_CASES[case]
    eng = Engine.build(model, {"device": "cuda", **rt})
    widths = set()
    for seed in range(3):
        ref, got = eager_and_device(eng, gpu_prompt(model), seed, 48)
        widths |= {s["width"] for s in ref.steps}
        med = lambda xs: sorted(xs)[len(xs) // 2] / 1e3  # noqa: E731
        print(f"{case} seed {seed}: {len(ref.steps)} steps, widths {sorted({s['width'] for s in ref.steps})}, "
              f"eager step median {med(ref.step_ns):.0f} us, device {med(got.step_ns):.0f} us; loop "
              f"{ref.loop_ns / 1e3:.0f} / {got.loop_ns / 1e3:.0f} us")
        assert got.tokens == ref.tokens
        assert got.steps == ref.steps
        assert len(got.step_ns) == len(got.steps) == len(got.step_t0_ns)
        assert all(t > 0 for t in got.step_ns)
        assert sum(got.step_ns) <= got.loop_ns       # device stamps lie inside the host's launch-to-sync
        assert got.step_t0_ns == sorted(got.step_t0_ns)
    if eng.rt.draft.policy == "stop_rule":
        assert len(widths) >= 2, f"the stop rule's decodes visited one width only ({widths}): a weak check"


@pytest.mark.gpu
@pytest.mark.parametrize("stale", [False, True])
def test_gpu_graphs_reused_across_requests(stale):
    """One engine's loop (``runtime.reuse_graphs``) serves requests of other prompts and lengths in turn:
    each decodes as its eager twin; a longer one rebuilds the slot larger. Negative control
    (``stale``): the caches of the request before left in the slot; the next request must differ."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    from snapshots import chat
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    if stale:
        eng._devloop_options = {"_stale_caches": True}
    code = "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
    prompts = [gpu_prompt("q1-mini"),
               chat.render([{"role": "user", "content": "Write a stack class"}, {"role": "tool_result", "content": code * 3}]),
               chat.render([{"role": "user", "content": "Explain this module"}, {"role": "tool_result", "content": code * 40}])]
    slots, same = [], []
    for i, prompt in enumerate(prompts):
        ref, got = eager_and_device(eng, prompt, seed=i, budget=48)
        same.append(same_decode(got, ref))
        slots.append((id(eng._slot), eng._slot.capacity))
    print(f"slots (id, capacity) per request: {slots}; same as eager: {same}")
    if stale:
        assert not all(same[1:]), "stale caches went unnoticed: the comparison cannot fail"
    else:
        assert all(same), same
        assert slots[0][0] == slots[1][0], "the second, shorter request should have reused the slot"
        assert slots[2][1] > slots[0][1], "the longest request should have rebuilt the slot larger"


@pytest.mark.gpu
def test_gpu_flat_depth_layout_decodes_the_same():
    """The extra depths' IFs one after another (``nested=False``, every control kernel evaluated)
    instead of nested: the same decode as eager under the stop rule, whose depths vary."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    drafts = set()
    for seed in range(2):
        ref, got = eager_and_device(eng, gpu_prompt("q1-mini"), seed, 48, {"nested": False})
        assert same_decode(got, ref)
        drafts |= {s["next_drafts"] for s in ref.steps}
    assert len(drafts - {0}) >= 2, drafts


@pytest.mark.gpu
@pytest.mark.parametrize("control", ["every_depth", "no_restore"])
def test_gpu_device_loop_negative_controls_are_caught(control):
    """Every extra depth run regardless of ``cont`` (the depth IFs ignored), or the warm-up's steps
    left in the decode state: the decode must differ from the eager one."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    kw = {"_every_depth": True} if control == "every_depth" else {"_restore": False}
    # (budget 128: the un-restored warm-up advances the state by ten steps; the capacity must hold them)
    ref, got = eager_and_device(eng, gpu_prompt("q1-mini"), 0, 128, kw)
    assert not same_decode(got, ref)
    if control == "every_depth":
        assert all(s["next_drafts"] == 7 for s in got.steps[:-1] if s["next_drafts"]), \
            [s["next_drafts"] for s in got.steps]


@pytest.mark.gpu
def test_gpu_device_loop_failure_exits_are_reported():
    """A width nothing was captured for (the draft settings changed after the first drafts), and
    the step bound reached before ``done``: a DeviceLoopError naming it, not a hang."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    from runtime.devloop import DeviceLoop, DeviceLoopError
    eng = Engine.build("q1-tiny", {"device": "cuda", "backend": "fast", "dtype": "bfloat16",
                                   "draft": {"policy": "fixed", "fixed_depth": 4}})
    rnd, st = eng.start(PROMPT * 8, seed=0, max_new_tokens=32)
    assert st.width() == 5
    with torch.no_grad():
        loop = DeviceLoop(rnd, st, DraftConfig(policy="fixed", fixed_depth=5))   # captures width 6 only
        loop.launch()
        torch.cuda.synchronize()
    with pytest.raises(DeviceLoopError, match="no captured graph"):
        loop.check()
    assert int(st.step) == 0

    rnd, st = eng.start(PROMPT * 8, seed=0, max_new_tokens=32)
    with torch.no_grad():
        loop = DeviceLoop(rnd, st, eng.rt.draft, _max_steps=2)
        loop.launch()
        torch.cuda.synchronize()
    with pytest.raises(DeviceLoopError, match="budget"):
        loop.check()
    assert int(st.step) == 2
    first = st.log[:2].clone()
    # launched again over a fresh request copied into its buffers (as a loop kept across requests is):
    # the last exit is cleared first, so the same two steps run before the bound stops it again, where
    # a stale flag would stop it before any step. (A relaunch without a fresh request would find the
    # budget exit's step verified but not drafted: no captured width, session 55's first GPU run.)
    rnd2, st2 = eng.start(PROMPT * 8, seed=0, max_new_tokens=32)
    with torch.no_grad():
        for f in dataclasses.fields(st):
            getattr(st, f.name).copy_(getattr(st2, f.name))
        for c, c2 in zip(rnd.cache.all, rnd2.cache.all):
            c.k.copy_(c2.k)
            c.v.copy_(c2.v)
            c.labels.copy_(c2.labels)
        loop.launch()
        torch.cuda.synchronize()
    with pytest.raises(DeviceLoopError, match="budget"):
        loop.check()
    assert int(st.step) == 2 and torch.equal(st.log[:2], first)


@pytest.mark.gpu
@pytest.mark.parametrize("timed", [True, False])
def test_gpu_device_loop_calibration_delay(timed):
    """debug.step_delay_fraction on the device: untimed, each step's recorded duration leaves the wait
    out, so the next step starts at least (1 + fraction) x that duration after this one's start;
    timed, the wait is inside the duration and the next step starts right after it."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    f = 0.5
    eng = Engine.build("q1-tiny", {"device": "cuda", "backend": "fast", "dtype": "bfloat16",
                                   "debug": {"step_delay_fraction": f, "step_delay_timed": timed}})
    ref, got = eager_and_device(eng, PROMPT * 8, 0, 32)
    assert same_decode(got, ref)
    t0, d = got.step_t0_ns, got.step_ns
    gaps = [b - a for a, b in zip(t0, t0[1:])]
    assert len(gaps) >= 5
    for gap, dur in zip(gaps, d):
        if timed:
            assert dur <= gap
        else:
            assert gap >= (1 + f) * dur - 1_000, (gap, dur)    # (globaltimer ticks: 1 us of slack)
    if timed:   # the wait is counted: (1 + f) x the undelayed step, which the untimed run shows
        assert sum(gap - dur for gap, dur in zip(gaps, d)) < 0.5 * sum(d)
