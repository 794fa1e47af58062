"""Sampling and rejection sampling over sparse (top-k) distributions, without host reads.

A row's served distribution is the checkpoint default filter (temperature 1, top-k 20, top-p 0.95):
softmax(logits / T) restricted to the k largest logits (ties: lower token id first), renormalised;
then the smallest prefix of that sorted list whose mass reaches top_p is kept (token i is kept iff
the mass before it is < top_p), renormalised again. It is represented as ``ids [rows, k]`` (sorted,
most probable first) and ``probs [rows, k]`` (0 for tokens cut by top-p).

Under tensor parallelism each rank takes the top-k of its vocabulary slice, the candidates are
gathered, and every rank selects the same global top-k (softmax over the top-k cancels the rest of
the vocabulary, so no denominator has to be exchanged).

Rejection sampling (speculative round step 3): draft d at row i is accepted with probability
min(1, p_i(d) / q_i(d)), q being the draft's actual proposal distribution (saved when drafting); at the
first rejection the replacement is drawn from normalise(max(0, p - q)); if every draft is accepted a
bonus token is drawn from the extra row's p.
"""
from __future__ import annotations

import torch

_LOW32 = 0xFFFFFFFF


def _orderable(x: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like the float32 values (monotone bit trick)."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)


def _from_orderable(k: torch.Tensor) -> torch.Tensor:
    b = torch.where(k < 0, -(k + 1) | -0x80000000, k)
    return b.to(torch.int32).view(torch.float32)


def topk_candidates(logits: torch.Tensor, k: int, vocab_start: int = 0) -> torch.Tensor:
    """int64 keys (value, then lower id first) of the k best logits of this slice, best first."""
    ids = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64) + vocab_start
    key = (_orderable(logits) << 32) | (_LOW32 - ids)
    return key.topk(min(k, logits.shape[-1]), dim=-1).values


def filter_dist(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                vocab_start: int = 0, comm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64, probs [T, k] fp32) of the served distribution of each row."""
    keys = topk_candidates(logits.float() / temperature, top_k, vocab_start)
    if comm is not None and comm.size > 1:
        gathered = comm.all_gather(keys)                              # [ranks, T, k]
        keys = gathered.permute(1, 0, 2).reshape(keys.shape[0], -1).topk(top_k, dim=-1).values
    ids = _LOW32 - (keys & _LOW32)
    vals = _from_orderable(keys >> 32)
    p = torch.softmax(vals, dim=-1)
    before = torch.cumsum(p, dim=-1) - p
    p = torch.where(before < top_p, p, torch.zeros_like(p))
    return ids, p / p.sum(-1, keepdim=True)


def draw(ids: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw in list order: the first i with u < cumsum(probs)_i (rounding: the last kept).
    Returns (token [T], index [T])."""
    c = torch.cumsum(probs, dim=-1)
    idx = (u[:, None] >= c).sum(-1)
    # the last positive entry (a residual can have zeros between positive entries)
    pos = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    last = torch.where(probs > 0, pos, torch.zeros_like(pos)).amax(-1)
    idx = torch.minimum(idx, last)
    return ids.gather(1, idx[:, None])[:, 0], idx


def prob_of(ids: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """p(token) per row under a sparse distribution (0 when the token is not in its support)."""
    return (probs * (ids == tokens[:, None])).sum(-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def verify_drafts(p_ids, p_probs, q_ids, q_probs, drafts, u_accept, u_resid, u_bonus):
    """Rejection sampling of one round.

    p_* [w, k]: target distributions of the w verified rows (row i predicts the token after row i).
    q_* [w-1, k], drafts [w-1]: proposal distributions and draft tokens for rows 1..w-1.
    u_accept, u_resid [w-1], u_bonus scalar: uniforms.
    Returns (accepted n: int64 0-dim, next token: int64 0-dim). Sync-free: the prefix length is a
    cumulative product, the replacement for every row is computed and the right one gathered."""
    w1 = drafts.shape[0]
    p_d = prob_of(p_ids[:w1], p_probs[:w1], drafts)
    q_d = prob_of(q_ids, q_probs, drafts)
    ok = u_accept * q_d < p_d                                # u < p/q without dividing by q
    n = torch.cumprod(ok.to(torch.int64), 0).sum()
    # replacement for each possible first rejection i: normalise(max(0, p_i - q_i)) on p_i's support
    q_on_p = (q_probs[:, None, :] * (q_ids[:, None, :] == p_ids[:w1, :, None])).sum(-1)   # [w-1, k]
    resid = (p_probs[:w1] - q_on_p).clamp_min(0)
    z = resid.sum(-1, keepdim=True)
    resid = torch.where(z > 0, resid / z.clamp_min(1e-30), p_probs[:w1])
    repl, _ = draw(p_ids[:w1], resid, u_resid)
    bonus, _ = draw(p_ids[w1:w1 + 1], p_probs[w1:w1 + 1], u_bonus.reshape(1))
    cand = torch.cat([repl, bonus])
    return n, cand.gather(0, n.reshape(1))[0]
