"""Qualify snapshots: a restored request must generate exactly what a real prefill generates.

For each snapshot (or a sample): decode once from real prefill (``engine.start``) and once from
:func:`snapshots.restore.restore`, with the snapshot's seed and budget. It passes when the token
sequences and the per-step acceptance records (width, accepted, emitted) are identical and — with
``exact=true``, the default — the state right after prefill (first token, first drafts, their
proposal distributions, the draft layer's hidden row) is equal bit for bit, which the restore is
built to guarantee (a token comparison alone misses small numerical damage more often than not).
The result — pass/fail, tokens compared, first mismatch, times — is written into the manifest as
the snapshot's ``qualification`` (atomically; negative-control runs record nothing).

Negative control: ``broken=cache_len_off_by_one|perturbed_hidden`` restores deliberately wrongly;
the command then succeeds only if every snapshot is rejected.

    python -m snapshots.verify model=q1-mini traces=claude400 [limit=N | sample=N] [budget=64]
        [broken=MODE] [exact=false] [store=DIR] [out=results.json] [runtime.device=cuda ...]
"""
from __future__ import annotations

import json
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .restore import BROKEN, load_snapshot, restore
from .store import (TMP_PREFIX, SnapshotError, git_revision, group_dir, load_manifest, parse_cli, update_manifest,
                    wants_help)
from .traces import ArgumentError

STATE_FIELDS = ("tokens", "q_ids", "q_probs", "g", "n_drafts", "out", "n_out", "done", "start")


def _state(st) -> dict[str, torch.Tensor]:
    return {k: getattr(st, k).detach().clone() for k in STATE_FIELDS if hasattr(st, k)}


def _first_mismatch(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verify_snapshot(engine, snapshot_dir: str | Path, budget: int | None = None, broken: str | None = None,
                    exact: bool = True, record: bool = True) -> dict:
    """Compare real prefill + decode with restore + decode for one snapshot; returns the result and
    (record, and not a negative control) writes it into the manifest as ``qualification``.
    Raises SnapshotError for a snapshot that cannot be read or does not belong to the engine."""
    d = Path(snapshot_dir)
    m, t = load_snapshot(d)
    seed = int(m["request"]["seed"])
    budget = int(m["request"]["budget"] if budget is None else budget)
    prompt = t["prompt"].tolist()
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    t0 = time.perf_counter()
    rnd, st = engine.start(prompt, seed, budget)
    sync()
    t_prefill = time.perf_counter() - t0
    ref_state = _state(st)
    ref = engine.decode(rnd, st)
    t_ref = time.perf_counter() - t0
    del rnd, st

    t0 = time.perf_counter()
    rnd, st = restore(engine, d, budget=budget, broken=broken, loaded=(m, t))
    sync()
    t_restore = time.perf_counter() - t0
    got_state = _state(st)
    got = engine.decode(rnd, st)
    t_got = time.perf_counter() - t0
    del rnd, st

    state_exact = all(k in got_state and ref_state[k].shape == got_state[k].shape
                      and torch.equal(ref_state[k], got_state[k]) for k in ref_state)
    diffs = [(ref_state[k].float() - got_state[k].float()).abs().max().item()
             for k in ("q_probs", "g") if k in ref_state and ref_state[k].shape == got_state[k].shape]
    rec = lambda g: [(s["width"], s["accepted"], s["emitted"]) for s in g.steps]  # noqa: E731
    tokens_identical = ref.tokens == got.tokens
    steps_identical = rec(ref) == rec(got)
    passed = tokens_identical and steps_identical and (state_exact or not exact)
    q = {
        "passed": passed,
        "tokens_compared": len(ref.tokens),
        "tokens_identical": tokens_identical,
        "first_mismatch": _first_mismatch(ref.tokens, got.tokens),
        "steps_identical": steps_identical,
        "steps": [len(ref.steps), len(got.steps)],
        "state_exact": state_exact,
        "state_max_abs_diff": max(diffs) if diffs else None,
        "exact_required": exact,
        "budget": budget,
        "seed": seed,
        "broken": broken,
        "seconds": {"real_prefill": round(t_prefill, 4), "real_total": round(t_ref, 4),
                    "restore": round(t_restore, 4), "restored_total": round(t_got, 4)},
        "engine": {"model": engine.cfg.name, "checkpoint_hash": engine.checkpoint_hash,
                   "dtype": engine.rt.dtype, "device": str(engine.device)},
        "revision": git_revision(),
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if record and broken is None:
        update_manifest(d, qualification=q)
    return q


def _passed(p: Path) -> bool:
    try:
        q = load_manifest(p, check_files=False).get("qualification")
    except SnapshotError:
        return False
    return bool(q and q.get("passed"))


def select_snapshots(directory: Path, limit: int | None = None, sample: int | None = None,
                     sample_seed: int = 0, order: str = "length", unverified_only: bool = False) -> list[Path]:
    """Snapshot directories of a group (incomplete ``.tmp-`` ones left out), shortest first;
    `limit`: the N shortest; `sample`: a seeded random N of them; ``order="shuffle"``: the
    selection in seeded random order (a run cut short by a time limit still spans all lengths);
    `unverified_only`: leave out snapshots whose manifest already records a passed qualification
    (continues a verify run cut short by time_limit_s)."""
    if not directory.is_dir():
        raise SnapshotError(f"{directory}: no snapshots here (capture first: python -m snapshots.capture ...)")
    dirs = [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(TMP_PREFIX)]
    if unverified_only:
        dirs = [p for p in dirs if not _passed(p)]

    def length(p: Path) -> int:
        try:
            return load_manifest(p, check_files=False)["request"]["prompt_len"]
        except SnapshotError:
            return -1   # damaged ones first: their error shows at once
    dirs.sort(key=lambda p: (length(p), p.name))
    if sample is not None:
        dirs = sorted(random.Random(sample_seed).sample(dirs, min(int(sample), len(dirs))),
                      key=lambda p: (length(p), p.name))
    if limit is not None:
        dirs = dirs[:int(limit)]
    if order == "shuffle":
        random.Random(f"order:{sample_seed}").shuffle(dirs)
    elif order != "length":
        raise ArgumentError(f"order={order!r}: expected length or shuffle")
    return dirs


USAGE = """\
usage: python -m snapshots.verify model=NAME traces=CORPUS [key=value ...]

Decode every selected snapshot from real prefill and from its restore; they must be identical.

  model=q1-mini traces=claude400  which snapshot group (with the engine's checkpoint hash)
  checkpoint=DIR random_seed=0    the engine's checkpoint (as for capture)
  limit=N | sample=N              the N shortest | a random N (sample_seed=0)
  budget=N                        output budget (default: each snapshot's recorded budget)
  exact=false                     compare tokens and steps only, not the post-prefill state bits
  broken=cache_len_off_by_one|perturbed_hidden
                                  negative control: succeeds only if every snapshot is rejected
  record=false                    do not write qualifications into the manifests
  time_limit_s=N order=shuffle    start no snapshot after N seconds (reported as PARTIAL); shuffle
                                  the order so a partial run spans all prompt lengths
  unverified_only=true            skip snapshots already qualified (continue a PARTIAL run)
  store=DIR out=FILE.json runtime.device=cuda ...

Exit status: 0 all passed (or, with broken=, all rejected); 1 otherwise; 2 bad arguments."""


def main(argv: list[str] | None = None) -> int:
    argv, helped = wants_help(argv, USAGE)
    if helped:
        return 0
    from .capture import build_engine

    try:
        cfg = parse_cli("verify", argv)
        if cfg["broken"] is not None and cfg["broken"] not in BROKEN:
            raise ArgumentError(f"broken={cfg['broken']!r}: expected one of {', '.join(BROKEN)}")
        if cfg["limit"] is not None and cfg["sample"] is not None:
            raise ArgumentError("give limit=N or sample=N, not both")
    except ArgumentError as e:
        print(f"error: {e}\n(see --help)", file=sys.stderr)
        return 2
    try:
        engine = build_engine(cfg)
        gdir = group_dir(cfg["store"], engine.cfg.name, engine.checkpoint_hash, cfg["traces"])
        dirs = select_snapshots(gdir, cfg["limit"], cfg["sample"], int(cfg["sample_seed"]), cfg["order"],
                                bool(cfg["unverified_only"]))
    except ArgumentError as e:
        print(f"error: {e}\n(see --help)", file=sys.stderr)
        return 2
    except (ValueError, SnapshotError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    broken = cfg["broken"]
    if cfg["unverified_only"] and not dirs:
        print(f"nothing to verify: every snapshot in {gdir} already records a passed qualification")
        return 0
    print(f"verify {len(dirs)} snapshots in {gdir} on {engine.device}/{engine.rt.dtype}"
          + (f" — NEGATIVE CONTROL broken={broken}" if broken else ""))
    print(f"{'request':<12} {'prompt':>7} {'tokens':>6} {'steps':>9} {'tokens=':>7} {'steps=':>6} "
          f"{'state=':>6} {'max|d|':>8} {'real s':>7} {'restore s':>9}  result")
    results, t0 = [], time.perf_counter()
    limit_s = cfg["time_limit_s"]
    for i, d in enumerate(dirs):
        if limit_s is not None and time.perf_counter() - t0 > float(limit_s):
            skipped = [p.name for p in dirs[i:]]
            break
        try:
            q = verify_snapshot(engine, d, cfg["budget"], broken, bool(cfg["exact"]), bool(cfg["record"]))
        except (SnapshotError, ValueError) as e:
            results.append({"request_id": d.name, "dir": str(d), "passed": False, "error": str(e)})
            print(f"{d.name:<12} error: {e}")
            continue
        L = load_manifest(d, check_files=False)["request"]["prompt_len"]
        results.append({"request_id": d.name, "dir": str(d), "prompt_len": L, **q})
        s = q["seconds"]
        dd = q["state_max_abs_diff"]
        print(f"{d.name:<12} {L:>7,} {q['tokens_compared']:>6} {q['steps'][0]:>4}/{q['steps'][1]:<4} "
              f"{'yes' if q['tokens_identical'] else 'NO':>7} {'yes' if q['steps_identical'] else 'NO':>6} "
              f"{'yes' if q['state_exact'] else 'NO':>6} {dd if dd is not None else float('nan'):>8.1e} "
              f"{s['real_total']:>7.2f} {s['restored_total']:>9.2f}  "
              f"{'pass' if q['passed'] else 'FAIL' + (' (first mismatch at token ' + str(q['first_mismatch']) + ')' if q['first_mismatch'] is not None else '')}")
    else:
        skipped = []
    passed = sum(1 for r in results if r["passed"])
    elapsed = time.perf_counter() - t0
    tokens = sum(r.get("tokens_compared", 0) for r in results)
    if cfg["out"]:
        Path(cfg["out"]).write_text(json.dumps({"group": str(gdir), "broken": broken, "passed": passed,
                                                "total": len(results), "skipped": skipped, "seconds": elapsed,
                                                "results": results},
                                               indent=1) + "\n")
    if broken:
        print(f"negative control broken={broken}: {len(results) - passed}/{len(results)} rejected "
              f"({tokens} tokens compared, {elapsed:.1f} s)")
        return 0 if results and passed == 0 else 1
    print(f"{passed}/{len(results)} snapshots reproduce real prefill ({tokens} tokens compared, {elapsed:.1f} s)"
          + (f"; PARTIAL: {len(skipped)} of {len(dirs)} not verified (time_limit_s={limit_s})" if skipped else ""))
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
