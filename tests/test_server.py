"""The streaming decode (``Engine.decode(stream=...)``) and the HTTP server (``runtime/server.py``).

Real parts: the committed q1-mini checkpoint and tokenizer, a real server on a loopback port, and
``http.client`` / raw sockets as the clients. What is checked: a streamed decode hands over exactly the
tokens of an unstreamed one, in chunks of about ``every``; a cancelled one stops early with a prefix of
them (negative control: the same request not cancelled runs to its budget); the server's completions
equal ``Engine.generate`` token for token, streamed or not, text included; a client that disconnects, or
the cancel endpoint, ends a completion early; every bad request gets its status and names its field,
and the server keeps serving; a busy engine with no queue answers 503. GPU (marked): the same stream
and cancel through the device loop, whose graphs are kept across requests.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.engine import Engine, TokenStream
from runtime.generate import decode_text, prompt_tokens
from runtime.server import make_server

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def mini():
    return Engine.build("q1-mini", {"device": "cpu"})


def chunked(eng, prompt, seed, budget, every, cancel_after=None):
    chunks = []
    stop = (lambda: len(chunks) >= cancel_after) if cancel_after is not None else (lambda: False)
    rnd, st = eng.start(prompt, seed, budget)
    g = eng.decode(rnd, st, stream=TokenStream(on_tokens=chunks.append, every=every, cancelled=stop))
    return g, chunks


def check_chunks(chunks, every):
    assert len(chunks[0]) == 1                      # the prefill's token, before the first step
    for c in chunks[1:-1]:
        assert every <= len(c) <= every + 7, [len(c) for c in chunks]   # a step emits at most 8


def test_a_streamed_decode_hands_over_the_decode_in_chunks(mini):
    ids = prompt_tokens(PROMPT, mini.cfg.vocab_size)
    ref = mini.generate(ids, seed=3, max_new_tokens=40)
    assert ref.finish_reason == "length" and len(ref.tokens) == 40
    g, chunks = chunked(mini, ids, 3, 40, every=8)
    assert sum(chunks, []) == g.tokens == ref.tokens and g.steps == ref.steps
    check_chunks(chunks, 8)
    assert g.finish_reason == "length"
    # cancelled after its second chunk: a prefix of the same decode, stopped early (the negative
    # control is the run above: not cancelled, the same request runs to its budget)
    c, chunks = chunked(mini, ids, 3, 40, every=8, cancel_after=2)
    assert c.finish_reason == "cancelled" and len(chunks) == 2
    assert sum(chunks, []) == c.tokens == ref.tokens[:len(c.tokens)] and 9 <= len(c.tokens) < 40
    with pytest.raises(ValueError, match="at least 1"):
        TokenStream(on_tokens=print, every=0)


# ---- the server --------------------------------------------------------------------------------
class Live:
    """A server on a free loopback port, serving in a thread."""

    def __init__(self, eng, **kw):
        self.httpd, self.srv = make_server(eng, "127.0.0.1", 0, **kw)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def request(self, method, path, body=None, raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.status, json.loads(r.read() or b"null"), dict(r.getheaders())
        conn.close()
        return out

    def stream(self, body):
        """(connection, response): read events with :func:`events`."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode())
        return conn, conn.getresponse()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def events(resp):
    """Server-Sent Events' data, as they arrive."""
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            yield None if data == b"[DONE]" else json.loads(data)


def wait_for(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def live(mini):
    s = Live(mini, stream_every=8, max_tokens_limit=512)
    yield s
    s.close()


def test_completions_equal_the_engine_streamed_or_not(live, mini):
    st, h, _ = live.request("GET", "/health")
    assert st == 200 and h["model"] == "q1-mini" and h["busy"] is False and h["execution"] == "eager"
    st, m, _ = live.request("GET", "/v1/models")
    assert st == 200 and m["data"][0]["id"] == "q1-mini"
    ids = prompt_tokens(PROMPT, mini.cfg.vocab_size)
    ref = mini.generate(ids, seed=5, max_new_tokens=48)
    st, out, _ = live.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "seed": 5})
    assert st == 200, out
    ch = out["choices"][0]
    assert ch["tokens"] == ref.tokens and ch["text"] == decode_text(ref.tokens, mini.cfg.vocab_size) != ""
    assert ch["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 48, "total_tokens": len(ids) + 48}
    assert out["speculative"]["steps"] == len(ref.steps) and out["speculative"]["tokens_per_step"] > 1
    # token ids as the prompt: the same completion
    st, out2, _ = live.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 48, "seed": 5})
    assert st == 200 and out2["choices"][0]["tokens"] == ref.tokens
    # streamed: the same tokens and text, in chunks of about 8, then the finish and [DONE]
    conn, resp = live.stream({"prompt": PROMPT, "max_tokens": 48, "seed": 5})
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    evs = list(events(resp))
    conn.close()
    assert evs[-1] is None and evs[-2]["choices"][0]["finish_reason"] == "length"
    chunks = [e["choices"][0]["tokens"] for e in evs[:-2]]
    assert sum(chunks, []) == ref.tokens
    check_chunks(chunks, 8)
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == ch["text"]
    assert evs[-2]["usage"]["completion_tokens"] == 48 and evs[-2]["id"] == resp.getheader("X-Completion-Id")


def test_a_client_that_disconnects_or_cancels_ends_its_completion(live, mini):
    body = {"prompt": PROMPT, "max_tokens": 160, "seed": 1, "stream_every": 4}
    # the control: not cancelled, the request runs to its budget
    conn, resp = live.stream(body)
    full = [e for e in events(resp) if e]
    conn.close()
    assert full[-1]["choices"][0]["finish_reason"] == "length" and full[-1]["usage"]["completion_tokens"] == 160
    served = live.srv.served
    # a client that reads one chunk and hangs up
    conn, resp = live.stream(body)
    first = next(events(resp))
    assert first["choices"][0]["tokens"]
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_for(lambda: live.srv.served > served and not live.srv.live)
    last = live.srv.last
    assert last["choices"][0]["finish_reason"] == "cancelled", last["usage"]
    assert last["usage"]["completion_tokens"] < 160 and live.srv.cancelled >= 1
    assert last["choices"][0]["tokens"] == sum([e["choices"][0]["tokens"] for e in full[:-1]], [])[
        :last["usage"]["completion_tokens"]]
    # the cancel endpoint, with the id from the stream's header
    conn, resp = live.stream(body)
    cid = resp.getheader("X-Completion-Id")
    it = events(resp)
    next(it)
    st, out, _ = live.request("POST", f"/v1/completions/{cid}/cancel")
    assert st == 200 and out == {"id": cid, "cancelled": True}
    rest = [e for e in it if e]
    conn.close()
    assert rest[-1]["choices"][0]["finish_reason"] == "cancelled" and rest[-1]["usage"]["completion_tokens"] < 160
    st, out, _ = live.request("POST", f"/v1/completions/{cid}/cancel")
    assert st == 404 and "no running or queued completion" in out["error"]["message"]


@pytest.mark.parametrize("body,status,param,words", [
    (b"{not json", 400, None, "not JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"prompt": "x", "temperature": 0.5}).encode(), 400, "temperature", "unknown field"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt", "empty"),
    (json.dumps({"prompt": []}).encode(), 400, "prompt", "empty"),
    (json.dumps({"prompt": [1, 2, 99999]}).encode(), 400, "prompt", "outside"),
    (json.dumps({"prompt": [1, True]}).encode(), 400, "prompt", "list of token ids"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt", "a string"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens", "1..512"),
    (json.dumps({"prompt": "x", "max_tokens": 513}).encode(), 400, "max_tokens", "1..512"),
    (json.dumps({"prompt": "x", "max_tokens": "8"}).encode(), 400, "max_tokens", "integer"),
    (json.dumps({"prompt": "x", "seed": -1}).encode(), 400, "seed", "seed"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream", "true or false"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model", "not served"),
    (json.dumps({"prompt": [1] * 196_600, "max_tokens": 64}).encode(), 400, "prompt", "max_context"),
])
def test_bad_requests_are_refused_with_their_field(live, body, status, param, words):
    st, out, _ = live.request("POST", "/v1/completions", raw=body)
    assert st == status and out["error"]["param"] == param and words in out["error"]["message"], out
    st, out, _ = live.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert st == 200 and out["usage"]["completion_tokens"] == 2          # and the server serves on


def test_routes_methods_and_a_busy_engine(mini):
    s = Live(mini, stream_every=4, max_queue=0)
    try:
        assert s.request("GET", "/v1/completions")[0] == 405
        assert s.request("GET", "/nowhere")[0] == 404
        assert s.request("POST", "/v1/chat/completions", {"prompt": "x"})[0] == 404
        conn, resp = s.stream({"prompt": PROMPT, "max_tokens": 160})
        it = events(resp)
        next(it)                                   # running: the engine is busy, no queue allowed
        assert s.request("GET", "/health")[1]["busy"] is True
        st, out, headers = s.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert st == 503 and headers.get("Retry-After") == "1" and "busy" in out["error"]["message"]
        assert [e for e in it if e][-1]["choices"][0]["finish_reason"] == "length"
        conn.close()
    finally:
        s.close()


def test_requests_wait_their_turn(live, mini):
    ids = prompt_tokens(PROMPT, mini.cfg.vocab_size)
    refs = {seed: mini.generate(ids, seed=seed, max_new_tokens=24).tokens for seed in (11, 12, 13)}
    got = {}

    def one(seed):
        got[seed] = live.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "seed": seed})

    threads = [threading.Thread(target=one, args=(s,)) for s in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(got[s][0] == 200 and got[s][1]["choices"][0]["tokens"] == refs[s] for s in refs), got
    # one engine, one decode at a time: some request waited for another's whole decode
    timing = [got[s][1]["timing"] for s in refs]
    assert max(t["queued_ms"] for t in timing) >= 0.5 * min(t["decode_ms"] for t in timing), timing


def test_the_command_line_serves_and_stops_on_ctrl_c():
    p = subprocess.run([sys.executable, "-m", "runtime.server", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "POST /v1/completions" in p.stdout and "stream_every" in p.stdout
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    # (as under pytest-xdist, whose workers ignore SIGINT: a child inherits that, and Ctrl-C must still work)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.server", "model=q1-tiny", "port=0", "max_queue=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        port = None
        for line in proc.stdout:
            if "listening on http://" in line:
                port = int(line.split("http://")[1].split()[0].rsplit(":", 1)[1])
                break
        assert port, "the server did not say where it listens"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [3, 4, 5], "max_tokens": 6}))
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200 and out["usage"]["completion_tokens"] == 6 and out["model"] == "q1-tiny"
        conn.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "runtime.server", "model=no-such-model"], capture_output=True,
                         text=True, env=env)
    assert bad.returncode == 2 and "error" in bad.stderr


# ---- GPU: the device loop's pauses -------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_device_loop_streams_and_cancels():
    """Through the device loop (one launch per chunk, graphs kept across requests): the chunks are the
    unstreamed decode's tokens, every step keeps its own stamps (only the pauses leave gaps between
    steps: one per relaunch), a cancel stops it early, and the kept loop decodes the next request as a
    fresh one would."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    assert eng.execution == "device"
    ids = prompt_tokens(PROMPT, eng.cfg.vocab_size)
    for seed in range(16):      # a request that does not stop early (session 55: a longer prompt's first token was EOS)
        ref = eng.generate(ids, seed=seed, max_new_tokens=96)
        if len(ref.tokens) >= 64:
            break
    assert len(ref.tokens) >= 64, "no seed of 16 decoded 64 tokens"
    g, chunks = chunked(eng, ids, seed, 96, every=16)
    assert sum(chunks, []) == g.tokens == ref.tokens and g.steps == ref.steps and g.finish_reason == ref.finish_reason
    check_chunks(chunks, 16)
    ends = [t + d for t, d in zip(g.step_t0_ns, g.step_ns)]
    gaps = [b - a for a, b in zip(ends, g.step_t0_ns[1:])]
    assert all(gap >= 0 for gap in gaps)
    paused = sum(gap > 2_000 for gap in gaps)      # a relaunch costs the host well over 2 us
    assert len(chunks) >= 5 and paused == len(chunks) - 2, (paused, len(chunks))   # chunk 0: the prefill's
    assert sum(ref.step_ns) <= ref.loop_ns and sum(g.step_ns) <= g.loop_ns
    c, cchunks = chunked(eng, ids, seed, 96, every=16, cancel_after=2)
    assert c.finish_reason == "cancelled" and c.tokens == ref.tokens[:len(c.tokens)] and len(c.tokens) < len(ref.tokens)
    again = eng.generate(ids, seed=seed, max_new_tokens=96)     # the kept loop, after a cancelled request
    assert again.tokens == ref.tokens and again.steps == ref.steps


@pytest.mark.gpu
def test_gpu_server_streams_through_the_device_loop():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    eng = Engine.build("q1-mini", {"device": "cuda", "backend": "fast", "dtype": "bfloat16"})
    s = Live(eng, stream_every=16)
    try:
        st, out, _ = s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 64, "seed": 4})
        assert st == 200 and out["speculative"]["execution"] == "device"
        conn, resp = s.stream({"prompt": PROMPT, "max_tokens": 64, "seed": 4})
        evs = [e for e in events(resp) if e]
        conn.close()
        assert sum([e["choices"][0]["tokens"] for e in evs], []) == out["choices"][0]["tokens"]
        assert "".join(e["choices"][0]["text"] for e in evs) == out["choices"][0]["text"]
    finally:
        s.close()
