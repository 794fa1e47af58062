"""``python -m runtime.server model=q1-mini port=8000``: the engine behind HTTP, one request at a time.

The runtime decodes a single request as fast as it can (DESIGN.md); this server puts one engine behind
a small OpenAI-style completions API for an agent or a person to talk to:

    GET  /health                        the model, device, execution; busy or not, requests queued
    GET  /v1/models                     the one model served
    POST /v1/completions                {"prompt": "text" | [token ids], "max_tokens": 64, "seed": 0,
                                         "stream": false}
    POST /v1/completions/{id}/cancel    end a running or queued completion early

A completion prefills the prompt, then decodes speculatively. With ``"stream": true`` the answer is
Server-Sent Events (``text/event-stream``): a chunk about every ``stream_every`` tokens (the device
loop pauses there and the host reads the result log), then a last chunk with the finish reason, the
usage and the round's statistics, then ``data: [DONE]``. Without it, one JSON object at the end.
A client that disconnects cancels its completion at the next chunk; so does the cancel endpoint.

Requests wait their turn (``max_queue`` may wait; beyond that 503 with Retry-After). A bad request gets
4xx with a JSON error naming the field: malformed JSON, unknown fields, an empty or over-long prompt
(beyond the model's context with its budget), token ids outside the vocabulary, a budget outside
1..``max_tokens_limit``. Text prompts are tokenised with the committed code tokenizer when the model's
vocabulary holds it (q1-mini), else as UTF-8 bytes (random-weight test models), as ``runtime.generate``
does; every response carries the token ids as well as the text.

Settings (Hydra overrides of ``conf/server.yaml``): model, checkpoint, runtime.*, host, port,
stream_every, max_tokens_default, max_tokens_limit, max_queue.
"""
from __future__ import annotations

import itertools
import json
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .engine import Engine, RequestError, TokenStream
from .generate import decode_text, prompt_tokens

HELP = """usage: python -m runtime.server [OVERRIDE ...]

Serve one engine over HTTP (OpenAI-style completions, streaming as Server-Sent Events).

Overrides (Hydra syntax, defaults in conf/server.yaml):
  model=q1-mini|q1-tiny|q1      model config (conf/model/*.yaml)
  host=127.0.0.1 port=8000      where to listen (port=0: any free port, printed)
  stream_every=32               tokens per streamed chunk (the device loop pauses there)
  max_tokens_default=256        budget of a request that names none
  max_tokens_limit=4096         the largest budget a request may ask for
  max_queue=8                   requests that may wait for the engine; beyond: 503
  runtime.device=cuda runtime.backend=fast runtime.dtype=bfloat16   (see conf/runtime/default.yaml)
  checkpoint=DIR random_seed=0  weights (default: the model's committed asset, else seeded random)

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/completions/{id}/cancel.
  curl -s localhost:8000/v1/completions -d '{"prompt": "def add(a, b):", "max_tokens": 32}'
  curl -sN localhost:8000/v1/completions -d '{"prompt": "def add(a, b):", "stream": true}'
"""

FIELDS = {"prompt", "max_tokens", "seed", "stream", "model", "stream_every"}
MAX_BODY = 16 << 20      # bytes of a request body (a 192K-token prompt as JSON ids is ~1.3 MB)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Completion:
    """One request's life in the server."""
    id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    stream: bool
    every: int
    cancel: threading.Event = field(default_factory=threading.Event)
    t_arrived: float = field(default_factory=time.perf_counter)


class EngineServer:
    """The engine, the queue in front of it and the requests in flight (no state outside an instance:
    two servers, or two copies of ``runtime``, may live in one process)."""

    def __init__(self, engine: Engine, *, stream_every: int = 32, max_tokens_default: int = 256,
                 max_tokens_limit: int = 4096, max_queue: int = 8, model_name: str | None = None):
        self.engine, self.model = engine, model_name or engine.cfg.name
        self.stream_every, self.max_tokens_default = int(stream_every), int(max_tokens_default)
        self.max_tokens_limit, self.max_queue = int(max_tokens_limit), int(max_queue)
        self._turn = threading.Lock()           # one decode at a time
        self._lock = threading.Lock()           # the counters and the table below
        self._ids = itertools.count(1)
        self.live: dict[str, Completion] = {}   # waiting or running
        self.waiting = 0
        self.served = self.cancelled = 0
        self.last: dict | None = None           # the last finished completion's summary (tests, /health)

    # ---- requests --------------------------------------------------------------------------------
    def parse(self, body: bytes) -> Completion:
        try:
            req = json.loads(body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(req, dict):
            raise BadRequest("the body must be a JSON object")
        unknown = sorted(set(req) - FIELDS)
        if unknown:
            raise BadRequest(f"unknown field(s) {unknown}; this server takes {sorted(FIELDS)}", unknown[0])
        if req.get("model") not in (None, self.model):
            raise BadRequest(f"model {req['model']!r} is not served here (this server: {self.model!r})", "model",
                             HTTPStatus.NOT_FOUND)
        vocab = self.engine.cfg.vocab_size
        p = req.get("prompt")
        if isinstance(p, str):
            if not p:
                raise BadRequest("the prompt is empty", "prompt")
            ids = prompt_tokens(p, vocab)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token ids outside [0, {vocab}): {bad[:5]}", "prompt")
        else:
            raise BadRequest("prompt: a string, or a list of token ids", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        n = req.get("max_tokens", self.max_tokens_default)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_tokens_limit:
            raise BadRequest(f"max_tokens={n!r}: an integer in 1..{self.max_tokens_limit}", "max_tokens")
        seed = req.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 62:
            raise BadRequest(f"seed={seed!r}: an integer in 0..2**62-1", "seed")
        stream = req.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream={stream!r}: true or false", "stream")
        every = req.get("stream_every", self.stream_every)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise BadRequest(f"stream_every={every!r}: a positive integer", "stream_every")
        try:
            self.engine.check_request(len(ids), n)
        except RequestError as e:
            raise BadRequest(str(e), "prompt") from None
        return Completion(id=f"cmpl-{next(self._ids):06d}", prompt=ids, max_tokens=n, seed=seed, stream=stream,
                          every=every)

    def admit(self, c: Completion) -> None:
        with self._lock:
            if self._turn.locked() and self.waiting >= self.max_queue:
                raise BadRequest(f"the engine is busy and {self.waiting} requests wait for it (max_queue="
                                 f"{self.max_queue}); try again shortly", None, HTTPStatus.SERVICE_UNAVAILABLE)
            self.waiting += 1
            self.live[c.id] = c

    def cancel(self, cid: str) -> bool:
        with self._lock:
            c = self.live.get(cid)
        if c is None:
            return False
        c.cancel.set()
        return True

    def run(self, c: Completion, on_tokens, disconnected=lambda: False) -> dict:
        """Decode ``c`` when its turn comes; ``on_tokens(ids)`` per chunk (streams). Returns the
        summary (what a non-streaming response holds)."""
        try:
            with self._turn:
                with self._lock:
                    self.waiting -= 1
                t_start = time.perf_counter()
                queued_s = t_start - c.t_arrived
                if c.cancel.is_set() or disconnected():
                    return self._summary(c, [], "cancelled", None, queued_s, 0.0, 0.0)
                eng = self.engine
                with torch.no_grad():
                    rnd, st = eng.start(c.prompt, c.seed, c.max_tokens)
                    prefill_s = time.perf_counter() - t_start
                    stream = TokenStream(on_tokens=on_tokens, every=c.every,
                                         cancelled=lambda: c.cancel.is_set() or disconnected())
                    t0 = time.perf_counter()
                    g = eng.decode(rnd, st, stream=stream)
                    decode_s = time.perf_counter() - t0
                del rnd, st
                return self._summary(c, g.tokens, g.finish_reason, g, queued_s, prefill_s, decode_s)
        finally:
            with self._lock:
                self.live.pop(c.id, None)

    def _summary(self, c: Completion, tokens, reason, g, queued_s, prefill_s, decode_s) -> dict:
        steps = len(g.steps) if g is not None else 0
        spec = {"steps": steps,
                "tokens_per_step": round(g.tokens_per_step, 4) if steps else None,
                "accepted_per_step": round(g.accepted_per_step, 4) if steps else None,
                "step_ms_mean": round(sum(g.step_ns) / steps / 1e6, 4) if steps else None,
                "execution": getattr(self.engine, "execution", "eager")}
        out = {"id": c.id, "object": "text_completion", "created": int(time.time()), "model": self.model,
               "choices": [{"index": 0, "text": self.text(tokens), "tokens": list(tokens),
                            "finish_reason": reason}],
               "usage": {"prompt_tokens": len(c.prompt), "completion_tokens": len(tokens),
                         "total_tokens": len(c.prompt) + len(tokens)},
               "speculative": spec,
               "timing": {"queued_ms": round(queued_s * 1e3, 3), "prefill_ms": round(prefill_s * 1e3, 3),
                          "decode_ms": round(decode_s * 1e3, 3)}}
        with self._lock:
            self.served += 1
            self.cancelled += reason == "cancelled"
            self.last = out
        return out

    def text(self, tokens) -> str:
        t = decode_text(list(tokens), self.engine.cfg.vocab_size)
        return t if t is not None else ""

    def health(self) -> dict:
        e = self.engine
        with self._lock:
            busy = self._turn.locked()
            return {"status": "ok", "model": self.model, "device": str(e.device), "backend": e.rt.backend,
                    "execution": getattr(e, "execution", "eager"), "checkpoint": e.checkpoint_hash,
                    "busy": busy, "queued": self.waiting, "served": self.served,
                    "cancelled": self.cancelled, "stream_every": self.stream_every,
                    "max_tokens_limit": self.max_tokens_limit, "max_context": e.cfg.max_context}


class TextDelta:
    """The text of a growing token list, handed out as increments: characters an unfinished multi-byte
    sequence may still change (a trailing U+FFFD) are held back until the next chunk or the end. Should
    the decoded text ever change before what was sent, nothing more is sent as text (the token ids in
    every chunk stay exact; ``mismatch`` says so)."""

    def __init__(self, server: EngineServer):
        self.server, self.tokens, self.sent, self.mismatch = server, [], "", False

    def add(self, ids: list[int], final: bool = False) -> str:
        self.tokens.extend(ids)
        text = self.server.text(self.tokens)
        stable = text if final else text.rstrip("\ufffd")
        if self.mismatch or not stable.startswith(self.sent):
            self.mismatch = True
            return ""
        delta = stable[len(self.sent):]
        self.sent += delta
        return delta


def _peer_gone(sock: socket.socket) -> bool:
    """The client closed its end (a readable socket with nothing to read). Requests are one body each,
    so a well-behaved client sends nothing more while it waits."""
    try:
        r, _, _ = select.select([sock], [], [], 0)
        if not r:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def make_handler(srv: EngineServer, log_requests: bool = True):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "IQuestRT"

        def log_message(self, fmt, *args):      # one line per request on stderr, as the base class does
            if log_requests:
                sys.stderr.write(f"{self.address_string()} - {fmt % args}\n")

        # ---- plumbing ----
        def _json(self, status: int, obj: dict) -> None:
            data = (json.dumps(obj) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == HTTPStatus.SERVICE_UNAVAILABLE:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": int(status)}})

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _event(self, obj) -> None:
            self._chunk(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

        def _body(self) -> bytes:
            n = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raise BadRequest("send the body with a Content-Length, not chunked", None, HTTPStatus.LENGTH_REQUIRED)
            try:
                n = int(n or 0)
            except ValueError:
                raise BadRequest(f"Content-Length {n!r} is not a number") from None
            if n > MAX_BODY:
                raise BadRequest(f"the body is {n} bytes; at most {MAX_BODY}", None, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            return self.rfile.read(n) if n > 0 else b""

        # ---- routes ----
        def do_GET(self):
            if self.path == "/health":
                return self._json(HTTPStatus.OK, srv.health())
            if self.path == "/v1/models":
                return self._json(HTTPStatus.OK, {"object": "list", "data": [
                    {"id": srv.model, "object": "model", "owned_by": "iquestrt",
                     "max_context": srv.engine.cfg.max_context}]})
            if self.path.startswith("/v1/completions"):
                return self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST for /v1/completions")
            return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}; see GET /health, GET /v1/models, "
                                                     "POST /v1/completions")

        def do_POST(self):
            try:
                body = self._body()
                parts = self.path.rstrip("/").split("/")
                if len(parts) == 5 and parts[:3] == ["", "v1", "completions"] and parts[4] == "cancel":
                    if srv.cancel(parts[3]):
                        return self._json(HTTPStatus.OK, {"id": parts[3], "cancelled": True})
                    return self._error(HTTPStatus.NOT_FOUND, f"no running or queued completion {parts[3]!r}")
                if self.path.rstrip("/") != "/v1/completions":
                    return self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
                c = srv.parse(body)
                srv.admit(c)
            except BadRequest as e:
                return self._error(e.status, str(e), e.param)
            gone = lambda: _peer_gone(self.connection)   # noqa: E731
            if not c.stream:
                try:
                    out = srv.run(c, on_tokens=lambda ids: None, disconnected=gone)
                except Exception as e:     # an engine failure: report it, keep serving
                    return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
                if out["choices"][0]["finish_reason"] == "cancelled" and gone():
                    self.close_connection = True
                    return
                return self._json(HTTPStatus.OK, out)
            self._stream(c, gone)

        def _stream(self, c: Completion, gone) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("X-Completion-Id", c.id)
            self.end_headers()
            text = TextDelta(srv)
            broken = threading.Event()

            def on_tokens(ids):
                if broken.is_set():
                    return
                try:
                    self._event({"id": c.id, "object": "text_completion.chunk", "model": srv.model,
                                 "choices": [{"index": 0, "text": text.add(ids), "tokens": ids,
                                              "finish_reason": None}]})
                except OSError:          # the client went away: cancel at the next chunk
                    broken.set()
                    c.cancel.set()
            try:
                out = srv.run(c, on_tokens, disconnected=gone)     # (a broken write has set c.cancel)
                if broken.is_set():
                    self.close_connection = True
                    return
                last = {k: out[k] for k in ("id", "model", "usage", "speculative", "timing")}
                last.update(object="text_completion.chunk", choices=[
                    {"index": 0, "text": text.add([], final=True), "tokens": [],
                     "finish_reason": out["choices"][0]["finish_reason"]}])
                self._event(last)
                self._event(b"[DONE]")
                self._chunk(b"")
            except OSError:
                self.close_connection = True
            except Exception as e:       # an engine failure mid-stream: an error event, then the end
                try:
                    self._event({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})
                    self._chunk(b"")
                except OSError:
                    pass
                self.close_connection = True

    return Handler


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 0, log_requests: bool = True,
                **kw) -> tuple[ThreadingHTTPServer, EngineServer]:
    """An HTTP server for ``engine`` bound to (host, port) (port 0: a free one); call
    ``serve_forever()`` on it (in a thread, for tests), ``shutdown()`` to stop. ``log_requests``: a line
    per request on stderr."""
    srv = EngineServer(engine, **kw)
    httpd = ThreadingHTTPServer((host, port), make_handler(srv, log_requests))
    httpd.daemon_threads = True
    return httpd, srv


def main(argv: list[str] | None = None) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .generate import cli_config

    cfg, status = cli_config("server", argv, HELP)
    if cfg is None:
        return status
    try:
        t0 = time.perf_counter()
        eng = Engine.build(cfg["model"], cfg["runtime"], cfg.get("checkpoint"), cfg.get("random_seed", 0))
        httpd, srv = make_server(eng, cfg["host"], int(cfg["port"]), stream_every=cfg["stream_every"],
                                 max_tokens_default=cfg["max_tokens_default"],
                                 max_tokens_limit=cfg["max_tokens_limit"], max_queue=cfg["max_queue"])
    except (ConfigError, CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def stop(signum, frame):   # Ctrl-C and SIGTERM alike, even where the parent left SIGINT ignored
        raise KeyboardInterrupt(signal.Signals(signum).name)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    host, port = httpd.server_address[:2]
    print(f"serving {srv.model} ({eng.checkpoint_hash[:24]}…) on {eng.device}, {eng.rt.backend}/{eng.rt.dtype}, "
          f"execution {eng.execution}; built in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"listening on http://{host}:{port} (Ctrl-C or SIGTERM stops; POST /v1/completions)", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        print("stopping: cancelling what runs", file=sys.stderr)
        for cid in list(srv.live):
            srv.cancel(cid)
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
