"""Train q1-mini: the IQuest-Q1 architecture at small size, on code the traces do not use.

    python experiments/train_mini.py [key=value ...]        (settings: conf/train/mini.yaml)

Data: the ``*.py`` files of the running Python's installed packages (site-packages), never the
standard library (the claude400 traces are built from it). 1% of files (by path hash) are held out.
A fraction ``session_frac`` of batches comes from agent sessions in the chat format built over
site-packages (``conf/traces/mini-train.yaml``), so the model knows the request format it serves.
Model: exactly the runtime's architecture (``conf/model/q1-mini.yaml``): RoPE, GQA with learned sinks,
three sliding-window layers to one full layer, top-8 of 32 SwiGLU experts, the MTP draft layer sharing
the LM head. RoPE and RMSNorm are the runtime's own functions, so export cannot drift from inference.
Loss: next-token + MTP at depths 1..3, where depth k runs the same draft layer on its own output of
depth k−1 (so later draft depths are trained for recursion) + a load-balancing term for the router.
Export: the runtime checkpoint format with E4M3 128×128 block-scaled experts (``runtime.checkpoint``).
Outputs (under ``out=``): the checkpoint, ``train_log.json`` (settings, revision, loss curve, data
stats), and, where matplotlib exists, ``loss.png``.

Runs on a GPU (bf16 autocast) within a wall-clock budget ``time_budget_s``; the learning-rate schedule
follows elapsed time so the run ends annealed whatever the throughput. On CPU it runs too (tiny
settings), which is how the tests check the export path end to end.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import site
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import checkpoint as ckpt  # noqa: E402
from runtime import fp8  # noqa: E402
from runtime.config import ModelConfig, load_model_config  # noqa: E402
from runtime.model import rms_norm, rope  # noqa: E402


# --------------------------------------------------------------------------------------------------
# Settings

def load_settings(argv: list[str]) -> dict:
    with open(ROOT / "conf" / "train" / "mini.yaml") as f:
        s = yaml.safe_load(f)
    for a in argv:
        if a in ("-h", "--help"):
            print(__doc__)
            print("settings (conf/train/mini.yaml):")
            for k, v in s.items():
                print(f"  {k}={v}")
            sys.exit(0)
        if "=" not in a:
            sys.exit(f"error: expected key=value, got {a!r}")
        k, v = a.split("=", 1)
        if k not in s:
            sys.exit(f"error: unknown setting {k!r}; known: {sorted(s)}")
        s[k] = yaml.safe_load(v)
    return s


# --------------------------------------------------------------------------------------------------
# Data

def python_files(max_bytes: int) -> list[Path]:
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = []
    for p in site.getsitepackages() + [site.getusersitepackages()]:
        p = Path(p)
        if p.is_dir() and p.resolve() != stdlib:
            roots.append(p)
    files, total = [], 0
    for r in roots:
        for f in sorted(r.rglob("*.py")):
            try:
                if stdlib in f.resolve().parents:
                    continue
                n = f.stat().st_size
            except OSError:
                continue
            if 200 <= n <= 400_000:
                files.append(f)
                total += n
    # deterministic subsample to the byte budget
    files.sort(key=lambda f: hashlib.sha256(str(f).encode()).hexdigest())
    out, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        out.append(f)
        total += f.stat().st_size
    return out


def build_data(s: dict, tokenizer_path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("<|eos|>")
    files = python_files(int(s["data_mb"] * 1e6))
    texts, held = [], []
    for f in files:
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        is_held = int(hashlib.sha256(str(f).encode()).hexdigest()[:4], 16) % 100 == 0
        (held if is_held else texts).append(t)
    t0 = time.time()
    enc = tok.encode_batch(texts)
    enc_h = tok.encode_batch(held)

    def stream(encs):
        arr = [np.array(e.ids + [eos], dtype=np.int16) for e in encs]
        return np.concatenate(arr) if arr else np.zeros(0, dtype=np.int16)

    train, val = stream(enc), stream(enc_h)
    stats = {"files": len(texts), "held_out_files": len(held), "train_tokens": int(train.size),
             "val_tokens": int(val.size), "tokenize_s": round(time.time() - t0, 1),
             "bytes": sum(len(t) for t in texts)}
    return train, val, stats


def session_stream(name: str) -> np.ndarray:
    """Agent sessions in the chat format (a trace corpus built over site-packages, never the stdlib):
    every whole session, assistant turns included and no trailing generation prompt (a stream that
    ended in ``<|assistant|><|eos|>`` would teach the model to stop at once), separated by <|eos|>."""
    from snapshots import chat
    from snapshots.traces import load_corpus
    corpus = load_corpus(name)
    parts = [np.array(chat.render(msgs, generation_prompt=False) + [2], dtype=np.int16)
             for _, msgs in sorted(corpus.sessions.items())]
    return np.concatenate(parts)


# --------------------------------------------------------------------------------------------------
# Model (training form of the runtime architecture)

class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        H, d, E, I = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.expert_width
        self.cfg, self.kind = cfg, kind
        self.ln1 = nn.Parameter(torch.ones(H))
        self.ln2 = nn.Parameter(torch.ones(H))
        self.q = nn.Linear(H, cfg.num_heads * d, bias=False)
        self.k = nn.Linear(H, cfg.num_kv_heads * d, bias=False)
        self.v = nn.Linear(H, cfg.num_kv_heads * d, bias=False)
        self.o = nn.Linear(cfg.num_heads * d, H, bias=False)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads))
        self.router = nn.Linear(H, E, bias=False)
        std_in, std_mid = H ** -0.5, I ** -0.5
        self.w_gate = nn.Parameter(torch.randn(E, I, H) * std_in)
        self.w_up = nn.Parameter(torch.randn(E, I, H) * std_in)
        self.w_down = nn.Parameter(torch.randn(E, H, I) * std_mid / math.sqrt(2 * cfg.num_layers))
        nn.init.normal_(self.o.weight, std=(cfg.num_heads * d) ** -0.5 / math.sqrt(2 * cfg.num_layers))

    def attention(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = rope(self.q(x).view(B, T, nh, d), pos, cfg.rope_theta).transpose(1, 2)     # [B, nh, T, d]
        k = rope(self.k(x).view(B, T, nkv, d), pos, cfg.rope_theta).transpose(1, 2)
        v = self.v(x).view(B, T, nkv, d).transpose(1, 2)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(d)                   # [B, nh, T, T]
        i = torch.arange(T, device=x.device)
        vis = i[None, :] <= i[:, None]
        if self.kind == "sliding":
            vis = vis & (i[None, :] > i[:, None] - cfg.sliding_window)
        s = s.masked_fill(~vis, float("-inf"))
        sink = self.sinks.float().view(1, nh, 1, 1).expand(B, nh, T, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]             # sink: zero value
        o = (p.to(v.dtype) @ v).transpose(1, 2).reshape(B, T, nh * d)
        return self.o(o)

    def moe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        B, T, H = x.shape
        E, I, k = cfg.num_experts, cfg.expert_width, cfg.num_experts_per_tok
        xf = x.reshape(-1, H)
        with torch.autocast(x.device.type, enabled=False):                            # FP32 routing, as the runtime
            logits = xf.to(torch.bfloat16).float() @ self.router.weight.float().T
        top, ids = logits.topk(k, dim=-1)
        w = torch.softmax(top, dim=-1)
        gate = torch.zeros_like(logits).scatter(1, ids, w.to(logits.dtype))              # [N, E]
        # every expert on every row, weighted by the routing (zero for unchosen): simple and fast
        # at this size; the runtime's reference does the same for small models
        w13 = torch.cat([self.w_gate, self.w_up], dim=1).reshape(E * 2 * I, H)
        h = (xf @ w13.to(xf.dtype).T).view(-1, E, 2 * I)
        act = F.silu(h[..., :I]) * h[..., I:] * gate.to(h.dtype)[..., None]
        y = act.reshape(-1, E * I) @ self.w_down.permute(0, 2, 1).reshape(E * I, H).to(act.dtype)
        # load balance (Switch-style): fraction routed × mean router probability, per expert
        frac = torch.zeros(E, device=x.device).scatter_add(0, ids.flatten(), torch.ones(ids.numel(), device=x.device))
        frac = frac / ids.numel()
        aux = E * (frac * torch.softmax(logits, dim=-1).mean(0)).sum()
        return y.view(B, T, H), aux

    def forward(self, x, pos):
        eps = self.cfg.rms_norm_eps
        x = x + self.attention(rms_norm(x, self.ln1, eps), pos)
        y, aux = self.moe(rms_norm(x, self.ln2, eps))
        return x + y, aux


class MiniLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, H)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.layers = nn.ModuleList(Block(cfg, cfg.layer_type(i)) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=H ** -0.5)
        self.enorm = nn.Parameter(torch.ones(H))
        self.hnorm = nn.Parameter(torch.ones(H))
        self.eh = nn.Linear(2 * H, H, bias=False)
        self.mtp = Block(cfg, cfg.mtp_attention)
        self.head_norm = nn.Parameter(torch.ones(H))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x, aux = self.embed(tokens), 0.0
        for layer in self.layers:
            x, a = layer(x, pos)
            aux = aux + a
        return x, aux

    def logits(self, h, norm=None):
        return self.lm_head(rms_norm(h, self.norm if norm is None else norm, self.cfg.rms_norm_eps))

    def mtp_forward(self, h_prev: torch.Tensor, tokens: torch.Tensor, offset: int):
        eps = self.cfg.rms_norm_eps
        pos = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
        x = self.eh(torch.cat([rms_norm(self.embed(tokens), self.enorm, eps), rms_norm(h_prev, self.hnorm, eps)], -1))
        return self.mtp(x, pos)


def losses(model: MiniLM, batch: torch.Tensor, depths: int, T: int) -> dict[str, torch.Tensor]:
    """batch [B, T + depths + 1]; main loss on positions 1..T; depth k predicts t + k + 1."""
    x = batch[:, :T]
    h, aux = model(x)
    out = {"main": F.cross_entropy(model.logits(h).flatten(0, 1).float(), batch[:, 1:T + 1].flatten().long()),
           "aux": aux}
    g = h
    for k in range(1, depths + 1):
        # row t of depth k: hidden that predicted token t+k, token t+k → predicts t+k+1
        g, a = model.mtp_forward(g, batch[:, k:T + k], offset=k)
        out["aux"] = out["aux"] + a
        out[f"mtp{k}"] = F.cross_entropy(model.logits(g, model.head_norm).flatten(0, 1).float(),
                                         batch[:, k + 1:T + k + 1].flatten().long())
    return out


# --------------------------------------------------------------------------------------------------
# Export to the runtime format

def export_tensors(model: MiniLM) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    bf = torch.bfloat16
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed.weight.detach().to(bf),
        "model.norm.weight": model.norm.detach().to(bf),
        "lm_head.weight": model.lm_head.weight.detach().to(bf),
    }

    def block(i: int, b: Block):
        p = ckpt.layer_prefix(i)
        t[p + "input_layernorm.weight"] = b.ln1.detach().to(bf)
        t[p + "post_attention_layernorm.weight"] = b.ln2.detach().to(bf)
        for n, lin in (("q_proj", b.q), ("k_proj", b.k), ("v_proj", b.v), ("o_proj", b.o)):
            t[p + f"self_attn.{n}.weight"] = lin.weight.detach().to(bf)
        t[p + "self_attn.sinks"] = b.sinks.detach().to(bf)
        t[p + "mlp.gate.weight"] = b.router.weight.detach().to(bf)
        for name, w in (("gate_proj", b.w_gate), ("up_proj", b.w_up), ("down_proj", b.w_down)):
            q, sc = fp8.quantize(w.detach().float(), cfg.fp8_block)
            for e in range(cfg.num_experts):
                n = ckpt.expert_names(cfg, i, e)[name]
                t[n] = q[e].contiguous()
                t[n + "_scale_inv"] = sc[e].contiguous()

    for i, b in enumerate(model.layers):
        block(i, b)
    m = cfg.num_layers
    block(m, model.mtp)
    p = ckpt.layer_prefix(m)
    t[p + "enorm.weight"] = model.enorm.detach().to(bf)
    t[p + "hnorm.weight"] = model.hnorm.detach().to(bf)
    t[p + "eh_proj.weight"] = model.eh.weight.detach().to(bf)
    t[p + "shared_head.norm.weight"] = model.head_norm.detach().to(bf)
    return {k: v.cpu() for k, v in t.items()}


def git_revision() -> str:
    """HEAD (+ -dirty); on machines that get a copy of the tree without .git, $IQUESTRT_REVISION."""
    if os.environ.get("IQUESTRT_REVISION"):
        return os.environ["IQUESTRT_REVISION"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "runtime", "experiments", "conf"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "") if sha else "unknown"
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    s = load_settings(argv)
    torch.manual_seed(s["seed"])
    dev = torch.device(s["device"] if s["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = load_model_config(s["model"])
    out = Path(s["out"])
    out.mkdir(parents=True, exist_ok=True)
    log = {"settings": s, "revision": git_revision(), "device": str(dev), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "curve": []}
    t_start = time.time()
    train, val, dstats = build_data(s, ROOT / "runtime" / "assets" / "tokenizer.json")
    log["data"] = dstats
    print(f"data: {dstats}", flush=True)
    if s["sessions"]:
        sess = session_stream(s["sessions"])
        log["data"]["session_tokens"] = int(sess.size)
        print(f"agent sessions '{s['sessions']}': {sess.size} tokens", flush=True)
        sess_t = torch.from_numpy(sess.astype(np.int64)).to(dev)
    train_t = torch.from_numpy(train.astype(np.int64)).to(dev)
    val_t = torch.from_numpy(val.astype(np.int64)).to(dev)
    model = MiniLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s["lr"], betas=(0.9, 0.95),
                            fused=dev.type == "cuda")
    B, T, D = s["batch"], s["seq_len"], s["mtp_depths"]
    gen = torch.Generator(device="cpu").manual_seed(s["seed"])
    amp = torch.autocast(dev.type, dtype=torch.bfloat16,
                         enabled=dev.type == "cuda" if s["amp"] == "auto" else bool(s["amp"]))
    w_mtp = [float(x) for x in s["mtp_weights"]][:D]

    def sample(data):
        idx = torch.randint(0, data.numel() - (T + D + 2), (B,), generator=gen)
        return torch.stack([data[i:i + T + D + 1] for i in idx.tolist()])

    budget = s["time_budget_s"]
    t_train = time.time()
    step = 0
    while True:
        frac = (time.time() - t_train) / budget
        if frac >= 1.0 or (s["max_steps"] and step >= s["max_steps"]):
            break
        lr = s["lr"] * min(1.0, (step + 1) / s["warmup_steps"]) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample(sess_t) if s["sessions"] and torch.rand((), generator=gen) < s["session_frac"] else sample(train_t)
        with amp:
            ls = losses(model, batch, D, T)
            loss = ls["main"] + sum(w * ls[f"mtp{k + 1}"] for k, w in enumerate(w_mtp)) + s["aux_weight"] * ls["aux"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
        opt.step()
        step += 1
        if step % s["log_every"] == 0 or step == 1:
            row = {"step": step, "t": round(time.time() - t_train, 1), "lr": lr,
                   **{k: round(float(v), 4) for k, v in ls.items()}}
            row["tokens_per_s"] = round(step * B * T / max(1e-9, time.time() - t_train))
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
    # held-out loss
    model.eval()
    with torch.no_grad(), amp:
        vals = [losses(model, sample(val_t), D, T) for _ in range(s["val_batches"])] if val_t.numel() > T + D + 2 else []
    log["val"] = {k: round(float(np.mean([float(v[k]) for v in vals])), 4) for k in (vals[0] if vals else {})}
    log["steps"] = step
    log["train_s"] = round(time.time() - t_train, 1)
    print(f"held-out: {log['val']}  steps {step}", flush=True)
    tensors = export_tensors(model)
    ck_dir = out / "q1-mini"
    h = ckpt.save_checkpoint(ck_dir, cfg, tensors, shard_bytes=int(s["shard_mb"] * (1 << 20)),
                             extra={"training": {"revision": log["revision"], "steps": step,
                                                 "val": log["val"], "data": dstats}})
    size = sum(f.stat().st_size for f in ck_dir.iterdir())
    log["checkpoint"] = {"content_hash": h, "bytes": size}
    log["total_s"] = round(time.time() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"checkpoint {ck_dir} {size / 2**20:.2f} MiB hash {h[:16]}", flush=True)
    try:
        plot_curve(log, out / "loss.png")
    except ImportError:
        pass
    return 0


def plot_curve(log: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = log["curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in ["main"] + [k for k in c[0] if k.startswith("mtp")]:
        ax.plot([r["step"] for r in c], [r[k] for r in c], label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(f"q1-mini training ({log['revision'][:10]}, {log.get('gpu') or log['device']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
