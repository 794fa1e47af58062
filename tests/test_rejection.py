"""Rejection sampling emits exactly the target distribution (chi-square), and a wrong rule fails."""
import numpy as np
import pytest
import torch
from scipy import stats

from runtime import rng
from runtime.sampling import draw, verify_drafts

V = 8
# p has no mass on token 7; q puts mass there (and on tokens p favours less)
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.00])
Q = torch.tensor([0.05, 0.10, 0.30, 0.05, 0.20, 0.05, 0.05, 0.20])


def _sparse(p):
    ids = torch.arange(V, dtype=torch.int64)
    return ids[None], p[None]


def _emit_first(n_trials, rule=None, seed=0):
    """Token emitted at the first draft position: the draft if accepted, else the replacement."""
    p_ids, p_probs = _sparse(P)
    q_ids, q_probs = _sparse(Q)
    # rows: 0 predicts the draft position, 1 is the bonus row (unused when a draft is rejected)
    p2_ids, p2_probs = torch.cat([p_ids, p_ids]), torch.cat([p_probs, p_probs])
    counts = np.zeros(V, dtype=np.int64)
    pos = torch.arange(n_trials)
    u_draft = rng.uniform(seed, pos, rng.DRAFT)
    u_acc = rng.uniform(seed, pos, rng.ACCEPT)
    u_res = rng.uniform(seed, pos, rng.RESIDUAL)
    u_bon = rng.uniform(seed, pos, rng.TARGET)
    drafts, _ = draw(q_ids.expand(n_trials, V), q_probs.expand(n_trials, V), u_draft)
    for i in range(n_trials):
        d = drafts[i:i + 1]
        if rule is None:
            n, nxt = verify_drafts(p2_ids, p2_probs, q_ids, q_probs, d, u_acc[i:i + 1], u_res[i:i + 1], u_bon[i])
            tok = int(d[0]) if int(n) == 1 else int(nxt)
        else:
            tok = rule(int(d[0]), float(u_acc[i]), float(u_res[i]))
        counts[tok] += 1
    return counts


def _pvalue(counts):
    support = P.numpy() > 0
    expected = P.double().numpy()[support]
    expected = expected / expected.sum() * counts.sum()
    if counts[~support].sum() > 0:
        return 0.0
    return stats.chisquare(counts[support], expected).pvalue


def test_rejection_sampling_emits_target_distribution():
    counts = _emit_first(6000)
    assert counts[7] == 0, "a token with p = 0 was emitted"
    assert _pvalue(counts) > 1e-3


def test_wrong_acceptance_rule_is_rejected():
    """Negative control: accept whenever p(d) > 0 (ignoring the ratio); replacement from p."""
    p_ids, p_probs = _sparse(P)

    def wrong(d, u_acc, u_res):
        if float(P[d]) > 0:
            return d
        tok, _ = draw(p_ids, p_probs, torch.tensor([u_res]))
        return int(tok[0])

    assert _pvalue(_emit_first(6000, rule=wrong)) < 1e-6


def test_residual_rule_without_clamp_is_rejected():
    """Negative control: replacement drawn from p instead of normalise(max(0, p - q))."""
    p_ids, p_probs = _sparse(P)

    def wrong(d, u_acc, u_res):
        if u_acc * float(Q[d]) < float(P[d]):
            return d
        tok, _ = draw(p_ids, p_probs, torch.tensor([u_res]))
        return int(tok[0])

    assert _pvalue(_emit_first(6000, rule=wrong)) < 1e-6


def test_all_accepted_gives_bonus_from_extra_row():
    # q == p on a one-token support: the draft is always accepted and the bonus row decides
    ids = torch.arange(V)[None]
    one = torch.zeros(1, V)
    one[0, 3] = 1.0
    bonus = torch.zeros(1, V)
    bonus[0, 5] = 1.0
    n, nxt = verify_drafts(torch.cat([ids, ids]), torch.cat([one, bonus]), ids, one, torch.tensor([3]),
                           torch.tensor([0.999]), torch.tensor([0.5]), torch.tensor(0.5))
    assert int(n) == 1 and int(nxt) == 5
