"""Microbenchmark of the decode-round Triton kernels (issue 7) against their memory floor.

One command on the GPU machine (from the repository root):

    PYTHONUNBUFFERED=1 python3 experiments/bench_kernels.py            # add --no-sweep to skip variants

For every kernel and shape it prints and records:
* time: the median per call of CUDA-graph replays (graph_us; the way the runtime launches them:
  one graph holds one call per rotating input set, so no input is served from L2 by a previous
  call) and, as a cross-check, triton.testing.do_bench's median of eager calls (eager_us; it
  clears L2 before every call, and includes the launch overhead);
* bytes: the minimum traffic (each input read once, each output written once; attention: only the
  valid KV extent; MoE: only the distinct experts' weights and scales);
* frac: bytes / time as a fraction of the device-to-device copy bandwidth measured in the same run
  (torch copy of a 2 GiB buffer, bytes read + written);
* the same for the eager torch reference at the same shapes (ref_us, ref_frac);
* attention: copy_same_us, a torch copy of the same KV bytes (read + write) in one call, timed the
  same way (the floor of moving these bytes in one launch, with its fixed latency), and
  of_copy_same = copy_same_us / graph_us; read_floor_us, the fastest register-load reader of the same
  K/V bytes in one launch (start_pos first, no arithmetic), and read_floor_tma_us, the same bytes
  through the TMA engine (``_tma_read``, sm_90+; NaN elsewhere), with of_read_floor / _tma; and
  skeleton_us, that TMA stream storing a partial per program with the runtime's own combine launch
  over them (the split + merge design with no arithmetic; ``_tma_read.tmasm1_128_s3``), of_skeleton;
  structure_us, the same two launches with a merge that costs nothing (``tmase1_128_s3``), and
  nomerge_us, the attention's split followed by that empty dependent instead of its combine (session 31);
  and what a torch user would run instead (``torch_attention.py``, session 36; ``--no-torch`` skips it):
  torch_sdpa_us, SDPA's fastest fused backend (torch_sdpa_backend; each backend's own torch_sdpa_<name>_us;
  SDPA has no sink input, so it runs without the sink), and torch_flex_us, flex_attention compiled, with
  the sink from its log-sum-exp; and, where FlashInfer is importable (``flashinfer_attention.py`` says how
  to carry it to the GPU machine), what vLLM / SGLang would run (session 39): fi_us, FlashInfer's batch
  prefill attention (FA2 kernels, 64-token pages: the fastest of its forms session 39 measured) without the
  sink, and fi_sink_us, the same with the sink applied from its log-sum-exp.
Full results go to $OUT/bench_kernels.json and .csv when OUT is set, with the figures of
``kernel_report.py`` (attention.png, attention_model.png, kernels.png); a short table comes last, then every goal of the
issue with PASS / FAIL (``kernel_report.goal_checks``; ``kernel_report.py`` re-reads a saved run).

``--dry-run`` runs the whole script on the CPU at toy shapes through the Triton interpreter, with
wall-clock "timings" that mean nothing: it only checks that the script works before GPU time is
spent on it.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import DEV, DRY_RUN, capture_graph, copy_bandwidth, write_results  # noqa: E402  (first: --dry-run must precede triton)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import _tma_read  # noqa: E402
import torch_attention as TA  # noqa: E402
import flashinfer_attention as FI  # noqa: E402
import kernel_report  # noqa: E402
from runtime.kernels import attention as A  # noqa: E402
from runtime.kernels import moe as M  # noqa: E402
from runtime.kernels import linear as LN  # noqa: E402
from runtime.kernels import norm as N  # noqa: E402
from runtime.kernels import rope as R  # noqa: E402
from runtime.kernels import router as RT  # noqa: E402
from runtime.fast import FastModel  # noqa: E402
from runtime.kernels import sampler as S  # noqa: E402
from runtime.kernels import uniform as U  # noqa: E402
from runtime import rng  # noqa: E402

ROWS: list[dict] = []

# Shapes: the q1 rank-emulation shard (and q1-mini where asked); toy shapes for --dry-run.
ATTN = dict(nh=6, nkv=1, d=128, window=4096, contexts=(4096, 16384, 65536, 196608), widths=(4, 6, 8),
            ring_start=100000, sweep_min_ctx=65536)
MOE = dict(H=6144, I=256, E=128, w=6, realistic=38, sets=3)
NORM = dict(shapes=((6144, 8), (256, 8)))
SAMPLER = dict(vocabs=(20000, 4096), widths=(8, 1))   # w = 1: the step's draft rows (session 36)
if DRY_RUN:
    ATTN.update(d=64, window=128, contexts=(256, 1024), widths=(4, 8), ring_start=1000, sweep_min_ctx=1024)
    MOE.update(H=256, I=128, E=64, realistic=30, sets=2)
    NORM.update(shapes=((256, 8),))
    SAMPLER.update(vocabs=(4096,), widths=(4,))


# ----------------------------------------------------------------------------------- timing
def graph_time(calls, reps=25):
    """Median seconds per call over replays of one graph holding every call once."""
    if DRY_RUN:
        t0 = time.perf_counter()
        for c in calls[:2]:
            c()
        t = (time.perf_counter() - t0) / min(2, len(calls))
        return t, t, t
    g = capture_graph(calls)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(reps)]
    for e0, e1 in evs:
        e0.record()
        g.replay()
        e1.record()
    torch.cuda.synchronize()
    ts = sorted(e0.elapsed_time(e1) * 1e-3 / len(calls) for e0, e1 in evs)
    del g
    return statistics.median(ts), ts[0], ts[-1]


def eager_time(calls, warmup=10, rep=40):
    if DRY_RUN:
        t0 = time.perf_counter()
        calls[0]()
        return time.perf_counter() - t0
    it = itertools.cycle(calls)
    return triton.testing.do_bench(lambda: next(it)(), warmup=warmup, rep=rep,
                                   return_mode="median") * 1e-3


def n_sets(bytes_per_set, l2, cap=128):
    return int(min(cap, max(2, math.ceil(3 * l2 / max(bytes_per_set, 1)))))


def record(kernel, shape, variant, calls, nbytes, copy_bw, ref_calls=None, eager=True, **extra):
    t, tmin, tmax = graph_time(calls)
    row = dict(kernel=kernel, shape=shape, variant=variant, graph_us=t * 1e6, graph_min_us=tmin * 1e6,
               graph_max_us=tmax * 1e6, bytes=nbytes, frac=nbytes / t / copy_bw, sets=len(calls))
    if eager:
        te = eager_time(calls)
        row.update(eager_us=te * 1e6, eager_frac=nbytes / te / copy_bw)
    if ref_calls is not None:
        tr = eager_time(ref_calls, warmup=5, rep=30)
        row.update(ref_us=tr * 1e6, ref_frac=nbytes / tr / copy_bw)
    row.update(extra)
    ROWS.append(row)
    msg = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(msg, flush=True)
    return row


# -------------------------------------------------------------------------------- attention
def _k(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def attention_sets(sets, w, nh, nkv, d, cap, start, n_keys):
    """``sets`` input sets of one attention shape: (q, k, v, sinks, start_pos, out) each, random BF16
    q / K / V of ``cap`` slots, sinks around log(n_keys) (so they take a visible share of the mass)."""
    data = []
    for _ in range(sets):
        q = torch.randn(w, nh, d, device=DEV).to(torch.bfloat16)
        k = torch.randn(nkv, cap, d, device=DEV).to(torch.bfloat16)
        v = torch.randn(nkv, cap, d, device=DEV).to(torch.bfloat16)
        sinks = torch.randn(nh, device=DEV) + math.log(n_keys)
        sp = torch.tensor(start, dtype=torch.int32, device=DEV)
        data.append((q, k, v, sinks, sp, torch.empty_like(q)))
    return data


def copy_same_calls(data, n_keys):
    """What moving an attention call's bytes costs in one call: per input set of ``attention_sets``,
    torch copies the n_keys valid K rows into a scratch buffer (read + write = the KV bytes)."""
    return [(lambda o=torch.empty_like(k[:, :n_keys]), k=k: o.copy_(k[:, :n_keys])) for _, k, _, _, _, _ in data]


@triton.jit
def _sol_flat_kernel(K, V, OUT, START, W, CHUNK: tl.constexpr, D: tl.constexpr, HOST: tl.constexpr = False,
                     CACHE: tl.constexpr = ""):
    """Read floor of an attention call (session 17): one program per CHUNK-row tile of the capacity
    (a fixed grid, as a captured launch needs); programs past the valid extent [0, start_pos + W)
    exit after reading start_pos, the others read their K and V tile and write one sum. Many small
    programs per SM, all loads in flight at once: no attention arithmetic, no partials, no merge.
    ``HOST``: the extent is the argument W (no start_pos load); ``CACHE``: the tiles' cache modifier.
    Of the shapes ab_attention.py tried (1-8 warps, 8-128 rows), 1 warp x 8 rows read fastest."""
    pid = tl.program_id(0)
    if HOST:
        n_keys = W
    else:
        n_keys = tl.load(START).to(tl.int32) + W
    r0 = pid * CHUNK
    if r0 < n_keys:
        rows = tl.arange(0, CHUNK)
        offs = (r0 + rows)[:, None] * D + tl.arange(0, D)[None, :]
        ok = (r0 + rows < n_keys)[:, None]
        k = tl.load(K + offs, mask=ok, other=0.0, cache_modifier=CACHE)
        v = tl.load(V + offs, mask=ok, other=0.0, cache_modifier=CACHE)
        tl.store(OUT + pid * D + tl.arange(0, D), tl.sum(k.to(tl.float32), 0) + tl.sum(v.to(tl.float32), 0))


def read_floor_calls(data, n_keys, chunk=8, num_warps=1, host=False, cache=""):
    """Per input set of ``attention_sets`` (one KV head, start_pos + w = n_keys): ``_sol_flat_kernel``
    reading the set's n_keys valid K and V rows in one launch (``host``: the extent passed as an
    argument instead of derived from start_pos)."""
    d, cap = data[0][1].shape[2], data[0][1].shape[1]
    grid = triton.cdiv(cap, chunk)
    return [(lambda k=k, v=v, sp=sp, w=(n_keys if host else q.shape[0]), out=torch.empty(grid, d, device=k.device):
             _sol_flat_kernel[(grid,)](k, v, out, sp, w, CHUNK=chunk, D=d, num_warps=num_warps, num_stages=1,
                                       HOST=host, CACHE=cache))
            for q, k, v, _, sp, _ in data]


def bench_attention(copy_bw, l2, sweep):
    nh, nkv, d, window = ATTN["nh"], ATTN["nkv"], ATTN["d"], ATTN["window"]
    slots = window + 64
    # "v1" (split + combine kernels) and "fused" (one launch) run at every shape, whatever
    # A.VARIANT ("default") is, so the two can be compared at short contexts (fixed cost) too.
    every_shape = {"default", "v1", "fused", "v2", "v1_pdl", "v2_pdl", "v2_pdl_pf0", "v2_pdl_pf4", "v2_pdl_pf8"}
    configs = [("default", {}), ("v1", dict(variant="v1")), ("fused", dict(variant="fused")),
               ("v2", dict(variant="v2")), ("v1_pdl", dict(variant="v1", pdl=True)),
               ("v2_pdl", dict(variant="v2", pdl=True))]
    # v2 + PDL: key blocks per split prefetched to L2 before the split's wait (default PREFETCH_BLOCKS)
    configs += [(f"v2_pdl_pf{pf}", dict(variant="v2", pdl=True, prefetch=pf)) for pf in (0, 4, 8)]
    # v2 + PDL (no prefetch) tiles: a 64-row Q tile at every width (the default's own tile since
    # attention.MIN_BLOCK_M became 64, so this row is a same-run repeat of "default"), 128 or 32 keys
    # per block, two splits per SM
    v2p = dict(variant="v2", pdl=True, prefetch=0)
    configs += [("v2p_m64", dict(v2p, min_block_m=64)),
                ("v2p_bn128_st2", dict(v2p, block_n=128, num_stages=2)),
                ("v2p_bn128_st3", dict(v2p, block_n=128, num_stages=3)),
                ("v2p_bn32_st6", dict(v2p, block_n=32, num_stages=6)),
                ("v2p_spl264_st3", dict(v2p, num_splits=264, num_stages=3)),
                ("v2p_spl264_st2", dict(v2p, num_splits=264, num_stages=2))]
    every_shape |= {name for name, _ in configs[-6:]}
    # session 12: the defaults before it (two-round-trip combine of 4 warps, no boundary-block
    # prefetch), and TMA tiles; ab_attention.py compares options pairwise, in alternation
    configs += [("s11_default", dict(combine_one_load=False, combine_num_warps=4, tail_prefetch=False)),
                ("v2_tma", dict(tma=True))]
    every_shape |= {"s11_default", "v2_tma"}
    # v1 combine tiles (head-dim columns x splits per load), at the long contexts, every width
    tiles = [(32, 32), (64, 256)]
    long_only = {f"v1_cd{cd}_cs{cs}" for cd, cs in tiles} | {"v1_spl198", "v1_st3", "v1_st5"}
    configs += [(f"v1_cd{cd}_cs{cs}", dict(variant="v1", combine_block_d=cd, combine_block_s=cs))
                for cd, cs in tiles]
    configs += [("v1_spl198", dict(variant="v1", num_splits=198)),
                ("v1_st3", dict(variant="v1", num_stages=3)), ("v1_st5", dict(variant="v1", num_stages=5))]
    if sweep:
        configs += [(f"bn{bn}_st{st}_w{nw}_spm{spm}",
                     dict(block_n=bn, num_stages=st, num_warps=nw, num_splits=spm * A_SMS[0]))
                    for bn, st, nw, spm in [(64, 4, 4, 1), (64, 3, 4, 2), (64, 3, 8, 1),
                                            (128, 2, 8, 1), (128, 3, 8, 1), (64, 2, 4, 2)]]
        configs += [("fused_cd64", dict(variant="fused", combine_block_d=64)),
                    ("fused_st4", dict(variant="fused", num_stages=4)),
                    ("fused_spm2", dict(variant="fused", num_splits=2 * A_SMS[0]))]
    cases = [("full", ctx) for ctx in ATTN["contexts"]] + [("ring", None)]
    for mode, ctx in cases:
        for w in ATTN["widths"]:
            if mode == "full":
                start = ctx - w
                n_keys = ctx
                cap = ctx + 64
            else:
                start = ATTN["ring_start"]
                n_keys = window + w - 1
                cap = slots
            kv_bytes = 2 * nkv * n_keys * d * 2
            io_bytes = 2 * w * nh * d * 2 + nh * 4 + 4
            sets = n_sets(2 * nkv * cap * d * 2, l2)
            data = attention_sets(sets, w, nh, nkv, d, cap, start, n_keys)
            ref_calls = [
                (lambda q=q, k=k, v=v, s=s: A.attention_reference(
                    q, k, v, start, s, window=None if mode == "full" else window,
                    ring=mode == "ring", dtype=torch.float32))
                for q, k, v, s, _, _ in data[:2]]
            shape = (f"full{_k(ctx)}_w{w}" if mode == "full" else f"ring{_k(window)}_w{w}")
            copy_us = graph_time(copy_same_calls(data, n_keys))[0] * 1e6
            read_us = graph_time(read_floor_calls(data, n_keys))[0] * 1e6 if mode == "full" else float("nan")
            # session 19: the same bytes read by the TMA engine (one 1-warp program per 128-row tile,
            # _tma_read.tmaf128: the fastest reader measured, 10.2 us at 64K against 11.4 us)
            tma_calls = _tma_read.calls("tmaf128", data) if mode == "full" else None
            read_tma_us = graph_time(tma_calls)[0] * 1e6 if tma_calls else float("nan")
            # session 20: the split + merge design with no arithmetic (_tma_read.tmasm1_128_s3: that TMA
            # stream, a partial per program and the runtime's own combine launch over them)
            skel_calls = _tma_read.calls("tmasm1_128_s3", data) if mode == "full" else None
            skeleton_us = graph_time(skel_calls)[0] * 1e6 if skel_calls else float("nan")
            # session 31: the same two launches with a merge that costs nothing (_tma_read.tmase1_128_s3:
            # the stream, then a dependent on the combine's grid that only waits), and the attention
            # itself without its merge (its split, then that dependent: measurement only)
            struct_calls = _tma_read.calls("tmase1_128_s3", data) if mode == "full" else None
            structure_us = graph_time(struct_calls)[0] * 1e6 if struct_calls else float("nan")
            nomerge_us = graph_time(_tma_read.without_merge(data))[0] * 1e6 if struct_calls else float("nan")
            # session 36: torch's own fused attentions on the same sets (what a torch user would run)
            torch_us = torch_attention_times(data, n_keys) if mode == "full" and TORCH_ROWS[0] else {}
            if mode == "full" and TORCH_ROWS[0] and not DRY_RUN and FI.available():
                torch_us.update(flashinfer_attention_times(data, n_keys))
            for name, cfg in configs:
                long_ctx = mode == "full" and ctx >= ATTN["sweep_min_ctx"]
                if name in long_only:
                    if not long_ctx:
                        continue
                elif name not in every_shape and not (w == 8 and (mode == "ring" or long_ctx)):
                    continue
                calls = [(lambda q=q, k=k, v=v, s=s, sp=sp, o=o, cfg=cfg: A._launch(
                    q, k, v, sp, s, o, ring=mode == "ring", window=window if mode == "ring" else 0,
                    **{"num_splits": None, **cfg}))
                    for q, k, v, s, sp, o in data]
                row = record("attention", shape, name, calls, kv_bytes + io_bytes, copy_bw,
                             ref_calls=ref_calls if name == "default" else None,
                             eager=name == "default", w=w, keys=n_keys, copy_same_us=copy_us,
                             read_floor_us=read_us, read_floor_tma_us=read_tma_us, skeleton_us=skeleton_us,
                             structure_us=structure_us, nomerge_us=nomerge_us,
                             **(torch_us if name == "default" else {}))
                row["of_copy_same"] = copy_us / row["graph_us"]
                row["of_skeleton"] = skeleton_us / row["graph_us"]
                row["of_read_floor"] = read_us / row["graph_us"]
                row["of_read_floor_tma"] = read_tma_us / row["graph_us"]
            del data, ref_calls
            if not DRY_RUN:
                torch.cuda.empty_cache()


A_SMS = [132]
TORCH_ROWS = [True]     # --no-torch: skip torch's own attentions


def torch_attention_times(data, n_keys) -> dict:
    """torch's fused attentions on the sets of one full-cache shape, timed as the kernel is (one graph
    over the rotating sets): ``torch_sdpa_<backend>_us`` for each fused SDPA backend that runs the shape
    (without the sink: SDPA has no sink input), ``torch_sdpa_us`` / ``torch_sdpa_backend`` the fastest,
    and ``torch_flex_us`` (flex_attention compiled, the sink applied from its log-sum-exp). A baseline
    that fails is reported and left out; it never stops the benchmark."""
    out = {}
    q, k, v, sinks = data[0][:4]
    start = n_keys - q.shape[0]
    # what each should compute, on the first set: the call (flex) and the call without its sink (SDPA);
    # *_err = max |torch - reference| / max |reference|, printed when above BF16's few ulps
    refs = {s: A.attention_reference(q, k, v, start, s, dtype=torch.float32) for s in (None, sinks)}

    for backend in TA.sdpa_backends(q, k, v, start):
        try:
            calls = TA.calls("sdpa", data, n_keys, backend)
            out[f"torch_sdpa_{backend}_err"] = baseline_err(calls, refs[None], "torch baseline", n_keys)
            out[f"torch_sdpa_{backend}_us"] = graph_time(calls)[0] * 1e6
        except Exception as e:   # noqa: BLE001  (a backend that runs eagerly but fails in a graph)
            print(f"  torch SDPA {backend} at {n_keys} keys left out: {type(e).__name__}: {e}", flush=True)
    sdpa = {key[len("torch_sdpa_"):-3]: t for key, t in out.items() if key.endswith("_us")}
    if sdpa:
        best = min(sdpa, key=sdpa.get)
        out.update(torch_sdpa_us=sdpa[best], torch_sdpa_backend=best)
    try:
        calls = TA.calls("flex", data, n_keys, fn=TA.flex_attention if DRY_RUN else None)  # compiled on the GPU
        out["torch_flex_err"] = baseline_err(calls, refs[sinks], "torch baseline", n_keys)
        out["torch_flex_us"] = graph_time(calls)[0] * 1e6
    except Exception as e:   # noqa: BLE001
        print(f"  torch flex_attention at {n_keys} keys left out: {type(e).__name__}: {e}", flush=True)
    return out


def baseline_err(calls, ref, what: str, n_keys: int) -> float:
    """max |out - ref| / max |ref| of a baseline's first call, printed when above BF16's few ulps."""
    o = calls[0]().float()
    e = ((o - ref).abs().max() / ref.abs().max()).item()
    if not e < 2e-2:
        print(f"  {what} at {n_keys} keys is off the reference: {e:.3g}", flush=True)
    return e


# session 39 (ab_attention, H200): FlashInfer 0.3.1's fastest form here; its BatchAttention was 2.0-2.7x
# slower than it, its Hopper (fa3) prefill 24-87x the runtime's time at these shapes
FI_CONFIGS = (("fi_us", "fi_fa2_p64"), ("fi_sink_us", "fi_fa2_p64_sink"))


def flashinfer_attention_times(data, n_keys) -> dict:
    """FlashInfer's attention on the sets of one full-cache shape, timed as the kernel is: ``fi_us`` without
    the sink, ``fi_sink_us`` with it (``FI_CONFIGS``), each with ``*_err`` against the reference (as
    ``torch_attention_times``), and ``fi_version``. One that fails is reported and left out."""
    out = {"fi_version": FI.available()}
    q, k, v, sinks = data[0][:4]
    start = n_keys - q.shape[0]
    for key, name in FI_CONFIGS:
        ref = A.attention_reference(q, k, v, start, sinks if FI.parse(name)[2] else None, dtype=torch.float32)
        try:
            calls = FI.calls(name, data, n_keys)
            out[key[:-3] + "_err"] = baseline_err(calls, ref, f"FlashInfer {name}", n_keys)
            out[key] = graph_time(calls)[0] * 1e6
        except Exception as e:   # noqa: BLE001
            print(f"  FlashInfer {name} at {n_keys} keys left out: {type(e).__name__}: {e}", flush=True)
    return out


# -------------------------------------------------------------------------------------- MoE
def routing(w, E, distinct, seed):
    """topk_ids [w, 8] (distinct per row) whose union has exactly `distinct` experts."""
    g = torch.Generator().manual_seed(seed)
    if distinct == w * 8:
        return torch.randperm(E, generator=g)[: w * 8].view(w, 8).to(torch.int32)
    pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 0.6  # skewed popularity
    pop = pop[torch.randperm(E, generator=g)]
    for _ in range(100000):
        ids = torch.stack([torch.multinomial(pop, 8, replacement=False, generator=g)
                           for _ in range(w)])
        if ids.unique().numel() == distinct:
            return ids.to(torch.int32)
    raise RuntimeError("no routing with the requested distinct count")


def moe_sets(sets):
    """``sets`` rotating q1-shard expert weight sets (w13, s13, w2, s2): 3 x 576 MiB, far beyond L2."""
    H, I, E = MOE["H"], MOE["I"], MOE["E"]
    weights = []
    for _ in range(sets):
        w13 = torch.randn(E, 2 * I, H, device=DEV).to(torch.float8_e4m3fn)
        s13 = (torch.rand(E, 2 * I // 128, H // 128, device=DEV) + 0.5) / math.sqrt(H)
        w2 = torch.randn(E, H, I, device=DEV).to(torch.float8_e4m3fn)
        s2 = (torch.rand(E, H // 128, I // 128, device=DEV) + 0.5) / math.sqrt(I)
        weights.append((w13, s13, w2, s2))
    return weights


def moe_data(weights, w, distinct):
    """One call's inputs per weight set: (x, ids, topk weights, weights, out), the routing's union
    exactly ``distinct`` experts."""
    H, E = MOE["H"], MOE["E"]
    data = []
    for i, wt in enumerate(weights):
        ids = routing(w, E, distinct, seed=i).to(DEV)
        tw = torch.rand(w, 8, device=DEV) + 0.05
        tw = tw / tw.sum(1, keepdim=True)
        # FP16 x holding BF16 values: what the runtime passes (the norm's out16)
        x = torch.randn(w, H, device=DEV).to(torch.bfloat16).to(torch.float16)
        data.append((x, ids, tw, wt, torch.empty(w, H, device=DEV, dtype=torch.bfloat16)))
    return data


def moe_bytes(w, distinct):
    """Minimum bytes of the whole MoE call (``call``) and of each of its launches (the names of
    ``moe_plan``'s steps): the distinct experts' weights and scales, plus x / partials / output."""
    H, I = MOE["H"], MOE["I"]
    gu = distinct * (2 * I * H + (2 * I // 128) * (H // 128) * 4)
    dn = distinct * (H * I + (H // 128) * (I // 128) * 4)
    P = w * 8
    return dict(call=gu + dn + 2 * w * H * 2 + P * 8, gate_up=gu + w * H * 2, down=dn + P * H * 4,
                reduce=P * H * 4 + w * H * 2, down_reduce=dn + w * H * 2)


def bench_moe(copy_bw, l2, sweep):
    H, I, E, w = MOE["H"], MOE["I"], MOE["E"], MOE["w"]
    weights = moe_sets(MOE["sets"])
    for label, distinct in ((f"realistic{MOE['realistic']}", MOE["realistic"]), (f"distinct{w * 8}", w * 8)):
        data = moe_data(weights, w, distinct)
        step_bytes = moe_bytes(w, distinct)
        nbytes = step_bytes["call"]
        ref_calls = [(lambda x=x, ids=ids, tw=tw, wt=wt: M.moe_reference(x, ids, tw, *wt))
                     for x, ids, tw, wt, _ in data[:2]]
        # "default" = M.MOE_VARIANT; v1 and v2 always, for A/B (variant="v1" / variant="v2").
        variants = [("default", {}), ("v1", dict(variant="v1")), ("v2", dict(variant="v2")),
                    ("bf16_x", dict(_bf16_x=True)),   # session 11 and before: BF16 x, cast per tile
                    # session 13: K steps per Gate/Up iteration (one until session 13; two, 3 stages)
                    ("gu_unroll1", dict(gu_unroll=1)), ("gu_unroll2_st3", dict(gu_unroll=2, gu_num_stages=3)),
                    ("gu_unroll3_st3", dict(gu_unroll=3, gu_num_stages=3)),   # 162 registers, 72 KiB: 3 per SM
                    ("gu_st4", dict(gu_num_stages=4))]   # the Gate/Up's stages before session 24 (3 since)
        # v2 with a persistent counter buffer (left zero by every call): no per-call memset node.
        cnt = torch.zeros(M.counters_size(w, H, I, E), device=DEV, dtype=torch.int32)
        variants += [("v2_cnt", dict(variant="v2", counters=cnt))]
        # v1 with the wide, pipelined Down (down_nb column blocks per program); operand types (FP16
        # defaults since session 10, BF16 before). Rejected session-10 variants (nb 12/16, Gate/Up
        # widths 16/64) run with --sweep.
        variants += [("v1_nb4_st3", dict(variant="v1", down_nb=4, down_num_stages=3)),
                     ("v1_bf16", dict(variant="v1", gu_f16=False, down_f16=False))]
        # programmatic dependent launch (Gate/Up -> Down -> reduce), the Down's L2 prefetch depth,
        # and reduce widths
        variants += [("v1_pdl", dict(variant="v1", pdl=True)),
                     ("v1_pdl_pf0", dict(variant="v1", pdl=True, down_prefetch=0)),
                     ("v1_pdl_pf4", dict(variant="v1", pdl=True, down_prefetch=4)),
                     ("v1_pdl_pf8", dict(variant="v1", pdl=True, down_prefetch=8)),
                     ("v1_rb256", dict(variant="v1", red_block_h=256)),
                     ("v1_pdl_rb256", dict(variant="v1", pdl=True, red_block_h=256)),
                     ("v1_nopdl", dict(variant="v1", pdl=False))]
        variants += [(f"v1_pdl_rb{rb}{tag}", dict(variant="v1", pdl=True, red_block_h=rb, **kw))
                     for rb, tag, kw in [(128, "", {}), (512, "", {}), (256, "_nb4", dict(down_nb=4)),
                                         (256, "_nb6", dict(down_nb=6)), (256, "_pf0", dict(down_prefetch=0)),
                                         (256, "_gu3", dict(gu_num_stages=3))]]
        if sweep and distinct == MOE["realistic"]:
            variants += [("v1_f16_nb12", dict(variant="v1", down_nb=12)),
                         ("v1_f16_nb16_st4", dict(variant="v1", down_nb=16, down_num_stages=4)),
                         ("v1_gubn16", dict(variant="v1", gu_block_n=16)),
                         ("v1_gubn64", dict(variant="v1", gu_block_n=64))]
            variants += [(f"gu{a}_down{b}", dict(variant="v1", gu_num_stages=a, down_num_stages=b))
                         for a, b in [(3, 2), (6, 2), (4, 3)]]
            variants += [(f"v2_k{a}_e{b}", dict(variant="v2", gu_split_k=a, down_split_e=b))
                         for a, b in [(3, 5), (4, 5), (8, 5), (12, 5), (6, 3), (6, 4), (6, 8), (6, 12)]]
            variants += [(f"v2_gu{a}_down{b}", dict(variant="v2", gu_num_stages=a, down_num_stages=b))
                         for a, b in [(2, 2), (4, 3), (4, 4)]]
            variants += [("v2_reg128", dict(variant="v2", gu_maxnreg=128)),
                         ("v2_reg128_k4", dict(variant="v2", gu_maxnreg=128, gu_split_k=4))]
        for name, kw in variants:
            kw = dict(kw)
            cast = kw.pop("_bf16_x", False)
            calls = [(lambda x=(x.to(torch.bfloat16) if cast else x), ids=ids, tw=tw, wt=wt, o=o, kw=kw:
                      M.fused_moe_fp8(x, ids, tw, *wt, o, **kw))
                     for x, ids, tw, wt, o in data]
            record("moe", f"H{H}_I{I}_E{E}_w{w}_{label}", name, calls, nbytes, copy_bw,
                   ref_calls=ref_calls if name == "default" else None, eager=name == "default",
                   distinct=distinct)
        # Breakdown: each production launch alone (M.moe_plan: the launches fused_moe_fp8 runs, with
        # its buffers allocated once per input set), same graph replay over the rotating sets. Bytes:
        # the launch's own minimum traffic (moe_bytes).
        for var, vkw in (("v1", {}), ("v1_bf16", dict(gu_f16=False, down_f16=False))):
            plans = [M.moe_plan(x, ids, tw, *wt, o, variant=var[:2], **vkw)[1] for x, ids, tw, wt, o in data]
            for plan in plans:  # fill the intermediate buffers (activations, group table) once
                for _, launch in plan:
                    launch()
            for k, (step, _) in enumerate(plans[0]):
                record("moe", f"H{H}_I{I}_E{E}_w{w}_{label}", f"{var}:{step}", [p[k][1] for p in plans],
                       step_bytes[step], copy_bw, eager=False, distinct=distinct, breakdown=True)
            del plans
        del data, ref_calls
    del weights
    if not DRY_RUN:
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- norm
def torch_add_rmsnorm(x, res, wt, eps):
    res.add_(x)
    r = res.float()
    return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * wt.float()).to(torch.bfloat16)


def bench_norm(copy_bw, l2, sweep):
    for H, w in NORM["shapes"]:
        nbytes = w * H * 2 * 4 + H * 2
        sets = n_sets(nbytes, l2, cap=256)
        data = [(torch.randn(w, H, device=DEV).to(torch.bfloat16),
                 torch.randn(w, H, device=DEV).to(torch.bfloat16),
                 (torch.rand(H, device=DEV) + 0.5).to(torch.bfloat16),
                 torch.empty(w, H, device=DEV, dtype=torch.bfloat16)) for _ in range(sets)]
        calls = [(lambda x=x, r=r, wt=wt, o=o: N.fused_add_rmsnorm(x, r, wt, 1e-6, o))
                 for x, r, wt, o in data]
        ref_calls = [(lambda x=x, r=r, wt=wt: torch_add_rmsnorm(x, r, wt, 1e-6))
                     for x, r, wt, _ in data[:4]]
        record("norm", f"H{H}_w{w}", "default", calls, nbytes, copy_bw, ref_calls=ref_calls)
        # with the FP16 copy for the MoE (the runtime's norm before each MoE)
        o16 = [torch.empty(w, H, device=DEV, dtype=torch.float16) for _ in data]
        calls = [(lambda x=x, r=r, wt=wt, o=o, o2=o2: N.fused_add_rmsnorm(x, r, wt, 1e-6, o, out16=o2))
                 for (x, r, wt, o), o2 in zip(data, o16)]
        record("norm", f"H{H}_w{w}", "out16", calls, nbytes + w * H * 2, copy_bw, eager=False)


# ------------------------------------------------------------------------------------- rope
def torch_rope_kv(qkv, cos2, sin2, nh, nkv, kc, vc, slots, labels=None, positions=None):
    """The fast step's sequence before session 12: the reference's RoPE in FP32, then index_copy_."""
    T = qkv.shape[0]
    d = kc.shape[2]
    qk = FastModel._rope(qkv[:, :(nh + nkv) * d].view(T, nh + nkv, d), cos2, sin2)
    kc.index_copy_(1, slots, qk[:, nh:].transpose(0, 1))
    vc.index_copy_(1, slots, qkv[:, (nh + nkv) * d:].view(T, nkv, d).transpose(0, 1))
    if labels is not None:
        labels.index_copy_(0, slots, positions)
    return qk[:, :nh]


def bench_rope(copy_bw, l2, sweep):
    nh, nkv, d = ATTN["nh"], ATTN["nkv"], ATTN["d"]
    for ring in (False, True):
        for w in (6, 8):
            slots = ATTN["window"] + 64 if ring else 65536 + 64
            start = ATTN["ring_start"] if ring else 65536 - w
            pos = torch.arange(start, start + w, device=DEV)
            sl = pos % slots if ring else pos
            ang = pos.double()[:, None] * torch.rand(d // 2, device=DEV, dtype=torch.float64)[None]
            cos2 = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None, :]
            sin2 = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None, :]
            sets = 16
            data = [(torch.randn(w, (nh + 2 * nkv) * d, device=DEV).to(torch.bfloat16),
                     torch.zeros(nkv, slots, d, device=DEV, dtype=torch.bfloat16),
                     torch.zeros(nkv, slots, d, device=DEV, dtype=torch.bfloat16),
                     torch.full((slots,), -1, device=DEV, dtype=torch.int64) if ring else None) for _ in range(sets)]
            nbytes = w * (nh + 2 * nkv) * d * 2 * 2 + (w * 8 if ring else 0)
            calls = [(lambda qkv=qkv, kc=kc, vc=vc, lab=lab: R.rope_kv_write(
                qkv, cos2, sin2, nh, nkv, kc, vc, sl, labels=lab, positions=pos if ring else None))
                for qkv, kc, vc, lab in data]
            torch_calls = [(lambda qkv=qkv, kc=kc, vc=vc, lab=lab: torch_rope_kv(
                qkv, cos2, sin2, nh, nkv, kc, vc, sl, lab, pos if ring else None)) for qkv, kc, vc, lab in data]
            shape = f"{'ring' if ring else 'full'}_w{w}"
            record("rope_kv", shape, "default", calls, nbytes, copy_bw, ref_calls=torch_calls[:4])
            record("rope_kv", shape, "torch_in_graph", torch_calls, nbytes, copy_bw, eager=False)


# ----------------------------------------------------------------------------------- router
def bench_router(copy_bw, l2, sweep):
    """The one-launch router (route_topk) against the reference's torch sequence (SGEMM of the BF16
    input against the FP32 router, topk, softmax) captured in a graph, at the q1 router (E = 128,
    H = 6144) and w = 6 / 8. Bytes: the BF16 router weight (the kernel's minimum) and x."""
    H, E = MOE["H"], MOE["E"]
    for w in (6, 8):
        sets = n_sets(E * H * 2, l2, cap=64)
        data = [(torch.randn(w, H, device=DEV).to(torch.bfloat16),
                 (torch.randn(E, H, device=DEV) / math.sqrt(H)).to(torch.bfloat16)) for _ in range(sets)]
        r32 = [r.float() for _, r in data]
        cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
        outs = [(torch.empty(w, 8, dtype=torch.int32, device=DEV), torch.empty(w, 8, device=DEV)) for _ in data]
        nbytes = E * H * 2 + w * H * 2 + w * 8 * 8
        def router_calls(**kw):   # one route_topk call per input set, with keywords kw
            return [(lambda x=x, r=r, o=o: RT.route_topk(x, r, 8, counter=cnt, ids=o[0], weights=o[1], **kw))
                    for (x, r), o in zip(data, outs)]
        calls = router_calls()

        def torch_route(x, r32):   # Model.route with FastModel's FP32 router copy
            top, ids = (x.float() @ r32.T).topk(8, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        torch_calls = [(lambda x=x, r=r: torch_route(x, r)) for (x, _), r in zip(data, r32)]
        record("router", f"E{E}_H{H}_w{w}", "default", calls, nbytes, copy_bw, ref_calls=torch_calls[:4])
        record("router", f"E{E}_H{H}_w{w}", "torch_in_graph", torch_calls, nbytes, copy_bw, eager=False)
        # the router slice after the wait, in BLOCK_K steps (the way before session 17); in this chain of
        # router calls each one's early launch overlaps the previous call, so the step's A/B
        # (bench_step.py --ab router_weights_after) is the measure that counts
        for name, kw in (("weights_after", dict(weights_first=False)), ("no_pdl", dict(pdl=False)),
                         ("no_pdl_weights_after", dict(pdl=False, weights_first=False))):
            record("router", f"E{E}_H{H}_w{w}", name, router_calls(**kw), nbytes, copy_bw, eager=False)
        del data, r32
    bench_oproj_routing(copy_bw, l2)


def bench_oproj_routing(copy_bw, l2, w=6, eps=1e-6):
    """The output projection and the routing as the step runs them (session 44), at the q1 rank
    (768 -> 6144, E = 128), w = 6: the pair's time per call. ``default`` (kernels.routing=folded): the
    projection adds to the residual, writes the sums of squares and the router-logit partials
    (``skinny_linear(residual=, fold=)``), ``route_folded`` routes and writes h / h16; ``rounded``: the
    same projection without the partials, then ``route_topk(norm=)`` (the default until session 44).
    Reference: torch's sequence (the projection, the add, RMSNorm, the FP32 router product of the
    rounded h, topk, softmax). Bytes: both weights, the norm weight, x, the residual read and
    written, h and h16 written."""
    H, E = MOE["H"], MOE["E"]
    K = 768 if not DRY_RUN else 256
    sets = n_sets((H * K + E * H) * 2, l2, cap=64)
    bf = torch.bfloat16
    data = [dict(x=torch.randn(w, K, device=DEV).to(bf), wo=(torch.randn(H, K, device=DEV) / math.sqrt(K)).to(bf),
                 r=torch.randn(w, H, device=DEV).to(bf), ln=(1 + 0.2 * torch.randn(H, device=DEV)).to(bf),
                 rw=(torch.randn(E, H, device=DEV) / math.sqrt(H)).to(bf)) for _ in range(sets)]
    for d in data:
        d["rw32"] = d["rw"].float()
    nb, rows, ep = LN.fold_shape(H, K, E, DEV)
    ssq = torch.empty(w, nb, device=DEV)
    pl = torch.empty(nb, rows, ep, device=DEV)
    h, h16 = torch.empty(w, H, device=DEV, dtype=bf), torch.empty(w, H, device=DEV, dtype=torch.float16)
    ids, wts = torch.empty(w, 8, dtype=torch.int32, device=DEV), torch.empty(w, 8, device=DEV)
    lcnt = torch.zeros(H // 16, dtype=torch.int32, device=DEV)
    cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
    nbytes = (H * K + E * H + H) * 2 + w * K * 2 + 2 * w * H * 2 + w * H * 4 + w * 8 * 8

    def folded(d):
        LN.skinny_linear(d["x"], d["wo"], counter=lcnt, residual=(d["r"], ssq), fold=(d["rw"], d["ln"], pl))
        RT.route_folded(pl, ssq, E, 8, (d["r"], d["ln"], eps, h, h16), ids=ids, weights=wts)

    def rounded(d):
        LN.skinny_linear(d["x"], d["wo"], counter=lcnt, residual=(d["r"], ssq))
        RT.route_topk(None, d["rw"], 8, counter=cnt, ids=ids, weights=wts, norm=(d["r"], ssq, d["ln"], eps, h, h16))

    def torch_seq(d):   # (in place on a copy: the reference's arithmetic, its own residual)
        r = (d["r"].float() + (d["x"] @ d["wo"].T).float()).to(bf)
        rf = r.float()
        hh = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * d["ln"].float()).to(bf)
        top, i = (hh.float() @ d["rw32"].T).topk(8, dim=-1)
        return i, torch.softmax(top, dim=-1)

    shape = f"oproj_route_E{E}_H{H}_w{w}"
    ref = [(lambda d=d: torch_seq(d)) for d in data]
    record("router", shape, "default", [(lambda d=d: folded(d)) for d in data], nbytes, copy_bw, ref_calls=ref[:4])
    record("router", shape, "rounded", [(lambda d=d: rounded(d)) for d in data], nbytes, copy_bw)
    record("router", shape, "torch_in_graph", ref, nbytes, copy_bw, eager=False)
    del data


# ----------------------------------------------------------------------------------- linear
def bench_linear(copy_bw, l2, sweep):
    """The decode projections (q1 rank: fused Q/K/V 6144 -> 1024, output 768 -> 6144, w = 6):
    skinny_linear against torch matmul (cuBLAS) captured in a graph, alone and behind the fused
    add + RMSNorm that precedes them in the step ("after_norm": the pair's time; the norm releases
    the projection at its start, so it launches while the norm runs). Bytes: the weight, x and y."""
    H = MOE["H"]
    w = 6
    for K, n_out, name in ((H, 1024 if not DRY_RUN else 512, "qkv"), (768 if not DRY_RUN else 256, H, "o_proj")):
        sets = n_sets(n_out * K * 2, l2, cap=64)
        data = [(torch.randn(w, K, device=DEV).to(torch.bfloat16),
                 (torch.randn(n_out, K, device=DEV) / math.sqrt(K)).to(torch.bfloat16),
                 torch.empty(w, n_out, device=DEV, dtype=torch.bfloat16)) for _ in range(sets)]
        cnt = torch.zeros(n_out // 16, dtype=torch.int32, device=DEV)
        nbytes = n_out * K * 2 + w * K * 2 + w * n_out * 2
        shape = f"{name}_{K}x{n_out}_w{w}"
        variants = [("default", {}), ("no_pdl", dict(pdl=False))]
        if sweep:
            variants += [(f"bn{bn}_sk{sk}", dict(block_n=bn, split_k=sk))
                         for bn, sk in ((16, 2), (32, 2), (32, 4), (64, 4), (64, 1), (128, 1), (32, 1))
                         if n_out % bn == 0 and K % (sk * 128) == 0]
        for vname, kw in variants:
            calls = [(lambda x=x, wt=wt, o=o, kw=kw: LN.skinny_linear(x, wt, o, counter=cnt, **kw))
                     for x, wt, o in data]
            record("linear", shape, vname, calls, nbytes, copy_bw, eager=vname == "default",
                   ref_calls=[(lambda x=x, wt=wt: x @ wt.T) for x, wt, _ in data[:4]] if vname == "default" else None)
        record("linear", shape, "cublas_in_graph", [(lambda x=x, wt=wt, o=o: torch.matmul(x, wt.T, out=o))
                                                    for x, wt, o in data], nbytes, copy_bw, eager=False)
        # the same call on one input set over and over: the weight stays in L2, so this is what the
        # projection's chain (launch, wait, products, split-K sum) costs when its bytes are not the limit
        x0, w0, o0 = data[0]
        record("linear", shape, "l2_hot", [lambda: LN.skinny_linear(x0, w0, o0, counter=cnt)] * len(data),
               nbytes, copy_bw, eager=False)
        # behind the norm that precedes the projection in the step (the pair's time per call)
        res = [torch.zeros(w, K, device=DEV, dtype=torch.bfloat16) for _ in data]
        ln = torch.ones(K, device=DEV, dtype=torch.bfloat16)
        hs = [torch.empty(w, K, device=DEV, dtype=torch.bfloat16) for _ in data]
        for vname, proj in (("after_norm", lambda h, wt, o: LN.skinny_linear(h, wt, o, counter=cnt)),
                            ("after_norm_no_pdl", lambda h, wt, o: LN.skinny_linear(h, wt, o, counter=cnt, pdl=False)),
                            ("cublas_after_norm", lambda h, wt, o: torch.matmul(h, wt.T, out=o))):
            calls = [(lambda x=x, wt=wt, o=o, r=r, h=h, proj=proj: (
                N.fused_add_rmsnorm(x, r, ln, 1e-6, out=h), proj(h, wt, o)))
                for (x, wt, o), r, h in zip(data, res, hs)]
            record("linear", shape, vname, calls, nbytes, copy_bw, eager=False)
        r0, h0 = res[0], hs[0]
        record("linear", shape, "after_norm_l2_hot", [lambda: (N.fused_add_rmsnorm(x0, r0, ln, 1e-6, out=h0),
                                                              LN.skinny_linear(h0, w0, o0, counter=cnt))] * len(data),
               nbytes, copy_bw, eager=False)
        del data, res, hs


# ---------------------------------------------------------------------------------- uniforms
def bench_uniform(copy_bw, l2, sweep):
    """The round's counter-based uniforms: one kernel launch (``uniform``) against ``rng.uniform``'s
    torch sequence (~50 launches) captured in a graph, for the verify's 1-7 positions and a draft's
    one. Bytes: the positions read and the floats written (latency, not bandwidth, is the cost)."""
    seed = torch.tensor(1234, dtype=torch.int64, device=DEV)
    for n in (1, 7):
        pos = [torch.arange(n, dtype=torch.int64, device=DEV) + 1000 * i for i in range(8)]
        outs = [torch.empty(n, device=DEV) for _ in pos]
        calls = [(lambda p=p, o=o: U.uniform(seed, p, rng.ACCEPT, out=o)) for p, o in zip(pos, outs)]
        torch_calls = [(lambda p=p: rng.uniform(seed, p, rng.ACCEPT)) for p in pos]
        record("uniform", f"n{n}", "default", calls, n * 12 + 8, copy_bw, ref_calls=torch_calls[:4])
        record("uniform", f"n{n}", "torch_in_graph", torch_calls, n * 12 + 8, copy_bw, eager=False)


# ---------------------------------------------------------------------------------- sampler
def bench_sampler(copy_bw, l2, sweep):
    for V, w in itertools.product(SAMPLER["vocabs"], SAMPLER["widths"]):
        nbytes = w * V * 4 + w * 4 + w * 20 * 8 + w * 8
        sets = n_sets(w * V * 4, l2, cap=192)
        data = []
        for _ in range(sets):
            logits = torch.randn(w, V, device=DEV) * 3
            u = torch.rand(w, device=DEV)
            outs = (torch.empty(w, 20, dtype=torch.int32, device=DEV),
                    torch.empty(w, 20, dtype=torch.float32, device=DEV),
                    torch.empty(w, dtype=torch.int32, device=DEV),
                    torch.empty(w, dtype=torch.int32, device=DEV))
            data.append((logits, u, outs))
        ref_calls = [(lambda lg=lg, u=u: S.sample_reference(lg, u, 1.0)) for lg, u, _ in data[:4]]
        # session 36: the selections by max-reductions (the default before it) and by bitonic sort beside it
        variants = [("default", {})] + [(f"select_{name}", dict(select=name)) for name in S.SELECTS
                                        if name != S.SELECT and (sweep or name == "max")]
        if sweep:
            # session 18: warps, chunk counts and pass-1 tile sizes (the same outputs for any)
            variants += [(f"warps{n}", dict(num_warps=n)) for n in (4, 16)]
            variants += [(f"nch{n}", dict(nch=n)) for n in (128, 256, 512, 2048) if n <= V]
            variants += [(f"tile{n}", dict(tile_elems=n)) for n in (2048, 8192, 16384)]
            variants += [("nch256_w4", dict(nch=256, num_warps=4)), ("nch512_w4", dict(nch=512, num_warps=4))]
        for name, kw in variants:
            calls = [(lambda lg=lg, u=u, o=o, kw=kw: S.sample_topk_topp(lg, u, 1.0, out=o, **kw))
                     for lg, u, o in data]
            record("sampler", f"V{V}_w{w}", name, calls, nbytes, copy_bw,
                   ref_calls=ref_calls if name == "default" else None, eager=name == "default")


# ------------------------------------------------------------------------------------- main
BENCHES = ("attention", "moe", "norm", "rope", "router", "sampler", "uniform", "linear")
# Test hook: after the kernel named here the script sends itself SIGTERM (what `timeout` sends), so that
# the tests can check the interrupted path deterministically. Unset in every real run.
_TERM_AFTER_ENV = "BENCH_KERNELS_SIGTERM_AFTER"


class _Terminated(Exception):
    """SIGTERM (e.g. from `timeout`) turned into an exception, so the run's rows are saved."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def parse_only(text: str) -> list[str]:
    """--only's comma-separated kernel names, in the order given; unknown or repeated names are an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown or not names:
        raise ValueError(f"unknown kernel(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(BENCHES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a kernel named twice in {text!r}")
    return names


def _report(rows: list[dict], env: dict, copy_bw: float, copy_bw2: float | None, status: str) -> None:
    """The short table, the attention lines, the goals (and the figures with $OUT) of the rows so far."""
    end = f" (end of run: {copy_bw2 / 1e12:.3f})" if copy_bw2 else ""
    print(f"\ncopy bandwidth {copy_bw / 1e12:.3f} TB/s{end}")
    if status != "complete":
        print(kernel_report.partial_line(env))
    print(f"{'kernel':9s} {'shape':30s} {'variant':22s} {'graph_us':>9s} {'frac':>6s} "
          f"{'eager_us':>9s} {'ref_us':>9s} {'ref_frac':>8s} {'MB':>8s}")
    for r in rows:
        print(f"{r['kernel']:9s} {r['shape']:30s} {r['variant']:22s} {r['graph_us']:9.2f} "
              f"{r['frac']:6.3f} {r.get('eager_us', float('nan')):9.2f} "
              f"{r.get('ref_us', float('nan')):9.1f} {r.get('ref_frac', float('nan')):8.4f} "
              f"{r['bytes'] / 1e6:8.2f}")
    for line in (kernel_report.attention_lines(rows, copy_bw) + kernel_report.model_lines(rows, copy_bw)
                 + kernel_report.torch_lines(rows)):
        print(line)
    print(kernel_report.goal_summary(kernel_report.goal_checks(rows)))
    out = os.environ.get("OUT")
    if out and rows:
        print("figures: " + ", ".join(kernel_report.write_figures(rows, env, out)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="A full run with --no-sweep takes about 2.5 minutes on the H200; the sweep's\n"
                                        "variants add several more. $OUT is rewritten after each kernel, and on\n"
                                        "Ctrl-C or SIGTERM (e.g. from `timeout`) the rows measured so far are saved\n"
                                        "and reported, marked partial (env.status, env.kernels_done; exit status\n"
                                        "130 / 143). `kernel_report.py $OUT` re-reads a saved run.")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tuning variants: the defaults, references "
                                                            "and probes only")
    ap.add_argument("--only", default=",".join(BENCHES), metavar="K1,K2",
                    help=f"the kernels to time, in this order (default: all: {','.join(BENCHES)})")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, toy shapes (script check)")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip torch's own attentions (SDPA's fused backends, compiled flex_attention) beside "
                         "every full-cache shape (flex compiles once per shape: ~1 min in all)")
    args = ap.parse_args()
    try:
        only = parse_only(args.only)
    except ValueError as e:
        ap.error(f"--only: {e}")
    sweep = not args.no_sweep
    TORCH_ROWS[0] = not args.no_torch
    if DRY_RUN:
        A_SMS[0], l2, name = 4, 2**20, "cpu (dry run: timings mean nothing)"
    else:
        props = torch.cuda.get_device_properties(DEV)
        A_SMS[0], l2, name = props.multi_processor_count, getattr(props, "L2_cache_size", 50 * 2**20), props.name
    env = dict(device=name, sms=A_SMS[0], l2_bytes=l2,
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               time=time.strftime("%Y-%m-%dT%H:%M:%S"), kernels=only, kernels_done=[], sweep=sweep,
               status="running")
    print("env", env, flush=True)
    copy_bw, copy_t = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (2 GiB copy, read+write, {copy_t * 1e3:.3f} ms)",
          flush=True)
    env.update(copy_bw=copy_bw)
    benches = dict(attention=bench_attention, moe=bench_moe, norm=bench_norm, rope=bench_rope,
                   router=bench_router, sampler=bench_sampler, uniform=bench_uniform, linear=bench_linear)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    t0, copy_bw2, status = time.time(), None, "complete"
    try:
        for name in only:
            t = time.time()
            benches[name](copy_bw, l2, sweep)
            env["kernels_done"].append(name)
            env["wall_s"] = time.time() - t0
            write_results("bench_kernels", dict(env=env), ROWS)   # kept if a later kernel is interrupted
            print(f"[{name} done in {time.time() - t:.1f}s]", flush=True)
            if os.environ.get(_TERM_AFTER_ENV) == name:
                os.kill(os.getpid(), signal.SIGTERM)
        copy_bw2, _ = copy_bandwidth()
    except (KeyboardInterrupt, _Terminated) as e:
        status = f"interrupted by {'SIGTERM' if isinstance(e, _Terminated) else 'Ctrl-C'} after " \
                 f"{time.time() - t0:.0f} s"
    finally:
        signal.signal(signal.SIGTERM, previous)
    env.update(copy_bw_end=copy_bw2, wall_s=time.time() - t0, status=status)
    # Rows of a kernel cut off midway are kept: each row is complete in itself.
    write_results("bench_kernels", dict(env=env), ROWS)
    _report(ROWS, env, copy_bw, copy_bw2, status)
    if status != "complete":
        sys.exit(143 if "SIGTERM" in status else 130)


if __name__ == "__main__":
    main()
