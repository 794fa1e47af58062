"""Restore a prefill snapshot into an engine: the API the replay harness and the runtime share.

``restore(engine, snapshot_dir) -> (rnd, state)``: validate the manifest and checksums, check that
the snapshot belongs to this engine's model, checkpoint, dtype and shard and to this checkout's
tokenizer, build a round with the capacity real prefill would have had, copy the target caches in,
then let the engine run its own draft prefill on the saved hidden rows and draw the first token and
drafts (``engine.begin(..., hidden_start=)``). The result is what ``engine.start`` returns after a
real prefill, ready for ``engine.decode``.

Duck-typed over the engine: the harness restores into engines imported from other git revisions
under other module names, so this module uses only engine attributes and methods (``cfg``,
``checkpoint_hash``, ``rt``, ``device``, ``check_request``, ``capacity_for``, ``new_round``,
``begin``; a round's ``cache.layers`` with ``kind``/``k``/``v``/``labels``) and never imports
``runtime``.

Negative controls (``broken=``), which verification must reject:
- ``cache_len_off_by_one``: the restored cache length is one short — position L-1 is left out of
  every cache and decoding starts at L-1 (a classic length bug);
- ``perturbed_hidden``: the saved hidden rows get noise of 1e-3 of each row's RMS (a small numerical
  corruption: the first-draft state differs; the tokens usually do too).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from . import tokenizer as tk
from .store import MANIFEST, STATE, SnapshotError, load_manifest

BROKEN = ("cache_len_off_by_one", "perturbed_hidden")
PERTURB_SCALE = 1e-3


def load_snapshot(snapshot_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors on the CPU) of a snapshot whose manifest, schema and checksums are good and
    whose tensors agree with the manifest. Refuses (SnapshotError) anything else, naming the file."""
    d = Path(snapshot_dir)
    m = load_manifest(d, check_files=True)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(d / STATE), device="cpu")
    except (SafetensorError, OSError) as e:
        raise SnapshotError(f"{d / STATE}: unreadable ({e})") from None
    L, st = m["request"]["prompt_len"], m["state"]
    problems = []
    if "prompt" not in t or t["prompt"].shape != (L,):
        problems.append(f"prompt shape {tuple(t['prompt'].shape) if 'prompt' in t else None}, manifest length {L}")
    if "hidden" not in t or t["hidden"].shape[0] != st["hidden_rows"] or st["hidden_start"] + st["hidden_rows"] != L:
        problems.append("hidden rows disagree with the manifest")
    for i, layer in enumerate(st["layers"]):
        names = [f"layer.{i}.k", f"layer.{i}.v"] + ([f"layer.{i}.labels"] if layer["kind"] != "full" else [])
        if any(n not in t for n in names):
            problems.append(f"layer {i} tensors missing")
    if problems:
        raise SnapshotError(f"{d / STATE}: " + "; ".join(problems))
    return m, t


def check_engine(manifest: dict, engine, path: str | Path) -> None:
    """Refuse (SnapshotError naming the manifest) a snapshot of another model, model config,
    checkpoint, tokenizer, dtype or tensor-parallel shard than `engine` (and this checkout) use."""
    mp = Path(path) / MANIFEST
    mm = manifest["model"]
    if mm["name"] != engine.cfg.name:
        raise SnapshotError(f"{mp}: snapshot of model {mm['name']!r}, the engine runs {engine.cfg.name!r}")
    mine = engine.cfg.to_dict()
    diff = sorted(k for k in set(mine) & set(mm["config"]) if k != "checkpoint" and mine[k] != mm["config"][k])
    if diff:
        raise SnapshotError(f"{mp}: model config differs from the engine's in {', '.join(diff)} "
                            f"(e.g. {diff[0]}: snapshot {mm['config'][diff[0]]!r}, engine {mine[diff[0]]!r})")
    if mm["checkpoint_hash"] != engine.checkpoint_hash:
        raise SnapshotError(f"{mp}: snapshot of checkpoint {mm['checkpoint_hash']!r}, the engine loaded "
                            f"{engine.checkpoint_hash!r}")
    try:
        current = tk.tokenizer_hash()
    except tk.TokenizerAssetError as e:
        raise SnapshotError(f"{mp}: cannot check the tokenizer: {e}") from None
    if manifest["tokenizer_hash"] != current:
        raise SnapshotError(f"{mp}: snapshot tokenised with tokenizer {manifest['tokenizer_hash'][:12]}…, this "
                            f"checkout's tokenizer is {current[:12]}… (recapture)")
    rt, srt = engine.rt, manifest["runtime"]
    if srt["dtype"] != rt.dtype:
        raise SnapshotError(f"{mp}: captured with runtime.dtype={srt['dtype']}, the engine runs {rt.dtype} "
                            "(restore into the same dtype, or recapture)")
    tp = srt["tp"]
    mine_rank = rt.tp.emulate_rank if rt.tp.emulate_rank is not None else rt.tp.rank
    theirs = tp["emulate_rank"] if tp["emulate_rank"] is not None else tp["rank"]
    if (tp["size"], theirs) != (rt.tp.size, mine_rank):
        raise SnapshotError(f"{mp}: snapshot of tensor-parallel rank {theirs} of {tp['size']}, the engine runs "
                            f"rank {mine_rank} of {rt.tp.size}")


def restore(engine, snapshot_dir: str | Path, budget: int | None = None, seed: int | None = None,
            broken: str | None = None, loaded: tuple[dict, dict] | None = None):
    """Rebuild the state real prefill leaves behind; returns (round, decode state) like
    ``engine.start``. `budget`/`seed` default to the snapshot's; `broken` selects a negative control;
    `loaded` passes an already loaded (manifest, tensors) pair."""
    if broken is not None and broken not in BROKEN:
        raise ValueError(f"broken={broken!r}: expected one of {BROKEN}")
    d = Path(snapshot_dir)
    m, t = loaded if loaded is not None else load_snapshot(d)
    check_engine(m, engine, d)
    L = m["request"]["prompt_len"]
    budget = int(m["request"]["budget"] if budget is None else budget)
    seed = int(m["request"]["seed"] if seed is None else seed)
    hs = int(m["state"]["hidden_start"])
    engine.check_request(L, budget)
    rnd = engine.new_round(engine.capacity_for(L, budget))
    layers = list(rnd.cache.layers)
    saved = m["state"]["layers"]
    if len(layers) != len(saved):
        raise SnapshotError(f"{d / MANIFEST}: {len(saved)} cached layers, the engine has {len(layers)}")
    n = L - 1 if broken == "cache_len_off_by_one" else L
    dev = engine.device
    with torch.no_grad():
        for i, (c, s) in enumerate(zip(layers, saved)):
            k, v = t[f"layer.{i}.k"], t[f"layer.{i}.v"]
            want = (c.k.shape[0], L, c.k.shape[2]) if c.kind == "full" else tuple(c.k.shape)
            if c.kind != s["kind"] or tuple(k.shape) != want or k.dtype != c.k.dtype:
                raise SnapshotError(f"{d / STATE}: layer {i} is {s['kind']} {tuple(k.shape)} {k.dtype}, the engine's "
                                    f"cache is {c.kind} {want} {c.k.dtype}")
            if c.kind == "full":
                c.k[:, :n].copy_(k[:, :n])
                c.v[:, :n].copy_(v[:, :n])
            else:
                c.k.copy_(k)
                c.v.copy_(v)
                c.labels.copy_(t[f"layer.{i}.labels"])
                if n < L:   # the ring forgets position L-1
                    gone = c.labels == L - 1
                    c.labels.masked_fill_(gone, -1)
                    c.k[:, gone] = 0
                    c.v[:, gone] = 0
        prompt = t["prompt"].to(dev)
        hidden = t["hidden"].to(dev)
        if broken == "perturbed_hidden":
            gen = torch.Generator().manual_seed(seed)
            noise = torch.randn(hidden.shape, generator=gen, dtype=torch.float32).to(dev)
            rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
            hidden = (hidden.float() + PERTURB_SCALE * rms * noise).to(hidden.dtype)
        if n < L:
            prompt, hidden = prompt[:n], hidden[:n - hs]
    kwargs = {}
    if hs:
        if "hidden_start" not in inspect.signature(engine.begin).parameters:
            raise SnapshotError(f"{d / MANIFEST}: the snapshot keeps hidden rows from {hs} on, but this engine's "
                                "begin() cannot start the draft prefill there (no hidden_start: an older revision)")
        kwargs["hidden_start"] = hs
    st = engine.begin(prompt, hidden, rnd, seed, budget, **kwargs)
    return rnd, st
