"""Paired A/B of split-KV attention options on the GPU: the configs' graphs replayed in alternation.

    OUT=... python3 experiments/ab_attention.py [--configs default,tma,...] [--contexts 65536,196608]
                                                [--widths 6] [--rounds 30] [--dry-run]

Each config gets one CUDA graph holding one call per rotating input set (>= 3x L2 of KV, exactly as
``bench_kernels.py`` times them); every round replays every config's graph once, in a fresh (seeded)
random order, so slow drifts of the machine (clocks, temperature, neighbours) and the after-effects of
one replay on the next (a probe's dirty L2 lines) fall on all configs alike. Per shape and config it prints the median time per call, the fraction of the
device-to-device copy bandwidth (KV + q/out bytes, as bench_kernels.py), and against the first config
the median of the per-round ratios with their 10-90 % range: a difference is only worth acting on
when that range excludes 1. The floor probes ``copy``, ``read``, ``read2``, ``tsum``,
``sol{m}_{rows}`` and ``solf{rows}_w{warps}`` (see ``probe_calls``) move the same KV bytes without
computing attention: what one call moving them costs here.
$OUT/ab_attention.json/.csv hold every round's times.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import (DRY_RUN, carveout_hook, carveouts, copy_bandwidth, paired_row, replay_paired,  # noqa: E402
                    write_results)  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import _tma_read  # noqa: E402
import _ws_attention  # noqa: E402
import flashinfer_attention as FI  # noqa: E402
from bench_kernels import attention_sets, copy_same_calls, n_sets, read_floor_calls  # noqa: E402
from runtime.kernels import attention as A  # noqa: E402


@triton.jit
def _stream_read_kernel(K, V, OUT, n_keys, per_split, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Floor probe: program p reads K and V rows of key blocks [p * per_split, (p + 1) * per_split)
    (the split kernel's ranges and tiles, a plain loop at the split's stage count) and writes one
    sum. Session 14 measured it slower than the split itself: a lower bound it is not; ``copy`` is."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_keys, BLOCK_N)
    b0 = pid * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    offs = tl.arange(0, BLOCK_N)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for b in range(b0, b1):
        acc += tl.load(K + b * BLOCK_N * D + offs).to(tl.float32)
        acc += tl.load(V + b * BLOCK_N * D + offs).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc))


@triton.jit
def _sol_read_kernel(K, V, OUT, START, W, NUM_PROGS, CHUNK: tl.constexpr, D: tl.constexpr):
    """Speed-of-light probe (session 17): what any one-launch reader of these bytes needs. Program p
    reads start_pos (as the split kernel must), derives the valid extent [0, start_pos + W) and reads
    its share of K and V rows in CHUNK-row tiles, one K and one V tile in flight per iteration
    (CHUNK x D x 2 B each; no software pipeline: the loop is launched with one stage), and writes one
    sum. No attention arithmetic, no partials, no merge."""
    pid = tl.program_id(0)
    n_keys = tl.load(START).to(tl.int32) + W
    per = tl.cdiv(tl.cdiv(n_keys, CHUNK), NUM_PROGS) * CHUNK
    r0 = pid * per
    r1 = tl.minimum(r0 + per, n_keys)
    rows = tl.arange(0, CHUNK)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([D], tl.float32)
    for r in range(r0, r1, CHUNK):
        ok = (r + rows < r1)[:, None]
        k = tl.load(K + r * D + offs, mask=ok, other=0.0)
        v = tl.load(V + r * D + offs, mask=ok, other=0.0)
        acc += tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0)
    tl.store(OUT + pid * D + tl.arange(0, D), acc)


def probe_calls(name, data, n_keys, d):
    """Calls of a floor probe over the same rotating sets: ``copy`` (torch copies the valid K rows
    into a scratch buffer: read + write = the KV bytes), ``read`` / ``read2`` (``_stream_read_kernel``
    with one / two programs per SM), ``tsum`` (torch sums of the valid K and V rows), ``sol{m}_{rows}``
    (``_sol_read_kernel``), ``solf{rows}_w{warps}[_host|_cg]`` (bench_kernels' read floor), and the TMA
    readers ``tmas{m}_{rows}_s{stages}`` / ``tmaf{rows}`` and ``tmasm{m}_{rows}_s{stages}`` (the
    stream, then its partials merged by the attention's own combine: a split + merge call with no
    arithmetic) (``_tma_read``, sm_90+ only); and FlashInfer's attention ``fi_{backend}_p{page}[_sink]``
    (``flashinfer_attention.py``, when FlashInfer is installed)."""
    if name in ("spacer", "spaced"):   # session 35: the attention calls apart, as the step runs them
        # spacer: a read-only torch sum over a scratch buffer larger than L2 (what a step's kernels between
        # two attention calls do to DRAM and L2, roughly: read other bytes); spaced: each default call
        # followed by that sum. spaced - spacer (paired rounds) is the attention's time between other work
        buf = torch.randn(SPACER_BYTES // 2 if not DRY_RUN else 4096, device=data[0][1].device, dtype=torch.bfloat16)
        spacer = [(lambda: buf.sum(dtype=torch.float32)) for _ in data]
        if name == "spacer":
            return spacer
        return [(lambda a=a, b=b: (a(), b())) for a, b in zip(_launches("default", data), spacer)]
    if FI.PATTERN.fullmatch(name):
        fi_calls = FI.calls(name, data, n_keys)
        if fi_calls is None:
            raise SystemExit(f"{name}: FlashInfer is not importable here (flashinfer_attention.py says how to carry it)")
        return fi_calls
    if _ws_attention.PATTERN.fullmatch(name):
        ws_calls = _ws_attention.calls(name, data)
        if ws_calls is None:
            raise SystemExit(f"{name}: the warp-specialized split needs Gluon and an sm_90+ GPU")
        return ws_calls
    if _tma_read.PATTERN.fullmatch(name):
        tma_calls = _tma_read.calls(name, data)
        if tma_calls is None:
            raise SystemExit(f"{name}: the TMA probes need Gluon and an sm_90+ GPU")
        return tma_calls
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
    if name == "copy":
        return copy_same_calls(data, n_keys)
    if name == "tsum":   # torch's own reductions read the valid K and V rows (two launches)
        return [(lambda k=k, v=v: (k[:, :n_keys].sum(), v[:, :n_keys].sum())) for _, k, v, _, _, _ in data]
    flat = re.fullmatch(r"solf(\d+)_w(\d+)(_host|_cg)?", name)
    if flat:   # bench_kernels' read floor with (first number) rows per tile and (second) warps per
        # program; _host: the extent passed from the host (no start_pos load), _cg: loads cached in L2 only
        return read_floor_calls(data, n_keys, int(flat.group(1)), int(flat.group(2)), host=flat.group(3) == "_host",
                                cache=".cg" if flat.group(3) == "_cg" else "")
    sol = re.fullmatch(r"sol(\d+)_(\d+)", name)
    if sol:   # _sol_read_kernel with (first number) programs per SM and (second) rows per tile
        grid, chunk = sms * int(sol.group(1)), int(sol.group(2))
        return [(lambda k=k, v=v, sp=sp, w=q.shape[0], out=torch.empty(grid, d, device=k.device):
                 _sol_read_kernel[(grid,)](k, v, out, sp, w, grid, CHUNK=chunk, D=d, num_warps=8, num_stages=1))
                for q, k, v, _, sp, _ in data]
    grid = sms * (2 if name == "read2" else 1)
    per = triton.cdiv(triton.cdiv(n_keys, A.BLOCK_N), grid)
    return [(lambda k=k, v=v, out=torch.empty(grid, device=k.device): _stream_read_kernel[(grid,)](
        k, v, out, n_keys, per, BLOCK_N=A.BLOCK_N, D=d, num_warps=A.NUM_WARPS, num_stages=A.NUM_STAGES))
        for _, k, v, _, _, _ in data]


# Floor probes (not attention): what reading these bytes costs in one call, timed the same way.
PROBES = ("copy", "read", "read2", "tsum") + tuple(f"sol{m}_{c}" for m in (1, 2, 4) for c in (64, 128, 256))
PROBES += tuple(f"solf{c}_w{nw}" for c in (8, 16, 32, 64, 128) for nw in (1, 2, 4, 8))
PROBES += tuple(f"solf{c}_w1{o}" for c in (8, 16, 32) for o in ("_host", "_cg"))
# session 19: TMA readers (programs per SM, rows per tile, stages; flat: rows per tile)
PROBES += ("tmasm1_64_s4", "tmasm1_128_s3", "tmasm2_64_s3")   # the stream, its partials and the combine
# session 34: the warp-specialized split and the runtime's combine (_ws_attention: a TMA producer warp,
# one or two consumer warpgroups taking alternate key blocks; names as _ws_attention.options reads them)
# session 39: FlashInfer's batch prefill ("append") attention, what vLLM / SGLang run (flashinfer_attention.py:
# backend, tokens per page, with or without the sink; needs FlashInfer installed, see that module)
PROBES += tuple(f"fi_{b}_p{p}{s}" for b in ("fa2", "fa3", "auto", "holistic") for p in (1, 16, 64) for s in ("", "_sink"))
PROBES += ("ws1_s2", "ws1_s3", "ws1_s4", "ws1_s6", "ws2_s4", "ws2_s4_r200", "ws1_s3_d", "ws2_s4_d", "ws1_s3_n",
           "ws1_s4_n", "ws1_s6_n")
# (call 1 also ran ws2_s5: with an odd stage count its two consumers can take a slot one phase early; removed)
# session 31: the same two launches with a merge that costs nothing (a dependent that only waits), without /
# with the partials' stores
PROBES += ("tmase1_128_s3", "tmasp1_128_s3")
# session 32: the bare stream in the split's buffers (64-key blocks, 4 stages) with each block held 350 /
# 700 ns before its slot is refilled (b) or after (a): a split's arithmetic emulated, in either order
PROBES += tuple(f"tmase1_64_s4_d{ns}{o}" for ns in (350, 700) for o in "ab") + ("tmase1_64_s4",)
# and two such programs per SM (each half the blocks, 3 stages), holding 700 / 1400 ns per block
PROBES += ("tmase2_64_s3", "tmase2_64_s3_d700b", "tmase2_64_s3_d1400b")
# and with the prologue staggered: the first block's copy 300 / 600 / 1200 ns before the others
PROBES += tuple(f"tmase1_64_s4{d}_g{g}" for d in ("", "_d700b") for g in (300, 600, 1200))
# and as 4-warp programs with a CTA barrier per block, as the split's loop has (_k)
PROBES += ("tmase1_64_s4_k", "tmase1_64_s4_d700b_k")
# (session 31's call 8 ran tmasm1_128_s3 / tmasp1_128_s3 with 4-warp programs, a probe version not kept,
# beside the 1-warp ones under the names *_w1: the same times within 0.3 us, so what the partials' stores
# cost these probes is not down to their one warp)
# session 21: the same in one launch: the stream, its partials, a grid-wide arrival and the merge
PROBES += ("tmasb1_128_s3", "tmasb1_64_s4")
PROBES += ("tmas1_64_s4", "tmas1_64_s6", "tmas1_128_s3", "tmas2_64_s3", "tmas4_64_s1", "tmas2_32_s6",
           "tmaf16", "tmaf32", "tmaf64", "tmaf128")

# session 35: the default's calls apart (each followed by a read-only sum over SPACER_BYTES), and that sum
# alone: bench_kernels times attention calls back to back, the step runs them between other kernels
PROBES += ("spacer", "spaced")
SPACER_BYTES = 128 * 2**20

CONFIGS = {
    "default": {},
    "s11_default": dict(combine_one_load=False, combine_num_warps=4, tail_prefetch=False),
    "cnw4": dict(combine_num_warps=4),
    "no_tailpf": dict(tail_prefetch=False),
    "two_loads": dict(combine_one_load=False),
    "tma": dict(tma=True),
    "tailpf": dict(tail_prefetch=True),
    "cnw2": dict(combine_num_warps=2),
    "tma_tailpf": dict(tma=True, tail_prefetch=True),
    "tma_tailpf_cnw2": dict(tma=True, tail_prefetch=True, combine_num_warps=2),
    "v1": dict(variant="v1"),
    "nopdl": dict(pdl=False),
    # the combine releases its dependent (the next call's split) at its start and the split asks L2
    # for its first two blocks before its wait: what a predecessor that triggers early would allow
    "trigger_pf2": dict(_combine_trigger=True, prefetch=2),
    "trigger": dict(_combine_trigger=True),
    "trigger_pf4": dict(_combine_trigger=True, prefetch=4),
    "trigger_pf8": dict(_combine_trigger=True, prefetch=8),
    # the split launched plainly: no overlap with the previous call (its latency, not its throughput)
    "iso": dict(_split_pdl=False),
    # session 16: splits of at most 0 (off) / 1 / 2 / 8 key blocks request their first block's K and V
    # before Q (kv_first); the baseline again (calls 2-3 of session 16: the first config of a run
    # measured up to ~5 % slower than identical code at 64K, so compare against this too)
    "default_again": {},
    "kv_first0": dict(kv_first=0),
    "kv_first1": dict(kv_first=1),
    "kv_first2": dict(kv_first=2),
    "kv_first8": dict(kv_first=8),
    # preferred shared-memory carveouts (_carve: (kernel-name parts or None for all, percent) pairs), set
    # around each launch, so the graph captures them: Triton asks for the largest only above 48 KiB
    # (the split), so the combine's blocks cannot join an SM that still runs a split
    "carve_all100": dict(_carve=((None, 100),)),
    "carve_comb100": dict(_carve=((["_attn_combine_kernel"], 100),)),
    # session 29: the partials' m and l stored by row (attention.ML_BY_ROW, the default since), so each
    # combine program reads 34 sectors of them instead of 264 (132 splits) / by split (the layout before)
    "ml_by_row": dict(ml_by_row=True),
    "ml_by_split": dict(ml_by_row=False),
    # session 37: the partials' acc as acc / l in BF16 (half the bytes the splits write and the combine reads)
    "bf16_partials": dict(partials="bfloat16"),
    # session 38: where BF16 partials lose (1.04-1.07x the default's time): the split alone, its merge empty
    "bf16_partials_empty_merge": dict(partials="bfloat16", _no_combine=True, _empty_dep=True),
    "bf16_partials_cd64": dict(partials="bfloat16", combine_block_d=64),
    "bf16_partials_cd64_cnw4": dict(partials="bfloat16", combine_block_d=64, combine_num_warps=4),
    # with m / l cheap to read, the combine's columns per program (default COMBINE_BLOCK_D = 32) and
    # warps (COMBINE_NUM_WARPS = 2) again
    "cd16": dict(combine_block_d=16),
    "cd64": dict(combine_block_d=64),
    "cd64_cnw4": dict(combine_block_d=64, combine_num_warps=4),
    "cd128_cnw4": dict(combine_block_d=128, combine_num_warps=4),
    # session 31: the split's warps, stages, keys per block and programs per SM again, on today's v2
    # (ml_by_row, KV_FIRST, TAIL_PREFETCH; sessions 10-12 measured these on v1 / early v2)
    "nw8": dict(num_warps=8),
    "nw8_st3": dict(num_warps=8, num_stages=3),
    "st3": dict(num_stages=3),
    "st5": dict(num_stages=5),
    "bn128_st2": dict(block_n=128, num_stages=2),
    "bn128_st2_nw8": dict(block_n=128, num_stages=2, num_warps=8),
    "bn32_st6": dict(block_n=32, num_stages=6),
    "spl264_st2": dict(num_splits=264, num_stages=2),
    # session 31, measurement only (the results are wrong): the attention call split into its parts. The
    # split without its partials' stores (the combine merges stale partials); the combine replaced by a
    # dependent on its grid that only waits (_tma_read._empty_dependent_kernel); both.
    "no_store": dict(_no_store=True),
    "empty_merge": dict(_no_combine=True, _empty_dep=True),
    "no_store_empty_merge": dict(_no_store=True, _no_combine=True, _empty_dep=True),
    # session 32: 16 / 33 / 66 splits (a quarter of the SMs or fewer, each streaming 2-8x the blocks): a
    # split's time per key block with the DRAM lightly loaded, i.e. the rate one SM's split can sustain
    **{f"ns{n}": dict(num_splits=n) for n in (16, 33, 66)},
    # two splits per SM (each half the blocks, processed concurrently with the other's), 2 / 3 stages (3
    # fill 2 x 112 KiB of shared memory), with the combine (264 partials: two chunks) or without it
    **{f"ns264_st{st}{e}": dict(num_splits=264, num_stages=st, **(dict(_no_combine=True, _empty_dep=True) if e else {}))
       for st in (2, 3) for e in ("", "_empty_merge")},
    **{p: None for p in PROBES},
}


def _launches(name, data):
    """Config ``name``'s calls, one per input set (with its carveouts around each launch)."""
    kw = dict(CONFIGS[name])
    carve = kw.pop("_carve", None)
    splits = kw.pop("num_splits", None)
    if kw.pop("_empty_dep", False):   # the split, then a dependent on the combine's grid that only waits
        kw.pop("_no_combine", None)
        calls = _tma_read.without_merge(data, pdl=not DRY_RUN, num_splits=splits, **kw)
    else:
        def launch(q, k, v, s, sp, o):
            A._launch(q, k, v, sp, s, o, ring=False, window=0, num_splits=splits, **kw)
        calls = [(lambda d=d: launch(*d)) for d in data]

    def carved(c):
        with carveouts(None if DRY_RUN else carve):
            c()
    return [(lambda c=c: carved(c)) for c in calls]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="default,s11_default,cnw4,no_tailpf,two_loads,tma",
                    help=f"comma list; the first is the baseline. Known: {', '.join(CONFIGS)}")
    ap.add_argument("--contexts", default="65536,196608")
    ap.add_argument("--widths", default="6")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at toy shapes, one round, no timing")
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if not DRY_RUN and any(n.startswith("carve_") for n in names):
        carveout_hook()   # before any kernel is loaded
    nh, nkv, d = (6, 1, 128) if not DRY_RUN else (6, 1, 64)
    copy_bw = copy_bandwidth()[0]
    l2 = 60 * 2**20
    rows, raw = [], {}
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for w in [int(x) for x in args.widths.split(",")]:
            c_ = ctx if not DRY_RUN else min(ctx, 512)
            cap = c_ + 64
            sets = n_sets(2 * nkv * cap * d * 2, l2) if not DRY_RUN else 2
            data = attention_sets(sets, w, nh, nkv, d, cap, c_ - w, c_)
            nbytes = 2 * nkv * c_ * d * 2 + 2 * w * nh * d * 2 + nh * 4 + 4
            calls = {n: probe_calls(n, data, c_, d) if n in PROBES else _launches(n, data) for n in names}
            shape = f"full{c_ // 1024}K_w{w}"
            times = replay_paired(calls, args.rounds, shape)
            if times is None:
                continue
            base = times[names[0]]
            for n in names:
                rows.append(paired_row(shape, n, times[n], base, nbytes, copy_bw, ctx=c_, w=w, rounds=args.rounds,
                                       sets=sets))
                raw[f"{shape}_{n}"] = times[n]
            del data, calls
            torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    write_results("ab_attention", {"copy_Bps": copy_bw, "configs": {n: repr(CONFIGS[n]) for n in names},
                                   "times_us": raw}, rows)


if __name__ == "__main__":
    main()
