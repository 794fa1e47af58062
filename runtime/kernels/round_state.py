"""The speculative round's state updates in one launch each: a draft depth's (``take_draft``, after
the sampler) and the verification's settle (``settle``, after the rejection sampling).

Algorithm (``_take_draft_kernel``, grid (1,), one program)
---------------------------------------------------------
Input: the sampler's outputs for the one draft row (``sample_topk_topp``: ids [1, K] int32 local to
the rank's vocabulary slice, probs [1, K] FP32, token [1] int32 local, index [1] int32), the draft
layer's output g [1, H] BF16, and the depth k. The program writes what the torch sequence of
``Round._take_draft`` writes (about twenty launches there):

* tokens[k] = token + vocab_start; q_ids[k, :] = ids + vocab_start (int64); q_probs[k, :] = probs;
  g_state[0, :] = g in FP32;
* served = probs[index]; logp = log(max(served, 1e-30)) in FP32 (libdevice ``logf``, the function
  torch's FP32 log calls); draft_logp = logp (k = 1) or draft_logp + logp;
* draft_ent = -sum(probs * log(max(probs, 1e-30))): the same terms; the sum of the K terms is a
  tree inside the program, so it may differ from torch's reduction order in the last bit;
* n_drafts = k; log[max(step - 1, 0), LOG_NEXT_DRAFTS] = k;
* cont = the draft policy's decision for depth k + 1: a constant where the depth bounds or the fixed
  policy decide it, else (draft_logp >= log_prob_min) & (draft_ent <= entropy_max) with both
  thresholds as FP32 (as torch compares an FP32 tensor with a Python float).

Algorithm (``_settle_kernel``, grid (1 + w,))
---------------------------------------------
Input: the verification's accepted count n and next token (0-dim int64), the target's last hidden
states h [w, H] BF16, the width w. Program 0 writes what ``Round.verify`` + ``Round._emit`` write
after ``verify_drafts`` (about forty launches there), all integer work, so exactly the same values:

* em = [drafts..., nxt] with em[n] = nxt (drafts = tokens[1:w]);
* emit: is_stop[i] = em[i] in stop_ids and i <= n; first_stop = min i with is_stop (w if none);
  count = min(min(first_stop, n) + 1, budget - n_out); out[n_out + i] = em[i] for all i < w;
  n_out += count; done |= any(is_stop) | (n_out >= budget);
* the result-log row at ``step`` (width, drafts, n, count, cache length P + n + 1, done, em, zeros
  elsewhere); step += 1; prev_start = P; start = P + n + 1; accepted = n; emitted[:w] = em;
  tokens[0] = nxt; n_drafts = 0.

Programs 1..w copy h's rows into hidden[:w] in FP32.

No host synchronisation; plain launches (their inputs come from torch ops or the sampler,
stream-ordered).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import check, launch_signature, next_pow2

CONT_NEVER, CONT_ALWAYS, CONT_RULE = 0, 1, 2


@triton.jit(do_not_specialize=["k", "vocab_start"], launch_metadata=launch_signature)
def _take_draft_kernel(IDS, PROBS, TOK, IDX, G, TOKENS, QIDS, QPROBS, GST, LOGP, ENT, NDRAFTS, LOG, STEP, CONT,
                       stride_q, stride_p, stride_log, k, vocab_start, lp_min, ent_max,
                       KTOP: tl.constexpr, KP: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr,
                       FIRST: tl.constexpr, CONT_MODE: tl.constexpr, LOG_COL: tl.constexpr,
                       LOGP_BUG: tl.constexpr = False):
    offs = tl.arange(0, KP)
    ok = offs < KTOP
    q = tl.load(PROBS + offs, mask=ok, other=0.0)
    ids = tl.load(IDS + offs, mask=ok, other=0).to(tl.int64) + vocab_start
    tl.store(QIDS + k * stride_q + offs, ids, mask=ok)
    tl.store(QPROBS + k * stride_p + offs, q, mask=ok)
    tl.store(TOKENS + k, tl.load(TOK).to(tl.int64) + vocab_start)
    idx = tl.load(IDX)
    if LOGP_BUG:   # negative control: the probability of the candidate after the drawn one (off by one)
        idx = (idx + 1) % KTOP
    served = tl.sum(tl.where(offs == idx, q, 0.0), 0)
    logp = libdevice.log(tl.maximum(served, 1e-30))
    if not FIRST:
        logp = tl.load(LOGP) + logp
    tl.store(LOGP, logp)
    terms = tl.where(ok, q * libdevice.log(tl.maximum(q, 1e-30)), 0.0)
    ent = -tl.sum(terms, 0)
    tl.store(ENT, ent)
    tl.store(NDRAFTS, k.to(tl.int64))
    row = tl.maximum(tl.load(STEP) - 1, 0)
    tl.store(LOG + row * stride_log + LOG_COL, k.to(tl.int64))
    if CONT_MODE == 2:
        cont = (logp >= lp_min) & (ent <= ent_max)
    else:
        cont = tl.full((), CONT_MODE == 1, tl.int1)
    tl.store(CONT, cont)
    offs_h = tl.arange(0, BLOCK_H)
    hk = offs_h < H
    tl.store(GST + offs_h, tl.load(G + offs_h, mask=hk, other=0.0).to(tl.float32), mask=hk)


def take_draft(st, ids, probs, token, index, g, k: int, cont_mode: int, *, vocab_start: int = 0,
               log_prob_min: float = 0.0, entropy_max: float = 0.0, log_col: int, _logp_bug=False) -> None:
    """Depth k's state update from the sampler's raw outputs (see the module docstring). ``st``: the
    round's DecodeState; ids [1, K] / token [1] / index [1] int32 (local ids), probs [1, K] FP32,
    g [1, H] (BF16 or FP32); ``cont_mode``: CONT_NEVER / CONT_ALWAYS / CONT_RULE (the thresholds).
    ``_logp_bug``: the tests' negative control (logp of the candidate after the drawn one)."""
    K = probs.shape[-1]
    H = g.shape[-1]
    check(ids.shape == probs.shape == (1, K) and token.shape == index.shape == (1,), "one sampled row")
    check(ids.dtype == token.dtype == index.dtype == torch.int32 and probs.dtype == torch.float32, "dtypes")
    check(ids.is_contiguous() and probs.is_contiguous() and g.is_contiguous() and g.shape == (1, H), "layouts")
    check(st.q_ids.shape[1] == K and st.q_ids.dtype == torch.int64 and st.q_probs.dtype == torch.float32
          and st.q_ids.stride(1) == 1 and st.q_probs.stride(1) == 1, "q_ids / q_probs [8, K]")
    check(st.g.shape == (1, H) and st.g.dtype == torch.float32 and st.g.is_contiguous(), "g state [1, H] fp32")
    check(st.log.stride(1) == 1 and st.tokens.dtype == torch.int64, "log rows, tokens int64")
    check(1 <= k < st.tokens.shape[0], f"depth {k} outside [1, {st.tokens.shape[0]})")
    check(cont_mode in (CONT_NEVER, CONT_ALWAYS, CONT_RULE), "cont_mode")
    _take_draft_kernel[(1,)](
        ids, probs, token, index, g, st.tokens, st.q_ids, st.q_probs, st.g, st.draft_logp, st.draft_ent,
        st.n_drafts, st.log, st.step, st.cont, st.q_ids.stride(0), st.q_probs.stride(0), st.log.stride(0),
        k, int(vocab_start), float(log_prob_min), float(entropy_max),
        KTOP=K, KP=next_pow2(K), H=H, BLOCK_H=next_pow2(H), FIRST=k == 1, CONT_MODE=cont_mode,
        LOG_COL=log_col, LOGP_BUG=bool(_logp_bug), num_warps=4,
    )


@triton.jit
def _emitted(TOKENS, n, nxt, j, W: tl.constexpr):
    """The emitted token at index j of a width-W verification with n accepted drafts: draft j
    (tokens[1 + j]) below n, nxt at n and at W - 1 (past n nothing is emitted; the value is kept)."""
    return tl.where(j == n, nxt, tl.where(j < W - 1, tl.load(TOKENS + 1 + j, mask=(j >= 0) & (j < W - 1),
                                                             other=0), nxt))


@triton.jit(launch_metadata=launch_signature)
def _settle_kernel(TOKENS, N, NXT, HIN, HID, STOP, OUT, NOUT, BUDGET, DONE, LOG, STEP, START, PREV, ACC, EMITTED,
                   NDRAFTS, stride_hin, stride_hid, stride_log, log_rows,
                   W: tl.constexpr, WP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, H: tl.constexpr,
                   BLOCK_H: tl.constexpr, COLS: tl.constexpr, COLS_P: tl.constexpr, C_WIDTH: tl.constexpr,
                   C_DRAFTS: tl.constexpr, C_ACC: tl.constexpr, C_EMIT: tl.constexpr, C_LEN: tl.constexpr,
                   C_DONE: tl.constexpr, C_TOK: tl.constexpr, STOP_BUG: tl.constexpr = False):
    pid = tl.program_id(0)
    if pid > 0:   # hidden[pid - 1, :] = h[pid - 1, :] in FP32
        r = pid - 1
        for h0 in tl.static_range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            ok = offs < H
            v = tl.load(HIN + r * stride_hin + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(HID + r * stride_hid + offs, v, mask=ok)
    else:
        n = tl.load(N)
        nxt = tl.load(NXT)
        i = tl.arange(0, WP)
        iv = i < W
        em = _emitted(TOKENS, n, nxt, i, W)
        s = tl.arange(0, SP)
        stops = tl.load(STOP + s, mask=s < S, other=0)
        hit = tl.sum(((em[:, None] == stops[None, :]) & (s[None, :] < S)).to(tl.int32), 1) > 0
        if STOP_BUG:   # negative control: stop tokens ignored
            hit = hit & False
        is_stop = hit & (i <= n) & iv
        first_stop = tl.min(tl.where(is_stop, i, W), 0).to(tl.int64)
        n_out = tl.load(NOUT)
        budget = tl.load(BUDGET)
        count = tl.minimum(tl.minimum(first_stop, n) + 1, budget - n_out)
        tl.store(OUT + n_out + i, em, mask=iv)
        new_out = n_out + count
        tl.store(NOUT, new_out)
        done = (tl.load(DONE).to(tl.int32) | (tl.max(is_stop.to(tl.int32), 0) > 0).to(tl.int32)
                | (new_out >= budget).to(tl.int32))
        tl.store(DONE, done != 0)
        P = tl.load(START)
        step = tl.load(STEP)
        c = tl.arange(0, COLS_P)
        j = c - C_TOK
        row = tl.where((j >= 0) & (j < W), _emitted(TOKENS, n, nxt, j, W), 0)
        row = tl.where(c == C_WIDTH, W, row)
        row = tl.where(c == C_DRAFTS, W - 1, row)
        row = tl.where(c == C_ACC, n, row)
        row = tl.where(c == C_EMIT, count, row)
        row = tl.where(c == C_LEN, P + n + 1, row)
        row = tl.where(c == C_DONE, done.to(tl.int64), row)
        tl.store(LOG + step * stride_log + c, row.to(tl.int64), mask=(c < COLS) & (step < log_rows))
        tl.store(STEP, step + 1)
        tl.store(PREV, P)
        tl.store(START, P + n + 1)
        tl.store(ACC, n)
        tl.store(EMITTED + i, em, mask=iv)
        tl.store(TOKENS, nxt)
        tl.store(NDRAFTS, n * 0)


def settle(st, n, nxt, h, w: int, *, cols: dict, _stop_bug=False) -> None:
    """The verification's state update after the rejection sampling (see the module docstring):
    ``st`` the round's DecodeState, n / nxt 0-dim int64, h [w, H] (BF16 or FP32), ``cols`` the
    result log's column indices (width, drafts, accepted, emitted, cache_len, done, tokens).
    ``_stop_bug``: the tests' negative control (stop tokens ignored)."""
    H = h.shape[-1]
    check(h.dim() == 2 and h.shape[0] == w and h.stride(1) == 1, "h [w, H]")
    check(1 <= w <= st.tokens.shape[0] and n.dtype == nxt.dtype == torch.int64 and n.numel() == nxt.numel() == 1,
          "w within the state's rows; n, nxt int64 scalars")
    check(st.hidden.shape[1] == H and st.hidden.dtype == torch.float32 and st.hidden.stride(1) == 1,
          "hidden [8, H] fp32")
    check(st.log.stride(1) == 1 and st.log.dtype == torch.int64 and st.out.dtype == torch.int64
          and st.emitted.dtype == torch.int64 and st.stop_ids.dtype == torch.int64, "int64 state")
    S = st.stop_ids.numel()
    COLS = st.log.shape[1]
    _settle_kernel[(1 + w,)](
        st.tokens, n, nxt, h, st.hidden, st.stop_ids if S else st.tokens, st.out, st.n_out, st.budget, st.done,
        st.log, st.step, st.start, st.prev_start, st.accepted, st.emitted, st.n_drafts,
        h.stride(0), st.hidden.stride(0), st.log.stride(0), st.log.shape[0],
        W=w, WP=next_pow2(w), S=S, SP=next_pow2(max(S, 1)), H=H, BLOCK_H=min(4096, next_pow2(H)),
        COLS=COLS, COLS_P=next_pow2(COLS), C_WIDTH=cols["width"], C_DRAFTS=cols["drafts"],
        C_ACC=cols["accepted"], C_EMIT=cols["emitted"], C_LEN=cols["cache_len"], C_DONE=cols["done"],
        C_TOK=cols["tokens"], STOP_BUG=bool(_stop_bug), num_warps=4,
    )
