"""The round's state updates in one launch each against Round's torch sequences: a draft depth's
(``take_draft``, against Round._take_draft's writes on the same sampler outputs) and the
verification's settle (``settle``, against Round._settle on the same n, next token and hidden states).

Each case poisons the state's rows the update writes, runs both on copies of one state, and compares
every field: equal (the entropy within 1e-6 relative: the kernel sums its K terms in another order),
for depth 1 (draft_logp set) and depth 3 (accumulated), at a nonzero vocabulary offset, for each of the
policy's decision modes. Negative control: logp taken at the candidate after the drawn one
changes draft_logp. Settle: every field of the state equal after the kernel and after
Round._settle, for accepted counts 0..w-1, with and without a stop token among the emitted ones, at
the budget's edge; negative control: stop tokens ignored.
"""
from __future__ import annotations

import copy

import pytest
import torch

from .conftest import HAS_CUDA, cpu_only, load_kernels


def _dev():
    return torch.device("cuda" if HAS_CUDA else "cpu")


def _state(H, K, seed):
    from runtime.speculative import DecodeState

    st = DecodeState.empty(H, K, 16, seed, [], _dev())
    g = torch.Generator().manual_seed(seed)
    st.step.fill_(3)
    st.draft_logp.fill_(-0.75)
    st.q_ids.copy_(torch.randint(0, 99, st.q_ids.shape, generator=g))
    st.log.copy_(torch.randint(0, 9, st.log.shape, generator=g))
    return st


def _sampled(K, H, seed):
    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(1, K, generator=g) ** 3
    p[0, K - 3:] = 0.0                                  # filtered-out tail (top-p)
    p = (p / p.sum()).sort(descending=True).values
    ids = torch.randperm(5000, generator=g)[:K].view(1, K).int()
    idx = torch.tensor([4], dtype=torch.int32)
    tok = ids[:, 4].clone()
    gh = torch.randn(1, H, generator=g).to(torch.bfloat16)
    return [t.to(dev) for t in (ids, p.float(), tok, idx, gh)]


def _torch_update(st, ids, probs, tok, idx, gh, k, vocab_start, decided, lp_min, ent_max):
    """Round._take_draft's writes, in its torch operations (the sampler's long() / offset first)."""
    from runtime.sampling import entropy
    from runtime.speculative import LOG_NEXT_DRAFTS

    q_ids, q_probs, d = ids.long() + vocab_start, probs, tok.long() + vocab_start
    st.tokens[k].copy_(d[0])
    st.q_ids[k].copy_(q_ids[0])
    st.q_probs[k].copy_(q_probs[0])
    st.g.copy_(gh.float())
    served = q_probs[0].gather(0, idx.long())[0]
    logp = torch.log(served.clamp_min(1e-30))
    st.draft_logp.copy_(logp if k == 1 else st.draft_logp + logp)
    st.draft_ent.copy_(entropy(q_probs[0]))
    st.n_drafts.fill_(k)
    st.log[:, LOG_NEXT_DRAFTS].index_copy_(0, (st.step - 1).clamp_min(0).view(1), st.n_drafts.view(1))
    if decided is None:
        st.cont.copy_((st.draft_logp >= lp_min) & (st.draft_ent <= ent_max))
    else:
        st.cont.fill_(decided)


def _same(D, k, mode, decided, lp_min=-2.0, ent_max=1.5, **kw):
    from runtime.speculative import LOG_NEXT_DRAFTS

    H, K, vs = 96, 20, 40000
    st = _state(H, K, seed=k)
    ref = copy.deepcopy(st)
    ids, probs, tok, idx, gh = _sampled(K, H, seed=10 + k)
    _torch_update(ref, ids, probs, tok, idx, gh, k, vs, decided, lp_min, ent_max)
    st.tokens[k] = -1
    st.q_probs[k] = float("nan")
    st.g.fill_(float("nan"))
    D.take_draft(st, ids, probs, tok, idx, gh, k, mode, vocab_start=vs, log_prob_min=lp_min, entropy_max=ent_max,
                 log_col=LOG_NEXT_DRAFTS, **kw)
    for name in ("tokens", "q_ids", "q_probs", "g", "draft_logp", "n_drafts", "log", "cont", "step"):
        if not torch.equal(getattr(st, name), getattr(ref, name)):
            return False
    return bool(((st.draft_ent - ref.draft_ent).abs() <= 1e-6 * ref.draft_ent.abs()).all())


CASES = [(1, "rule", None), (3, "rule", None), (2, "always", True), (3, "never", False)]


def _mode(D, name):
    return {"rule": D.CONT_RULE, "always": D.CONT_ALWAYS, "never": D.CONT_NEVER}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("k,mode,decided", CASES)
def test_gpu(k, mode, decided):
    D = load_kernels("round_state")
    assert _same(D, k, _mode(D, mode), decided)
    assert _same(D, k, _mode(D, mode), decided, lp_min=-50.0, ent_max=50.0)
    assert not _same(D, k, _mode(D, mode), decided, _logp_bug=True)


@cpu_only
@pytest.mark.parametrize("k,mode,decided", CASES[:2])
def test_interp(k, mode, decided):
    D = load_kernels("round_state")
    assert _same(D, k, _mode(D, mode), decided)
    assert not _same(D, k, _mode(D, mode), decided, _logp_bug=True)


def _settle_same(R, w, n, stop_at, budget_left, seed, **kw):
    """State after settle == state after Round._settle (from one random state; ``stop_at``: index of
    em whose token is made a stop token, or None; ``budget_left``: budget - n_out)."""
    from runtime.speculative import (LOG_ACCEPTED, LOG_CACHE_LEN, LOG_DONE, LOG_DRAFTS, LOG_EMITTED, LOG_TOKENS,
                                     LOG_WIDTH, DecodeState, Round)

    dev = _dev()
    g = torch.Generator().manual_seed(seed)
    H = 160
    tokens = torch.randint(0, 30000, (8,), generator=g)
    nxt = torch.tensor(31000 + seed)
    em = torch.cat([tokens[1:w], nxt.view(1)]).scatter(0, torch.tensor([n]), nxt.view(1))
    stops = [int(em[stop_at])] if stop_at is not None else []
    st = DecodeState.empty(H, 20, 40, seed, stops + [7], dev)
    st.tokens.copy_(tokens)
    st.start.fill_(1000 + seed)
    st.step.fill_(5)
    st.n_out.fill_(40 - budget_left)
    st.log.copy_(torch.randint(0, 9, st.log.shape, generator=g))
    st.out.copy_(torch.randint(0, 9, st.out.shape, generator=g))
    st.n_drafts.fill_(w - 1)
    h = torch.randn(w, H, generator=g).to(torch.bfloat16).to(dev)
    nt, nx = torch.tensor(n, device=dev), nxt.to(dev)
    ref = copy.deepcopy(st)
    Round._settle(ref, w, nt, nx, h)
    st.hidden.fill_(float("nan"))
    st.emitted.fill_(-5)
    cols = dict(width=LOG_WIDTH, drafts=LOG_DRAFTS, accepted=LOG_ACCEPTED, emitted=LOG_EMITTED,
                cache_len=LOG_CACHE_LEN, done=LOG_DONE, tokens=LOG_TOKENS)
    R.settle(st, nt, nx, h, w, cols=cols, **kw)
    hid_ok = torch.equal(st.hidden[:w], ref.hidden[:w])
    others = [torch.equal(getattr(st, f), getattr(ref, f)) for f in
              ("tokens", "start", "prev_start", "accepted", "n_drafts", "out", "n_out", "log", "step", "done")]
    return hid_ok and all(others) and torch.equal(st.emitted[:w], ref.emitted[:w])


SETTLE_CASES = [(6, 0, None, 30), (6, 5, None, 30), (6, 3, 1, 30), (6, 3, 3, 30), (8, 7, 5, 2), (4, 2, None, 1),
                (5, 4, 4, 30)]


@pytest.mark.gpu
@pytest.mark.parametrize("w,n,stop_at,left", SETTLE_CASES)
def test_gpu_settle(w, n, stop_at, left):
    R = load_kernels("round_state")
    assert _settle_same(R, w, n, stop_at, left, seed=w * 10 + n)
    if stop_at is not None and stop_at <= n and left > stop_at + 1:
        assert not _settle_same(R, w, n, stop_at, left, seed=w * 10 + n, _stop_bug=True)


@cpu_only
def test_interp_settle():
    R = load_kernels("round_state")
    for w, n, stop_at, left in SETTLE_CASES[:4]:
        assert _settle_same(R, w, n, stop_at, left, seed=w * 10 + n), (w, n, stop_at, left)
    assert not _settle_same(R, 6, 3, 1, 30, seed=63, _stop_bug=True)
