"""The decode step at real tensor parallelism: the all-reduces through torch.distributed (arm ``comm``)
against the fused all-reduce (``runtime.tp.fused_allreduce``, arm ``fused``), paired on the same ranks.

    OUT=... python3 experiments/bench_tp.py [--ranks 2] [--layers 8] [--contexts 8192] [--reps 30]
                                           [--no-graph] [--dry-run]

One process per rank (``torch.multiprocessing``). With ``--ranks`` GPUs the ranks talk over NCCL, one GPU
each. With fewer they share GPU 0 over gloo. Gloo's CUDA collectives pass through the host and cannot be
captured, so there both arms run eagerly, host-bound: a check of the plumbing, not the comparison that
decides the fused path's default.

Each rank builds q1 with ``--layers`` layers (the layer pattern kept: the whole model's rank shard at TP = 2
does not fit one H200) from seeded random tensors, and its TP shard. At each context it builds a synthetic
decode state (``bench_step.synthetic_state``: 6 rows, 5 drafts; rank 0's, broadcast) and two rounds over the
same weights and caches:
- ``comm``: the fast backend's paths for a rank with peers (the norms and the routing apart from the
  projections), the all-reduces through torch.distributed;
- ``fused``: the exchange over buffers opened through CUDA IPC (peer-to-peer, never multicast).

Each arm's step (verify, draft_first, draft_next to depth 5: ``bench_step.step_fn``) is captured as one
CUDA graph on every rank, NCCL's collectives inside the capture. The two graphs replay in alternation, the
order swapped every pair, each replay between barriers and timed by CUDA events on every rank. A replay's time
is the slowest rank's. Rank 0 prints per arm the median ms a step, and the median per-pair ratio fused / comm
with its 10-90 % range. It writes $OUT/bench_tp.json and .csv. A rank's failure leaves its traceback in
$OUT/r<rank>.err (or the temporary folder named at the end).

``--dry-run``: the CPU, the Triton interpreter, q1-tiny at 2 layers over gloo, the comm arm's step once
eagerly (the plumbing, no timing). The fused arm needs CUDA (its buffers open through CUDA IPC): skipped there.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import CUDA, DEV, DRY_RUN, time_call, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_config(layers: int):
    from runtime.config import load_model_config

    if DRY_RUN:
        return dataclasses.replace(load_model_config("q1-tiny"), num_layers=2, layer_pattern=("sliding", "full"),
                                   sliding_window=32).validate()
    return dataclasses.replace(load_model_config("q1"), num_layers=layers).validate()


def build(rank: int, ranks: int, layers: int):
    """(config, reference model, fast model) of this rank's shard, over torch.distributed."""
    import bench_step as B
    from runtime.checkpoint import random_tensors
    from runtime.config import TPConfig, make_shard
    from runtime.fast import FastModel
    from runtime.model import Model
    from runtime.parallel import make_comm

    cfg = model_config(layers)
    tp = TPConfig(size=ranks, rank=rank)
    with torch.no_grad():
        tensors = B.ConsumingTensors(random_tensors(cfg, tp, seed=0, device=DEV))
        ref = Model(cfg, tensors, make_shard(cfg, tp), "bfloat16", DEV, make_comm(tp))
        del tensors
        fast = FastModel.from_model(ref)
    return cfg, ref, fast


def rank_state(ref, L: int, gen):
    """Rank 0's synthetic decode state at cache length L, on every rank (the ranks must verify the same
    tokens), and its restorer."""
    import bench_step as B
    import torch.distributed as dist

    st = B.synthetic_state(ref, L, 64, seed=0, gen=gen)
    for f in dataclasses.fields(st):
        dist.broadcast(getattr(st, f.name), 0)
    return st, B.restorer(st, B.clone_state(st))


def time_arms(steps: dict, restore, reps: int, graphs: bool) -> dict:
    """{arm: [seconds of each timed replay on this rank]}: every arm's step in alternation (order swapped
    every pair), each replay after a restore and a barrier; two warm-up pairs. ``graphs``: captured first
    (``bench_step.capture``), else eager."""
    import bench_step as B
    import torch.distributed as dist

    fns = {a: B.capture(fn, restore).replay for a, fn in steps.items()} if graphs else dict(steps)
    names = list(fns)
    times = {a: [] for a in names}
    for i in range(reps + 2):
        for a in (names if i % 2 == 0 else names[::-1]):
            restore()
            B.sync()
            dist.barrier()
            t = time_call(fns[a])
            if i >= 2:
                times[a].append(t)
    return times


def run_rank(rank: int, args) -> list[dict]:
    import bench_step as B
    import torch.distributed as dist
    from runtime.config import DraftConfig, SamplingConfig
    from runtime.speculative import Round

    t0 = time.perf_counter()
    cfg, ref, fast = build(rank, args.ranks, args.layers)
    log(rank, f"{cfg.name} at {cfg.num_layers} layers, {args.ranks} ranks over {args.dist}: built in "
              f"{time.perf_counter() - t0:.1f} s")
    sampling, draft = SamplingConfig(), DraftConfig(policy="fixed", fixed_depth=B.DEPTHS)
    gen = torch.Generator(device=DEV).manual_seed(0)
    graphs = CUDA and args.dist == "nccl" and not args.no_graph
    if CUDA and not graphs:
        log(rank, "eager steps (no capture: " + ("--no-graph" if args.no_graph else
                                                 "gloo's CUDA collectives pass through the host") +
            "): host-bound times, not the comparison that decides the default")
    rows = []
    for L in ((40,) if DRY_RUN else args.contexts):
        cache = ref.new_cache(L + 64 + 16)
        B.fill_cache(cache, L, gen)
        st, restore = rank_state(ref, L, gen)
        steps = {"comm": B.step_fn(Round(fast, cache, sampling, draft), st)}
        if CUDA:   # the exchange's buffers: a collective (every rank opens every other's through CUDA IPC)
            r_fused = Round(fast, cache, sampling, draft)
            B._peer_fused(r_fused)
            steps["fused"] = B.step_fn(r_fused, st)
        with torch.no_grad():
            if DRY_RUN:
                for a, fn in steps.items():
                    restore()
                    fn()
                    log(rank, f"ctx={L} dry run: arm {a} ran one step")
                continue
            mine = time_arms(steps, restore, args.reps, graphs)
        if "fused" in steps:
            r_fused.model.check_peers()   # (a read that took the failure exit: PeerTimeout)
        every = [None] * args.ranks
        dist.all_gather_object(every, mine)
        slowest = {a: [max(t[a][i] for t in every) for i in range(len(mine[a]))] for a in mine}
        row = {"context": L, "ranks": args.ranks, "layers": cfg.num_layers, "dist": args.dist, "graphs": graphs,
               "reps": args.reps}
        for a, ts in slowest.items():
            row[f"{a}_ms"] = statistics.median(ts) * 1e3
            row[f"{a}_ms_by_rank"] = [statistics.median(t[a]) * 1e3 for t in every]
        msg = f"ctx={L}: " + ", ".join(f"{a} {row[f'{a}_ms']:.3f} ms" for a in slowest)
        if "fused" in slowest:
            ratios = sorted(f / c for c, f in zip(slowest["comm"], slowest["fused"]))
            row.update(ratio=statistics.median(ratios), ratio_p10=ratios[len(ratios) // 10],
                       ratio_p90=ratios[(9 * len(ratios)) // 10], comm=slowest["comm"], fused=slowest["fused"])
            msg += f"; fused / comm {row['ratio']:.4f} [{row['ratio_p10']:.4f}, {row['ratio_p90']:.4f}]"
        log(rank, msg + f" (a step per replay, the slowest of {args.ranks} ranks; {args.reps} pairs)")
        rows.append(row)
        del steps, cache, st
        if CUDA:
            torch.cuda.empty_cache()
    return rows


def _rank_main(rank: int, port: int, args, err_dir: str) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()
    torch.set_num_threads(1)
    if CUDA:
        torch.cuda.set_device(rank if args.dist == "nccl" else 0)
    dist.init_process_group(args.dist, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    try:
        rows = run_rank(rank, args)
        if rank == 0:
            out = write_results("bench_tp", dict(args=vars(args)), rows)
            if out:
                log(rank, f"results: {out}/bench_tp.json")
    except BaseException:   # (written first: another rank's failure may end this process before it reports)
        import traceback
        with open(os.path.join(err_dir, f"r{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks, one process each")
    ap.add_argument("--layers", type=int, default=8, help="q1's layers (default 8: ~21 GB a rank at TP = 2)")
    ap.add_argument("--contexts", default="8192", help="comma-separated cache lengths")
    ap.add_argument("--reps", type=int, default=30, help="timed pairs per context")
    ap.add_argument("--no-graph", action="store_true", help="eager steps (host-bound) even over NCCL")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, q1-tiny at 2 layers, one eager step")
    args = ap.parse_args()
    if args.ranks < 2:
        ap.error("--ranks: at least 2 (one rank has nothing to all-reduce)")
    args.contexts = tuple(int(c) for c in args.contexts.split(",") if c)
    args.dist = "nccl" if CUDA and torch.cuda.device_count() >= args.ranks else "gloo"
    err_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_tp_")
    os.makedirs(err_dir, exist_ok=True)
    print(f"bench_tp: {args.ranks} ranks over {args.dist} ({torch.cuda.device_count() if CUDA else 0} GPUs "
          f"visible); torch {torch.__version__}; rank errors go to {err_dir}", flush=True)
    try:
        mp.spawn(_rank_main, args=(_free_port(), args, err_dir), nprocs=args.ranks, join=True)
    except Exception as e:
        errs = sorted(f for f in os.listdir(err_dir) if f.endswith(".err"))
        print(f"a rank failed: {e}\nthe ranks' own errors: {errs or 'none written'} in {err_dir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
