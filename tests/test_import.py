"""Claude Code transcript import: malformed lines are named or counted; the mapping is exact."""

import shutil
from pathlib import Path

import pytest

from snapshots import traces
from snapshots._claude_import import TranscriptError, read_transcripts

DATA = Path(__file__).parent / "data" / "claude_transcript.jsonl"

SESSION_A = [
    ("user", "The parser in calc.py crashes on empty input. Please fix it."),
    ("assistant", "Let me read calc.py."),
    ("tool_call", 'Read({"file_path": "/repo/calc.py"})'),
    ("tool_result", "     1\u2192def parse(s):\n     2\u2192    return s.split()[0]\n"),
    ("assistant", "The first token is taken without a check. I'll guard it."),
    ("tool_call", 'Edit({"file_path": "/repo/calc.py", "old_string": "    return s.split()[0]", '
                  '"new_string": "    parts = s.split()\\n    return parts[0] if parts else None"})'),
    ("tool_result", "The file /repo/calc.py has been updated."),
    ("assistant", "Fixed: `parse` now returns None for empty input."),
    ("user", "Thanks! Also check résumé ünïcode 🐍 <|end|> strings."),
    ("assistant", "Done: they round-trip."),
]
SESSION_B = [
    ("user", "List the files."),
    ("tool_call", 'Bash({"command": "ls", "description": "List files"})'),
    ("tool_result", "calc.py\nREADME.md"),
    ("assistant", "There are two files: calc.py and README.md."),
]


def test_malformed_line_error_names_file_and_line():
    with pytest.raises(TranscriptError, match=r"claude_transcript\.jsonl:7: malformed transcript line: invalid JSON"):
        read_transcripts(DATA)


def test_skip_malformed_counts_and_maps_messages(tmp_path):
    path, rep = traces.import_transcripts(DATA, "imp", store=tmp_path, skip_malformed=True, system_prompt=False)
    assert rep["malformed_skipped"] == 1 and rep["malformed_examples"][0].startswith("claude_transcript.jsonl:7:")
    assert rep["sidechain_skipped"] == 1 and rep["duplicate_skipped"] == 1 and rep["thinking_skipped"] == 1
    assert rep["ignored_types"] == {"file-history-snapshot": 1, "summary": 1}
    corpus = traces.load_corpus("imp", tmp_path)
    got = {sid: [(m["role"], m["content"]) for m in msgs] for sid, msgs in corpus.sessions.items()}
    assert got == {"s00": SESSION_A, "s01": SESSION_B}
    # One request per model turn, each a prefix ending right before it.
    assert [(r.request_id, r.n_messages) for r in corpus.requests] == [
        ("s00-r00", 1), ("s00-r01", 4), ("s00-r02", 7), ("s00-r03", 9), ("s01-r00", 1), ("s01-r01", 3)]
    assert all(len(corpus.tokens(r)) == r.n_tokens for r in corpus.requests)
    assert corpus.manifest["source"]["claude_session_ids"]["s01"].endswith("00b")


def test_system_prompt_and_directory_input(tmp_path):
    d = tmp_path / "project"
    (d / "sub").mkdir(parents=True)
    shutil.copy(DATA, d / "sub" / "one.jsonl")
    traces.import_transcripts(d, "dir", store=tmp_path / "store", skip_malformed=True)
    corpus = traces.load_corpus("dir", tmp_path / "store")
    first = corpus.sessions["s00"]
    assert first[0]["role"] == "system" and first[1]["content"] == SESSION_A[0][1]
    assert corpus.requests[0].n_messages == 2
    with pytest.raises(TranscriptError, match=r"sub/one\.jsonl:7:"):
        traces.import_transcripts(d, "dir2", store=tmp_path / "store")


def test_too_long_requests_are_dropped_and_counted(tmp_path):
    _, rep = traces.import_transcripts(DATA, "short", store=tmp_path, skip_malformed=True,
                                       system_prompt=False, max_tokens=60)
    corpus = traces.load_corpus("short", tmp_path)
    assert rep["requests_dropped_too_long"] > 0
    assert all(r.n_tokens <= 60 for r in corpus.requests)
    assert len(corpus.requests) + rep["requests_dropped_too_long"] == 6


def test_cli_import_fails_then_skips(tmp_path, capsys):
    args = ["import", f"path={DATA}", "name=cli", f"store={tmp_path}"]
    assert traces.main(args) == 1
    assert "claude_transcript.jsonl:7:" in capsys.readouterr().err
    assert traces.main(args + ["skip_malformed=true"]) == 0
    out = capsys.readouterr().out
    assert "1 malformed lines" in out and "6 requests in 2 sessions" in out


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(TranscriptError, match="does not exist"):
        read_transcripts(tmp_path / "nothing.jsonl")
