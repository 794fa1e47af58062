"""Does where a decode's buffers sit in GPU memory change its speed? The question behind an A/A offset.

A paired replay keeps each arm's device loop (its graphs, state and caches: ``runtime.reuse_graphs``)
across requests and builds it again, larger, only when a request does not fit. If the memory those
buffers land in changes the step time, every request decoded on one kept loop shares that loop's
offset: the requests are no longer independent samples of the arm, and a paired CI over them is too
narrow (an A/A arm that differs from control, or a false win).

Several engines of one model (each its own copy of the weights) decode the same request (random prompt
tokens, forked from one prefill) in rotation:

- ``kept``: each engine's loop built once, then reused: the spread within one placement;
- ``fresh``: before every decode the loop is dropped, ``torch.cuda.empty_cache()`` runs and a pad of a
  random size (a multiple of 2 MiB up to ``--pad-mib``) is held while the loop is built again: a new
  placement of the loop's caches, state and graphs every decode, the engine's weights kept;
- ``rebuilt``: the same, but the whole engine is built again from the shared checkpoint tensors: its
  weights move too (the other engines stay where they are);
- ``epochs``: what ``replay.paired``'s placement epochs do: before each round every engine is dropped,
  then all are built again in a random order, each after its own random pad (held for the round).

Per mode and engine: mean and SD of the time per output token (first step left out, %globaltimer);
between the engines, the SD of their means against what the within-engine SD predicts for it
(``ratio`` ~ 1: the engines are alike; >> 1: each placement carries its own offset).

    OUT=... python3 experiments/placement.py --contexts 2048,32768 --engines 4 --trials 8
    python experiments/placement.py --dry-run        # CPU, q1-tiny, eager: checks the script

Writes ``$OUT/placement.json`` (every decode: engine, mode, trial, TPOT, the first cache's address).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics

from _bench import CUDA, DEV, DRY_RUN, write_results  # noqa: I001  (first: --dry-run switches the interpreter on)

import torch

from runtime import checkpoint as ck
from runtime.config import load_model_config, runtime_config_from_dict
from runtime.engine import Engine, default_checkpoint, resolve_device
from runtime.graphs import fork_request

MIB = 1 << 20


def tpot_us(g) -> float:
    body = g.step_ns[1:] or g.step_ns
    tokens = sum(s["emitted"] for s in g.steps[1:]) or 1
    return sum(body) / tokens / 1e3


def first_cache_address(eng) -> int:
    slot = getattr(eng, "_slot", None)
    return int(slot.rnd.cache.all[0].k.data_ptr()) if slot is not None else -1


def spread(means: list[float], sds: list[float], n: int) -> tuple[float, float, float]:
    """(SD of the engines' means, the SD of a mean that the within-engine SD predicts, their ratio)."""
    between = statistics.stdev(means) if len(means) > 1 else 0.0
    within = math.sqrt(statistics.mean(s * s for s in sds) / n) if n > 0 else 0.0
    return between, within, between / within if within > 0 else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="q1-mini")
    ap.add_argument("--contexts", default="2048,32768", help="prompt lengths (random tokens)")
    ap.add_argument("--tokens", type=int, default=128, help="output budget per decode")
    ap.add_argument("--engines", type=int, default=4, help="engines (each its own weights and loop)")
    ap.add_argument("--trials", type=int, default=8, help="decodes per engine and mode")
    ap.add_argument("--modes", default="kept,fresh,rebuilt,epochs")
    ap.add_argument("--pad-mib", type=int, default=1024, help="largest random pad before a fresh build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, eager: checks the script")
    a = ap.parse_args()
    model = "q1-tiny" if DRY_RUN else a.model
    rt = {"backend": "reference" if DRY_RUN else "fast", "dtype": "float32" if DRY_RUN else "bfloat16",
          "device": str(DEV)}
    rng = random.Random(a.seed)
    cfg, rtc = load_model_config(model), runtime_config_from_dict(rt)
    path = default_checkpoint(cfg)         # the tensors every engine converts from (the harness's WeightCache)
    tensors = (ck.load_checkpoint(path, cfg, rtc.tp) if path is not None
               else dict(ck.random_tensors(cfg, rtc.tp, seed=0, device=resolve_device(rtc.device))))
    build = lambda: Engine(cfg, rtc, tensors, "placement")   # noqa: E731
    engines = [build() for _ in range(a.engines)]
    print(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; model {model}, execution "
          f"{engines[0].execution}, {a.engines} engines, {a.trials} decodes each per mode, {a.tokens} tokens",
          flush=True)
    rows = []
    print(f"{'context':>8} {'mode':>6} {'engine':>6} {'mean us':>9} {'sd us':>7} {'cache addr mod 2MiB':>20}")
    for ctx in [int(c) for c in a.contexts.split(",")]:
        gen = torch.Generator().manual_seed(a.seed)
        prompt = torch.randint(0, engines[0].cfg.vocab_size, (min(ctx, engines[0].cfg.max_context - a.tokens - 32),),
                               generator=gen).tolist()
        with torch.no_grad():
            rnd0, st0 = engines[0].start(prompt, a.seed, a.tokens)
        ref = None
        for mode in a.modes.split(","):
            times = {e: [] for e in range(a.engines)}
            addrs = {e: set() for e in range(a.engines)}
            for trial in range(a.trials):
                order = list(range(a.engines))
                rng.shuffle(order)
                pads = []
                if mode == "epochs":
                    engines = [None] * a.engines
                    if CUDA:
                        torch.cuda.empty_cache()
                    for e in order:
                        pads.append(torch.empty(rng.randrange(0, a.pad_mib // 2 + 1) * 2 * MIB,
                                                dtype=torch.uint8, device=DEV))
                        engines[e] = build()
                    rng.shuffle(order)
                for e in order:
                    pad = None
                    if mode in ("fresh", "rebuilt"):
                        engines[e]._slot = None
                        if mode == "rebuilt":
                            engines[e] = None
                        if CUDA:
                            torch.cuda.empty_cache()
                        pad = torch.empty(rng.randrange(0, a.pad_mib // 2 + 1) * 2 * MIB, dtype=torch.uint8,
                                          device=DEV)
                        if mode == "rebuilt":
                            engines[e] = build()
                    eng = engines[e]
                    rnd, st = fork_request(rnd0, st0)
                    with torch.no_grad():
                        g = eng.decode(rnd, st)
                    del pad
                    ref = ref or g.tokens
                    if g.tokens != ref:
                        raise SystemExit(f"engine {e} decoded other tokens than engine 0: the engines differ")
                    t = tpot_us(g)
                    times[e].append(t)
                    addrs[e].add(first_cache_address(eng))
                    rows.append({"context": ctx, "mode": mode, "engine": e, "trial": trial, "tpot_us": t,
                                 "cache_addr": first_cache_address(eng), "steps": len(g.steps)})
                del pads
            means = [statistics.mean(times[e]) for e in range(a.engines)]
            sds = [statistics.stdev(times[e]) if a.trials > 1 else 0.0 for e in range(a.engines)]
            for e in range(a.engines):
                mods = sorted({x % (2 * MIB) for x in addrs[e] if x >= 0})
                print(f"{ctx:>8} {mode:>6} {e:>6} {means[e]:>9.2f} {sds[e]:>7.2f} "
                      f"{(str(mods[:3]) if len(mods) <= 3 else f'{len(mods)} distinct'):>20}")
            between, within, ratio = spread(means, sds, a.trials)
            lo, hi = min(means), max(means)
            print(f"{ctx:>8} {mode:>6}    all  engines' means {lo:.2f}..{hi:.2f} us ({(hi / lo - 1) * 100:.2f} %): "
                  f"SD between {between:.3f} us, expected from within {within:.3f} us, ratio {ratio:.1f}",
                  flush=True)
    write_results("placement", {"args": vars(a)}, rows)


if __name__ == "__main__":
    main()
