"""Eager against captured execution (runtime/graphs.py) of whole decodes, side by side in one run.

For each model and context: one request is started (random prompt tokens, fast backend, BF16),
forked, and decoded twice from the same state, once with ``execution=eager`` and once captured. The
table gives per execution the steps, the median step and time per output token (host-timed steps,
as the replay records them; the first step left out), the first two steps, the time spent before
the first step (the capture: the eager warm-up of every piece, the captures, one replay of each)
and whether both decodes emitted the same tokens and the same result log.

    OUT=... python3 experiments/bench_execution.py --models q1-mini      # session 53's q1-mini rows
    python3 experiments/bench_execution.py --models q1 --contexts 16 --tokens 64     # session 53's q1 row
    python experiments/bench_execution.py --dry-run                      # CPU, q1-tiny, eager only

q1 (rank 0 of 8, random weights) needs a short prompt: PyTorch held 125 GiB after the engine built it
on an H200, and its reference prefill dequantises each token's 8 experts (256 tokens asked for 48 GiB more).
Writes ``$OUT/bench_execution.json`` (every step's time). Times name the machine; compare the two
executions within one run.
"""
from __future__ import annotations

import argparse
import statistics
import time

from _bench import CUDA, DEV, DRY_RUN, write_results  # noqa: I001  (first: --dry-run switches the interpreter on)

import torch

from runtime.engine import Engine
from runtime.graphs import fork_request

ROWS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def engine_for(model: str, execution: str) -> Engine:
    rt = {"backend": "reference" if DRY_RUN else "fast", "dtype": "float32" if DRY_RUN else "bfloat16",
          "device": str(DEV), "execution": execution}
    if model == "q1":
        rt["tp"] = {"size": 8, "emulate_rank": 0}
    return Engine.build(model, rt)


def decode_timed(eng: Engine, rnd, st) -> tuple[object, float]:
    t0 = time.perf_counter()
    g = eng.decode(rnd, st)
    return g, time.perf_counter() - t0


def row(model, ctx, execution, g, wall_s, same) -> dict:
    steps = [t / 1e3 for t in g.step_ns]          # us
    body = steps[1:] or steps
    tokens = sum(s["emitted"] for s in g.steps[1:]) or 1
    return {"model": model, "context": ctx, "execution": execution, "steps": len(steps),
            "step_us": statistics.median(body), "tpot_us": sum(body) / tokens,
            "first_us": steps[:2], "before_steps_ms": (wall_s * 1e6 - sum(steps)) / 1e3,
            "tokens_per_step": g.tokens_per_step, "identical": same, "step_us_all": steps}


def bench(model: str, ctx: int, tokens: int, seed: int) -> None:
    eng = engine_for(model, "eager")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, eng.cfg.vocab_size, (ctx,), generator=gen).tolist()
    with torch.no_grad():
        rnd, st = eng.start(prompt, seed, tokens)
    r2, s2 = fork_request(rnd, st)
    ref, ref_s = decode_timed(eng, rnd, st)
    rows = [row(model, ctx, "eager", ref, ref_s, True)]
    if CUDA:
        eng.execution = "captured"     # the same engine and weights, the other execution
        got, got_s = decode_timed(eng, r2, s2)
        rows.append(row(model, ctx, "captured", got, got_s, got.tokens == ref.tokens and got.steps == ref.steps))
    for r in rows:
        ROWS.append(r)
        log(f"{r['model']:<8} {r['context']:>7} {r['execution']:<9} {r['steps']:>5} {r['step_us']:>10.1f} "
            f"{r['tpot_us']:>10.1f} {r['first_us'][0]:>9.0f} {r['first_us'][-1]:>9.0f} {r['before_steps_ms']:>11.1f} "
            f"{r['tokens_per_step']:>8.2f} {'yes' if r['identical'] else 'NO'}")
    if CUDA and len(rows) == 2:
        log(f"{'':<8} {'':>7} captured/eager step {rows[1]['step_us'] / rows[0]['step_us']:.4f}, "
            f"TPOT {rows[1]['tpot_us'] / rows[0]['tpot_us']:.4f}")
    del eng, rnd, st, r2, s2
    if CUDA:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="q1-mini", help="comma-separated: q1-mini, q1 (rank 0 of 8), q1-tiny")
    ap.add_argument("--contexts", default="2048,32768", help="prompt lengths (random tokens)")
    ap.add_argument("--tokens", type=int, default=96, help="output budget per decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, eager only: checks the script")
    args = ap.parse_args()
    models = ["q1-tiny"] if DRY_RUN else args.models.split(",")
    contexts = [64] if DRY_RUN else [int(c) for c in args.contexts.split(",")]
    log(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; {args.tokens} tokens per decode")
    log(f"{'model':<8} {'context':>7} {'execution':<9} {'steps':>5} {'step us':>10} {'TPOT us':>10} "
        f"{'step0 us':>9} {'step1 us':>9} {'before ms':>11} {'tok/step':>8} same")
    for m in models:
        for c in contexts:
            bench(m, c, args.tokens, args.seed)
    path = write_results("bench_execution", {"args": vars(args), "device": str(DEV)}, ROWS)
    if path:
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
