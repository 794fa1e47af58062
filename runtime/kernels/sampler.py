"""Top-k / top-p sampler for the decode round: one program per row, given uniform numbers.

Semantics (``sample_reference`` is the definition): probs = softmax(logits / T) over the whole
vocabulary; the top_k largest (ties -> lower token id first), sorted descending; renormalised to
sum 1; cumulative sum c; token i of that list is kept iff c_i - p_i < top_p (the first always is);
the kept ones renormalised (the others get probability 0 but stay in the list); the draw is the
first kept i with u < cumsum(kept)_i (the last kept one if rounding leaves none).

Algorithm (``_sample_kernel``, grid (w,), program = one row)
-----------------------------------------------------------
The renormalised top-k distribution only needs the top-k scaled logits z = logits / T:
p_i = exp(z_i - z_0) / sum_{j<k} exp(z_j - z_0); the full-vocabulary softmax denominator cancels.
So the program selects the top-k of z exactly and never exponentiates the vocabulary.

* Keys: each element becomes one int64 key, (order-preserving bits of z) << 32 | (2^31 - 1 - id):
  keys are distinct, larger key = larger z, and equal z order the lower id first.
* Pass 1 (chunk maxima): the vocabulary is cut into NCH strided chunks (chunk j = ids j, j + NCH,
  j + 2 NCH, ...), so the pass streams contiguous tiles of TILE_ROWS x NCH elements (TILE_ROWS *
  NCH ~ TILE_ELEMS = 4,096) and keeps one running maximum key per chunk in registers.
* The top-k elements lie in the k chunks with the largest maxima (the maxima of those k chunks are
  k distinct elements at least as large as anything in any other chunk), so every other chunk is
  skipped. k max-reductions pick those chunks (or a bitonic ``tl.topk``, ``bitonic=True``).
* Pass 2: gather the k chunks' members (k x NT keys, NT = ceil(V / NCH)) from L1/L2 and take their
  top-k the same way: the exact global top-k, sorted descending.
* Top-p and the draw on the k values in FP32 (cumsums over a 32-wide vector), then the row's
  outputs: ids [k], filtered probabilities [k], token, index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, launch_signature, next_pow2

# Elements per pass-1 step (TILE_ROWS x NCH): 4,096 FP32 = 16 KiB of loads in flight per program
# (keyword tile_elems). Session 18, H200, 8 x 20,000 in one run: 4,096 20.0 us, 8,192 (the default
# until then) 22.6 us, 16,384 28.1 us (each step's int64 keys live in registers); 8 x 4,096: equal.
TILE_ELEMS = 4096
NUM_WARPS = 8
# Selection of the top K keys: bitonic tl.topk (True) or K max-reductions (False). Measured on the
# H200 (experiments/notes/kernels.md): max-reductions 22.7 us vs bitonic 34.6 us at 8 x 20,000.
SELECT_BITONIC = False
_KEY_MIN = tl.constexpr(-(2 ** 63))


def _chunk_count(V: int) -> int:
    """Strided chunk count: ~V/32 chunks (so k chunks hold ~k*32 candidates), between 32 and 4,096."""
    return min(4096, max(32, next_pow2(V) // 32))


@triton.jit
def _keys(z, idx):
    b = z.to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _scaled(l, T):
    # IEEE division, and + 0.0 turns -0.0 into +0.0 so that equal values get equal keys.
    return tl.math.div_rn(l.to(tl.float32), T) + 0.0


@triton.jit
def _topk_iterative(x, KP: tl.constexpr, K: tl.constexpr):
    """Top K of distinct int64 keys by K max-reductions (alternative to the bitonic ``tl.topk``)."""
    offs = tl.arange(0, KP)
    out = tl.full([KP], _KEY_MIN, tl.int64)
    for i in tl.static_range(K):
        m = tl.max(x, 0)
        out = tl.where(offs == i, m, out)
        x = tl.where(x == m, _KEY_MIN, x)
    return out


@triton.jit
def _select(x, KP: tl.constexpr, K: tl.constexpr, BITONIC: tl.constexpr):
    if BITONIC:
        r = tl.topk(x, KP)
    else:
        r = _topk_iterative(x, KP, K)
    return r


@triton.jit(launch_metadata=launch_signature)
def _sample_kernel(
    LOGITS, U, TEMP, IDS, PROBS, TOKEN, INDEX,
    stride_l, stride_ids, stride_probs, temp_value, top_p,
    V: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NCH: tl.constexpr, NT_PAD: tl.constexpr,
    TILE_ROWS: tl.constexpr, TEMP_IS_PTR: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
    TOPP_BUG: tl.constexpr, BITONIC: tl.constexpr,
):
    row = tl.program_id(0)
    if TEMP_IS_PTR:
        if TEMP_PER_ROW:
            T = tl.load(TEMP + row).to(tl.float32)
        else:
            T = tl.load(TEMP).to(tl.float32)
    else:
        T = temp_value
    base = LOGITS + row.to(tl.int64) * stride_l

    # Pass 1: running maximum key per strided chunk.
    offs_c = tl.arange(0, NCH)
    best = tl.full([NCH], _KEY_MIN, tl.int64)
    NT: tl.constexpr = (V + NCH - 1) // NCH
    for t0 in range(0, NT, TILE_ROWS):
        idx = (t0 + tl.arange(0, TILE_ROWS))[:, None] * NCH + offs_c[None, :]
        ok = idx < V
        z = _scaled(tl.load(base + idx, mask=ok, other=0.0), T)
        key = tl.where(ok, _keys(z, idx), _KEY_MIN)
        best = tl.maximum(best, tl.max(key, 0))

    # The K chunks with the largest maxima hold the top K elements.
    top_chunks = _select(best, KP, K, BITONIC)
    offs_k = tl.arange(0, KP)
    chunk = (0x7FFFFFFF - top_chunks.to(tl.int32)) % NCH
    chunk_ok = (offs_k < K) & (top_chunks != _KEY_MIN)

    # Pass 2: exact top K among their members.
    cidx = tl.arange(0, NT_PAD)[None, :] * NCH + chunk[:, None]
    cok = chunk_ok[:, None] & (cidx < V)
    z = _scaled(tl.load(base + cidx, mask=cok, other=0.0), T)
    ckey = tl.where(cok, _keys(z, cidx), _KEY_MIN)
    top = _select(tl.reshape(ckey, [KP * NT_PAD]), KP, K, BITONIC)

    ids = 0x7FFFFFFF - top.to(tl.int32)
    hi = (top >> 32).to(tl.int32)
    zt = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)
    valid = offs_k < K
    z0 = tl.max(tl.where(valid, zt, float("-inf")), 0)
    e = tl.where(valid, tl.exp(zt - z0), 0.0)
    p = e / tl.sum(e, 0)
    c = tl.cumsum(p, 0)
    if TOPP_BUG:
        keep = valid & (c < top_p)
    else:
        keep = valid & ((c - p) < top_p)
    q = tl.where(keep, p, 0.0)
    q = q / tl.sum(q, 0)
    cq = tl.cumsum(q, 0)
    u = tl.load(U + row).to(tl.float32)
    hit = keep & (u < cq)
    first = tl.min(tl.where(hit, offs_k, KP), 0)
    last_kept = tl.max(tl.where(keep, offs_k, -1), 0)
    chosen = tl.where(first < KP, first, last_kept)
    token = tl.sum(tl.where(offs_k == chosen, ids, 0), 0)
    tl.store(IDS + row * stride_ids + offs_k, ids, mask=valid)
    tl.store(PROBS + row * stride_probs + offs_k, q, mask=valid)
    tl.store(TOKEN + row, token)
    tl.store(INDEX + row, chosen)


def sample_topk_topp(logits, u, temperature, top_k=20, top_p=0.95, *, out=None, _topp_bug=False,
                     bitonic=None, nch=None, tile_elems=None, num_warps=None):
    """Sample one token per row. logits [w, V] fp32 or bf16; u [w] fp32 in [0, 1); temperature a
    Python number or a device tensor (one value, or [w]). Returns (ids [w, top_k] int32 sorted by
    probability, probs [w, top_k] fp32 filtered and renormalised, token [w] int32, index [w] int32).
    ``out`` may pass those four tensors preallocated. No host synchronisation.
    ``_topp_bug`` is the tests' negative control (keeps one token too few). Tuning (same outputs for
    any value): ``nch`` strided chunks (a power of two, default ``_chunk_count(V)``), ``tile_elems``
    elements per pass-1 step (default TILE_ELEMS), ``num_warps`` (default NUM_WARPS).
    """
    check(logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16, torch.float16),
          "logits [w, V] fp32/bf16/fp16")
    w, V = logits.shape
    check(logits.stride(1) == 1, "logits rows must be contiguous")
    check(1 <= top_k <= 32 and V >= top_k, "1 <= top_k <= 32 and V >= top_k")
    check(u.shape == (w,) and u.device == logits.device, "u [w] on the device of logits")
    temp_is_ptr = isinstance(temperature, torch.Tensor)
    per_row = False
    if temp_is_ptr:
        check(temperature.numel() in (1, w) and temperature.device == logits.device,
              "temperature tensor: one value or [w], on the device of logits")
        per_row = temperature.numel() == w and w > 1
        temp_value = 1.0
    else:
        temp_value = float(temperature)
        check(temp_value > 0, "temperature > 0")
    dev = logits.device
    if out is None:
        out = (torch.empty((w, top_k), device=dev, dtype=torch.int32),
               torch.empty((w, top_k), device=dev, dtype=torch.float32),
               torch.empty((w,), device=dev, dtype=torch.int32),
               torch.empty((w,), device=dev, dtype=torch.int32))
    ids, probs, token, index = out
    nch = int(nch or _chunk_count(V))
    check(nch == next_pow2(nch) and nch >= 2, "nch: a power of two >= 2")
    nt_pad = next_pow2(triton.cdiv(V, nch))
    tile_rows = max(1, min(nt_pad, int(tile_elems or TILE_ELEMS) // nch))
    kp = max(2, next_pow2(top_k))
    _sample_kernel[(w,)](
        logits, u, temperature if temp_is_ptr else u, ids, probs, token, index,
        logits.stride(0), ids.stride(0), probs.stride(0), temp_value, float(top_p),
        V=V, K=top_k, KP=kp, NCH=nch, NT_PAD=nt_pad, TILE_ROWS=tile_rows,
        TEMP_IS_PTR=temp_is_ptr, TEMP_PER_ROW=per_row, TOPP_BUG=_topp_bug,
        BITONIC=SELECT_BITONIC if bitonic is None else bitonic,
        num_warps=int(num_warps or NUM_WARPS),
    )
    return ids, probs, token, index


def sample_reference(logits, u, temperature, top_k=20, top_p=0.95):
    """The definition, in torch FP32 (any device). Same outputs as ``sample_topk_topp``."""
    w, V = logits.shape
    t = temperature
    if isinstance(t, torch.Tensor):
        t = t.float().reshape(-1, 1) if t.numel() == w and w > 1 else t.float().reshape(1, 1)
    probs = torch.softmax(logits.float() / t, dim=-1)
    sp, si = torch.sort(probs, dim=-1, descending=True, stable=True)
    p = sp[:, :top_k]
    ids = si[:, :top_k]
    p = p / p.sum(-1, keepdim=True)
    c = torch.cumsum(p, -1)
    keep = (c - p) < top_p
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum(-1, keepdim=True)
    cq = torch.cumsum(q, -1)
    k = torch.arange(top_k, device=logits.device).expand(w, top_k)
    hit = keep & (u.float()[:, None] < cq)
    first = torch.where(hit, k, torch.full_like(k, top_k)).amin(-1)
    last_kept = torch.where(keep, k, torch.full_like(k, -1)).amax(-1)
    chosen = torch.where(first < top_k, first, last_kept)
    token = ids.gather(1, chosen[:, None])[:, 0]
    return ids.int(), q, token.int(), chosen.int()
