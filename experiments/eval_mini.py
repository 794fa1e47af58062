"""Measure q1-mini with the runtime's own decode on held-out claude400 requests.

    python experiments/eval_mini.py [checkpoint=DIR] [n=24] [budget=128] [device=auto] [out=FILE.json]
                                    [max_context=200000] [store=TRACE_STORE]

For ``n`` requests spread over the corpus's context lengths (q1-mini never trained on the traces, so
every request is held out), at the checkpoint's default sampling (temperature 1, top-k 20, top-p 0.95):
- mean accepted drafts and tokens per step with a fixed 5 drafts, and with the stop rule;
- distinct experts per layer at six live rows (the width-6 verification rows of fixed-5 decoding)
  for real requests, versus a repeated-token input decoded the same way;
- a sample of generated text on one request.
Prints a table; writes every number and the per-request rows to ``out``. Needs only torch,
tokenizers, safetensors and PyYAML (it runs on the GPU machines as they are).
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import checkpoint as ckpt  # noqa: E402
from runtime.config import load_model_config, runtime_config_from_dict  # noqa: E402
from runtime.engine import Engine, default_checkpoint  # noqa: E402
from snapshots.traces import load_corpus  # noqa: E402
from snapshots.tokenizer import load_tokenizer  # noqa: E402

DEFAULTS = {"checkpoint": None, "n": 24, "budget": 128, "device": "auto", "out": None, "traces": "claude400",
            "max_context": 200_000, "store": None, "model": "q1-mini"}


def parse(argv):
    s = dict(DEFAULTS)
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        k, _, v = a.partition("=")
        if k not in s:
            sys.exit(f"error: unknown setting {k!r}; known: {sorted(s)}")
        s[k] = int(v) if isinstance(DEFAULTS[k], int) else v
    return s


def seed_of(request_id: str) -> int:
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16)


class ExpertCounter:
    """Wraps Model.route: distinct experts per target layer over each 6-row verification."""

    def __init__(self, model):
        self.model, self.orig = model, model.route
        self.n_layers = len(model.layers)
        self.layer_ids = {id(lw): i for i, lw in enumerate(model.layers)}
        self.counts: list[int] = []
        model.route = self

    def __call__(self, lw, x):
        ids, w = self.orig(lw, x)
        if x.shape[0] == 6 and id(lw) in self.layer_ids:
            self.counts.append(int(torch.unique(ids).numel()))
        return ids, w

    def take(self) -> list[int]:
        c, self.counts = self.counts, []
        return c


def main(argv) -> int:
    s = parse(argv)
    cfg = load_model_config(s["model"])
    path = Path(s["checkpoint"]) if s["checkpoint"] else default_checkpoint(cfg)
    if path is None:
        sys.exit("error: no checkpoint (train one: experiments/train_mini.py)")
    tensors = ckpt.load_checkpoint(path, cfg)
    chash = ckpt.checkpoint_hash(path)
    engines = {pol: Engine(cfg, runtime_config_from_dict(
        {"device": s["device"], "draft": {"policy": pol, "fixed_depth": 5}}), tensors, chash)
        for pol in ("fixed", "stop_rule")}
    corpus = load_corpus(s["traces"], store=s["store"])
    reqs = sorted((r for r in corpus.requests if r.n_tokens + s["budget"] + 32 <= min(cfg.max_context, s["max_context"])),
                  key=lambda r: r.n_tokens)
    step = max(1, len(reqs) // s["n"])
    chosen = reqs[::step][: s["n"]]
    tok = load_tokenizer()
    counter = ExpertCounter(engines["fixed"].model)
    rows, sample = [], None
    t0 = time.time()
    for i, r in enumerate(chosen):
        prompt = corpus.tokens(r)
        row = {"request_id": r.request_id, "context": len(prompt)}
        for pol, eng in engines.items():
            ts = time.time()
            g = eng.generate(prompt, seed=seed_of(r.request_id), max_new_tokens=s["budget"])
            row[pol] = {"steps": len(g.steps), "tokens": len(g.tokens), "accepted_per_step": g.accepted_per_step,
                        "tokens_per_step": g.tokens_per_step,
                        "drafts_per_step": statistics.mean(x["drafts"] for x in g.steps) if g.steps else 0.0,
                        "wall_s": round(time.time() - ts, 2)}
            if pol == "fixed":
                c = counter.take()
                row["distinct_experts_6rows"] = statistics.mean(c) if c else None
                if sample is None and len(prompt) > 4000:
                    sample = {"request_id": r.request_id, "context": len(prompt),
                              "prompt_tail": tok.decode(prompt[-300:], skip_special_tokens=False),
                              "output": tok.decode(g.tokens, skip_special_tokens=False)}
        rows.append(row)
        print(f"[{i + 1}/{len(chosen)}] {r.request_id} ctx {len(prompt):>7}  fixed5 acc/step "
              f"{row['fixed']['accepted_per_step']:.2f}  stop-rule acc/step {row['stop_rule']['accepted_per_step']:.2f} "
              f"(drafts {row['stop_rule']['drafts_per_step']:.2f})  experts@6 {row['distinct_experts_6rows']}", flush=True)
    # repeated-token input through the same path
    rep_tok = tok.encode("    ").ids[0]
    g = engines["fixed"].generate([rep_tok] * 1024, seed=1, max_new_tokens=s["budget"])
    rep_counts = counter.take()

    def mean_of(pol, key):
        return statistics.mean(r[pol][key] for r in rows)

    summary = {
        "checkpoint": str(path), "checkpoint_hash": chash, "device": str(engines["fixed"].device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and s["device"] != "cpu" else None,
        "requests": len(rows), "budget": s["budget"],
        "fixed5_accepted_per_step": mean_of("fixed", "accepted_per_step"),
        "fixed5_tokens_per_step": mean_of("fixed", "tokens_per_step"),
        "stop_rule_accepted_per_step": mean_of("stop_rule", "accepted_per_step"),
        "stop_rule_tokens_per_step": mean_of("stop_rule", "tokens_per_step"),
        "stop_rule_drafts_per_step": mean_of("stop_rule", "drafts_per_step"),
        "distinct_experts_6rows_real": statistics.mean(r["distinct_experts_6rows"] for r in rows if r["distinct_experts_6rows"]),
        "distinct_experts_6rows_repeated_token": statistics.mean(rep_counts) if rep_counts else None,
        "repeated_token_accepted_per_step": g.accepted_per_step,
        "num_experts": cfg.num_experts, "wall_s": round(time.time() - t0, 1),
    }
    print("\n" + "\n".join(f"{k:>40}: {v}" for k, v in summary.items()))
    if sample:
        print(f"\nsample ({sample['request_id']}, context {sample['context']}):\n--- prompt tail ---\n"
              f"{sample['prompt_tail']}\n--- q1-mini output ---\n{sample['output']}")
    if s["out"]:
        Path(s["out"]).write_text(json.dumps({"summary": summary, "rows": rows, "sample": sample}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
