"""Do whole decodes run at a speed set by their copy's import position? (session 60)

The paired replay's A/A runs put offsets on the arms by import position (``experiments/notes/placement.md``,
session 60: over 65 runs the arm imported first +0.23 % of TPOT at 46K-189K, the second -0.075 % over all),
and ``import_order_kernels.py`` finds the attention call alone has offsets of its own, but in another
pattern over context (largest at 4K). This probe times what the replay times, whole decodes, without the
replay's request noise: ``--copies`` copies of the working tree's runtime are imported in a drawn order
(``replay.arms``, labels control / candidate / aa, then copy3, ...), each copy's engine built on one shared set
of weights (``replay.arms.build``, the arms' path: same model, same random weights), in import order. Per
context one random prompt is prefilled by every copy (the same tokens and seed, so the same state); each
copy decodes it once untimed (its graphs built, as a first decode does in the replay), then in ``--reps``
rounds every copy decodes a fresh fork of its own started request once, in ``_bench``'s balanced orders.

Per context and copy: the decode's time (the steps after the first, the device loop's %globaltimer
stamps, or host-timed steps in the host loops) over the mean of the copies in the same round, mean and
standard error (``import_order_kernels.copy_effects``, also over the rounds where the copy did not decode
first); whether every copy emitted the first copy's tokens (it must: same weights, state and seed).

    OUT=... python3 experiments/import_order_steps.py --contexts 4096,65536,160000 --reps 48
    python3 experiments/import_order_steps.py --analyse RUN/import_order_steps.json   # a saved run's table
    python experiments/import_order_steps.py --dry-run    # CPU, q1-tiny, reference backend, eager: checks it

Writes ``$OUT/import_order_steps.json`` (every decode's time, place and steps) and prints a table per context.
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
from pathlib import Path

from _bench import CUDA, DEV, DRY_RUN, round_orders, write_results  # noqa: I001  (first: --dry-run)

import torch

from import_order_kernels import copy_effects, copy_labels
from replay import arms as armsmod


def decode_us(g) -> float:
    """A decode's time in us: its steps after the first (the first one's time includes the loop's start)."""
    steps = [t / 1e3 for t in g.step_ns]
    return float(sum(steps[1:] or steps))


def print_table(n: int, effects: list[dict], positions: dict[str, int], same: bool) -> None:
    for e in effects:
        print(f"{n:>7} {e['label']:>9} (imported and built #{positions[e['label']] + 1}): median "
              f"{e['median_us'] / 1e3:9.3f} ms a decode, {e['rel_pct']:+.3f} % (se {e['se_pct']:.3f}) against the "
              f"mean of all copies; not first in round (against the others not first) {e['rel_later_pct']:+.3f} % "
              f"(se {e['se_later_pct']:.3f}); first in round {e['first_in_round_pct']:+.2f} %; same tokens: {same}",
              flush=True)


def analyse(path: Path) -> None:
    """The printed table of a saved run."""
    payload = json.loads(path.read_text())
    order = payload["import_order"]
    rows = payload["rows"]
    for n in sorted({x["context"] for x in rows}):
        same = all(t["same_tokens"] for t in payload["table"] if t["context"] == n)
        print_table(n, copy_effects([x for x in rows if x["context"] == n], order),
                    {lb: order.index(lb) for lb in order}, same)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q1-mini", help="conf/model/<name>.yaml (random weights, seeded)")
    ap.add_argument("--contexts", default="4096,65536,160000", help="prompt lengths (random tokens)")
    ap.add_argument("--tokens", type=int, default=128, help="output budget per decode")
    ap.add_argument("--reps", type=int, default=48, help="timed rounds (every copy decodes once per round)")
    ap.add_argument("--copies", type=int, default=3, help="how many copies to import (at least 2)")
    ap.add_argument("--execution", default="device", help="runtime.execution: device | captured | eager")
    ap.add_argument("--seed", type=int, default=None, help="the import order's draw (default: fresh)")
    ap.add_argument("--analyse", metavar="JSON", default=None, help="print a saved run's table and exit")
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, reference backend, eager: checks the script")
    a = ap.parse_args()
    if a.analyse:
        return analyse(Path(a.analyse))
    if a.copies < 2:
        ap.error(f"--copies {a.copies}: at least 2 (each copy is compared with the others)")
    order = random.Random(a.seed).sample(copy_labels(a.copies), a.copies)
    model = "q1-tiny" if DRY_RUN else a.model
    rt = ({"backend": "reference", "dtype": "float32", "device": "cpu", "execution": "eager"} if DRY_RUN else
          {"backend": "fast", "dtype": "bfloat16", "device": str(DEV), "execution": a.execution})
    contexts = [48, 96] if DRY_RUN else [int(c) for c in a.contexts.split(",")]
    tokens, reps = (6, a.copies) if DRY_RUN else (a.tokens, a.reps)
    repo = armsmod.repo_root(Path(__file__).resolve().parent)
    arms = armsmod.load_arms(repo, {label: armsmod.WORKTREE for label in order}, {}, order=order)
    weights = armsmod.WeightCache()
    for label in order:                       # built in import order, as the replay builds by default
        armsmod.build(arms[label], model, rt, weights)
    fork = {label: importlib.import_module(f"{arm.module}.graphs").fork_request for label, arm in arms.items()}
    print(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; {model}, {a.execution if not DRY_RUN else 'eager'}; "
          f"imported and built {', '.join(order)}; {tokens} tokens a decode, {reps} rounds", flush=True)
    rows, table = [], []
    for n in contexts:
        vocab = arms[order[0]].engine.cfg.vocab_size
        prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        started, first = {}, {}
        with torch.no_grad():
            for label in order:               # every copy prefills the same prompt, then decodes it once untimed
                eng = arms[label].engine
                started[label] = eng.start(prompt, 0, tokens)
                first[label] = eng.decode(*fork[label](*started[label])).tokens
            same = all(first[label] == first[order[0]] for label in order)
            orders = round_orders(order, reps)
            for r, o in enumerate(orders):
                for place, label in enumerate(o):
                    g = arms[label].engine.decode(*fork[label](*started[label]))
                    rows.append({"context": n, "round": r, "label": label, "place": place,
                                 "import_position": order.index(label), "us": decode_us(g), "steps": len(g.step_ns),
                                 "same_tokens": g.tokens == first[order[0]]})
        same = same and all(x["same_tokens"] for x in rows if x["context"] == n)
        effects = copy_effects([x for x in rows if x["context"] == n], order)
        table += [{"context": n, "import_position": order.index(e["label"]), "same_tokens": same, **e}
                  for e in effects]
        print_table(n, effects, {lb: order.index(lb) for lb in order}, same)
        del started
        if CUDA:
            torch.cuda.empty_cache()
    write_results("import_order_steps", {"args": vars(a), "model": model, "runtime": rt, "import_order": order,
                                         "table": table}, rows)


if __name__ == "__main__":
    main()
