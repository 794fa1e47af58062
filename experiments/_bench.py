"""What the GPU benchmarks share: the ``--dry-run`` switch and the copy-bandwidth ceiling.

Import this before triton: with ``--dry-run`` it turns on the Triton interpreter (the kernels then
run on the CPU at toy shapes, to check a script end to end without a GPU) and installs the test
shims the interpreter needs. ``DEV`` is the device the benchmark runs on.
"""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # before triton is imported: its own library functions must be interpreted too
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if DRY_RUN:
    from tests.kernels import _interp  # noqa: E402

    _interp.install()

DEV = torch.device("cpu" if DRY_RUN else "cuda")
CUDA = DEV.type == "cuda"


def time_call(fn) -> float:
    """Seconds of one call: CUDA events on the GPU (host launch time included when the host is the
    bottleneck, as for eager launches), wall clock on the CPU."""
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e-3


# --------------------------------------------------------------- shared-memory carveout (experiments)
# Triton asks the driver for the largest shared-memory carveout (cuFuncSetCacheConfig PREFER_SHARED)
# only for kernels that use more than 48 KiB; the others get the driver's default, which sizes the
# SM's L1 / shared split to the kernel's own occupancy. An SM cannot change that split while blocks
# run on it, so a programmatic dependent with another split cannot join an SM until it drains.
_FUNCS: dict[str, set[int]] = {}   # kernel name -> CUfunction handles loaded since carveout_hook()


def carveout_hook() -> None:
    """Record every Triton kernel loaded from now on (name -> CUfunction), for ``set_carveout``."""
    import triton

    def hook(module, function, name, metadata_group, hash):
        _FUNCS.setdefault(name, set()).add(int(function))
    triton.knobs.runtime.kernel_load_end_hook.add(hook)


def set_carveout(percent: int, names=None) -> int:
    """Preferred shared-memory carveout (percent of the maximum; -1: the driver's default) of every
    recorded kernel whose name contains one of ``names`` (None: all). Returns how many functions."""
    from runtime.kernels._common import set_function_carveout

    n = 0
    for name, fns in _FUNCS.items():
        if names is None or any(m in name for m in names):
            for f in fns:
                set_function_carveout(f, percent)
                n += 1
    return n


@contextlib.contextmanager
def carveouts(spec):
    """Within the block, the carveouts of ``spec``: (kernel-name parts or None for all, percent)
    pairs (``set_carveout``); afterwards every recorded kernel's back at the driver's default. A CUDA
    graph keeps the carveouts its kernels were captured with (probe_carveout.py). Empty: nothing.
    Refused when ``carveout_hook`` has recorded no kernel: the carveouts would silently reach none
    (session 27's ``moe_gu_st3_cv*`` step variants ran without the hook and measured no carveout)."""
    if spec and not _FUNCS:
        raise RuntimeError("carveouts: no kernel recorded; call carveout_hook() before the kernels load")
    for names, pct in spec or ():
        set_carveout(pct, names)
    try:
        yield
    finally:
        if spec:
            set_carveout(-1)


def recorded_kernels() -> list[str]:
    """Names of the kernels ``carveout_hook`` has recorded so far."""
    return sorted(_FUNCS)


def capture_graph(calls):
    """One CUDA graph holding ``calls`` in order (each run once eagerly first, to compile and to warm
    the allocator, then on a side stream, as capture needs), replayed three times to warm it."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    return g


def _copy_seconds(nbytes: int, reps: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    return statistics.median([time_call(lambda: b.copy_(a)) for _ in range(reps)])


def copy_bandwidth(nbytes: int = 2 * 2**30, reps: int = 10) -> tuple[float, float]:
    """(bytes read + written per second, median seconds) of a device-to-device copy: the ceiling
    every kernel and step is reported against."""
    if DRY_RUN:
        nbytes, reps = 2**24, 2
    t = _copy_seconds(nbytes, reps)
    if CUDA:
        torch.cuda.empty_cache()   # the 4 GiB of copy buffers are gone by now
    return 2 * nbytes / t, t


def write_results(name: str, payload: dict, rows: list[dict]) -> str | None:
    """$OUT/<name>.json (payload plus the rows) and $OUT/<name>.csv (the rows, union of their keys);
    nothing without $OUT. Returns the folder written to."""
    import csv
    import json
    out = os.environ.get("OUT")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({**payload, "rows": rows}, f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, f"{name}.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    return out


LEAD_US = 200.0            # a spin kernel at the head of every round (paired_rounds): the host enqueues behind it
SPIN_CYCLES_PER_US = 1980  # torch.cuda._sleep's unit: SM clock cycles (the H200's ~1.98 GHz; slower clocks spin longer)


def round_orders(names, rounds: int, seed: int = 0) -> list[list]:
    """The replay order of each of ``rounds`` rounds: per block of ``len(names)`` rounds one permutation
    drawn from the seed, rotated by one place each round, so that within every block each config runs
    first, second, ... exactly once (over any number of rounds the counts per place differ by at most
    one), while the fresh permutation of each block lets every config follow every other. Session 60
    found the earlier orders (an independent seeded shuffle per round) put the first config first in 74
    of 200 rounds, the others in 65 and 61."""
    names = list(names)
    rng = random.Random(f"paired-rounds:{seed}")
    out: list[list] = []
    while len(out) < rounds:
        p = rng.sample(names, len(names))
        out.extend(p[j:] + p[:j] for j in range(len(p)))
    return out[:rounds]


def place_spread(orders: list[list]) -> int:
    """The largest difference, over places in a round, between how often two configs ran there (0 or 1
    for ``round_orders``; a check of any schedule's balance)."""
    names = sorted({n for o in orders for n in o}, key=str)
    counts = {n: [0] * len(names) for n in names}
    for o in orders:
        for i, n in enumerate(o):
            counts[n][i] += 1
    return max(max(c[i] for c in counts.values()) - min(c[i] for c in counts.values()) for i in range(len(names)))


def paired_rounds(graphs: dict, rounds: int, calls_per_graph: int, lead_us: float = LEAD_US,
                  orders_out: list | None = None) -> dict:
    """Replay every graph once per round, in the order ``round_orders`` gives, and return
    {name: [microseconds per call, one per round]}. With a fixed rotation each graph always followed
    the same one, and the after-effects of one replay (dirty L2 lines written back) fell on one config
    (session 16); rotated permutations drawn afresh every block let every graph follow every other,
    and every config takes every place equally often.

    Each round starts with a spin kernel of ``lead_us`` (``torch.cuda._sleep``): the host enqueues the
    round's events and replays while the GPU spins, so every graph starts right behind the previous
    kernel. Without it (``lead_us=0``) the round's first replay started on an idle GPU and its time
    included the host's launch: +3-7 % at 4K-190K attention (session 60, ``import_order_kernels.py``).
    ``orders_out``, when given, receives each round's order."""
    names = list(graphs)
    times = {n: [] for n in names}
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in names]
    for order in round_orders(names, rounds):
        if lead_us > 0:
            torch.cuda._sleep(int(lead_us * SPIN_CYCLES_PER_US))
        for (e0, e1), n in zip(ev, order):
            e0.record()
            graphs[n].replay()
            e1.record()
        torch.cuda.synchronize()
        for (e0, e1), n in zip(ev, order):
            times[n].append(e0.elapsed_time(e1) * 1e3 / calls_per_graph)
        if orders_out is not None:
            orders_out.append(list(order))
    return times


def paired_stats(times: list, base: list) -> dict:
    """Median time per call and, against the baseline's rounds, the median per-round ratio with its
    10-90 % range (a difference is worth acting on when that range excludes 1)."""
    ratios = sorted(t / b for t, b in zip(times, base))
    return dict(us=statistics.median(times), ratio=statistics.median(ratios),
                ratio_p10=ratios[len(ratios) // 10], ratio_p90=ratios[(9 * len(ratios)) // 10])


def replay_paired(calls: dict, rounds: int, shape: str, lead_us: float = LEAD_US,
                  orders_out: list | None = None) -> dict | None:
    """{config: [calls]} -> {config: [microseconds per call, one per round]}: one graph per config,
    replayed by ``paired_rounds`` (which takes ``lead_us`` and ``orders_out``). With --dry-run: each
    config's first call once on the CPU, a line saying so, and None."""
    if DRY_RUN:
        for c in calls.values():
            c[0]()
        print(f"{shape}: dry run of {len(calls)} configs", flush=True)
        return None
    graphs = {n: capture_graph(c) for n, c in calls.items()}
    times = paired_rounds(graphs, rounds, len(next(iter(calls.values()))), lead_us, orders_out)
    del graphs
    return times


def paired_row(shape: str, config: str, times: list, base: list, nbytes: int, copy_bw: float, note: str = "",
               **extra) -> dict:
    """One config's result row against its baseline's rounds (``paired_stats``, the fraction of the
    copy bandwidth its bytes reach), printed as one line."""
    st = paired_stats(times, base)
    row = dict(shape=shape, config=config, frac=nbytes / (st["us"] * 1e-6) / copy_bw, bytes=nbytes, **st, **extra)
    print(f"{shape:>16} {config:>18} {st['us']:8.2f} us  frac {row['frac']:.3f}  ratio {st['ratio']:.4f} "
          f"[{st['ratio_p10']:.4f}, {st['ratio_p90']:.4f}]{note}", flush=True)
    return row


HOST_GAP_US = 50.0   # an idle stretch this long between kernels is the host (restores, replay calls)


def critical_path(events) -> dict[str, list]:
    """{kernel name: [total us, count, exposed us, gap us]} of kernel events (start us, duration us,
    name). In start order, a kernel's gap is the time the GPU sat idle between the latest end so far
    and its start (a launch gap; stretches of at least HOST_GAP_US, the host's own time between
    replays, are left out), its exposed time how far it moved that latest end past its start: what
    the step would lose without it if it were free, launch included. Over a chain of dependent
    kernels, gaps + exposed sum to the span; a kernel launched early and waiting (PDL) is charged only
    for the time it ends after its predecessor."""
    out: dict[str, list] = {}
    frontier = None
    for ts, dur, name in sorted(events):
        k = out.setdefault(name, [0.0, 0, 0.0, 0.0])
        k[0] += dur
        k[1] += 1
        if frontier is None:
            frontier = ts
        gap = ts - frontier
        if 0.0 < gap < HOST_GAP_US:
            k[3] += gap
        k[2] += max(0.0, ts + dur - max(frontier, ts))
        frontier = max(frontier, ts + dur)
    return out
