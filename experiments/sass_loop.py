"""Predict a kernel change before spending GPU time: compile one MoE launch for the H200 (sm_90) on a
machine without a GPU and print its registers, shared memory and the instruction mix of its hot loop.

    python3 experiments/sass_loop.py --launch gate_up [--opts gu_weights_a=False,gu_num_stages=3]
            [--w 6] [--sass out.sass]

The launch is the one ``moe_plan`` builds at the q1 rank-emulation shard (H 6144, I 256, 128 experts,
``--w`` rows, 8 experts per row), compiled through ``tests/kernels/_sm90_compile.py``'s stand-in driver
(Triton's own compile, no interpreter). The hot loop is the backward branch whose body holds the most
MMA instructions; its instructions are counted by opcode (``cuobjdump -sass``, shipped with Triton).
Session 23 used it to predict the MoE's operand-order change (experiments/notes/kernels.md).
"""
from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = {"gate_up": "_moe_gate_up_kernel", "down": "_moe_down_wide_kernel"}


def hot_loop(sass: str) -> list[str]:
    """Instructions (opcode and operands) of the backward branch's body with the most MMAs."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    best: tuple[int, list[str]] = (-1, [])
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            n = sum("MMA" in t for t in body)
            if n > best[0]:
                best = (n, body)
    return best[1]


def opcode_mix(body: list[str]) -> collections.Counter:
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launch", choices=sorted(LAUNCHES), default="gate_up")
    ap.add_argument("--opts", default="", help="moe_plan keywords, e.g. gu_weights_a=False,gu_num_stages=3 "
                    "(values read as Python literals)")
    ap.add_argument("--w", type=int, default=6, help="live rows")
    ap.add_argument("--sass", default=None, help="also write the whole SASS here")
    args = ap.parse_args()
    opts = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.opts.split(",") if kv)}
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels")]
    import torch
    import triton
    from triton.runtime import driver

    import _sm90_compile as C

    sink: list = []
    driver.set_active(C._Sm90Driver())
    M = C._compile_only("moe", sink)
    M.pdl_supported = lambda device: True
    g = torch.Generator().manual_seed(0)
    w, E, H, I = args.w, 128, 6144, 256
    x = torch.randn(w, H, generator=g).to(torch.float16)
    ids = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(w)]).to(torch.int32)
    w13 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
    _, steps = M.moe_plan(x, ids, torch.rand(w, 8), w13, torch.ones(E, 2 * I // 128, H // 128), w2,
                          torch.ones(E, H // 128, I // 128), **opts)
    dict(steps)[args.launch]()
    name, grid, kernel, _ = next(s for s in sink if s[0] == LAUNCHES[args.launch])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    usage = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", res)
    body = hot_loop(sass)
    mix = opcode_mix(body)
    print(f"{name} grid {tuple(grid)} {opts or 'defaults'}: {usage.group(0) if usage else '?'}, "
          f"shared memory {kernel.metadata.shared} B, wgmma in PTX: {'wgmma' in kernel.asm['ptx']}")
    print(f"hot loop: {len(body)} instructions; " + ", ".join(f"{k} {v}" for k, v in mix.most_common(16)))


if __name__ == "__main__":
    main()
