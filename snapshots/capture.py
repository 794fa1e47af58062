"""Capture prefill snapshots: real target prefill once per request, saved for many restores.

What a snapshot holds (everything decode needs that the target prefill produced):

- ``prompt`` — the request's token ids [L] (int64);
- ``layer.<i>.k`` / ``layer.<i>.v`` — full-attention layers: K/V of positions 0..L-1 [kv_heads, L, d]
  (the cache's capacity beyond L is zeros after a prefill and is rebuilt, not stored);
  sliding layers: the whole ring [kv_heads, slots, d] and ``layer.<i>.labels`` [slots] (slot →
  position, -1 empty);
- ``hidden`` — the target hidden rows the draft prefill consumes, rows ``hidden_start``..L-1. A
  full-attention draft layer needs them all. A sliding draft layer keeps only the last ring-size
  positions, so fewer suffice: ``draft_rows=minimal`` keeps the last min(L, ring slots) rows, which
  reproduces the draft K/V and first drafts to ~1e-8 but not bit for bit (the draft prefill's
  chunks then have other row counts and its last chunk sees another ring layout, so reductions run
  in another order); ``draft_rows=aligned`` (default) starts at the draft prefill's chunk boundary
  at or before (start of its last chunk − ring slots), at most ring + 2 chunks (≈2.6K rows for
  q1-mini), so the restore replays the same chunks over the same ring and is bit-exact.

The draft layer's own cache is not stored: :func:`snapshots.restore.restore` rebuilds it by running
the restoring engine's draft prefill, so an arm that changes the draft layer is measured with it.

Sizes (``state.safetensors``; manifest ~5 KB):

- q1-mini (float32 reference, 1 full layer of 4, 1 KV head × 64, rings of 576 slots, hidden 256),
  measured on claude400's 5 shortest requests (1,014–1,016 tokens): 2.47 MB each, 2,430 B per
  prompt token (519 KB full-layer K/V, 899 KB rings, 1,038 KB hidden rows, 8 KB prompt). Marginal
  cost 512 B/token (the full layer's K/V); fixed ≈ 0.9 MB of rings + at most 2.7 MB of aligned
  hidden rows. All 400 claude400 requests (12.27 M tokens), computed from their lengths: 7.36 GB,
  600 B/token on average.
- one q1 rank (tp.size=8 emulate_rank=0), BF16, at 192K = 196,608 positions, on paper:
  22 full layers × 196,608 × 1 KV head × 128 × 2 (K,V) × 2 B = 2,214.6 MB (11,264 B/token);
  66 rings × 4,160 slots × 128 × 2 × 2 B = 140.6 MB + 2.2 MB labels;
  hidden rows for the full-attention draft layer: 196,608 × 6,144 × 2 B = 2,415.9 MB (12,288 B/token);
  prompt 1.6 MB. Total 4.77 GB per request, 24.3 KB/token (23.6 KB/token marginal + 143 MB fixed).
  Storing the draft layer's K/V (512 B/token) instead of its input rows would halve this, at the
  price of not re-running the arm's own draft prefill on restore.

Command line (``key=value``, defaults in ``conf/snapshots/capture.yaml``)::

    python -m snapshots.capture model=q1-mini traces=claude400 [limit=N] [budget=64] [store=DIR]
        [traces_store=DIR] [draft_rows=aligned|minimal] [checkpoint=DIR] [out=summary.json]
        [runtime.device=cuda runtime.dtype=bfloat16 ...]

Requests run shortest first (progress is visible early); ``limit=N`` takes the N shortest. An
existing valid snapshot (manifest and checksums good, same model, checkpoint, tokenizer and corpus
hashes) is reused, not recomputed; an existing damaged or mismatching one is reported and left as
it is (``python -m snapshots.store prune invalid=true`` removes damaged ones).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import tokenizer as tk
from .store import (MANIFEST, SCHEMA, SCHEMA_VERSION, STATE, SnapshotError, commit_dir, file_entry, git_revision,
                    load_manifest, new_tmp_dir, parse_cli, resolve_store, runtime_settings, snapshot_dir, wants_help)
from .traces import ArgumentError

DRAFT_ROWS = ("aligned", "minimal")
DEFAULT_DRAFT_CHUNK = 1024


def request_seed(request_id: str) -> int:
    """The request's sampling seed: 31 bits of sha256(request_id), the same on every machine."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:4], "big") & 0x7FFFFFFF


def prompt_digest(prompt: torch.Tensor) -> str:
    return hashlib.sha256(prompt.to(torch.int64).cpu().contiguous().numpy().tobytes()).hexdigest()


def draft_chunk(engine) -> int:
    """Row chunk of the engine's draft prefill (the default of ``model.mtp_prefill(chunk=)``)."""
    try:
        d = inspect.signature(engine.model.mtp_prefill).parameters["chunk"].default
        return int(d) if isinstance(d, int) and d > 0 else DEFAULT_DRAFT_CHUNK
    except (AttributeError, KeyError, TypeError, ValueError):
        return DEFAULT_DRAFT_CHUNK


def draft_hidden_start(prompt_len: int, draft_caches: list, chunk: int, policy: str = "aligned") -> int:
    """First hidden row the draft prefill needs (see the module docstring). Hidden row i feeds the
    draft row at position i + 1; the draft prefill's chunks start at rows 0, chunk, 2·chunk, …"""
    if policy not in DRAFT_ROWS:
        raise ValueError(f"draft_rows={policy!r}: expected one of {DRAFT_ROWS}")
    if not draft_caches or any(c.kind == "full" for c in draft_caches):
        return 0
    ring = max(c.slots for c in draft_caches)
    L = prompt_len
    if policy == "minimal":
        return max(0, L - ring)
    last_chunk = chunk * ((L - 1) // chunk)
    return chunk * (max(0, last_chunk - ring) // chunk)


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.clone() if t.device.type == "cpu" else t.cpu()


def runtime_record(engine) -> dict:
    rt = engine.rt
    tp = rt.tp
    return {"dtype": rt.dtype, "device": str(engine.device), "backend": getattr(rt, "backend", None),
            "tp": {"size": tp.size, "rank": tp.rank, "emulate_rank": tp.emulate_rank}}


def capture_state(engine, prompt: list[int], budget: int, draft_rows: str = "aligned"
                  ) -> tuple[dict[str, torch.Tensor], dict, float]:
    """Real target prefill of `prompt`; returns (tensors to save, the manifest's ``state``, seconds)."""
    L = len(prompt)
    engine.check_request(L, budget)
    rnd = engine.new_round(engine.capacity_for(L, budget))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    hidden = engine.prefill(prompt, rnd)
    sync()
    seconds = time.perf_counter() - t0
    tensors = {"prompt": torch.as_tensor(prompt, dtype=torch.int64).cpu().clone()}
    layers, nbytes = [], {"full_kv": 0, "rings": 0, "hidden": 0, "prompt": tensors["prompt"].numel() * 8}
    for i, c in enumerate(rnd.cache.layers):
        if c.kind == "full":
            k, v = _host(c.k[:, :L]), _host(c.v[:, :L])
            nbytes["full_kv"] += k.nbytes + v.nbytes
        else:
            k, v, labels = _host(c.k), _host(c.v), _host(c.labels)
            tensors[f"layer.{i}.labels"] = labels
            nbytes["rings"] += k.nbytes + v.nbytes + labels.nbytes
        tensors[f"layer.{i}.k"], tensors[f"layer.{i}.v"] = k, v
        layers.append({"kind": c.kind, "slots": c.slots, "window": c.window, "rows": k.shape[1]})
    chunk = draft_chunk(engine)
    hs = draft_hidden_start(L, list(rnd.cache.mtp), chunk, draft_rows)
    tensors["hidden"] = _host(hidden[hs:])
    nbytes["hidden"] = tensors["hidden"].nbytes
    state = {"layers": layers, "cache_dtype": str(rnd.cache.layers[0].k.dtype).replace("torch.", ""),
             "hidden_dtype": str(hidden.dtype).replace("torch.", ""), "hidden_start": hs,
             "hidden_rows": L - hs, "draft_rows": draft_rows, "draft_chunk": chunk,
             "draft_layers": [{"kind": c.kind, "slots": c.slots} for c in rnd.cache.mtp], "bytes": nbytes}
    return tensors, state, seconds


def _expectations(engine, prompt_sha: str, meta: dict) -> dict:
    return {"model name": (("model", "name"), engine.cfg.name),
            "checkpoint hash": (("model", "checkpoint_hash"), engine.checkpoint_hash),
            "tokenizer hash": (("tokenizer_hash",), tk.tokenizer_hash()),
            "trace corpus hash": (("trace", "corpus_hash"), (meta.get("trace") or {}).get("corpus_hash")),
            "prompt": (("request", "prompt_sha256"), prompt_sha),
            "runtime dtype": (("runtime", "dtype"), engine.rt.dtype),
            "tensor-parallel shard": (("runtime", "tp"), runtime_record(engine)["tp"])}


def check_existing(path: Path, engine, prompt_sha: str, meta: dict) -> dict:
    """The manifest of an existing snapshot at `path` if it is valid and of this model, checkpoint,
    tokenizer, corpus and prompt; else SnapshotError naming the file and the difference."""
    m = load_manifest(path, check_files=True)
    for what, (keys, want) in _expectations(engine, prompt_sha, meta).items():
        if want is None:
            continue
        got = m
        for k in keys:
            got = got.get(k) if isinstance(got, dict) else None
        if got != want:
            raise SnapshotError(f"{path / MANIFEST}: existing snapshot has another {what} ({got!r}, this capture "
                                f"{want!r}); left as it is — remove it (python -m snapshots.store prune ...) to recapture")
    return m


def capture_request(engine, prompt_tokens: list[int], request_id: str, seed: int, budget: int,
                    out_dir: str | Path, meta: dict | None = None, draft_rows: str = "aligned"
                    ) -> tuple[dict, bool]:
    """Snapshot one request into `out_dir` (the request's own directory). Returns (manifest, reused).

    `meta` may hold ``trace`` ({name, corpus_hash, ...}) and anything else to record. An existing
    valid snapshot of the same model/checkpoint/tokenizer/corpus/prompt is reused as it is; an
    existing damaged or different one raises SnapshotError and is not touched. The new snapshot is
    written in a temporary directory and renamed into place."""
    out_dir, meta = Path(out_dir), dict(meta or {})
    prompt = torch.as_tensor(list(prompt_tokens), dtype=torch.int64)
    psha = prompt_digest(prompt)
    if out_dir.exists():
        return check_existing(out_dir, engine, psha, meta), True
    t_wall = time.time()
    tensors, state, prefill_s = capture_state(engine, prompt.tolist(), budget, draft_rows)
    from safetensors.torch import save_file

    tmp = new_tmp_dir(out_dir)
    try:
        save_file(tensors, str(tmp / STATE), metadata={"schema": SCHEMA, "request_id": request_id})
        manifest = {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "request_id": request_id,
            "model": {"name": engine.cfg.name, "checkpoint_hash": engine.checkpoint_hash,
                      "config": engine.cfg.to_dict()},
            "tokenizer_hash": tk.tokenizer_hash(),
            "trace": meta.pop("trace", None) or {},
            "request": {"prompt_len": int(prompt.numel()), "prompt_sha256": psha, "seed": int(seed),
                        "budget": int(budget)},
            "runtime": runtime_record(engine),
            "state": state,
            "files": {STATE: file_entry(tmp / STATE)},
            "revision": git_revision(),
            "capture": {"time_utc": datetime.fromtimestamp(t_wall, timezone.utc).isoformat(timespec="seconds"),
                        "unix_time": t_wall, "prefill_seconds": round(prefill_s, 4),
                        "seconds": round(time.time() - t_wall, 4), "host": platform.node(),
                        "torch": torch.__version__, "python": platform.python_version()},
            "meta": meta,
            "qualification": None,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        commit_dir(tmp, out_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest, False


def snapshot_bytes(manifest: dict) -> int:
    return sum(e["bytes"] for e in manifest["files"].values())


def capture_corpus(engine, corpus, store=None, budget: int = 64, limit: int | None = None,
                   draft_rows: str = "aligned", progress: bool = True) -> dict:
    """Capture every request of `corpus` (shortest first; `limit`: the N shortest) into the store.
    Returns a summary; per-request problems (an existing damaged snapshot, a request too long for the
    model) are collected in ``errors`` and the other requests still run."""
    from tqdm import tqdm

    reqs = sorted(corpus.requests, key=lambda r: (r.n_tokens, r.request_id))
    if limit is not None:
        reqs = reqs[:int(limit)]
    trace = {"name": corpus.name, "corpus_hash": corpus.corpus_hash}
    rows, errors = [], []
    done_bytes = 0
    t0 = time.perf_counter()
    bar = tqdm(total=sum(r.n_tokens for r in reqs), unit="tok", unit_scale=True, disable=not progress,
               desc=f"capture {engine.cfg.name}/{corpus.name}", dynamic_ncols=True,
               mininterval=0.1 if sys.stderr.isatty() else 15)   # logs get a line every 15 s, not a flood
    for i, r in enumerate(reqs):
        out = snapshot_dir(store, engine.cfg.name, engine.checkpoint_hash, corpus.name, r.request_id)
        meta = {"trace": dict(trace, request_id=r.request_id, session_id=r.session_id, n_messages=r.n_messages)}
        t1 = time.perf_counter()
        try:
            m, reused = capture_request(engine, corpus.tokens(r), r.request_id, request_seed(r.request_id),
                                        budget, out, meta, draft_rows)
            n = snapshot_bytes(m)
            done_bytes += n
            rows.append({"request_id": r.request_id, "prompt_len": m["request"]["prompt_len"], "bytes": n,
                         "reused": reused, "seconds": round(time.perf_counter() - t1, 3),
                         "budget": m["request"]["budget"], "dir": str(out)})
        except (SnapshotError, ValueError) as e:
            errors.append({"request_id": r.request_id, "error": str(e)})
            if progress:
                tqdm.write(f"error: {r.request_id}: {e}", file=sys.stderr)
        bar.update(r.n_tokens)
        bar.set_postfix_str(f"req {i + 1}/{len(reqs)} reused {sum(x['reused'] for x in rows)} "
                            f"{done_bytes / 1e6:,.1f} MB")
    bar.close()
    tokens = sum(x["prompt_len"] for x in rows)
    return {"model": engine.cfg.name, "checkpoint_hash": engine.checkpoint_hash, "trace": corpus.name,
            "corpus_hash": corpus.corpus_hash, "runtime": runtime_record(engine), "budget": budget,
            "draft_rows": draft_rows, "requests": len(reqs), "captured": sum(not x["reused"] for x in rows),
            "reused": sum(x["reused"] for x in rows), "failed": len(errors), "tokens": tokens,
            "bytes": done_bytes, "bytes_per_token": done_bytes / max(1, tokens),
            "seconds": round(time.perf_counter() - t0, 2),
            "store": str(resolve_store(store)), "rows": rows, "errors": errors}


def build_engine(cfg: dict):
    """The checkout's engine for a command's config (model, runtime overrides, checkpoint)."""
    from runtime.engine import Engine

    return Engine.build(cfg["model"], runtime_settings(cfg.get("runtime")), cfg.get("checkpoint"),
                        int(cfg.get("random_seed") or 0))


USAGE = """\
usage: python -m snapshots.capture model=NAME traces=CORPUS [key=value ...]

Real target prefill of every request of a trace corpus, saved as snapshots (shortest first).

  model=q1-mini              model config (conf/model/*.yaml); checkpoint=DIR, else the committed
                             asset, else a seeded random checkpoint (random_seed=0)
  traces=claude400           corpus name; traces_store=DIR (default $IQUESTRT_HOME/traces)
  limit=N                    only the N shortest requests
  budget=64                  output budget recorded with each snapshot (sets the cache capacity)
  store=DIR                  snapshot store (default $IQUESTRT_HOME/snapshots, ~/.cache/iquestrt/snapshots)
  draft_rows=aligned         hidden rows kept for a sliding draft layer: aligned (bit-exact) | minimal
  out=FILE.json              also write the summary (per request: tokens, bytes, seconds) as JSON
  progress=false             no progress bar
  runtime.device=cuda runtime.dtype=bfloat16 runtime.tp.size=8 runtime.tp.emulate_rank=0 ...

Exit status: 0 all captured or reused; 1 some request failed (listed; nothing was overwritten);
2 bad arguments."""


def main(argv: list[str] | None = None) -> int:
    argv, helped = wants_help(argv, USAGE)
    if helped:
        return 0
    from .traces import CorpusError, load_corpus

    try:
        cfg = parse_cli("capture", argv)
        if cfg["draft_rows"] not in DRAFT_ROWS:
            raise ArgumentError(f"draft_rows={cfg['draft_rows']!r}: expected one of {DRAFT_ROWS}")
        if cfg["limit"] is not None and int(cfg["limit"]) < 1:
            raise ArgumentError("limit must be at least 1")
    except ArgumentError as e:
        print(f"error: {e}\n(see --help)", file=sys.stderr)
        return 2
    try:
        corpus = load_corpus(cfg["traces"], cfg["traces_store"])
        t0 = time.perf_counter()
        engine = build_engine(cfg)
        build_s = time.perf_counter() - t0
        summary = capture_corpus(engine, corpus, cfg["store"], int(cfg["budget"]), cfg["limit"],
                                 cfg["draft_rows"], bool(cfg["progress"]))
    except (CorpusError, ValueError, tk.TokenizerAssetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary["build_seconds"] = round(build_s, 2)
    if cfg["out"]:
        Path(cfg["out"]).write_text(json.dumps(summary, indent=1) + "\n")
    s = summary
    print(f"{s['model']} ({s['checkpoint_hash'][:24]}) on {s['runtime']['device']}/{s['runtime']['dtype']}, "
          f"trace {s['trace']} ({s['corpus_hash'][:12]}): {s['requests']} requests, {s['captured']} captured, "
          f"{s['reused']} reused, {s['failed']} failed")
    print(f"{s['tokens']:,} prompt tokens, {s['bytes'] / 1e6:,.1f} MB, {s['bytes_per_token']:,.0f} B/token, "
          f"{s['seconds']:.1f} s (+{build_s:.1f} s engine build) -> "
          f"{Path(s['rows'][0]['dir']).parent if s['rows'] else s['store']}")
    for e in s["errors"]:
        print(f"  failed {e['request_id']}: {e['error']}", file=sys.stderr)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
