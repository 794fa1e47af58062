"""Paired A/B of the fused all-reduce's kernels (runtime/kernels/peer.py; the MoE reduce's and the output
projection's forms with the exchange inside) alone, on the GPU.

    OUT=... python3 experiments/ab_peer.py [--configs peer,norm,...] [--rows 6] [--ranks 8]
                                           [--chain 64] [--rounds 40] [--dry-run]

Each config gets one CUDA graph holding a chain of ``--chain`` launches at q1's width (H = 6,144),
every launch adding into one residual, so each waits for the one before (programmatic dependents, as
in the step); even launches also write the FP16 copy (the post-attention norm's form in the step).
The exchange is rank emulation's (``PeerExchange.emulated``: the peers' buffers static zeros, so
every launch does a real rank's loads without waiting), exactly what ``bench_step --ab peer_fused``
runs. Every round replays every config's graph once in a balanced seeded order (``_bench.paired_rounds``).

Per config: the median time per launch and, against the first config, the median per-round ratio
with its 10-90 % range. ``norm`` is ``fused_add_rmsnorm`` (what a rank runs where NCCL has already
all-reduced): the difference to it is what the exchange costs a point under emulation.
``--list`` prints the configs. $OUT/ab_peer.json/.csv hold every round's times.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import CUDA, DEV, DRY_RUN, paired_stats, replay_paired, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402

from runtime.kernels import linear as L  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402
from runtime.kernels import norm as N  # noqa: E402
from runtime.kernels import peer as P  # noqa: E402

# name -> (ranks or None for the --ranks value, peer_add_rmsnorm keywords); "norm": fused_add_rmsnorm;
# names starting "reduce": the MoE reduce's launches, "proj": the output projection's (below)
CONFIGS = {
    "peer": (None, {}),
    "peer_again": (None, {}),          # A/A
    "norm": (None, None),
    "s49": (None, dict(fence="sys", rearm_lag=1, one_reduce=False)),   # the kernel as session 49 left it
    "lag1": (None, dict(fence="sys_acq", rearm_lag=1)),   # the re-arm one point back with the fence it needs
    "ranks1": (1, {}),                 # no peer loads: the publication, the state, the re-arm
    "ranks2": (2, {}),
    "fence_sys": (None, dict(fence="sys")),
    "fence_gpu": (None, dict(fence="gpu")),
    "fence_sys_acq": (None, dict(fence="sys_acq")),
    "fence_sys_rel": (None, dict(fence="sys_rel")),
    "fence_sys_one": (None, dict(fence="sys_one")),
    "fence_gpu_one": (None, dict(fence="gpu_one")),
    "two_reduce": (None, dict(one_reduce=False)),
    "no_rearm": (None, dict(_no_rearm=True)),
    "seq_first": (None, dict(_seq_first=True)),
    "floor": (None, dict(_seq_first=True, _no_rearm=True)),
    # the MoE reduce (8 experts a row): with the next add + norm (what a single rank runs), with the
    # all-reduce over the exchange inside it too (the fused all-reduce's default), and writing the rank's
    # partial sum for the exchange's own kernel after it (peer_moe_reduce=False): two launches a point
    "reduce_norm": (None, "norm"),
    "reduce_peer": (None, "peer"),
    "reduce_then_peer": (None, "apart"),
    # the output projection (q1's rank: 6 heads' 768 columns into 6,144) with the residual add, the sums of
    # squares and the folded routing's partials in its epilogue (what a single rank runs), with the all-reduce
    # over the exchange inside it too (the fused all-reduce's default since session 51), the same with the
    # arrival ticket relaxed, with one rank (no peer loads) or no re-arm, and the plain projection followed
    # by the exchange's own kernel (peer_o_proj=False: two launches a point)
    "proj_resid": (None, "proj"),
    "proj_peer": (None, "proj_peer"),
    "proj_peer_relaxed": (None, "proj_peer_relaxed"),
    "proj_peer_ranks1": (1, "proj_peer"),
    "proj_peer_no_rearm": (None, "proj_peer_no_rearm"),
    "proj_then_peer": (None, "proj_apart"),
}
DEFAULT = ("peer,norm,peer_again,s49,lag1,ranks1,ranks2,fence_sys,fence_gpu,fence_sys_acq,fence_sys_one,two_reduce,"
           "no_rearm,seq_first,floor,reduce_norm,reduce_peer,reduce_then_peer,proj_resid,proj_peer,proj_peer_relaxed,"
           "proj_peer_ranks1,proj_peer_no_rearm,proj_then_peer")
PROJ = {"proj": None, "proj_peer": {}, "proj_peer_relaxed": {"ticket": "relaxed"}, "proj_peer_no_rearm": {"_no_rearm": True}}


def chain(config: str, rows: int, ranks: int, n: int, H: int, seed: int) -> list:
    """The config's ``n`` launches (closures) on its own residual and exchange."""
    R, kw = CONFIGS[config]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, H, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4)]
    res = torch.randn(rows, H, generator=g).to(torch.bfloat16).to(DEV)
    wt = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    out = torch.empty(rows, H, dtype=torch.bfloat16, device=DEV)
    out16 = torch.empty(rows, H, dtype=torch.float16, device=DEV)
    eps = 1e-6
    if kw is None:
        return [(lambda i=i: N.fused_add_rmsnorm(xs[i % 4], res, wt, eps, out=out, out16=out16 if i % 2 == 0 else None))
                for i in range(n)]
    xchg = P.PeerExchange.emulated(R or ranks, 0, 8, H, DEV)
    if config.startswith("reduce"):
        ys = [torch.randn(rows * 8, H, generator=g).to(DEV) for _ in range(4)]
        tw = torch.rand(rows, 8, generator=g).to(DEV)
        cnt = torch.zeros(8, dtype=torch.int32, device=DEV)
        pdl = CUDA
        if kw == "apart":
            return [(lambda i=i: (M._launch_reduce(ys[i % 4], tw, out, pdl=pdl),
                                  P.peer_add_rmsnorm(out, res, wt, eps, xchg, out=out16.view(torch.bfloat16))))
                    for i in range(n)]
        peer = (xchg, {}) if kw == "peer" else None
        return [(lambda i=i: M._launch_reduce(ys[i % 4], tw, out, pdl=pdl, norm=(res, wt, eps, cnt), peer=peer))
                for i in range(n)]
    if config.startswith("proj"):
        K, E = (768, 128) if H == 6144 else (128, 16)
        ins = [torch.randn(rows, K, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4)]
        w = (torch.randn(H, K, generator=g) / K ** 0.5).to(torch.bfloat16).to(DEV)
        router = torch.randn(E, H, generator=g).to(torch.bfloat16).to(DEV)
        ssq = torch.empty(rows, L.ssq_blocks(H, K, DEV), dtype=torch.float32, device=DEV)
        pl = torch.empty(L.fold_shape(H, K, E, DEV), dtype=torch.float32, device=DEV)
        cnt = torch.zeros(H // 16 + 1, dtype=torch.int32, device=DEV)
        if kw == "proj_apart":
            return [(lambda i=i: P.peer_add_rmsnorm(L.skinny_linear(ins[i % 4], w, out, counter=cnt), res, wt, eps,
                                                    xchg, out=out16.view(torch.bfloat16))) for i in range(n)]
        pk = PROJ[kw]
        peer = None if pk is None else (xchg, pk)
        return [(lambda i=i: L.skinny_linear(ins[i % 4], w, counter=cnt, residual=(res, ssq), fold=(router, wt, pl),
                                             peer=peer)) for i in range(n)]
    return [(lambda i=i: P.peer_add_rmsnorm(xs[i % 4], res, wt, eps, xchg, out=out,
                                            out16=out16 if i % 2 == 0 else None, **kw))
            for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT, help="comma-separated, the first is the baseline (--list)")
    ap.add_argument("--rows", default="6", help="rows per launch (comma-separated: one table each)")
    ap.add_argument("--ranks", type=int, default=8, help="the emulated ranks (q1's TP = 8)")
    ap.add_argument("--chain", type=int, default=64, help="launches per graph")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--list", action="store_true", help="print the configs and exit")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter at a toy width, one launch, no timing")
    args = ap.parse_args()
    if args.list:
        for k, (R, kw) in CONFIGS.items():
            print(f"{k:>24}  ranks {R or args.ranks}  {'fused_add_rmsnorm' if kw is None else kw}")
        return
    names = args.configs.split(",")
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown} (--list)")
    H = 256 if DRY_RUN else 6144
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        shape = f"w{rows}_R{args.ranks}"
        calls = {c: chain(c, rows, args.ranks, 1 if DRY_RUN else args.chain, H, seed=rows) for c in names}
        times = replay_paired(calls, args.rounds, shape)
        if times is None:
            continue
        base, norm = times[names[0]], times.get("norm")
        for c in names:
            st = paired_stats(times[c], base)
            over = "" if norm is None else f"  over norm {st['us'] - paired_stats(norm, base)['us']:+6.2f} us"
            print(f"{shape:>8} {c:>22} {st['us']:7.2f} us  ratio {st['ratio']:.4f} [{st['ratio_p10']:.4f}, "
                  f"{st['ratio_p90']:.4f}]{over}", flush=True)
            rows_out.append(dict(shape=shape, config=c, **st, rounds=times[c]))
    out = write_results("ab_peer", dict(args=vars(args)), rows_out)
    if out:
        print(f"results: {out}/ab_peer.json")


if __name__ == "__main__":
    main()
