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
  skipped. k max-reductions pick those chunks (or a bitonic ``tl.topk``, ``select="bitonic"``).
* Pass 2: gather the k chunks' members (k x NT keys, NT = ceil(V / NCH)) from L1/L2 and take their
  top-k the same way: the exact global top-k, sorted descending.
* Top-p and the draw on the k values in FP32 (cumsums over a 32-wide vector), then the row's
  outputs: ids [k], filtered probabilities [k], token, index.

Selection by ranks (``select="rank"``, the default since session 36). The two selections above were
k max-reductions each (2k block-wide reductions in series: most of the kernel's 13-20 us on the H200).
Ranks replace them: rank_i = #{j : key_j > key_i} from one compare-all tile, and slot r < k of the
sorted top k is the key whose rank is r (one more reduction). That costs N^2 compares, so it runs on
small sets only (``_topk_threshold``, the same for both passes):
* N <= RANK_N = 128 keys (pass 1 with NCH <= 128 chunk maxima) are ranked directly;
* otherwise the keys are cut into groups (pass 2: the KP gathered chunks; pass 1: RANK_GROUPS = 64 runs
  of NCH / 64 chunk maxima) and the groups' maxima ranked. The k-th largest group maximum t is a lower
  bound of the k-th largest key (the k largest group maxima are k keys >= t), so the top k are the
  top k of the keys >= t. Those (usually k to ~2k of them) are compacted into CMAX = 64 scratch
  slots per row and pass (an inclusive scan gives each its slot; stored, a CTA barrier, loaded back)
  and ranked there. More than CMAX keys >= t (many equal or clustered values) falls back to the k
  max-reductions over all N. Same outputs in every case (the tests force each path in turn, and a
  clustered input makes the compacted path wrong when forced: its negative control).
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
# Selection of the top K keys (keyword ``select``): "rank" (ranks from compare-all tiles, pass 2 over
# the members above a threshold; module doc), "max" (K max-reductions) or "bitonic" (tl.topk). Measured
# on the H200 (experiments/notes/kernels.md): max-reductions 22.7 us vs bitonic 34.6 us at 8 x 20,000
# (session 9); rank: session 36.
SELECT = "rank"
SELECTS = ("rank", "max", "bitonic")
RANK_N = 128            # at most this many keys are ranked directly (a RANK_N^2 compare tile) ...
RANK_GROUPS = 64        # ... more are cut into this many groups (pass 1; sm_90 compile at 20,000 x 8 rows:
                        # 64-113 registers, against 166-255 with 128 groups, whose BF16 control spilled)
CMAX = 64               # the keys above a threshold compacted and ranked (a CMAX^2 compare tile)
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
def _topk_rank(x, KP: tl.constexpr, K: tl.constexpr):
    """The same as ``_topk_iterative`` for distinct keys (``_KEY_MIN`` = absent), from ranks:
    rank_i = #{j present : x_j > x_i}; slot r < K holds the key of rank r (``_KEY_MIN`` if none)."""
    ok = x != _KEY_MIN
    rank = tl.sum(((x[None, :] > x[:, None]) & ok[None, :]).to(tl.int32), 1)
    slots = tl.arange(0, KP)
    hit = (rank[:, None] == slots[None, :]) & ok[:, None] & (slots[None, :] < K)
    return tl.max(tl.where(hit, x[:, None], _KEY_MIN), 0)


@triton.jit
def _select(x, KP: tl.constexpr, K: tl.constexpr, BITONIC: tl.constexpr):
    if BITONIC:
        r = tl.topk(x, KP)
    else:
        r = _topk_iterative(x, KP, K)
    return r


@triton.jit
def _topk_threshold(x, N: tl.constexpr, G: tl.constexpr, KP: tl.constexpr, K: tl.constexpr, scr,
                    CMAX_: tl.constexpr, FORCE: tl.constexpr):
    """Sorted top K of the N distinct keys x (``_KEY_MIN`` = absent), as ``_topk_iterative``: ranked
    directly when N <= RANK_N (G == 0); else through the K-th largest maximum t of N / G groups of G
    consecutive keys: the keys >= t compacted into ``scr`` [CMAX_] and ranked (module doc). FORCE
    (tests): 1 compacts whatever their count (wrong beyond CMAX_: the negative control), 2 falls back."""
    if G == 0:
        top = _topk_rank(x, KP, K)
    else:
        top_g = _topk_rank(tl.max(tl.reshape(x, [N // G, G]), 1), KP, K)
        t = tl.max(tl.where(tl.arange(0, KP) == K - 1, top_g, _KEY_MIN), 0)
        sel = (x >= t) & (x != _KEY_MIN)
        n = tl.sum(sel.to(tl.int32), 0)
        if FORCE == 1:
            compact = n >= 0
        elif FORCE == 2:
            compact = n < 0
        else:
            compact = n <= CMAX_
        if compact:
            slot = tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(scr + slot, x, mask=sel & (slot < CMAX_))
            tl.debug_barrier()     # the CTA's stores before its loads (bar.sync orders global memory too)
            offs = tl.arange(0, CMAX_)
            top = _topk_rank(tl.load(scr + offs, mask=offs < n, other=_KEY_MIN), KP, K)
        else:
            top = _topk_iterative(x, KP, K)
    return top


@triton.jit(launch_metadata=launch_signature)
def _sample_kernel(
    LOGITS, U, TEMP, IDS, PROBS, TOKEN, INDEX, SCR,
    stride_l, stride_ids, stride_probs, temp_value, top_p,
    V: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, NCH: tl.constexpr, NT_PAD: tl.constexpr,
    TILE_ROWS: tl.constexpr, TEMP_IS_PTR: tl.constexpr, TEMP_PER_ROW: tl.constexpr,
    TOPP_BUG: tl.constexpr, BITONIC: tl.constexpr, RANK: tl.constexpr, G1: tl.constexpr,
    CMAX_: tl.constexpr, FORCE: tl.constexpr,
    CAND: tl.constexpr = False, vocab_start=0, MAP=None, stride_map=0, MAPPED: tl.constexpr = False,
):
    """RANK: both selections by ``_topk_threshold`` (pass 1's groups of G1 chunk maxima, 0: ranked
    directly; pass 2's groups: the gathered chunks), else by ``_select``; FORCE: its tests' switch.
    CAND (``rank_candidates``): IDS gets the top K's global ids (+ vocab_start) and PROBS their z;
    MAPPED (``sample_candidates``): the row's ids are indices into MAP's row of global ids."""
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
    scr = SCR + row * (2 * CMAX_)
    if RANK:
        top_chunks = _topk_threshold(best, NCH, G1, KP, K, scr, CMAX_, FORCE)
    else:
        top_chunks = _select(best, KP, K, BITONIC)
    offs_k = tl.arange(0, KP)
    chunk = (0x7FFFFFFF - top_chunks.to(tl.int32)) % NCH
    chunk_ok = (offs_k < K) & (top_chunks != _KEY_MIN)

    # Pass 2: exact top K among their members.
    cidx = tl.arange(0, NT_PAD)[None, :] * NCH + chunk[:, None]
    cok = chunk_ok[:, None] & (cidx < V)
    z = _scaled(tl.load(base + cidx, mask=cok, other=0.0), T)
    ckey = tl.reshape(tl.where(cok, _keys(z, cidx), _KEY_MIN), [KP * NT_PAD])
    if RANK:
        top = _topk_threshold(ckey, KP * NT_PAD, NT_PAD, KP, K, scr + CMAX_, CMAX_, FORCE)
    else:
        top = _select(ckey, KP, K, BITONIC)

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
    if MAPPED:
        ids = tl.load(MAP + row * stride_map + ids, mask=valid, other=0)
    token = tl.sum(tl.where(offs_k == chosen, ids, 0), 0)
    if CAND:
        tl.store(IDS + row * stride_ids + offs_k, ids + vocab_start, mask=valid)
        tl.store(PROBS + row * stride_probs + offs_k, zt, mask=valid)
    else:
        tl.store(IDS + row * stride_ids + offs_k, ids, mask=valid)
        tl.store(PROBS + row * stride_probs + offs_k, q, mask=valid)
    tl.store(TOKEN + row, token)
    tl.store(INDEX + row, chosen)


def sample_topk_topp(logits, u, temperature, top_k=20, top_p=0.95, *, out=None, _topp_bug=False,
                     select=None, nch=None, tile_elems=None, num_warps=None, _force=0, _cand=None, _map=None):
    """Sample one token per row. logits [w, V] fp32 or bf16; u [w] fp32 in [0, 1); temperature a
    Python number or a device tensor (one value, or [w]). Returns (ids [w, top_k] int32 sorted by
    probability, probs [w, top_k] fp32 filtered and renormalised, token [w] int32, index [w] int32).
    ``out`` may pass those four tensors preallocated. No host synchronisation.
    ``_topp_bug`` is the tests' negative control (keeps one token too few); ``_force`` forces the
    rank selection's path (1: compacted, 2: fallback; module doc). Tuning (same outputs for any
    value): ``select`` (SELECTS, default SELECT),
    ``nch`` strided chunks (a power of two, default ``_chunk_count(V)``), ``tile_elems``
    elements per pass-1 step (default TILE_ELEMS), ``num_warps`` (default NUM_WARPS).
    ``_cand`` (vocab_start) and ``_map`` (global ids [w, V] int32): ``rank_candidates``' and
    ``sample_candidates``' modes.
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
    select = select or SELECT
    check(select in SELECTS, f"select: one of {SELECTS}")
    nch = int(nch or _chunk_count(V))
    check(nch == next_pow2(nch) and nch >= 2, "nch: a power of two >= 2")
    nt_pad = next_pow2(triton.cdiv(V, nch))
    tile_rows = max(1, min(nt_pad, int(tile_elems or TILE_ELEMS) // nch))
    kp = max(2, next_pow2(top_k))
    rank = select == "rank"
    scr = torch.empty((w, 2 * CMAX) if rank else (1,), device=dev, dtype=torch.int64)
    g1 = 0 if nch <= RANK_N else nch // RANK_GROUPS
    _sample_kernel[(w,)](
        logits, u, temperature if temp_is_ptr else u, ids, probs, token, index, scr,
        logits.stride(0), ids.stride(0), probs.stride(0), temp_value, float(top_p),
        V=V, K=top_k, KP=kp, NCH=nch, NT_PAD=nt_pad, TILE_ROWS=tile_rows,
        TEMP_IS_PTR=temp_is_ptr, TEMP_PER_ROW=per_row, TOPP_BUG=_topp_bug,
        BITONIC=select == "bitonic", RANK=rank, G1=g1, CMAX_=CMAX, FORCE=int(_force),
        CAND=_cand is not None, vocab_start=int(_cand or 0), MAP=_map, stride_map=0 if _map is None else _map.stride(0),
        MAPPED=_map is not None, num_warps=int(num_warps or NUM_WARPS),
    )
    return ids, probs, token, index


def rank_candidates(logits, u, temperature, top_k=20, top_p=0.95, *, vocab_start=0, **options):
    """Tensor parallelism, stage 1 (DESIGN.md: "each rank takes a local top-20 of its vocabulary
    slice, candidates are exchanged, every rank selects the same token"): this rank's candidates, the
    top ``top_k`` of its slice ``logits`` [w, V_rank], in one launch of the sampler's kernel
    (``options``: ``sample_topk_topp``'s tunings). Returns (their z = logits / T, FP32 [w, top_k],
    their global ids ``vocab_start + id``, int32 [w, top_k]), best first, ties lower id first.
    Gathered from every rank in rank order, they are what ``sample_candidates`` takes."""
    ids, z, _, _ = sample_topk_topp(logits, u, temperature, top_k, top_p, _cand=int(vocab_start), **options)
    return z, ids


def sample_candidates(cand_z, cand_ids, u, top_k=20, top_p=0.95, *, select=None):
    """Tensor parallelism, stage 2: the draw over every rank's candidates, ``cand_z`` / ``cand_ids``
    [w, R x top_k] (``rank_candidates`` of ranks 0..R-1, concatenated in rank order), in one launch.
    Returns ``sample_topk_topp``'s (ids, probs, token, index) with global ids: bit for bit what it
    gives on the whole vocabulary's logits (tests/kernels/test_sampler.py). Why: the global top k lie
    among the ranks' top k; the z are the first stage's (the kernel scales them again by T = 1, which
    is exact); ties go to the lower index of the candidate row, which is the lower id (the slices
    ascend in id, and each rank's list puts the lower id first among equal values). So the
    candidates must come in rank order."""
    check(cand_z.shape == cand_ids.shape and cand_ids.dtype == torch.int32 and cand_z.dtype == torch.float32,
          "candidates: z [w, R x k] fp32, ids int32")
    return sample_topk_topp(cand_z.contiguous(), u, 1.0, top_k, top_p, select=select, _map=cand_ids.contiguous())


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
