"""The synthetic trace corpus: determinism, source sensitivity, prefixes, real tool output, errors."""

import gzip
import json
import re
import textwrap

import pytest

from snapshots import traces
from snapshots._trace_store import CorpusError, default_store

MODULES = {
    "calc/__init__.py": '"""A tiny calculator package."""\nfrom .parser import parse\nfrom .ops import apply\n',
    "calc/parser.py": '''
        """Parse arithmetic expressions into tokens."""
        import re

        TOKEN = re.compile(r"\\s*(\\d+|[-+*/()])")


        def tokenize(text):
            out = []
            for m in TOKEN.finditer(text):
                out.append(m.group(1))
            return out


        def parse(text, strict=False):
            tokens = tokenize(text)
            if strict and not tokens:
                raise ValueError("empty expression")
            return tokens


        class Reader:
            def __init__(self, text):
                self.tokens = tokenize(text)
                self.pos = 0

            def peek(self, offset):
                return self.tokens[self.pos + offset]

            def advance(self, n):
                self.pos += n
    ''',
    "calc/ops.py": '''
        """Operators: résumé of the four rules (ünïcode on purpose)."""
        import operator

        OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


        def apply(op, a, b):
            return OPS[op](a, b)


        def reduce_all(op, values):
            acc = values[0]
            for v in values[1:]:
                acc = apply(op, acc, v)
            return acc


        def log_result(value, sink):
            sink.append(str(value))
    ''',
    "main.py": '''
        import sys
        from calc import parse, apply


        def run(argv):
            tokens = parse(" ".join(argv))
            print(tokens)


        def report(values, stream):
            for v in values:
                stream.write(f"{v}\\n")


        if __name__ == "__main__":
            run(sys.argv[1:])
    ''',
}


def make_tree(root):
    for rel, text in MODULES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))
    (root / "calc" / "__pycache__").mkdir()
    (root / "calc" / "__pycache__" / "junk.py").write_text("not used\n")
    return root


def small_config(source, **over):
    cfg = dict(
        kind="synthetic", n_sessions=2, requests_per_session=5, min_tokens=900, max_tokens=4000,
        shortest_session_tokens=2200, session_spacing=1.0, growth=[1.0, 1.5], seed=0,
        source=str(source), exclude_dirs=["__pycache__"], max_file_bytes=400_000, store=None,
    )
    cfg.update(over)
    return cfg


@pytest.fixture
def built(tmp_path):
    src = make_tree(tmp_path / "src")
    store = tmp_path / "store"
    traces.build_corpus("small", small_config(src), store=store, progress=False)
    return src, store, traces.load_corpus("small", store)


def test_build_twice_gives_identical_corpus(built, tmp_path):
    src, store, corpus = built
    traces.build_corpus("again", small_config(src), store=tmp_path / "store2", progress=False)
    again = traces.load_corpus("again", tmp_path / "store2")
    assert again.corpus_hash == corpus.corpus_hash
    assert [r.n_tokens for r in again.requests] == [r.n_tokens for r in corpus.requests]
    assert again.sessions == corpus.sessions


def test_changed_source_file_changes_hashes(built, tmp_path):
    src, store, corpus = built
    p = src / "calc" / "parser.py"
    p.write_text(p.read_text().replace("def tokenize(text):", "def tokenize(text, sep=None):"))
    traces.build_corpus("changed", small_config(src), store=store, progress=False)
    changed = traces.load_corpus("changed", store)
    assert changed.manifest["source"]["content_hash"] != corpus.manifest["source"]["content_hash"]
    assert changed.corpus_hash != corpus.corpus_hash


def test_other_seed_changes_corpus(built, tmp_path):
    src, store, corpus = built
    traces.build_corpus("seed1", small_config(src, seed=1), store=store, progress=False)
    assert traces.load_corpus("seed1", store).corpus_hash != corpus.corpus_hash


def test_requests_are_growing_prefixes_ending_before_assistant(built):
    _, _, corpus = built
    assert len(corpus.requests) == 10 and len(corpus.sessions) == 2
    assert corpus.requests[0].request_id == "s00-r00"
    for sid, msgs in corpus.sessions.items():
        reqs = [r for r in corpus.requests if r.session_id == sid]
        assert len(reqs) == 5
        prev_ids = []
        for r in reqs:
            assert r.messages == msgs[: r.n_messages]
            assert msgs[r.n_messages]["role"] == "assistant"  # the turn the model generates
            ids = corpus.tokens(r)
            assert len(ids) == r.n_tokens
            if prev_ids:  # the previous request is a prefix, up to its generation prompt
                assert len(ids) > len(prev_ids) and ids[: len(prev_ids) - 1] == prev_ids[:-1]
            prev_ids = ids
        counts = [r.n_tokens for r in reqs]
        assert counts == sorted(counts) and counts[0] < counts[-1]
        assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
    assert max(r.n_tokens for r in corpus.requests) <= 4000


def test_tool_results_are_real_file_content(built):
    src, _, corpus = built
    reads = 0
    for msgs in corpus.sessions.values():
        calls = [(i, m) for i, m in enumerate(msgs) if m["role"] == "tool_call"]
        for i, m in calls:
            if not m["content"].startswith("Read("):
                continue
            # The k-th call of a turn is answered by the k-th result after the turn's calls.
            j = i
            while msgs[j + 1]["role"] == "tool_call":
                j += 1
            k = i - next(x for x in range(i, -1, -1) if msgs[x - 1]["role"] != "tool_call")
            result = msgs[j + 1 + k]["content"]
            args = json.loads(m["content"][len("Read("):-1])
            lines = (src / args["file_path"]).read_text().splitlines()
            for line in result.splitlines():
                n, text = re.match(r"\s*(\d+)\t(.*)$", line).groups()
                if "raise TypeError" not in text and "is None:" not in text and '"""' not in text:
                    assert text in lines  # edits (guards, docstrings) are the only new lines
            reads += 1
    assert reads > 0


def test_manifest_records_identity(built):
    src, _, corpus = built
    m = corpus.manifest
    assert m["name"] == "small" and m["seed"] == 0 and m["config"]["n_sessions"] == 2
    assert m["source"]["path"] == str(src.resolve()) and m["source"]["n_files"] == 4  # __pycache__ left out
    assert len(m["tokenizer_hash"]) == 64 and len(m["corpus_hash"]) == 64
    assert all(len(s["content_hash"]) == 64 for s in m["sessions"])
    assert [r["n_tokens"] for r in m["requests"]] == [r.n_tokens for r in corpus.requests]


def test_tampered_session_is_refused(built):
    _, store, _ = built
    path = store / "small" / "sessions" / "s01.jsonl.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines[1] = json.dumps({"role": "user", "content": "something else"})
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(CorpusError, match="s01.jsonl.gz: content hash mismatch"):
        traces.load_corpus("small", store)


def test_tampered_manifest_is_refused(built):
    _, store, _ = built
    path = store / "small" / "manifest.json"
    m = json.loads(path.read_text())
    m["requests"][3]["n_messages"] += 3
    path.write_text(json.dumps(m))
    with pytest.raises(CorpusError, match="corpus hash mismatch"):
        traces.load_corpus("small", store)


def test_unknown_name_and_missing_store_are_clear(built, tmp_path):
    _, store, _ = built
    with pytest.raises(CorpusError, match=r"unknown corpus 'nope'.*available: small"):
        traces.load_corpus("nope", store)
    with pytest.raises(CorpusError, match="does not exist"):
        traces.load_corpus("small", tmp_path / "no-store")


def test_store_default_follows_iquestrt_home(monkeypatch, tmp_path):
    monkeypatch.setenv("IQUESTRT_HOME", str(tmp_path))
    assert default_store() == tmp_path / "traces"
    monkeypatch.delenv("IQUESTRT_HOME")
    assert default_store().parts[-3:] == (".cache", "iquestrt", "traces")


def test_cli_stats_unknown_name_and_help(built, capsys):
    _, store, _ = built
    assert traces.main(["stats", "name=small", f"store={store}"]) == 0
    out = capsys.readouterr().out
    assert "10 requests in 2 sessions" in out and "p50" in out and "s01" in out
    assert traces.main(["build", "name=nope"]) == 2
    assert "unknown corpus name 'nope'" in capsys.readouterr().err
    assert traces.main(["--help"]) == 0
    assert "build  name=NAME" in capsys.readouterr().out
    assert traces.main(["stats", "name=small", "bogus_key=1"]) == 2
    assert "bogus_key" in capsys.readouterr().err


def test_claude400_config_composes_with_overrides():
    cfg = traces._compose("traces/claude400", ["n_sessions=3", "seed=5"])
    assert (cfg["n_sessions"], cfg["seed"], cfg["requests_per_session"]) == (3, 5, 40)
    assert 180_000 <= cfg["max_tokens"] <= 192_000 and cfg["min_tokens"] <= 1_200
