"""The reference model: eager PyTorch, CPU or CUDA, FP32 or BF16 compute. The numerical oracle.

Per layer: RMSNorm → attention (GQA, RoPE, learned per-head sink logit with zero value, sliding ring
or full cache) → residual → RMSNorm → MoE (router → top-k → SwiGLU experts on dequantised E4M3
weights, routing weights renormalised over the chosen k) → residual. The MTP draft layer takes the
target's last hidden state and the embedding of the next token (EH projection of the two normalised
operands), runs one transformer layer with its own router, and shares the LM head.

Two ways to run attention against a cache, chosen by the caller, never by tensor values:
- ``mode="decode"`` (the speculative step, at most 8 rows): write the rows' K/V into the cache, then
  read. On a sliding ring this is only correct because the ring holds window + a pad of slots
  (the property the ring test checks, with a window-sized ring as its negative control).
- ``mode="prefill"`` (any number of rows): sliding layers read the ring's old contents together with
  the chunk's own K/V, then keep the last ring-size rows; full layers read up to the chunk's end.

Nothing here reads a tensor value on the host in decode mode (see :mod:`runtime.nosync`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fp8
from .checkpoint import expert_names, layer_prefix
from .config import ModelConfig, Shard
from .parallel import LocalComm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Small models keep dequantised experts and run every expert densely (a few large GEMMs beat many
# small gathers on CPU); large ones gather and dequantise only the chosen experts each step.
DENSE_MOE_MAX_BYTES = 1 << 30
# Without dense experts, up to this many (row, expert) pairs (a decode: 8 rows x top 8) dequantise each
# pair's weights; more (a prefill) dequantise each chosen expert once (Model._moe_grouped).
GATHER_MOE_MAX_PAIRS = 64
ATTN_SCORE_BUDGET = 1 << 26   # elements of one score block; bounds prefill memory


# --------------------------------------------------------------------------------------------------
# Caches

class KVCache:
    """One attention layer's cache: ``k``/``v`` [kv_heads, slots, head_dim].

    Full layers index slots by position. Sliding layers are a ring of window + pad slots; position p
    lives in slot p % slots and ``labels[slot]`` records which position a slot holds (-1: empty).
    """

    def __init__(self, kind: str, kv_heads: int, slots: int, head_dim: int, dtype, device, window: int = 0):
        self.kind, self.slots, self.window = kind, slots, window
        self.k = torch.zeros(kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.labels = torch.full((slots,), -1, dtype=torch.int64, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "labels": self.labels}


@dataclass
class ModelCache:
    layers: list[KVCache]
    mtp: list[KVCache]

    @property
    def all(self) -> list[KVCache]:
        return self.layers + self.mtp


# --------------------------------------------------------------------------------------------------
# Building blocks

def write_decode(cache: "KVCache", positions: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor):
    """Write the rows' K/V, then return what they read: (keys, values, key positions). Full caches
    are indexed by position; a ring writes position p into slot p % slots and labels the slot."""
    if cache.kind == "full":
        cache.k.index_copy_(1, positions, kt)
        cache.v.index_copy_(1, positions, vt)
        return cache.k, cache.v, torch.arange(cache.slots, device=kt.device)
    slots = positions % cache.slots
    cache.k.index_copy_(1, slots, kt)
    cache.v.index_copy_(1, slots, vt)
    cache.labels.index_copy_(0, slots, positions)
    return cache.k, cache.v, cache.labels


def write_prefill(cache: "KVCache", positions: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor):
    """Prefill chunks may exceed the ring: read the old ring together with the chunk, then keep the
    chunk's last ``slots`` rows. Full caches read only up to the chunk's (host-known) end."""
    if cache.kind == "full":
        cache.k.index_copy_(1, positions, kt)
        cache.v.index_copy_(1, positions, vt)
        end = int(positions[-1]) + 1
        return cache.k[:, :end], cache.v[:, :end], torch.arange(end, device=kt.device)
    keys = torch.cat([cache.k, kt], dim=1)
    vals = torch.cat([cache.v, vt], dim=1)
    kpos = torch.cat([cache.labels, positions])
    n = min(positions.shape[0], cache.slots)
    slots = positions[-n:] % cache.slots
    cache.k.index_copy_(1, slots, kt[:, -n:])
    cache.v.index_copy_(1, slots, vt[:, -n:])
    cache.labels.index_copy_(0, slots, positions[-n:])
    return keys, vals, kpos


def visible_keys(cache: "KVCache", kpos: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """[T, S] bool: causal for full layers; the last ``window`` positions for sliding layers."""
    k, q = kpos[None, :], qpos[:, None]
    if cache.kind == "full":
        return k <= q
    return (k >= 0) & (k <= q) & (k > q - cache.window)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, d]. Angles in float64: at 192K positions a float32 angle is off
    by ~1e-2 rad."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
           sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a sink: out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink_h}), in FP32.

    q [T, nh, d]; k, v [nkv, S, d]; visible [T, S] bool; sinks [nh]. Query head h reads KV head
    h // (nh / nkv). Returns [T, nh, d] in q's dtype."""
    T, nh, d = q.shape
    nkv, S, _ = k.shape
    g = nh // nkv
    qg = q.float().view(T, nkv, g, d).permute(1, 2, 0, 3)                # [nkv, g, T, d]
    kf, vf = k.float()[:, None], v.float()[:, None]                       # [nkv, 1, S, d]
    s = (qg @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(d))                # [nkv, g, T, S]
    s = s.masked_fill(~visible[None, None], float("-inf"))
    sink = sinks.float().view(nkv, g, 1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)
    e = torch.exp(s - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    o = (e @ vf) / den                                                    # [nkv, g, T, d]
    return o.permute(2, 0, 1, 3).reshape(T, nh, d).to(q.dtype)


def attend_chunked(q, k, v, visible_fn, sinks) -> torch.Tensor:
    """:func:`attend` over query chunks so that a score block stays under ATTN_SCORE_BUDGET."""
    T, nh, _ = q.shape
    S = k.shape[1]
    step = max(1, ATTN_SCORE_BUDGET // max(1, nh * S))
    if step >= T:
        return attend(q, k, v, visible_fn(0, T), sinks)
    return torch.cat([attend(q[a:a + step], k, v, visible_fn(a, min(T, a + step)), sinks)
                      for a in range(0, T, step)], dim=0)


# --------------------------------------------------------------------------------------------------
# Weights

@dataclass
class LayerWeights:
    kind: str
    ln1: torch.Tensor
    ln2: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    sinks: torch.Tensor          # fp32 [local heads]
    router: torch.Tensor         # bf16 [E, H]
    w13: torch.Tensor            # e4m3 [E, 2I, H]: Gate rows then Up rows
    s13: torch.Tensor            # fp32 [E, 2I/b, ceil(H/b)]
    w2: torch.Tensor             # e4m3 [E, H, I]
    s2: torch.Tensor             # fp32 [E, ceil(H/b), I/b]
    dq13: torch.Tensor | None = None   # dequantised copies (dense MoE mode only)
    dq2: torch.Tensor | None = None


@dataclass
class MTPWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh: torch.Tensor
    head_norm: torch.Tensor
    layer: LayerWeights


def _views_of(base, parts: list[list[torch.Tensor]]) -> bool:
    """Whether ``parts[e][j]`` are exactly the row blocks of the stacked tensor ``base`` that
    ``stacked_experts`` made (expert e, parts one after another along dim 1)."""
    if base is None or not base.is_contiguous() or base.shape[0] != len(parts):
        return False
    for e, row in enumerate(parts):
        off = 0
        for x in row:
            if (x._base is not base or tuple(x.shape[1:]) != tuple(base.shape[2:])
                    or off + x.shape[0] > base.shape[1] or x.data_ptr() != base[e, off].data_ptr()):
                return False
            off += x.shape[0]
        if off != base.shape[1]:
            return False
    return True


def stacked_experts(t: dict, names: list[list[str]], device) -> torch.Tensor:
    """The experts' parts stacked: [E, rows of part 0 + rows of part 1 + ..., ...] on ``device``, for
    ``names[e]`` = the tensor names of expert e's parts (e.g. gate and up).

    The stacked tensor is shared through ``t``. Whoever stacks first points the dict's per-expert entries
    at views of the result, which frees the originals. A later model over the same dict (the replay's arms
    share one) finds those views and stacks nothing. So the experts are held once, not once in the dict
    plus once per model: q1's rank shard is 50 GiB of them."""
    parts = [[t[n] for n in row] for row in names]
    base = parts[0][0]._base
    if _views_of(base, parts):
        return base.to(device)
    stacked = torch.cat([torch.stack([row[j] for row in parts]) for j in range(len(parts[0]))], dim=1).to(device)
    for e, row in enumerate(names):
        off = 0
        for j, n in enumerate(row):
            rows = parts[e][j].shape[0]
            t[n] = stacked[e, off:off + rows]
            off += rows
    return stacked


def _layer_weights(cfg: ModelConfig, t: dict, i: int, kind: str, dtype, device) -> LayerWeights:
    p = layer_prefix(i)

    def dense(name):
        return t[p + name].to(device=device, dtype=dtype)

    ns = [expert_names(cfg, i, e) for e in range(cfg.num_experts)]
    w13 = stacked_experts(t, [[n["gate_proj"], n["up_proj"]] for n in ns], device)
    s13 = stacked_experts(t, [[n["gate_proj"] + "_scale_inv", n["up_proj"] + "_scale_inv"] for n in ns], device)
    w2 = stacked_experts(t, [[n["down_proj"]] for n in ns], device)
    s2 = stacked_experts(t, [[n["down_proj"] + "_scale_inv"] for n in ns], device)
    return LayerWeights(
        kind=kind, ln1=dense("input_layernorm.weight"), ln2=dense("post_attention_layernorm.weight"),
        wq=dense("self_attn.q_proj.weight"), wk=dense("self_attn.k_proj.weight"),
        wv=dense("self_attn.v_proj.weight"), wo=dense("self_attn.o_proj.weight"),
        sinks=t[p + "self_attn.sinks"].to(device=device, dtype=torch.float32),
        router=t[p + "mlp.gate.weight"].to(device=device, dtype=torch.bfloat16),
        w13=w13, s13=s13, w2=w2, s2=s2)


# --------------------------------------------------------------------------------------------------
class Model:
    """One rank's shard of the model plus the forward functions of the reference backend."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], shard: Shard,
                 dtype: str = "float32", device="cpu", comm=None, dense_moe: bool | None = None):
        self.cfg, self.shard, self.device = cfg, shard, torch.device(device)
        self.dtype = DTYPES[dtype]
        self.comm = comm or LocalComm()
        dt, dev = self.dtype, self.device
        self.embed = tensors["model.embed_tokens.weight"].to(device=dev, dtype=dt)
        self.final_norm = tensors["model.norm.weight"].to(device=dev, dtype=dt)
        self.lm_head = tensors["lm_head.weight"].to(device=dev, dtype=dt)
        self.layers = [_layer_weights(cfg, tensors, i, cfg.layer_type(i), dt, dev) for i in range(cfg.num_layers)]
        self.mtp = []
        for j in range(cfg.mtp_layers):
            i = cfg.num_layers + j
            p = layer_prefix(i)
            self.mtp.append(MTPWeights(
                enorm=tensors[p + "enorm.weight"].to(device=dev, dtype=dt),
                hnorm=tensors[p + "hnorm.weight"].to(device=dev, dtype=dt),
                eh=tensors[p + "eh_proj.weight"].to(device=dev, dtype=dt),
                head_norm=tensors[p + "shared_head.norm.weight"].to(device=dev, dtype=dt),
                layer=_layer_weights(cfg, tensors, i, cfg.mtp_attention, dt, dev)))
        all_layers = self.layers + [m.layer for m in self.mtp]
        expert_bytes = sum(lw.w13.numel() + lw.w2.numel() for lw in all_layers) * torch.tensor([], dtype=dt).element_size()
        self.dense_moe = expert_bytes <= DENSE_MOE_MAX_BYTES if dense_moe is None else dense_moe
        if self.dense_moe:
            b = cfg.fp8_block
            for lw in all_layers:
                lw.dq13 = fp8.dequantize(lw.w13, lw.s13, b, dt)
                E, I2, H = lw.dq13.shape
                lw.dq13 = lw.dq13.reshape(E * I2, H)
                lw.dq2 = fp8.dequantize(lw.w2, lw.s2, b, dt).permute(0, 2, 1).reshape(-1, H).contiguous()

    def check_peers(self) -> None:
        """Raises if a fused collective failed (the fast backend's fused all-reduce); nothing here."""

    # ---- caches -----------------------------------------------------------------------------------
    def new_cache(self, capacity: int, dtype=None) -> ModelCache:
        """Full layers get ``capacity`` slots; sliding layers a ring of window + pad slots."""
        cfg, dt = self.cfg, dtype or self.dtype

        def make(kind):
            slots = capacity if kind == "full" else cfg.ring_slots
            return KVCache(kind, self.shard.num_kv_heads, slots, cfg.head_dim, dt, self.device, cfg.sliding_window)

        return ModelCache([make(lw.kind) for lw in self.layers], [make(m.layer.kind) for m in self.mtp])

    # ---- pieces -------------------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The tokens' embedding rows (all-reduced over the ranks' vocabulary slices; ``reduce=False``:
        this rank's slice only, zero rows for the others' tokens)."""
        local = tokens - self.shard.vocab_start
        inside = (local >= 0) & (local < self.shard.vocab_size)
        e = self.embed[local.clamp(0, self.shard.vocab_size - 1)] * inside[:, None].to(self.dtype)
        return self.comm.all_reduce(e) if self.shard.tp_size > 1 and reduce else e

    def attention(self, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                  mode: str) -> torch.Tensor:
        cfg, sh = self.cfg, self.shard
        T, d = x.shape[0], cfg.head_dim
        q = rope((x @ lw.wq.T).view(T, sh.num_heads, d), positions, cfg.rope_theta)
        k = rope((x @ lw.wk.T).view(T, sh.num_kv_heads, d), positions, cfg.rope_theta)
        v = (x @ lw.wv.T).view(T, sh.num_kv_heads, d)
        kt, vt = k.transpose(0, 1).to(cache.k.dtype), v.transpose(0, 1).to(cache.v.dtype)
        if mode == "decode":
            keys, vals, kpos = write_decode(cache, positions, kt, vt)
        else:
            keys, vals, kpos = write_prefill(cache, positions, kt, vt)

        def visible(a, b):
            return visible_keys(cache, kpos, positions[a:b])
        o = attend_chunked(q, keys, vals, visible, lw.sinks)
        out = o.reshape(T, -1) @ lw.wo.T
        return self.comm.all_reduce(out) if sh.tp_size > 1 else out

    def route(self, lw: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] fp32 renormalised over the chosen k). FP32 router logits
        from the BF16-rounded normalised input."""
        logits = x.to(torch.bfloat16).float() @ lw.router.float().T
        top, ids = logits.topk(self.cfg.num_experts_per_tok, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def moe(self, lw: LayerWeights, x: torch.Tensor, ids: torch.Tensor | None = None,
            weights: torch.Tensor | None = None) -> torch.Tensor:
        if ids is None:
            ids, weights = self.route(lw, x)
        T, H = x.shape
        E, I = lw.w2.shape[0], lw.w2.shape[2]
        if lw.dq13 is not None:
            out = []
            rows = max(1, (1 << 24) // (E * 2 * I))
            for a in range(0, T, rows):
                xa = x[a:a + rows]
                h = (xa @ lw.dq13.T).view(xa.shape[0], E, 2 * I)
                act = F.silu(h[..., :I]) * h[..., I:]
                gate = torch.zeros(xa.shape[0], E, device=x.device, dtype=torch.float32)
                gate.scatter_(1, ids[a:a + rows], weights[a:a + rows])
                act = act * gate.to(act.dtype)[..., None]
                out.append(act.reshape(xa.shape[0], E * I) @ lw.dq2)
            y = torch.cat(out) if len(out) > 1 else out[0]
        elif ids.numel() <= GATHER_MOE_MAX_PAIRS:
            y = self._moe_gathered(lw, x, ids, weights)
        else:
            y = self._moe_grouped(lw, x, ids, weights)
        return self.comm.all_reduce(y) if self.shard.tp_size > 1 else y

    def _moe_gathered(self, lw: LayerWeights, x, ids, weights) -> torch.Tensor:
        """Each (row, expert) pair's weights dequantised on their own: a decode's few rows."""
        b, I = self.cfg.fp8_block, lw.w2.shape[2]
        w13 = fp8.dequantize(lw.w13[ids], lw.s13[ids], b, self.dtype)      # [T, k, 2I, H]
        h = torch.einsum("th,tkoh->tko", x, w13)
        act = F.silu(h[..., :I]) * h[..., I:]
        w2 = fp8.dequantize(lw.w2[ids], lw.s2[ids], b, self.dtype)         # [T, k, H, I]
        return torch.einsum("tki,tkhi,tk->th", act, w2, weights.to(self.dtype))

    def _moe_grouped(self, lw: LayerWeights, x, ids, weights) -> torch.Tensor:
        """A prefill's many rows: each chosen expert dequantised once and applied to all its rows, so
        the memory is one expert's, not T x k of them (q1's shard: 192 MiB a row the other way). The
        same sums as ``_moe_gathered`` up to the order of additions (reads the chosen ids on the host:
        prefill only, never a captured piece)."""
        b, I = self.cfg.fp8_block, lw.w2.shape[2]
        y = torch.zeros(x.shape[0], x.shape[1], dtype=self.dtype, device=x.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            h = x[rows] @ fp8.dequantize(lw.w13[e], lw.s13[e], b, self.dtype).T          # [n, 2I]
            act = F.silu(h[:, :I]) * h[:, I:]
            ye = act @ fp8.dequantize(lw.w2[e], lw.s2[e], b, self.dtype).T             # [n, H]
            y.index_add_(0, rows, ye * weights[rows, slot].to(self.dtype)[:, None])
        return y

    def block(self, lw: LayerWeights, x, positions, cache, mode) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        x = x + self.attention(lw, rms_norm(x, lw.ln1, eps), positions, cache, mode)
        return x + self.moe(lw, rms_norm(x, lw.ln2, eps))

    # ---- whole passes ------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: ModelCache,
                mode: str = "decode") -> torch.Tensor:
        """Target pass over rows; writes their K/V. Returns the last hidden state [T, H] (pre-norm)."""
        x = self.embed_tokens(tokens)
        for lw, c in zip(self.layers, cache.layers):
            x = self.block(lw, x, positions, c, mode)
        return x

    def logits(self, hidden: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [T, V_local], FP32."""
        h = rms_norm(hidden, self.final_norm if norm is None else norm, self.cfg.rms_norm_eps)
        return (h @ self.lm_head.T).float()

    def mtp_forward(self, hidden_prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    cache: ModelCache, mode: str = "decode", j: int = 0) -> torch.Tensor:
        """Draft layer j: row t combines the hidden state that predicted token t with token t's
        embedding and predicts token t+1. Returns the draft hidden state [T, H] (pre-norm)."""
        m, eps = self.mtp[j], self.cfg.rms_norm_eps
        e = rms_norm(self.embed_tokens(tokens), m.enorm, eps)
        h = rms_norm(hidden_prev.to(self.dtype), m.hnorm, eps)
        x = torch.cat([e, h], dim=-1) @ m.eh.T
        return self.block(m.layer, x, positions, cache.mtp[j], mode)

    def mtp_logits(self, g: torch.Tensor, j: int = 0) -> torch.Tensor:
        return self.logits(g, self.mtp[j].head_norm)

    def prefill(self, tokens: torch.Tensor, cache: ModelCache, start: int = 0, chunk: int = 1024) -> torch.Tensor:
        """Target prefill of ``tokens`` at positions start.. in chunks; returns hidden states [T, H]."""
        out = []
        for a in range(0, tokens.shape[0], chunk):
            t = tokens[a:a + chunk]
            pos = torch.arange(start + a, start + a + t.shape[0], device=self.device)
            out.append(self.forward(t, pos, cache, mode="prefill"))
        return torch.cat(out)

    def mtp_prefill(self, hidden_prev: torch.Tensor, tokens: torch.Tensor, cache: ModelCache,
                    start: int, chunk: int = 1024, j: int = 0) -> torch.Tensor:
        out = []
        for a in range(0, tokens.shape[0], chunk):
            t = tokens[a:a + chunk]
            pos = torch.arange(start + a, start + a + t.shape[0], device=self.device)
            out.append(self.mtp_forward(hidden_prev[a:a + chunk], t, pos, cache, mode="prefill", j=j))
        return torch.cat(out)
