"""The reference's own variation: how far do earlier logits move when a request grows by a few tokens?

For each request: prefill it (length L) with the checkout's reference engine, then prefill it again
with 1 and with 8 more tokens appended (the recorded next assistant turn, else seeded random ids),
and compare the logits at positions < L. Mathematically they are equal (attention is causal);
numerically they are not always: the prefill's last chunk has another row count (other GEMM
blocking) and full layers read keys up to the chunk's end, so reductions run in another order.
This is the noise floor a candidate's qualification against the reference must not mistake for an
error. Reported per bucket of distance from the prompt's end: max |Δlogit|, max relative
(|Δ| / max |logit| of the row), mean |Δ|, max |Δp| (softmax, temperature 1), argmax changes and
the fraction of rows that are bit-identical.

    python -m snapshots.stability model=q1-mini traces=claude400 [limit=N | sample=N] [appends=[1,8]]
        [out=FILE.json] [runtime.device=cuda runtime.dtype=bfloat16 ...]
"""
from __future__ import annotations

import json
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import tokenizer as tk
from .store import git_revision, group_dir, parse_cli, wants_help
from .traces import ArgumentError

# distance from the last prompt position: [lo, hi)
BUCKETS = ((0, 1), (1, 8), (8, 64), (64, 512), (512, 4096), (4096, 1 << 62))


def bucket_name(lo: int, hi: int) -> str:
    return "last" if hi - lo == 1 else (f"{lo}+" if hi >= 1 << 62 else f"{lo}-{hi - 1}")


def compared_positions(L: int, tail_rows: int, spread_rows: int) -> torch.Tensor:
    """All of the last `tail_rows` positions of the prompt plus up to `spread_rows` evenly spaced
    earlier ones (logits of every position of a 190K prompt would not fit in memory)."""
    tail = list(range(max(0, L - tail_rows), L))
    head_end = tail[0] if tail else L
    step = max(1, head_end // max(1, spread_rows))
    head = list(range(0, head_end, step))[:spread_rows]
    return torch.tensor(head + tail, dtype=torch.int64)


def prefill_logits(engine, tokens: list[int], positions: torch.Tensor) -> torch.Tensor:
    """FP32 logits [len(positions), V_local] of a fresh reference prefill of `tokens`."""
    rnd = engine.new_round(engine.capacity_for(len(tokens), 1))
    with torch.no_grad():
        hidden = engine.prefill(tokens, rnd)
        rows = hidden[positions.to(hidden.device)]
        return engine.model.logits(rows).float().cpu()


def continuation(corpus, request, k: int, vocab: int, seed: int = 0) -> list[int]:
    """The first k tokens of the recorded next assistant turn (content, then <|end|>), padded with
    seeded random ids; all folded into the model's vocabulary."""
    nxt = corpus.next_message(request) if corpus is not None else None
    ids = (tk.encode(nxt["content"]) + [tk.END_ID]) if nxt else []
    rng = random.Random(f"stability:{seed}:{getattr(request, 'request_id', request)}")
    while len(ids) < k:
        ids.append(rng.randrange(9, vocab))
    return [i % vocab for i in ids[:k]]


def compare(ref: torch.Tensor, new: torch.Tensor, dist: torch.Tensor) -> list[dict]:
    """Per-bucket statistics of new − ref (rows at distances `dist` from the prompt's end)."""
    diff = (new - ref).abs()
    row_max = diff.amax(-1)
    rel = row_max / ref.abs().amax(-1).clamp_min(1e-30)
    dp = (torch.softmax(new, -1) - torch.softmax(ref, -1)).abs().amax(-1)
    argmax = new.argmax(-1) != ref.argmax(-1)
    same = row_max == 0
    out = []
    for lo, hi in BUCKETS:
        sel = (dist >= lo) & (dist < hi)
        n = int(sel.sum())
        if not n:
            continue
        out.append({"bucket": bucket_name(lo, hi), "rows": n, "max_abs": row_max[sel].max().item(),
                    "max_rel": rel[sel].max().item(), "mean_abs": diff[sel].mean().item(),
                    "max_dp": dp[sel].max().item(), "argmax_changed": int(argmax[sel].sum()),
                    "identical_frac": float(same[sel].float().mean())})
    return out


def stability(engine, corpus, requests, appends=(1, 8), tail_rows: int = 1024, spread_rows: int = 1024,
              progress: bool = True) -> dict:
    results = []
    vocab = engine.cfg.vocab_size
    for r in requests:
        toks = corpus.tokens(r)
        L = len(toks)
        pos = compared_positions(L, tail_rows, spread_rows)
        dist = (L - 1) - pos
        t0 = time.perf_counter()
        ref = prefill_logits(engine, toks, pos)
        per = {}
        for k in appends:
            new = prefill_logits(engine, toks + continuation(corpus, r, k, vocab), pos)
            per[str(k)] = compare(ref, new, dist)
        results.append({"request_id": r.request_id, "prompt_len": L, "rows_compared": len(pos),
                        "seconds": round(time.perf_counter() - t0, 3), "appended": per})
        if progress:
            print(f"  {r.request_id}: {L:,} tokens, {len(pos)} positions, {results[-1]['seconds']:.1f} s",
                  file=sys.stderr)
    return {"model": engine.cfg.name, "checkpoint_hash": engine.checkpoint_hash, "trace": corpus.name,
            "corpus_hash": corpus.corpus_hash, "dtype": engine.rt.dtype, "device": str(engine.device),
            "appends": list(appends), "revision": git_revision(),
            "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "requests": results,
            "summary": summarise(results, appends)}


def summarise(results: list[dict], appends) -> dict:
    """Per appended count and bucket: the worst case over requests."""
    out = {}
    for k in appends:
        agg: dict[str, dict] = {}
        for r in results:
            for b in r["appended"][str(k)]:
                a = agg.setdefault(b["bucket"], {"bucket": b["bucket"], "rows": 0, "max_abs": 0.0, "max_rel": 0.0,
                                                 "max_dp": 0.0, "argmax_changed": 0, "identical_rows": 0})
                a["rows"] += b["rows"]
                a["identical_rows"] += round(b["identical_frac"] * b["rows"])
                a["argmax_changed"] += b["argmax_changed"]
                for f in ("max_abs", "max_rel", "max_dp"):
                    a[f] = max(a[f], b[f])
        order = [bucket_name(lo, hi) for lo, hi in BUCKETS]
        out[str(k)] = sorted(agg.values(), key=lambda a: order.index(a["bucket"]))
    return out


def format_table(report: dict) -> str:
    lines = [f"{report['model']} ({report['checkpoint_hash'][:24]}) {report['device']}/{report['dtype']}, "
             f"{len(report['requests'])} requests of {report['trace']}: logits at earlier positions after "
             "appending tokens and re-prefilling",
             f"{'+tok':>4} {'distance':>10} {'rows':>7} {'max|Δ|':>9} {'max rel':>9} {'max|Δp|':>9} "
             f"{'argmax Δ':>8} {'identical':>9}"]
    for k, rows in report["summary"].items():
        for a in rows:
            lines.append(f"{k:>4} {a['bucket']:>10} {a['rows']:>7} {a['max_abs']:>9.2e} {a['max_rel']:>9.2e} "
                         f"{a['max_dp']:>9.2e} {a['argmax_changed']:>8} {a['identical_rows'] / a['rows']:>8.1%}")
    return "\n".join(lines)


USAGE = """\
usage: python -m snapshots.stability model=NAME traces=CORPUS [key=value ...]

Re-prefill requests with 1 and 8 appended tokens and report how far the reference's logits at
earlier positions move (its own variation, per bucket of distance from the prompt's end).

  model=q1-mini traces=claude400 traces_store=DIR checkpoint=DIR random_seed=0
  limit=3 | sample=N (sample_seed=0)   the N shortest requests | a random N
  appends=[1,8]                        numbers of appended tokens
  tail_rows=1024 spread_rows=1024      positions compared: the last tail_rows + evenly spaced earlier ones
  out=FILE.json                        default <store>/<model>-<ckpt>/<trace>/stability-<dtype>-<device>.json
  runtime.device=cuda runtime.dtype=bfloat16 ..."""


def main(argv: list[str] | None = None) -> int:
    argv, helped = wants_help(argv, USAGE)
    if helped:
        return 0
    from .capture import build_engine
    from .traces import CorpusError, load_corpus

    try:
        cfg = parse_cli("stability", argv)
        appends = cfg["appends"] if isinstance(cfg["appends"], list) else [cfg["appends"]]
        if not appends or any(not isinstance(k, int) or k < 1 for k in appends):
            raise ArgumentError(f"appends={cfg['appends']!r}: expected positive integers, e.g. appends=[1,8]")
        if cfg["sample"] is not None and any(a.startswith("limit=") for a in argv):
            raise ArgumentError("give limit=N or sample=N, not both")
    except ArgumentError as e:
        print(f"error: {e}\n(see --help)", file=sys.stderr)
        return 2
    try:
        corpus = load_corpus(cfg["traces"], cfg["traces_store"])
        engine = build_engine(cfg)
        reqs = sorted(corpus.requests, key=lambda r: (r.n_tokens, r.request_id))
        if cfg["sample"] is not None:
            reqs = sorted(random.Random(int(cfg["sample_seed"])).sample(reqs, min(int(cfg["sample"]), len(reqs))),
                          key=lambda r: (r.n_tokens, r.request_id))
        elif cfg["limit"] is not None:
            reqs = reqs[:int(cfg["limit"])]
        for r in reqs:
            engine.check_request(r.n_tokens + max(appends), 1)
        report = stability(engine, corpus, reqs, tuple(appends), int(cfg["tail_rows"]), int(cfg["spread_rows"]))
    except (CorpusError, ValueError, tk.TokenizerAssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = Path(cfg["out"]) if cfg["out"] else (
        group_dir(cfg["store"], engine.cfg.name, engine.checkpoint_hash, corpus.name)
        / f"stability-{engine.rt.dtype}-{engine.device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
