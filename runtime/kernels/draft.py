"""A draft depth's state update in one launch (the speculative round's ``_take_draft`` after sampling).

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

No host synchronisation; a plain launch (its inputs come from the sampler, stream-ordered).
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
