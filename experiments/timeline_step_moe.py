"""The MoE's per-program timeline inside the q1 step's CUDA graph (one verify layer), per variant.

    OUT=... python3 experiments/timeline_step_moe.py [--context 8192] [--layer 44]
        [--variants default,moe_gu_st3] [--replays 20] [--dry-run]

``timeline_moe.py`` records the MoE's programs in a graph of back-to-back MoE calls; the step runs
the MoE between the router and the next layer's projections, and sessions 26-27 found the two
disagree (3 Gate/Up stages: ~2 % faster alone, ~4 % slower in the step, the loss inside the Gate/Up
kernel itself). This script records the same per-program stamps (SM, entry, after the wait, end;
``moe_plan(_timeline=)``) inside the step: the q1 rank-emulated step of ``bench_step.py`` (verify of
6 rows + 5 draft passes, synthetic caches at ``--context``) is captured as one CUDA graph for each
``--variants`` name (``bench_step.AB_VARIANTS``; ``default``: none), with the records switched on for
the MoE of one verify layer only (``--layer``; every other MoE call is the variant's plain kernel).
Each replay's records are read after it; times are in us after that replay's first Gate/Up wait
return (the router's end), with the keys of ``timeline_moe.py``:

    gate/up: first / last entry, last wait, first / median / 90th-percentile / last end,
             median / longest busy time (end - wait) of a program with a group;
    down:    first entry, last wait, median / last end, median busy time;
    reduce:  last wait, last end;

then per SM, by how many Gate/Up programs it held, when its last one ended and the SM's rate, and
the step's time with the records on (the stamps cost little; ``bench_step.py --ab`` times the
variants without them). $OUT/timeline_step_moe.json holds the medians and the raw records per
variant. ``--dry-run``: the CPU interpreter at q1-tiny shapes (the plumbing only: no timer).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import CUDA, DEV, DRY_RUN, carveout_hook, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402

from bench_step import (AB_VARIANTS, W, build_q1, capture, clone_state, fill_cache, restorer,  # noqa: E402
                        step_fn, synthetic_state, sync)
from runtime.config import DraftConfig, SamplingConfig  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402
from runtime.kernels.attention import TIMELINE_FIELDS  # noqa: E402
from runtime.speculative import Round  # noqa: E402
from timeline_moe import KEYS, _print_per_sm, _sm_last_ends, phases  # noqa: E402


def record_layer(rnd: Round, layer: int, buf: torch.Tensor | None) -> list:
    """rnd runs a shallow copy of its model whose MoE call for verify layer ``layer`` (and only that
    one) records its programs into ``buf`` (``moe_plan(_timeline=)``; None: the interpreter, which
    has no timer). Returns a list that gets one entry per call of that layer's MoE."""
    m = copy.copy(rnd.model)
    target, plain, hits = m.layers[layer], m._moe_options, []

    def moe_fast(lw, *a, **k):
        if lw is target:
            hits.append(1)
        m._moe_options = {**plain, "_timeline": buf} if lw is target and buf is not None else plain
        try:
            return type(m)._moe_fast(m, lw, *a, **k)
        finally:
            m._moe_options = plain
    m._moe_fast = moe_fast
    rnd.model = m
    return hits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer", type=int, default=44, help="the verify layer whose MoE records (0-based)")
    ap.add_argument("--variants", default="default,moe_gu_st3",
                    help="comma-separated bench_step variants (default: none applied)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays recorded per variant")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, q1-tiny shapes, no timer")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v != "default" and v not in AB_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: default, {', '.join(AB_VARIANTS)}")
    if CUDA:
        carveout_hook()   # before any kernel loads: the carveout variants (moe_gu_st3_cv*) need it
    cfg, shard, ref, fast, _ = build_q1(args)
    layer = min(args.layer, cfg.num_layers - 1)
    L = 40 if DRY_RUN else args.context
    replays = 1 if DRY_RUN else args.replays
    gen = torch.Generator(device=DEV).manual_seed(0)
    cache = ref.new_cache(L + 80)
    fill_cache(cache, L, gen)
    st = synthetic_state(ref, L, 64, seed=0, gen=gen)
    restore = restorer(st, clone_state(st))
    H, I, E = cfg.hidden_size, shard.expert_width, cfg.num_experts
    sampling, draft = SamplingConfig(), DraftConfig(policy="fixed", fixed_depth=5)
    rows, raw = [], {}
    for name in names:
        rnd = Round(fast, cache, sampling, draft)
        if name != "default":
            AB_VARIANTS[name](rnd)
        opts = rnd.model._moe_options   # (the record layout follows the variant's Down and reduce grids)
        n_gu, n_dn, n_red = M.timeline_programs(W, H, I, E, down_nb=opts.get("down_nb"),
                                                 red_block_h=opts.get("red_block_h"),
                                                 down_weights_a=opts.get("down_weights_a"))
        buf = torch.zeros(n_gu + n_dn + n_red, TIMELINE_FIELDS, dtype=torch.int64, device=DEV)
        hits = record_layer(rnd, layer, None if DRY_RUN else buf)
        step = step_fn(rnd, st)
        with torch.no_grad():
            if DRY_RUN:
                restore()
                step()
                print(f"{name}: one step ran eagerly; layer {layer}'s MoE was called {len(hits)} time(s) "
                      f"(dry run: no timer, no records)")
                continue
            g = capture(step, restore)
            if len(hits) != 2:   # the eager warm-up and the capture: one call each
                raise SystemExit(f"{name}: layer {layer}'s MoE was called {len(hits)} times in warm-up + capture, not 2")
            recs, ms = [], []
            for _ in range(replays):
                restore()
                sync()
                t0 = time.perf_counter()
                g.replay()
                sync()
                ms.append((time.perf_counter() - t0) * 1e3)
                recs.append(buf.cpu().clone())
            del g
        if os.environ.get("OUT"):   # the raw records first: kept even if the summary below fails
            os.makedirs(os.environ["OUT"], exist_ok=True)
            torch.save(recs, os.path.join(os.environ["OUT"], f"records_{len(rows)}_{name}.pt"))
        per = []
        for r in recs:
            gu = r[:n_gu][r[:n_gu, 4] == 1]
            per.append(phases(r, n_gu, n_dn, int(gu[:, 2].min())))
        med = {k: statistics.median(p[k] for p in per) for k in per[0]}
        print(f"\n{name}: ctx {L}, verify layer {layer}; step with the records {statistics.median(ms):.3f} ms "
              f"(host-timed replays, median of {replays}); us after the Gate/Up's first wait return "
              f"(medians over replays):")
        for k in ["gu_entry_first", "gu_entry_last"] + KEYS[1:]:
            print(f"  {k:16s} {med[k]:8.2f}")
        print(f"  programs with a group: Gate/Up {med['gu_active']:.0f} of {n_gu}, Down {med['dn_active']:.0f} of {n_dn}")
        per_sm, dn_sm = {}, {}
        for r in recs:
            gu = r[:n_gu][r[:n_gu, 4] == 1]
            dn = r[n_gu:n_gu + n_dn][r[n_gu:n_gu + n_dn, 4] == 1]
            _sm_last_ends(gu, int(gu[:, 2].min()), per_sm)
            _sm_last_ends(dn, int(gu[:, 3].max()), dn_sm)
        print("  Gate/Up per SM: programs, SMs per replay, last end after the first wait (median, min-max), SM rate")
        row = dict(variant=name, context=L, layer=layer, step_ms_with_records=statistics.median(ms),
                   programs=[n_gu, n_dn, n_red], **med)
        # bytes per program: Gate + Up FP8 rows of its 32 columns; the Down's share of its expert
        row["gu_per_sm_last_end_us"] = _print_per_sm(per_sm, 2 * M.GU_BLOCK_N * H, len(recs))
        print("  Down per SM: programs, SMs per replay, last end after the last Gate/Up end (median, min-max), SM rate")
        row["down_per_sm_last_end_us"] = _print_per_sm(dn_sm, H * I // (n_dn // min(W * 8, E)), len(recs))
        rows.append(row)
        base = min(int(r[:, 1][r[:, 1] > 0].min()) for r in recs)
        raw[f"{len(rows) - 1}:{name}"] = [torch.cat([r[:, :1], torch.where(r[:, 1:4] > 0, r[:, 1:4] - base, -1), r[:, 4:5]], 1).tolist()
                     for r in recs]
    if rows:
        out = write_results("timeline_step_moe", {"raw": raw, "argv": sys.argv}, rows)
        if out:
            print(f"wrote {out}/timeline_step_moe.json, .csv")
        if len(rows) > 1:
            print("\nside by side (us after the Gate/Up's first wait return):")
            print(f"  {'key':16s} " + " ".join(f"{r['variant']:>14s}" for r in rows))
            for k in ["gu_entry_last"] + KEYS[1:]:
                print(f"  {k:16s} " + " ".join(f"{r[k]:14.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
