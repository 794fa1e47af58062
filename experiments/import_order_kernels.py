"""Does a copy of the runtime run its attention at a speed set by its import position? (sessions 59-60)

The paired replay's A/A runs (``experiments/notes/placement.md``, sessions 59-60) put a penalty on the arm
imported first in the longest requests (46K-189K: +0.2 % of TPOT), and a small gain on the arm imported
second (-0.075 % over all). This probe separates the kernel's copy from its data: ``--copies`` copies of
``runtime`` (default 3) are imported as the replay imports its arms (``replay.arms``, the working tree,
labels control / candidate / aa, then copy3, copy4, ...; in a drawn order), and each copy's
``decode_attention_full`` is captured in a CUDA graph of ``--calls`` calls over ONE shared KV cache, q and
output. The copies are first called in their import order (as the fingerprints do; ``--call-order random``:
in an order of their own, which is when Triton loads each copy's kernel), their graphs captured in another
drawn order (``--capture-order``), then timed in rounds: each round replays every copy's graph once, in
``_bench``'s balanced orders behind a spin kernel (``--lead-us``; 0 = none, the round's first replay then
starts on an idle GPU). The same data and launch arguments, so a difference can only come from the copy
itself (its compiled module, where it was loaded, its graph).

Per context and copy: its time over the mean of the copies in each round (mean, se); the same over the
rounds where it did not run first, against the others not first (what a lead kernel missing from the
schedule cannot move); and its time first in a round against later (medians). A value against the mean
of two is about half the difference between the two copies.

``--warm import`` imports a throwaway copy (label ``warm``) before the others and never calls it;
``--warm call`` also calls its attention once per context before the others' first calls (what the
replay's ``warm_copy=true`` does for every kernel of a decode). The warm copy is never timed.

    OUT=... python3 experiments/import_order_kernels.py --contexts 4096,65536,190000 --rounds 201
    python3 experiments/import_order_kernels.py --analyse RUN/import_order_kernels.json   # a saved run's table
    python experiments/import_order_kernels.py --dry-run       # CPU interpreter, toy shapes: checks the script

Writes ``$OUT/import_order_kernels.json`` (every round's times and places) and prints a table per context.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import random
import statistics
from pathlib import Path

from _bench import CUDA, DEV, DRY_RUN, LEAD_US, replay_paired, round_orders, write_results  # noqa: I001  (first: --dry-run)

import torch

from replay import arms as armsmod


def load_copies(order: list[str]) -> dict[str, object]:
    """The working tree's runtime imported once per label, in ``order``: label -> its attention function."""
    repo = armsmod.repo_root(Path(__file__).resolve().parent)
    loaded = armsmod.load_arms(repo, {label: armsmod.WORKTREE for label in order}, {}, order=order)
    return {label: importlib.import_module(f"{arm.module}.kernels.attention").decode_attention_full
            for label, arm in loaded.items()}


def copy_labels(n: int) -> list[str]:
    """control, candidate, aa, then copy3, copy4, ...: ``n`` labels."""
    return [*armsmod.ARMS[:n], *(f"copy{i}" for i in range(len(armsmod.ARMS), n))]


def copy_effects(rows: list[dict], labels: list[str]) -> list[dict]:
    """Per copy (of one context's ``rows``: round, label, us, place): its time over the mean of the
    copies in the same round, mean and standard error over rounds; the same over the rounds in which it
    did not run first, against the mean of the copies that did not run first either (the first replay of
    a round is where a missing lead kernel shows: ``rel_later_pct``); and how much slower it ran first in
    its round than later (``first_in_round_pct``, medians)."""
    by_round: dict[int, dict[str, dict]] = {}
    for x in rows:
        by_round.setdefault(x["round"], {})[x["label"]] = x
    out = []
    for label in labels:
        rel, rel_later, first, later = [], [], [], []
        for rr in by_round.values():
            mean = statistics.fmean(rr[lb]["us"] for lb in labels)
            x = rr[label]
            rel.append(x["us"] / mean - 1)
            (first if x["place"] == 0 else later).append(x["us"])
            if x["place"] != 0:
                rel_later.append(x["us"] / statistics.fmean(rr[lb]["us"] for lb in labels if rr[lb]["place"]) - 1)

        def m_se(v):
            return (100 * statistics.fmean(v) if v else float("nan"),
                    100 * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else float("nan"))
        out.append({"label": label, "rel_pct": m_se(rel)[0], "se_pct": m_se(rel)[1],
                    "rel_later_pct": m_se(rel_later)[0], "se_later_pct": m_se(rel_later)[1],
                    "first_in_round_pct": 100 * (statistics.median(first) / statistics.median(later) - 1)
                    if first and later else float("nan"),
                    "median_us": statistics.median(x["us"] for x in rows if x["label"] == label)})
    return out


def old_place(import_order: list[str], r: int, label: str) -> int:
    """The place in round ``r`` a copy had before session 60: ``_bench.paired_rounds`` then drew each
    round's order as ``random.Random(r).sample(names, len(names))`` with the graphs in import order."""
    return random.Random(r).sample(import_order, len(import_order)).index(label)


def analyse(path: Path) -> None:
    """The printed table of a saved run, through ``copy_effects``."""
    payload = json.loads(path.read_text())
    order = [x for x in payload["import_order"] if x != "warm"]
    rows = payload["rows"]
    for x in rows:
        if "place" not in x:
            x["place"] = old_place(order, x["round"], x["label"])
    for n in sorted({x["context"] for x in rows}):
        for e in copy_effects([x for x in rows if x["context"] == n], order):
            print(f"{n:>7} {e['label']:>9} (imported #{order.index(e['label']) + 1}): median {e['median_us']:8.3f} us, "
                  f"all rounds {e['rel_pct']:+.3f} % (se {e['se_pct']:.3f}), not first in round (against the others not first) "
                  f"{e['rel_later_pct']:+.3f} % (se {e['se_later_pct']:.3f}); first in round "
                  f"{e['first_in_round_pct']:+.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,65536,190000", help="valid keys per call")
    ap.add_argument("--rounds", type=int, default=201, help="timing rounds (each copy's graph once per round)")
    ap.add_argument("--rows", type=int, default=6, help="live rows (q1-mini: 6 heads, 1 KV head, d = 64)")
    ap.add_argument("--calls", type=int, default=16, help="calls per graph")
    ap.add_argument("--seed", type=int, default=None, help="the import, call and capture orders' draw (default: fresh)")
    ap.add_argument("--copies", type=int, default=3,
                    help="how many copies to import (labels control, candidate, aa, then copy3, copy4, ...): more "
                         "copies map the offsets of more import positions")
    ap.add_argument("--warm", choices=("none", "import", "call"), default="none",
                    help="a throwaway copy imported first: never called (import) or called once per context first (call)")
    ap.add_argument("--call-order", choices=("import", "random"), default="import",
                    help="the copies' first calls (where Triton loads each copy's kernel): in import order, as the "
                         "replay's fingerprints make them, or in an order of their own")
    ap.add_argument("--capture-order", choices=("import", "random"), default="random",
                    help="the order in which the copies' graphs are captured")
    ap.add_argument("--lead-us", type=float, default=LEAD_US,
                    help="the spin kernel at the head of every timing round (0: none, the round's first replay "
                         "then starts on an idle GPU, as before session 60)")
    ap.add_argument("--analyse", metavar="JSON", default=None,
                    help="print the table again from a run's import_order_kernels.json and exit (a run from before "
                         "session 60 has no places in round: they are rebuilt from the orders its rounds had then)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, toy shapes: checks the script")
    a = ap.parse_args()
    if a.analyse:
        return analyse(Path(a.analyse))
    if a.copies < 2:
        ap.error(f"--copies {a.copies}: at least 2 (each copy is compared with the others)")
    labels = copy_labels(a.copies)
    rng = random.Random(a.seed)
    order = rng.sample(labels, len(labels))
    call_order = order if a.call_order == "import" else rng.sample(order, len(order))
    capture_order = order if a.capture_order == "import" else rng.sample(order, len(order))
    warm = [] if a.warm == "none" else ["warm"]
    copies = load_copies(warm + order)
    warm_f = copies.pop("warm", None)
    print(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; imported {', '.join(warm + order)}"
          f"{'' if not warm else f' (the warm copy: {a.warm})'}; first called {', '.join(call_order)}; "
          f"captured {', '.join(capture_order)}; lead {a.lead_us:g} us", flush=True)
    contexts = [256, 600] if DRY_RUN else [int(c) for c in a.contexts.split(",")]
    rounds, calls_n = (len(order), 1) if DRY_RUN else (a.rounds, a.calls)
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
        if warm_f is not None and a.warm == "call":     # the throwaway copy's kernel loaded and run first
            warm_f(q, k, v, sp, sinks, torch.empty_like(q))
        for label in call_order:
            calls[label]()
        ref = outs[order[0]]
        same = all(torch.equal(outs[label], ref) for label in order)
        # one graph per copy, captured in capture_order, replayed once per round in _bench's balanced
        # orders behind a lead kernel; the dry run times nothing (rounds of 1 us in the schedule's orders)
        orders: list[list] = []
        t = replay_paired({label: [calls[label]] * calls_n for label in capture_order}, rounds, f"{n} keys",
                          a.lead_us, orders)
        if t is None:
            orders = round_orders(capture_order, rounds)
            t = {label: [1.0] * rounds for label in order}
        ctx_rows = [{"context": n, "round": r, "label": label, "import_position": order.index(label),
                     "call_position": call_order.index(label), "capture_position": capture_order.index(label),
                     "place": orders[r].index(label), "us": t[label][r]}
                    for r in range(rounds) for label in order]
        rows += ctx_rows
        for e in copy_effects(ctx_rows, order):
            label = e["label"]
            table.append({"context": n, "import_position": order.index(label),
                          "call_position": call_order.index(label), "capture_position": capture_order.index(label),
                          "outputs_equal": same, **e})
            print(f"{n:>7} {label:>9} (imported #{order.index(label) + 1}{' after warm' if warm else ''}, called "
                  f"#{call_order.index(label) + 1}, captured #{capture_order.index(label) + 1}): median "
                  f"{e['median_us']:8.3f} us, {e['rel_pct']:+.3f} % (se {e['se_pct']:.3f}) against the mean of all "
                  f"copies; not first in round (against the others not first) {e['rel_later_pct']:+.3f} % (se {e['se_later_pct']:.3f}); first in "
                  f"round {e['first_in_round_pct']:+.2f} %; outputs equal: {same}", flush=True)
    write_results("import_order_kernels", {"args": vars(a), "import_order": warm + order, "call_order": call_order,
                                           "capture_order": capture_order, "table": table}, rows)


if __name__ == "__main__":
    main()
