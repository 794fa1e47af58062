"""Prefill snapshots: capture → restore → verify reproduces real prefill; broken restores and bad
snapshots are refused; existing snapshots are reused; the store and the command lines work."""
import json
import shutil

import pytest
import torch

from runtime.engine import Engine
from snapshots import capture, restore, stability, store, verify
from snapshots.store import MANIFEST, STATE, SnapshotError
from snapshots.traces import ArgumentError, CorpusError, build_corpus, load_corpus

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    return Engine.build("q1-tiny", {"device": "cpu"})


def prompt(n, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(9, vocab, (n,), generator=g).tolist()


def snap(engine, root, rid, tokens, budget=24, **kw):
    out = store.snapshot_dir(root, engine.cfg.name, engine.checkpoint_hash, "synthetic", rid)
    m, reused = capture.capture_request(engine, tokens, rid, capture.request_seed(rid), budget, out,
                                        {"trace": {"name": "synthetic", "corpus_hash": "c0"}}, **kw)
    return out, m, reused


@pytest.fixture(scope="module")
def tiny_snaps(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("snapstore")
    # rings of 96 slots wrap at these lengths; 2,100 rows puts the aligned draft prefill start at 1,024
    dirs = {n: snap(tiny, root, f"r{n}", prompt(n, seed=n), budget=16 if n > 1000 else 24)[0] for n in (130, 277, 2100)}
    return root, dirs


# ---- round trip --------------------------------------------------------------------------------
def test_restore_reproduces_real_prefill_bit_for_bit(tiny, tiny_snaps):
    root, dirs = tiny_snaps
    for n, d in dirs.items():
        m = json.loads((d / MANIFEST).read_text())
        assert m["request"]["prompt_len"] == n and m["state"]["hidden_start"] == (1024 if n > 1000 else 0)
        assert m["state"]["hidden_rows"] == n - m["state"]["hidden_start"]
        q = verify.verify_snapshot(tiny, d)
        assert q["passed"] and q["tokens_identical"] and q["steps_identical"] and q["state_exact"], q
        assert q["tokens_compared"] >= 1
        assert json.loads((d / MANIFEST).read_text())["qualification"]["passed"] is True


def test_restored_caches_equal_real_prefill(tiny, tiny_snaps):
    _, dirs = tiny_snaps
    d = dirs[277]
    toks = restore.load_snapshot(d)[1]["prompt"].tolist()
    m = json.loads((d / MANIFEST).read_text())
    ref, _ = tiny.start(toks, m["request"]["seed"], m["request"]["budget"])
    got, _ = restore.restore(tiny, d)
    for a, b in zip(ref.cache.all, got.cache.all):    # target layers and the draft layer's ring
        assert a.kind == b.kind and torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.labels, b.labels)
    assert all(c.labels.min() >= 0 for c in got.cache.layers if c.kind == "sliding")   # rings wrapped


def test_minimal_draft_rows_restore_from_the_ring_only(tiny, tmp_path):
    d, m, _ = snap(tiny, tmp_path, "m277", prompt(277, seed=277), draft_rows="minimal")
    assert m["state"]["hidden_start"] == 277 - tiny.cfg.ring_slots
    q = verify.verify_snapshot(tiny, d, exact=False)
    assert q["passed"] and q["tokens_identical"]
    assert q["state_max_abs_diff"] < 1e-5     # the same draft K/V up to reduction order


@pytest.mark.parametrize("mode", restore.BROKEN)
def test_broken_restores_are_rejected(tiny, tiny_snaps, mode):
    _, dirs = tiny_snaps
    for n in (130, 277):
        before = (dirs[n] / MANIFEST).read_text()
        q = verify.verify_snapshot(tiny, dirs[n], broken=mode)
        assert not q["passed"] and not q["state_exact"]
        assert (dirs[n] / MANIFEST).read_text() == before      # a negative control records nothing
    q = verify.verify_snapshot(tiny, dirs[130], broken="cache_len_off_by_one", exact=False)
    assert not q["passed"] and q["first_mismatch"] == 0          # caught by the tokens alone


def test_full_attention_draft_layer_keeps_every_hidden_row():
    class C:
        def __init__(self, kind, slots):
            self.kind, self.slots = kind, slots
    assert capture.draft_hidden_start(5000, [C("full", 9000)], 1024) == 0
    assert capture.draft_hidden_start(5000, [C("sliding", 576)], 1024) == 3072
    assert capture.draft_hidden_start(5000, [C("sliding", 576)], 1024, "minimal") == 5000 - 576
    assert capture.draft_hidden_start(300, [C("sliding", 576)], 1024) == 0


# ---- reuse and atomic writes -------------------------------------------------------------------
def test_existing_valid_snapshot_is_reused_not_recomputed(tiny, tiny_snaps, monkeypatch):
    root, dirs = tiny_snaps
    d = dirs[130]
    stamps = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    monkeypatch.setattr(capture, "capture_state", lambda *a, **k: pytest.fail("recomputed"))
    _, m, reused = snap(tiny, root, "r130", prompt(130, seed=130))
    assert reused and m["request"]["prompt_len"] == 130
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == stamps


def test_failed_capture_leaves_nothing(tiny, tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        snap(tiny, tmp_path, "x1", prompt(50))
    assert not any(p.is_dir() for p in tmp_path.rglob("*") if p.name.startswith(("x1", ".tmp-")))


# ---- bad input ---------------------------------------------------------------------------------
@pytest.fixture
def copy(tiny_snaps, tmp_path):
    _, dirs = tiny_snaps
    dst = tmp_path / "r130"
    shutil.copytree(dirs[130], dst)
    return dst


def edit_manifest(d, **fields):
    m = json.loads((d / MANIFEST).read_text())
    for k, v in fields.items():
        keys = k.split("__")
        cur = m
        for x in keys[:-1]:
            cur = cur[x]
        cur[keys[-1]] = v
    (d / MANIFEST).write_text(json.dumps(m))


def test_corrupted_file_is_refused_and_not_overwritten(tiny, copy):
    f = copy / STATE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"state\.safetensors: checksum mismatch"):
        restore.restore(tiny, copy)
    m = json.loads((copy / MANIFEST).read_text())
    with pytest.raises(SnapshotError, match="checksum mismatch"):   # capture does not replace it either
        capture.capture_request(tiny, prompt(130, seed=130), "r130", 1, 24, copy,
                                {"trace": {"name": "synthetic", "corpus_hash": "c0"}})
    assert f.read_bytes() == bytes(data) and json.loads((copy / MANIFEST).read_text()) == m


def test_truncated_file_is_refused(tiny, copy):
    f = copy / STATE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(SnapshotError, match=r"state\.safetensors: \d+ bytes, manifest records \d+ \(truncated"):
        restore.restore(tiny, copy)


def test_snapshot_of_another_model_or_checkpoint_is_refused(tiny, copy):
    other = Engine.build("q1-tiny", {"device": "cpu"}, random_seed=1)
    with pytest.raises(SnapshotError, match=r"manifest.json: snapshot of checkpoint 'random:q1-tiny:seed0'"):
        restore.restore(other, copy)
    edit_manifest(copy, model__name="q1-mini")
    with pytest.raises(SnapshotError, match=r"manifest.json: snapshot of model 'q1-mini', the engine runs 'q1-tiny'"):
        restore.restore(tiny, copy)


def test_snapshot_of_another_tokenizer_is_refused(tiny, copy):
    edit_manifest(copy, tokenizer_hash="0" * 64)
    with pytest.raises(SnapshotError, match="manifest.json: snapshot tokenised with tokenizer 000000000000"):
        restore.restore(tiny, copy)


def test_snapshot_of_another_dtype_is_refused(copy):
    bf = Engine.build("q1-tiny", {"device": "cpu", "dtype": "bfloat16"})
    with pytest.raises(SnapshotError, match="runtime.dtype=float32, the engine runs bfloat16"):
        restore.restore(bf, copy)


def test_unknown_schema_version_is_refused(tiny, copy):
    edit_manifest(copy, schema_version=99)
    with pytest.raises(SnapshotError, match="manifest.json: unknown schema version 99"):
        restore.restore(tiny, copy)


def test_missing_snapshot_is_refused(tiny, tmp_path, copy):
    with pytest.raises(SnapshotError, match="nowhere: snapshot directory not found"):
        restore.restore(tiny, tmp_path / "nowhere")
    (copy / MANIFEST).unlink()
    with pytest.raises(SnapshotError, match="manifest.json: manifest missing"):
        restore.restore(tiny, copy)


def test_cli_arguments_are_checked():
    with pytest.raises(ArgumentError, match="unknown key 'limt'"):
        store.parse_cli("capture", ["limt=3"])
    with pytest.raises(ArgumentError, match="expected int"):
        store.parse_cli("capture", ["budget=lots"])
    with pytest.raises(ArgumentError, match="expected key=value"):
        store.parse_cli("verify", ["q1-mini"])
    cfg = store.parse_cli("capture", ["limit=5", "runtime.device=cuda", "runtime.draft.policy=fixed", "store=null"])
    assert cfg["limit"] == 5 and cfg["store"] is None
    rt = store.runtime_settings(cfg["runtime"])
    assert rt["device"] == "cuda" and rt["draft"]["policy"] == "fixed" and rt["draft"]["max_depth"] == 7
    assert capture.main(["--help"]) == 0 and verify.main(["--help"]) == 0 and stability.main(["--help"]) == 0
    assert verify.main(["broken=nonsense"]) == 2 and store.main(["prune"]) == 2


# ---- the store command line ----------------------------------------------------------------------
def test_store_ls_du_prune(tiny, tmp_path, capsys):
    root = tmp_path / "s"
    good, _, _ = snap(tiny, root, "g1", prompt(40, seed=1))
    bad, _, _ = snap(tiny, root, "b1", prompt(40, seed=2))
    (bad / STATE).write_bytes(b"x" * (bad / STATE).stat().st_size)
    (good.parent / ".tmp-b2-1-2").mkdir()                     # an interrupted capture
    assert store.main(["ls", f"store={root}", "check=true"]) == 0
    out = capsys.readouterr().out
    assert "invalid: b1" in out and "checksum mismatch" in out and "incomplete: .tmp-b2-1-2" in out
    assert store.main(["du", f"store={root}"]) == 0 and "total" in capsys.readouterr().out
    assert store.main(["prune", f"store={root}", "invalid=true", "dry_run=true"]) == 0
    assert bad.exists()
    assert store.main(["prune", f"store={root}", "invalid=true"]) == 0
    assert good.exists() and not bad.exists() and not (good.parent / ".tmp-b2-1-2").exists()
    assert store.main(["prune", f"store={root}", "older_than_days=0"]) == 0 and not good.exists()


def test_default_store_is_outside_the_repository(monkeypatch, tmp_path):
    monkeypatch.setenv("IQUESTRT_HOME", str(tmp_path))
    assert store.default_store() == tmp_path / "snapshots"
    monkeypatch.delenv("IQUESTRT_HOME")
    assert store.default_store() == store.Path.home() / ".cache" / "iquestrt" / "snapshots"


# ---- q1-mini on a real trace request, through the command lines ---------------------------------
@pytest.fixture(scope="module")
def corpus_args(tmp_path_factory):
    """claude400 from the default trace store if it is there; else a tiny corpus built here."""
    try:
        load_corpus("claude400")
        return ["traces=claude400"]
    except CorpusError:
        from tests.test_traces import make_tree, small_config

        base = tmp_path_factory.mktemp("traces")
        src = make_tree(base / "src")
        build_corpus("small", small_config(src), store=base / "store", progress=False)
        return ["traces=small", f"traces_store={base / 'store'}"]


def test_q1_mini_capture_verify_cli(corpus_args, tmp_path, capsys):
    args = ["model=q1-mini", *corpus_args, "limit=1", "budget=32", f"store={tmp_path}", "runtime.device=cpu"]
    summary = tmp_path / "summary.json"
    assert capture.main(args + ["progress=false", f"out={summary}"]) == 0
    s = json.loads(summary.read_text())
    assert s["captured"] == 1 and s["failed"] == 0 and s["bytes_per_token"] > 512   # ≥ the full layer's K/V
    d = store.Path(s["rows"][0]["dir"])
    mtime = (d / STATE).stat().st_mtime_ns
    assert capture.main(args + ["progress=false", f"out={summary}"]) == 0
    assert json.loads(summary.read_text())["reused"] == 1 and (d / STATE).stat().st_mtime_ns == mtime
    vargs = [a for a in args if not a.startswith(("budget=", "traces_store="))]
    assert verify.main(vargs) == 0
    q = json.loads((d / MANIFEST).read_text())["qualification"]
    assert q["passed"] and q["state_exact"] and q["tokens_compared"] >= 1
    # continuing a partial run: the qualified snapshot is skipped; a damaged qualification is not
    assert verify.main(vargs + ["unverified_only=true"]) == 0
    assert "nothing to verify" in capsys.readouterr().out
    assert verify.select_snapshots(d.parent, unverified_only=True) == []
    m = json.loads((d / MANIFEST).read_text())
    m["qualification"]["passed"] = False
    (d / MANIFEST).write_text(json.dumps(m))
    assert verify.select_snapshots(d.parent, unverified_only=True) == [d]
    assert verify.main(vargs + ["unverified_only=true"]) == 0 and verify.select_snapshots(d.parent, unverified_only=True) == []
    assert verify.main(vargs + ["broken=cache_len_off_by_one", "budget=8"]) == 0    # 0: the control was rejected
    assert "1/1 rejected" in capsys.readouterr().out
    assert verify.main(vargs + ["time_limit_s=0", "order=shuffle", "record=false"]) == 1   # nothing verified
    assert "PARTIAL: 1 of 1 not verified" in capsys.readouterr().out
    # an engine of another model finds no snapshots of its own in this store: a clear error, status 1
    assert verify.main([a if not a.startswith("model=") else "model=q1-tiny" for a in vargs]) == 1


def test_q1_mini_stability_cli(corpus_args, tmp_path, capsys):
    out = tmp_path / "stab.json"
    args = ["model=q1-mini", *corpus_args, "limit=1", "appends=[1,8]", "tail_rows=64", "spread_rows=16",
            f"out={out}", "runtime.device=cpu"]
    assert stability.main(args) == 0
    r = json.loads(out.read_text())
    assert set(r["summary"]) == {"1", "8"} and r["requests"][0]["rows_compared"] == 80
    assert {b["bucket"] for b in r["summary"]["1"]} >= {"last", "1-7", "8-63"}
    assert "max|Δ|" in capsys.readouterr().out
