"""The captured execution (runtime/graphs.py): each piece of the round a CUDA graph per width, replayed
by the engine's host loop, must decode exactly what the eager loop decodes.

GPU tests compare, from one started request, an eager decode with a captured one: the same tokens and
the same result log (every column), for the fast backend and the reference, under the stop rule
(several widths and depths in one decode) and the fixed policy. Their negative control captures with
the warm-up's state changes left in place, which the comparison must reject. CPU tests check the
configuration, the widths and depths captured, that the host loop still runs the pieces in the old
loop's order, and that the replay's fingerprint tells a captured arm from an eager one.
"""
from __future__ import annotations

import time
import types

import pytest
import torch

from replay import fingerprint as fpm
from runtime.config import ConfigError, DraftConfig
from runtime.engine import Engine
from runtime.graphs import CapturedPieces, fork_request, reachable, resolve_execution

HAS_CUDA = torch.cuda.is_available()
PROMPT = [1, 17, 29, 3, 88, 5, 41, 9, 120, 7, 33, 64, 2, 19, 250, 11]


def old_loop(eng, rnd, st, stop_early_at=None):
    """The host loop as it was before runtime/graphs.py (pieces called directly). ``stop_early_at``:
    the negative control, extra depths cut at that depth."""
    d = eng.rt.draft
    with torch.no_grad():
        while not bool(st.done):
            w = st.width()
            rnd.verify(st, w)
            if not bool(st.done):
                rnd.draft_first(st, w)
                for k in range(2, d.min_depth + 1):
                    rnd.draft_next(st, k)
                for k in range(d.min_depth + 1, (stop_early_at or d.max_depth) + 1):
                    if not bool(st.cont):
                        break
                    rnd.draft_next(st, k)
    return eng.result(st, [])


def same_decode(a, b) -> bool:
    return a.tokens == b.tokens and a.steps == b.steps


# ------------------------------------------------------------------------------------------ CPU tests
def test_execution_resolves_by_device_and_comm():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_execution("auto", cpu, True) == "eager"
    assert resolve_execution("auto", gpu, True) == "device"     # the device loop (runtime/devloop.py)
    assert resolve_execution("auto", gpu, False) == "eager"      # real TP over gloo: not capturable
    assert resolve_execution("eager", gpu, True) == "eager"
    assert resolve_execution("captured", gpu, False) == "captured"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_execution("captured", cpu, True)


def test_execution_config_errors_are_clear():
    assert Engine.build("q1-tiny", {"device": "cpu"}).execution == "eager"
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        Engine.build("q1-tiny", {"device": "cpu", "execution": "captured"})
    with pytest.raises(ConfigError, match="execution must be auto|eager|captured"):
        Engine.build("q1-tiny", {"device": "cpu", "execution": "graphs"})


def test_reachable_widths_and_depths():
    assert reachable(DraftConfig()) == ([4, 5, 6, 7, 8], [4, 5, 6, 7])
    assert reachable(DraftConfig(policy="fixed", fixed_depth=7)) == ([8], [4, 5, 6, 7])
    assert reachable(DraftConfig(policy="fixed", fixed_depth=3)) == ([4], [])
    assert reachable(DraftConfig(min_depth=2, max_depth=5)) == ([3, 4, 5, 6], [3, 4, 5])


@pytest.mark.parametrize("policy", ["stop_rule", "fixed"])
def test_host_loop_runs_the_pieces_in_the_old_order(policy):
    """Engine.decode (now through EagerPieces) against the loop it replaced, on q1-tiny (CPU). The
    negative control (extra depths cut at 4) must differ, or the comparison could not fail."""
    # (random weights draw ~1/20-probability drafts: a stop rule at log_prob_min -12 runs depths 4-6)
    draft = {"policy": policy, "fixed_depth": 6, "stop_rule": {"log_prob_min": -12.0, "entropy_max": 10.0}}
    eng = Engine.build("q1-tiny", {"device": "cpu", "draft": draft})
    rnd, st = eng.start(PROMPT, seed=3, max_new_tokens=24)
    r2, s2 = fork_request(rnd, st)
    r3, s3 = fork_request(rnd, st)
    new = eng.decode(rnd, st)
    assert same_decode(new, old_loop(eng, r2, s2))
    assert len(new.step_ns) == len(new.steps)
    widths = {s["width"] for s in new.steps}
    assert widths == {7} if policy == "fixed" else len(widths) >= 2, widths
    assert not same_decode(new, old_loop(eng, r3, s3, stop_early_at=4))


def test_host_loop_steps_tile_the_loop_and_count_the_reads_between_pieces(monkeypatch):
    """A host-loop step runs from the end of the previous one to its own end, so the host's reads of
    ``done`` and the width are in it (``Engine.step_clock``): a read slowed by 20 ms shows in every
    step, and the steps add up to the loop's time (the device loop's stamps tile it the same way)."""
    from runtime.speculative import DecodeState
    eng = Engine.build("q1-tiny", {"device": "cpu"})
    assert eng.step_clock == "host perf_counter, step to step"
    rnd, st = eng.start(PROMPT, seed=3, max_new_tokens=12)
    slow = 20_000_000
    real = DecodeState.width

    def slow_width(self):
        until = time.perf_counter_ns() + slow
        while time.perf_counter_ns() < until:
            pass
        return real(self)
    monkeypatch.setattr(DecodeState, "width", slow_width)
    g = eng.decode(rnd, st)
    assert len(g.steps) >= 3
    assert min(g.step_ns) >= slow
    assert sum(g.step_ns) <= g.loop_ns <= sum(g.step_ns) + 5_000_000
    for t0, dt, t1 in zip(g.step_t0_ns, g.step_ns, g.step_t0_ns[1:]):
        assert 0 <= t1 - (t0 + dt) < 1_000_000     # contiguous: no untimed gap between steps


def test_fingerprint_tells_a_captured_arm_from_an_eager_one():
    """The same pieces run captured are another arm (a line ``execution:captured`` in every width's
    trace); an eager arm's trace, hence its hash, is what it was before the execution existed."""
    eng = Engine.build("q1-tiny", {"device": "cpu"})
    restore = lambda: eng.start(PROMPT, seed=0, max_new_tokens=8)  # noqa: E731
    eager = fpm.fingerprint_arm(types.SimpleNamespace(engine=eng), restore)
    rnd, st = restore()
    st.n_drafts.fill_(5)
    assert eager["widths"][6]["ops"] == fpm.trace_width(rnd, st, 6)
    eng.execution = "captured"      # (the attribute the engine resolves; only a GPU can run it)
    captured = fpm.fingerprint_arm(types.SimpleNamespace(engine=eng), restore)
    cmp = fpm.compare(eager, captured)
    assert not cmp["identical"]
    assert all(captured["widths"][w]["ops"][0] == "execution:captured" for w in fpm.WIDTHS)
    assert "execution:captured" in fpm.describe(cmp, "candidate vs control")
    eng.execution = "eager"
    assert fpm.identical(eager, fpm.fingerprint_arm(types.SimpleNamespace(engine=eng), restore))


# ------------------------------------------------------------------------------------------ GPU tests
GPU_CASES = {
    "mini-fast-stop_rule": ("q1-mini", {"backend": "fast", "dtype": "bfloat16"}),
    "mini-reference-bf16-stop_rule": ("q1-mini", {"dtype": "bfloat16"}),
    "mini-reference-fp32-fixed7": ("q1-mini", {"draft": {"policy": "fixed", "fixed_depth": 7}}),
    "tiny-fast-fixed4": ("q1-tiny", {"backend": "fast", "dtype": "bfloat16",
                                      "draft": {"policy": "fixed", "fixed_depth": 4}}),
}


def gpu_prompt(model: str):
    if model == "q1-tiny":
        return PROMPT * 8
    from snapshots import chat
    code = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n"
    return chat.render([{"role": "user", "content": "Read util.py and explain it"},
                        {"role": "tool_result", "content": code * 6}])


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_captured_decode_is_the_eager_decode(case):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    model, rt = GPU_CASES[case]
    eng = Engine.build(model, {"device": "cuda", **rt})
    assert eng.execution == "device"         # the default on one GPU: the device loop (test_devloop.py)
    prompt = gpu_prompt(model)
    widths = set()
    for seed in range(3):
        rnd, st = eng.start(prompt, seed=seed, max_new_tokens=48)
        r2, s2 = fork_request(rnd, st)
        eng.execution = "eager"
        ref = eng.decode(rnd, st)
        eng.execution = "captured"
        got = eng.decode(r2, s2)
        widths |= {s["width"] for s in ref.steps}
        print(f"{case} seed {seed}: {len(ref.steps)} steps, widths {sorted({s['width'] for s in ref.steps})}, "
              f"tokens/step {ref.tokens_per_step:.2f}; eager step median "
              f"{sorted(ref.step_ns)[len(ref.step_ns) // 2] / 1e3:.0f} us, captured "
              f"{sorted(got.step_ns)[len(got.step_ns) // 2] / 1e3:.0f} us")
        assert got.tokens == ref.tokens
        assert got.steps == ref.steps
        assert len(got.step_ns) == len(got.steps)
    if eng.rt.draft.policy == "stop_rule":
        assert len(widths) >= 2, f"the stop rule's decodes visited one width only ({widths}): a weak check"


@pytest.mark.gpu
def test_gpu_capture_without_putting_the_state_back_is_caught(monkeypatch):
    """Negative control: the warm-up's steps left in the decode state (``_restore=False``). The decode
    must then differ from the eager one, so the comparison above can fail."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    # (budget 128: the un-restored warm-up advances the state by ten steps; the capacity must hold them)
    rnd, st = eng.start(gpu_prompt("q1-mini"), seed=0, max_new_tokens=128)
    r2, s2 = fork_request(rnd, st)
    eng.execution = "eager"
    ref = eng.decode(rnd, st)
    eng.execution = "captured"
    monkeypatch.setattr(eng, "pieces", lambda r, s: CapturedPieces(r, s, eng.rt.draft, _restore=False))
    got = eng.decode(r2, s2)
    assert not same_decode(got, ref)


@pytest.mark.gpu
def test_gpu_captured_decode_of_a_finished_request_captures_nothing():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-tiny", {"device": "cuda"})
    rnd, st = eng.start(PROMPT, seed=0, max_new_tokens=1)     # the first token fills the budget
    assert bool(st.done)
    assert type(eng.pieces(rnd, st)).__name__ == "EagerPieces"
    g = eng.decode(rnd, st)
    assert g.steps == [] and len(g.tokens) == 1
