"""On-disk format of a trace corpus, its hashes, and atomic writes.

A corpus lives in ``<store>/<name>/``::

    manifest.json              name, kind, seed, config, source identity, tokenizer hash,
                               sessions (id, file, message count, content hash), requests
                               (id, session, number of messages, tokens), corpus hash
    sessions/s00.jsonl.gz      one message {"role", "content"} per line, the whole session

A request is a prefix of its session: its first ``n_messages`` messages. Hashes are sha256 over
canonical JSON (sorted keys, no whitespace, UTF-8), so they depend on content only.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

FORMAT = "iquestrt-traces/1"
MANIFEST = "manifest.json"


class CorpusError(RuntimeError):
    """A corpus that cannot be used: unknown name, missing store, bad format or hash mismatch."""


def default_store() -> Path:
    """`$IQUESTRT_HOME/traces` if IQUESTRT_HOME is set, else `~/.cache/iquestrt/traces`."""
    home = os.environ.get("IQUESTRT_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "iquestrt").expanduser() / "traces"


def resolve_store(store: str | os.PathLike | None) -> Path:
    return Path(store).expanduser() if store else default_store()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def session_hash(messages: list[dict]) -> str:
    """Content hash of a session's messages (roles and contents, in order)."""
    return sha256(canonical([[m["role"], m["content"]] for m in messages]))


def corpus_hash(sessions: list[dict], requests: list[dict]) -> str:
    """Hash of the corpus content: every session's hash and every request's prefix definition."""
    return sha256(
        canonical(
            {
                "sessions": [[s["session_id"], s["content_hash"]] for s in sessions],
                "requests": [[r["request_id"], r["session_id"], r["n_messages"]] for r in requests],
            }
        )
    )


def session_bytes(messages: list[dict]) -> bytes:
    """gzip of the JSON-lines session file; mtime 0 so equal content gives equal bytes."""
    raw = b"".join(canonical({"role": m["role"], "content": m["content"]}) + b"\n" for m in messages)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw)
    return buf.getvalue()


def write_corpus(store: Path, name: str, manifest: dict, sessions: dict[str, list[dict]]) -> Path:
    """Write the corpus into ``store/name`` atomically: a temp directory renamed into place, so a
    reader sees the old corpus or the new one, never a mix. Returns the corpus directory."""
    if not name or "/" in name or name.startswith((".", "_")):
        raise CorpusError(f"invalid corpus name {name!r}")
    store.mkdir(parents=True, exist_ok=True)
    final = store / name
    tmp = store / f".{name}.tmp-{os.getpid()}"
    old = store / f".{name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "sessions").mkdir(parents=True)
    for entry in manifest["sessions"]:
        (tmp / entry["file"]).write_bytes(session_bytes(sessions[entry["session_id"]]))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def available(store: Path) -> list[str]:
    """Names of the corpora in `store` (directories holding a manifest), sorted."""
    if not store.is_dir():
        return []
    return sorted(p.name for p in store.iterdir() if (p / MANIFEST).is_file() and not p.name.startswith("."))


def read_manifest(store: Path, name: str) -> dict:
    """The manifest of corpus `name`; refuses a missing store or corpus with what exists instead."""
    if not store.is_dir():
        raise CorpusError(
            f"trace store {store} does not exist; build a corpus first: "
            f"python -m snapshots.traces build name={name}"
        )
    path = store / name / MANIFEST
    if not path.is_file():
        have = ", ".join(available(store)) or "none"
        raise CorpusError(
            f"unknown corpus {name!r} in {store} (available: {have}); "
            f"build it with: python -m snapshots.traces build name={name}"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CorpusError(f"{path}: manifest is not valid JSON ({e})") from e
    if manifest.get("format") != FORMAT:
        raise CorpusError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def read_session(corpus_dir: Path, entry: dict) -> list[dict]:
    """Messages of one session file, verified against the manifest's content hash."""
    path = corpus_dir / entry["file"]
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            messages = [json.loads(line) for line in f]
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise CorpusError(f"{path}: unreadable session file ({e})") from e
    got = session_hash(messages)
    if got != entry["content_hash"]:
        raise CorpusError(
            f"{path}: content hash mismatch (manifest {entry['content_hash'][:12]}, file {got[:12]}); "
            f"the corpus was modified after it was built: rebuild it"
        )
    return messages
