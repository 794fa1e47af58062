"""The training model (experiments/train_mini.py) and the runtime's reference compute the same
function, so an exported checkpoint means at inference what it meant in training."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import train_mini  # noqa: E402

from runtime import fp8  # noqa: E402
from runtime.config import runtime_config_from_dict  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from tests.conftest import tiny_cfg  # noqa: E402


def _representable(model):
    """Round every parameter to what the checkpoint stores (BF16 dense, E4M3 block experts)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("w_gate", "w_up", "w_down"):
                q, s = fp8.quantize(p.float(), model.cfg.fp8_block)
                p.copy_(fp8.dequantize(q, s, model.cfg.fp8_block))
            else:
                p.copy_(p.to(torch.bfloat16).float())


def _pair(break_rope=False):
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = train_mini.MiniLM(cfg)
    with torch.no_grad():
        for b in list(model.layers) + [model.mtp]:
            b.sinks.normal_()
    _representable(model)
    tensors = train_mini.export_tensors(model)
    if break_rope:  # negative control: a transposed Q projection breaks the exported function
        k = "model.layers.0.self_attn.q_proj.weight"
        tensors[k] = tensors[k].flip(0).contiguous()
    eng = Engine(cfg, runtime_config_from_dict({}), tensors)
    return cfg, model, eng


def _compare(cfg, model, eng):
    T = 80   # longer than the tiny window (32): sliding layers really slide
    toks = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h_train, _ = model(toks[:, :T])
        logits_train = model.logits(h_train)[0]
        g_train, _ = model.mtp_forward(h_train, toks[:, 1:T + 1], offset=1)
        mtp_train = model.logits(g_train, model.head_norm)[0]
        rnd = eng.new_round(T + 16)
        h_rt = eng.model.prefill(toks[0, :T], rnd.cache, chunk=32)
        logits_rt = eng.model.logits(h_rt)
        g_rt = eng.model.mtp_prefill(h_rt, toks[0, 1:T + 1], rnd.cache, start=1, chunk=32)
        mtp_rt = eng.model.mtp_logits(g_rt)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return rel(logits_rt, logits_train), rel(mtp_rt, mtp_train)


def test_training_model_matches_runtime_reference():
    main_err, mtp_err = _compare(*_pair())
    assert main_err < 1e-4 and mtp_err < 1e-4, (main_err, mtp_err)


def test_a_wrong_export_is_detected():
    main_err, _ = _compare(*_pair(break_rope=True))
    assert main_err > 1e-2
