"""The executions of whole decodes side by side in one run: eager, captured (runtime/graphs.py) and the
device loop (runtime/devloop.py).

For each model and context: one request is started (random prompt tokens, fast backend, BF16),
forked, and decoded once per execution from the same state. The table gives per execution the
steps, the median step and time per output token (the first step left out; host-timed steps for
the host loops, as the replay records them, %globaltimer stamps for the device loop), the loop's
host time per output token (first step's start to the last one's end, every step: the like-for-like
column), the first two steps, the time spent before the first step (captures: the eager warm-up of
every piece, the captures, one replay or the parent graph's upload; for ``device-again``, the graphs
kept from the ``device`` row, only the request's copy into their buffers) and whether each decode
emitted the first one's tokens and result log.

    OUT=... python3 experiments/bench_execution.py --models q1-mini      # q1-mini at 2K and 32K
    python3 experiments/bench_execution.py --models q1 --contexts 16 --tokens 64     # rank-emulated q1
    python experiments/bench_execution.py --dry-run                      # CPU, q1-tiny, eager only

q1 (rank 0 of 8, random weights) has needed a short prompt. In session 53 PyTorch held 125 GiB after the
engine built it on an H200, and its reference prefill dequantised each token's 8 experts: 256 tokens asked
for 48 GiB more. Session 54 holds the experts once (``model.stacked_experts``) and groups a prefill by
expert (``Model._moe_grouped``). The shard is 52.6 GiB; longer q1 prompts have not been run on the GPU
since.
Writes ``$OUT/bench_execution.json`` (every step's time). Times name the machine; compare the
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
    steps = [t / 1e3 for t in g.step_ns]          # us (the device loop's: %globaltimer; else host)
    body = steps[1:] or steps
    tokens = sum(s["emitted"] for s in g.steps[1:]) or 1
    loop_us = g.loop_ns / 1e3
    return {"model": model, "context": ctx, "execution": execution, "steps": len(steps),
            "step_us": statistics.median(body), "tpot_us": sum(body) / tokens,
            "loop_tpot_us": loop_us / max(1, sum(s["emitted"] for s in g.steps)),
            "first_us": steps[:2], "before_steps_ms": (wall_s * 1e6 - loop_us) / 1e3,
            "tokens_per_step": g.tokens_per_step, "identical": same, "step_us_all": steps}


def bench(model: str, ctx: int, tokens: int, seed: int, executions: list[str]) -> None:
    eng = engine_for(model, "eager")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, eng.cfg.vocab_size, (ctx,), generator=gen).tolist()
    with torch.no_grad():
        rnd, st = eng.start(prompt, seed, tokens)
    execs = executions if CUDA else ["eager"]
    forks = [(rnd, st)] + [fork_request(rnd, st) for _ in execs[1:]]
    rows, ref = [], None
    for ex, (r, s) in zip(execs, forks):
        # the same engine and weights, each execution from the same state ("device-flat": the device
        # loop with its extra depths' IFs one after another, not nested; "device-again": the device
        # loop once more, its graphs kept from the row before: runtime.reuse_graphs)
        eng.execution = "device" if ex.startswith("device") else ex
        eng._devloop_options = {"nested": False} if ex == "device-flat" else {}
        got, got_s = decode_timed(eng, r, s)
        ref = ref or got
        rows.append(row(model, ctx, ex, got, got_s, got.tokens == ref.tokens and got.steps == ref.steps))
    for r in rows:
        ROWS.append(r)
        log(f"{r['model']:<8} {r['context']:>7} {r['execution']:<11} {r['steps']:>5} {r['step_us']:>10.1f} "
            f"{r['tpot_us']:>10.1f} {r['loop_tpot_us']:>10.1f} {r['first_us'][0]:>9.0f} {r['first_us'][-1]:>9.0f} "
            f"{r['before_steps_ms']:>11.1f} {r['tokens_per_step']:>8.2f} {'yes' if r['identical'] else 'NO'}")
    for r in rows[1:]:
        log(f"{'':<8} {'':>7} {r['execution']}/{rows[0]['execution']}: step {r['step_us'] / rows[0]['step_us']:.4f}, "
            f"TPOT {r['tpot_us'] / rows[0]['tpot_us']:.4f}, loop TPOT {r['loop_tpot_us'] / rows[0]['loop_tpot_us']:.4f}")
    del eng, rnd, st, forks
    if CUDA:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="q1-mini", help="comma-separated: q1-mini, q1 (rank 0 of 8), q1-tiny")
    ap.add_argument("--contexts", default="2048,32768", help="prompt lengths (random tokens)")
    ap.add_argument("--tokens", type=int, default=96, help="output budget per decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executions", default="eager,captured,device,device-again",
                    help="comma-separated, the first the reference of the ratios (eager | captured | device | "
                         "device-flat: the device loop with its depth IFs one after another, not nested | "
                         "device-again: the device loop reusing the graphs the row before built)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, eager only: checks the script")
    args = ap.parse_args()
    models = ["q1-tiny"] if DRY_RUN else args.models.split(",")
    contexts = [64] if DRY_RUN else [int(c) for c in args.contexts.split(",")]
    log(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; {args.tokens} tokens per decode")
    log(f"{'model':<8} {'context':>7} {'execution':<11} {'steps':>5} {'step us':>10} {'TPOT us':>10} {'loop TPOT':>10} "
        f"{'step0 us':>9} {'step1 us':>9} {'before ms':>11} {'tok/step':>8} same")
    for m in models:
        for c in contexts:
            bench(m, c, args.tokens, args.seed, args.executions.split(","))
    if CUDA and any(e.startswith("device") for e in args.executions.split(",")):
        from runtime.devloop import control_kernels
        log(f"device loop's control kernels compiled by {control_kernels(DEV)['_compiler']}")
    path = write_results("bench_execution", {"args": vars(args), "device": str(DEV)}, ROWS)
    if path:
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
