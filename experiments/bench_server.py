"""What streaming costs: a decode handed over in chunks against the same decode in one piece, and the
server's time to first token, side by side in one run.

1. Engine: one request (random prompt tokens), forked, decoded in rounds; each round decodes it once
   unstreamed and once per chunk size (``--every``), in a rotating order. Under the device loop a
   streamed decode is one launch per chunk (the host reads each chunk and launches again). Per chunk
   size: the decode's wall time per output token (launch to last sync, the host's clock, every step
   and pause) as a ratio to the unstreamed decode's, the chunks, and whether the tokens are the same.
2. HTTP (``runtime/server.py`` on a loopback port, ``http.client``): the same prompt as token ids,
   streamed and not, in rounds: time to the first event (the prefill's token), to the last, and the
   unstreamed answer's time; the gaps between streamed chunks.

    OUT=... python3 experiments/bench_server.py --models q1-mini --contexts 2048,32768
    python3 experiments/bench_server.py --models q1 --contexts 2048 --tokens 64 --rounds 3
    python experiments/bench_server.py --dry-run        # CPU, q1-tiny, eager: checks the script

Writes ``$OUT/bench_server.json`` after every row (a run cut short keeps what it measured). Times name
the machine; compare within one run. Every HTTP request prefills its prompt on the reference path: q1
(rank 0 of 8) took 5.4 s at 2K on the H200 (session 55), so ``--http-contexts`` keeps q1's HTTP part short.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

from _bench import CUDA, DEV, DRY_RUN, write_results  # noqa: I001  (first: --dry-run switches the interpreter on)

import torch

from runtime.engine import Engine, TokenStream
from runtime.graphs import fork_request
from runtime.server import make_server

ROWS: list[dict] = []
ARGS: dict = {}


def save() -> str | None:
    return write_results("bench_server", {"args": ARGS, "device": str(DEV)}, ROWS)


def log(msg: str) -> None:
    print(msg, flush=True)


def engine_for(model: str) -> Engine:
    rt = {"backend": "reference" if DRY_RUN else "fast", "dtype": "float32" if DRY_RUN else "bfloat16",
          "device": str(DEV)}
    if model == "q1":
        rt["tp"] = {"size": 8, "emulate_rank": 0}
    return Engine.build(model, rt)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed_decode(eng, rnd, st, every):
    chunks = []
    stream = None if every is None else TokenStream(on_tokens=chunks.append, every=every)
    sync()
    t0 = time.perf_counter_ns()
    g = eng.decode(rnd, st, stream=stream)
    sync()
    return g, time.perf_counter_ns() - t0, len(chunks)


def engine_part(model, ctx, eng, prompt, seed, tokens, everies, rounds):
    with torch.no_grad():
        rnd0, st0 = eng.start(prompt, seed, tokens)
        ref, _, _ = timed_decode(eng, *fork_request(rnd0, st0), None)     # builds the kept loop, not timed
        names = ["none"] + [str(e) for e in everies]
        times = {n: [] for n in names}
        chunks, same = {}, {}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                g, ns, k = timed_decode(eng, *fork_request(rnd0, st0), None if n == "none" else int(n))
                times[n].append(ns / max(1, len(g.tokens)))
                chunks[n], same[n] = k, g.tokens == ref.tokens and g.steps == ref.steps
    base = statistics.median(times["none"])
    for n in names:
        med = statistics.median(times[n])
        row = {"part": "engine", "model": model, "context": ctx, "every": n, "tokens": len(ref.tokens),
               "steps": len(ref.steps), "chunks": chunks[n], "wall_per_token_us": med / 1e3,
               "ratio": med / base, "identical": same[n], "all_us": [t / 1e3 for t in times[n]]}
        ROWS.append(row)
        save()
        log(f"{model:<8} {ctx:>7} {n:>6} {row['tokens']:>6} {row['steps']:>5} {row['chunks']:>6} "
            f"{row['wall_per_token_us']:>12.1f} {row['ratio']:>8.4f} {'yes' if row['identical'] else 'NO'}")
    return ref


def http_part(model, ctx, eng, prompt, seed, tokens, every, rounds, ref):
    httpd, srv = make_server(eng, "127.0.0.1", 0, log_requests=False, stream_every=every,
                             max_tokens_limit=max(tokens, 4096))
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    port = httpd.server_address[1]
    body = {"prompt": prompt, "max_tokens": tokens, "seed": seed}
    res = {"first": [], "last": [], "plain": [], "gaps": []}
    same = True
    try:
        for _ in range(rounds + 1):              # the first round warms the connection path, not counted
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}))
            resp = conn.getresponse()
            stamps, toks = [], []
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    stamps.append(time.perf_counter() - t0)
                    toks += json.loads(line[6:])["choices"][0]["tokens"]
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            t1 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(body))
            out = json.loads(conn.getresponse().read())
            plain = time.perf_counter() - t1
            conn.close()
            same &= toks == out["choices"][0]["tokens"] == ref.tokens
            if _ == 0:
                continue
            res["first"].append(stamps[0])
            res["last"].append(stamps[-1])
            res["plain"].append(plain)
            res["gaps"] += [b - a for a, b in zip(stamps[1:-2], stamps[2:-1])]
    finally:
        httpd.shutdown()
        httpd.server_close()
    med = {k: statistics.median(v) * 1e3 if v else float("nan") for k, v in res.items()}
    row = {"part": "http", "model": model, "context": ctx, "every": every, "tokens": len(ref.tokens),
           "first_event_ms": med["first"], "last_event_ms": med["last"], "unstreamed_ms": med["plain"],
           "chunk_gap_ms": med["gaps"], "streamed_over_unstreamed": med["last"] / med["plain"],
           "identical": same, "all": res}
    ROWS.append(row)
    save()
    log(f"{model:<8} {ctx:>7} {every:>6} {row['tokens']:>6} {med['first']:>14.2f} {med['gaps']:>12.2f} "
        f"{med['last']:>13.2f} {med['plain']:>14.2f} {row['streamed_over_unstreamed']:>8.4f} {'yes' if same else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="q1-mini", help="comma-separated: q1-mini, q1 (rank 0 of 8), q1-tiny")
    ap.add_argument("--contexts", default="2048,32768", help="prompt lengths (random tokens)")
    ap.add_argument("--tokens", type=int, default=128, help="output budget per decode")
    ap.add_argument("--every", default="64,32,16,8", help="chunk sizes (tokens) of the streamed decodes")
    ap.add_argument("--http-every", type=int, default=32, help="the server's chunk size")
    ap.add_argument("--http-contexts", default=None, help="the HTTP part's prompt lengths (default: --contexts)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, q1-tiny, eager: checks the script")
    a = ap.parse_args()
    ARGS.update(vars(a))
    models = ["q1-tiny"] if DRY_RUN else a.models.split(",")
    contexts = [64] if DRY_RUN else [int(c) for c in a.contexts.split(",")]
    tokens, rounds = (16, 2) if DRY_RUN else (a.tokens, a.rounds)
    everies = [int(e) for e in a.every.split(",")]
    log(f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}; {tokens} tokens per decode, {rounds} rounds")
    engines = {m: engine_for(m) for m in models}
    log(f"1. engine: wall time per output token (launch to last sync), streamed against unstreamed "
        f"(execution: {', '.join(f'{m} {e.execution}' for m, e in engines.items())})")
    log(f"{'model':<8} {'context':>7} {'every':>6} {'tokens':>6} {'steps':>5} {'chunks':>6} {'us per token':>12} "
        f"{'ratio':>8} same")
    refs = {}
    for m, eng in engines.items():
        for c in contexts:
            gen = torch.Generator().manual_seed(a.seed)
            prompt = torch.randint(0, eng.cfg.vocab_size, (c,), generator=gen).tolist()
            refs[(m, c)] = (prompt, engine_part(m, c, eng, prompt, a.seed, tokens, everies, rounds))
    log(f"2. HTTP, {a.http_every} tokens per chunk: medians in ms from sending the request")
    log(f"{'model':<8} {'context':>7} {'every':>6} {'tokens':>6} {'first event':>14} {'chunk gap':>12} "
        f"{'last event':>13} {'unstreamed':>14} {'ratio':>8} same")
    http_ctx = contexts if DRY_RUN or not a.http_contexts else [int(c) for c in a.http_contexts.split(",")]
    for m, eng in engines.items():
        for c in http_ctx:
            if (m, c) not in refs:
                raise SystemExit(f"--http-contexts {c}: not among --contexts (the engine part's reference decode)")
            prompt, ref = refs[(m, c)]
            http_part(m, c, eng, prompt, a.seed, tokens, a.http_every, rounds, ref)
    path = save()
    if path:
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
