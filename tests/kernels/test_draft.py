"""A draft depth's state update in one launch (``take_draft``) against Round._take_draft's torch
sequence on the same sampler outputs.

Each case poisons the state's rows the update writes, runs both on copies of one state, and compares
every field: equal (the entropy within 1e-6 relative: the kernel sums its K terms in another order),
for depth 1 (draft_logp set) and depth 3 (accumulated), at a nonzero vocabulary offset, for each of the
policy's decision modes. Negative control: logp taken at the candidate after the drawn one
changes draft_logp.
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
    D = load_kernels("draft")
    assert _same(D, k, _mode(D, mode), decided)
    assert _same(D, k, _mode(D, mode), decided, lp_min=-50.0, ent_max=50.0)
    assert not _same(D, k, _mode(D, mode), decided, _logp_bug=True)


@cpu_only
@pytest.mark.parametrize("k,mode,decided", CASES[:2])
def test_interp(k, mode, decided):
    D = load_kernels("draft")
    assert _same(D, k, _mode(D, mode), decided)
    assert not _same(D, k, _mode(D, mode), decided, _logp_bug=True)
