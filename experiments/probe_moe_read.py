"""Probe (session 22): how fast can the MoE Gate/Up's weight bytes be *read*, with the Gate/Up's own
access pattern and grid, with no arithmetic? Tells whether the Gate/Up (about 3 TB/s over its call:
sessions 21-22's timelines) is held back by its loop's work or by reading those bytes this way.

    OUT=... python3 experiments/probe_moe_read.py [--configs ...] [--distinct 38] [--rounds 30] [--dry-run]

Readers (each XOR-folds every 32-bit word it reads into one value per program, stored, so that no
load can be dropped), on the same rotating weight sets and routing as ``ab_moe.py``:
  gate_up        the v1 Gate/Up launch itself (E4M3 products, SiLU * mul, activations)
  rows_u{U}      the Gate/Up's grid and addresses: program (expert group, 32 columns) reads its 32 Gate
                 and 32 Up rows, U x 128 B of each row per loop iteration into registers (Triton does
                 not software-pipeline loads that feed no dot, so U sets the bytes in flight: U x 8 KiB)
  tiled_u{U}     the Gate/Up's grid, each program reading one contiguous 64 x H-byte region of its expert
                 (8 KiB per K step, U steps per iteration): what a weight layout with each program's
                 tiles contiguous would read (the same bytes, other addresses; session 26)
  flat{KB}       one program per contiguous KB-KiB piece of each distinct expert's Gate/Up weights
                 (the same bytes as contiguous streams; many small programs in flight, like a copy)
Prints the median time per call, the bytes (the distinct experts' Gate/Up weights) and the fraction of
the copy bandwidth; $OUT/probe_moe_read.json holds every round.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import DEV, copy_bandwidth, paired_row, replay_paired, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_kernels import MOE, moe_data, moe_sets  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402


@triton.jit
def _rows_read_kernel(W13, IDS, OUT, stride_we, stride_wn, P, H: tl.constexpr, I: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    g = tl.program_id(0)
    nb = tl.program_id(1)
    expert, n_groups, _pair, _ok = M._expert_group(IDS, g, P, BLOCK_P, 16)
    if g < n_groups:
        W = W13.to(tl.pointer_type(tl.int32))
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 32)                     # 32 words = 128 B of a row per K step
        row_g = W + expert.to(tl.int64) * (stride_we // 4) + offs_n[:, None] * (stride_wn // 4)
        row_u = row_g + I * (stride_wn // 4)
        acc = tl.zeros([BLOCK_N, 32], tl.int32)
        for k00 in range(0, H // 4, 32 * UNROLL):
            for u in tl.static_range(UNROLL):
                kk = k00 + u * 32 + offs_k
                acc ^= tl.load(row_g + kk[None, :]) ^ tl.load(row_u + kk[None, :])
        tl.store(OUT + g * tl.num_programs(1) + nb, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _flat_read_kernel(W13, IDS, OUT, stride_we, P, PIECES: tl.constexpr, WORDS: tl.constexpr,
                      BLOCK_P: tl.constexpr):
    g = tl.program_id(0)
    piece = tl.program_id(1)
    expert, n_groups, _pair, _ok = M._expert_group(IDS, g, P, BLOCK_P, 16)
    if g < n_groups:
        W = W13.to(tl.pointer_type(tl.int32)) + expert.to(tl.int64) * (stride_we // 4) + piece * WORDS
        v = tl.load(W + tl.arange(0, WORDS))
        tl.store(OUT + g * PIECES + piece, tl.xor_sum(v, 0))


@triton.jit
def _tiled_read_kernel(W13, IDS, OUT, stride_we, P, H: tl.constexpr, I: tl.constexpr, BLOCK_P: tl.constexpr,
                       UNROLL: tl.constexpr):
    g = tl.program_id(0)
    nb = tl.program_id(1)
    expert, n_groups, _pair, _ok = M._expert_group(IDS, g, P, BLOCK_P, 16)
    if g < n_groups:
        W = W13.to(tl.pointer_type(tl.int32)) + expert.to(tl.int64) * (stride_we // 4) + nb * (64 * H // 4)
        offs = tl.arange(0, 2048)                     # 64 rows x 128 B = 8 KiB per K step, contiguous
        acc = tl.zeros([2048], tl.int32)
        for k00 in range(0, H // 128, UNROLL):
            for u in tl.static_range(UNROLL):
                acc ^= tl.load(W + (k00 + u) * 2048 + offs)
        tl.store(OUT + g * tl.num_programs(1) + nb, tl.xor_sum(acc, 0))


def _calls(name, data, out):
    H, I = MOE["H"], MOE["I"]
    if name == "gate_up":
        res = []
        for x, ids, tw, wt, o in data:
            steps = dict(M.moe_plan(x, ids, tw, *wt, o)[1])
            res.append(steps["gate_up"])
        return res
    res = []
    for x, ids, tw, (w13, *_), o in data:
        P = ids.numel()
        ids32 = ids.to(torch.int32).contiguous()
        bp = max(16, triton.next_power_of_2(P))
        if name.startswith("tiled"):
            un = int(name[len("tiled_u"):])
            res.append(lambda w13=w13, ids32=ids32, P=P, un=un, bp=bp: _tiled_read_kernel[(min(P, 128), I // 32)](
                w13, ids32, out, w13.stride(0), P, H=H, I=I, BLOCK_P=bp, UNROLL=un, num_warps=4))
        elif name.startswith("rows"):
            un = int(name[len("rows_u"):])
            res.append(lambda w13=w13, ids32=ids32, P=P, un=un, bp=bp: _rows_read_kernel[(min(P, 128), I // 32)](
                w13, ids32, out, w13.stride(0), w13.stride(1), P, H=H, I=I, BLOCK_P=bp, BLOCK_N=32, UNROLL=un,
                num_warps=4))
        else:
            kb = int(name[len("flat"):])
            words = kb * 256
            pieces = 2 * I * H // (kb * 1024)
            res.append(lambda w13=w13, ids32=ids32, P=P, words=words, pieces=pieces, bp=bp: _flat_read_kernel[(min(P, 128), pieces)](
                w13, ids32, out, w13.stride(0), P, PIECES=pieces, WORDS=words, BLOCK_P=bp,
                num_warps=4 if words <= 4096 else 8))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="gate_up,rows_u2,rows_u4,rows_u8,flat16,flat64,gate_up_again")
    ap.add_argument("--distinct", type=int, default=MOE["realistic"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at toy shapes (no timer)")
    args = ap.parse_args()
    H, I, w = MOE["H"], MOE["I"], MOE["w"]
    copy_bw = copy_bandwidth()[0]
    data = moe_data(moe_sets(MOE["sets"]), w, args.distinct)
    out = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)
    names = args.configs.split(",")
    graphs = {n: _calls(n.replace("_again", ""), data, out) for n in names}
    shape = f"w{w}_distinct{args.distinct}"
    times = replay_paired(graphs, args.rounds, shape)
    if times is None:
        return
    nbytes = args.distinct * 2 * I * H
    rows = [paired_row(shape, n, times[n], times[names[0]], nbytes, copy_bw) for n in names]
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s; bytes: the {args.distinct} experts' Gate/Up weights, "
          f"{nbytes / 1e6:.1f} MB")
    write_results("probe_moe_read", dict(copy_Bps=copy_bw, times=times), rows)


if __name__ == "__main__":
    main()
