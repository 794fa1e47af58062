"""Verdict rules on synthetic runs with known answers and on hand-built statistics; every rule beside
a deliberately broken variant of the verdict that must fail the same check."""

from __future__ import annotations

import dataclasses
import math
import re

import pandas as pd
import pytest

from analysis import stats, verdict
from analysis.stats import Analysis, Effect
from tests.test_stats import SMALL, simulated_run, step_level_ci


def analyze(**kw):
    run = simulated_run(**kw)
    return stats.analyze(run, n_boot=1000), run.manifest


def effect(metric, mean, lo, hi, p, arm="candidate", n=400, sd=0.01):
    return Effect(metric=metric, arm=arm, base="control", n=n, mean=mean, ci=(lo, hi), p=p, hl=mean,
                  hl_ci=(lo, hi), sd=sd, mde=stats.min_detectable_effect(sd, n), before=1e7,
                  after=1e7 * math.exp(mean))


def hand_built(tpot=(-0.021, -0.028, -0.014, 1e-9), tps=(0.0, 0.0, 0.0, 1.0), step=None,
               aa=(0.001, -0.003, 0.005, 0.6), n=400, exact=400, aa_exact=400) -> Analysis:
    step = step or (tpot[0] + tps[0], tpot[1], tpot[2], tpot[3])
    effects = {"tpot": effect("tpot", *tpot, n=n), "step": effect("step", *step, n=n),
               "tps": effect("tps", *tps, n=n), "steps": effect("steps", 0.0, 0.0, 0.0, 1.0, n=n)}
    aa_eff = {} if aa is None else {"tpot": effect("tpot", *aa, arm="aa", n=n)}
    bit = {"n_requests": n, "candidate_exact": exact, "aa_exact": aa_exact,
           "aa_compared": n if aa is not None else 0, "control_reproducible": n,
           "differing": [], "n_differing": n - exact, "aa_differing": []}
    return Analysis(run_id="hand", arms=["control", "candidate", "aa"], n_requests=n, effects=effects,
                    aa=aa_eff, adjusted=None, identity_residual=0.0, bit_exact=bit, drift={},
                    context_slope=None, context_bins=pd.DataFrame(), per_request=pd.DataFrame(),
                    decodes=pd.DataFrame(), settings={"level": 0.95, "alpha": 0.05})


MANIFEST = {"run_id": "hand", "status": "complete", "expect_bit_exact": True, "arms": {}}


# ----------------------------------------------------------------------------- headline and rules

def test_headline_format():
    v = verdict.decide(hand_built(), MANIFEST)
    assert v.call == "faster" and v.flags == []
    assert v.headline == ("candidate is 2.1% faster per output token [1.4, 2.8] 95% CI; acceptance "
                          "unchanged; bit-exact: 400/400 requests; A/A offset +0.1% [\u22120.3, 0.5]")


def test_significance_needs_both_ci_and_rank_test():
    assert verdict.decide(hand_built(tpot=(-0.02, -0.03, -0.01, 0.2)), MANIFEST).call == "inconclusive"
    assert verdict.decide(hand_built(tpot=(-0.02, -0.03, 0.001, 0.01)), MANIFEST).call == "inconclusive"
    assert verdict.decide(hand_built(tpot=(0.02, 0.01, 0.03, 0.01)), MANIFEST).call == "slower"


def test_inconclusive_headline_says_which_evidence_disagrees():
    """Interval excluding 0 with p >= alpha (a GPU A/A run of session 56 read "no significant change ...
    [-0.9, -0.1]"), and the reverse: the headline names the disagreement; when both agree, nothing is added
    (the control: an interval holding 0 with a large p)."""
    ci_only = verdict.decide(hand_built(tpot=(-0.004, -0.009, -0.001, 0.065)), MANIFEST)
    assert ci_only.call == "inconclusive"
    assert "the interval excludes 0 but the signed-rank test does not reject at 0.05" in ci_only.headline
    p_only = verdict.decide(hand_built(tpot=(0.0035, -0.0005, 0.0081, 0.027)), MANIFEST)
    assert p_only.call == "inconclusive" and "p < 0.05 but the interval holds 0" in p_only.headline
    agree = verdict.decide(hand_built(tpot=(0.001, -0.003, 0.005, 0.6)), MANIFEST)
    assert agree.call == "inconclusive" and "a call needs both" not in agree.headline


def test_inconclusive_headline_points_at_pooling_when_the_arm_offset_dominates():
    """An interval widened by an arm offset at least as large as its request noise (a GPU run's floor): the
    headline says more requests will not help and names the pooling; the control, an offset well under the
    request noise, adds nothing, and neither does a call."""
    import dataclasses

    def with_offset(tpot, arm_sd, se):
        a = hand_built(tpot=tpot)
        e = a.effects["tpot"]
        a.effects["tpot"] = dataclasses.replace(e, arm_sd=arm_sd, se=se, ci_requests=e.ci)
        return verdict.decide(a, MANIFEST)
    big = with_offset((0.001, -0.004, 0.006, 0.6), 0.0017, 0.0015)
    assert big.call == "inconclusive" and "sd 0.17% is most of that" in big.headline
    assert "python -m analysis.compare" in big.headline
    small = with_offset((0.001, -0.004, 0.006, 0.6), 0.0005, 0.0015)
    assert small.call == "inconclusive" and "analysis.compare" not in small.headline
    called = with_offset((-0.021, -0.028, -0.014, 1e-9), 0.0017, 0.0015)
    assert called.call == "faster" and "analysis.compare" not in called.headline


def test_insufficient_requests():
    v = verdict.decide(hand_built(n=5, exact=5, aa_exact=5), MANIFEST)
    assert v.call == "insufficient"


def aa_offset_rule_holds(decide) -> bool:
    """Effect -2%; A/A CI [-1.2%, +1.1%] (bound 1.2% > half the effect) must flag; A/A CI
    [-0.4%, +0.5%] must not."""
    wide = decide(hand_built(tpot=(-0.02, -0.025, -0.015, 1e-6), aa=(-0.0005, -0.012, 0.011, 0.9)),
                  MANIFEST)
    narrow = decide(hand_built(tpot=(-0.02, -0.025, -0.015, 1e-6), aa=(0.0005, -0.004, 0.005, 0.8)),
                    MANIFEST)
    return ("aa_offset_exceeds_effect" in wide.flags and "exceeds the effect" in wide.headline
            and "aa_offset_exceeds_effect" not in narrow.flags and wide.call == "faster")


def decide_on_aa_point_estimate(a, manifest, **kw):
    """Deliberately wrong: judges the A/A offset by its point estimate instead of its CI."""
    aa = a.aa["tpot"]
    point = dataclasses.replace(aa, ci=(aa.mean, aa.mean))
    return verdict.decide(dataclasses.replace(a, aa={"tpot": point}), manifest, **kw)


def test_aa_offset_exceeds_effect():
    assert aa_offset_rule_holds(verdict.decide)


def test_aa_offset_negative_control_point_estimate_fails():
    assert not aa_offset_rule_holds(decide_on_aa_point_estimate)


# ----------------------------------------------------------------------------- synthetic runs

@pytest.fixture(scope="module")
def runs():
    """name -> (analysis, manifest) for the scenarios below (computed once)."""
    base = dict(n_requests=80, request_effect_sd=0.005)
    return {
        "faster": analyze(seed=21, latency_effect=math.log(0.97), **base),
        "slower": analyze(seed=22, latency_effect=math.log(1.03), **base),
        "accept": analyze(seed=23, acceptance_multiplier=1.08, expect_bit_exact=False, **base),
        "aa": analyze(seed=24, aa_offset=0.03, **base),
        "nonexact": analyze(seed=25, latency_effect=math.log(0.97), nonexact_fraction=0.05, **base),
    }


def sign_detected(decide, runs) -> bool:
    return (decide(*runs["faster"]).call == "faster" and decide(*runs["slower"]).call == "slower")


def decide_flipped(a, manifest, **kw):
    """Deliberately wrong: reads the log-ratio as control/candidate."""
    t = a.effects["tpot"]
    flipped = dataclasses.replace(t, mean=-t.mean, ci=(-t.ci[1], -t.ci[0]))
    return verdict.decide(dataclasses.replace(a, effects={**a.effects, "tpot": flipped}), manifest, **kw)


def test_sign_detection(runs):
    assert sign_detected(verdict.decide, runs)
    v = verdict.decide(*runs["faster"])
    assert re.match(r"candidate is \d\.\d% faster per output token \[\d\.\d, \d\.\d\] 95% CI; "
                    r"acceptance unchanged; bit-exact: 80/80 requests; A/A offset ", v.headline)
    assert 2.0 < -runs["faster"][0].effects["tpot"].pct < 4.0


def test_sign_negative_control_flipped_fails(runs):
    assert not sign_detected(decide_flipped, runs)


def acceptance_rule_holds(decide, runs) -> bool:
    changed = decide(*runs["accept"])
    same = decide(*runs["faster"])
    return ("acceptance_changed" in changed.flags and "explain both effects" in changed.headline
            and "acceptance_changed" not in same.flags and "acceptance unchanged" in same.headline)


def decide_ignoring_tps(a, manifest, **kw):
    """Deliberately wrong: never looks at tokens per step."""
    null = dataclasses.replace(a.effects["tps"], mean=0.0, ci=(0.0, 0.0), p=1.0)
    return verdict.decide(dataclasses.replace(a, effects={**a.effects, "tps": null}), manifest, **kw)


def test_acceptance_change(runs):
    assert acceptance_rule_holds(verdict.decide, runs)
    a = runs["accept"][0]
    assert a.effects["tps"].mean > 0.03  # the acceptance change has its own effect and interval
    assert a.effects["tps"].ci[0] > 0


def test_acceptance_negative_control_ignoring_tps_fails(runs):
    assert not acceptance_rule_holds(decide_ignoring_tps, runs)


def aa_rule_holds(decide, runs) -> bool:
    return decide(*runs["aa"]).call == "unstable" and decide(*runs["faster"]).call == "faster"


def decide_without_aa(a, manifest, **kw):
    """Deliberately wrong: drops the A/A arm."""
    return verdict.decide(dataclasses.replace(a, aa={}), manifest, **kw)


def test_aa_instability_refused(runs):
    assert aa_rule_holds(verdict.decide, runs)
    assert "UNSTABLE" in verdict.decide(*runs["aa"]).headline


def test_aa_negative_control_without_aa_fails(runs):
    assert not aa_rule_holds(decide_without_aa, runs)


def test_not_bit_exact(runs):
    a, manifest = runs["nonexact"]
    v = verdict.decide(a, manifest)
    n_diff = a.bit_exact["n_differing"]
    assert n_diff > 0 and "not_bit_exact" in v.flags
    assert f"NOT bit-exact: {80 - n_diff}/80 requests identical" in v.headline
    relaxed = verdict.decide(a, dict(manifest, expect_bit_exact=False))
    assert "not_bit_exact" not in relaxed.flags and "(not required)" in relaxed.headline
    assert "not_bit_exact" not in verdict.decide(*runs["faster"]).flags


def test_incomplete_run_flagged(runs):
    a, manifest = runs["faster"]
    v = verdict.decide(a, dict(manifest, status="interrupted"))
    assert "incomplete_run" in v.flags and "run interrupted" in v.headline


# ----------------------------------------------------------------------------- false positives

def false_positive_rate(decide_fn, n=100) -> float:
    calls = 0
    for i in range(n):
        run = simulated_run(seed=5000 + i, **SMALL)
        calls += decide_fn(run) in ("faster", "slower")
    return calls / n


def harness_call(run):
    return verdict.decide(stats.analyze(run, n_boot=500), run.manifest).call


def step_level_call(run):
    """Deliberately wrong: calls on the step-level interval (steps as independent units)."""
    lo, hi = step_level_ci(run)
    return "faster" if hi < 0 else "slower" if lo > 0 else "inconclusive"


def test_aa_false_positive_rate():
    assert false_positive_rate(harness_call) <= 0.075


def test_false_positive_negative_control_step_level_fails():
    assert false_positive_rate(step_level_call, n=40) > 0.075


# ------------------------------------------------------------------------------ host contention

def _host_requests(n=60, contended=0, ratio=0.5):
    """Request rows of a CPU run: every decode had 98% of a core except ``contended`` at ``ratio``."""
    arms = ["control", "candidate", "aa"] * (n // 3)
    dec = [10_000_000] * n
    cpu = [int(d * (ratio if i < contended else 0.98)) for i, d in enumerate(dec)]
    return pd.DataFrame({"arm": arms, "decode_ns": dec, "cpu_ns": cpu})


CPU_MANIFEST = dict(MANIFEST, arms={a: {"device": "cpu"} for a in ("control", "candidate", "aa")})


def test_host_contention_flag_and_its_scope():
    quiet = stats.host_contention(_host_requests(contended=2), CPU_MANIFEST)      # 3.3% <= 5%
    busy = stats.host_contention(_host_requests(contended=6), CPU_MANIFEST)       # 10% > 5%
    assert quiet["contended"] == 2 and busy["contended"] == 6 and busy["n_decodes"] == 60
    assert abs(busy["median_ratio"] - 0.98) < 1e-9 and busy["min_ratio"] == 0.5
    assert sum(busy["contended_by_arm"].values()) == 6
    v_quiet = verdict.decide(dataclasses.replace(hand_built(), host=quiet), CPU_MANIFEST)
    v_busy = verdict.decide(dataclasses.replace(hand_built(), host=busy), CPU_MANIFEST)
    assert "host_contention" not in v_quiet.flags
    assert "host_contention" in v_busy.flags and "HOST CONTENTION: 6/60 decodes" in v_busy.headline
    assert v_busy.call == v_quiet.call == "faster"          # reported, not a refusal
    # negative control: a verdict that ignores the host record misses the busy run
    assert "host_contention" not in verdict.decide(hand_built(), CPU_MANIFEST).flags
    # out of scope: GPU arms (the host thread may sleep in a synchronisation), unmeasured decodes,
    # runs written before the column existed
    gpu = dict(MANIFEST, arms={a: {"device": "cuda:0"} for a in ("control", "candidate")})
    assert stats.host_contention(_host_requests(contended=30), gpu) is None
    unmeasured = _host_requests(contended=30).assign(cpu_ns=-1)
    assert stats.host_contention(unmeasured, CPU_MANIFEST) is None
    assert stats.host_contention(_host_requests().drop(columns="cpu_ns"), CPU_MANIFEST) is None


def test_step_clocks_that_differ_are_flagged():
    """Arms whose steps are timed differently (the device loop's %globaltimer against the host loop's
    perf_counter, or a revision from before the host loop counted its reads between steps) get a flag
    and a caveat in the headline; the same clock on both sides, or a manifest without clocks, none."""
    def manifest(control, candidate):
        return {**MANIFEST, "arms": {"control": {"step_clock": control}, "candidate": {"step_clock": candidate}}}

    host, dev = "host perf_counter, step to step", "device %globaltimer, step to step"
    v = verdict.decide(hand_built(), manifest(host, dev))
    assert "step_clocks_differ" in v.flags
    assert "step clocks differ (control: host perf_counter" in v.headline
    for same in (manifest(host, host), manifest(dev, dev), MANIFEST):
        assert "step_clocks_differ" not in verdict.decide(hand_built(), same).flags


def test_an_arms_step_clock_defaults_to_the_legacy_one():
    """An engine from before ``Engine.step_clock`` timed only each step's pieces; the harness names
    that clock, so a run against such a control is flagged by the rule above."""
    import types

    from replay import arms
    from runtime.engine import Engine
    assert arms.step_clock(types.SimpleNamespace(execution="captured")) == arms.LEGACY_STEP_CLOCK
    eng = Engine.build("q1-tiny", {"device": "cpu"})
    assert arms.step_clock(eng) == "host perf_counter, step to step" != arms.LEGACY_STEP_CLOCK
    eng.execution = "device"
    assert arms.step_clock(eng) == "device %globaltimer, step to step"
