"""FP8 block quantisation, the checkpoint format, the loader's errors, random shards."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import fp8
from runtime.checkpoint import (CheckpointError, content_hash, load_checkpoint, random_tensors,
                                save_checkpoint, slice_for_rank)
from runtime.config import TPConfig
from tests.conftest import tiny_cfg


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130, 129)])
def test_fp8_block_roundtrip_within_bound(shape):
    g = torch.Generator().manual_seed(sum(shape))
    # blocks of very different magnitudes: a per-tensor scale would fail the bound
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[-1])[None]
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == fp8.scale_shape(w.shape, 128)
    err = (fp8.dequantize(q, s) - w).abs()
    assert (err <= fp8.roundtrip_bound(w)).all()
    # negative control: one scale for the whole tensor violates the per-element bound
    amax = w.abs().max() / fp8.E4M3_MAX
    coarse = (w / amax).to(torch.float8_e4m3fn).float() * amax
    assert not ((coarse - w).abs() <= fp8.roundtrip_bound(w)).all()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = tiny_cfg()
    path = tmp_path_factory.mktemp("ck") / "tiny"
    tensors = dict(random_tensors(cfg, seed=3))
    h = save_checkpoint(path, cfg, tensors, shard_bytes=1 << 20)
    return cfg, path, tensors, h


def test_save_load_roundtrip_and_hash(saved):
    cfg, path, tensors, h = saved
    assert len(list(path.glob("model-*.safetensors"))) > 1       # really sharded
    loaded = load_checkpoint(path, cfg, verify_hash=True)
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)
    assert content_hash(loaded) == h
    assert content_hash(dict(random_tensors(cfg, seed=4))) != h
    assert loaded["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert loaded["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def _copy(path, dst):
    import shutil
    shutil.copytree(path, dst)
    return dst


def _edit(ck, fn):
    """Apply fn to the tensor dict of the file holding the first expert tensor of layer 0."""
    idx = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    fname = idx["model.layers.0.mlp.experts.0.gate_proj.weight"]
    t = load_file(str(ck / fname))
    fn(t)
    save_file(t, str(ck / fname))


def test_loader_names_every_problem(saved, tmp_path):
    cfg, path, _, _ = saved
    ck = _copy(path, tmp_path / "bad")

    def damage(t):
        del t["model.layers.0.mlp.experts.0.gate_proj.weight"]
        t["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.float8_e4m3fn)
        t["model.layers.0.mlp.experts.0.down_proj.weight"] = t["model.layers.0.mlp.experts.0.down_proj.weight"].float()

    _edit(ck, damage)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck, cfg)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight: listed in the index but absent" in msg
    assert "model.layers.0.mlp.experts.0.up_proj.weight: shape (3, 3), expected (256, 128)" in msg
    assert "model.layers.0.mlp.experts.0.down_proj.weight: dtype torch.float32" in msg


def test_loader_refuses_other_model_and_tampering(saved, tmp_path):
    cfg, path, _, _ = saved
    with pytest.raises(CheckpointError, match="differing fields"):
        load_checkpoint(path, tiny_cfg(num_layers=2, layer_pattern=("sliding", "full")))
    ck = _copy(path, tmp_path / "tampered")
    _edit(ck, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.gate_proj.weight",
                                      torch.zeros_like(t["model.layers.0.mlp.experts.0.gate_proj.weight"])))
    load_checkpoint(ck, cfg)      # shapes and dtypes still valid…
    with pytest.raises(CheckpointError, match="content hash"):
        load_checkpoint(ck, cfg, verify_hash=True)   # …but the content is not what was saved
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", cfg)
    (ck / "model-00001.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(ck, cfg)


def test_rank_shard_generated_directly_equals_slice_of_whole():
    cfg = tiny_cfg()
    whole = dict(random_tensors(cfg, seed=5))
    for rank in (0, 1):
        tp = TPConfig(size=2, rank=rank)
        direct = dict(random_tensors(cfg, tp, seed=5))
        from runtime.config import make_shard
        cut = slice_for_rank(cfg, whole, make_shard(cfg, tp))
        assert set(direct) == set(cut)
        bad = [k for k in direct if not torch.equal(direct[k].view(torch.uint8), cut[k].view(torch.uint8))]
        assert not bad, bad[:3]
    assert dict(random_tensors(cfg, TPConfig(size=2, rank=1), seed=5))["lm_head.weight"].shape == (256, 128)


def test_q1_rank_emulation_shapes():
    """The full q1 rank-0 shard has one rank's shapes (checked on specs, not generated on CPU)."""
    from runtime.checkpoint import _expected
    from runtime.config import load_model_config, make_shard
    cfg = load_model_config("q1")
    sh = make_shard(cfg, TPConfig(size=8, emulate_rank=0))
    exp = _expected(cfg, sh)
    assert exp["model.layers.0.self_attn.q_proj.weight"][0] == (6 * 128, 6144)
    assert exp["model.layers.0.self_attn.k_proj.weight"][0] == (128, 6144)
    assert exp["lm_head.weight"][0] == (20000, 6144)
    assert exp["model.layers.0.mlp.experts.127.gate_proj.weight"][0] == (256, 6144)
    assert exp["model.layers.87.mlp.experts.0.down_proj.weight_scale_inv"][0] == (48, 2)
    nbytes = sum(torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for s, d in exp.values())
    assert 40e9 < nbytes < 100e9, nbytes    # fits one H200 (about 139 GiB)


def test_models_over_one_dict_hold_the_experts_once():
    """The first model built from a tensor dict stacks each layer's experts and points the dict's
    per-expert entries at views of the stack; a second model over the same dict (the replay's arms share
    one) takes those stacks as they are. Both equal a model built from a fresh copy of the dict. Negative
    control: entries that are views of another layout (experts permuted) are not taken for a stack."""
    from runtime.checkpoint import expert_names
    from runtime.config import make_shard
    from runtime.model import Model

    cfg = tiny_cfg()
    t = dict(random_tensors(cfg, seed=0))
    fresh = {k: v.clone() for k, v in t.items()}
    shard = make_shard(cfg, TPConfig())
    m1 = Model(cfg, t, shard, "float32", "cpu")
    n = expert_names(cfg, 0, 1)
    assert t[n["up_proj"]]._base is m1.layers[0].w13
    m2 = Model(cfg, t, shard, "float32", "cpu")
    ref = Model(cfg, fresh, shard, "float32", "cpu")
    layers = lambda m: m.layers + [x.layer for x in m.mtp]  # noqa: E731
    for a, b, r in zip(layers(m1), layers(m2), layers(ref)):
        for f in ("w13", "s13", "w2", "s2"):
            assert getattr(a, f).data_ptr() == getattr(b, f).data_ptr(), f
            assert torch.equal(getattr(a, f).float(), getattr(r, f).float()), f
    # views of a stack whose experts are in another order: same shapes, other addresses
    odd = {k: v.clone() for k, v in fresh.items()}
    E, names = cfg.num_experts, [expert_names(cfg, 0, e) for e in range(cfg.num_experts)]
    perm = list(range(E))[::-1]
    base = torch.stack([torch.cat([odd[names[p]["gate_proj"]], odd[names[p]["up_proj"]]]) for p in perm])
    rows = odd[names[0]["gate_proj"]].shape[0]
    for e in range(E):
        odd[names[perm[e]]["gate_proj"]], odd[names[perm[e]]["up_proj"]] = base[e, :rows], base[e, rows:]
    m3 = Model(cfg, odd, shard, "float32", "cpu")
    assert m3.layers[0].w13.data_ptr() != base.data_ptr()
    assert torch.equal(m3.layers[0].w13.float(), ref.layers[0].w13.float())


def test_grouped_moe_is_the_gathered_moe():
    """Without dense experts a prefill's many rows dequantise each chosen expert once (``_moe_grouped``)
    instead of once per (row, expert) pair (``_moe_gathered``, a decode's path): the same values up to
    the order of additions (FP32 here). Negative control: the routing weights of each row's slots
    swapped must not pass."""
    from runtime.config import make_shard
    from runtime.model import GATHER_MOE_MAX_PAIRS, Model

    cfg = tiny_cfg()
    m = Model(cfg, dict(random_tensors(cfg, seed=1)), make_shard(cfg, TPConfig()), "float32", "cpu",
              dense_moe=False)
    lw = m.layers[0]
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    ids, w = m.route(lw, x)
    assert ids.numel() > GATHER_MOE_MAX_PAIRS
    ref = m._moe_gathered(lw, x, ids, w)
    got = m.moe(lw, x)
    assert torch.equal(got, m._moe_grouped(lw, x, ids, w))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(m._moe_grouped(lw, x, ids, w.flip(1)), ref, rtol=1e-3, atol=1e-4)
    few = x[:GATHER_MOE_MAX_PAIRS // cfg.num_experts_per_tok]          # a decode's rows: gathered
    assert torch.equal(m.moe(lw, few), m._moe_gathered(lw, few, *m.route(lw, few)))
