"""Does one loaded copy of the runtime carry a speed offset of its own for a whole process? The question
behind session 57's calibration: over 27 A/A replays on the H200, the candidate arm (identical code) moved
against control by 0.17 % (sd across runs) beyond its request noise, the A/A arm by nothing.

Each process does what ``replay.paired`` does to its arms, without the replay around it: it imports the
worktree's ``runtime`` three times through ``replay.arms.import_runtime`` (labels control, candidate, aa, in
that order), builds each arm's engine through ``replay.arms.build`` (one shared ``WeightCache``), prefills
one random prompt per arm, then for each of ``--trials`` epochs rebuilds every engine in a random order after
a random pad (``replay.paired.Placement``'s recipe) and decodes a fork of the arm's request on each, the arms
in a rotated permutation. Per process and arm: the mean time per output token (first step left out, the
step clock) and its standard error; per process, each arm's log ratio against control.

Across processes, a copy without an offset of its own has contrasts that scatter as their standard errors
say (``z rms`` ~ 1); a copy with one scatters more (its excess, sqrt(mean(m^2 - se^2)), is the offset's sd).

    OUT=... python3 experiments/arm_offsets.py --processes 8 --trials 10 --context 16384     # GPU
    python experiments/arm_offsets.py --dry-run                                               # CPU: the script

Writes ``$OUT/arm_offsets.json`` (every decode of every process).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LABELS = ("control", "candidate", "aa")


def one_process(a) -> dict:
    """The child: three imported copies, epochs of rebuilt engines, rotated decodes; returns its decodes."""
    import itertools

    import torch

    from replay import arms as armsmod

    cuda = torch.cuda.is_available() and not a.dry_run
    rt = ({"backend": "fast", "dtype": "bfloat16", "device": "cuda"} if cuda else
          {"backend": "reference", "dtype": "float32", "device": "cpu"})
    model = "q1-mini" if cuda else "q1-tiny"
    rev = armsmod.Revision(rev="WORKTREE", sha="-", key="worktree-armoffsets", root=ROOT)
    weights = armsmod.WeightCache()
    arms = {}
    for label in LABELS:
        name, mod = armsmod.import_runtime(label, rev)
        arms[label] = armsmod.build(armsmod.Arm(label=label, revision=rev, module=name, overrides={},
                                                runtime=mod), model, rt, weights)
    rng = random.Random(a.seed)
    eng0 = arms["control"].engine
    ctx = min(a.context, eng0.cfg.max_context - a.tokens - 32) if cuda else 64
    prompt = torch.randint(0, eng0.cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(a.seed)).tolist()
    started = {}
    with torch.no_grad():
        for label, arm in arms.items():
            started[label] = arm.engine.start(prompt, a.seed, a.tokens)
    perms = list(itertools.permutations(LABELS))
    rng.shuffle(perms)
    rows, ref = [], None
    for trial in range(a.trials):
        order = list(arms.values())
        rng.shuffle(order)
        for arm in order:
            arm.engine = None
        pads = []
        if cuda:
            torch.cuda.empty_cache()
        for arm in order:
            pads.append(torch.empty(rng.randrange(0, a.pad_mib + 1) << 20, dtype=torch.uint8,
                                    device="cuda" if cuda else "cpu"))
            armsmod.build(arm, model, rt, weights)
        for label in perms[trial % len(perms)]:
            arm = arms[label]
            fork = arm.sub("graphs").fork_request
            rnd, st = fork(*started[label])
            with torch.no_grad():
                g = arm.engine.decode(rnd, st)
            if ref is None:
                ref = g.tokens
            if g.tokens != ref:
                raise SystemExit(f"arm {label} decoded other tokens than the first decode: the copies differ")
            body = g.step_ns[1:] or g.step_ns
            tokens = sum(s["emitted"] for s in g.steps[1:]) or 1
            rows.append({"trial": trial, "arm": label, "tpot_us": sum(body) / tokens / 1e3,
                         "execution": getattr(arm.engine, "execution", "eager")})
        del pads
    return {"seed": a.seed, "context": ctx, "model": model, "rows": rows}


def summarize(procs: list[dict]) -> list[dict]:
    """Per arm other than control: each process's log ratio against control with its se, then across
    processes the z rms and the pooled offset (``analysis.stats.pooled_arm_offset``)."""
    from analysis import stats

    out = []
    for label in LABELS[1:]:
        ms, ses = [], []
        for p in procs:
            by = {}
            for r in p["rows"]:
                by.setdefault(r["trial"], {})[r["arm"]] = math.log(r["tpot_us"])
            d = [t[label] - t["control"] for t in by.values() if label in t and "control" in t]
            if len(d) < 2:
                continue
            m = sum(d) / len(d)
            sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
            ms.append(m)
            ses.append(sd / math.sqrt(len(d)))
        if not ms:
            continue
        z = [m / s for m, s in zip(ms, ses) if s > 0]
        out.append({"arm": label, "processes": len(ms), "contrasts_pct": [round(100 * m, 3) for m in ms],
                    "se_pct": [round(100 * s, 3) for s in ses],
                    "sd_across_pct": 100 * (math.sqrt(sum((m - sum(ms) / len(ms)) ** 2 for m in ms) / (len(ms) - 1))
                                            if len(ms) > 1 else float("nan")),
                    "z_rms": math.sqrt(sum(v * v for v in z) / len(z)) if z else float("nan"),
                    "pooled_offset_pct": 100 * stats.pooled_arm_offset(ms, ses)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=8, help="independent processes (each one sample of the offsets)")
    ap.add_argument("--trials", type=int, default=10, help="epochs per process (every arm rebuilt, one decode each)")
    ap.add_argument("--context", type=int, default=16384, help="prompt length (random tokens)")
    ap.add_argument("--tokens", type=int, default=128, help="output budget per decode")
    ap.add_argument("--pad-mib", type=int, default=512, help="largest random pad before an engine's rebuild")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per process")
    ap.add_argument("--budget-s", type=float, default=0, help="start no process after this many seconds (0: no limit)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, reference backend: checks the script")
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(one_process(a)), flush=True)
        return
    if a.dry_run:
        a.processes, a.trials, a.tokens = 2, 3, 6
    procs, t0 = [], time.time()
    for k in range(a.processes):
        if a.budget_s and time.time() - t0 > a.budget_s:
            print(f"--budget-s {a.budget_s:g} spent: {a.processes - k} processes not started", flush=True)
            break
        cmd = [sys.executable, __file__, "--child", "--seed", str(a.seed + k), "--trials", str(a.trials),
               "--context", str(a.context), "--tokens", str(a.tokens), "--pad-mib", str(a.pad_mib)]
        cmd += ["--dry-run"] if a.dry_run else []
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"process {k}: over {a.timeout:g} s, stopped; the summary has the finished ones", flush=True)
            break
        res = [line[7:] for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        if r.returncode != 0 or not res:
            sys.exit(f"process {k} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        procs.append(json.loads(res[-1]))
        means = {lab: sum(x["tpot_us"] for x in procs[-1]["rows"] if x["arm"] == lab) /
                 max(1, sum(1 for x in procs[-1]["rows"] if x["arm"] == lab)) for lab in LABELS}
        print(f"process {k}: context {procs[-1]['context']}, " + ", ".join(f"{lab} {v:.2f} us" for lab, v in means.items())
              + f" ({procs[-1]['rows'][0]['execution']})", flush=True)
    summary = summarize(procs)
    for s in summary:
        print(f"{s['arm']:>9} vs control over {s['processes']} processes: contrasts {s['contrasts_pct']} % "
              f"(se {s['se_pct']}), sd across {s['sd_across_pct']:.3f} %, z rms {s['z_rms']:.2f}, "
              f"pooled offset {s['pooled_offset_pct']:.3f} %", flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "arm_offsets.json"), "w") as f:
            json.dump({"args": vars(a), "summary": summary, "processes": procs}, f, indent=1)


if __name__ == "__main__":
    main()
