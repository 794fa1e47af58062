"""The committed q1-mini checkpoint: small enough to travel, loads, generates, predicts code."""
import torch

from runtime import checkpoint as ckpt
from runtime.config import REPO_ROOT, load_model_config
from runtime.engine import Engine, default_checkpoint
from snapshots import chat
from snapshots.tokenizer import load_tokenizer


def test_asset_is_small_and_hash_verified():
    cfg = load_model_config("q1-mini")
    path = default_checkpoint(cfg)
    assert path == REPO_ROOT / "runtime" / "assets" / "q1-mini"
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 24 * 2**20, size
    tensors = ckpt.load_checkpoint(path, cfg, verify_hash=True)
    assert tensors["model.layers.0.mlp.experts.31.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_committed_checkpoint_generates_and_beats_chance():
    eng = Engine.build("q1-mini", {"draft": {"policy": "fixed", "fixed_depth": 5}})
    assert eng.checkpoint_hash == ckpt.checkpoint_hash(default_checkpoint(eng.cfg))
    tok = load_tokenizer()
    code = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()\n" * 3
    prompt = chat.render([{"role": "user", "content": "Read util.py"},
                          {"role": "tool_result", "content": code}])
    g = eng.generate(prompt, seed=0, max_new_tokens=24)
    assert 1 <= len(g.tokens) <= 24 and all(0 <= t < eng.cfg.vocab_size for t in g.tokens)
    # a trained model predicts repeated code far better than chance (ln 4096 = 8.3 nats)
    ids = torch.tensor(tok.encode(code).ids)
    with torch.no_grad():
        rnd = eng.new_round(len(ids) + 16)
        logits = eng.model.logits(eng.model.prefill(ids, rnd.cache))
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item()
    assert nll < 2.0, nll


def test_untrained_weights_fail_the_code_check():
    """Negative control: the same check on a random q1-mini checkpoint."""
    cfg = load_model_config("q1-mini")
    eng = Engine(cfg, Engine.build("q1-tiny").rt, dict(ckpt.random_tensors(cfg, seed=0)))
    ids = torch.tensor(load_tokenizer().encode("def f(x):\n    return x + 1\n" * 4).ids)
    with torch.no_grad():
        rnd = eng.new_round(len(ids) + 16)
        logits = eng.model.logits(eng.model.prefill(ids, rnd.cache))
    assert torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item() > 5.0
