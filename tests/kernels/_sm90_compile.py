"""Compile every kernel launch configuration for sm_90 on a machine without a GPU (run by
test_compile_sm90.py in a subprocess without TRITON_INTERPRET); prints a JSON report last:
{"kernels": [...], "problems": [...], "rows": [[name, grid, shared, regs, stack, local], ...]}.
"""
from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

SMEM_LIMIT = 227 * 1024


# libdevice's FP64 cos / sin keep a small array on the stack for the Payne-Hanek reduction of large
# arguments (RoPE angles reach 1e6 radians): a stack frame that is no register spill. Allowed, up to
# this size, only in the launches that call them (the RoPE tables; rope_kv_write with ANGLES).
TRIG_STACK = 64


def _fp64_trig(name, kw):
    return name == "_rope_tables_kernel" or (name == "_rope_kv_kernel" and bool(kw.get("ANGLES")))


# The exchange's kernels at the test models' widths (below 4,096: q1-tiny's 256) keep an 8 B stack frame
# in a few forms, with no local memory and 40 registers or fewer: a frame, not spilled registers. At
# q1's width (6,144) none is allowed.
EXCHANGE_SMALL_STACK = 8


def _exchange_small(name, kw):
    return ((name == "_peer_add_rmsnorm_kernel" and kw["H"] < 4096)
            or (name == "_moe_reduce_kernel" and kw.get("PEER") and kw["H"] < 4096)
            or (name == "_linear_kernel" and kw.get("PEER") and kw["N"] < 4096))


class _Sm90Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


class _CompileOnly:
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.fn.fn.__name__, grid, self.fn.warmup(*args, grid=grid, **kwargs), kwargs))
        return launch


# What a launch's constexprs must (and must not) put into its PTX: (kernel, keyword, PTX text).
PTX_MARKS = [("_attn_split_v2_kernel", "TAIL_PREFETCH", "prefetch.global.L2"),
             ("_linear_kernel", "PREFETCH", "prefetch.global.L2"),
             ("_linear_kernel", "PDL", "griddepcontrol.launch_dependents"),
             ("_add_rmsnorm_kernel", "PDL", "griddepcontrol.wait"),
             ("_router_kernel", "PDL", "griddepcontrol.wait"),
             ("_route_folded_kernel", "PDL", "griddepcontrol.wait"),
             ("_moe_gate_up_kernel", "WAIT", "griddepcontrol.wait"),
             ("_attn_split_v2_kernel", "TMA", "cp.async.bulk.tensor"),
             ("_attn_split_v2_kernel", "PDL", "griddepcontrol.wait"),
             ("_rope_kv_kernel", "PDL", "griddepcontrol.wait"),
             # the reference's RoPE rounds each product: no contraction into FMA
             ("_rope_kv_kernel", "enable_fp_fusion", "fma.rn.f32"),
             # the fused all-reduce: system-scope fences and volatile polls of the peers' rows on the GPU
             # (SYS_FENCE / GPU_FENCE: derived keys, see DERIVED)
             ("_peer_add_rmsnorm_kernel", "SYS_FENCE", "fence.acq_rel.sys"),
             ("_peer_add_rmsnorm_kernel", "GPU_FENCE", "fence.acq_rel.gpu"),
             ("_peer_add_rmsnorm_kernel", "ON_GPU", "ld.volatile.global"),
             ("_peer_add_rmsnorm_kernel", "PDL", "griddepcontrol.wait"),
             ("_moe_reduce_kernel", "PEER", "ld.volatile.global"),
             ("_moe_reduce_kernel", "SYS_FENCE", "fence.acq_rel.sys"),
             ("_linear_kernel", "PEER", "ld.volatile.global"),
             ("_linear_kernel", "SYS_FENCE", "fence.acq_rel.sys")]


def _exchange_fence(scope):
    """Whether a launch of the exchange's code (the exchange's kernel; the MoE reduce or the projection with PEER) puts a
    fence of ``scope`` (1: GPU, 2: system) into its PTX."""
    return lambda kw: bool(kw.get("ON_GPU")) and bool(kw.get("PEER", True)) and scope in (kw.get("ACQ"), kw.get("REL"))


# Keys of PTX_MARKS computed from a launch's constexprs: (kernel, key) -> function of them
DERIVED = {("_peer_add_rmsnorm_kernel", "SYS_FENCE"): _exchange_fence(2),
           ("_peer_add_rmsnorm_kernel", "GPU_FENCE"): _exchange_fence(1),
           ("_moe_reduce_kernel", "SYS_FENCE"): _exchange_fence(2),
           ("_linear_kernel", "SYS_FENCE"): lambda kw: bool(kw.get("PEER")) and _exchange_fence(2)(kw)}


# Keywords that put weight loads before griddepcontrol.wait (and without which no global load precedes
# it): (kernel -> keyword).
EARLY_LOADS = {"_router_kernel": "WEIGHTS_FIRST", "_add_rmsnorm_kernel": "WEIGHT_FIRST",
               "_moe_reduce_kernel": "WEIGHT_FIRST"}
# (not _peer_add_rmsnorm_kernel: it always reads its table of buffers, written once, before the wait)


# Launches whose weights-as-A products must stay on mma.sync, never wgmma (session 22: a wgmma waited
# for before each K step's scale lost): (kernel -> keyword).
MMA_SYNC = {"_moe_gate_up_kernel": "WEIGHTS_A", "_moe_down_wide_kernel": "WEIGHTS_A", "_linear_kernel": "WEIGHTS_A"}


def ptx_problems(sink) -> list[str]:
    """A keyword switched on must show in the PTX, and switched off must not (where nothing else
    emits that instruction): the options really change the code. The weights-as-A launches (MMA_SYNC)
    must multiply on mma.sync only: a Triton that chose wgmma for their N = 8 products is caught."""
    out = []
    for name, grid, kernel, kwargs in sink:
        ptx = kernel.asm["ptx"]
        kwargs = {**kwargs, **{key: f(kwargs) for (kname, key), f in DERIVED.items() if kname == name}}
        if kwargs.get(MMA_SYNC.get(name, "")) and ("wgmma" in ptx or "mma.sync" not in ptx):
            out.append(f"{name} {grid}: {MMA_SYNC[name]}=True but its products are not (only) mma.sync")
        for kname, key, mark in PTX_MARKS:
            if name != kname or key not in kwargs or (key == "TAIL_PREFETCH" and kwargs.get("IS_RING")):
                continue   # (rings have no boundary blocks: no tail prefetch)
            other = key == "TAIL_PREFETCH" and kwargs.get("PREFETCH", 0) and kwargs.get("PDL")
            if bool(kwargs[key]) != (mark in ptx) and not (other and mark in ptx):
                out.append(f"{name} {grid}: {key}={kwargs[key]} but {mark!r} {'absent' if kwargs[key] else 'present'}")
        key = EARLY_LOADS.get(name)
        if key and kwargs.get("PDL"):
            lines = ptx.splitlines()   # weights read before the wait: loads precede it in the PTX
            wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
            early = sum("ld.global" in ln for ln in lines[:wait])
            if bool(kwargs.get(key)) != (early > 0):
                out.append(f"{name} {grid}: {key}={kwargs.get(key)} but {early} global loads before "
                           f"griddepcontrol.wait")
    return out


def _compile_only(name, sink):
    """runtime.kernels.<name> with its kernels replaced by compile-only stand-ins."""
    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(f"runtime.kernels.{name}")
    for key, val in list(vars(mod).items()):
        if isinstance(val, JITFunction) and key.endswith("_kernel"):
            setattr(mod, key, _CompileOnly(val, sink))
    return mod


def _launch_everything(A, M, Nm, S, R, RT, U, LN, RS, PF):
    bf = torch.bfloat16
    for d, window, E, H, I in ((128, 4096, 128, 6144, 256), (64, 512, 32, 256, 128)):
        for w in (4, 8):
            q = torch.randn(w, 6, d).to(bf)
            k = torch.randn(1, window + 64, d).to(bf)
            sp = torch.tensor(5, dtype=torch.int32)
            A._launch(q, k, k, sp, torch.zeros(6), None, ring=False, window=0, num_splits=132,
                      variant="v1", combine_block_s=32)     # the combine's loop over split chunks
            for variant in A.VARIANTS:
                A.decode_attention_full(q, k, k, sp, torch.zeros(6), num_splits=132, variant=variant)
                A.decode_attention_ring(q, k, k, sp, torch.zeros(6), window, num_splits=132,
                                        variant=variant)
            for variant in ("v1", "v2"):      # the combine as a programmatic dependent
                A.decode_attention_full(q, k, k, sp, torch.zeros(6), num_splits=132, variant=variant,
                                        pdl=True)
            for opts in (dict(tma=True), dict(tail_prefetch=False), dict(combine_one_load=False),
                         dict(combine_num_warps=4), dict(combine_num_warps=8), dict(kv_first=0),
                         dict(kv_first=2), dict(ml_by_row=False), dict(partials="bfloat16"),
                         dict(partials="bfloat16", combine_one_load=False)):   # v2 / combine options
                A.decode_attention_full(q, k, k, sp, torch.zeros(6), num_splits=132, variant="v2",
                                        pdl=True, **opts)
            A._launch(q, k, k, sp, torch.zeros(6), None, ring=False, window=0, num_splits=132, variant="v2",
                      _timeline=torch.zeros(132 + w * 6 * 4, A.TIMELINE_FIELDS, dtype=torch.int64))
            A._launch(q, k, k, sp, torch.zeros(6), None, ring=False, window=0, num_splits=132, variant="v2",
                      combine_num_warps=1, combine_block_d=8)    # one warp: 8 columns (32 spill)
        w13 = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn)
        s13 = torch.ones(E, 2 * I // 128, H // 128)
        w2 = torch.zeros(E, H, I, dtype=torch.float8_e4m3fn)
        s2 = torch.ones(E, H // 128, -(-I // 128))
        for w, bug in ((4, False), (8, False), (6, True)):
            x = torch.randn(w, H).to(bf)
            ids = torch.zeros(w, 8, dtype=torch.int32)
            M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug)
            M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, variant="v2",
                            _drop_split=bug)
            for nb, st in ((4, 2), (8, 3)):
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, down_nb=nb,
                                down_num_stages=st)
            for f16, nb in ((False, 1), (False, 8), (True, 8)):   # BF16 / FP16 operands; v1 Down
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug,
                                gu_f16=f16, down_f16=f16, down_nb=nb)
            for pf, rb in ((2, None), (0, 256)):                # programmatic dependent launches
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, pdl=True,
                                down_prefetch=pf, red_block_h=rb)
            for dwa in (True, False):                           # the Down's group from the Gate/Up's table
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, pdl=True,
                                group_table=True, down_weights_a=dwa)
            for gt in (True, False):                            # groups ranked through the experts' bitmap
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, pdl=True,
                                group_table=gt, group_bits=True)
            for u, st in ((2, 3), (2, 4)):                      # two K steps per Gate/Up iteration
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, gu_unroll=u,
                                gu_num_stages=st)
            for gwa, dwa in ((False, False), (False, True), (True, False)):   # the MMA's A operand: x or
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug,   # the weights
                                gu_weights_a=gwa, down_weights_a=dwa)
            for bn in (16, 64):                                 # other Gate/Up widths
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, _scale_bug=bug, gu_block_n=bn)
            for first in (True, False):                         # + add + norm (its weight before the wait)
                M.fused_moe_fp8(x, ids, torch.ones(w, 8), w13, s13, w2, s2, pdl=True, _norm_bug=bug,
                                norm=(x.clone(), torch.ones(H).to(bf), 1e-6, torch.zeros(8, dtype=torch.int32)),
                                norm_weight_first=first)
        for rdt in (bf, torch.float32):
            x = torch.randn(8, H).to(bf)
            for first in (True, False):
                Nm.fused_add_rmsnorm(x, x.to(rdt), torch.ones(H).to(bf), 1e-6, weight_first=first)
            Nm.fused_add_rmsnorm(x, x.to(rdt), torch.ones(H).to(bf), 1e-6, out16=torch.empty(8, H).half())
        x = torch.randn(8, H).to(bf)                            # no residual; the embedding gather
        Nm.rmsnorm(x, torch.ones(H).to(bf), 1e-6, x_out=torch.empty_like(x))
        Nm.rmsnorm(x, torch.ones(H).to(bf), 1e-6, _stale_bug=True, x_out=torch.empty_like(x))
        Nm.rmsnorm(torch.randn(40, H).to(bf), torch.ones(H).to(bf), 1e-6, ids=torch.arange(6), vocab_start=3)
        x16 = torch.randn(6, H).half()                          # the MoE on the norm's FP16 copy
        M.fused_moe_fp8(x16, torch.zeros(6, 8, dtype=torch.int32), torch.ones(6, 8), w13, s13, w2, s2)
    for d, nh in ((128, 6), (64, 6)):                                # RoPE + KV-cache write
        for ring in (False, True):
            kc = torch.zeros(1, 4160, d).to(bf)
            R.rope_kv_write(torch.randn(8, (nh + 2) * d).to(bf), torch.ones(8, 1, d), torch.ones(8, 1, d), nh, 1,
                            kc, kc.clone(), torch.arange(8), labels=torch.zeros(4160, dtype=torch.int64) if ring else None,
                            positions=torch.arange(8) if ring else None)
        inv = torch.rand(d // 2, dtype=torch.float64)              # tables from the positions
        R.rope_tables(torch.arange(8), inv)
        R.rope_tables(torch.arange(8), inv, _angle_bug=True)
        kc = torch.zeros(1, 4160, d).to(bf)
        R.rope_kv_write(torch.randn(8, (nh + 2) * d).to(bf), None, None, nh, 1, kc, kc.clone(), None,
                        labels=torch.zeros(4160, dtype=torch.int64), positions=torch.arange(8), inv_freq=inv,
                        ring_slots=4160)
        for n_parts in (4, 8):   # the projection's partials summed here (8: q1's plan with partials, 64 x 8)
            R.rope_kv_write(None, torch.ones(6, 1, d), torch.ones(6, 1, d), nh, 1, kc, kc.clone(), torch.arange(6),
                            qkv_parts=torch.randn(n_parts, 8, (nh + 2) * d))
    from runtime.speculative import DecodeState                     # the round's state updates
    for H in (6144, 256):
        st = DecodeState.empty(H, 20, 64, 0, [3, 5], "cpu")
        for k, mode in ((1, RS.CONT_RULE), (3, RS.CONT_ALWAYS)):
            RS.take_draft(st, torch.zeros(1, 20, dtype=torch.int32), torch.rand(1, 20), torch.zeros(1, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), torch.randn(1, H).to(bf), k, mode, log_col=5)
        for w in (4, 8):
            RS.settle(st, torch.tensor(1), torch.tensor(9), torch.randn(w, H).to(bf), w,
                      cols=dict(width=0, drafts=1, accepted=2, emitted=3, cache_len=4, done=6, tokens=8))
    for T, E, H in ((6, 128, 6144), (16, 32, 256)):                  # the router (q1, mini)
        for bug, first in itertools.product((False, True), (False, True)):
            RT.route_topk(torch.randn(T, H).to(bf), torch.randn(E, H).to(bf), 8, _order_bug=bug, weights_first=first)
        for nw in (8, 16):
            RT.route_topk(torch.randn(T, H).to(bf), torch.randn(E, H).to(bf), 8, num_warps=nw)
    for (N, K, bn, sk), pdl in itertools.product(((1024, 6144, 32, 4), (6144, 768, 64, 1), (512, 256, None, None),
                                                  (1024, 6144, 128, 1)), (True, False)):   # projections (q1: 132 SMs)
        LN.skinny_linear(torch.randn(6, K).to(bf), torch.randn(N, K).to(bf), block_n=bn, split_k=sk, pdl=pdl,
                         prefetch=pdl)
        LN.skinny_linear(torch.randn(6, K).to(bf), torch.randn(N, K).to(bf), block_n=bn, split_k=sk, pdl=pdl,
                         weights_a=False)                                   # x as the MMA's A operand
    LN.skinny_linear(torch.randn(12, 6144).to(bf), torch.randn(1024, 6144).to(bf))   # 12 rows: x as A
    LN.skinny_linear(torch.randn(6, 6144).to(bf), torch.randn(1024, 6144).to(bf), partials=True)   # for RoPE
    LN.skinny_linear(torch.randn(6, 6144).to(bf), torch.randn(1024, 6144).to(bf), partials=True,
                     block_n=64, split_k=8, block_k=64)   # (q1's plan with partials on 132 SMs; the stand-in has 4)
    LN.skinny_linear(torch.randn(6, 6144).to(bf), torch.randn(1024, 6144).to(bf), block_n=128, split_k=16,
                     _drop_bug=True, _no_wait=True)
    # the pre-MoE norm inside the output projection (residual=) and the router (norm=): q1, mini
    for T, E, H, K, (bn, sk) in ((6, 128, 6144, 768, (64, 1)), (8, 32, 256, 384, (32, 2))):
        for bug in (False, True):
            res = torch.randn(T, H).to(bf)
            ssq = torch.empty(T, H // bn)
            LN.skinny_linear(torch.randn(T, K).to(bf), torch.randn(H, K).to(bf), block_n=bn, split_k=sk,
                             residual=(res, ssq), _resid_bug=bug)
            for first, h16, nw in ((True, True, None), (False, False, None), (True, True, 16)):
                RT.route_topk(None, torch.randn(E, H).to(bf), 8, weights_first=first, _norm_bug=bug, num_warps=nw,
                              norm=(res, ssq, torch.randn(H).to(bf), 1e-6, torch.empty(T, H).to(bf),
                                    torch.empty(T, H).half() if h16 else None))
            # the routing folded into the projection (kernels.routing=folded), and its controls
            pl = torch.empty(H // bn, LN.FOLD_ROWS, max(16, E))
            LN.skinny_linear(torch.randn(T, K).to(bf), torch.randn(H, K).to(bf), block_n=bn, split_k=sk,
                             residual=(res, ssq), fold=(torch.randn(E, H).to(bf), torch.randn(H).to(bf), pl),
                             _fold_bug=bug)
            RT.route_folded(pl, ssq, E, 8, (res, torch.randn(H).to(bf), 1e-6, torch.empty(T, H).to(bf),
                                            torch.empty(T, H).half()), _scale_bug=bug, _order_bug=bug)
    # the expert prefetch (FastModel.expert_prefetch; bulk L2 prefetches, and the dry form of the tests)
    w13 = torch.empty(128, 512, 6144, dtype=torch.uint8)
    ids = torch.zeros(8, 8, dtype=torch.int32)
    PF.expert_prefetch(ids, w13, 32 << 20)
    PF.expert_prefetch(ids, w13, 32 << 20, k_first=True)
    m = PF.max_items(64, 128, 256, 6144, 32 << 20)
    PF.expert_prefetch(ids, w13, 32 << 20, dry=(torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int32),
                                                torch.empty(1, dtype=torch.int32)), _bug=True)
    for seed in (torch.tensor(3), 5):                                # the round's uniforms
        U.uniform(seed, torch.arange(7), 2)
    U.uniform(3, torch.arange(7), 2, _bug=True)
    for V in (20000, 4096):
        for select in S.SELECTS:
            S.sample_topk_topp(torch.randn(8, V), torch.rand(8), 1.0, select=select)
        for force in (1, 2):
            S.sample_topk_topp(torch.randn(8, V), torch.rand(8), 1.0, _force=force)
        S.sample_topk_topp(torch.randn(8, V).to(bf), torch.rand(8), torch.rand(8), _topp_bug=True)
        S.sample_topk_topp(torch.randn(8, V), torch.rand(8), torch.rand(()))
    for R in (2, 8):   # tensor parallelism's two stages: a 20,000-logit slice's candidates, the draw over R x 20
        S.rank_candidates(torch.randn(8, 20000).to(bf), torch.rand(8), 0.7, vocab_start=20000)
        S.sample_candidates(torch.randn(8, R * 20), torch.zeros(8, R * 20, dtype=torch.int32), torch.rand(8))



def _launch_peer(PE, M, LN):
    """The fused all-reduce + add + RMSNorm (runtime/kernels/peer.py) at q1 (H = 6144) and q1-tiny
    widths, 2 and 8 ranks, 1 and 8 rows, with and without the FP16 copy and the re-arm, and its forms
    without the add and without the norm."""
    bf = torch.bfloat16
    for R, H in itertools.product((2, 8), (6144, 256)):
        xchg = PE.PeerExchange.group(R, 8, H, "cpu")[R - 1]
        for T, first in itertools.product((1, 8), (True, False)):
            x = torch.randn(T, H).to(bf)
            PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, weight_first=first,
                                out16=torch.empty(T, H).half() if first else None)
        PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, _no_rearm=True)
        PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, add=False)   # a residual's start
        PE.peer_add_rmsnorm(x, x.clone(), None, 1e-6, xchg, norm=False)                 # a pass's last add
        for one in (True, False):    # the fast path's one reduction, or two
            PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, one_reduce=one)
        if H == 6144:    # the fences' forms and the measurement-only early sequence number
            for f in sorted(PE._FENCES):
                PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, fence=f)
            PE.peer_add_rmsnorm(x, x.clone(), torch.ones(H).to(bf), 1e-6, xchg, _seq_first=True)
        for T in (1, 8):   # the MoE reduce all-reducing over the exchange, with the next add + norm
            y = torch.randn(T * 8, H)
            for kw in ({}, dict(rearm_lag=1, fence="sys_acq"), dict(_no_rearm=True)):
                M._launch_reduce(y, torch.ones(T, 8), torch.empty(T, H).to(bf), pdl=True, peer=(xchg, kw),
                                 norm=(torch.randn(T, H).to(bf), torch.ones(H).to(bf), 1e-6,
                                       torch.zeros(8, dtype=torch.int32)))
        # the output projection all-reducing over the exchange in its epilogue (q1: 6 heads' 768 columns
        # into 6,144, one K slice; the tiny width in two), with and without the folded routing's partials
        K, (bn, sk) = (768, (64, 1)) if H == 6144 else (128, (32, 2))
        for T in (1, 8):
            res = torch.randn(T, H).to(bf)
            ssq = torch.empty(T, H // bn)
            for kw in ({}, dict(rearm_lag=1, fence="sys_acq"), dict(_no_rearm=True), dict(fence="sys"),
                       dict(ticket="relaxed")):
                LN.skinny_linear(torch.randn(T, K).to(bf), torch.randn(H, K).to(bf), block_n=bn, split_k=sk,
                                 residual=(res, ssq), peer=(xchg, kw))
            pl = torch.empty(H // bn, LN.FOLD_ROWS, 128)
            LN.skinny_linear(torch.randn(T, K).to(bf), torch.randn(H, K).to(bf), block_n=bn, split_k=sk,
                             residual=(res, ssq), peer=(xchg, {}),
                             fold=(torch.randn(128, H).to(bf), torch.randn(H).to(bf), pl))


def main():
    import triton
    from triton.runtime import driver as drv

    sink = []
    drv.set_active(_Sm90Driver())
    mods = [_compile_only(n, sink) for n in ("attention", "moe", "norm", "sampler", "rope", "router", "uniform",
                                             "linear", "round_state", "prefetch")]
    for m in mods[:3] + mods[5:6] + mods[7:]:   # the stand-in device is the CPU: pdl=True launches for sm_90
        m.pdl_supported = lambda device: True
    mods[7].compiled_cuda = lambda device: True   # and the weight prefetch
    mods[0].compiled_cuda = lambda device: True   # and the L2 prefetches
    mods[9].compiled_cuda = lambda device: True   # the expert prefetch's inline PTX
    mods[4].pdl_supported = lambda device: True
    _launch_everything(*mods)
    pe = _compile_only("peer", sink)
    pe.pdl_supported = pe.compiled_cuda = lambda device: True
    _launch_peer(pe, mods[1], mods[7])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        cuobjdump = shutil.which("cuobjdump")
    problems, rows = ptx_problems(sink), []
    for name, grid, kernel, kw in sink:
        shared = kernel.metadata.shared
        regs = stack = local = None
        if cuobjdump:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                     capture_output=True, text=True).stdout
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
            if m is None:
                problems.append(f"{name} {grid}: no resource report")
            else:
                regs, stack, local = (int(v) for v in m.groups())
                allowed = (TRIG_STACK if _fp64_trig(name, kw) else
                           EXCHANGE_SMALL_STACK if _exchange_small(name, kw) else 0)
                if stack > allowed or local:
                    problems.append(f"{name} {grid}: stack {stack} B, local {local} B")
        if shared > SMEM_LIMIT:
            problems.append(f"{name} {grid}: {shared} B shared memory")
        rows.append([name, list(grid), shared, regs, stack, local, kernel.metadata.num_warps])
        print(name, grid, "shared", shared, "regs", regs, file=sys.stderr)
    print(json.dumps(dict(kernels=sorted({r[0] for r in rows}), problems=problems, rows=rows)))


if __name__ == "__main__":
    main()
