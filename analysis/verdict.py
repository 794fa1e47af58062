"""The verdict on a replay: what the statistics allow a user to conclude. Decides; computes nothing.

Inputs are an ``analysis.stats.Analysis`` and the run's manifest. Let ``alpha`` = 0.05 and let
every interval be the analysis' bootstrap CI (95%) of a mean per-request log-ratio (for candidate
effects: widened by the arm offset the A/A arm shows, see ``analysis.stats``).

An effect is **significant** when its CI excludes 0 *and* its Wilcoxon signed-rank p < alpha (both
the mean-based interval and the rank test must agree; either alone does not count).

The call, first rule that applies:

1. ``insufficient``: fewer than ``min_requests`` (10) requests have both control and candidate.
2. ``unstable`` (refusal): the A/A arm's TPOT effect (aa vs control) is significant. The A/A arm is
   the control loaded again through the candidate's path; if it differs from control, the
   measurement itself is biased or unstable, and no speed verdict is given.
3. ``faster`` / ``slower``: the candidate's TPOT effect (candidate vs control) is significant, with
   mean < 0 (faster) or > 0 (slower).
4. ``inconclusive``: otherwise; the headline gives the minimum detectable effect.

Flags, evaluated whatever the call:

- ``acceptance_changed``: the tokens-per-step effect is significant. The TPOT effect is then the
  sum of two effects (log TPOT ratio = log step-latency ratio - log tokens-per-step ratio) and both
  are stated: "acceptance changed: explain both effects".
- ``aa_offset_exceeds_effect`` (only when the call is faster or slower): the largest A/A offset
  compatible with the A/A data, ``B = max(|lo|, |hi|)`` of the A/A TPOT CI, is more than
  ``aa_fraction`` (0.5) of the candidate's TPOT effect ``|mean|``; i.e. an offset of the
  measurement path the A/A arm cannot rule out could explain half the effect or more.
- ``not_bit_exact``: the manifest says ``expect_bit_exact`` and at least one request's candidate
  (or A/A) token sequence differs from control's.
- ``host_contention``: a CPU run where more than ``host_fraction`` (5%) of the decodes got less
  than 90% of a core (thread CPU time / wall time, ``analysis.stats.host_contention``): another
  process competed for the CPU while the clock ran, so the timings carry its load (in session 9 a
  compile beside a CPU calibration made 2 of 16 A/A runs "faster"). Timings are still reported.
- ``no_aa_arm``: the run has no A/A arm, so the A/A rules could not be applied.
- ``incomplete_run``: the manifest status is not ``complete``.

The headline is one line, e.g. "candidate is 2.1% faster per output token [1.4, 2.8] 95% CI;
acceptance unchanged; bit-exact: 400/400 requests; A/A offset 0.1% [−0.3, 0.5]".
"""

from __future__ import annotations

import dataclasses
import math

from analysis.stats import Analysis, Effect, pct

ALPHA = 0.05
AA_FRACTION = 0.5
MIN_REQUESTS = 10
HOST_FRACTION = 0.05   # host_contention: largest share of CPU decodes allowed below 90% of a core
CALLS = ("faster", "slower", "inconclusive", "unstable", "insufficient")
MINUS = "\u2212"


@dataclasses.dataclass
class Verdict:
    call: str                 # one of CALLS
    flags: list[str]          # codes, see the module docstring
    headline: str
    reasons: list[str]        # one sentence per rule that fired or was checked

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_significant(e: Effect | None, alpha: float = ALPHA) -> bool:
    """CI excludes 0 and Wilcoxon p < alpha."""
    if e is None or not all(math.isfinite(v) for v in e.ci) or not math.isfinite(e.p):
        return False
    return _excludes_zero(e) and e.p < alpha


def _excludes_zero(e: Effect) -> bool:
    return e.ci[0] > 0 or e.ci[1] < 0


def aa_bound(aa: Effect) -> float:
    """Largest |A/A offset| compatible with the A/A CI (log scale)."""
    return max(abs(aa.ci[0]), abs(aa.ci[1]))


def _num(v: float, digits: int = 1) -> str:
    s = f"{v:.{digits}f}"
    if s.lstrip("-") == f"{0:.{digits}f}":
        s = s.lstrip("-")  # no "-0.0"
    return s.replace("-", MINUS)


def pct_digits(*values: float) -> int:
    """Decimals for percents: 1, or 2 when every value is below 0.1% (so it does not print as 0.0)."""
    return 2 if all(abs(v) < 0.1 for v in values if math.isfinite(v)) else 1


def fmt_pct(e: Effect, signed: bool = True) -> str:
    """'+1.2% [0.4, 2.0]' for an effect (percent change of the metric)."""
    return fmt_pct_values(e.pct, *e.pct_ci, signed=signed)


def fmt_pct_values(v: float, lo: float, hi: float, signed: bool = True) -> str:
    """``fmt_pct`` of a percent change and its interval given as numbers."""
    d = pct_digits(v, lo, hi)
    sign = "+" if signed and v > 0 else ""
    return f"{sign}{_num(v, d)}% [{_num(lo, d)}, {_num(hi, d)}]"


def _speed(e: Effect) -> str:
    """'2.1% faster per output token [1.4, 2.8]' style, in the direction of the effect."""
    if e.mean < 0:  # faster: the reduction in time per token, 1 - exp(x)
        v, lo, hi = -e.pct, -e.pct_ci[1], -e.pct_ci[0]
        word = "faster"
    else:
        v, (lo, hi), word = e.pct, e.pct_ci, "slower"
    d = pct_digits(v, lo, hi)
    return f"{_num(v, d)}% {word} per output token [{_num(lo, d)}, {_num(hi, d)}]"


def _split_evidence(e: Effect, alpha: float) -> str:
    """When the interval and the signed-rank test disagree (one rejects 0, the other not), say so: a call
    needs both, and an interval that excludes 0 under "no significant change" reads as a contradiction."""
    if not (all(math.isfinite(v) for v in e.ci) and math.isfinite(e.p)):
        return ""
    excludes = _excludes_zero(e)
    if excludes and e.p >= alpha:
        return f" (the interval excludes 0 but the signed-rank test does not reject at {alpha:g}: a call needs both)"
    if not excludes and e.p < alpha:
        return f" (p < {alpha:g} but the interval holds 0: a call needs both)"
    return ""


def _offset_bound(e: Effect) -> str:
    """When the arm offset the interval was widened by is at least its request noise, more requests cannot
    narrow it much: say what can (several runs, each its own process, pooled by ``analysis.compare``)."""
    if e.ci_requests is None or not (e.arm_sd > 0 and math.isfinite(e.se) and e.arm_sd >= e.se):
        return ""
    return (f" (an arm offset of sd {100 * e.arm_sd:.2f}% is most of that, and more requests do not shrink it: "
            f"pool several runs with python -m analysis.compare)")


def decide(a: Analysis, manifest: dict, alpha: float = ALPHA, aa_fraction: float = AA_FRACTION,
           min_requests: int = MIN_REQUESTS, host_fraction: float = HOST_FRACTION) -> Verdict:
    level_pct = f"{round(100 * a.settings.get('level', 0.95))}% CI"
    tpot, tps, step = a.effects["tpot"], a.effects["tps"], a.effects["step"]
    aa = a.aa.get("tpot")
    flags, reasons, parts = [], [], []

    if a.n_requests < min_requests:
        call = "insufficient"
        parts.append(f"INSUFFICIENT DATA: {a.n_requests} paired requests (need {min_requests})")
        reasons.append(f"{a.n_requests} requests with both control and candidate < {min_requests}")
    elif aa is not None and is_significant(aa, alpha):
        call = "unstable"
        parts.append(f"UNSTABLE, no verdict: the A/A arm differs from control by {fmt_pct(aa)} "
                     f"{level_pct} (p={aa.p:.2g}); candidate {fmt_pct(tpot)} is not interpretable")
        reasons.append("A/A TPOT effect is significant (CI excludes 0 and p < alpha): refused")
    elif is_significant(tpot, alpha):
        call = "faster" if tpot.mean < 0 else "slower"
        parts.append(f"candidate is {_speed(tpot)} {level_pct}")
        reasons.append(f"TPOT CI excludes 0 and p={tpot.p:.2g} < {alpha}: {call}")
    else:
        call = "inconclusive"
        mde = pct(tpot.mde)
        parts.append(f"no significant change per output token: candidate {fmt_pct(tpot)} {level_pct}, "
                     f"p={tpot.p:.2g}{_split_evidence(tpot, alpha)}; detectable at this noise: "
                     f"\u00b1{_num(mde, pct_digits(mde))}%{_offset_bound(tpot)}")
        reasons.append(f"TPOT CI {'includes' if tpot.ci[0] <= 0 <= tpot.ci[1] else 'excludes'} 0, "
                       f"p={tpot.p:.2g}: inconclusive")

    if is_significant(tps, alpha):
        flags.append("acceptance_changed")
        parts.append(f"acceptance changed: tokens/step {fmt_pct(tps)}, step latency {fmt_pct(step)}; "
                     "explain both effects")
        reasons.append("tokens-per-step effect is significant: the TPOT effect mixes acceptance "
                       "and step latency")
    else:
        parts.append("acceptance unchanged")

    be = a.bit_exact
    expect = bool(manifest.get("expect_bit_exact", False))
    n, ok = be["n_requests"], be["candidate_exact"]
    aa_bad = be["aa_compared"] - be["aa_exact"]
    if expect and (ok < n or aa_bad > 0):
        flags.append("not_bit_exact")
        msg = f"NOT bit-exact: {ok}/{n} requests identical"
        if aa_bad:
            msg += f", A/A differs in {aa_bad}"
        parts.append(msg + " (bit-exactness expected)")
        reasons.append(f"expect_bit_exact and {n - ok} candidate / {aa_bad} A/A requests differ")
    else:
        parts.append(f"bit-exact: {ok}/{n} requests" + ("" if expect else " (not required)"))

    arms = manifest.get("arms") or {}
    clocks = [(arms.get(k) or {}).get("step_clock") for k in ("control", "candidate")]
    if all(clocks) and clocks[0] != clocks[1]:
        flags.append("step_clocks_differ")
        parts.append(f"step clocks differ (control: {clocks[0]}; candidate: {clocks[1]}): the step and TPOT "
                     "effects include the clocks' difference")
        reasons.append("the arms time their steps differently (runtime.execution or the engine's step clock "
                       "changed): latency effects are not the candidate's work alone")

    if aa is None:
        flags.append("no_aa_arm")
        parts.append("no A/A arm")
        reasons.append("no A/A arm: stability and offset rules not applied")
    else:
        text = f"A/A offset {fmt_pct(aa)}"
        if call in ("faster", "slower") and aa_bound(aa) > aa_fraction * abs(tpot.mean):
            flags.append("aa_offset_exceeds_effect")
            text += " is not small against the effect (A/A offset exceeds the effect)"
            reasons.append(f"A/A bound {pct(aa_bound(aa)):.2f}% > {aa_fraction} x |effect| "
                           f"{aa_fraction * abs(tpot.pct):.2f}%")
        parts.append(text)

    host = getattr(a, "host", None)
    if host and host["share"] > host_fraction:
        flags.append("host_contention")
        parts.append(f"HOST CONTENTION: {host['contended']}/{host['n_decodes']} decodes ran on less than "
                     f"{round(100 * host['threshold'])}% of a core (another process took the CPU); "
                     "rerun on a quiet machine")
        reasons.append(f"{100 * host['share']:.1f}% of decodes had thread CPU time / wall time < "
                       f"{host['threshold']} (> {100 * host_fraction:.0f}% allowed)")

    status = manifest.get("status", "complete")
    if status != "complete":
        flags.append("incomplete_run")
        parts.append(f"run {status}: {a.n_requests} requests analysed")
        reasons.append(f"manifest status {status!r}")
    return Verdict(call=call, flags=flags, headline="; ".join(parts), reasons=reasons)
