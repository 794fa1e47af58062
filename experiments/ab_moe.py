"""Paired A/B of fused MoE options on the GPU: the configs' graphs replayed in alternation.

    OUT=... python3 experiments/ab_moe.py [--configs default,nb4,...] [--distinct 38,48] [--widths 6]
                                          [--rounds 40] [--dry-run]

Each config gets one CUDA graph holding one call per rotating weight set (3 x 576 MiB of q1-shard
expert weights, far beyond L2, exactly as ``bench_kernels.py`` times the MoE); every round replays
every config's graph once, in a balanced seeded order behind a spin kernel (``_bench.paired_rounds``). A config
named ``down:NAME`` times only the Down launch of NAME's plan (its Gate/Up run once beforehand to fill
the activations), like the breakdown rows of ``bench_kernels.py``. Per shape and config it prints the
median time per call, the fraction of the copy bandwidth (whole MoE: weights of the distinct experts
plus x and out; Down: its weights plus the FP32 per-pair output) and, against the first config of its
kind (whole or ``down:``), the median per-round ratio with its 10-90 % range.
$OUT/ab_moe.json/.csv hold every round's times.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import DEV, SPIN_CYCLES_PER_US, copy_bandwidth, paired_row, replay_paired, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402

from bench_kernels import MOE, moe_bytes, moe_data, moe_sets  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402
from runtime.kernels.prefetch import expert_prefetch, max_items  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CONFIGS = {
    "default": {},
    "default_again": {},
    # the wide Down's shape: column blocks per program and pipeline stages (defaults DOWN_NB_WEIGHTS_A = 4,
    # DOWN_WIDE_NUM_STAGES_WEIGHTS_A = 2 since session 28; 6 and 3 before: nb6_st3)
    "nb6_st3": dict(down_nb=6, down_num_stages=3),
    "nb4": dict(down_nb=4),
    "nb5": dict(down_nb=5),
    "nb12": dict(down_nb=12),
    "down_st2": dict(down_num_stages=2),
    "down_st4": dict(down_num_stages=4),
    # BF16 operands in the wide Down (FP16 since session 10)
    "down_bf16": dict(down_f16=False),
    # Gate/Up one K step per iteration (two since session 13)
    "gu_unroll1": dict(gu_unroll=1),
    # Gate/Up, Down and reduce launched plainly (no programmatic dependent launch)
    "no_pdl": dict(pdl=False),
    # the Gate/Up with x as the MMA's A operand (the form before session 23; default since: the
    # weights), and the weights-A form's stages, one K step per iteration, a 128-register cap
    "gu_x_a": dict(gu_weights_a=False),
    "gu_st3": dict(gu_num_stages=3),
    "gu_st3_r128": dict(gu_num_stages=3, gu_maxnreg=128),
    **{f"gu_u1_st{st}": dict(gu_unroll=1, gu_num_stages=st) for st in (6, 8)},
    # the wide Down with the activations as the MMA's A operand (the form before session 23, with its
    # 8 column blocks per program; default since: the weight tile, 6 blocks), and both old forms
    "down_x_a": dict(down_weights_a=False),
    "x_a": dict(gu_weights_a=False, down_weights_a=False),
    "nb8": dict(down_nb=8),
    # the wide Down's group from the Gate/Up's group table (group_table) / ranked from the ids, and the
    # table with 4 / 8 column blocks per Down program
    "gt": dict(group_table=True),
    "ranked": dict(group_table=False),
    "gt_nb4": dict(group_table=True, down_nb=4),
    "gt_nb8": dict(group_table=True, down_nb=8),
    # the groups ranked through the experts' bitmap (group_bits) / by P x P comparisons
    "bits": dict(group_bits=True),
    "no_bits": dict(group_bits=False),
    "bits_ranked": dict(group_bits=True, group_table=False),
    # the Down ranking the ids itself and L2-prefetching its first N weight tiles (128 rows x I each)
    # before its wait (down_prefetch; session 11 measured 2 / 4 / 8 slower, before the Down's programs
    # could share an SM with the Gate/Up's: session 28's carveout and 4 x 2 Down; session 42: no gain either)
    **{f"ranked_pf{n}": dict(group_table=False, down_prefetch=n) for n in (1, 2, 4)},
    # the expert prefetch's ceiling in isolation (FastModel.expert_prefetch, session 45): N MiB of the
    # call's own experts' Gate/Up weights asked of L2 (runtime/kernels/prefetch.py), a spin of 10 us (no
    # memory traffic: time for the prefetch to land), then the MoE. sleep10 is the same without the
    # prefetch: compare pfN_sleep10 with it (both times include the spin)
    "sleep10": dict(_sleep_us=10),
    **{f"pf{n}_sleep10": dict(_sleep_us=10, _prefetch_mib=n) for n in (8, 16, 32, 48)},
    # the same ranges read by a plain load kernel (_warm_kernel) instead of asked for: the L2 residency's
    # own ceiling, whatever the prefetch instruction costs; warmx reads as many bytes of another weight
    # set (the control: the same launch and traffic, nothing the MoE then finds in L2)
    **{f"warm{n}_sleep10": dict(_sleep_us=10, _warm_mib=n) for n in (8, 16, 32)},
    **{f"warmx{n}_sleep10": dict(_sleep_us=10, _warm_mib=n, _warm_other=True) for n in (8, 16, 32)},
    # the same with the budget as every row's first K columns (expert_prefetch k_first): every Gate/Up
    # program's first K steps
    **{f"pfk{n}_sleep10": dict(_sleep_us=10, _prefetch_mib=n, _k_first=True) for n in (8, 16, 32, 48)},
    **{f"warmk{n}_sleep10": dict(_sleep_us=10, _warm_mib=n, _k_first=True) for n in (8, 16, 32, 48)},
    **{f"warmxk{n}_sleep10": dict(_sleep_us=10, _warm_mib=n, _warm_other=True, _k_first=True) for n in (8, 16, 32, 48)},
    **{f"pfk{n}_only": dict(_prefetch_mib=n, _no_moe=True, _k_first=True) for n in (8, 32)},
    **{f"warmk{n}_only": dict(_warm_mib=n, _no_moe=True, _k_first=True) for n in (8, 32)},
    # the prefetch / the warm alone (no spin, no MoE): what the launch itself takes
    **{f"pf{n}_only": dict(_prefetch_mib=n, _no_moe=True) for n in (8, 32)},
    **{f"warm{n}_only": dict(_warm_mib=n, _no_moe=True) for n in (8, 32)},
}
_PROBE_KEYS = {"_sleep_us", "_prefetch_mib", "_warm_mib", "_warm_other", "_no_moe", "_k_first"}



def _chunks(ids, w13, budget, k_first):
    """(offsets int64, sizes int32, count [1]) of the chunks expert_prefetch asks for (its dry form), sized
    to the bound, unused entries size 0."""
    E, two_i, H = w13.shape
    m = max_items(ids.numel(), E, two_i // 2, H, budget, k_first=k_first)
    offs = torch.zeros(m, dtype=torch.int64, device=w13.device)
    sizes = torch.zeros(m, dtype=torch.int32, device=w13.device)
    n = torch.zeros(1, dtype=torch.int32, device=w13.device)
    expert_prefetch(ids, w13, budget, k_first=k_first, dry=(offs, sizes, n))
    return offs, sizes, n


@triton.jit
def _warm_kernel(w_ptr, offs_ptr, sizes_ptr, sink_ptr, WARM_BLOCK: tl.constexpr):
    """One program per chunk: reads its ``size`` bytes at ``off`` (as int32 words) and folds them into an
    xor that is stored only if it equals a value the data cannot produce at run time (so the loads stay)."""
    c = tl.program_id(0)
    off = tl.load(offs_ptr + c)
    size = tl.load(sizes_ptr + c)
    base = (w_ptr + off).to(tl.pointer_type(tl.int32))
    acc = tl.zeros([WARM_BLOCK], dtype=tl.int32)
    j = tl.arange(0, WARM_BLOCK)
    for k in range(0, size // 4, WARM_BLOCK):
        acc ^= tl.load(base + k + j, mask=k + j < size // 4, other=0)
    x = tl.xor_sum(acc, 0)
    tl.store(sink_ptr, x, mask=(x == 0x7FFFFFFF) & (size < 0))


def _calls(name, data):
    """The graph's calls for config ``name``: whole MoE calls, or for ``down:NAME`` the Down launch of
    each set's plan (the plan's launches run once here, so the activations are real)."""
    down = name.startswith("down:")
    kw = dict(CONFIGS[name.split(":", 1)[1] if down else name])
    probe = {k: kw.pop(k) for k in _PROBE_KEYS & set(kw)}
    spin, pf_mib, warm_mib = probe.get("_sleep_us", 0), probe.get("_prefetch_mib", 0), probe.get("_warm_mib", 0)
    k_first = bool(probe.get("_k_first"))
    if not down:
        warm = [None] * len(data)
        if warm_mib:   # each call's chunks (the prefetch's own ranges), read from its set or the next one
            for i, (_, ids, _, wt, _) in enumerate(data):
                j = (i + 1) % len(data) if probe.get("_warm_other") else i
                warm[i] = (data[j][3][0], *_chunks(ids, wt[0], warm_mib << 20, k_first))

        def call(i, x, ids, tw, wt, o):
            if pf_mib:
                expert_prefetch(ids, wt[0], pf_mib << 20, k_first=k_first)
            if warm[i] is not None:
                w13, offs, sizes, n = warm[i]
                _warm_kernel[(offs.numel(),)](w13, offs, sizes, n, WARM_BLOCK=4096, num_warps=4)
            if spin:
                torch.cuda._sleep(int(spin * SPIN_CYCLES_PER_US))
            if not probe.get("_no_moe"):
                M.fused_moe_fp8(x, ids, tw, *wt, o, **kw)
        return [(lambda i=i, d=d: call(i, *d)) for i, d in enumerate(data)]
    if probe:
        raise ValueError(f"{name}: the spin / prefetch / warm configs are whole-call configs only")
    out = []
    for x, ids, tw, wt, o in data:
        steps = dict(M.moe_plan(x, ids, tw, *wt, o, **kw)[1])
        for launch in steps.values():
            launch()
        out.append(steps["down"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="default,default_again,down:default,down:down_bf16",
                    help="comma list; the first whole and the first down: config are the baselines. "
                         f"Known: {', '.join(CONFIGS)} (each also as down:NAME)")
    ap.add_argument("--distinct", default=None, help="distinct experts per layer (default: realistic and all w x 8)")
    ap.add_argument("--widths", default=str(MOE["w"]))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at toy shapes, one call, no timing")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n.split(":", 1)[-1] not in CONFIGS or (":" in n and not n.startswith("down:"))]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)} (each also as down:NAME)")
    gpu_only = [n for n in names if set(CONFIGS[n.split(":", 1)[-1]]) & _PROBE_KEYS]
    if gpu_only and str(DEV) != "cuda":
        ap.error(f"{gpu_only}: the spin and the L2 prefetch need a CUDA GPU (not the dry run's interpreter)")
    H, I, E = MOE["H"], MOE["I"], MOE["E"]
    copy_bw = copy_bandwidth()[0]
    weights = moe_sets(MOE["sets"])
    rows, raw = [], {}
    for w in [int(v) for v in args.widths.split(",")]:
        distinct = ([int(v) for v in args.distinct.split(",")] if args.distinct
                    else [MOE["realistic"], w * 8])
        for dist in distinct:
            data = moe_data(weights, w, dist)
            nb = moe_bytes(w, dist)
            calls = {n: _calls(n, data) for n in names}
            shape = f"w{w}_distinct{dist}"
            times = replay_paired(calls, args.rounds, shape)
            if times is None:
                continue
            base = {kind: next(n for n in names if n.startswith("down:") == kind) for kind in (False, True)
                    if any(n.startswith("down:") == kind for n in names)}
            for n in names:
                down = n.startswith("down:")
                rows.append(paired_row(shape, n, times[n], times[base[down]], nb["down" if down else "call"],
                                       copy_bw, f" vs {base[down]}", w=w, distinct=dist, rounds=args.rounds,
                                       sets=len(data)))
                raw[f"{shape}_{n}"] = times[n]
            del data, calls
            torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s  ({DEV}, H {H}, I {I}, E {E})")
    write_results("ab_moe", {"copy_Bps": copy_bw, "configs": {n: repr(CONFIGS[n.split(':', 1)[-1]]) for n in names},
                             "times_us": raw}, rows)


if __name__ == "__main__":
    main()
