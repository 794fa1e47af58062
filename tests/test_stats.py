"""Statistics against synthetic data with known answers, each beside a negative control that must fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from analysis import rawio, stats, synthetic

N_DATASETS = 200
SMALL = dict(n_requests=30, output_min=48, output_max=128)  # cheap datasets for Monte-Carlo checks


def simulated_run(**kw) -> rawio.RunData:
    spec = synthetic.SyntheticSpec(**kw)
    steps, requests, manifest = synthetic.simulate(spec)
    return rawio.RunData(rawio.Path("<simulated>"), manifest, steps, requests, [])


def request_level_ci(run: rawio.RunData, n_boot: int = 1000, seed: int = 0):
    """The harness's interval: per-request log TPOT ratios, bootstrap over requests."""
    req = stats.request_metrics(stats.decode_metrics(run.steps), run.requests)
    x = stats.paired_table(req, "candidate")["tpot"].to_numpy()
    return stats.bootstrap_ci(x, n_boot=n_boot, rng=seed)


def step_level_ci(run: rawio.RunData, n_boot: int = 0, seed: int = 0):
    """Deliberately wrong: every step a unit. Pairs candidate and control steps of the same
    (request, rep, step) and takes a normal interval of the mean per-step log duration ratio,
    ignoring that steps of one request share its random effect and decode noise."""
    s = run.steps.loc[~run.steps["warmup"]]
    s = s.assign(logd=np.log((s["t_end_ns"] - s["t_start_ns"]).astype(float)))
    key = ["request_id", "rep", "step"]
    c = s[s["arm"] == "candidate"].set_index(key)["logd"]
    b = s[s["arm"] == "control"].set_index(key)["logd"]
    d = (c - b).dropna().to_numpy()
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
    return (d.mean() - half, d.mean() + half)


@pytest.fixture(scope="module")
def coverage_runs():
    """Datasets with a 2% speed-up that varies per request; truth on the log scale."""
    truth = math.log(0.98)
    # 50 requests: with rare latency spikes the per-request ratios are heavy-tailed, and at 30
    # requests the bootstrap interval undercovers (about 87%); real runs have hundreds
    kw = dict(SMALL, n_requests=50)
    runs = [simulated_run(seed=1000 + i, latency_effect=truth, request_effect_sd=0.02, **kw)
            for i in range(N_DATASETS)]
    return truth, runs


def coverage(ci_fn, truth, runs) -> float:
    hits = 0
    for i, run in enumerate(runs):
        lo, hi = ci_fn(run, seed=i)
        hits += lo <= truth <= hi
    return hits / len(runs)


def test_ci_coverage_request_level(coverage_runs):
    truth, runs = coverage_runs
    cov = coverage(request_level_ci, truth, runs)
    assert 0.90 <= cov <= 0.99, f"coverage {cov}"


def test_ci_coverage_negative_control_step_level_fails(coverage_runs):
    truth, runs = coverage_runs
    cov = coverage(step_level_ci, truth, runs)
    assert not (0.90 <= cov <= 0.99), f"a step-level CI passed the coverage check ({cov})"


def _manual_metrics(steps, request_id, arm, include_warmup=False):
    s = steps[(steps["request_id"] == request_id) & (steps["arm"] == arm)]
    kept = s if include_warmup else s[~s["warmup"]]
    dur = float((kept["t_end_ns"] - kept["t_start_ns"]).sum())
    tok = float(kept["emitted"].sum())
    n = len(kept)
    return dur / tok, dur / n, tok / n, (s, kept)


def test_decomposition_identity_exact():
    run = simulated_run(seed=7, n_requests=40, latency_effect=0.01, acceptance_multiplier=1.1,
                        expect_bit_exact=False)
    a = stats.analyze(run, n_boot=200)
    assert a.identity_residual < 1e-12
    per = a.per_request
    np.testing.assert_allclose(per["tpot"], per["step"] - per["tps"], rtol=0, atol=1e-12)
    # the effects obey it too (means are linear) and both parts are really non-zero here
    e = a.effects
    assert abs(e["tpot"].mean - (e["step"].mean - e["tps"].mean)) < 1e-12
    assert e["tps"].mean > 0.02 and e["step"].mean > 0.0
    # independent recomputation from the raw rows for one request
    rid = per.index[0]
    tc, sc, kc, _ = _manual_metrics(run.steps, rid, "candidate")
    tb, sb, kb, _ = _manual_metrics(run.steps, rid, "control")
    assert per.loc[rid, "tpot"] == pytest.approx(math.log(tc / tb), abs=1e-12)
    assert per.loc[rid, "step"] == pytest.approx(math.log(sc / sb), abs=1e-12)
    assert per.loc[rid, "tps"] == pytest.approx(math.log(kc / kb), abs=1e-12)


def test_decomposition_negative_control_mixed_definitions_break_identity():
    """Tokens per step counted with warm-up steps while TPOT excludes them: the identity check
    must catch the inconsistency."""
    run = simulated_run(seed=7, n_requests=10, acceptance_multiplier=1.1, expect_bit_exact=False)
    worst = 0.0
    for rid in run.requests["request_id"].unique():
        t, s, _, _ = _manual_metrics(run.steps, rid, "control")
        _, _, k_all, _ = _manual_metrics(run.steps, rid, "control", include_warmup=True)
        worst = max(worst, abs(math.log(t) - (math.log(s) - math.log(k_all))))
    assert worst > 1e-3


def test_hodges_lehmann_and_signed_rank_table():
    assert stats.hodges_lehmann(np.array([1.0, 2.0, 3.0]))[0] == 2.0
    cdf = stats._signed_rank_cdf(10)  # tabulated: P(T+ <= 8) = 0.0244 for n = 10
    assert cdf[8] == pytest.approx(0.0244, abs=5e-4) and cdf[9] > 0.025
    rng = np.random.default_rng(0)
    x = 0.3 + rng.standard_normal(60)
    est, lo, hi = stats.hodges_lehmann(x)
    assert lo < est < hi and lo < 0.3 < hi
    # normal approximation (n > 100) and exact branch agree near the boundary
    y = rng.standard_normal(101)
    _, lo_a, hi_a = stats.hodges_lehmann(y)
    _, lo_e, hi_e = stats.hodges_lehmann(y[:100])
    assert abs(lo_a - lo_e) < 0.1 and abs(hi_a - hi_e) < 0.1


def test_degenerate_inputs():
    z = np.zeros(20)
    assert stats.wilcoxon_p(z) == 1.0
    assert stats.bootstrap_ci(z) == (0.0, 0.0)
    assert all(math.isnan(v) for v in stats.bootstrap_ci([1.0]))


def test_min_detectable_effect_matches_normal_formula():
    mde = stats.min_detectable_effect(0.02, 400)
    assert mde == pytest.approx((1.959964 + 0.841621) * 0.02 / 20, rel=0.01)
    assert stats.min_detectable_effect(0.02, 100) == pytest.approx(2 * mde, rel=0.02)


def bit_exact_by_sha(run):
    a = stats.analyze(run, n_boot=100)
    return set(a.per_request.index[a.per_request["bit_exact"] == 0])


def bit_exact_by_length(run):
    """Deliberately weak: compares the number of emitted tokens, not the tokens."""
    r = run.requests.pivot_table(index="request_id", columns="arm", values="n_tokens", aggfunc="first")
    return set(r.index[r["candidate"] != r["control"]])


def _true_differences(run):
    toks = {}
    for (rid, arm), g in run.steps.sort_values("step").groupby(["request_id", "arm"]):
        toks[(rid, arm)] = np.concatenate(g["tokens"].to_list())
    ids = run.requests["request_id"].unique()
    return {rid for rid in ids if not np.array_equal(toks[(rid, "candidate")], toks[(rid, "control")])}


def check_bit_exact_detector(detector) -> bool:
    spec = synthetic.SyntheticSpec(seed=3, n_requests=60, nonexact_fraction=0.1, **{
        k: v for k, v in SMALL.items() if k != "n_requests"})
    steps, requests, manifest = synthetic.simulate(spec, with_tokens=True)
    run = rawio.from_frames(steps, requests, manifest)
    truth = _true_differences(run)
    return len(truth) > 0 and detector(run) == truth


def test_bit_exact_detection():
    assert check_bit_exact_detector(bit_exact_by_sha)


def test_bit_exact_negative_control_length_only_fails():
    assert not check_bit_exact_detector(bit_exact_by_length)


def test_drift_detected_and_environment_drift_cancels():
    drifting = stats.analyze(simulated_run(seed=11, n_requests=150, drift_effect=0.04), n_boot=200)
    d = drifting.drift["effect"]
    assert d.ci[0] > 0 and d.p < 0.05  # the effect grows over the run
    assert stats.pct(d.total) == pytest.approx(4.0, abs=2.0)
    # negative control: every arm slows down together; the paired effect shows no drift, while
    # the environment's own drift is seen
    env = stats.analyze(simulated_run(seed=11, n_requests=150, drift_env=0.10), n_boot=200)
    assert env.drift["effect"].ci[0] <= 0 <= env.drift["effect"].ci[1]
    assert env.drift["environment"].ci[0] > 0
    assert env.effects["tpot"].ci[0] <= 0 <= env.effects["tpot"].ci[1]


def test_aa_adjusted_effect_removes_offset():
    run = simulated_run(seed=5, n_requests=80, latency_effect=0.03, aa_offset=0.03)
    a = stats.analyze(run, n_boot=500)
    assert a.adjusted.ci[0] <= 0 <= a.adjusted.ci[1]
    # request-only interval: clearly above 0; the A/A arm's 3% offset widens the reported one so
    # that an arm offset of that size is not mistaken for the candidate's effect
    assert a.effects["tpot"].ci_requests[0] > 0 and a.effects["tpot"].arm_sd == pytest.approx(0.03, abs=0.006)
    assert a.effects["tpot"].ci[0] < a.effects["tpot"].ci_requests[0]
    assert stats.analyze(run, n_boot=500, widen=False).effects["tpot"].ci[0] > 0
    per = a.per_request
    np.testing.assert_allclose(per["adj_tpot"], per["tpot"] - per["aa_tpot"], atol=1e-15)


def test_reps_are_averaged_per_request():
    a = stats.analyze(simulated_run(seed=2, n_requests=20, reps=3, latency_effect=-0.02), n_boot=200)
    assert a.n_requests == 20 and (a.per_request["n_reps"] == 3).all()
    assert len(a.decodes) == 20 * 3 * 3


def _arm_offset_coverage(arm_offset_sd: float, n: int = 300, truth: float = 0.05):
    """Coverage of the request-only, the widened and the floored TPOT interval over n simulated runs in
    which every arm carries its own random offset (the same for all its requests). The floor is the
    contrast's true offset sd, sqrt(2) x each arm's (what a calibration's pooled estimate measures)."""
    naive = widened = floored = 0
    floor = math.sqrt(2) * arm_offset_sd
    for i in range(n):
        run = simulated_run(seed=3000 + i, n_requests=30, output_min=48, output_max=128,
                            latency_effect=truth, arm_offset_sd=arm_offset_sd)
        req = stats.request_metrics(stats.decode_metrics(run.steps), run.requests)
        c = stats.summarize(stats.paired_table(req, "candidate")["tpot"], "tpot", "candidate", "control",
                            n_boot=500, seed=i)
        a = stats.summarize(stats.paired_table(req, "aa")["tpot"], "tpot", "aa", "control", n_boot=500, seed=i)
        w = stats.widen_for_arm_offset(c, stats.arm_offset_sd(a))
        f = stats.widen_for_arm_offset(c, max(stats.arm_offset_sd(a), floor))
        naive += c.ci[0] <= truth <= c.ci[1]
        widened += w.ci[0] <= truth <= w.ci[1]
        floored += f.ci[0] <= truth <= f.ci[1]
    return naive / n, widened / n, floored / n


def test_arm_offsets_widened_interval_recovers_coverage():
    """Arm offsets as large as the request noise (contrast sd ~ 1 se): the request-only interval
    (negative control) under-covers; the interval widened by the A/A arm's offset gets close to
    nominal. Without offsets the widening costs little."""
    # (150 and 75 simulated runs: 0.78 / 0.89 and 0.93 / 0.96; 300 and 150, 45 s more of CI, read
    # 0.77 / 0.87 and 0.94 / 0.96)
    naive, widened, floored = _arm_offset_coverage(0.004, n=150)
    assert naive < 0.85, f"request-only interval covered {naive}: the offsets are too small to test"
    assert widened >= 0.87 and widened - naive >= 0.05, (naive, widened)
    # one run's A/A estimate of the offset is mostly 0 or too small: a calibrated floor covers more
    assert floored >= 0.92 and floored - widened >= 0.02, (naive, widened, floored)
    naive0, widened0, floored0 = _arm_offset_coverage(0.0, n=75)
    assert 0.9 <= naive0 <= widened0 == floored0 <= 0.99, (naive0, widened0, floored0)


def test_analyze_widens_by_the_recorded_arm_sd_floor():
    """A run records its floor (replay.paired's arm_sd_floor): analyze widens the candidate's intervals
    by max(the A/A arm's offset, floor); a run recorded without one is analysed as before (control)."""
    run = simulated_run(seed=11, n_requests=24, latency_effect=0.02)
    plain = stats.analyze(run, n_boot=300)
    assert stats.recorded_arm_sd_floor(run.manifest) == 0.0 and plain.settings["arm_sd_floor"] == 0.0
    assert stats.analyze(run, n_boot=300, arm_sd_floor=0.0).effects["tpot"].ci == plain.effects["tpot"].ci
    floor = 0.01
    assert stats.arm_offset_sd(plain.aa["tpot"]) < floor      # the floor is what widens here
    recorded = rawio.RunData(run.run_dir, {**run.manifest, "analysis": {"arm_sd_floor": floor}}, run.steps,
                             run.requests, [])
    a = stats.analyze(recorded, n_boot=300)
    assert a.settings["arm_sd_floor"] == floor
    for m in ("tpot", "step", "tps"):
        e, p = a.effects[m], plain.effects[m]
        assert e.arm_sd == floor and e.ci_requests == (p.ci_requests or p.ci), m
        h = 1.959963984540054 * floor
        assert e.ci[0] == pytest.approx(e.mean - math.hypot(e.mean - e.ci_requests[0], h))
        # the detectable effect grows with it: the same multiple of sqrt(se^2 + floor^2) as of se
        if p.se > 0:     # (tokens per step: every request the same, no spread to scale)
            assert e.mde == pytest.approx(p.mde / p.se * math.hypot(p.se, floor)) and e.mde > p.mde, m
    assert a.effects["tpot"].mde > plain.effects["tpot"].mde
    assert a.effects["steps"].ci == plain.effects["steps"].ci        # not a latency: not widened
    assert a.aa["tpot"].ci == plain.aa["tpot"].ci                    # the A/A effect is the estimator
    assert a.adjusted.arm_sd == floor
    # a run without an A/A arm: the floor alone
    no_aa = simulated_run(seed=11, n_requests=24, latency_effect=0.02, arms=("control", "candidate"))
    b = stats.analyze(no_aa, n_boot=300, arm_sd_floor=floor)
    assert not b.aa and b.effects["tpot"].arm_sd == floor
    assert stats.analyze(no_aa, n_boot=300).effects["tpot"].ci_requests is None
    for bad in (-0.001, "x", float("nan")):
        with pytest.raises(ValueError, match="arm_sd_floor"):
            stats.recorded_arm_sd_floor({"analysis": {"arm_sd_floor": bad}})


def test_widening_arithmetic():
    e = stats.summarize(np.array([0.01, 0.03, 0.02, 0.05, 0.04, 0.02]), "tpot", "candidate", "control", n_boot=200)
    aa_small = stats.summarize(np.array([0.001, -0.002, 0.0015, -0.001, 0.0, 0.002]), "tpot", "aa", "control",
                               n_boot=200)
    assert stats.arm_offset_sd(aa_small) == 0.0 and stats.widen_for_arm_offset(e, 0.0) is e
    aa = stats.summarize(np.array([0.050, 0.052, 0.049, 0.051, 0.050, 0.048]), "tpot", "aa", "control", n_boot=200)
    tau = stats.arm_offset_sd(aa)
    assert tau == pytest.approx(math.sqrt(aa.mean ** 2 - aa.sd ** 2 / aa.n))
    w = stats.widen_for_arm_offset(e, tau)
    h = 1.959963984540054 * tau
    assert w.ci_requests == e.ci and w.arm_sd == tau and w.mean == e.mean
    assert w.ci[0] == pytest.approx(e.mean - math.hypot(e.mean - e.ci[0], h))
    assert w.ci[1] == pytest.approx(e.mean + math.hypot(e.ci[1] - e.mean, h))


def _placement_runs(n: int, epochs: int, offset_sd: float, truth: float = 0.02):
    """Coverage of the TPOT interval and how often the A/A interval excludes 0, clustered by placement
    epoch and not (requests as independent units), over n simulated GPU-like runs: little request
    noise, and every arm's offset drawn again at each of ``epochs`` epochs of 32 requests."""
    out = {"clustered": [0, 0], "requests": [0, 0]}
    for i in range(n):
        steps, req, _ = synthetic.simulate(synthetic.SyntheticSpec(
            seed=5000 + i, n_requests=32, output_min=48, output_max=128, latency_effect=truth,
            arm_offset_sd=offset_sd, placement_epochs=epochs, step_noise_sd=0.01, decode_noise_sd=0.002,
            spike_prob=0.0))
        r = stats.request_metrics(stats.decode_metrics(steps), req)
        clusters = stats.request_clusters(req)
        c, a = stats.paired_table(r, "candidate"), stats.paired_table(r, "aa")
        for how, cl in (("clustered", clusters), ("requests", None)):
            of = (lambda t: None) if cl is None else (lambda t: cl.reindex(t.index).to_numpy())   # noqa: E731
            e = stats.summarize(c["tpot"], "tpot", "candidate", "control", n_boot=300, seed=i, clusters=of(c))
            aa = stats.summarize(a["tpot"], "tpot", "aa", "control", n_boot=300, seed=i, clusters=of(a))
            out[how][0] += e.ci[0] <= truth <= e.ci[1]
            out[how][1] += not aa.ci[0] <= 0 <= aa.ci[1]
    return {k: (v[0] / n, v[1] / n) for k, v in out.items()}


def test_placement_epochs_resampled_as_units_keep_the_interval_honest():
    """The GPU's arm offsets come from where an engine's buffers sit (experiments/placement.py) and are
    shared by every request decoded on one placement. With the placement drawn again per epoch and
    the epochs resampled as units, the interval covers the truth and an A/A arm is rarely called
    different; treating the requests as independent (the negative control) does neither."""
    got = _placement_runs(100, epochs=8, offset_sd=0.005)
    cover, aa_false = got["clustered"]
    assert cover >= 0.86 and aa_false <= 0.12, got
    cover, aa_false = got["requests"]
    assert cover <= 0.8 and aa_false >= 0.2, got


def test_cluster_statistics_and_the_epoch_column():
    x = np.array([0.01, 0.012, 0.03, 0.028, -0.01, -0.008, 0.02, 0.022])
    e = stats.summarize(x, "tpot", "candidate", "control", n_boot=500, clusters=np.repeat([0, 1, 2, 3], 2))
    means = stats.cluster_means(x, np.repeat([0, 1, 2, 3], 2))
    np.testing.assert_allclose(means, [0.011, 0.029, -0.009, 0.021])
    assert e.n_clusters == 4 and e.n == 8 and e.mean == pytest.approx(x.mean())
    assert e.se == pytest.approx(np.std(means, ddof=1) / 2)
    alone = stats.summarize(x, "tpot", "candidate", "control", n_boot=500)
    assert alone.n_clusters is None and (e.ci[1] - e.ci[0]) > 2 * (alone.ci[1] - alone.ci[0])
    # one cluster per request is the request bootstrap itself
    same = stats.summarize(x, "tpot", "candidate", "control", n_boot=500, clusters=np.arange(8))
    assert same.n_clusters is None and same.ci == alone.ci
    # a run with the column: analyze resamples its epochs (cluster=False: the requests)
    run = simulated_run(seed=3, n_requests=24, arm_offset_sd=0.005, placement_epochs=6)
    assert sorted(run.requests["epoch"].unique()) == list(range(6))
    a = stats.analyze(run, n_boot=200)
    assert a.effects["tpot"].n_clusters == 6 and a.aa["tpot"].n_clusters == 6 and a.settings["clusters"] == 6
    alone = stats.analyze(run, n_boot=200, cluster=False)
    assert alone.effects["tpot"].n_clusters is None
    width = lambda bins: float((bins["hi"] - bins["lo"]).sum())     # noqa: E731
    assert width(a.context_bins) > width(alone.context_bins)       # the bins resample epochs too
    assert a.drift["effect"].n == a.drift["aa"].n == a.drift["environment"].n == 6    # drift: one point an epoch
    assert alone.drift["effect"].n == 24
    # a run that kept its engines (-1, or no column) has no clusters
    assert stats.request_clusters(run.requests.assign(epoch=-1)) is None
    assert stats.request_clusters(run.requests.drop(columns="epoch")) is None


def test_context_slope_takes_one_point_per_epoch():
    """Requests run in context order (``requests.select`` first or spread) fill each placement epoch with
    neighbours, so the arms' epoch offsets read as a slope of the effect over context when every request is
    a point (the negative control: ``cluster=False``); one point per epoch keeps the slope's interval
    honest. No true context effect here: the contexts are reassigned in run order after the simulation."""
    n, wrong = 24, {"epochs": 0, "requests": 0}
    for i in range(n):
        run = simulated_run(seed=900 + i, n_requests=48, output_min=48, output_max=96, arm_offset_sd=0.01,
                            placement_epochs=8, step_noise_sd=0.01, decode_noise_sd=0.002, spike_prob=0.0)
        req = run.requests
        first = req.groupby("request_id")["order"].min().sort_values()
        ctx = np.sort(req.groupby("request_id")["context_len"].first().to_numpy())
        run.requests = req.assign(context_len=req["request_id"].map(dict(zip(first.index, ctx))))
        for how, cluster in (("epochs", True), ("requests", False)):
            c = stats.analyze(run, n_boot=20, cluster=cluster).context_slope
            wrong[how] += not (c.ci[0] <= 0 <= c.ci[1])
            if how == "epochs":
                assert c.n == 8
    # (deterministic: seeded runs and bootstraps; measured 0 of 24 against 12 of 24)
    assert wrong["epochs"] <= 0.15 * n and wrong["requests"] >= 0.4 * n, wrong


def _three_arm_runs(n_runs: int, offsets: dict, seed: int, n: int = 32, noise: float = 0.01) -> list:
    """Per run, per-request (candidate / control, aa / control) log ratios: every arm's request noise plus a
    run-level offset per arm drawn with sd ``offsets[arm]``."""
    rng = np.random.default_rng(seed)
    runs = []
    for _ in range(n_runs):
        o = {a: rng.normal(0, offsets.get(a, 0.0)) for a in ("control", "candidate", "aa")}
        x = {a: o[a] + rng.normal(0, noise, n) for a in o}
        runs.append(np.column_stack([x["candidate"] - x["control"], x["aa"] - x["control"]]))
    return runs


def test_arm_offset_components_name_the_arm_that_carries_the_offset():
    """An offset on one arm shows in that arm's component and not the others', whichever arm it is (the
    control's moves both contrasts together); without offsets every component is near 0 (the negative
    control: request noise alone is not called an offset)."""
    tau = 0.004      # 2.3 x the request se (0.01 * sqrt(2 / 32)): visible over 200 runs
    for k, arm in enumerate(("control", "candidate", "aa")):
        c = stats.arm_offset_components(_three_arm_runs(200, {arm: tau}, seed=k))
        assert c[arm] == pytest.approx(tau ** 2, rel=0.35), (arm, c)
        others = [v for a, v in c.items() if a != arm]
        assert max(abs(v) for v in others) < 0.3 * tau ** 2, (arm, c)
    none = stats.arm_offset_components(_three_arm_runs(200, {}, seed=7))
    assert max(abs(v) for v in none.values()) < 0.3 * tau ** 2, none
    # too few runs to say anything
    assert all(math.isnan(v) for v in stats.arm_offset_components(_three_arm_runs(2, {}, seed=1)).values())
