"""Read Claude Code session transcripts (JSONL) into our messages.

Claude Code appends one JSON object per line to ``~/.claude/projects/<project>/<session>.jsonl``:
``{"type": "user"|"assistant"|"summary"|"system"|..., "message": {"role", "content"}, "uuid",
"parentUuid", "sessionId", "timestamp", "isSidechain", ...}``. ``content`` is a string or a list of
blocks: ``{"type": "text", "text"}``, ``{"type": "tool_use", "id", "name", "input"}`` (assistant),
``{"type": "tool_result", "tool_use_id", "content": str | [text blocks]}`` (user), ``thinking``,
``image``.

Mapping: text -> user/assistant message (consecutive text blocks of one line joined); tool_use ->
tool_call ``name(json input)``; tool_result -> tool_result (text blocks joined, images as
``[image]``); thinking blocks are dropped (not replayed context); entries of other types, sidechain
(sub-agent) entries and blocks of unknown type are skipped and counted. Messages keep file order
(transcripts are append-only); an entry whose uuid was already seen is dropped (resumed sessions
repeat history). Entries are grouped by ``sessionId``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .chat import tool_call_content


class TranscriptError(ValueError):
    """A malformed transcript line; the message names the file and the 1-based line number."""


class _Bad(Exception):
    pass


@dataclass
class ImportReport:
    """What the importer read and what it skipped (every skip is counted, none is silent)."""

    files: list[dict] = field(default_factory=list)  # name, sha256, lines
    lines: int = 0
    malformed_skipped: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    ignored_types: Counter = field(default_factory=Counter)
    sidechain_skipped: int = 0
    duplicate_skipped: int = 0
    thinking_skipped: int = 0
    unknown_blocks: int = 0

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "lines": self.lines,
            "malformed_skipped": self.malformed_skipped,
            "malformed_examples": self.malformed_examples,
            "ignored_types": dict(sorted(self.ignored_types.items())),
            "sidechain_skipped": self.sidechain_skipped,
            "duplicate_skipped": self.duplicate_skipped,
            "thinking_skipped": self.thinking_skipped,
            "unknown_blocks": self.unknown_blocks,
        }


def transcript_files(path: Path) -> list[Path]:
    """`path` itself, or every *.jsonl under the directory `path` (sorted); refuses none found."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"), key=lambda p: p.relative_to(path).as_posix())
        if files:
            return files
        raise TranscriptError(f"no *.jsonl transcript files under {path}")
    raise TranscriptError(f"transcript path {path} does not exist")


def read_transcripts(path: Path, skip_malformed: bool = False) -> tuple[list[tuple[str, list[dict]]], ImportReport]:
    """Sessions as (Claude sessionId, messages) in order of first appearance, and the report.

    A malformed line raises TranscriptError("<file>:<line>: ...") unless `skip_malformed`, in
    which case it is skipped and counted in the report.
    """
    report = ImportReport()
    sessions: dict[str, list[dict]] = {}
    seen: set[str] = set()
    root = Path(path).expanduser()
    for f in transcript_files(root):
        data = f.read_bytes()
        name = f.name if f == root else f.relative_to(root).as_posix()
        report.files.append({"name": name, "sha256": hashlib.sha256(data).hexdigest()})
        n = 0
        for lineno, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            n += 1
            if not raw.strip():
                continue
            try:
                entry = _parse_line(raw, report)
            except _Bad as e:
                if not skip_malformed:
                    raise TranscriptError(f"{f}:{lineno}: malformed transcript line: {e}") from None
                report.malformed_skipped += 1
                if len(report.malformed_examples) < 10:
                    report.malformed_examples.append(f"{name}:{lineno}: {e}")
                continue
            if entry is None:
                continue
            sid, uuid, messages = entry
            if uuid is not None:
                if uuid in seen:
                    report.duplicate_skipped += 1
                    continue
                seen.add(uuid)
            sessions.setdefault(sid, []).extend(messages)
        report.files[-1]["lines"] = n
        report.lines += n
    return list(sessions.items()), report


def _parse_line(raw: str, report: ImportReport):
    """(sessionId, uuid, messages) of one line, None for an entry that is not conversation."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _Bad(f"invalid JSON ({e.msg}; column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise _Bad("missing `type`")
    if kind not in ("user", "assistant"):
        report.ignored_types[kind] += 1
        return None
    if obj.get("isSidechain"):
        report.sidechain_skipped += 1
        return None
    sid = obj.get("sessionId")
    if not isinstance(sid, str) or not sid:
        raise _Bad(f"{kind} entry without a `sessionId`")
    msg = obj.get("message")
    if not isinstance(msg, dict) or "content" not in msg:
        raise _Bad(f"{kind} entry without a `message` object holding `content`")
    uuid = obj.get("uuid") if isinstance(obj.get("uuid"), str) else None
    return sid, uuid, _messages(kind, msg["content"], report)


def _messages(kind: str, content, report: ImportReport) -> list[dict]:
    if isinstance(content, str):
        return [{"role": kind, "content": content}]
    if not isinstance(content, list):
        raise _Bad(f"`content` must be a string or a list of blocks, got {type(content).__name__}")
    out: list[dict] = []

    def add(role: str, text: str, joinable: bool) -> None:
        if joinable and out and out[-1]["role"] == role and out[-1].get("_join"):
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text, "_join": joinable})

    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _Bad(f"content block {i} is not an object with a `type`")
        t = block["type"]
        if t == "text":
            if not isinstance(block.get("text"), str):
                raise _Bad(f"text block {i} without a string `text`")
            add(kind, block["text"], True)
        elif t == "image":
            add(kind, "[image]", True)
        elif t == "tool_use":
            if kind != "assistant" or not isinstance(block.get("name"), str):
                raise _Bad(f"tool_use block {i} must be in an assistant entry and have a `name`")
            add("tool_call", tool_call_content(block["name"], block.get("input", {})), False)
        elif t == "tool_result":
            if kind != "user":
                raise _Bad(f"tool_result block {i} must be in a user entry")
            add("tool_result", _result_text(block.get("content"), i), False)
        elif t in ("thinking", "redacted_thinking"):
            report.thinking_skipped += 1
        else:
            report.unknown_blocks += 1
    for m in out:
        m.pop("_join", None)
    return out


def _result_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for b in content:
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
                parts.append(b["text"])
            elif isinstance(b, dict) and b.get("type") == "image":
                parts.append("[image]")
            else:
                raise _Bad(f"tool_result block {i} holds a part that is neither text nor image")
        return "\n".join(parts)
    raise _Bad(f"tool_result block {i}: `content` must be a string or a list of blocks")


def request_points(messages: list[dict]) -> list[int]:
    """Prefix lengths at which the model starts a turn: before each run of assistant/tool_call
    messages that follows a user or tool_result message."""
    model = ("assistant", "tool_call")
    out, seen_input = [], False
    for i, m in enumerate(messages):
        if m["role"] in model and seen_input and messages[i - 1]["role"] not in model:
            out.append(i)
        seen_input = seen_input or m["role"] in ("user", "tool_result")
    return out
