"""Every launch configuration of the kernels compiles for the H200 (sm_90) without a GPU.

The interpreter checks the kernels' arithmetic but not that Triton can compile them for Hopper, nor
what they cost in registers and shared memory. ``_sm90_compile.py`` runs in a subprocess (Triton's
own library functions must not be interpreted there): a stand-in driver reports a
compute-capability-9.0 target, and each launcher runs with its kernels replaced by "compile only"
(``JITFunction.warmup``). Checked: every kernel compiles, shared memory fits one block's opt-in
limit (227 KiB), and the cubins use no local memory or stack (no register spills). CPU only (where
CUDA exists the GPU tests compile for real).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import cpu_only

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@cpu_only
def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, os.path.join(HERE, "_sm90_compile.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert not report["problems"], report["problems"]
    assert {"_attn_split_kernel", "_attn_combine_kernel", "_attn_fused_kernel", "_moe_gate_up_kernel",
            "_moe_gate_up_v2_kernel", "_moe_down_v2_kernel",
            "_moe_down_kernel", "_moe_down_wide_kernel", "_moe_reduce_kernel", "_add_rmsnorm_kernel",
            "_sample_kernel", "_rope_kv_kernel", "_router_kernel", "_route_folded_kernel", "_rope_tables_kernel", "_take_draft_kernel",
            "_settle_kernel", "_peer_add_rmsnorm_kernel"} <= set(report["kernels"])


def test_ptx_marks_catch_an_option_that_changes_nothing():
    """Negative control of the PTX check in ``_sm90_compile``: a launch whose keyword asks for an
    instruction its PTX lacks (or the reverse) is reported; a consistent one is not."""
    sys.path.insert(0, HERE)
    try:
        from _sm90_compile import ptx_problems
    finally:
        sys.path.remove(HERE)

    class _K:
        def __init__(self, ptx):
            self.asm = {"ptx": ptx}

    name = "_attn_split_v2_kernel"
    good = [(name, (1,), _K("prefetch.global.L2 [x];"), dict(TAIL_PREFETCH=True, PDL=False)),
            (name, (1,), _K("ld.global"), dict(TAIL_PREFETCH=False, TMA=False, PDL=False))]
    assert ptx_problems(good) == []
    bad = [(name, (1,), _K("ld.global"), dict(TAIL_PREFETCH=True)),
           (name, (1,), _K("cp.async.bulk.tensor.2d"), dict(TMA=False)),
           (name, (1,), _K("ld.global"), dict(PDL=True))]
    assert len(ptx_problems(bad)) == 3
    gu = "_moe_gate_up_kernel"   # the weights-as-A products on mma.sync, never wgmma
    assert ptx_problems([(gu, (1,), _K("mma.sync.aligned.m16n8k16"), dict(WEIGHTS_A=True)),
                         (gu, (1,), _K("wgmma.mma_async"), dict(WEIGHTS_A=False))]) == []
    assert len(ptx_problems([(gu, (1,), _K("wgmma.mma_async.sync.aligned"), dict(WEIGHTS_A=True)),
                             ("_moe_down_wide_kernel", (1,), _K("ld.global"), dict(WEIGHTS_A=True))])) == 2


def test_stack_allowance_only_for_the_fp64_trig_launches():
    """The compile check allows a stack frame (libdevice's FP64 cos / sin reduction) only in the RoPE
    launches that call those functions; any other kernel's stack is still reported (negative side)."""
    sys.path.insert(0, HERE)
    try:
        from _sm90_compile import _fp64_trig
    finally:
        sys.path.remove(HERE)
    assert _fp64_trig("_rope_tables_kernel", {}) and _fp64_trig("_rope_kv_kernel", {"ANGLES": True})
    assert not _fp64_trig("_rope_kv_kernel", {"ANGLES": False}) and not _fp64_trig("_rope_kv_kernel", {})
    assert not _fp64_trig("_linear_kernel", {"ANGLES": True})
