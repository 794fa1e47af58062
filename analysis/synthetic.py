"""Synthetic replay output with known injected effects, in exactly the raw-output schema.

The statistics and the verdict are qualified against data whose answer is known: this module
simulates what ``replay.paired`` writes (``manifest.json``, ``steps/*.parquet``,
``requests/*.parquet``) for a control, a candidate and an A/A arm, with

- a step-latency multiplier for the candidate, ``exp(latency_effect)``, varying per request with
  standard deviation ``request_effect_sd`` on the log scale;
- a tokens-per-step change: the candidate's per-draft acceptance probability is multiplied by
  ``acceptance_multiplier`` (coupled to the control through shared uniforms, as a real change in
  acceptance would move the same draws);
- an A/A offset ``aa_offset`` (log multiplier on the A/A arm's step latency);
- per-decode and per-step noise (log-normal), rare latency spikes and slow warm-up steps;
- drift over run order: ``drift_env`` moves every arm (the pairing should cancel it), while
  ``drift_effect`` moves the candidate's effect from ``latency_effect - drift_effect/2`` at the
  start of the run to ``latency_effect + drift_effect/2`` at its end.

With ``acceptance_multiplier == 1`` the candidate emits the same tokens as the control (bit-exact)
except for a ``nonexact_fraction`` of requests, and the true per-output-token effect is exactly
``latency_effect`` on the log scale: the step noise of the two arms is exchangeable, so the
expected per-request log-ratio is the expected log multiplier (``SyntheticSpec.true_tpot_log_ratio``).

    python -m analysis.synthetic out=/tmp/run n_requests=100 latency_effect=-0.02
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ARMS = ("control", "candidate", "aa")
VOCAB = 160_000


@dataclasses.dataclass
class SyntheticSpec:
    n_requests: int = 50
    reps: int = 1
    arms: tuple[str, ...] = ARMS
    seed: int = 0
    # injected effects, natural-log scale
    latency_effect: float = 0.0        # candidate step latency multiplier exp(.) (population mean)
    request_effect_sd: float = 0.0     # per-request random effect on the candidate multiplier
    acceptance_multiplier: float = 1.0  # candidate per-draft acceptance probability multiplier
    aa_offset: float = 0.0             # A/A arm step latency multiplier exp(.)
    arm_offset_sd: float = 0.0         # every arm's own random latency offset in this run (sd, log
                                       # scale): a loaded copy's layout/placement, the same for all
                                       # its requests (drawn from a separate stream: seeds unchanged)
    placement_epochs: int = 0          # > 0: the offsets are drawn again for every arm at each of this
                                       # many epochs of consecutive requests (replay.paired's
                                       # placement.epochs) and each decode records its epoch
    drift_env: float = 0.0             # log latency change over the run, all arms alike
    drift_effect: float = 0.0          # change of the candidate effect from run start to run end
    nonexact_fraction: float = 0.0     # requests whose candidate tokens differ without acceptance change
    expect_bit_exact: bool = True      # written to the manifest
    # noise
    step_noise_sd: float = 0.05
    decode_noise_sd: float = 0.01
    spike_prob: float = 0.002
    spike_factor: float = 3.0
    # shape of the workload
    context_min: int = 1_024
    context_max: int = 196_608
    output_min: int = 64
    output_max: int = 256
    warmup_steps: int = 2
    warmup_factor: float = 3.0
    base_step_ms: float = 8.0
    context_ms_per_64k: float = 2.0
    width_cost: float = 0.06           # relative latency per verified row beyond 4

    @property
    def true_tpot_log_ratio(self) -> float:
        """Expected per-request log TPOT ratio candidate/control when acceptance is unchanged."""
        if self.acceptance_multiplier != 1.0:
            raise ValueError("the true TPOT effect has no closed form when acceptance changes")
        return self.latency_effect

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["arms"] = list(self.arms)
        return d


def _token_sha(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i8").tobytes()).hexdigest()


def _accepted_from_uniforms(u: np.ndarray, a: float, width: np.ndarray) -> np.ndarray:
    """Leading successes of Bernoulli(a) drafts, by inverse transform so that arms share draws."""
    a = min(max(a, 1e-6), 0.995)
    k = np.floor(np.log(u) / np.log(a)).astype(np.int64)  # P(k >= j) = a**j
    return np.minimum(k, width - 1)


def _sequence(rng_u: np.ndarray, drafts: np.ndarray, a: float, budget: int):
    """One decode's step sequence: width, drafts, accepted, emitted (truncated to the budget)."""
    width = np.concatenate([[4], 1 + drafts[:-1]])  # the first step verifies the prefill's 3 drafts
    accepted = _accepted_from_uniforms(rng_u, a, width)
    emitted = accepted + 1
    total = np.cumsum(emitted)
    n = int(np.searchsorted(total, budget) + 1)
    width, drafts, accepted, emitted = width[:n], drafts[:n], accepted[:n], emitted[:n].copy()
    emitted[-1] -= int(total[n - 1] - budget) if total[n - 1] > budget else 0
    return width, drafts, accepted, emitted


def simulate(spec: SyntheticSpec, with_tokens: bool = False):
    """Simulate a run in memory: returns ``(steps, requests, manifest)`` in the raw-output schema.

    ``with_tokens=False`` leaves the per-step ``tokens`` lists out (fast, for Monte-Carlo); the
    ``tokens_sha`` column is always computed from the emitted sequence.
    """
    rng = np.random.default_rng(spec.seed)
    n_req, reps, arms = spec.n_requests, spec.reps, list(spec.arms)
    if "control" not in arms:
        raise ValueError("a run needs a control arm")
    # run order: requests in sequence, arms in a seeded random order per (request, rep)
    schedule = []
    for r in range(n_req):
        for rep in range(reps):
            for arm in rng.permutation(arms):
                schedule.append((r, str(arm), rep))
    order_of = {key: i for i, key in enumerate(schedule)}
    n_decodes = len(schedule)

    log_ctx = rng.uniform(np.log(spec.context_min), np.log(spec.context_max), n_req)
    context = np.round(np.exp(log_ctx)).astype(np.int64)
    budget = rng.integers(spec.output_min, spec.output_max + 1, n_req)
    accept_p = rng.beta(6.0, 2.5, n_req)
    cand_effect = spec.latency_effect + spec.request_effect_sd * rng.standard_normal(n_req)
    nonexact = rng.random(n_req) < spec.nonexact_fraction

    n_ep = min(spec.placement_epochs, n_req * reps)
    per_epoch = -(-(n_req * reps) // n_ep) if n_ep > 0 else 0
    draws = spec.arm_offset_sd * np.random.default_rng([spec.seed, 7]).standard_normal(
        (max(n_ep, 1), len(arms)) if n_ep else len(arms))
    arm_off = ({(arm, e): draws[e, i] for e in range(n_ep) for i, arm in enumerate(arms)} if n_ep
               else {(arm, -1): v for arm, v in zip(arms, draws)})

    step_parts, req_rows = [], []
    clock = 0
    for r in range(n_req):
        max_steps = int(budget[r])
        u = 1.0 - rng.random(max_steps)               # shared acceptance draws, in (0, 1]
        drafts = 3 + rng.binomial(4, accept_p[r], max_steps)
        seqs = {"control": _sequence(u, drafts, accept_p[r], int(budget[r]))}
        seqs["aa"] = seqs["control"]
        if spec.acceptance_multiplier != 1.0:
            seqs["candidate"] = _sequence(u, drafts, accept_p[r] * spec.acceptance_multiplier, int(budget[r]))
        else:
            seqs["candidate"] = seqs["control"]
        tok_ctrl = rng.integers(0, VOCAB, int(budget[r]))
        toks = {"control": tok_ctrl, "aa": tok_ctrl, "candidate": tok_ctrl}
        if spec.acceptance_multiplier != 1.0 or nonexact[r]:
            tok_cand = tok_ctrl.copy()
            start = rng.integers(0, len(tok_cand))
            tok_cand[start:] = rng.integers(0, VOCAB, len(tok_cand) - start)
            tok_cand[start] = (tok_ctrl[start] + 1) % VOCAB  # guarantee a difference
            toks["candidate"] = tok_cand
        for rep in range(reps):
            for arm in arms:
                order = order_of[(r, arm, rep)]
                epoch = (r * reps + rep) // per_epoch if per_epoch else -1
                width, drft, acc, emi = seqs[arm]
                n = len(width)
                frac = order / max(n_decodes - 1, 1)
                arm_log = {"control": 0.0, "aa": spec.aa_offset,
                           "candidate": cand_effect[r] + spec.drift_effect * (frac - 0.5)}[arm]
                base_ms = (spec.base_step_ms + spec.context_ms_per_64k * context[r] / 65_536) * (
                    1.0 + spec.width_cost * (width - 4))
                log_mult = (arm_log + arm_off[(arm, epoch)] + spec.drift_env * frac
                            + spec.decode_noise_sd * rng.standard_normal()
                            + spec.step_noise_sd * rng.standard_normal(n))
                dur_ms = base_ms * np.exp(log_mult)
                dur_ms = np.where(rng.random(n) < spec.spike_prob, dur_ms * spec.spike_factor, dur_ms)
                warm = np.arange(n) < spec.warmup_steps
                dur_ms = np.where(warm, dur_ms * spec.warmup_factor, dur_ms)
                dur_ns = np.maximum(np.round(dur_ms * 1e6).astype(np.int64), 1)
                gaps = rng.integers(2_000, 8_000, n)      # host-side gap between device steps
                t_start = clock + np.cumsum(gaps) + np.concatenate([[0], np.cumsum(dur_ns)[:-1]])
                t_end = t_start + dur_ns
                clock = int(t_end[-1]) + 1_000_000
                part = {
                    "request_id": np.full(n, f"req-{r:05d}", dtype=object),
                    "arm": np.full(n, arm, dtype=object),
                    "rep": np.full(n, rep, dtype=np.int64),
                    "order": np.full(n, order, dtype=np.int64),
                    "step": np.arange(n, dtype=np.int64),
                    "width": width.astype(np.int64),
                    "drafts": drft.astype(np.int64),
                    "accepted": acc.astype(np.int64),
                    "emitted": emi.astype(np.int64),
                    "t_start_ns": t_start.astype(np.int64),
                    "t_end_ns": t_end.astype(np.int64),
                    "warmup": warm,
                }
                tokens = toks[arm][: int(emi.sum())]
                if with_tokens:
                    bounds = np.cumsum(emi)[:-1]
                    part["tokens"] = [t.astype(np.int64) for t in np.split(tokens, bounds)]
                step_parts.append(part)
                req_rows.append({
                    "request_id": f"req-{r:05d}", "arm": arm, "rep": rep,
                    "context_len": int(context[r]), "order": order, "n_steps": n,
                    "n_tokens": int(emi.sum()), "tokens_sha": _token_sha(tokens),
                    "decode_ns": int(t_end[-1] - t_start[0]),
                    **({"epoch": epoch} if per_epoch else {}),
                })
    cols = list(step_parts[0].keys())
    steps = pd.DataFrame({c: (np.concatenate([p[c] for p in step_parts]) if c != "tokens"
                              else [t for p in step_parts for t in p[c]]) for c in cols})
    steps = steps.sort_values(["order", "step"], kind="stable").reset_index(drop=True)
    requests = pd.DataFrame(req_rows).sort_values("order", kind="stable").reset_index(drop=True)
    manifest = {
        "run_id": f"synthetic-{spec.seed}",
        "command": "python -m analysis.synthetic",
        "config": {"synthetic": spec.to_dict()},
        "arms": {arm: {"rev": f"synthetic-{arm}", "sha": hashlib.sha1(arm.encode()).hexdigest()}
                 for arm in arms},
        "environment": {"host": "synthetic", "gpu": "none (simulated timings)"},
        "hashes": {},
        "status": "complete",
        "expect_bit_exact": bool(spec.expect_bit_exact),
    }
    return steps, requests, manifest


def write_run(run_dir: str | Path, spec: SyntheticSpec, parts: int = 3) -> Path:
    """Write a synthetic run directory (manifest, several step and request part files)."""
    run_dir = Path(run_dir)
    steps, requests, manifest = simulate(spec, with_tokens=True)
    (run_dir / "steps").mkdir(parents=True, exist_ok=True)
    (run_dir / "requests").mkdir(parents=True, exist_ok=True)
    n_orders = int(requests["order"].max()) + 1
    edges = np.linspace(0, n_orders, parts + 1).round().astype(int)
    for i in range(parts):  # part files split by run order, as an append-only writer produces
        sel = (steps["order"] >= edges[i]) & (steps["order"] < edges[i + 1])
        steps[sel].to_parquet(run_dir / "steps" / f"part-{i:05d}.parquet", index=False)
        sel = (requests["order"] >= edges[i]) & (requests["order"] < edges[i + 1])
        requests[sel].to_parquet(run_dir / "requests" / f"part-{i:05d}.parquet", index=False)
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return run_dir


HELP = """python -m analysis.synthetic out=DIR [key=value ...]

Write a synthetic run directory with known injected effects (raw-output schema of replay.paired).
  out=DIR                 run directory to create (required)
  parts=3                 number of part files for steps/ and requests/
Any field of SyntheticSpec, e.g. n_requests=50 reps=1 seed=0 latency_effect=0.0
request_effect_sd=0.0 acceptance_multiplier=1.0 aa_offset=0.0 drift_env=0.0 drift_effect=0.0
nonexact_fraction=0.0 expect_bit_exact=true step_noise_sd=0.05 decode_noise_sd=0.01
(effects are natural-log multipliers: latency_effect=-0.02 is a 2% faster step)."""


def main(argv: list[str] | None = None) -> int:
    from analysis.report import parse_cli

    defaults = {"out": "", "parts": 3, **{k: v for k, v in SyntheticSpec().to_dict().items() if k != "arms"}}
    opts, positional = parse_cli(sys.argv[1:] if argv is None else argv, defaults, HELP)
    if opts is None:
        return 0
    if not opts["out"] or positional:
        print(HELP, file=sys.stderr)
        return 2
    spec = SyntheticSpec(**{k: v for k, v in opts.items() if k not in ("out", "parts")})
    path = write_run(opts["out"], spec, parts=opts["parts"])
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
