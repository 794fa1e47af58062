"""Whole-step benchmark: the speculative step on the fast backend vs the reference backend.

One command on the GPU machine (repository root; < 6 minutes on one H200):

    PYTHONUNBUFFERED=1 python3 experiments/bench_step.py 2>&1 | tee $OUT/bench_step.log

What it times (eager launches, CUDA events around each step, warm-up first, median over reps):
the step = verify(w=6) + draft_first(w=6) + draft_next at depths 2..5, i.e. 6 live rows and 5
drafts, on

* **q1, rank-emulated** (``tp.size=8 tp.emulate_rank=0``: 88 layers, 6 query heads / 1 KV head,
  a 20,000-logit vocabulary slice, 256-wide expert shards; about 56 GB of weights generated directly
  on the GPU with ``runtime.checkpoint.random_tensors``). One BF16 reference model; the fast model
  shares its weights (``FastModel.from_model``). The restored state is synthetic: caches filled with
  random BF16 data at contexts 8K and 64K (no real 64K prefill of q1), a decode state with 5 drafts
  and their proposals. Before every timed step the decode state is restored (outside the timing), so
  every repetition does the same work. The fast step is also captured as one CUDA graph and
  replayed (what the device loop will launch), reported separately.
* **q1-mini** (the committed checkpoint; real prefill of a random-token prompt): reference FP32,
  reference BF16 and fast, at contexts 2K and 16K.

The floor of the q1 step is the bytes it must read over the device-to-device copy bandwidth measured
in the same run (bytes read + written, as in bench_kernels.py); see :func:`step_bytes` for the
formula (KV extent of the full layers, the sliding rings, the routed experts' FP8 weights and scales
at ~38 distinct experts for a 6-row pass and 8 for a 1-row pass, the attention/router/EH weights and
the LM-head slice, for the verify pass and the 5 draft-layer passes). The floor is also given at the
distinct-expert count observed in the run (random weights route more uniformly than a trained
model).

Output: progress lines, then a short table last; $OUT/bench_step.json and .csv when OUT is set.
``--profile`` also profiles a few replays of the fast step's graph per kernel (torch.profiler) and
prints the device time per part of the step (attention, router, MoE, cuBLAS GEMMs, norms, torch glue)
and the top kernels, with each part's share of the critical path (its launch gaps and its exposed
time: how far its kernels moved the latest end; see ``_bench.critical_path``); the JSON keeps every
kernel ("profiles"). ``--ab NAME[,NAME]`` times the fast step's graph against a variant
(``AB_VARIANTS``: the change applied to a second Round) in one run, replays alternating, and prints
the per-pair ratio with its 10-90 % range. ``--ab-base NAME`` applies a variant to both arms.
Ablations (measurement only, wrong values): ``ceil_router`` replays the real routing instead of
launching the router; ``ceil_router+{part}[+{part}...]`` (or ``--ab-base ceil_router --ab
ceil_{part}``) also skips those parts' launches in every layer pass (``ABLATIONS``): the ceiling of
what fusing them away could save (see ``_ablate`` for why the router's replay is required).

``--sweep 8192,32768,65536,131072,196096`` also replays the fast step's graph at those contexts in paired
rounds (``--sweep-rounds``, every context once per round in a shuffled order) and fits its time against
the K/V bytes the step reads (``kernel_report.sweep_fit``): the slope is what one more byte of context
costs the whole step, printed as a fraction of copy bandwidth beside the step's floor, and drawn into
``step_sweep.png`` when OUT is set (``kernel_report.py --step $OUT`` re-reads it). ``--sweep-base
ceil_router`` replays one routing, recorded at the first context, in every arm at every context (the
synthetic states route differently per context, which would change the MoE's work with the context);
``--sweep-variants`` adds arms (``default_again``: the A/A control). ``--contexts ''`` skips the eager /
reference timings.

``--dry-run`` runs the whole script on the CPU through the Triton interpreter at q1-tiny shapes
(2 layers; rank emulation of 2; wall-clock "timings" that mean nothing), to check the script before
GPU time is spent on it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import os
import platform
import random
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import (CUDA, DEV, DRY_RUN, carveout_hook, carveouts, copy_bandwidth, critical_path,  # noqa: E402
                    time_call, write_results)  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402
import triton  # noqa: E402

import kernel_report  # noqa: E402

from runtime import rng  # noqa: E402
from runtime.checkpoint import random_tensors  # noqa: E402
from runtime.config import DraftConfig, SamplingConfig, TPConfig, load_model_config, make_shard  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.fast import MAX_DECODE_ROWS, FastModel  # noqa: E402
from runtime.kernels.linear import skinny_linear  # noqa: E402
from runtime.kernels import sampler as sampler_kernels  # noqa: E402
from runtime.model import Model  # noqa: E402
from runtime.parallel import make_comm  # noqa: E402
from runtime.speculative import DecodeState, Round  # noqa: E402

T_START = time.perf_counter()
ROWS: list[dict] = []
PROFILES: dict = {}   # context (and "context arm" of --ab pairs) -> per-kernel profile (--profile)
W, DEPTHS = 6, 5             # live rows of the verify pass; draft-layer passes (depth 1 + 2..5)
DISTINCT_6ROWS = 38          # routed experts of a 6-row pass (the brief's working number)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ timing
def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_step(step, restore, reps: int, warmup: int) -> dict:
    for _ in range(warmup):
        restore()
        step()
    sync()
    ts, hs = [], []
    for _ in range(reps):
        restore()
        sync()
        h0 = time.perf_counter()
        ts.append(time_call(step))
        hs.append(time.perf_counter() - h0)
    return {"ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
            "host_ms": statistics.median(hs) * 1e3, "reps": reps}


# Kernel-name patterns -> the part of the step they belong to (first match wins; --profile). Every Triton
# kernel of runtime/ has a part (tests/test_bench_tools.py checks it): session 47 found the folded router
# (`_route_folded_kernel`, the default since session 44) under "other".
KERNEL_PARTS = (
    ("attention split", ("_attn_split",)), ("attention combine", ("_attn_combine",)),
    ("attention (fused)", ("_attn_fused",)), ("rope + kv write", ("_rope_kv",)),
    ("rope tables", ("_rope_tables",)),
    ("router", ("_router", "_route_folded")), ("projections (skinny_linear)", ("_linear_kernel",)),
    ("moe gate/up", ("_moe_gate_up",)), ("moe down", ("_moe_down",)),
    ("moe reduce", ("_moe_reduce",)), ("moe grouping", ("_groups_kernel",)),
    ("expert prefetch", ("_expert_prefetch",)), ("add + rmsnorm", ("_add_rmsnorm", "rmsnorm")),
    ("sampler", ("_sample", "_topk_", "_topp")), ("uniforms", ("_uniform_kernel",)),
    ("round state", ("_take_draft", "_settle_kernel")),
    ("dense GEMM (cuBLAS)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
    ("torch topk/sort", ("topk", "sort", "radix")), ("torch softmax", ("softmax",)),
    ("torch reduce", ("reduce_kernel",)), ("torch copy/cast/fill", ("copy", "fill", "cast")),
    ("torch elementwise", ("elementwise", "vectorized", "unrolled")),
    ("torch index/cat", ("index", "cat", "gather", "scatter")),
)


def kernel_part(name: str) -> str:
    low = name.lower()
    for part, pats in KERNEL_PARTS:
        if any(p.lower() in low for p in pats):
            return part
    return "other"


def _kernel_times(prof) -> dict[str, list]:
    """``_bench.critical_path`` of a profiler's trace (its events of category "kernel")."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            trace = json.load(fh)
    return critical_path((float(ev["ts"]), float(ev.get("dur", 0.0)), ev["name"])
                         for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel")


def profile_replays(replay, restore, n: int = 3) -> dict:
    """Per-kernel device time of ``n`` replays under torch.profiler (CUPTI records the kernels of a
    graph replay one by one), less the kernels of ``n`` restores alone: {"parts": {part: {us, count}},
    "kernels": [[name, us, count]] (top first), "kernel_us": their sum}, all per step."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        restore()
        replay()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            restore()
            replay()
        sync()
    kernels = _kernel_times(prof)
    with profile(activities=[ProfilerActivity.CUDA]) as prof_r:   # the restores' own copies
        for _ in range(n):
            restore()
        sync()
    for name, (us, c, ex, gap) in _kernel_times(prof_r).items():
        if name in kernels:
            k = kernels[name]
            k[0], k[1], k[2], k[3] = k[0] - us, k[1] - c, k[2] - ex, k[3] - gap
    rows = sorted(([name, us / n, c / n, ex / n, gap / n] for name, (us, c, ex, gap) in kernels.items() if c > 0),
                  key=lambda r: -r[1])
    parts: dict[str, dict] = {}
    for name, us, c, ex, gap in rows:
        p = parts.setdefault(kernel_part(name), {"us": 0.0, "count": 0.0, "exposed_us": 0.0, "gap_us": 0.0})
        p["us"] += us
        p["count"] += c
        p["exposed_us"] += ex
        p["gap_us"] += gap
    return {"parts": dict(sorted(parts.items(), key=lambda kv: -kv[1]["exposed_us"] - kv[1]["gap_us"])),
            "kernels": rows, "kernel_us": sum(r[1] for r in rows), "replays": n,
            "path_us": sum(r[3] + r[4] for r in rows)}


def print_profile(prof: dict, step_ms: float) -> None:
    log(f"per-kernel device time of one step (sum {prof['kernel_us'] / 1e3:.2f} ms; the graph takes "
        f"{step_ms:.2f} ms: the rest is launch gaps and dependent waits; PDL overlap can make the sum larger); "
        f"critical path: each part's gaps before its kernels and its exposed time (how far its kernels "
        f"moved the latest end; sum {prof['path_us'] / 1e3:.2f} ms)")
    print(f"    {'part':<28} {'device':>9} {'launches':>9} {'gaps':>9} {'exposed':>9} {'path %':>7}", flush=True)
    for part, v in prof["parts"].items():
        path = v["exposed_us"] + v["gap_us"]
        print(f"    {part:<28} {v['us'] / 1e3:6.3f} ms {v['count']:9.0f} {v['gap_us'] / 1e3:6.3f} ms "
              f"{v['exposed_us'] / 1e3:6.3f} ms {100 * path / (step_ms * 1e3):6.1f}", flush=True)
    print("    top kernels (device ms, launches, gaps ms, exposed ms):", flush=True)
    for name, us, c, ex, gap in prof["kernels"][:25]:
        print(f"    {us / 1e3:8.3f} {c:6.0f}x {gap / 1e3:7.3f} {ex / 1e3:7.3f}  {name[:100]}", flush=True)


def time_graph(step, restore, reps: int, profile: bool = False) -> dict:
    """The step captured once as a CUDA graph (after eager warm-up), replayed after each restore;
    ``profile``: also the per-kernel device time of a few replays (``profile_replays``)."""
    g = capture(step, restore)
    out = time_step(g.replay, restore, reps, warmup=2)
    if profile:
        out["profile"] = profile_replays(g.replay, restore)
    del g
    return out


def capture(step, restore):
    """The step captured once as a CUDA graph (after an eager warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        restore()
        step()
    torch.cuda.current_stream().wait_stream(s)
    sync()
    restore()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g


# Round's hooks (attribute -> the model's method it binds at construction: sampler, uniforms, draft
# update, settle). Round calls them, not rnd.model's methods, so a variant's model must be rebound there.
ROUND_HOOKS = {"_sample_rows": "sample_rows", "_uniform": "uniform", "_take_draft_hook": "take_draft",
               "_settle_hook": "settle"}


def _set_model(rnd: Round, m) -> None:
    """rnd runs ``m``: its model, and each hook of ROUND_HOOKS still bound to the model it replaces
    rebound to m's method (a hook a variant set otherwise, e.g. None or rng.uniform, is left alone).
    Until session 36 only rnd.model changed: a variant whose attributes only the hooks read
    (``sampler_max``'s sampler options; ``torch_glue``'s draft update and settle) timed the default there."""
    old, rnd.model = rnd.model, m
    for attr, name in ROUND_HOOKS.items():
        hook = getattr(rnd, attr, None)
        if hook is not None and getattr(hook, "__self__", None) is old:
            setattr(rnd, attr, getattr(m, name))


def _model_variant(rnd: Round, **attrs) -> None:
    """rnd runs a shallow copy of its model with ``attrs`` set on the copy (same weights, caches),
    through ``_set_model``. Refused on an ablated model: its layers are bound to that model
    (``_ablate``), so the copy's attrs would never run (``apply_variants`` applies the changes first,
    then the ablations)."""
    if getattr(rnd.model, "_ablated", None):
        raise ValueError(f"a change after the ablation {'+'.join(rnd.model._ablated)} would not run: "
                         "apply it before (apply_variants)")
    m = copy.copy(rnd.model)
    for k, v in attrs.items():
        setattr(m, k, v)
    _set_model(rnd, m)


def _peer_fused(rnd: Round, **kw) -> None:
    """rnd's model with the fused all-reduce over a rank-emulation exchange (peer_add_rmsnorm's keywords
    ``kw``)."""
    m = rnd.model
    _model_variant(rnd, _xchg=m.comm.peer_exchange(MAX_DECODE_ROWS, m.cfg.hidden_size, m.device),
                   peer_options={**m.peer_options, **kw})


def _moe_opts(rnd: Round, **kw) -> None:
    """rnd's model with the MoE kernel called with keywords ``kw`` on top of its moe_options."""
    _model_variant(rnd, _moe_options={**rnd.model._moe_options, **kw})


def _attn_opts(rnd: Round, **kw) -> None:
    """rnd's model with the attention kernels called with keywords ``kw`` on top of its attention_options."""
    _model_variant(rnd, _attn_options={**rnd.model._attn_options, **kw})


def _skinny(rnd: Round, **kw) -> None:
    """rnd's model with its projections on skinny_linear called with keywords ``kw``."""
    m = rnd.model
    _model_variant(rnd, _proj=lambda x, w, **k: skinny_linear(x, w, counter=m._linear_counter, **kw, **k))


def _skinny_by(rnd: Round, qkv: dict, o: dict) -> None:
    """rnd's model with skinny_linear called with keywords ``qkv`` for the fused Q/K/V projection and
    ``o`` for the output projection (told apart by their weights' shapes)."""
    m = rnd.model
    n_qkv = (m.shard.num_heads + 2 * m.shard.num_kv_heads) * m.cfg.head_dim
    _model_variant(rnd, _proj=lambda x, w, **k: skinny_linear(x, w, counter=m._linear_counter,
                                                              **(qkv if w.shape[0] == n_qkv else o), **k))


def _router(rnd: Round, **kw) -> None:
    """rnd's model with its router kernel called with keywords ``kw`` (route_topk's; with or without
    the fused norm). route_topk only runs with the rounded routing, so these variants also set
    kernels.routing=rounded (since session 44 the default is folded): compare them with
    ``routing_rounded``, not with the default."""
    _model_variant(rnd, router_options={**rnd.model.router_options, **kw},
                   kernels=dataclasses.replace(rnd.model.kernels, routing="rounded"))


def _one_stage(m, logits, u, s):
    """``sampler_one_stage``'s sampling: the sampler's kernel on this rank's slice alone, its ids made global."""
    ids, probs, tok, idx = sampler_kernels.sample_topk_topp(logits, u, s.temperature, s.top_k, s.top_p,
                                                            **m._sampler_options)
    return ids + m.shard.vocab_start, probs, tok + m.shard.vocab_start, idx


def _stale(fn, cache: dict, key=None):
    """``fn``'s result on its first call per key (by default the shapes of its tensor arguments,
    positional and keyword), computed with real values during the eager warm-up, then that same
    tensor again without launching anything."""
    def call(*args, **kw):
        k = key(*args) if key else tuple((i, tuple(a.shape)) for i, a in [*enumerate(args), *kw.items()]
                                         if isinstance(a, torch.Tensor))
        if k not in cache:
            cache[k] = fn(*args, **kw)
        return cache[k]
    return call


_ROUTES: dict = {}   # (rows, router weight's address) -> (ids, weights): the routing ceil_router replays


def _ablate(rnd: Round, *parts: str) -> None:
    """MEASUREMENT ONLY, WRONG VALUES: rnd's model skips ``parts``' launches in every layer pass (their
    consumers read what the warm-up left, or garbage), so an A/B ratio is the most that removing the
    parts (their bytes, their chains and their launch boundaries) could save in the step: the ceiling
    of a fusion before it is built. Parts: ABLATIONS; repeated calls add parts.

    ``router`` replays each layer's routing from ``_ROUTES``, which the first router-ablated pass after
    ``_ROUTES.clear()`` records from its own router calls; bench_q1 makes that a pass with nothing
    else ablated, so the replay is exactly the routing the default computes on the restored state.
    Every other part changes the values the router would see (stale or garbage: session 24's first
    measurement of ``combine`` collapsed the routing to a few experts and "saved" 24 % of the step),
    and the MoE's time depends on the number of distinct experts; so the other parts are only
    accepted together with ``router`` and are measured against ``ceil_router`` (``--ab-base
    ceil_router``). The ablated passes launch the parts apart (``fuse_router_norm`` off), so they route
    rounded; since session 44 the default routes folded, so the recorded routing can differ from the
    default's at near ties (0.2 % of choices on random q1 data, session 44)."""
    from runtime import fast as _fast
    parts = tuple(getattr(rnd.model, "_ablated", ())) + parts
    if "router" not in parts:
        raise ValueError(f"ablation {'+'.join(parts)}: every part but the router changes the routing; "
                         f"use ceil_router+{'+'.join(parts)} or --ab-base ceil_router")
    _set_model(rnd, getattr(rnd.model, "_unablated", rnd.model))
    m = rnd.model
    n_qkv = (m.shard.num_heads + 2 * m.shard.num_kv_heads) * m.cfg.head_dim
    h, nhd = m.cfg.hidden_size, m.shard.num_heads * m.cfg.head_dim
    # (the parts as they are launched apart: the pre-MoE norm is its own launch again)
    patches, attrs, cache = [], {"_ablated": parts, "_unablated": m, "fuse_router_norm": False}, {}
    stale_proj = {}
    for part in parts:
        if part == "pre_moe_norm":       # the add + RMSNorm between the output projection and the router
            attrs["_add_norm"] = _stale(m._add_norm, cache)
        elif part in ("qkv", "o_proj"):  # one of the two projections (told apart by the weight's shape)
            stale_proj[(n_qkv, h) if part == "qkv" else (h, nhd)] = _stale(m._proj, cache)
        elif part == "rope":             # RoPE + the K/V cache write (the attention reads stale q and rows)
            patches.append((_fast._rope, "rope_kv_write", _stale(_fast._rope.rope_kv_write, cache)))
        elif part == "combine":          # the attention's combine (the output projection reads garbage)
            patches.append((_fast._attn, "_combine", lambda *a, **k: None))
        elif part == "router":           # the router: each layer's warm-up routing replayed
            patches.append((_fast._router, "route_topk", _stale(
                _fast._router.route_topk, _ROUTES, key=lambda x, wr, *a: (x.shape[0], wr.data_ptr()))))
        elif part == "moe_reduce":       # the MoE's reduce + next norm (the next layer reads garbage)
            patches.append((_fast._moe, "_launch_reduce", lambda *a, **k: None))
        else:
            raise KeyError(f"ablation {part!r}: one of {ABLATIONS}")
    if stale_proj:
        real = m._proj
        attrs["_proj"] = lambda x, w, **k: stale_proj.get(tuple(w.shape), real)(x, w, **k)
    _model_variant(rnd, **attrs)
    layers = type(rnd.model)._layers_fast.__get__(rnd.model)   # the copy's, with attrs

    def run(*args, **kw):
        with contextlib.ExitStack() as stack:   # module attributes replaced for the pass, then restored
            for mod, name, value in patches:
                stack.enter_context(mock.patch.object(mod, name, value))
            return layers(*args, **kw)
    rnd.model._layers_fast = run


def record_routing(rnd: Round, st, restore) -> int:
    """``_ROUTES`` anew from one pass of ``rnd`` with only the router ablated, i.e. the routing the
    default computes on the restored state, which every ceil_router pass after it replays; returns
    the number of (rows, router) keys recorded."""
    _ROUTES.clear()
    _ablate(rnd, "router")
    restore()
    with torch.no_grad():
        step_fn(rnd, st)()
    return len(_ROUTES)


def _ceil_parts(name: str) -> list[str]:
    """The parts of an ablation name ``ceil_{part}[+{part}...]`` ([] for any other name)."""
    return name[len("ceil_"):].split("+") if name.startswith("ceil_") else []


def ab_variant(name: str):
    """The A/B variant ``name``: one of AB_VARIANTS, or ``ceil_{part}[+{part}...]`` (_ablate)."""
    if name in AB_VARIANTS:
        return AB_VARIANTS[name]
    parts = _ceil_parts(name)
    if not parts or not set(parts) <= set(ABLATIONS):
        raise KeyError(name)
    return lambda rnd: _ablate(rnd, *parts)


def apply_variants(rnd: Round, *names: str | None) -> None:
    """The variants ``names`` (None and "default" skipped) applied to rnd: every change first, then the
    ablations (``ceil_*``), whatever the order given. An ablated model runs layers bound to itself, so
    a change applied after an ablation changed a copy that nothing ran: until session 35 (found by the
    sweep's control arm) ``--ab-base ceil_router --ab attn_ns66`` timed the default twice, silently;
    ``_model_variant`` now refuses that order."""
    names = [n for n in names if n and n != "default"]
    for n in sorted(names, key=lambda n: n.startswith("ceil_")):   # stable: changes, then ablations
        ab_variant(n)(rnd)


def check_sweep_variants(names: list[str]) -> None:
    """--sweep-variants takes the --ab variants that change how the step runs, not the ablations
    (measurement only: they skip launches and replay a routing recorded at one context)."""
    for v in names:
        if v != "default" and (v.startswith("ceil_") or v not in AB_VARIANTS):
            raise ValueError(f"{v!r} is not an --ab variant" + (" (ablations are not swept)" if v.startswith("ceil_")
                                                                  else ""))


def check_ab_names(names: list[str], base: str | None) -> None:
    """KeyError for an unknown name, ValueError for an ablation pair that would change the routing
    (``_ablate``'s rule, checked before any GPU work)."""
    base_parts = _ceil_parts(base or "")
    for n in names + ([base] if base else []):
        ab_variant(n)
        if n.startswith("ceil_"):
            parts = _ceil_parts(n) + (base_parts if n != base else [])
            if "router" not in parts:
                raise ValueError(f"{n}: ablations other than the router change the routing; pair them "
                                 f"with it (ceil_router+{n[len('ceil_'):]}, or --ab-base ceil_router)")


ABLATIONS = ("pre_moe_norm", "qkv", "o_proj", "rope", "combine", "router", "moe_reduce")


def _lin(spec: str) -> dict:
    """skinny_linear keywords from "st6", "st6.bn32.sk4", "st12.bk64", "st6.nw8" ("" = the defaults)."""
    keys = dict(st="num_stages", bn="block_n", sk="split_k", bk="block_k", nw="num_warps")
    return {keys[p[:2]]: int(p[2:]) for p in spec.split(".") if p}


# skinny_linear tilings and pipeline depths per projection: name -> (Q/K/V spec, output spec); the
# names count stages against session 20's first default of 4 (calls 2-3), so "lin_q6" is now the default
LINEAR_VARIANTS = {
    "lin_q6": ("st6", ""), "lin_o6": ("", "st6"), "lin_q5_o5": ("st5", "st5"), "lin_q8_o8": ("st8", "st8"),
    "lin_q12_o6": ("st12", "st6"), "lin_q8bk64_o6": ("st8.bk64", "st6"), "lin_q12bk64_o12bk64": ("st12.bk64", "st12.bk64"),
    "lin_q6bn64sk8_o6": ("st6.bn64.sk8", "st6"), "lin_q6bn32sk8_o6": ("st6.bn32.sk8", "st6"),
    "lin_q6bn16sk4_o6": ("st6.bn16.sk4", "st6"), "lin_q6_o6bn64sk2": ("st6", "st6.bn64.sk2"),
    "lin_q6_o6bn32sk1": ("st6", "st6.bn32.sk1"), "lin_q6w8_o6w8": ("st6.nw8", "st6.nw8"),
    "lin_q6w2_o6w2": ("st6.nw2", "st6.nw2"),
    # (session 24: with the Q/K/V partials summed in rope_kv_write, more K slices cost no last arriver)
    "lin_q6bn64sk16_o6": ("st6.bn64.sk16", "st6"), "lin_q6bn128sk16_o6": ("st6.bn128.sk16", "st6"),
    "lin_q6bn64sk4_o6": ("st6.bn64.sk4", "st6"), "lin_q6bn32sk2_o6": ("st6.bn32.sk2", "st6"),
    "lin_q6bn16sk8_o6": ("st6.bn16.sk8", "st6"),
    # (session 27: the Q/K/V's planned tiling with partials is 64 x 8 in K steps of 64, i.e.
    # lin_q6bn64sk8bk64_o6; lin_q6bn64sk8_o6 now takes steps of 128; this is the tiling before)
    "lin_q6bn32sk4_o6": ("st6.bn32.sk4", "st6"),
    # (and around the new tiling: 3 / 4 stages, 64-column K steps, 128 x 8, 64 x 12)
    "lin_q4bn64sk8_o6": ("st4.bn64.sk8", "st6"), "lin_q3bn64sk8_o6": ("st3.bn64.sk8", "st6"),
    "lin_q6bn64sk8bk64_o6": ("st6.bn64.sk8.bk64", "st6"), "lin_q6bn128sk8_o6": ("st6.bn128.sk8", "st6"),
    "lin_q6bn64sk12_o6": ("st6.bn64.sk12", "st6"),
    "lin_q6bn64sk8bk32_o6": ("st6.bn64.sk8.bk32", "st6"), "lin_q_o6bk64": ("", "st6.bk64"),
}


# Same-run A/B of the fast step's graph (--ab NAME): NAME's change applied to a second Round.
AB_VARIANTS = {
    # the default again in a graph of its own: an A/A control (with --ab, the pair's own spread; with
    # --sweep-variants, what capturing the same step twice does to its time at each context)
    "default_again": lambda rnd: None,
    # the round's uniforms from rng.uniform's torch sequence (~50 launches per call) instead of the
    # one-launch kernel (FastModel.uniform)
    "torch_uniforms": lambda rnd: setattr(rnd, "_uniform", rng.uniform),
    # the Q/K/V and output projections on torch matmul (cuBLAS) instead of skinny_linear
    "cublas_linear": lambda rnd: _set_model(rnd, FastModel.from_model(
        rnd.model, kernels=dataclasses.replace(rnd.model.kernels, linear="reference"))),
    # skinny_linear launched plainly (no early launch)
    "linear_no_pdl": lambda rnd: _skinny(rnd, pdl=False),
    # skinny_linear with the L2 prefetch of its weight before its wait (session 14: slower, off by
    # default; call 4 measured its absence as "linear_no_prefetch" when it was on)
    "linear_prefetch": lambda rnd: _skinny(rnd, prefetch=True),
    # the projections with x as the MMA's A operand (skinny_linear weights_a=False; the weight tile as
    # the A operand by default since session 23)
    "linear_x_a": lambda rnd: _skinny(rnd, weights_a=False),
    # the router and Gate/Up launched plainly (not programmatic dependents of the norm / the router)
    "router_gu_plain": lambda rnd: _model_variant(rnd, moe_pdl=False, _moe_options={**rnd.model._moe_options,
                                                                                    "gu_pdl": False}),
    # the router's slice streamed in BLOCK_K steps after its wait for the norm (the way before session
    # 17) instead of loaded before it (route_topk weights_first; with the rounded routing, where
    # route_topk runs: compare with routing_rounded)
    "router_weights_after": lambda rnd: _model_variant(rnd, router_weights_first=False, kernels=dataclasses.replace(
        rnd.model.kernels, routing="rounded")),
    # the norms' (and the MoE reduce's fused norm's) weight loaded after the wait, at the end of the
    # chain (the way before session 17) instead of before it (norm weight_first)
    "norm_weight_after": lambda rnd: _model_variant(rnd, norm_weight_first=False),
    # short attention splits reading their first K/V block after the wait for rope_kv_write (the way
    # before session 17) instead of before it when the block lies below start_pos (kv_before_wait)
    "attn_kv_after_wait": lambda rnd: _attn_opts(rnd, kv_before_wait=False),
    # the attention combine releases the output projection at its start (attention option release_next)
    "release_next": lambda rnd: _attn_opts(rnd, release_next=True),
    # attention splits of at most N key blocks (every split of a 4K ring or an 8K cache has one)
    # request their first block's K and V before Q and take the masked path (kv_first; session 16,
    # default 1); attn_kv_first0 is the way before it
    **{f"attn_kv_first{n}": (lambda rnd, n=n: _attn_opts(rnd, kv_first=n)) for n in (1, 2, 0)},
    # the same for splits of up to N blocks (a 12-16K cache has 2 per split, 24K 3, 32K 4), each of the
    # split's N blocks also asked of L2 before the wait (prefetch=N): the blocks after the first, read
    # after the wait by the masked loop one at a time, then come from L2 (session 35)
    **{f"attn_kv_first{n}_pf{n}": (lambda rnd, n=n: _attn_opts(rnd, kv_first=n, prefetch=n)) for n in (2, 3, 4)},
    # the pass's glue in torch: RoPE tables (eight launches per pass), ring slots, the embedding gather
    # as torch launches, norms with a zero residual tensor (FastModel.fused_glue off; it also turns the
    # one-launch draft update and settle off: since session 36 (_set_model); before, Round's hooks kept
    # them on, so earlier torch_glue A/Bs measured the passes' glue only)
    "torch_glue": lambda rnd: _model_variant(rnd, fused_glue=False),
    # the paths a rank takes when it has real peers (FastModel._has_peers() true; under rank emulation it
    # is false): the output projection's residual add, the pre-MoE norm, the routing (rounded, not folded)
    # and the MoE's norm apart from the kernels before them (the all-reduce must come between). The
    # collectives stay emulation's no-ops, so the ratio is what a real TP rank pays for the fusions it
    # cannot use, communication excluded. Session 48: 1.154 / 1.150 at 8K / 64K while the sampling and the
    # draft update also went to torch with peers; since, they take the kernels in two stages with or
    # without peers (FastModel._sample_fast): 1.040 / 1.041
    "peer_paths": lambda rnd: _model_variant(rnd, _has_peers=lambda: True),
    # a real rank's paths with the fused all-reduce (tp.fused_allreduce; runtime/kernels/peer.py): each
    # all-reduce before a norm inside that norm's kernel, over a rank-emulation exchange (this rank's
    # buffer and protocol in full; the peers' buffers static zeros, read but never waited for). Against
    # peer_paths: what the exchange's kernel costs beside the plain add + norm, traffic between GPUs
    # excluded (emulation); against the default, what a real rank's step pays less that traffic
    "peer_fused": lambda rnd: _peer_fused(rnd),
    # the same with fences around the exchange (peer.FENCE is "none": the re-arm two points back needs
    # none; see peer._FENCES for the forms): what they would cost
    **{f"peer_fused_fence_{f}": (lambda rnd, f=f: _peer_fused(rnd, fence=f))
       for f in ("sys", "gpu", "sys_acq", "sys_rel", "sys_one", "gpu_one")},
    # the exchange's fast path with two reductions (peer.ONE_REDUCE is True), and the sequence number read
    # before the wait (measurement only: see peer_add_rmsnorm's _seq_first). Session 50 call 1 ran these
    # names (and _fence_none, _one_reduce, _floor) against session 49's defaults: fence sys, two reductions
    "peer_fused_two_reduce": lambda rnd: _peer_fused(rnd, one_reduce=False),
    "peer_fused_seq_first": lambda rnd: _peer_fused(rnd, _seq_first=True),
    # the exchange as session 49 left it: the re-arm one point back with system-scope fences, two
    # reductions, the MoE's all-reduce in the exchange's own kernel after the reduce
    "peer_fused_s49": lambda rnd: (_peer_fused(rnd, fence="sys", rearm_lag=1, one_reduce=False),
                                   _model_variant(rnd, peer_moe_reduce=False, peer_o_proj=False)),
    # the re-arm one point back with the acquire fence it needs (rearm_lag=1, fence="sys_acq")
    "peer_fused_lag1": lambda rnd: _peer_fused(rnd, fence="sys_acq", rearm_lag=1),
    # the MoE reduce writing the rank's partial sum, all-reduced by the exchange's own kernel after it
    "peer_fused_reduce_apart": lambda rnd: (_peer_fused(rnd), _model_variant(rnd, peer_moe_reduce=False)),
    # the output projection writing the rank's partial sum, all-reduced with the add + norm by the
    # exchange's own kernel after it, and the routing rounded (the default's way before session 51)
    "peer_fused_o_apart": lambda rnd: (_peer_fused(rnd), _model_variant(rnd, peer_o_proj=False)),
    # the output projection's arrival ticket relaxed (linear.PEER_TICKET is "acq_rel")
    "peer_fused_ticket_relaxed": lambda rnd: (_peer_fused(rnd), _model_variant(rnd, peer_o_options={"ticket": "relaxed"})),
    # the sampling of a rank-emulated step in one stage: the rank's own top k drawn from directly, no
    # second stage over the (here one rank's) gathered candidates (the emulated step's way before session
    # 48; since, FastModel._sample_fast runs both stages under any TP, as a real rank must)
    "sampler_one_stage": lambda rnd: _model_variant(rnd, _sample_fast=functools.partial(_one_stage, rnd.model)),
    # the sampler selecting its top 20 by max-reductions (the way before session 36) / bitonic sort
    # instead of by ranks (kernels.sampler_options select; sampler.SELECT)
    **{f"sampler_{n}": (lambda rnd, n=n: _model_variant(rnd, _sampler_options={**rnd.model._sampler_options,
                                                                               "select": n})) for n in ("max", "bitonic")},
    # each draft depth's state update as Round's torch sequence on sample_rows (about twenty launches)
    # instead of FastModel.take_draft (the sampler's kernel, then one launch)
    "torch_draft_update": lambda rnd: setattr(rnd, "_take_draft_hook", None),
    # verify's writes after the rejection sampling as Round's torch sequence (about forty launches)
    # instead of FastModel.settle (one launch)
    "torch_settle": lambda rnd: setattr(rnd, "_settle_hook", None),
    # the MoE's output and the next residual add + RMSNorm in two launches (the reduce, then the norm)
    # instead of one (FastModel.fuse_moe_norm off)
    "moe_norm_apart": lambda rnd: _model_variant(rnd, fuse_moe_norm=False),
    # the fused Q/K/V projection's split-K partials summed by its last arriving program (the way before
    # session 24) instead of inside rope_kv_write (FastModel.qkv_sum_in_rope; same bits)
    "qkv_sum_in_linear": lambda rnd: _model_variant(rnd, qkv_sum_in_rope=False),
    # the pre-MoE add + RMSNorm as its own launch between the output projection and the router
    # (FastModel.fuse_router_norm, session 25: the projection adds, the router normalises; without it
    # the routing is the rounded one, route_topk: since session 44 compare with routing_rounded)
    "router_norm_apart": lambda rnd: _model_variant(rnd, fuse_router_norm=False),
    # the router's own product of the BF16-rounded h (route_topk(norm=), kernels.routing=rounded: the
    # default until session 44) instead of the routing folded into the output projection (the default
    # since: its epilogue writes FP32 router-logit partials, route_folded sums them and routes; other
    # numerics, near ties). routing_folded sets the default explicitly (an A/A now; session 44 measured it
    # against the rounded default: 0.9772 / 0.9795 at 8K / 64K)
    "routing_rounded": lambda rnd: _model_variant(rnd, kernels=dataclasses.replace(rnd.model.kernels, routing="rounded")),
    "routing_folded": lambda rnd: _model_variant(rnd, kernels=dataclasses.replace(rnd.model.kernels, routing="folded")),
    # the expert prefetch (FastModel.expert_prefetch, runtime/kernels/prefetch.py; DESIGN.md "Kernels"):
    # per layer pass, a side-stream launch asks L2 for N MiB of the Gate/Up weights of the experts the
    # layer chose in its previous pass, forked when the pass starts (xpfN), before the attention split
    # (xpfN_attn) or before the router (xpfN_router). The graph replays the same step, so the prediction
    # is this pass's own routing: the oracle, the most a predictor could give. xpf0 launches the prefetch
    # kernel with nothing to ask for (the fork's own cost). Session 45: every one slower (1.002-1.18)
    **{f"xpf{n}": (lambda rnd, n=n: _model_variant(rnd, expert_prefetch=(n << 20, "layer"), _pred_ids={},
                                                  _side_stream=None)) for n in (0, 4, 8, 16, 32, 64)},
    **{f"xpf{n}_{tag}": (lambda rnd, n=n, at=at: _model_variant(rnd, expert_prefetch=(n << 20, at), _pred_ids={},
                                                               _side_stream=None))
       for n in (0, 4, 8, 16, 32) for tag, at in (("attn", "attention"), ("router", "router"))},
    # the same with the budget as the first K columns of every row of each predicted expert
    # (expert_prefetch k_first: every Gate/Up program's first K steps)
    **{f"xpfk{n}{tag}": (lambda rnd, n=n, at=at: _model_variant(rnd, expert_prefetch=(n << 20, at, True), _pred_ids={},
                                                              _side_stream=None))
       for n in (8, 16, 32, 48) for tag, at in (("", "layer"), ("_router", "router"))},
    # the router with n warps per program (router.NUM_WARPS; fused with the norm, NORM_NUM_WARPS)
    **{f"router_w{n}": (lambda rnd, n=n: _router(rnd, num_warps=n)) for n in (2, 4, 8, 16)},
    # the norm apart, its router with n warps
    **{f"router_norm_apart_w{n}": (lambda rnd, n=n: (_model_variant(rnd, fuse_router_norm=False),
                                                    _router(rnd, num_warps=n))) for n in (8, 16)},
    # RoPE's tables computed in every rope_kv_write program (FP64 cos / sin) instead of once per pass
    # in torch (session 15, call 2: 0.3 % slower together with the glue above; off by default)
    "kernel_rope_tables": lambda rnd: _model_variant(rnd, rope_tables_in_kernel=True),
    # skinny_linear with 3 / 4 / 6 pipeline stages (default linear.NUM_STAGES: 6 since session 20)
    **{f"linear_st{n}": (lambda rnd, n=n: _skinny(rnd, num_stages=n)) for n in (3, 4, 6)},
    # the router in 2 ... 48 H slices (route_topk split_h; default router.SPLIT_H)
    **{f"router_sh{n}": (lambda rnd, n=n: _router(rnd, split_h=n)) for n in (2, 4, 8, 12, 16, 24, 48)},
    # the MoE's Gate/Up with 3 / 4 / 5 stages, the wide Down with 4 (defaults moe.GU_NUM_STAGES,
    # moe.DOWN_WIDE_NUM_STAGES; a stage count other than the default keeps the driver's carveout, so
    # moe_gu_st4 is the default before session 28)
    **{f"moe_gu_st{n}": (lambda rnd, n=n: _moe_opts(rnd, gu_num_stages=n)) for n in (3, 4, 5)},
    # the Gate/Up in K steps of 64 (moe gu_block_k; default 128, the scale block): 2 steps per iteration
    # at 4 stages (half the default's shared memory and bytes in flight: 30 KiB, sm_90 compile), 4 steps
    # per iteration (the default's 60 KiB: Triton buffers each unrolled load's stages) or 2 at 8 stages
    "moe_gu_bk64": lambda rnd: _moe_opts(rnd, gu_block_k=64),
    "moe_gu_bk64_u4": lambda rnd: _moe_opts(rnd, gu_block_k=64, gu_unroll=4),
    "moe_gu_bk64_st8": lambda rnd: _moe_opts(rnd, gu_block_k=64, gu_num_stages=8),
    # the Gate/Up with x and the wide Down with the activations as the MMA's A operand (the forms
    # before session 23; the defaults since: the weights), each alone and both
    "moe_gu_x_a": lambda rnd: _moe_opts(rnd, gu_weights_a=False),
    "moe_down_x_a": lambda rnd: _moe_opts(rnd, down_weights_a=False),
    "moe_x_a": lambda rnd: _moe_opts(rnd, gu_weights_a=False, down_weights_a=False),
    "moe_down_st4": lambda rnd: _moe_opts(rnd, down_num_stages=4),
    # (session 28) the wide Down in less shared memory, so that it can join an SM beside the Gate/Up's
    # programs in their 132 KiB carveout (74 KiB at the default 6 blocks x 3 stages: beside one only)
    # (the default since session 28 is 4 blocks at 2 stages: moe_dnb4_st2 is an A/A, moe_dnb6_st3 the
    # Down before it; on session 28's call 6 moe_down_st2 was 6 x 2 and moe_dnb4 4 x 3, the old stages)
    "moe_down_st2": lambda rnd: _moe_opts(rnd, down_nb=6, down_num_stages=2),
    "moe_dnb4_st2": lambda rnd: _moe_opts(rnd, down_nb=4, down_num_stages=2),
    "moe_dnb6_st3": lambda rnd: _moe_opts(rnd, down_nb=6, down_num_stages=3),
    # the Down ranking the ids itself (no group table) and L2-prefetching its first N weight tiles before
    # its wait (ab_moe's ranked_pf{N}; session 42: no gain)
    **{f"moe_ranked_pf{n}": (lambda rnd, n=n: _moe_opts(rnd, group_table=False, down_prefetch=n)) for n in (1, 2, 4)},
    # the wide Down's expert group read from the Gate/Up's table / ranked from the ids (group_table)
    "moe_group_table": lambda rnd: _moe_opts(rnd, group_table=True),
    "moe_group_ranked": lambda rnd: _moe_opts(rnd, group_table=False),
    **{f"moe_gt_dnb{n}": (lambda rnd, n=n: _moe_opts(rnd, group_table=True, down_nb=n)) for n in (4, 8)},
    # the groups ranked through the experts' bitmap / by P x P comparisons (group_bits)
    "moe_group_bits": lambda rnd: _moe_opts(rnd, group_bits=True),
    "moe_group_cmp": lambda rnd: _moe_opts(rnd, group_bits=False),
    "moe_group_cmp_st3": lambda rnd: _moe_opts(rnd, group_bits=False, gu_num_stages=3),
    # (with 4 / 5 Gate/Up stages: 60 / 80 KiB of shared memory, at most 3 / 2 Gate/Up programs per SM)
    **{f"moe_group_bits_st{n}": (lambda rnd, n=n: _moe_opts(rnd, group_bits=True, gu_num_stages=n)) for n in (4, 5)},
    # preferred shared-memory carveouts (Triton sets the largest only above 48 KiB of shared memory):
    # every kernel's at the largest (except the Gate/Up's, which moe's launch sets to its own,
    # GU_CARVEOUT, before every launch) / the Gate/Up's at the largest (its moe keyword)
    "carve_all100": lambda rnd: _carve(rnd, (None, 100)),
    "carve_gu100": lambda rnd: _moe_opts(rnd, gu_carveout=100),
    # the Gate/Up at 3 stages (40 KiB) with its carveout capping the programs per SM (moe gu_carveout;
    # the default since session 28: 3 stages at 57 %): 57 % of 228 KiB asks for the 132 KiB
    # configuration (3 programs of 40 + 1 KiB), 71 % for 164 KiB (4); nocv: the driver's default (5
    # fit). Until session 28 these set the carveout through _carve, whose hook bench_step installed
    # for carve_* names only: session 27 measured them without any carveout.
    **{f"moe_gu_st3_cv{pct}": (lambda rnd, pct=pct: _moe_opts(rnd, gu_num_stages=3, gu_carveout=pct))
       for pct in (57, 71)},
    "moe_gu_st3_nocv": lambda rnd: _moe_opts(rnd, gu_num_stages=3, gu_carveout=-1),
    # the MoE reduce over 128 / 512 columns per program, the wide Down over 4 / 5 / 8 column blocks
    # per program (defaults moe.RED_BLOCK_H, moe.DOWN_NB_WEIGHTS_A = 4 since session 28, 6 before; these
    # keep the default stages, 2 since session 28)
    **{f"moe_red{n}": (lambda rnd, n=n: _moe_opts(rnd, red_block_h=n)) for n in (128, 512)},
    **{f"moe_dnb{n}": (lambda rnd, n=n: _moe_opts(rnd, down_nb=n)) for n in (4, 5, 8)},
    # the attention partials' m and l stored by row for the combine (attention ml_by_row, the default
    # since session 29) / by split (the layout before)
    "attn_ml_by_row": lambda rnd: _attn_opts(rnd, ml_by_row=True),
    "attn_ml_by_split": lambda rnd: _attn_opts(rnd, ml_by_row=False),
    # the partials' acc as acc / l in BF16 (attention.PARTIALS; session 38: 1.02-1.08x the call's time alone)
    "attn_bf16_partials": lambda rnd: _attn_opts(rnd, partials="bfloat16"),
    # the attention over 66 / 264 splits (half / two per SM; default attention.SPLITS_PER_SM per SM)
    **{f"attn_ns{n}": (lambda rnd, n=n: _attn_opts(rnd, num_splits=n)) for n in (66, 264)},
    # the attention split's keys per block and pipeline stages (defaults BLOCK_N 64, NUM_STAGES 4):
    # bench_kernels (session 21, call 3) timed 32 keys x 6 stages faster at 4K (full and ring), 16K and
    # 192K, slower at 64K w = 4 / 6; kv_first 2: an 8K split's two 32-key blocks on the short path
    **{f"attn_bn{bn}_st{st}{'_kf2' if kf else ''}": (
        lambda rnd, bn=bn, st=st, kf=kf: _attn_opts(rnd, block_n=bn, num_stages=st, **({"kv_first": 2} if kf else {})))
       for bn, st, kf in ((32, 6, False), (32, 4, False), (32, 8, False), (32, 6, True), (64, 6, False),
                          (64, 3, False))},
    # the full-cache attention split asking L2 for its first 2 / 4 / 8 key blocks before its wait (keyword
    # prefetch; default attention.PREFETCH_BLOCKS = 0, chosen in session 12 in ab_attention, whose
    # predecessor, the previous call's combine, does not release it early; in the step rope_kv_write does)
    **{f"attn_pf{n}": (lambda rnd, n=n: _attn_opts(rnd, prefetch=n)) for n in (2, 4, 8)},
    # the attention combine with 1 / 4 / 8 warps (default attention.COMBINE_NUM_WARPS)
    **{f"attn_cw{n}": (lambda rnd, n=n: _attn_opts(rnd, combine_num_warps=n)) for n in (1, 4, 8)},
    # lin_q{Q/K/V}_o{output}: see LINEAR_VARIANTS
    **{name: (lambda rnd, q=q, o=o: _skinny_by(rnd, _lin(q), _lin(o))) for name, (q, o) in LINEAR_VARIANTS.items()},
    # MEASUREMENT ONLY, wrong values (_ablate): the router's launches skipped in every layer pass, its
    # routing replayed; ceil_router+{part}[+{part}...] (ab_variant) also skips those parts (ABLATIONS),
    # to be timed against ceil_router (--ab-base ceil_router): the ceiling of fusing them away
    "ceil_router": lambda rnd: _ablate(rnd, "router"),
}


def time_graph_ab(step_a, step_b, restore, reps: int, profile: bool = False) -> dict:
    """Graphs of two steps replayed in alternation (restored before each replay, the order swapped
    every pair): median ms of each and the median and 10-90 % range of the per-pair ratio b / a;
    ``profile``: also each graph's ``profile_replays`` ("profile_a", "profile_b")."""
    ga, gb = capture(step_a, restore), capture(step_b, restore)
    profs = {f"profile_{k}": profile_replays(g.replay, restore) for k, g in (("a", ga), ("b", gb))} if profile else {}
    ta, tb = [], []
    for i in range(reps + 2):
        pair = {}
        for name, g in (("a", ga), ("b", gb)) if i % 2 == 0 else (("b", gb), ("a", ga)):
            restore()
            sync()
            pair[name] = time_call(g.replay)
        if i >= 2:
            ta.append(pair["a"])
            tb.append(pair["b"])
    ratios = sorted(b / a for a, b in zip(ta, tb))
    # the same graphs in blocks (every replay of one, then of the other), as time_graph times one
    blk_a = time_step(ga.replay, restore, reps, warmup=2)["ms"]
    blk_b = time_step(gb.replay, restore, reps, warmup=2)["ms"]
    del ga, gb
    return {"a_ms": statistics.median(ta) * 1e3, "b_ms": statistics.median(tb) * 1e3,
            "ratio": statistics.median(ratios), "ratio_p10": ratios[len(ratios) // 10],
            "ratio_p90": ratios[(9 * len(ratios)) // 10], "reps": reps,
            "a_block_ms": blk_a, "b_block_ms": blk_b, **profs}


# ------------------------------------------------------------------------------- state and caches
def clone_state(st: DecodeState) -> DecodeState:
    return dataclasses.replace(st, **{f.name: getattr(st, f.name).clone() for f in dataclasses.fields(st)})


def restorer(st: DecodeState, saved: DecodeState):
    def restore():
        for f in dataclasses.fields(st):
            getattr(st, f.name).copy_(getattr(saved, f.name))
    return restore


def fill_cache(cache, L: int, gen: torch.Generator) -> None:
    """Random BF16 K/V; ring labels as a real decode at length L leaves them (slot s holds the last
    position p < L with p % slots == s)."""
    for c in cache.all:
        c.k.copy_(torch.randn(c.k.shape, generator=gen, device=DEV, dtype=torch.float32))
        c.v.copy_(torch.randn(c.v.shape, generator=gen, device=DEV, dtype=torch.float32))
        if c.kind != "full":
            s = torch.arange(c.slots, device=DEV)
            p = (L - 1) - ((L - 1 - s) % c.slots)
            c.labels.copy_(torch.where(p >= 0, p, torch.full_like(p, -1)))
        else:
            c.labels.fill_(-1)


def synthetic_state(model: Model, L: int, budget: int, seed: int, gen: torch.Generator) -> DecodeState:
    """A decode state at cache length L holding a committed token and 5 drafts with their proposals
    (draft j is the top entry of its proposal, so q(d) > 0), as after a draft phase of depth 5."""
    cfg, sh = model.cfg, model.shard
    k = SamplingConfig().top_k
    st = DecodeState.empty(cfg.hidden_size, k, budget, seed, cfg.stop_token_ids, DEV)
    lo, hi = sh.vocab_start, sh.vocab_end
    ids = torch.randint(lo, hi, (8, k), generator=gen, device=DEV)
    probs = torch.rand(8, k, generator=gen, device=DEV).sort(-1, descending=True).values
    st.q_ids.copy_(ids)
    st.q_probs.copy_(probs / probs.sum(-1, keepdim=True))
    st.tokens.copy_(ids[:, 0])
    st.emitted.copy_(ids[:, 0])
    st.hidden.copy_(torch.randn(8, cfg.hidden_size, generator=gen, device=DEV))
    st.g.copy_(torch.randn(1, cfg.hidden_size, generator=gen, device=DEV))
    st.start.fill_(L)
    st.prev_start.fill_(L - W)
    st.accepted.fill_(W - 1)
    st.n_drafts.fill_(W - 1)
    return st


def step_fn(rnd: Round, st: DecodeState):
    carve = getattr(rnd, "_carveout", None) if CUDA else None   # (the dry run: no driver to ask)

    def step():
        with carveouts(carve):   # (carve_* variants: the kernels' carveouts while this step runs or is captured)
            rnd.verify(st, W)
            rnd.draft_first(st, W)
            for k in range(2, DEPTHS + 1):
                rnd.draft_next(st, k)
    return step


def _carve(rnd: Round, *spec) -> None:
    """rnd's step runs (and is captured) with these preferred shared-memory carveouts: (kernel-name
    parts or None for every kernel, percent) pairs (_bench.set_carveout; a graph keeps the carveout
    it was captured with: experiments/probe_carveout.py)."""
    rnd._carveout = spec


class ConsumingTensors:
    """Read-once view of ``random_tensors``' generator for ``Model.__init__`` (which reads every name
    once): per-expert slices are dropped as soon as they are stacked, so the peak is the model plus
    one layer's experts instead of two copies of the experts."""

    def __init__(self, it):
        self._it, self._buf = it, {}

    def __getitem__(self, name):
        while name not in self._buf:
            try:
                k, v = next(self._it)
            except StopIteration:
                raise KeyError(name) from None
            self._buf[k] = v
        return self._buf.pop(name)


# ------------------------------------------------------------------------------------------ floors
def step_bytes(cfg, sh, L: int, distinct6: float, distinct1: float = 8.0) -> dict:
    """Bytes the step must read (each once), by part.

    per position of one layer's K+V:  kv = 2 * nkv * d * 2 B;  full layer at verify: (L + w) keys;
    sliding layer: window + w - 1 keys (the rows' whole windows);
    one expert (E4M3 + FP32 128x128-block scales): 3 * I * H + 4 * (ceil(2I/128) ceil(H/128) +
    ceil(H/128) ceil(I/128));
    attention + router weights of a layer (BF16): 2 * ((nh + 2 nkv) d H + H nh d + E H) (+ norms);
    verify   = sum_layers (attn + distinct6 * expert + KV) + LM head (2 V H)
    draft 1  = attn + EH (2 * 2H * H) + distinct6 * expert + KV(L + w) + LM head
    draft k  = attn + EH + distinct1 * expert + KV(L + k) + LM head        (k = 2..5, one row)
    """
    H, d, E = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    nh, nkv, I, V = sh.num_heads, sh.num_kv_heads, sh.expert_width, sh.vocab_size
    kv = 2 * nkv * d * 2
    c = lambda n: -(-n // 128)  # noqa: E731
    expert = 3 * I * H + 4 * (c(2 * I) * c(H) + c(H) * c(I))
    attn = 2 * ((nh + 2 * nkv) * d * H + H * nh * d + E * H) + 2 * 2 * H + 4 * nh
    lm = 2 * V * H
    eh = 2 * 2 * H * H + 3 * 2 * H

    def keys(kind, end):
        return end if kind == "full" else min(end, cfg.sliding_window + W - 1)

    types = cfg.layer_types
    v_kv = sum(keys(t, L + W) * kv for t in types)
    v_exp = len(types) * distinct6 * expert
    v_dense = len(types) * attn
    parts = {"verify_kv": v_kv, "verify_experts": v_exp, "verify_dense": v_dense, "verify_lm": lm}
    mt = cfg.mtp_attention
    d_kv = keys(mt, L + W) * kv + sum(keys(mt, L + k) * kv for k in range(2, DEPTHS + 1))
    d_exp = (distinct6 + (DEPTHS - 1) * distinct1) * expert
    parts.update(draft_kv=d_kv, draft_experts=d_exp, draft_dense=DEPTHS * (attn + eh), draft_lm=DEPTHS * lm)
    parts["total"] = sum(parts.values())
    parts["expert_bytes"] = expert
    return parts


# ------------------------------------------------------------------------------------------ q1-mini
def bench_mini(args, copy_bw):
    name = "q1-tiny" if DRY_RUN else "q1-mini"
    cfg = load_model_config(name)
    if DRY_RUN:
        cfg = dataclasses.replace(cfg, num_layers=2, layer_pattern=("sliding", "full"), expert_width=128).validate()
    contexts = (60,) if DRY_RUN else (2048, 16384)
    arms = [("reference-fp32", {"backend": "reference", "dtype": "float32"}),
            ("reference-bf16", {"backend": "reference", "dtype": "bfloat16"}),
            ("fast", {"backend": "fast", "dtype": "bfloat16"})]
    gen = torch.Generator().manual_seed(1)
    for L in contexts:
        prompt = torch.randint(0, cfg.vocab_size, (L,), generator=gen).tolist()
        res = {}
        for arm, rt in arms:
            rt = dict(rt, device=str(DEV), draft={"policy": "fixed", "fixed_depth": DEPTHS})
            eng = Engine.build(cfg if DRY_RUN else name, rt)
            with torch.no_grad():
                rnd, st = eng.start(prompt, 0, 64)
                assert st.width() == W, st.width()
                t = time_step(step_fn(rnd, st), restorer(st, clone_state(st)),
                              reps=args.reps_fast if arm == "fast" else args.reps_ref, warmup=args.warmup)
            res[arm] = t
            row = dict(model=cfg.name, context=L, arm=arm, **t)
            ROWS.append(row)
            log(f"{cfg.name} ctx={L} {arm}: {t['ms']:.3f} ms/step (host {t['host_ms']:.3f} ms)")
            del eng, rnd, st
        for arm in ("reference-fp32", "reference-bf16"):
            ROWS.append(dict(model=cfg.name, context=L, arm=f"fast/{arm}", ratio=res["fast"]["ms"] / res[arm]["ms"]))
    if CUDA:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ q1
def build_q1(args):
    if DRY_RUN:
        cfg = dataclasses.replace(load_model_config("q1-tiny"), num_layers=2, layer_pattern=("sliding", "full"),
                                  sliding_window=32).validate()
        tp = TPConfig(size=2, emulate_rank=0)
    else:
        cfg = load_model_config("q1")
        tp = TPConfig(size=8, emulate_rank=0)
    shard = make_shard(cfg, tp)
    if CUDA:
        free, total = torch.cuda.mem_get_info()
        log(f"GPU memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB before the q1 shard")
    t0 = time.perf_counter()
    with torch.no_grad():
        tensors = ConsumingTensors(random_tensors(cfg, tp, seed=0, device=DEV))
        ref = Model(cfg, tensors, shard, "bfloat16", DEV, make_comm(tp))
        del tensors
        fast = FastModel.from_model(ref)
    sync()
    nbytes = sum(t.numel() * t.element_size() for t in _weights(ref))
    log(f"{cfg.name} rank 0/{tp.size} built in {time.perf_counter() - t0:.1f}s: {nbytes / 1e9:.2f} GB of weights"
        + (f"; allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, peak "
           f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if CUDA else ""))
    return cfg, shard, ref, fast, nbytes


def _weights(m: Model):
    seen = {}
    for t in [m.embed, m.final_norm, m.lm_head]:
        seen[t.data_ptr()] = t
    for lw in m.layers + [x.layer for x in m.mtp]:
        for f in dataclasses.fields(lw):
            t = getattr(lw, f.name)
            if isinstance(t, torch.Tensor):
                base = t._base if t._base is not None else t
                seen[base.data_ptr()] = base
    for x in m.mtp:
        for t in (x.enorm, x.hnorm, x.eh, x.head_norm):
            seen[t.data_ptr()] = t
    return list(seen.values())


def observed_distinct(fast: FastModel, rnd: Round, st, restore) -> tuple[float, float]:
    """Mean distinct experts per layer of the verify pass (6 rows) and of draft_first (6 rows), from
    one instrumented fast step (host reads after the step, outside any timing)."""
    from runtime import fast as _fast
    calls = []

    def spy(orig):   # a router kernel (route_topk with or without its fused norm, or route_folded)
        def route(*a, **k):
            ids, wts = orig(*a, **k)
            calls.append(ids)
            return ids, wts
        return route

    with (mock.patch.object(_fast._router, "route_topk", spy(_fast._router.route_topk)),
          mock.patch.object(_fast._router, "route_folded", spy(_fast._router.route_folded))):
        restore()
        with torch.no_grad():
            step_fn(rnd, st)()
    sync()
    n = fast.cfg.num_layers
    verify = [int(torch.unique(c).numel()) for c in calls[:n]]
    draft1 = int(torch.unique(calls[n]).numel())
    return statistics.mean(verify), float(draft1)


def run_ab(args, L: int, model: str, new_round, st, restore) -> None:
    """The --ab pairs at context L: each variant's step graph against the default's (or --ab-base's),
    alternating replays (``time_graph_ab``), logged and added to ROWS. Dry run: each arm's step runs
    once eagerly instead (a check of the variants' plumbing, no timing)."""
    _ROUTES.clear()   # ceil_router's routing: recorded anew at this context
    if any(n.startswith("ceil_") for n in args.ab + [args.ab_base or ""]):
        n = record_routing(new_round(), st, restore)
        log(f"q1 ctx={L} routing recorded for the ablations: {n} (rows, router) keys")
    r_a = new_round()
    apply_variants(r_a, args.ab_base)
    base = args.ab_base or "default"
    for name in args.ab:
        r_b = new_round()
        apply_variants(r_b, args.ab_base, name)
        name = f"{base} + {name}" if args.ab_base else name
        if DRY_RUN:
            for r in (r_a, r_b):
                restore()
                step_fn(r, st)()
            log(f"q1 ctx={L} A/B dry run: {base} and {name} each ran one step")
            continue
        ab = time_graph_ab(step_fn(r_a, st), step_fn(r_b, st), restore, args.reps_fast, profile=args.profile)
        log(f"q1 ctx={L} A/B fast graph: {base} {ab['a_ms']:.3f} ms, {name} {ab['b_ms']:.3f} ms, "
            f"ratio {ab['ratio']:.4f} [{ab['ratio_p10']:.4f}, {ab['ratio_p90']:.4f}] (in blocks: "
            f"{ab['a_block_ms']:.3f} / {ab['b_block_ms']:.3f} ms)")
        for arm, ms in (("a", ab["a_ms"]), ("b", ab["b_ms"])):
            if f"profile_{arm}" in ab:
                log(f"profile of the {base if arm == 'a' else name} graph:")
                PROFILES[f"{L} {base if arm == 'a' else name}"] = prof = ab.pop(f"profile_{arm}")
                print_profile(prof, ms)
        ROWS.append(dict(model=model, context=L, arm=f"fast-graph A/B {name}", base=base, **ab))


def bench_q1(args, copy_bw):
    cfg, shard, ref, fast, wbytes = build_q1(args)
    contexts = (40, 150) if DRY_RUN and args.contexts else args.contexts
    sampling, draft = SamplingConfig(), DraftConfig(policy="fixed", fixed_depth=DEPTHS)
    gen = torch.Generator(device=DEV).manual_seed(0)
    distinct = None
    for L in contexts:
        if time.perf_counter() - T_START > args.budget_s:
            log(f"time budget {args.budget_s}s spent: context {L} skipped")
            continue
        cap = L + 64 + 16
        cache = ref.new_cache(cap)
        fill_cache(cache, L, gen)
        st = synthetic_state(ref, L, 64, seed=0, gen=gen)
        restore = restorer(st, clone_state(st))
        r_ref, r_fast = Round(ref, cache, sampling, draft), Round(fast, cache, sampling, draft)
        if distinct is None:
            if CUDA:
                restore()
                with torch.no_grad():
                    step_fn(r_fast, st)()      # compile the kernels before instrumenting
            distinct = observed_distinct(fast, r_fast, st, restore)
            log(f"observed distinct experts: verify {distinct[0]:.1f} per layer, draft depth 1 {distinct[1]:.0f}")
        res = {}
        with torch.no_grad():
            res["fast"] = time_step(step_fn(r_fast, st), restore, args.reps_fast, args.warmup)
            log(f"q1 ctx={L} fast (eager): {res['fast']['ms']:.2f} ms/step (host {res['fast']['host_ms']:.2f} ms)")
            if CUDA and not args.no_graph:
                try:
                    res["fast-graph"] = time_graph(step_fn(r_fast, st), restore, args.reps_fast,
                                                   profile=args.profile)
                    log(f"q1 ctx={L} fast (CUDA graph): {res['fast-graph']['ms']:.2f} ms/step")
                    if "profile" in res["fast-graph"]:
                        PROFILES[L] = res["fast-graph"].pop("profile")
                        print_profile(PROFILES[L], res["fast-graph"]["ms"])
                except Exception as e:  # reported, not fatal: the eager numbers stand
                    log(f"q1 ctx={L} fast (CUDA graph) FAILED: {type(e).__name__}: {e}")
                    res["fast-graph"] = {"error": f"{type(e).__name__}: {e}"}
            if args.ab and (DRY_RUN or (CUDA and not args.no_graph)):
                run_ab(args, L, f"{cfg.name} rank0/{shard.tp_size}", lambda: Round(fast, cache, sampling, draft),
                       st, restore)
            res["reference"] = time_step(step_fn(r_ref, st), restore, args.reps_ref, min(1, args.warmup))
            log(f"q1 ctx={L} reference: {res['reference']['ms']:.2f} ms/step")
        d6 = min(DISTINCT_6ROWS, cfg.num_experts)
        fl = step_bytes(cfg, shard, L, d6, min(8, cfg.num_experts))
        flo = step_bytes(cfg, shard, L, distinct[0], min(8, cfg.num_experts))
        floor_ms, floor_obs_ms = fl["total"] / copy_bw * 1e3, flo["total"] / copy_bw * 1e3
        log(f"q1 ctx={L} floor: {fl['total'] / 1e9:.2f} GB -> {floor_ms:.2f} ms at {d6} experts; "
            f"{flo['total'] / 1e9:.2f} GB -> {floor_obs_ms:.2f} ms at the observed {distinct[0]:.1f}")
        for arm, t in res.items():
            ROWS.append(dict(model=f"{cfg.name} rank0/{shard.tp_size}", context=L, arm=arm, **t,
                             floor_ms=floor_ms, floor_observed_ms=floor_obs_ms,
                             frac_of_floor=(floor_ms / t["ms"]) if "ms" in t else None))
        ROWS.append(dict(model=f"{cfg.name} rank0/{shard.tp_size}", context=L, arm="fast/reference",
                         ratio=res["fast"]["ms"] / res["reference"]["ms"]))
        ROWS.append(dict(model=f"{cfg.name} rank0/{shard.tp_size}", context=L, arm="floor-bytes",
                         **{k: v for k, v in fl.items()}, distinct_experts=d6,
                         observed_distinct=distinct[0], observed_total=flo["total"]))
        del cache, st, r_ref, r_fast
        if CUDA:
            torch.cuda.empty_cache()
    if args.sweep:
        context_sweep(args, cfg, shard, fast, ref, copy_bw, gen)
    return wbytes


def context_sweep(args, cfg, shard, fast: FastModel, ref: Model, copy_bw: float, gen) -> None:
    """``--sweep``: the fast step's graph at each context (one cache and decode state per context, all
    alive at once; with ``--sweep-variants``, one graph per variant and context over the same cache),
    replayed in ``--sweep-rounds`` paired rounds (every graph once per round, restored before each
    replay, in a seeded shuffled order: no graph always follows another), then per variant
    ``kernel_report.sweep_fit`` of the step's time against the K/V bytes it reads (``step_bytes``'
    verify_kv + draft_kv): the slope is what one more byte of context costs the whole step. Rows: one
    per variant and context (arm "sweep", every round's ms kept), one fit per variant (arm "sweep-fit").
    ``--sweep-base`` (e.g. ceil_router) applies to every arm; with an ablation, the routing is recorded
    once, at the first context, and replayed everywhere (``_ablate``), so that the MoE's work does not
    change with the context (each context's synthetic state, drawn in turn, routes differently)."""
    contexts = (40, 100, 150) if DRY_RUN else tuple(args.sweep)
    rounds = 2 if DRY_RUN else args.sweep_rounds
    variants = ["default"] + [v for v in args.sweep_variants if v != "default"]
    sampling, draft = SamplingConfig(), DraftConfig(policy="fixed", fixed_depth=DEPTHS)
    arms, keep = {}, []
    for i, L in enumerate(contexts):
        cache = ref.new_cache(L + 64 + 16)
        fill_cache(cache, L, gen)
        st = synthetic_state(ref, L, 64, seed=0, gen=gen)
        restore = restorer(st, clone_state(st))
        keep.append((cache, st))
        if i == 0 and args.sweep_base and _ceil_parts(args.sweep_base):   # once, for every arm everywhere
            n = record_routing(Round(fast, cache, sampling, draft), st, restore)
            log(f"sweep: routing recorded at context {L} for every arm: {n} (rows, router) keys")
        for v in variants:
            rnd = Round(fast, cache, sampling, draft)
            apply_variants(rnd, args.sweep_base, v)
            step = step_fn(rnd, st)
            with torch.no_grad():
                arms[v, L] = (capture(step, restore).replay if CUDA else step, restore)
        log(f"sweep: context {L} captured ({', '.join(variants)})")
    times = {key: [] for key in arms}
    with torch.no_grad():
        for r in range(rounds):
            for key in random.Random(r).sample(list(arms), len(arms)):
                replay, restore = arms[key]
                restore()
                sync()
                times[key].append(time_call(replay) * 1e3)
    model = f"{cfg.name} rank0/{shard.tp_size}"
    kv, floors = {}, {}
    for L in contexts:
        b = step_bytes(cfg, shard, L, min(DISTINCT_6ROWS, cfg.num_experts), min(8, cfg.num_experts))
        kv[L], floors[L] = b["verify_kv"] + b["draft_kv"], b["total"] / copy_bw * 1e3
    for v in variants:
        for L in contexts:
            ROWS.append(dict(model=model, context=L, arm="sweep", variant=v, sweep_ms=statistics.median(times[v, L]),
                             times_ms=times[v, L], kv_bytes=kv[L], floor_ms=floors[L], rounds=rounds,
                             base=args.sweep_base or "default"))
    fits, _ = kernel_report.sweep_from_payload({"rows": ROWS, "copy_bw": copy_bw})   # as a saved run is read
    for v, fit in fits.items():
        for line in kernel_report.sweep_lines(fit, floors):
            log(f"[{v}] {line}")
        ROWS.append(dict(model=model, context=max(contexts), arm="sweep-fit", variant=v,
                         **{k: x for k, x in fit.items() if k != "per_context"}))
    for line in kernel_report.sweep_ratio_lines({"rows": ROWS}):
        log(line)
    del arms, keep
    if CUDA:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ main
def table(copy_bw) -> str:
    lines = [f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)", "",
             f"{'model':<16} {'ctx':>6} {'arm':<16} {'ms/step':>9} {'host ms':>8} {'floor ms':>9} {'floor/t':>8}"]
    for r in ROWS:
        if "ms" in r:
            fl = r.get("floor_ms")
            lines.append(f"{r['model']:<16} {r['context']:>6} {r['arm']:<16} {r['ms']:>9.3f} {r['host_ms']:>8.3f} "
                         + (f"{fl:>9.3f} {fl / r['ms']:>8.3f}" if fl else f"{'':>9} {'':>8}"))
        elif "a_ms" in r:
            lines.append(f"{r['model']:<16} {r['context']:>6} {r['arm']:<16} {r.get('base', 'default')} {r['a_ms']:.3f} ms, variant "
                         f"{r['b_ms']:.3f} ms: ratio {r['ratio']:.4f} [{r['ratio_p10']:.4f}, {r['ratio_p90']:.4f}]")
        elif "ratio" in r:
            lines.append(f"{r['model']:<16} {r['context']:>6} {r['arm']:<16} ratio {r['ratio']:.3f}")
        elif "error" in r:
            lines.append(f"{r['model']:<16} {r['context']:>6} {r['arm']:<16} {r['error']}")
        elif r.get("arm") == "sweep":
            lines.append(f"{r['model']:<16} {r['context']:>6} {'sweep ' + r['variant']:<16} {r['sweep_ms']:>9.3f} "
                         f"{'':>8} {r['floor_ms']:>9.3f} {r['floor_ms'] / r['sweep_ms']:>8.3f}")
        elif r.get("arm") == "sweep-fit":   # (the fit's own head line, as the sweep printed it)
            lines.append(f"{r['model']:<16} {'':>6} sweep fit, {r['variant']}: "
                         + kernel_report.sweep_lines({**r, "per_context": {}})[0])
        elif r.get("arm") == "floor-bytes":
            gb = {k: r[k] / 1e9 for k in r if k.startswith(("verify_", "draft_", "total"))}
            lines.append(f"{r['model']:<16} {r['context']:>6} floor bytes (GB): total {gb['total']:.3f} = verify "
                         f"kv {gb['verify_kv']:.3f} + experts {gb['verify_experts']:.3f} + dense "
                         f"{gb['verify_dense']:.3f} + lm {gb['verify_lm']:.3f}; drafts kv {gb['draft_kv']:.3f} "
                         f"+ experts {gb['draft_experts']:.3f} + dense {gb['draft_dense']:.3f} + lm "
                         f"{gb['draft_lm']:.3f}; at observed {r['observed_distinct']:.1f} experts "
                         f"{r['observed_total'] / 1e9:.3f}")
    return "\n".join(lines)


def _ints(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(",") if x.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, q1-tiny shapes")
    ap.add_argument("--contexts", type=_ints, default=(8192, 65536),
                    help="q1 contexts timed eager, as a graph and on the reference (default 8192,65536; '' for none)")
    ap.add_argument("--sweep", type=_ints, default=(), metavar="CONTEXTS",
                    help="also time the fast step's graph at these q1 contexts (e.g. 8192,32768,65536,131072,196096) "
                         "in paired rounds and fit its time against the K/V bytes it reads: what one more KV "
                         "byte costs the step, as a fraction of copy bandwidth (step_sweep.png with OUT)")
    ap.add_argument("--sweep-rounds", type=int, default=40, help="paired rounds of --sweep (default 40)")
    ap.add_argument("--sweep-variants", type=lambda v: [x for x in v.split(",") if x], default=[],
                    metavar="NAMES", help="--sweep also for these --ab variants (their graphs in the same rounds), "
                                          "e.g. attn_ns66 (half the attention grid: a lower rate per KV byte)")
    ap.add_argument("--sweep-base", default=None, metavar="NAME",
                    help="apply this variant to every arm of --sweep; ceil_router (recommended): the routing "
                         "recorded once at the first context and replayed at all of them, so that the MoE does "
                         "the same work at every context (the synthetic states route differently per context)")
    ap.add_argument("--reps-fast", type=int, default=None)
    ap.add_argument("--reps-ref", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay of the fast step")
    ap.add_argument("--no-mini", action="store_true")
    ap.add_argument("--no-q1", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip further q1 contexts past this")
    ap.add_argument("--ab", type=lambda v: [x for x in v.split(",") if x], nargs="+", default=[],
                    help=f"same-run A/B of the fast graph against variants, alternating replays (names "
                         f"separated by commas or spaces): {', '.join(AB_VARIANTS)}; and ablations "
                         f"ceil_router+PART[+PART...] with parts {', '.join(p for p in ABLATIONS if p != 'router')} "
                         f"(measurement only: those launches skipped, the routing replayed)")
    ap.add_argument("--ab-base", default=None, metavar="NAME",
                    help="apply this variant to both arms of every --ab pair (e.g. ceil_router: the "
                         "warm-up's routing replayed in both, so that ablations which feed the router "
                         "garbage leave the MoE's work unchanged)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the fast step's CUDA graph per kernel (torch.profiler): device time "
                         "per part of the step (attention, MoE, GEMMs, norms, torch glue), top kernels; "
                         "with --ab, both graphs of every pair as well")
    args = ap.parse_args()
    args.ab = [name for names in args.ab for name in names]
    try:
        check_sweep_variants(args.sweep_variants)
        if args.sweep_base:
            check_ab_names([args.sweep_base], None)
    except (KeyError, ValueError) as e:
        ap.error(f"--sweep-variants / --sweep-base: {e}")
    try:
        check_ab_names(args.ab, args.ab_base)
    except KeyError as e:
        ap.error(f"--ab / --ab-base: unknown variant {e}; known: {', '.join(AB_VARIANTS)}, "
                 f"ceil_{{part}}[+{{part}}...] with parts {', '.join(ABLATIONS)}")
    except ValueError as e:
        ap.error(f"--ab / --ab-base: {e}")
    if CUDA:   # before any kernel is loaded: the carveout variants' set_carveout reaches the kernels
        carveout_hook()   # loaded after this (it only records them; before session 28 it was installed for
        # carve_* names only, so the moe_gu_st3_cv* variants set no carveout)
    args.reps_fast = args.reps_fast or (1 if DRY_RUN else 20)
    args.reps_ref = args.reps_ref or (1 if DRY_RUN else 5)
    args.warmup = (0 if DRY_RUN else 3) if args.warmup is None else args.warmup
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if CUDA else "cpu (dry run: interpreter)",
           "dry_run": DRY_RUN, "argv": sys.argv}
    log(f"environment: {env}")
    copy_bw, _ = copy_bandwidth()
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    if not args.no_mini:
        bench_mini(args, copy_bw)
    wbytes = None
    if not args.no_q1:
        wbytes = bench_q1(args, copy_bw)
    out = write_results("bench_step", {"env": env, "copy_bw": copy_bw, "weight_bytes": wbytes,
                                       "profiles": PROFILES}, ROWS)
    if out:
        log(f"wrote {out}/bench_step.json, .csv")
        if any(r.get("arm") == "sweep" for r in ROWS):
            fits, floors = kernel_report.sweep_from_payload({"rows": ROWS, "copy_bw": copy_bw})
            kernel_report.plot_sweep(fits, {**env, "copy_bw": copy_bw}, os.path.join(out, "step_sweep.png"), floors)
            log(f"wrote {out}/step_sweep.png")
    log("done")
    print(table(copy_bw), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
