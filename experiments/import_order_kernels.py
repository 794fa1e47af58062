"""Does the copy of the runtime imported first run its attention slower? (session 59)

The paired replay's A/A runs (``experiments/notes/placement.md``, session 59) put a penalty on the arm
imported first, not the one built first, and only in the longest requests (46K-189K: +0.2 % of TPOT).
Attention is the part of a step that grows with context. This probe separates the kernel's copy from its
data: three copies of ``runtime`` are imported as the replay imports its arms (``replay.arms``, the working
tree, labels control / candidate / aa, in a random order), and each copy's ``decode_attention_full`` is
captured in a CUDA graph of ``--calls`` calls over ONE shared KV cache, q and output. The copies are
called first in their import order (as the fingerprints do), then timed in rounds, each round replaying
every copy's graph in a fresh random order (``_bench.replay_paired``). Per context: each copy's time over the mean of the three,
mean and standard error over rounds, with the copy's import position. The same data and launch
arguments, so a difference can only come from the copy itself (its compiled module, where it was
loaded, its launch path); the two later copies are each other's A/A.

    OUT=... python3 experiments/import_order_kernels.py --contexts 4096,65536,190000 --rounds 200
    python experiments/import_order_kernels.py --dry-run       # CPU interpreter, toy shapes: checks the script

Writes ``$OUT/import_order_kernels.json`` (every round's times) and prints a table per context.
"""
from __future__ import annotations

import argparse
import importlib
import math
import random
import statistics
from pathlib import Path

from _bench import CUDA, DEV, DRY_RUN, replay_paired, write_results  # noqa: I001  (first: --dry-run)

import torch

from replay import arms as armsmod


def load_copies(order: list[str]) -> dict[str, object]:
    """The working tree's runtime imported once per label, in ``order``: label -> its attention function."""
    repo = armsmod.repo_root(Path(__file__).resolve().parent)
    loaded = armsmod.load_arms(repo, {label: armsmod.WORKTREE for label in order}, {}, order=order)
    return {label: importlib.import_module(f"{arm.module}.kernels.attention").decode_attention_full
            for label, arm in loaded.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,65536,190000", help="valid keys per call")
    ap.add_argument("--rounds", type=int, default=200, help="timing rounds (each copy's graph once per round)")
    ap.add_argument("--rows", type=int, default=6, help="live rows (q1-mini: 6 heads, 1 KV head, d = 64)")
    ap.add_argument("--calls", type=int, default=16, help="calls per graph")
    ap.add_argument("--seed", type=int, default=None, help="the import order's draw (default: fresh)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes: checks the script")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    order = rng.sample(list(armsmod.ARMS), 3)
    copies = load_copies(order)
    print(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; imported {', '.join(order)}", flush=True)
    contexts = [256, 600] if DRY_RUN else [int(c) for c in a.contexts.split(",")]
    rounds, calls_n = (2, 1) if DRY_RUN else (a.rounds, a.calls)
    nh, nkv, d, w = 6, 1, 64, a.rows
    rows, table = [], []
    for n in contexts:
        cap = 1 << math.ceil(math.log2(n))
        k = torch.randn(nkv, cap, d, device=DEV).to(torch.bfloat16)
        v = torch.randn(nkv, cap, d, device=DEV).to(torch.bfloat16)
        q = torch.randn(w, nh, d, device=DEV).to(torch.bfloat16)
        sinks = torch.randn(nh, device=DEV) + math.log(n)
        sp = torch.tensor(n - w, dtype=torch.int32, device=DEV)
        outs = {label: torch.empty_like(q) for label in order}
        calls = {label: (lambda f=f, o=outs[label]: f(q, k, v, sp, sinks, o)) for label, f in copies.items()}
        for label in order:                       # first calls in import order, as the fingerprints make them
            calls[label]()
        ref = outs[order[0]]
        same = all(torch.equal(outs[label], ref) for label in order)
        # one graph per copy, replayed once per round in a fresh order (_bench's paired rounds); the dry run
        # times nothing (every round 1 us)
        t = replay_paired({label: [calls[label]] * calls_n for label in order}, rounds, f"{n} keys") or \
            {label: [1.0] * rounds for label in order}
        for r in range(rounds):
            mean = statistics.fmean(t[label][r] for label in order)
            for label in order:
                rows.append({"context": n, "round": r, "label": label, "import_position": order.index(label),
                             "us": t[label][r], "rel": t[label][r] / mean - 1})
        for label in order:
            rel = [x["rel"] for x in rows if x["context"] == n and x["label"] == label]
            m = statistics.fmean(rel)
            se = statistics.stdev(rel) / math.sqrt(len(rel)) if len(rel) > 1 else float("nan")
            table.append({"context": n, "label": label, "import_position": order.index(label),
                          "median_us": statistics.median(t[label]), "rel_pct": 100 * m, "se_pct": 100 * se,
                          "outputs_equal": same})
            print(f"{n:>7} {label:>9} (imported #{order.index(label) + 1}): median {statistics.median(t[label]):8.3f} us, "
                  f"{100 * m:+.3f} % (se {100 * se:.3f}) against the mean of the three; outputs equal: {same}",
                  flush=True)
    write_results("import_order_kernels", {"args": vars(a), "import_order": order, "table": table}, rows)


if __name__ == "__main__":
    main()
