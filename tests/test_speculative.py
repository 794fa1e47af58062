"""The speculative round: same distribution as plain sampling, deterministic, exact cache settlement,
no host synchronisation inside the pieces."""
import numpy as np
import pytest
import torch
from scipy import stats

from runtime.nosync import HostSyncError, forbid_host_sync

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
N_SEEDS = 400
POSITIONS = 3   # token marginals at the first positions after the prompt


def _spec_tokens(engine, n_seeds, broken=False):
    out = np.zeros((n_seeds, POSITIONS), dtype=np.int64)
    for s in range(n_seeds):
        toks = _broken_generate(engine, s) if broken else \
            engine.generate(PROMPT, seed=s, max_new_tokens=POSITIONS).tokens
        out[s] = toks[:POSITIONS]
    return out


def _broken_generate(engine, seed):
    """Negative control: drafts are emitted without verification (acceptance forced)."""
    rnd, st = engine.start(PROMPT, seed, POSITIONS)
    return ([int(st.out[0])] + st.tokens[1:st.width()].tolist())[:POSITIONS]


def _ar_tokens(engine, n_seeds):
    return np.array([engine.generate_autoregressive(PROMPT, seed=s, max_new_tokens=POSITIONS)
                     for s in range(n_seeds)], dtype=np.int64)


def _same_distribution_pvalue(a, b):
    """Smallest p-value over positions of a chi-square homogeneity test (sparse cells pooled)."""
    ps = []
    for j in range(a.shape[1]):
        cats = np.union1d(a[:, j], b[:, j])
        ca = np.array([(a[:, j] == c).sum() for c in cats])
        cb = np.array([(b[:, j] == c).sum() for c in cats])
        big = (ca + cb) >= 10
        table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
        table = table[:, table.sum(0) > 0]
        ps.append(stats.chi2_contingency(table).pvalue)
    return min(ps)


@pytest.fixture(scope="module")
def ar_samples(small_vocab_engine):
    return _ar_tokens(small_vocab_engine, N_SEEDS)


def test_speculative_matches_autoregressive_distribution(small_vocab_engine, ar_samples):
    spec = _spec_tokens(small_vocab_engine, N_SEEDS)
    # the branch we test must actually be exercised: drafts get accepted at the second position
    g = [small_vocab_engine.generate(PROMPT, seed=s, max_new_tokens=POSITIONS) for s in range(40)]
    assert sum(s["accepted"] for x in g for s in x.steps) > 5
    # Bonferroni over 3 positions at 1e-3
    assert _same_distribution_pvalue(spec, ar_samples) > 1e-3 / POSITIONS


def test_unverified_drafts_fail_the_distribution_test(small_vocab_engine, ar_samples):
    broken = _spec_tokens(small_vocab_engine, N_SEEDS, broken=True)
    assert _same_distribution_pvalue(broken, ar_samples) < 1e-6


def test_deterministic_for_fixed_seed(tiny_engine):
    a = tiny_engine.generate(PROMPT, seed=7, max_new_tokens=24)
    b = tiny_engine.generate(PROMPT, seed=7, max_new_tokens=24)
    c = tiny_engine.generate(PROMPT, seed=8, max_new_tokens=24)
    assert a.tokens == b.tokens and a.steps == b.steps
    assert a.tokens != c.tokens
    assert len(a.tokens) == 24


def _committed_prefill(engine, committed):
    rnd = engine.new_round(engine.capacity_for(len(committed), 8))
    engine.prefill(committed, rnd)
    return rnd.cache


def _compare_caches(engine, dec_cache, ref_cache, length):
    diffs = []
    for c_dec, c_ref in zip(dec_cache.layers, ref_cache.layers):
        if c_dec.kind == "full":
            a, b = c_dec.k[:, :length], c_ref.k[:, :length]
            av, bv = c_dec.v[:, :length], c_ref.v[:, :length]
        else:
            # the window before `length`: every position a future row may still read
            pos = torch.arange(max(0, length - c_dec.window), length)
            slots = pos % c_dec.slots
            assert torch.equal(c_dec.labels[slots], pos), "ring labels do not hold the window"
            assert torch.equal(c_ref.labels[slots], pos)
            a, b, av, bv = c_dec.k[:, slots], c_ref.k[:, slots], c_dec.v[:, slots], c_ref.v[:, slots]
        diffs.append(max((a - b).abs().max().item(), (av - bv).abs().max().item()))
    return max(diffs)


def _run_steps(engine, seed, n_steps, break_settle=False):
    rnd, st = engine.start(PROMPT, seed, 400)
    rejections = 0
    for _ in range(n_steps):
        w = st.width()
        rnd.verify(st, w)
        if break_settle:   # negative control: no rollback of the cache length
            st.start.copy_(st.prev_start + w)
        rejections += int(st.accepted) < w - 1
        rnd.draft_first(st, w)
        engine._draft_rest(st, rnd)
    committed = PROMPT + st.out[:int(st.n_out) - 1].tolist()
    return rnd, st, committed, rejections


def test_cache_settlement_equals_fresh_prefill(small_vocab_engine):
    e = small_vocab_engine
    rnd, st, committed, rejections = _run_steps(e, seed=11, n_steps=90)
    assert rejections >= 5
    assert int(st.start) == len(committed)
    assert len(committed) > e.cfg.ring_slots, "the ring must have wrapped"
    ref = _committed_prefill(e, committed)
    assert _compare_caches(e, rnd.cache, ref, len(committed)) < 1e-5


def test_cache_settlement_without_rollback_fails(small_vocab_engine):
    e = small_vocab_engine
    rnd, st, committed, _ = _run_steps(e, seed=11, n_steps=40, break_settle=True)
    length = int(st.start)
    ref = _committed_prefill(e, committed)
    with pytest.raises(AssertionError):
        assert length == len(committed) and _compare_caches(e, rnd.cache, ref, length) < 1e-5


def test_step_pieces_do_not_synchronise(tiny_engine):
    rnd, st = tiny_engine.start(PROMPT, 0, 32)
    w = st.width()
    with forbid_host_sync():
        rnd.verify(st, w)
        rnd.draft_first(st, w)
        for k in range(2, 8):
            rnd.draft_next(st, k)


def test_sync_guard_catches_host_reads(tiny_engine):
    rnd, st = tiny_engine.start(PROMPT, 0, 32)
    for bad in (lambda: st.start.item(), lambda: bool(st.done), lambda: st.tokens.tolist(),
                lambda: st.tokens[st.tokens > 3], lambda: torch.nonzero(st.tokens),
                lambda: int(st.n_drafts) + 1):
        with pytest.raises(HostSyncError):
            with forbid_host_sync():
                bad()
