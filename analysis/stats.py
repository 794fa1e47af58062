"""Paired statistics of a replay, with the request as the unit. Computes; decides nothing.

Definitions (warm-up steps excluded everywhere):

- per decode of a (request, arm, rep): ``duration`` = sum of step durations (``t_end_ns -
  t_start_ns``), ``tokens`` = sum of ``emitted``, ``steps`` = number of steps;
  TPOT = duration / tokens, step latency = duration / steps, tokens per step = tokens / steps.
  Hence TPOT = step latency / tokens per step exactly, and on the log scale
  ``log TPOT = log step latency - log tokens per step``.
- per (request, arm): the mean over reps of each log metric (a geometric mean), so the identity
  survives the averaging.
- per request: the paired log-ratio ``log(candidate) - log(control)`` of each metric, and the same
  for ``aa`` against control. The A/A-adjusted effect is ``log(cand/ctrl) - log(aa/ctrl)``.
  Because the ratios are differences of the same logs, the decomposition
  ``tpot = step - tps`` holds per request up to rounding; ``Analysis.identity_residual`` is the
  largest violation found (it is computed, never assumed).

An effect is the mean of the per-request log-ratios, with a bootstrap CI that resamples requests
(scipy.stats.bootstrap, BCa by default, seeded numpy Generator), a Wilcoxon signed-rank p-value,
a Hodges-Lehmann estimate with its distribution-free CI, and the minimum detectable effect at the
observed spread (paired, two-sided alpha, power 0.8). Effects are natural-log ratios; ``pct``
turns one into a percent change ``100 * (exp(x) - 1)``. Calibration on synthetic runs with rare
latency spikes (tests/test_stats.py, experiments/harness_calibration.py): the plain BCa interval
covered the true effect in about 93% of datasets at 50-100 requests but only about 87% at 30, so
the interval is expanded by t_{n-1}/z·sqrt(n/(n-1)) around the mean (negligible at 100 requests,
+12% at 16); real-replay calibration: experiments/replay_calibration.py.

Arm offsets. Each arm of a run is one loaded copy of the runtime in one process; its step latency
can carry an offset of its own (memory placement, code layout, allocator state) that is the same
for all requests of the run, so resampling requests cannot see it: on the CPU, 12 real replays
with an injected +10% slowdown scattered 1.3x more between runs than the request-bootstrap
intervals allowed, and 2 of 12 missed the injected value. The A/A arm measures exactly this: its
contrast with control is ``delta_aa - delta_control`` plus request noise, so
``tau^2 = max(0, mean_aa^2 - se_aa^2)`` (se_aa = sd/sqrt(n) of the A/A log-ratios) estimates the
variance an arm offset adds to *any* contrast with control. Each candidate-vs-control interval
(and the A/A-adjusted one) is widened by it in quadrature: half-width_side ->
sqrt(half-width_side^2 + (z tau)^2). ``Effect.ci_requests`` keeps the request-only interval and
``Effect.arm_sd`` the tau used (0 when the A/A arm shows no offset beyond its own noise). The A/A
effect itself is not widened (it is the estimator).

The arm-offset floor. One run's tau is one draw of an offset against its own noise, mostly 0, and a
plug-in that is mostly 0 widens too little on average. The run records a floor
(``manifest["analysis"]["arm_sd_floor"]``, from ``replay.paired``'s ``arm_sd_floor``) and the
candidate's intervals are widened by ``max(tau, floor)`` (by the floor alone when the run has no A/A
arm). On the H200 (q1-mini, device loop, placement epochs; ``experiments/notes/placement.md``, session
57): over 35 real replays the A/A arm's own intervals held 0 in 33 of 35 (z rms 0.96, no offset beyond
its noise), but those of a candidate identical to control (27 replays) in 20 of 27 before widening (z rms
1.47); the candidate contrasts' pooled offset ``sqrt(mean(m^2 - se^2))`` is 0.167 % (95 %: 0.067-0.231),
so a GPU run's floor is 0.0017. With it every interval whose truth is 0 held it in 59 of 62 (0.952; z rms
0.97; without it 55 of 62, 1.16). A run recorded without a floor is analysed with 0, as it was.

Placement epochs. On a GPU the offsets come from where an arm's buffers sit in memory
(``experiments/notes/placement.md``), and ``replay.paired`` draws a new placement for every arm at each
epoch (``placement.epochs``), recording each decode's epoch. The requests of an epoch share its arms'
offsets, so where an epoch holds several requests the epoch is the unit: intervals (the effects' and
the context bins') resample epochs; the p-value, Hodges-Lehmann estimate, detectable effect and
standard error are the epochs' means', and so are the drift slopes' points. ``Effect.n_clusters`` says how many; ``analyze(cluster=False)``
is the negative control that treats the requests as independent.

Also computed: bit-exactness per request (identical ``tokens_sha`` across arms and reps), drift
(slope of the per-request log-ratio against run order, with CI) and the effect against context
length (slope per doubling, and per context-length bin).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
import zlib

import numpy as np
import pandas as pd
import scipy.stats

from analysis.rawio import DECODE_KEY, RunData

LEVEL = 0.95
ALPHA = 0.05
POWER = 0.8
N_BOOT = 4000
METRICS = ("tpot", "step", "tps", "steps")  # log-ratio columns of the per-request table
METRIC_NAMES = {"tpot": "time per output token", "step": "step latency",
                "tps": "tokens per step", "steps": "steps per request"}


def pct(x: float) -> float:
    """Percent change of a natural-log ratio."""
    return 100.0 * math.expm1(x) if np.isfinite(x) else float("nan")


# --------------------------------------------------------------------------- per decode / request

def decode_metrics(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per (request_id, arm, rep) with duration_ns, tokens, steps, tpot_ns, step_ns,
    tokens_per_step, mean accepted, order. Decodes with no non-warm-up step are left out."""
    s = steps.loc[~steps["warmup"].astype(bool)]
    s = s.assign(duration_ns=(s["t_end_ns"] - s["t_start_ns"]).astype(np.float64))
    g = s.groupby(DECODE_KEY, sort=False)
    d = g.agg(duration_ns=("duration_ns", "sum"), tokens=("emitted", "sum"),
              steps=("step", "size"), accepted=("accepted", "mean"),
              order=("order", "first")).reset_index()
    d = d[(d["tokens"] > 0) & (d["duration_ns"] > 0)]
    d["tpot_ns"] = d["duration_ns"] / d["tokens"]
    d["step_ns"] = d["duration_ns"] / d["steps"]
    d["tokens_per_step"] = d["tokens"] / d["steps"]
    return d.reset_index(drop=True)


def request_metrics(decodes: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """One row per (request_id, arm): mean over reps of log tpot/step/tps/steps, mean order,
    context_len, n_reps."""
    d = decodes.assign(log_tpot=np.log(decodes["tpot_ns"]), log_step=np.log(decodes["step_ns"]),
                       log_tps=np.log(decodes["tokens_per_step"]),
                       log_steps=np.log(decodes["steps"].astype(np.float64)))
    r = d.groupby(["request_id", "arm"], sort=False).agg(
        log_tpot=("log_tpot", "mean"), log_step=("log_step", "mean"), log_tps=("log_tps", "mean"),
        log_steps=("log_steps", "mean"), order=("order", "mean"), n_reps=("rep", "nunique"),
    ).reset_index()
    ctx = requests.groupby("request_id", sort=False)["context_len"].first()
    r["context_len"] = r["request_id"].map(ctx).astype(np.int64)
    return r


def paired_table(req: pd.DataFrame, arm: str, base: str = "control") -> pd.DataFrame:
    """Per-request log-ratios arm/base for requests that have both arms, indexed by request_id."""
    a = req[req["arm"] == arm].set_index("request_id")
    b = req[req["arm"] == base].set_index("request_id")
    ids = a.index.intersection(b.index)
    a, b = a.loc[ids], b.loc[ids]
    out = pd.DataFrame(index=ids)
    for m in METRICS:
        out[m] = a[f"log_{m}"] - b[f"log_{m}"]
        out[f"{base}_log_{m}"] = b[f"log_{m}"]
        out[f"{arm}_log_{m}"] = a[f"log_{m}"]
    out["order"] = (a["order"] + b["order"]) / 2
    out["context_len"] = b["context_len"]
    out["n_reps"] = np.minimum(a["n_reps"], b["n_reps"])
    return out


def request_clusters(requests: pd.DataFrame) -> pd.Series | None:
    """Per request, the placement epochs its decodes ran in (``epoch``, written by a replay that
    rebuilds its arms' engines between epochs: ``placement.epochs``), as one key; None when the run
    recorded none (every request its own unit)."""
    if "epoch" not in requests.columns or not (requests["epoch"] >= 0).all():
        return None
    return requests.groupby("request_id", sort=False)["epoch"].agg(
        lambda e: ",".join(str(v) for v in sorted(set(int(x) for x in e))))


def bit_exactness(requests: pd.DataFrame) -> pd.DataFrame:
    """Per request: whether every decode of each pair of arms (all reps) has the same tokens_sha.

    Columns: candidate (vs control), aa (vs control), control_reproducible (all control reps
    identical); NaN where an arm is absent."""
    shas = requests.groupby(["request_id", "arm"])["tokens_sha"].agg(lambda s: frozenset(s))
    shas = shas.unstack("arm")
    out = pd.DataFrame(index=shas.index)
    ctrl = shas["control"] if "control" in shas else pd.Series(np.nan, index=shas.index)

    def same(x, y):
        if not isinstance(x, frozenset) or not isinstance(y, frozenset):
            return np.nan
        return float(len(x | y) == 1)

    for arm in ("candidate", "aa"):
        other = shas[arm] if arm in shas else pd.Series(np.nan, index=shas.index)
        out[arm] = [same(x, y) for x, y in zip(ctrl, other)]
    out["control_reproducible"] = [float(len(x) == 1) if isinstance(x, frozenset) else np.nan
                                   for x in ctrl]
    return out


# --------------------------------------------------------------------------- one-sample inference

# scipy >= 1.15 takes the Generator as ``rng``; older releases as ``random_state``
_RNG_KW = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def bootstrap_ci(x, level: float = LEVEL, n_boot: int = N_BOOT,
                 rng: np.random.Generator | int | None = 0, method: str = "BCa") -> tuple[float, float]:
    """CI of the mean of ``x`` by resampling its elements (the requests). Degenerate input
    (all equal) gives a zero-width interval; fewer than 2 values give NaNs."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2:
        return (float("nan"), float("nan"))
    if np.all(x == x[0]):
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap((x,), np.mean, n_resamples=n_boot, confidence_level=level,
                                    method=method, vectorized=True, axis=-1, **{_RNG_KW: rng})
    lo, hi = res.confidence_interval
    if not (np.isfinite(lo) and np.isfinite(hi)) and method.lower() == "bca":
        return bootstrap_ci(x, level, n_boot, rng, "percentile")
    # Small-sample expansion (Hesterberg's "expanded" bootstrap): a bootstrap interval is about
    # z·sd/√n wide where t_{n-1}·sd/√(n-1) is due, so it under-covers at a few dozen requests.
    m = float(np.mean(x))
    z = scipy.stats.norm.ppf(0.5 + level / 2)
    k = scipy.stats.t.ppf(0.5 + level / 2, len(x) - 1) / z * math.sqrt(len(x) / (len(x) - 1))
    return (m - k * (m - float(lo)), m + k * (float(hi) - m))


def cluster_bootstrap_ci(x, clusters, level: float = LEVEL, n_boot: int = N_BOOT,
                         rng: np.random.Generator | int | None = 0, method: str = "BCa") -> tuple[float, float]:
    """CI of the mean of ``x`` by resampling whole clusters (``clusters[i]``: the cluster of ``x[i]``):
    requests that share a placement epoch share its arms' offsets, so they are resampled together.
    The statistic is the request mean of the resampled clusters (sum of their sums over the sum of
    their sizes); the small-sample expansion counts clusters."""
    x = np.asarray(x, dtype=np.float64)
    keys, inv = np.unique(np.asarray(clusters), return_inverse=True)
    k = len(keys)
    if k < 2:
        return (float("nan"), float("nan"))
    sums = np.bincount(inv, weights=x, minlength=k)
    sizes = np.bincount(inv, minlength=k).astype(np.float64)
    m = float(sums.sum() / sizes.sum())
    if np.all(x == x[0]):
        return (float(x[0]), float(x[0]))
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng

    def ratio(s, c, axis=-1):
        return s.sum(axis=axis) / c.sum(axis=axis)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = scipy.stats.bootstrap((sums, sizes), ratio, paired=True, n_resamples=n_boot,
                                    confidence_level=level, method=method, vectorized=True, axis=-1,
                                    **{_RNG_KW: rng})
    lo, hi = res.confidence_interval
    if not (np.isfinite(lo) and np.isfinite(hi)) and method.lower() == "bca":
        return cluster_bootstrap_ci(x, clusters, level, n_boot, rng, "percentile")
    z = scipy.stats.norm.ppf(0.5 + level / 2)
    e = scipy.stats.t.ppf(0.5 + level / 2, k - 1) / z * math.sqrt(k / (k - 1))
    return (m - e * (m - float(lo)), m + e * (float(hi) - m))


def cluster_means(x, clusters) -> np.ndarray:
    """The mean of ``x`` within each cluster (in the order of the sorted cluster keys)."""
    x = np.asarray(x, dtype=np.float64)
    _, inv = np.unique(np.asarray(clusters), return_inverse=True)
    return np.bincount(inv, weights=x) / np.bincount(inv)


def wilcoxon_p(x) -> float:
    """Two-sided Wilcoxon signed-rank p-value of ``x`` against 0 (zeros dropped; all zero: 1)."""
    x = np.asarray(x, dtype=np.float64)
    if np.count_nonzero(x) == 0:
        return 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(scipy.stats.wilcoxon(x, zero_method="wilcox").pvalue)


def _signed_rank_cdf(n: int) -> np.ndarray:
    """Exact null CDF of the signed-rank statistic T+ for n untied values: P(T+ <= k), k=0..M."""
    p = np.zeros(n * (n + 1) // 2 + 1)
    p[0] = 1.0
    for k in range(1, n + 1):
        shifted = np.zeros_like(p)
        shifted[k:] = p[:-k]
        p = 0.5 * (p + shifted)
    return np.cumsum(p)


def hodges_lehmann(x, level: float = LEVEL) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate (median of Walsh averages) and its signed-rank CI (exact null
    distribution up to n=100, normal approximation beyond). With too few values for the level the
    interval is the full range of Walsh averages."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n == 0:
        return (float("nan"),) * 3
    i, j = np.triu_indices(n)
    w = np.sort((x[i] + x[j]) / 2.0)
    m = len(w)
    est = float(np.median(w))
    half = (1.0 - level) / 2.0
    if n <= 100:
        c = int(np.count_nonzero(_signed_rank_cdf(n) <= half))
    else:
        z = scipy.stats.norm.ppf(1.0 - half)
        c = int(math.floor(m / 2.0 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)))
    if c < 1:
        return (est, float(w[0]), float(w[-1]))
    return (est, float(w[c - 1]), float(w[m - c]))


def min_detectable_effect(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Smallest true mean log-ratio a paired two-sided test at ``alpha`` finds with ``power``,
    at spread ``sd`` of the per-request log-ratios over ``n`` requests (t approximation)."""
    if n < 2 or not np.isfinite(sd):
        return float("nan")
    t = scipy.stats.t
    return float((t.ppf(1 - alpha / 2, n - 1) + t.ppf(power, n - 1)) * sd / math.sqrt(n))


@dataclasses.dataclass
class Effect:
    """Mean per-request log-ratio ``arm/base`` of one metric, with its uncertainty."""
    metric: str
    arm: str
    base: str
    n: int
    mean: float
    ci: tuple[float, float]
    p: float                      # Wilcoxon signed-rank, two-sided
    hl: float                     # Hodges-Lehmann estimate
    hl_ci: tuple[float, float]
    sd: float                     # spread of the per-request log-ratios
    mde: float                    # minimum detectable |mean| (alpha, power 0.8)
    before: float                 # geometric mean of the metric in ``base`` over the same requests
    after: float                  # ... in ``arm``
    level: float = LEVEL
    ci_requests: tuple[float, float] | None = None   # before widening for the arm offset (None: not widened)
    arm_sd: float = 0.0           # tau: the arm-offset sd the interval was widened by
    n_clusters: int | None = None  # placement epochs resampled as units (None: requests are the units)
    se: float = float("nan")      # standard error of ``mean``: over clusters when there are clusters

    @property
    def ratio(self) -> float:
        return math.exp(self.mean)

    @property
    def pct(self) -> float:
        return pct(self.mean)

    @property
    def pct_ci(self) -> tuple[float, float]:
        return (pct(self.ci[0]), pct(self.ci[1]))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ratio=self.ratio, pct=self.pct, pct_ci=list(self.pct_ci),
                 hl_pct=pct(self.hl), hl_pct_ci=[pct(v) for v in self.hl_ci], mde_pct=pct(self.mde))
        d["ci"], d["hl_ci"] = list(self.ci), list(self.hl_ci)
        d["ci_requests"] = list(self.ci_requests) if self.ci_requests is not None else None
        return d


def arm_offset_sd(aa: Effect) -> float:
    """tau: sd of an arm offset against control, from the A/A contrast (method of moments, >= 0)."""
    if aa is None or aa.n < 2 or not (math.isfinite(aa.mean) and math.isfinite(aa.se)):
        return 0.0
    return math.sqrt(max(0.0, aa.mean ** 2 - aa.se ** 2))


def pooled_arm_offset(means, ses) -> float:
    """tau over several runs: sqrt(mean(m^2 - se^2)) of their contrasts ``means`` with standard errors ``ses``
    (``arm_offset_sd``'s method of moments, pooled over runs instead of one run; 0 when negative)."""
    m, se = np.asarray(means, dtype=np.float64), np.asarray(ses, dtype=np.float64)
    return math.sqrt(max(0.0, float(np.mean(m ** 2 - se ** 2)))) if len(m) else float("nan")


def arm_offset_components(contrasts) -> dict:
    """Which arm carries a run-level offset, from runs whose three arms run the same code. ``contrasts``:
    per run an (n, 2) array of per-request log ratios (candidate / control, A/A / control). Across runs the
    two contrasts' means vary by their request noise (each run's own covariance of the per-request pairs
    over n) plus the arms' offsets: var(cand - ctrl) = v_cand + v_ctrl, var(aa - ctrl) = v_aa + v_ctrl, and
    their covariance v_ctrl. Method of moments: the variances of each arm's offset (negative when the
    runs scatter less than their request noise), keyed control / candidate / aa."""
    runs = [np.asarray(c, dtype=np.float64) for c in contrasts]
    runs = [c[np.isfinite(c).all(axis=1)] for c in runs]
    runs = [c for c in runs if len(c) >= 3]
    if len(runs) < 3:
        return {k: float("nan") for k in ("control", "candidate", "aa")}
    means = np.array([c.mean(axis=0) for c in runs])
    noise = np.mean([np.cov(c.T) / len(c) for c in runs], axis=0)
    o = np.cov(means.T) - noise
    return {"control": float(o[0, 1]), "candidate": float(o[0, 0] - o[0, 1]), "aa": float(o[1, 1] - o[0, 1])}


def widen_for_arm_offset(e: Effect, tau: float) -> Effect:
    """``e`` with its interval widened in quadrature by z * tau on each side (see module docstring), and
    its detectable effect with it: the same multiple of sqrt(se^2 + tau^2) as it was of se."""
    if not (tau > 0 and all(math.isfinite(v) for v in e.ci)):
        return e
    h = scipy.stats.norm.ppf(0.5 + e.level / 2) * tau
    lo, hi = e.ci
    ci = (e.mean - math.hypot(e.mean - lo, h), e.mean + math.hypot(hi - e.mean, h))
    mde = math.hypot(e.mde, e.mde / e.se * tau) if e.se > 0 and math.isfinite(e.mde) else e.mde
    return dataclasses.replace(e, ci=ci, ci_requests=(lo, hi), arm_sd=tau, mde=mde)


def summarize(x, metric: str, arm: str, base: str, before_logs=None, after_logs=None,
              level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0,
              method: str = "BCa", alpha: float = ALPHA, clusters=None) -> Effect:
    """Every statistic of one set of per-request log-ratios ``x``. ``clusters`` (one key per request,
    e.g. its placement epochs): when fewer distinct than requests, the clusters are the units, since
    their requests share the arms' offsets: the CI resamples clusters, the p-value, Hodges-Lehmann
    estimate and detectable effect are those of the cluster means. ``mean`` and ``sd`` stay the
    requests'."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    sd = float(np.std(x, ddof=1)) if n > 1 else float("nan")
    gm = lambda v: float(np.exp(np.mean(v))) if v is not None and len(v) else float("nan")  # noqa: E731
    rng = _rng(seed, f"{arm}/{base}/{metric}")
    k = len(np.unique(np.asarray(clusters))) if clusters is not None and n else n
    if k < n:
        units = cluster_means(x, clusters)
        ci = cluster_bootstrap_ci(x, clusters, level, n_boot, rng, method)
    else:
        units, k = x, None
        ci = bootstrap_ci(x, level, n_boot, rng, method)
    mean = float(np.mean(x)) if n else float("nan")
    m = len(units)
    usd = float(np.std(units, ddof=1)) if m > 1 else float("nan")
    hl, hlo, hhi = hodges_lehmann(units, level)
    return Effect(metric=metric, arm=arm, base=base, n=n, mean=mean, ci=ci,
                  p=wilcoxon_p(units) if m else float("nan"), hl=hl, hl_ci=(hlo, hhi), sd=sd,
                  mde=min_detectable_effect(usd, m, alpha), before=gm(before_logs),
                  after=gm(after_logs), level=level, n_clusters=k,
                  se=usd / math.sqrt(m) if m > 1 else float("nan"))


# --------------------------------------------------------------------------- regressions

@dataclasses.dataclass
class Slope:
    """Least-squares slope of per-request values against ``x`` (other covariates held fixed)."""
    y: str
    x: str
    n: int
    slope: float
    ci: tuple[float, float]
    p: float
    x_span: float                 # max(x) - min(x): slope * x_span is the change over the data

    @property
    def total(self) -> float:
        return self.slope * self.x_span

    @property
    def total_ci(self) -> tuple[float, float]:
        return (self.ci[0] * self.x_span, self.ci[1] * self.x_span)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(ci=list(self.ci), total=self.total, total_ci=list(self.total_ci),
                 total_pct=pct(self.total), total_pct_ci=[pct(v) for v in self.total_ci])
        return d


def ols_slope(y, x, covariates=None, level: float = LEVEL, y_name: str = "y",
              x_name: str = "x") -> Slope:
    """OLS slope of y on x (plus optional covariate columns), classical t-interval."""
    y = np.asarray(y, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    cols = [np.ones_like(x), x] + ([np.asarray(c, dtype=np.float64) for c in covariates]
                                   if covariates is not None else [])
    X = np.column_stack(cols)
    n, k = X.shape
    span = float(np.ptp(x)) if n else float("nan")
    if n <= k or span == 0:
        return Slope(y_name, x_name, n, float("nan"), (float("nan"),) * 2, float("nan"), span)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    s2 = float(resid @ resid) / (n - k)
    cov = s2 * np.linalg.pinv(X.T @ X)
    se = math.sqrt(max(cov[1, 1], 0.0))
    tcrit = scipy.stats.t.ppf(0.5 + level / 2, n - k)
    b = float(beta[1])
    p = float(2 * scipy.stats.t.sf(abs(b) / se, n - k)) if se > 0 else (1.0 if b == 0 else 0.0)
    return Slope(y_name, x_name, n, b, (float(b - tcrit * se), float(b + tcrit * se)), p, span)


def robust_slope(y, x, level: float = LEVEL, y_name: str = "y", x_name: str = "x") -> Slope:
    """Theil-Sen slope of y on x with its CI (one outlying request cannot tilt it), and the
    Kendall-tau p-value of the trend."""
    y = np.asarray(y, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    span = float(np.ptp(x)) if n else float("nan")
    if n < 3 or span == 0:
        return Slope(y_name, x_name, n, float("nan"), (float("nan"),) * 2, float("nan"), span)
    res = scipy.stats.theilslopes(y, x, alpha=level)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = float(scipy.stats.kendalltau(x, y).pvalue)
    return Slope(y_name, x_name, n, float(res.slope), (float(res.low_slope), float(res.high_slope)),
                 p if np.isfinite(p) else 1.0, span)


def context_bins(table: pd.DataFrame, column: str = "tpot", n_bins: int = 4, level: float = LEVEL,
                 n_boot: int = N_BOOT, seed: int = 0, clusters: pd.Series | None = None) -> pd.DataFrame:
    """Mean log-ratio per context-length quantile bin, with bootstrap CIs (resampling the bin's
    placement epochs where ``clusters``, by request, has fewer of them than requests)."""
    n_bins = max(1, min(n_bins, len(table) // 10))
    q = pd.qcut(table["context_len"], n_bins, duplicates="drop") if n_bins > 1 else None
    rows = []
    groups = table.groupby(q, observed=True) if q is not None else [("all", table)]
    for k, (_, t) in enumerate(groups):
        x = t[column].to_numpy()
        rng = _rng(seed, f"ctxbin{k}")
        c = None if clusters is None else clusters.reindex(t.index).to_numpy()
        if c is not None and 1 < len(set(c)) < len(x):
            lo, hi = cluster_bootstrap_ci(x, c, level, n_boot, rng, "percentile")
        else:
            lo, hi = bootstrap_ci(x, level, n_boot, rng, "percentile")
        rows.append({"context_min": int(t["context_len"].min()), "context_max": int(t["context_len"].max()),
                     "n": len(x), "mean": float(np.mean(x)), "lo": lo, "hi": hi,
                     "pct": pct(float(np.mean(x))), "pct_lo": pct(lo), "pct_hi": pct(hi)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- the whole run

@dataclasses.dataclass
class Analysis:
    run_id: str
    arms: list[str]
    n_requests: int                          # requests paired candidate/control
    effects: dict[str, Effect]               # candidate vs control, by metric
    aa: dict[str, Effect]                    # aa vs control, by metric (empty without an aa arm)
    adjusted: Effect | None                  # per request tpot(cand/ctrl) - tpot(aa/ctrl)
    identity_residual: float                 # max |tpot - (step - tps)| over requests and arms
    bit_exact: dict                          # counts and differing request ids
    drift: dict[str, Slope]                  # effect / aa / environment vs run order
    context_slope: Slope | None              # tpot log-ratio per doubling of context
    context_bins: pd.DataFrame
    per_request: pd.DataFrame
    decodes: pd.DataFrame
    settings: dict
    n_unpaired: int = 0                      # requests left out: no decode of control or candidate
    host: dict | None = None                 # host contention (see host_contention); None: not measured

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id, "arms": self.arms, "n_requests": self.n_requests,
            "n_unpaired": self.n_unpaired,
            "effects": {k: v.to_dict() for k, v in self.effects.items()},
            "aa": {k: v.to_dict() for k, v in self.aa.items()},
            "adjusted": self.adjusted.to_dict() if self.adjusted else None,
            "identity_residual": self.identity_residual, "bit_exact": self.bit_exact,
            "drift": {k: v.to_dict() for k, v in self.drift.items()},
            "context_slope": self.context_slope.to_dict() if self.context_slope else None,
            "context_bins": self.context_bins.to_dict(orient="records"),
            "settings": self.settings, "host": self.host,
        }


HOST_SHARE_MIN = 0.9   # a CPU decode whose thread ran less than this share of its wall time waited for a core


def host_contention(requests: pd.DataFrame, manifest: dict, threshold: float = HOST_SHARE_MIN) -> dict | None:
    """How many decodes shared their core with another process, from each decode's thread CPU time
    over its wall time (``cpu_ns / decode_ns``; 1.0 when the decode had a core to itself). Only for
    runs whose arms all decode on the CPU (on a GPU the host thread may legitimately sleep in a
    synchronisation) and that recorded ``cpu_ns``; otherwise None."""
    devices = {str(a.get("device", "")) for a in (manifest.get("arms") or {}).values()}
    if "cpu_ns" not in requests.columns or devices != {"cpu"}:
        return None
    r = requests[(requests["cpu_ns"] >= 0) & (requests["decode_ns"] > 0)]
    if not len(r):
        return None
    ratio = r["cpu_ns"] / r["decode_ns"]
    low = ratio < threshold
    return {"n_decodes": int(len(r)), "contended": int(low.sum()), "share": float(low.mean()),
            "median_ratio": float(ratio.median()), "min_ratio": float(ratio.min()), "threshold": threshold,
            "contended_by_arm": {str(k): int(v) for k, v in low.groupby(r["arm"]).sum().items()}}


def check_arm_sd_floor(v) -> float:
    """An arm-offset floor as a float; ValueError unless a finite number >= 0."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    if not (math.isfinite(f) and f >= 0):
        raise ValueError(f"arm_sd_floor={v!r}: a number >= 0 (an sd on the natural-log scale)")
    return f


def recorded_arm_sd_floor(manifest: dict) -> float:
    """The arm-offset floor a run recorded (``manifest["analysis"]["arm_sd_floor"]``); 0 for a run
    recorded before the floor existed, so its analysis is what it was."""
    try:
        return check_arm_sd_floor((manifest.get("analysis") or {}).get("arm_sd_floor", 0.0))
    except ValueError as e:
        raise ValueError(f"the run's manifest: analysis.{e}") from None


def analyze(run: RunData, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0,
            method: str = "BCa", alpha: float = ALPHA, widen: bool = True, cluster: bool = True,
            arm_sd_floor: float | None = None) -> Analysis:
    """All statistics of one run. Raises ValueError when no request has both control and candidate.
    ``widen=False`` keeps the request-only intervals (no arm-offset widening; for calibration);
    ``cluster=False`` treats requests as independent even where placement epochs were recorded (the
    calibration's negative control). ``arm_sd_floor``: the least arm offset (log scale) the candidate's
    intervals are widened by, whatever the A/A arm shows (see the module docstring); None: the one the
    run recorded (``recorded_arm_sd_floor``)."""
    floor = recorded_arm_sd_floor(run.manifest) if arm_sd_floor is None else check_arm_sd_floor(arm_sd_floor)
    decodes = decode_metrics(run.steps)
    req = request_metrics(decodes, run.requests)
    arms = [a for a in ("control", "candidate", "aa") if (req["arm"] == a).any()]
    if "control" not in arms or "candidate" not in arms:
        raise ValueError(f"run {run.manifest.get('run_id')}: needs decodes of control and "
                         f"candidate, found arms {arms}")
    kw = dict(level=level, n_boot=n_boot, seed=seed, method=method, alpha=alpha)
    cand = paired_table(req, "candidate")
    if len(cand) == 0:
        raise ValueError("no request has decodes of both control and candidate")
    clus = request_clusters(run.requests) if cluster else None
    of = lambda t: None if clus is None else clus.reindex(t.index).to_numpy()   # noqa: E731

    def units(t: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
        """``t``'s columns averaged per placement epoch where epochs hold several requests (the drift and
        context slopes' points: an epoch's offsets would otherwise read as a trend over its requests, which
        run in order and, with ``requests.select`` first or spread, in context order too)."""
        c = of(t)
        if c is None or len(set(c)) >= len(t):
            return t[cols]
        return t[cols].groupby(c).mean()
    effects = {m: summarize(cand[m], m, "candidate", "control", cand[f"control_log_{m}"],
                            cand[f"candidate_log_{m}"], clusters=of(cand), **kw) for m in METRICS}
    residual = float(np.max(np.abs(cand["tpot"] - (cand["step"] - cand["tps"]))))

    per = pd.DataFrame({"request_id": cand.index, "context_len": cand["context_len"].to_numpy(),
                        "order": cand["order"].to_numpy(), "n_reps": cand["n_reps"].to_numpy()})
    for m in METRICS:
        per[m] = cand[m].to_numpy()
    if clus is not None:
        per["epoch"] = clus.reindex(cand.index).to_numpy()
    per["control_tpot_ns"] = np.exp(cand["control_log_tpot"].to_numpy())
    per["candidate_tpot_ns"] = np.exp(cand["candidate_log_tpot"].to_numpy())
    per = per.set_index("request_id")

    aa, adjusted, drift = {}, None, {}
    if "aa" in arms:
        aat = paired_table(req, "aa")
        aa = {m: summarize(aat[m], m, "aa", "control", aat[f"control_log_{m}"],
                           aat[f"aa_log_{m}"], clusters=of(aat), **kw) for m in ("tpot", "step", "tps")}
        residual = max(residual, float(np.max(np.abs(aat["tpot"] - (aat["step"] - aat["tps"])))))
        for m in ("tpot", "step", "tps"):
            per[f"aa_{m}"] = aat[m].reindex(per.index)
        per["aa_tpot_ns"] = np.exp(aat["aa_log_tpot"]).reindex(per.index)
        per["adj_tpot"] = per["tpot"] - per["aa_tpot"]
        both = per["adj_tpot"].dropna()
        cand_vs_aa = req[req["arm"].isin(["candidate", "aa"])]
        ca = paired_table(cand_vs_aa, "candidate", "aa").reindex(both.index)
        adjusted = summarize(both, "tpot", "candidate", "aa(adjusted)", ca["aa_log_tpot"],
                             ca["candidate_log_tpot"], clusters=of(both), **kw)
        if widen:
            for m in aa:
                effects[m] = widen_for_arm_offset(effects[m], max(arm_offset_sd(aa[m]), floor))
            adjusted = widen_for_arm_offset(adjusted, max(arm_offset_sd(aa["tpot"]), floor))
        if len(aat) > 2:
            u = units(aat, ["tpot", "order"])
            drift["aa"] = robust_slope(u["tpot"], u["order"], level=level,
                                       y_name="log TPOT ratio aa/control", x_name="run order")

    elif widen and floor > 0:   # no A/A arm to measure an offset: the floor alone
        for m in ("tpot", "step", "tps"):     # the metrics an A/A arm's offset would widen
            effects[m] = widen_for_arm_offset(effects[m], floor)

    be = bit_exactness(run.requests).reindex(per.index)
    per["bit_exact"] = be["candidate"]
    per["aa_bit_exact"] = be["aa"]
    cand_diff = per.index[per["bit_exact"] == 0].tolist()
    bit = {"n_requests": int(per["bit_exact"].notna().sum()),
           "candidate_exact": int((per["bit_exact"] == 1).sum()),
           "aa_exact": int((per["aa_bit_exact"] == 1).sum()),
           "aa_compared": int(per["aa_bit_exact"].notna().sum()),
           "control_reproducible": int((be["control_reproducible"] == 1).sum()),
           "differing": cand_diff[:50], "n_differing": len(cand_diff),
           "aa_differing": per.index[per["aa_bit_exact"] == 0].tolist()[:50]}

    if len(cand) > 2:
        u = units(cand.assign(log_ctx=np.log(cand["context_len"].astype(np.float64))),
                  ["tpot", "order", "control_log_step", "log_ctx"])
        drift["effect"] = robust_slope(u["tpot"], u["order"], level=level,
                                       y_name="log TPOT ratio candidate/control", x_name="run order")
        drift["environment"] = ols_slope(u["control_log_step"], u["order"], [u["log_ctx"]], level=level,
                                         y_name="log control step latency (context held fixed)",
                                         x_name="run order")
    ctx_slope = None
    if len(cand) > 2:   # one point per epoch too: requests run in context order fill an epoch with neighbours
        u = units(cand.assign(log2_ctx=np.log2(cand["context_len"].astype(np.float64))), ["tpot", "log2_ctx"])
        ctx_slope = robust_slope(u["tpot"], u["log2_ctx"], level=level,
                                 y_name="log TPOT ratio candidate/control", x_name="log2 context length")
    bins = context_bins(per, "tpot", level=level, n_boot=n_boot, seed=seed, clusters=clus)
    return Analysis(
        run_id=str(run.manifest.get("run_id", "")), arms=arms, n_requests=len(cand),
        effects=effects, aa=aa, adjusted=adjusted, identity_residual=residual, bit_exact=bit,
        drift=drift, context_slope=ctx_slope, context_bins=bins, per_request=per,
        decodes=decodes, settings={"level": level, "n_boot": n_boot, "seed": seed,
                                   "method": method, "alpha": alpha, "widen": widen, "arm_sd_floor": floor,
                                   "clusters": None if clus is None else int(clus.nunique())},
        n_unpaired=int(req["request_id"].nunique() - len(cand)),
        host=host_contention(run.requests, run.manifest),
    )
