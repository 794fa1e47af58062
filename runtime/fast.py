"""The ``fast`` backend: the reference model with its decode-mode pieces on the Triton kernels.

:class:`FastModel` is a :class:`~runtime.model.Model` (same weights, same checkpoint, same caches'
layout) whose decode passes (``mode="decode"``: the speculative step, at most 8 rows) run on
``runtime.kernels``; prefill stays on the reference torch path. Everything is BF16: weights, caches
and activations, so the backend requires ``runtime.dtype=bfloat16`` (a clear error otherwise: the
recorded dtype stays true, and snapshots of the BF16 reference restore into it unchanged).

Decode pass, per target layer (the residual stream ``r`` is BF16; ``h`` is the normalised input):

    qkv  = h @ [Wq; Wk; Wv]^T                  one GEMM (Wq/Wk/Wv are views of the fused weight):
                                               skinny_linear, launched while the norm before it
                                               runs (kernels.linear)
    q, k = RoPE(q, k); cache[slots] <- k, v    rope_kv_write: one kernel (angles in float64 on the
                                               host side of the pass, as the reference; ring: slot
                                               p % R from the positions, labels too); it also sums
                                               the Q/K/V projection's split-K partials
                                               (qkv_sum_in_rope: the projection's own sum, moved)
    o    = decode_attention_full / _ring(q, cache, start_pos = positions[:1], sinks)
    h    = fused_add_rmsnorm(o @ Wo^T, r, ln2)          r += attention output (h16: h as FP16); Wo: skinny_linear
    ids, weights = route_topk(h, router, 8)    FP32 router logits from the BF16 input, top 8,
                                               softmax: one kernel (the reference: 3-5 torch launches)
                                               (fuse_router_norm: the projection does the add and
                                               per-block sums of squares, the router the norm and
                                               writes h and h16: one launch fewer)
                                               (kernels.routing=folded, the default: the projection's
                                               epilogue also writes FP32 router-logit partials of the
                                               unrounded h, route_folded sums them, routes and writes h
                                               and h16: other numerics, near ties may differ; where
                                               fuse_router_norm does not apply, rounded)
    m    = fused_moe_fp8(h16, ids, weights, w13, s13, w2, s2)   the same values as h, no per-tile cast
    h    = fused_add_rmsnorm(m, r, ln1 of the next layer)   (the last layer: r += m only); with
                                               fuse_moe_norm the MoE's reduce does this add + norm
                                               itself (norm=: each row's last program), same values

so each residual add is fused with the norm that follows it (the reference's ``block`` does
``x + attn(norm(x))`` then ``x + moe(norm(x))``: same values, rounded the same way, since the kernel
rounds r to BF16 before normalising the stored value). The first norm of a pass, the MTP layer's
``enorm``/``hnorm`` (written straight into the halves of the EH input) and the LM-head norm use the
same kernel with a zero residual that it neither reads nor writes (``rmsnorm``; the pass's first norm
also gathers the embedding rows). ``start_pos`` is a device tensor (the rows' positions are
consecutive by construction of the round), so no pass reads anything on the host.

Sampling: :meth:`FastModel.sample_rows` is the hook :class:`~runtime.speculative.Round` uses for the
served distribution and the draw: ``sample_topk_topp`` on the rank's logits, with the counter-based
uniforms as input; :meth:`FastModel.uniform` is the hook for those uniforms (``uniform``: one launch
per call, the same bits as ``rng.uniform``'s ~50 torch launches). Under tensor parallelism (real or
emulated) it takes two launches (``_sample_fast``): each rank's top k of its vocabulary slice, then,
after the candidates' exchange (an excluded no-op under emulation), the draw over every rank's
candidates: the same ids, probabilities and draw as one launch over the whole vocabulary.

Tensor parallelism: with peers, the all-reduces come between the projections and the norms (the
fusions above that join them are single-rank ones). ``tp.fused_allreduce`` (:meth:`FastModel.use_peer_exchange`)
moves every all-reduce that a norm follows into that norm's kernel (``runtime/kernels/peer.py``): the
ranks read each other's partial sums from NaN-armed buffers; the embedding rows' (the residual's start)
and a pass's last MoE's (the add alone) too. The one after the MoE runs inside the MoE reduce
(``peer_moe_reduce``) and the one after the attention inside the output projection's epilogue
(``peer_o_proj``), so the single-rank fusions around them (the norm in the reduce; the add in the
projection, the norm and the folded routing in the router) apply with peers too.

Launches: the kernels of a decode pass are programmatic dependents (sm_90+): each launches while the
one before it runs and waits (griddepcontrol.wait) before reading that kernel's output. A kernel that
reads anything before its wait (the MoE Down reads the expert ids; the attention split reads
start_pos) is released only once that data is final (see ``runtime/kernels/moe.py``).

Per-piece selection (``runtime.kernels``, :class:`~runtime.config.KernelsConfig`, for A/B runs):
each of ``attention``, ``moe``, ``norm``, ``sampler`` and ``linear`` is ``fast`` (its kernel, above) or
``reference`` (eager torch, still without host reads): attention = the reference's
``write_decode`` + ``attend_chunked`` after the same Q/K/V GEMM and RoPE; moe = ``Model.moe``
(with its all-reduce under TP); norm = :func:`add_rmsnorm_torch` (the kernel's contract on the
tests' oracle ``add_rmsnorm_reference``); sampler = ``filter_dist`` + ``draw`` on the rank's slice;
linear = torch matmul (cuBLAS) for the Q/K/V and output projections.
``attention_options`` / ``moe_options`` / ``sampler_options`` are keywords for
``decode_attention_full/_ring`` / ``fused_moe_fp8`` / ``sample_topk_topp``, checked against the
kernels' signatures at construction.

Where the kernels run: on CUDA. On a CPU only inside the Triton interpreter (``TRITON_INTERPRET=1``
set before the kernels were imported, with the interpreter shims of ``tests/kernels/_interp.py``
installed: without them the interpreter multiplies BF16 storage bits); anything else is a
:class:`~runtime.config.ConfigError` at construction.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from . import rng
from .config import ConfigError, DraftConfig, KernelsConfig, ModelConfig, SamplingConfig, Shard
from .kernels import attention as _attn
from .kernels import linear as _linear
from .kernels import moe as _moe
from .kernels import norm as _norm
from .kernels import peer as _peer
from .kernels import prefetch as _prefetch
from .kernels import rope as _rope
from .kernels import round_state as _round
from .kernels import router as _router
from .kernels import sampler as _sampler
from .kernels import uniform as _uniform
from .model import KVCache, LayerWeights, Model, ModelCache, attend_chunked, visible_keys, write_decode
from .speculative import (LOG_ACCEPTED, LOG_CACHE_LEN, LOG_DONE, LOG_DRAFTS, LOG_EMITTED, LOG_NEXT_DRAFTS, LOG_TOKENS,
                          LOG_WIDTH, continue_decided)
from .sampling import draw, filter_dist

MAX_DECODE_ROWS = 8
# peer_add_rmsnorm's keywords that belong to the exchange (also the MoE reduce's: peer.exchange_launch)
_PEER_EXCHANGE_KEYS = ("fence", "rearm_lag", "max_polls", "_no_rearm")
_BF16 = torch.bfloat16
# Negative controls for the tests: a FastModel with one deliberately broken kernel argument.
BROKEN = ("drop_sinks", "moe_scale_bug", "draft_logp_bug", "settle_stop_bug", "moe_norm_bug")
# (the piece whose kernel each breaks; the settle kernel belongs to no selectable piece)
_BROKEN_PIECE = {"drop_sinks": "attention", "moe_scale_bug": "moe", "draft_logp_bug": "sampler",
                 "settle_stop_bug": None, "moe_norm_bug": "moe"}


def _keyword_options(*fns, drop=()) -> list[str]:
    """Keyword-only parameter names accepted by every one of ``fns`` (less ``drop`` and the tests'
    ``_`` controls): what a config may pass through to them."""
    names = None
    for fn in fns:
        ps = inspect.signature(fn).parameters.values()
        mine = {p.name for p in ps if p.kind is inspect.Parameter.KEYWORD_ONLY}
        names = mine if names is None else names & mine
    return sorted(n for n in names or () if n not in drop and not n.startswith("_"))


def kernel_options(kernels: KernelsConfig) -> tuple[dict, dict, dict]:
    """(attention, MoE, sampler keywords) of ``kernels`` after checking their names against the
    kernel entry points; an unknown name is a ConfigError listing the allowed ones."""
    checks = (("attention_options", kernels.attention_options,
               _keyword_options(_attn.decode_attention_full, _attn.decode_attention_ring, drop=("out",)),
               "decode_attention_full/_ring"),
              ("moe_options", kernels.moe_options, _keyword_options(_moe.moe_plan, drop=("norm",)),
               "fused_moe_fp8 (moe_plan)"),
              ("sampler_options", kernels.sampler_options,
               _keyword_options(_sampler.sample_topk_topp, drop=("out",)), "sample_topk_topp"))
    for what, given, allowed, fn in checks:
        unknown = sorted(k for k in given if k not in allowed)
        if unknown:
            raise ConfigError(f"runtime.kernels.{what}: unknown keyword(s) {unknown} for {fn}; "
                              f"allowed: {allowed}")
    return dict(kernels.attention_options), dict(kernels.moe_options), dict(kernels.sampler_options)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_add_rmsnorm``'s contract in eager torch (``kernels.norm=reference``): residual += x in
    residual's dtype (updated in place); out = RMSNorm(residual as stored) * weight, BF16, written into
    ``out`` when given; returns out. Values from the tests' oracle ``add_rmsnorm_reference`` (FP64)."""
    r, normed = _norm.add_rmsnorm_reference(x, residual, weight, eps)
    residual.copy_(r)
    if out is None:
        return normed.to(_BF16)
    out.copy_(normed)
    return out


def _jitted(mod):
    return [v for v in vars(mod).values() if hasattr(v, "fn") and hasattr(v, "arg_names")]


def kernels_runnable(device: torch.device) -> str | None:
    """None when the kernels can run on ``device``; otherwise why not (a sentence)."""
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"device {device} is neither CUDA nor the CPU"
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return ("runtime.backend=fast runs Triton kernels and needs a CUDA device (runtime.device "
                "resolved to cpu). Use runtime.backend=reference on machines without a GPU; the "
                "kernels run on the CPU only in the Triton interpreter (tests: TRITON_INTERPRET=1 "
                "before the kernels are imported, plus tests/kernels/_interp.py shims)")
    import triton.language.standard as std
    from triton.runtime import interpreter

    if not isinstance(std.cdiv, interpreter.InterpretedFunction):
        return ("TRITON_INTERPRET=1 is set but triton was imported before it: its library functions "
                "are compiled ones (set the variable before anything imports triton)")
    mods = (_attn, _linear, _moe, _norm, _rope, _round, _router, _sampler, _uniform)
    if any(not isinstance(f, interpreter.InterpretedFunction) for m in mods for f in _jitted(m)):
        return ("TRITON_INTERPRET=1 is set but runtime.kernels were imported before it: their "
                "kernels are compiled ones, which cannot run on the CPU (re-import them after "
                "setting the variable)")
    if not getattr(interpreter, "_iqrt_shims_installed", False):
        return ("the Triton interpreter is active without the shims of tests/kernels/_interp.py: "
                "its tl.dot on BF16 operands would multiply raw storage bits (wrong results)")
    return None


class FastModel(Model):
    """One rank's shard with decode passes on the Triton kernels (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], shard: Shard,
                 dtype: str = "bfloat16", device="cuda", comm=None, dense_moe: bool | None = None,
                 broken: str | None = None, kernels: KernelsConfig | None = None):
        why = kernels_runnable(torch.device(device))
        if why:
            raise ConfigError(why)
        if dtype != "bfloat16":
            raise ConfigError(f"runtime.backend=fast computes in bfloat16 (BF16 weights, caches and "
                              f"activations); set runtime.dtype=bfloat16 (got {dtype})")
        _check_shapes(cfg, shard)
        super().__init__(cfg, tensors, shard, "bfloat16", device, comm, dense_moe)
        self._setup(broken, kernels)

    @classmethod
    def from_model(cls, model: Model, broken: str | None = None,
                   kernels: KernelsConfig | None = None) -> "FastModel":
        """A fast model over an existing BF16 reference model's weights (shared, not copied; the
        Q/K/V weights of the shared layers become views of one fused tensor, same values)."""
        if model.dtype != _BF16:
            raise ConfigError(f"the fast backend shares only BF16 weights; this model is {model.dtype}")
        why = kernels_runnable(model.device)
        if why:
            raise ConfigError(why)
        _check_shapes(model.cfg, model.shard)
        fm = cls.__new__(cls)
        fm.__dict__.update(model.__dict__)
        fm._setup(broken, kernels)
        return fm

    def _setup(self, broken: str | None, kernels: KernelsConfig | None = None) -> None:
        kernels = KernelsConfig() if kernels is None else kernels
        p = kernels.problems()
        if p:
            raise ConfigError("runtime config: " + "; ".join(p))
        self.kernels = kernels
        self._attn_options, self._moe_options, self._sampler_options = kernel_options(kernels)
        if broken is not None and broken not in BROKEN:
            raise ValueError(f"broken must be one of {BROKEN}, got {broken!r}")
        if broken is not None and _BROKEN_PIECE[broken] and getattr(kernels, _BROKEN_PIECE[broken]) != "fast":
            raise ValueError(f"broken={broken!r} breaks the {_BROKEN_PIECE[broken]} kernel, which "
                             f"kernels.{_BROKEN_PIECE[broken]}=reference does not run")
        self.broken = broken
        # The pass's glue in the kernels: RoPE's tables in one launch per pass (rope_tables), a ring's
        # slots computed inside rope_kv_write, norms without a zero residual tensor, the embedding
        # gather inside the norm after it, and the round's state updates (Round's take_draft and settle
        # hooks, one launch each): about 250 torch launches fewer per q1 step, 5.0 % of its time at 8K
        # (session 37, bench_step.py --ab torch_glue: 1.0505; sessions 15-35 read ~2 % because that
        # variant left the two hooks fused). False restores the torch glue (the same values except the
        # draft entropy's last bit).
        self.fused_glue = True
        # RoPE's cos / sin tables computed inside rope_kv_write (FP64 libdevice cos / sin per program)
        # instead of once per pass in torch: the same values, but off by default (session 15, call 2:
        # with it the step was 0.3 % slower: the per-layer FP64 trig outweighs the saved launches;
        # bench_step.py --ab kernel_rope_tables)
        self.rope_tables_in_kernel = False
        # The fused Q/K/V projection's split-K partials summed inside rope_kv_write (the same bits)
        # instead of by the projection's last arriving program: its arrival counter's round trip and
        # the sum's loads and store leave the critical path. Session 24 (H200, call 5, same-run A/B):
        # the q1 step 0.9931 / 0.9934 of the other way's time at 8K / 64K. False: the projection sums
        # (bench_step.py --ab qkv_sum_in_linear).
        self.qkv_sum_in_rope = True
        # The MoE reduce also does the next residual add + RMSNorm (one launch fewer per layer; the
        # same values: bench_step.py --ab moe_norm_apart measures it). Its per-row arrival counters:
        self.fuse_moe_norm = True
        # The pre-MoE add + RMSNorm without a launch of its own: the output projection adds its result
        # to the residual in its epilogue and writes per-block sums of squares
        # (skinny_linear(residual=)), and the router normalises its slices of the residual itself,
        # writing h and h16 as the norm did (route_topk(norm=)). The same residual; h may differ from
        # the norm kernel's in the last bit (the sum of squares in another order).
        # bench_step.py --ab router_norm_apart measures the old way.
        self.fuse_router_norm = True
        # Expert prefetch (DESIGN.md "Kernels"; runtime/kernels/prefetch.py): None (the default), or
        # (bytes, at[, k_first]) (k_first: expert_prefetch's layout). In each layer pass a launch on a
        # side stream asks L2 for ``bytes`` of the Gate/Up weights of the experts that layer chose in
        # its previous pass (its router writes them into a buffer per layer, _pred_ids), forked when the
        # pass starts (at="layer"), before the attention split (at="attention") or before the router
        # (at="router"). It applies where the router writes the ids (fuse_router_norm, compiled CUDA).
        # A measurement option (bench_step.py --ab xpf*): session 45 measured every form slower.
        self.expert_prefetch: tuple | None = None
        # The fused all-reduce's exchange (use_peer_exchange; tp.fused_allreduce): None, the all-reduces
        # then go through comm before the norms.
        self._xchg = None
        # peer_add_rmsnorm's keywords (e.g. fence; benchmarks' variants), in each of its calls (those of
        # the exchange itself, _PEER_EXCHANGE_KEYS, also in the MoE reduce's)
        self.peer_options: dict = {}
        # With the fused all-reduce: the all-reduce after the MoE inside the MoE reduce, with the next
        # add + RMSNorm (one launch fewer per layer, the same bits). False: the reduce writes the
        # rank's partial sum and peer_add_rmsnorm all-reduces it (bench_step.py --ab peer_fused_reduce_apart)
        self.peer_moe_reduce = True
        # With the fused all-reduce: the all-reduce after the attention inside the output projection's
        # epilogue (skinny_linear(peer=)), which then adds to the residual and writes the sums of squares
        # (and the folded routing's partials) as on one rank: the pre-MoE norm moves into the router, and
        # the exchange's own kernel after the attention goes. False: the projection writes the rank's partial
        # sum and peer_add_rmsnorm all-reduces it (bench_step.py --ab peer_fused_o_apart)
        self.peer_o_proj = True
        # further skinny_linear peer keywords for the output projection's exchange (e.g. ticket; benchmarks' variants)
        self.peer_o_options: dict = {}
        self._pred_ids: dict[int, torch.Tensor] = {}
        self._side_stream = None
        self._moe_norm_counter = torch.zeros(MAX_DECODE_ROWS, dtype=torch.int32, device=self.device)
        self._log_cols = dict(width=LOG_WIDTH, drafts=LOG_DRAFTS, accepted=LOG_ACCEPTED, emitted=LOG_EMITTED,
                              cache_len=LOG_CACHE_LEN, done=LOG_DONE, tokens=LOG_TOKENS)
        cfg, sh, dev = self.cfg, self.shard, self.device
        d = cfg.head_dim
        self._inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
        self._router32: dict[int, torch.Tensor] = {}
        # route_topk's arrival counter: zero, and left zero by every call (one per model: calls are
        # stream-ordered)
        self._route_counter = torch.zeros(1, dtype=torch.int32, device=dev)
        # the router and the MoE as programmatic dependents (None: the kernels' defaults); moe_options'
        # ``pdl`` sets both
        self.moe_pdl = self._moe_options.get("pdl")
        # route_topk loads its router slice before waiting for the norm (None: router.WEIGHTS_FIRST)
        self.router_weights_first = None
        # further route_topk keywords (e.g. split_h; benchmarks' variants), in both of its calls
        self.router_options: dict = {}
        # the norms (and the MoE reduce's fused norm) load their weight before their wait (None:
        # norm.WEIGHT_FIRST)
        self.norm_weight_first = None
        self._qkv: dict[int, torch.Tensor] = {}
        nq, nk = sh.num_heads * d, sh.num_kv_heads * d
        for lw in self.layers + [m.layer for m in self.mtp]:
            self._router32[id(lw)] = lw.router.float()
            if lw.wq.shape[0] + lw.wk.shape[0] + lw.wv.shape[0] != nq + 2 * nk:
                raise ConfigError("unexpected Q/K/V weight shapes")
            base = lw.wq._base
            if base is not None and base is lw.wk._base is lw.wv._base and base.shape[0] == nq + 2 * nk:
                qkv = base          # already fused (another FastModel over the same weights)
            else:
                qkv = torch.cat([lw.wq, lw.wk, lw.wv], dim=0).contiguous()
                lw.wq, lw.wk, lw.wv = qkv[:nq], qkv[nq:nq + nk], qkv[nq + nk:]
            self._qkv[id(lw)] = qkv
        self._u0 = torch.zeros(MAX_DECODE_ROWS, dtype=torch.float32, device=dev)
        # skinny_linear's arrival counters (zero, left zero by every call; calls are stream-ordered)
        n_max = max([nq + 2 * nk] + [lw.wo.shape[0] for lw in self.layers + [m.layer for m in self.mtp]])
        if kernels.linear == "fast":
            why = (_linear.unsupported(nq + 2 * nk, cfg.hidden_size)
                   or _linear.unsupported(cfg.hidden_size, nq))
            if why:
                raise ConfigError(f"kernels.linear=fast: {why}; set kernels.linear=reference")
        # (one more: skinny_linear(peer=)'s arrivals of its column blocks)
        self._linear_counter = torch.zeros(n_max // 16 + 1, dtype=torch.int32, device=dev)

    def _has_peers(self) -> bool:
        """Other ranks exist whose data this rank's result needs (real tensor parallelism; under rank
        emulation the collectives are counted no-ops), or rank emulation of the fused all-reduce, which
        does a real rank's work (its peers' buffers static)."""
        return self.comm.size > 1 and (not getattr(self.comm, "emulated", False) or self._xchg is not None)

    def use_peer_exchange(self, timeout_s: float | None = None, exchange=None) -> None:
        """The fused all-reduce (tp.fused_allreduce; DESIGN.md "Tensor parallel"): each all-reduce that
        a residual add + RMSNorm follows (after the output projection; after the MoE) runs inside that
        norm's kernel (``peer_add_rmsnorm``) over ``exchange``, by default ``comm.peer_exchange`` (a
        collective under real TP); so do the embedding's (the norm after it, the residual's start) and
        the pass's last MoE's (the add alone). The logits' and the sampling candidates' gathers stay on
        comm. Needs the fast norm and MoE kernels."""
        if self.kernels.norm != "fast" or self.kernels.moe != "fast":
            raise ConfigError("tp.fused_allreduce runs inside the norm kernels after the fast MoE: it needs "
                              "kernels.norm=fast and kernels.moe=fast")
        self._xchg = exchange if exchange is not None else self.comm.peer_exchange(
            MAX_DECODE_ROWS, self.cfg.hidden_size, self.device, timeout_s)

    def check_peers(self) -> None:
        """Raises ``PeerTimeout`` if a read of the fused all-reduce took its failure exit (a host read)."""
        if self._xchg is not None:
            self._xchg.check()

    def _reduce_add_norm(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                         out16: torch.Tensor | None = None) -> torch.Tensor:
        """r += all-reduce(x); RMSNorm(r) * w: in one kernel over the exchange (fused all-reduce), or
        the add + norm of an x that comm has all-reduced already."""
        if self._xchg is not None:
            return _peer.peer_add_rmsnorm(x, r, w, self.cfg.rms_norm_eps, self._xchg, out16=out16,
                                          weight_first=self.norm_weight_first, **self.peer_options)
        return self._add_norm(x, r, w, self.cfg.rms_norm_eps, out16=out16)

    # ---- caches -------------------------------------------------------------------------------------
    def new_cache(self, capacity: int, dtype=None) -> ModelCache:
        if dtype is not None and dtype != _BF16:
            raise ValueError(f"the fast backend keeps BF16 caches, not {dtype}")
        return super().new_cache(capacity, _BF16)

    # ---- small pieces -------------------------------------------------------------------------------
    def _add_norm(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None, out16: torch.Tensor | None = None) -> torch.Tensor:
        """r += x; RMSNorm(r) * w in BF16: the fused kernel, or its eager contract (kernels.norm);
        ``out16``: also the same values in FP16 (the MoE kernel's input)."""
        if self.kernels.norm == "reference":
            out = add_rmsnorm_torch(x, r, w, eps, out)
            if out16 is not None:
                out16.copy_(out)
            return out
        return _norm.fused_add_rmsnorm(x, r, w, eps, out, out16=out16, weight_first=self.norm_weight_first)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
              x_out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x) * w in BF16 (x rounded to BF16 first, as the reference's ``rms_norm`` of a BF16
        tensor): the norm kernel with no residual (``rmsnorm``), or the add-norm with a zero one
        (kernels.norm=reference, or ``fused_glue`` off). ``x_out``: also receives x's BF16 values."""
        x = x.to(_BF16).contiguous()
        if self.kernels.norm == "fast" and self.fused_glue:
            return _norm.rmsnorm(x, w, self.cfg.rms_norm_eps, out, x_out=x_out, weight_first=self.norm_weight_first)
        res = torch.zeros_like(x)
        out = self._add_norm(x, res, w, self.cfg.rms_norm_eps, out)
        if x_out is not None:
            x_out.copy_(res)
        return out

    def _embed_norm(self, tokens: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                    x_out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(embed_tokens(tokens)) * w in BF16; ``x_out``: also the embeddings. One launch
        (``rmsnorm`` gathering the rank's embedding rows) with the fused glue where no peer's rows are
        needed (one rank, or rank emulation: the all-reduce is then still counted as excluded); with
        the fused all-reduce, the rank's rows (``embed_tokens(reduce=False)``) all-reduced inside the
        norm's kernel; otherwise the reference's ``embed_tokens`` and the norm."""
        if self._xchg is not None:   # the rank's rows, all-reduced inside the norm's kernel
            e = self.embed_tokens(tokens, reduce=False)
            res = torch.empty_like(e) if x_out is None else x_out
            return _peer.peer_add_rmsnorm(e, res, w, self.cfg.rms_norm_eps, self._xchg, out=out, add=False,
                                          weight_first=self.norm_weight_first, **self.peer_options)
        if self.kernels.norm == "fast" and self.fused_glue and not self._has_peers():
            out = _norm.rmsnorm(self.embed, w, self.cfg.rms_norm_eps, out, x_out=x_out, ids=tokens,
                                vocab_start=self.shard.vocab_start, vocab_size=self.shard.vocab_size,
                                weight_first=self.norm_weight_first)
            if self.shard.tp_size > 1:      # the all-reduce the reference's embed_tokens does (a no-op
                self.comm.all_reduce(out)   # here: emulation counts its bytes, [T, H] BF16 like e)
            return out
        return self._norm(self.embed_tokens(tokens), w, out, x_out=x_out)

    def _rope_tables(self, positions: torch.Tensor):
        """cos/sin [T, 1, d] (both halves) of the reference's RoPE, once per pass: one launch
        (``rope_tables``, the same values) with fast attention and ``fused_glue``, torch otherwise."""
        if self.kernels.attention == "fast" and self.fused_glue:
            return _rope.rope_tables(positions, self._inv_freq)
        ang = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos().float(), ang.sin().float()
        return torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """The reference's rotate-half RoPE, x1*cos - x2*sin | x2*cos + x1*sin, in FP32 (exactly)."""
        xf = x.float()
        h = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
        return (xf * cos2 + rot * sin2).to(x.dtype)

    def _router_kw(self) -> dict:
        """route_topk's keywords besides its inputs (both of its calls: with and without the norm)."""
        return dict(counter=self._route_counter, pdl=self.moe_pdl, weights_first=self.router_weights_first,
                    **self.router_options)

    def route(self, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As the reference (FP32 logits from the BF16-rounded input). With ``kernels.moe=fast``, a
        decode pass (at most ``_router.BLOCK_T`` rows) routes in one launch (``route_topk``: ids int32,
        the logits summed in another order than cuBLAS's, so near ties may resolve differently);
        otherwise torch with the FP32 router kept."""
        if self.kernels.moe == "fast" and x.shape[0] <= _router.BLOCK_T:   # (the router is BF16)
            return _router.route_topk(x.to(_BF16), lw.router, self.cfg.num_experts_per_tok, **self._router_kw())
        r = self._router32.get(id(lw))
        if r is None:
            return super().route(lw, x)
        logits = x.to(_BF16).float() @ r.T
        top, ids = logits.topk(self.cfg.num_experts_per_tok, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    # ---- decode-mode pieces on the kernels ----------------------------------------------------------
    def _proj(self, x: torch.Tensor, w: torch.Tensor, partials: bool = False,
              residual: tuple | None = None, fold: tuple | None = None) -> torch.Tensor:
        """x @ w^T (BF16): skinny_linear with kernels.linear=fast, torch matmul otherwise.
        ``partials``: skinny_linear's split-K partials (FP32 [S, R, N]) where it splits K.
        ``residual`` = (r, ssq) (fast only): r += x @ w^T and its per-block sums of squares instead;
        ``fold`` = (router, norm weight, pl): also the router-logit partials (kernels.routing=folded).
        With ``residual`` and the fused all-reduce, x @ w^T is all-reduced over the exchange first."""
        if self.kernels.linear == "reference":
            return x @ w.T
        return _linear.skinny_linear(x, w, counter=self._linear_counter, partials=partials, residual=residual,
                                     fold=fold, peer=self._exchange_peer(self.peer_o_options) if residual is not None
                                     else None)

    def _exchange_peer(self, extra: dict | None = None) -> tuple | None:
        """A kernel's ``peer=`` for the fused all-reduce inside it (the exchange, its keywords and the
        kernel's own ``extra``), or None."""
        if self._xchg is None:
            return None
        return self._xchg, {**{k: v for k, v in self.peer_options.items() if k in _PEER_EXCHANGE_KEYS}, **(extra or {})}

    def _proj_qkv(self, x: torch.Tensor, w: torch.Tensor) -> dict:
        """The fused Q/K/V projection as rope_kv_write's input: {"qkv": BF16 [T, N]}, or with
        ``qkv_sum_in_rope`` (fast linear, split K) {"qkv": None, "qkv_parts": FP32 [S, R, N]}."""
        y = self._proj(x, w, partials=self.qkv_sum_in_rope)
        return {"qkv": None, "qkv_parts": y} if y.dim() == 3 else {"qkv": y}

    def _router_norm_fusable(self, rows: int) -> bool:
        """Whether the pre-MoE add + RMSNorm may move into the output projection and the router
        (``fuse_router_norm``): fast attention, linear, norm and MoE kernels, the one-launch router,
        and no peer whose partial sums the add must wait for, or the fused all-reduce with
        ``peer_o_proj`` (the projection all-reduces over the exchange itself)."""
        k = self.kernels
        return (self.fuse_router_norm and k.attention == k.linear == k.norm == k.moe == "fast"
                and rows <= _router.BLOCK_T
                and (not self._has_peers() or (self._xchg is not None and self.peer_o_proj)))

    def _attention_fast(self, lw: LayerWeights, h: torch.Tensor, positions: torch.Tensor,
                        cache: KVCache, tab, residual: tuple | None = None, fold: tuple | None = None,
                        before_split=None, reduce: bool = True) -> torch.Tensor:
        """The attention block of h; with ``residual`` = (r, ssq) (``_router_norm_fusable``), the
        output projection adds its result to r itself and writes ssq (skinny_linear(residual=));
        returns r then. ``fold``: skinny_linear's fold= (kernels.routing=folded). ``before_split``:
        called (no arguments) between rope_kv_write and the attention split (the expert prefetch).
        ``reduce``: under TP, all-reduce the output through comm (False: the rank's partial sum)."""
        cfg, sh = self.cfg, self.shard
        T, d, nh, nkv = h.shape[0], cfg.head_dim, sh.num_heads, sh.num_kv_heads
        if self.kernels.attention == "reference":    # device tensors only, as the reference's decode
            qkv = self._proj(h, self._qkv[id(lw)])
            qk = self._rope(qkv[:, :(nh + nkv) * d].view(T, nh + nkv, d), tab["cos"], tab["sin"])
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * d:].view(T, nkv, d)
            kt, vt = k.transpose(0, 1), v.transpose(0, 1)
            keys, vals, kpos = write_decode(cache, positions, kt, vt)
            o = attend_chunked(q, keys, vals, lambda a, b: visible_keys(cache, kpos, positions[a:b]), lw.sinks)
            out = self._proj(o.reshape(T, nh * d).to(_BF16).contiguous(), lw.wo)
            return self.comm.all_reduce(out) if sh.tp_size > 1 and reduce else out
        o = torch.empty(T, nh, d, dtype=_BF16, device=h.device)
        sinks = None if self.broken == "drop_sinks" else lw.sinks
        # (release_next, the combine releasing the output projection at its start, is an option: with
        # the router and Gate/Up programmatic too, the chain of early launches then reaches the MoE
        # while the attention runs: session 14, call 9, the step 0.6-0.8 % slower with it)
        opts = self._attn_options
        qkv = self._proj_qkv(h, self._qkv[id(lw)])
        # RoPE of q and k + the K/V cache write: one kernel (the reference's operations, exactly)
        # (the kernel computes a ring's slots with fused_glue, the tables with rope_tables_in_kernel)
        rope = (dict(cos2=tab["cos"], sin2=tab["sin"]) if "cos" in tab
                else dict(cos2=None, sin2=None, inv_freq=self._inv_freq))
        if cache.kind == "full":
            q = _rope.rope_kv_write(**qkv, nh=nh, nkv=nkv, k_cache=cache.k, v_cache=cache.v, slots=positions,
                                    positions=positions, **rope)
            if before_split is not None:
                before_split()
            _attn.decode_attention_full(q, cache.k, cache.v, tab["start"], sinks, out=o, **opts)
        else:
            ring = dict(slots=None, ring_slots=cache.slots)
            if not self.fused_glue:
                slots = tab.get(("slots", cache.slots))
                if slots is None:
                    slots = tab[("slots", cache.slots)] = positions % cache.slots
                ring = dict(slots=slots)
            q = _rope.rope_kv_write(**qkv, nh=nh, nkv=nkv, k_cache=cache.k, v_cache=cache.v, labels=cache.labels,
                                    positions=positions, **ring, **rope)
            if before_split is not None:
                before_split()
            _attn.decode_attention_ring(q, cache.k, cache.v, tab["start"], sinks, cache.window, out=o, **opts)
        # (with residual, out is r += o @ Wo^T: under rank emulation the all-reduce it stands in for is
        # counted on r, a tensor of the output's shape and dtype)
        out = self._proj(o.view(T, nh * d), lw.wo, residual=residual, fold=fold)
        if residual is not None and self._xchg is not None:   # all-reduced in the projection's epilogue
            return out
        return self.comm.all_reduce(out) if sh.tp_size > 1 and reduce else out

    def _moe_norm_fusable(self) -> bool:
        """Whether the MoE's reduce may also do the next residual add + RMSNorm (``fuse_moe_norm``):
        fast MoE (v1) and norm kernels, and no peer whose partial sums the add must wait for, or the
        fused all-reduce with ``peer_moe_reduce`` (the reduce all-reduces over the exchange itself)."""
        return (self.fuse_moe_norm and self.kernels.moe == "fast" and self.kernels.norm == "fast"
                and (not self._has_peers() or (self._xchg is not None and self.peer_moe_reduce))
                and self._moe_options.get("variant", _moe.MOE_VARIANT) == "v1")

    def _moe_fast(self, lw: LayerWeights, h: torch.Tensor, h16: torch.Tensor | None = None,
                  norm: tuple | None = None, routed: tuple | None = None, reduce: bool = True) -> torch.Tensor:
        """The MoE of h (BF16); ``h16``: the same values in FP16 (written by the norm before), which
        the kernel reads instead of converting h on every Gate/Up tile. ``norm`` = (r, weight): the
        reduce also does r += MoE(h) and returns RMSNorm(r) * weight (see ``_moe_norm_fusable``).
        ``routed``: (ids, weights) already computed (route_topk(norm=)). ``reduce``: as
        ``_attention_fast``'s (the fast MoE only)."""
        if self.kernels.moe == "reference":
            return Model.moe(self, lw, h)           # routes, and all-reduces under TP, itself
        ids, weights = self.route(lw, h) if routed is None else routed
        fused = None if norm is None else (norm[0], norm[1], self.cfg.rms_norm_eps, self._moe_norm_counter)
        peer = None
        if norm is not None and self._xchg is not None:   # the fused all-reduce inside the reduce
            peer = self._exchange_peer()
            reduce = False
        y = _moe.fused_moe_fp8(h if h16 is None else h16, ids, weights, lw.w13, lw.s13, lw.w2, lw.s2,
                               _scale_bug=self.broken == "moe_scale_bug", norm=fused,
                               _norm_bug=self.broken == "moe_norm_bug", norm_weight_first=self.norm_weight_first,
                               peer=peer, **self._moe_options)
        # (with norm, y is the next layer's normalised input; under rank emulation the all-reduce of
        # the MoE output it stands in for is counted on a tensor of the same shape and dtype)
        return self.comm.all_reduce(y) if self.shard.tp_size > 1 and reduce else y

    def _expert_prefetch_plan(self, fuse_rn: bool) -> tuple | None:
        """(bytes, at, k_first) of ``expert_prefetch`` where it applies in this pass (the router writes
        the per-layer ids: fuse_router_norm; compiled CUDA), else None."""
        xpf = self.expert_prefetch
        if xpf is None or not fuse_rn or not _prefetch.compiled_cuda(self.device):
            return None
        nbytes, at, *k_first = xpf
        if at not in ("layer", "attention", "router") or int(nbytes) < 0 or len(k_first) > 1:
            raise ValueError(f"expert_prefetch: (bytes >= 0, 'layer', 'attention' or 'router'[, k_first]), got {xpf!r}")
        return int(nbytes), at, bool(k_first and k_first[0])

    def _predicted_ids(self, lw: LayerWeights) -> torch.Tensor:
        """The layer's ids buffer [MAX_DECODE_ROWS, k] int32 (-1 until its router writes rows): created
        on first use, which must not be inside a CUDA-graph capture (it would be refilled per replay)."""
        buf = self._pred_ids.get(id(lw))
        if buf is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("expert_prefetch: first pass inside a CUDA-graph capture; run one eagerly first")
            buf = self._pred_ids[id(lw)] = torch.full((MAX_DECODE_ROWS, self.cfg.num_experts_per_tok), -1,
                                                      dtype=torch.int32, device=self.device)
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
        return buf

    def _fork_prefetch(self, ids: torch.Tensor, w13: torch.Tensor, nbytes: int, k_first: bool) -> None:
        """The expert prefetch on the side stream, after everything enqueued so far on this one."""
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            _prefetch.expert_prefetch(ids, w13, nbytes, k_first=k_first)

    def _tables(self, positions: torch.Tensor) -> dict:
        """A pass's shared inputs: start_pos, and RoPE's cos / sin tables (unless rope_kv_write computes
        them: ``rope_tables_in_kernel``, fast attention only)."""
        if positions.shape[0] > MAX_DECODE_ROWS:
            raise ValueError(f"a decode pass takes at most {MAX_DECODE_ROWS} rows, got {positions.shape[0]}")
        tab = {"start": positions[:1]}
        if self.kernels.attention == "reference" or not self.rope_tables_in_kernel:
            tab["cos"], tab["sin"] = self._rope_tables(positions)
        return tab

    def _layers_fast(self, layers: list[LayerWeights], caches: list[KVCache], r: torch.Tensor | None,
                     positions: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode layers from the input r (BF16 [T, H]), or from the embeddings of ``tokens`` (r None);
        returns the residual stream after them."""
        eps = self.cfg.rms_norm_eps
        tab = self._tables(positions)
        fused_ar = self._xchg     # the fused all-reduce's exchange, or None
        if r is None:        # r = embed(tokens), h = norm(r): one launch with the fused glue
            r = torch.empty(tokens.shape[0], self.cfg.hidden_size, dtype=_BF16, device=self.device)
            h = self._embed_norm(tokens, layers[0].ln1, x_out=r)
        else:
            x = r
            r = torch.empty_like(x)
            h = self._norm(x, layers[0].ln1, x_out=r)    # r = x, h = norm(x)
        # the MoE kernel's input as FP16 (the same values), written by the norm before it
        h16 = None if self.kernels.moe == "reference" else torch.empty(r.shape, dtype=torch.float16,
                                                                          device=r.device)
        fuse_rn = self._router_norm_fusable(r.shape[0])
        if fuse_rn:   # the output projection's per-block sums of squares; h as the router writes it
            wo = layers[0].wo
            ssq = torch.empty(r.shape[0], _linear.ssq_blocks(wo.shape[0], wo.shape[1], r.device),
                              dtype=torch.float32, device=r.device)
            h_mid = torch.empty_like(r)
        folded = fuse_rn and self.kernels.routing == "folded"
        xpf = self._expert_prefetch_plan(fuse_rn)
        T = r.shape[0]
        if folded:   # the output projection's router-logit partials (route_folded sums them)
            E = layers[0].router.shape[0]
            pl = torch.empty(_linear.fold_shape(wo.shape[0], wo.shape[1], E, r.device), dtype=torch.float32,
                             device=r.device)
        for i, (lw, c) in enumerate(zip(layers, caches)):
            routed, ids, split_fork, router_fork = None, None, None, None
            if xpf is not None:   # the prefetch of the experts this layer chose last time; the router writes ids
                pred = self._predicted_ids(lw)
                ids = pred[:T]
                fork = functools.partial(self._fork_prefetch, pred, lw.w13, xpf[0], xpf[2])
                if xpf[1] == "layer":          # now, before the Q/K/V projection
                    fork()
                elif xpf[1] == "attention":    # between rope_kv_write and the attention split
                    split_fork = fork
                else:                          # after the output projection, before the router
                    router_fork = fork
            if folded:   # r += attention and the router's partial products in the projection
                self._attention_fast(lw, h, positions, c, tab, residual=(r, ssq), fold=(lw.router, lw.ln2, pl),
                                     before_split=split_fork)
                if router_fork is not None:
                    router_fork()
                h = h_mid
                routed = _router.route_folded(pl, ssq, E, self.cfg.num_experts_per_tok, (r, lw.ln2, eps, h, h16),
                                              pdl=self.moe_pdl, ids=ids)
            elif fuse_rn:   # r += attention in the projection; h = norm(r) and the routing in the router
                self._attention_fast(lw, h, positions, c, tab, residual=(r, ssq), before_split=split_fork)
                if router_fork is not None:
                    router_fork()
                h = h_mid
                routed = _router.route_topk(None, lw.router, self.cfg.num_experts_per_tok, ids=ids,
                                            norm=(r, ssq, lw.ln2, eps, h, h16), **self._router_kw())
            else:   # r += attention (its all-reduce inside the norm's kernel with the fused all-reduce)
                a = self._attention_fast(lw, h, positions, c, tab, reduce=fused_ar is None)
                h = self._reduce_add_norm(a, r, lw.ln2, out16=h16)
            if i + 1 < len(layers) and self._moe_norm_fusable():
                h = self._moe_fast(lw, h, h16, norm=(r, layers[i + 1].ln1), routed=routed)   # r += moe, h = norm(r)
                continue
            m = self._moe_fast(lw, h, h16, routed=routed, reduce=fused_ar is None)
            if i + 1 < len(layers):
                h = self._reduce_add_norm(m, r, layers[i + 1].ln1)   # r += moe
            elif fused_ar is not None:   # r += moe, all-reduced in the kernel (no norm: the pass's end)
                _peer.peer_add_rmsnorm(m, r, None, eps, fused_ar, norm=False, **self.peer_options)
            else:
                r.add_(m)
        if xpf is not None:   # the side stream joins (a capture must end on one stream)
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        return r

    # ---- whole passes ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: ModelCache,
                mode: str = "decode") -> torch.Tensor:
        if mode != "decode":
            return super().forward(tokens, positions, cache, mode)
        return self._layers_fast(self.layers, cache.layers, None, positions, tokens=tokens)

    def mtp_forward(self, hidden_prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    cache: ModelCache, mode: str = "decode", j: int = 0) -> torch.Tensor:
        if mode != "decode":
            return super().mtp_forward(hidden_prev, tokens, positions, cache, mode, j)
        m, H = self.mtp[j], self.cfg.hidden_size
        T = tokens.shape[0]
        eh_in = torch.empty(T, 2 * H, dtype=_BF16, device=self.device)
        self._embed_norm(tokens, m.enorm, out=eh_in[:, :H])
        self._norm(hidden_prev, m.hnorm, out=eh_in[:, H:])
        x = (eh_in @ m.eh.T).contiguous()
        return self._layers_fast([m.layer], [cache.mtp[j]], x, positions)

    def logits(self, hidden: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        if hidden.shape[0] > MAX_DECODE_ROWS:     # prefill-sized: the reference path
            return super().logits(hidden, norm)
        h = self._norm(hidden, self.final_norm if norm is None else norm)
        return (h @ self.lm_head.T).float()

    # ---- sampling hooks (used by Round) -------------------------------------------------------------
    def uniform(self, seed, positions: torch.Tensor, purpose: int, lane: int = 0) -> torch.Tensor:
        """``rng.uniform``'s numbers (the same bits): one kernel launch with ``kernels.sampler=fast``."""
        if self.kernels.sampler == "reference":
            return rng.uniform(seed, positions, purpose, lane)
        return _uniform.uniform(seed, positions, purpose, lane)

    def settle(self, st, w: int, n: torch.Tensor, nxt: torch.Tensor, h: torch.Tensor) -> bool:
        """Round's settle hook: with the fused glue, verify's writes after the rejection sampling (the
        emitted tokens, stop and budget, the result-log row, the state for the next round, the hidden
        states) in one launch (``settle``); returns True. False (the torch sequence runs) otherwise."""
        if not self.fused_glue:
            return False
        _round.settle(st, n, nxt, h, w, cols=self._log_cols, _stop_bug=self.broken == "settle_stop_bug")
        return True

    def take_draft(self, st, logits: torch.Tensor, u: torch.Tensor, g: torch.Tensor, k: int,
                   s: SamplingConfig, draft: DraftConfig) -> bool:
        """Round's draft-update hook: with the fast sampler and the fused glue, the sampler's kernel on
        the draft row's logits (``_sample_fast``: under TP in two stages), then one launch
        (``take_draft``) for the state writes of Round._take_draft (tokens, proposal, g,
        log-probability, entropy, depth, log column, the policy's decision); returns True. False (the
        round's torch sequence runs) otherwise."""
        if self.kernels.sampler == "reference" or not self.fused_glue or logits.shape[0] != 1:
            return False
        ids, probs, tok, idx = self._sample_fast(logits.contiguous(), u.float(), s)
        decided = continue_decided(draft, k)
        mode = _round.CONT_RULE if decided is None else (_round.CONT_ALWAYS if decided else _round.CONT_NEVER)
        r = draft.stop_rule
        _round.take_draft(st, ids, probs, tok, idx, g, k, mode, vocab_start=0,
                          log_prob_min=r.log_prob_min, entropy_max=r.entropy_max, log_col=LOG_NEXT_DRAFTS,
                          _logp_bug=self.broken == "draft_logp_bug")
        return True

    def _sample_fast(self, logits: torch.Tensor, u: torch.Tensor, s: SamplingConfig):
        """(ids [T, k] int32 global token ids, probs [T, k] fp32, token [T] int32 global, index [T]
        int32) by the sampler's kernel. Under tensor parallelism (comm.size > 1; rank emulation runs the
        same launches, its exchange a counted no-op) in two stages, as DESIGN.md's "each rank takes a
        local top-20 of its vocabulary slice, candidates are exchanged, every rank selects the same
        token": ``rank_candidates`` (the kernel's top k of this rank's slice), gathered from every rank in
        rank order, then ``sample_candidates`` (the kernel again over the R x k candidates), which gives
        the one launch's ids, probabilities and draw over the whole vocabulary, bit for bit (sampler.py
        says why).
        ``_sampler_options`` tune the first stage (a whole slice), not the second."""
        if self.comm.size == 1:
            return _sampler.sample_topk_topp(logits, u, s.temperature, s.top_k, s.top_p, **self._sampler_options)
        T = logits.shape[0]
        z, ids = _sampler.rank_candidates(logits, u, s.temperature, s.top_k, s.top_p,
                                          vocab_start=self.shard.vocab_start, **self._sampler_options)
        z = self.comm.all_gather(z).permute(1, 0, 2).reshape(T, -1)
        ids = self.comm.all_gather(ids).permute(1, 0, 2).reshape(T, -1)
        return _sampler.sample_candidates(z, ids, u, s.top_k, s.top_p, select=self._sampler_options.get("select"))

    def sample_rows(self, logits: torch.Tensor, u: torch.Tensor | None, s: SamplingConfig):
        """(ids [T, k] int64 global token ids, probs [T, k] fp32, token [T] int64, index [T] int64) of
        the served distribution of each row and its draw with the uniforms u [T] (u None: the draw is
        meaningless, only the distribution is wanted)."""
        T = logits.shape[0]
        if self.kernels.sampler == "reference":
            ids, probs = filter_dist(logits, s.temperature, s.top_k, s.top_p, self.shard.vocab_start, self.comm)
            if u is None:
                return ids, probs, ids[:, 0], torch.zeros_like(ids[:, 0])
            tok, idx = draw(ids, probs, u)
            return ids, probs, tok, idx
        if u is None:
            u = self._u0[:T] if T <= MAX_DECODE_ROWS else torch.zeros(T, device=logits.device)
        ids, probs, tok, idx = self._sample_fast(logits.contiguous(), u.float(), s)
        return ids.long(), probs, tok.long(), idx.long()


def _check_shapes(cfg: ModelConfig, shard: Shard) -> None:
    problems = []
    if cfg.fp8_block != 128:
        problems.append(f"fp8_block {cfg.fp8_block} (the MoE kernel assumes 128)")
    if shard.expert_width % 128:
        problems.append(f"expert width per rank {shard.expert_width} is not a multiple of 128")
    if cfg.head_dim not in (16, 32, 64, 128, 256):
        problems.append(f"head_dim {cfg.head_dim} (attention kernel: a power of two in [16, 256])")
    g = shard.num_heads // max(1, shard.num_kv_heads)
    if MAX_DECODE_ROWS * g > 128:
        problems.append(f"{g} query heads per KV head x 8 rows exceed the attention kernel's 128 rows")
    if cfg.num_experts_per_tok * MAX_DECODE_ROWS > 64:
        problems.append("more than 64 (row, expert) pairs per pass (MoE kernel)")
    if problems:
        raise ConfigError(f"model '{cfg.name}' cannot use the fast backend: " + "; ".join(problems))
