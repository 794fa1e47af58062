"""Trace corpora: agent requests to prefill and replay (build, import, load, stats).

``claude400`` is 400 requests from 10 synthetic coding-agent sessions built deterministically from
the running Python's standard library: a system prompt, a task, then assistant tool calls (Read,
Grep, Glob, LS, Bash, Edit) whose results are real file contents, real regex matches, real listings
and the real output of commands run on the files (`_agent_sessions`, `_agent_tools`). Request k of a
session is its context right before its k-th assistant message; contexts span 1K to 190K tokens.
Real Claude Code transcripts import into the same format (`_claude_import`).

Command line (``key=value`` overrides are composed by Hydra from ``conf/traces/``)::

    python -m snapshots.traces build name=claude400 [seed=1 n_sessions=2 store=DIR ...]
    python -m snapshots.traces stats name=claude400 [store=DIR]
    python -m snapshots.traces import path=FILE_OR_DIR name=mine [skip_malformed=true store=DIR]

Python::

    corpus = load_corpus("claude400")
    for r in corpus.requests:          # r.request_id "s03-r17", r.session_id, r.messages, r.n_tokens
        ids = corpus.tokens(r)          # chat template ids, ending with <|assistant|>

Store: ``store=`` > ``$IQUESTRT_HOME/traces`` > ``~/.cache/iquestrt/traces`` (format: `_trace_store`).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import chat
from . import tokenizer as tk
from ._source_tree import SourceTreeError
from ._trace_store import (
    FORMAT,
    CorpusError,
    corpus_hash,
    read_manifest,
    read_session,
    resolve_store,
    session_hash,
    write_corpus,
)

__all__ = ["Corpus", "CorpusError", "Request", "build_corpus", "import_transcripts", "load_corpus"]

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
MODEL_MAX_CONTEXT = 196_608


@dataclass(frozen=True)
class Request:
    """One request: the first `n_messages` messages of session `session_id`."""

    request_id: str
    session_id: str
    n_messages: int
    n_tokens: int
    messages: list[dict]


class Corpus:
    """A loaded, hash-verified corpus: `.requests` in manifest order, `.manifest`, `.sessions`."""

    def __init__(self, name: str, path: Path, manifest: dict, sessions: dict[str, list[dict]]):
        self.name, self.path, self.manifest, self.sessions = name, path, manifest, sessions
        self.requests = [
            Request(r["request_id"], r["session_id"], r["n_messages"], r["n_tokens"],
                    sessions[r["session_id"]][: r["n_messages"]])
            for r in manifest["requests"]
        ]
        self._by_id = {r.request_id: r for r in self.requests}

    @property
    def corpus_hash(self) -> str:
        return self.manifest["corpus_hash"]

    def request(self, request_id: str) -> Request:
        """The request with this id; refuses (KeyError naming the corpus) an unknown id."""
        try:
            return self._by_id[request_id]
        except KeyError:
            raise KeyError(f"corpus {self.name!r} has no request {request_id!r}") from None

    def tokens(self, request: Request | str) -> list[int]:
        """Token ids of a request through the chat template (ends with the generation prompt)."""
        r = self.request(request) if isinstance(request, str) else request
        return chat.render(r.messages)

    def next_message(self, request: Request) -> dict | None:
        """The message that followed the request in its session (the recorded assistant turn)."""
        msgs = self.sessions[request.session_id]
        return msgs[request.n_messages] if request.n_messages < len(msgs) else None


def load_corpus(name: str, store: str | Path | None = None, check_tokenizer: bool = True) -> Corpus:
    """Load corpus `name` from the store, verifying every session hash and the corpus hash.

    Refuses (CorpusError): a missing store or unknown name (listing what exists), a changed session
    file or manifest (hash mismatch), and — with `check_tokenizer` — a corpus whose token counts
    came from a different tokenizer than the current asset.
    """
    root = resolve_store(store)
    manifest = read_manifest(root, name)
    path = root / name
    sessions = {e["session_id"]: read_session(path, e) for e in manifest["sessions"]}
    for s in manifest["sessions"]:
        if len(sessions[s["session_id"]]) != s["n_messages"]:
            raise CorpusError(f"{path}: session {s['session_id']} message count differs from manifest")
    got = corpus_hash(manifest["sessions"], manifest["requests"])
    if got != manifest["corpus_hash"]:
        raise CorpusError(
            f"{path}/manifest.json: corpus hash mismatch (recorded {manifest['corpus_hash'][:12]}, "
            f"computed {got[:12]}); the manifest was edited: rebuild the corpus"
        )
    if check_tokenizer and manifest["tokenizer_hash"] != tk.tokenizer_hash():
        raise CorpusError(
            f"corpus {name!r} was counted with tokenizer {manifest['tokenizer_hash'][:12]} but the "
            f"current asset is {tk.tokenizer_hash()[:12]}; rebuild it (python -m snapshots.traces "
            f"build name={name}) or load with check_tokenizer=False"
        )
    return Corpus(name, path, manifest, sessions)


# ---- building ---------------------------------------------------------------------------------
def default_source() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def build_corpus(name: str, cfg: Mapping, store: str | Path | None = None, progress: bool = True) -> Path:
    """Build synthetic corpus `name` from config `cfg` (see conf/traces/claude400.yaml) and write
    it atomically. Deterministic for a given source tree, config, seed and tokenizer.

    Refuses (CorpusError) a result outside its own promises: a request longer than `max_tokens`.
    """
    from tqdm import tqdm

    from ._agent_sessions import SessionBuilder, session_targets
    from ._source_tree import SourceTree

    source = Path(cfg["source"]) if cfg.get("source") else default_source()
    tree = SourceTree(source, tuple(cfg["exclude_dirs"]), int(cfg["max_file_bytes"]))
    n_sessions, per_session = int(cfg["n_sessions"]), int(cfg["requests_per_session"])
    if per_session < 1 or n_sessions < 1:
        raise CorpusError("n_sessions and requests_per_session must be at least 1")
    targets = session_targets(n_sessions, int(cfg["shortest_session_tokens"]), int(cfg["max_tokens"]),
                              float(cfg["session_spacing"]))
    seed = int(cfg["seed"])
    width = max(2, len(str(n_sessions - 1)))
    bar = tqdm(total=n_sessions * per_session, desc=f"build {name}", unit="req", disable=not progress)
    sessions: dict[str, list[dict]] = {}
    prefixes: dict[str, list[int]] = {}
    focus: list[str] = []
    for i, final in enumerate(targets):
        sid = f"s{i:0{width}d}"
        # A string seed is hashed with sha512 by `random`: stable across runs and platforms.
        rng = random.Random(f"claude-traces:{seed}:{sid}")
        lo, hi = cfg["growth"]
        builder = SessionBuilder(
            tree=tree, rng=rng, requests=per_session, min_tokens=int(cfg["min_tokens"]),
            final_tokens=final, growth=rng.uniform(float(lo), float(hi)), progress=lambda: bar.update(1),
            avoid=tuple(focus),
        )
        sessions[sid], prefixes[sid] = builder.build()
        focus.append(builder.focus)
    bar.close()
    config = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in cfg.items() if k != "store"}
    manifest = _manifest(name, "synthetic", config, tree.identity(), sessions, prefixes, seed=seed)
    too_long = [r for r in manifest["requests"] if r["n_tokens"] > int(cfg["max_tokens"])]
    if too_long:
        raise CorpusError(f"{len(too_long)} requests exceed max_tokens, e.g. {too_long[0]}")
    return write_corpus(resolve_store(store), name, manifest, sessions)


def _manifest(name, kind, config, source, sessions, prefixes, seed=None, extra=None) -> dict:
    """Manifest with per-session hashes, per-request token counts and the corpus hash."""
    session_entries, requests = [], []
    for sid, msgs in sessions.items():
        lens = [len(x) for x in tk.encode_batch([m["content"] for m in msgs])]
        cum = [0]
        for n in lens:
            cum.append(cum[-1] + chat.message_tokens(n))
        session_entries.append({
            "session_id": sid,
            "file": f"sessions/{sid}.jsonl.gz",
            "n_messages": len(msgs),
            "content_hash": session_hash(msgs),
        })
        for j, n_msgs in enumerate(prefixes[sid]):
            requests.append({
                "request_id": f"{sid}-r{j:02d}",
                "session_id": sid,
                "n_messages": n_msgs,
                "n_tokens": cum[n_msgs] + 2,  # + <|bos|> + generation prompt
            })
    manifest = {
        "format": FORMAT,
        "name": name,
        "kind": kind,
        "seed": seed,
        "config": config,
        "source": source,
        "tokenizer_hash": tk.tokenizer_hash(),
        "template": "bos (role content end)* assistant; see snapshots/chat.py",
        "n_sessions": len(session_entries),
        "n_requests": len(requests),
        "sessions": session_entries,
        "requests": requests,
        "corpus_hash": corpus_hash(session_entries, requests),
    }
    if extra:
        manifest.update(extra)
    return manifest


# ---- importing --------------------------------------------------------------------------------
def import_transcripts(
    path: str | Path,
    name: str,
    store: str | Path | None = None,
    skip_malformed: bool = False,
    system_prompt: bool = True,
    max_tokens: int = MODEL_MAX_CONTEXT,
) -> tuple[Path, dict]:
    """Import Claude Code transcripts (a .jsonl file or a directory of them) as corpus `name`.

    One request per model turn (before each run of assistant/tool_call messages that follows a
    user or tool_result message); requests longer than `max_tokens` are dropped and counted.
    Returns (corpus directory, report dict). Refuses (TranscriptError) a malformed line, naming
    file and line, unless `skip_malformed`; refuses (CorpusError) transcripts yielding no request.
    """
    from ._agent_sessions import SYSTEM_PROMPT
    from ._claude_import import read_transcripts, request_points

    found, report = read_transcripts(Path(path), skip_malformed=skip_malformed)
    width = max(2, len(str(len(found) - 1)))
    sessions, prefixes, origin = {}, {}, {}
    dropped_long = dropped_sessions = 0
    for claude_sid, msgs in found:
        if system_prompt:
            msgs = [{"role": "system", "content": SYSTEM_PROMPT}] + msgs
        points = request_points(msgs)
        if points:
            lens = [len(x) for x in tk.encode_batch([m["content"] for m in msgs])]
            cum = [0]
            for n in lens:
                cum.append(cum[-1] + chat.message_tokens(n))
            keep = [p for p in points if cum[p] + 2 <= max_tokens]
            dropped_long += len(points) - len(keep)
            points = keep
        if not points:
            dropped_sessions += 1
            continue
        sid = f"s{len(sessions):0{width}d}"
        sessions[sid], prefixes[sid], origin[sid] = msgs, points, claude_sid
    if not sessions:
        raise CorpusError(f"{path}: no importable request (no session with a user turn followed by a model turn)")
    rep = report.as_dict()
    rep.update({"requests_dropped_too_long": dropped_long, "sessions_without_requests": dropped_sessions})
    files_hash = session_hash([{"role": f["name"], "content": f["sha256"]} for f in rep["files"]])
    source = {"path": str(Path(path).expanduser().resolve()), "content_hash": files_hash,
              "claude_session_ids": origin}
    config = {"path": str(path), "skip_malformed": skip_malformed, "system_prompt": system_prompt,
              "max_tokens": max_tokens}
    manifest = _manifest(name, "import", config, source, sessions, prefixes, extra={"import_report": rep})
    return write_corpus(resolve_store(store), name, manifest, sessions), rep


# ---- stats ------------------------------------------------------------------------------------
def format_stats(corpus: Corpus) -> str:
    """Counts, token summary, a percentile table and a per-session histogram of log2 lengths."""
    toks = [r.n_tokens for r in corpus.requests]
    sids = [s["session_id"] for s in corpus.manifest["sessions"]]
    m = corpus.manifest
    out = [
        f"corpus {corpus.name} ({m['kind']}): {len(toks)} requests in {len(sids)} sessions",
        f"  corpus hash {m['corpus_hash'][:16]}  tokenizer {m['tokenizer_hash'][:16]}  "
        f"source {m['source'].get('path')} ({m['source'].get('python_version', '-')})",
        f"tokens: min {min(toks):,}  median {statistics.median(toks):,.0f}  "
        f"mean {statistics.fmean(toks):,.0f}  max {max(toks):,}  total {sum(toks):,}",
        "",
        "percentile    tokens",
    ]
    s = sorted(toks)
    for p in (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 100):
        out.append(f"  p{p:<3d}  {_percentile(s, p):>10,.0f}")
    # Half-octave bins: enough resolution to see the 1K..192K spread in ~16 rows.
    first = math.floor(2 * math.log2(max(1, s[0])))
    last = math.floor(2 * math.log2(max(1, s[-1])))
    by_session = {sid: [r.n_tokens for r in corpus.requests if r.session_id == sid] for sid in sids}
    show = sids if len(sids) <= 16 else []
    out += ["", "requests per context-length bin (half-octave, log scale), by session:"]
    head = f"  {'tokens':>17}  " + " ".join(f"{sid:>4}" for sid in show) + "   all"
    out.append(head)
    scale = max(1, max(sum(1 for t in toks if math.floor(2 * math.log2(max(1, t))) == b)
                       for b in range(first, last + 1)))
    for b in range(first, last + 1):
        a, z = 2 ** (b / 2), 2 ** ((b + 1) / 2)
        counts = [sum(1 for t in by_session[sid] if math.floor(2 * math.log2(max(1, t))) == b) for sid in show]
        total = sum(1 for t in toks if math.floor(2 * math.log2(max(1, t))) == b)
        cells = " ".join(f"{c:>4}" if c else "   ." for c in counts)
        bar = "#" * round(40 * total / scale)
        out.append(f"  {a:>7,.0f} – {z:<7,.0f}  {cells} {total:>5} {bar}")
    out += ["", "per session:   requests   first      last   messages"]
    for sid in sids:
        t = by_session[sid]
        n_msgs = next(e["n_messages"] for e in m["sessions"] if e["session_id"] == sid)
        out.append(f"  {sid:>6}  {len(t):>9}  {min(t):>6,}  {max(t):>8,}  {n_msgs:>9}")
    return "\n".join(out)


def _percentile(sorted_vals: list[int], p: float) -> float:
    """Linear-interpolation percentile of already sorted values."""
    if len(sorted_vals) == 1:
        return float(sorted_vals[0])
    x = (len(sorted_vals) - 1) * p / 100
    i = int(x)
    j = min(i + 1, len(sorted_vals) - 1)
    return sorted_vals[i] + (sorted_vals[j] - sorted_vals[i]) * (x - i)


# ---- command line -----------------------------------------------------------------------------
USAGE = """\
usage: python -m snapshots.traces COMMAND key=value ...

commands:
  build  name=NAME [overrides]   build the synthetic corpus configured in conf/traces/NAME.yaml
                                 (e.g. name=claude400 seed=1 n_sessions=2 requests_per_session=5)
  stats  name=NAME               print counts, token percentiles and a length histogram
  import path=P name=NAME        import Claude Code transcripts (a .jsonl file or a directory)
         [skip_malformed=true]   skip malformed lines (counted) instead of failing on the first
         [system_prompt=false]   do not prepend the agent system prompt
         [max_tokens=196608]     drop requests longer than this (counted)

every command takes store=DIR (default $IQUESTRT_HOME/traces or ~/.cache/iquestrt/traces)."""


def _compose(config: str, overrides: list[str]) -> dict:
    """Hydra compose of conf/<config>.yaml with `overrides`; returns a plain dict."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name=config, overrides=overrides)
    except HydraException as e:
        keys = ", ".join(_config_keys(config))
        raise ArgumentError(f"bad arguments {overrides}: {str(e).splitlines()[0]} (keys: {keys})") from None
    return OmegaConf.to_container(cfg, resolve=True)


def _config_keys(config: str) -> list[str]:
    import yaml

    return sorted(yaml.safe_load((CONF_DIR / f"{config}.yaml").read_text()) or {})


class ArgumentError(ValueError):
    """A command-line argument the config does not have (or of the wrong type)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    bad = [a for a in args if "=" not in a]
    if command not in ("build", "stats", "import") or bad:
        print(f"error: {'unknown command ' + repr(command) if not bad else 'expected key=value, got ' + repr(bad[0])}\n",
              file=sys.stderr)
        print(USAGE, file=sys.stderr)
        return 2
    names = [a.split("=", 1)[1] for a in args if a.startswith("name=")]
    if not names or not names[0]:
        print("error: name=NAME is required", file=sys.stderr)
        return 2
    name = names[0]
    try:
        if command == "build":
            known = sorted(p.stem for p in (CONF_DIR / "traces").glob("*.yaml") if not p.stem.startswith("_"))
            if name.startswith("_") or not (CONF_DIR / "traces" / f"{name}.yaml").is_file():
                print(f"error: unknown corpus name {name!r}; configured corpora: {', '.join(known)} "
                      f"(conf/traces/NAME.yaml)", file=sys.stderr)
                return 2
            cfg = _compose(f"traces/{name}", [a for a in args if not a.startswith("name=")])
            start = time.perf_counter()
            path = build_corpus(name, cfg, store=cfg.get("store"))
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            print(f"built {name} in {time.perf_counter() - start:.1f} s -> {path} ({size / 1e6:.2f} MB)")
            print(format_stats(load_corpus(name, cfg.get("store"))))
        elif command == "stats":
            cfg = _compose("traces/_cli", args)
            print(format_stats(load_corpus(name, cfg.get("store"))))
        else:
            cfg = _compose("traces/_cli", args)
            if not cfg.get("path"):
                print("error: import needs path=FILE_OR_DIR", file=sys.stderr)
                return 2
            path, rep = import_transcripts(
                cfg["path"], name, store=cfg.get("store"), skip_malformed=bool(cfg["skip_malformed"]),
                system_prompt=bool(cfg["system_prompt"]), max_tokens=int(cfg["max_tokens"]),
            )
            print(f"imported {rep['lines']} lines from {len(rep['files'])} file(s) -> {path}")
            print(f"skipped: {rep['malformed_skipped']} malformed lines, {rep['sidechain_skipped']} sidechain "
                  f"entries, {rep['duplicate_skipped']} duplicates, {rep['thinking_skipped']} thinking blocks, "
                  f"{rep['unknown_blocks']} unknown blocks, ignored types {rep['ignored_types']}, "
                  f"{rep['requests_dropped_too_long']} requests over max_tokens")
            for ex in rep["malformed_examples"]:
                print(f"  malformed: {ex}")
            print(format_stats(load_corpus(name, cfg.get("store"))))
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CorpusError, ValueError, tk.TokenizerAssetError, SourceTreeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
