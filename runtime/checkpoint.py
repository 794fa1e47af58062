"""Checkpoint format: safetensors shards + ``config.json``, HF/DeepSeek-style tensor names.

Expert weights are E4M3 with 128x128 block scales (``...weight`` + ``...weight_scale_inv``); everything
else is BF16. A checkpoint holds either the whole model (``tp.size == 1``) or exactly one tensor-parallel
rank's shard; the loader slices a whole checkpoint for a rank, and refuses a shard of another rank.

The random generator derives every element from a hash of (seed, tensor key, global element index),
so one rank's shard is generated directly, identical to the same slice of the whole model: the full
``q1`` never has to exist anywhere.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from . import fp8, rng
from .config import ModelConfig, Shard, TPConfig, make_shard, model_config_from_dict

FORMAT_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, or does not match the model config."""


@dataclass(frozen=True)
class TensorSpec:
    """Global shape, the dimension split across TP ranks (None: replicated) and the stored dtype."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None
    dtype: torch.dtype
    init: str  # linear | norm | sink | router | embed

    def local_shape(self, shard: Shard) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.shape
        s = list(self.shape)
        s[self.split_dim] //= shard.tp_size
        return tuple(s)

    def local_range(self, shard: Shard) -> tuple[int, int] | None:
        if self.split_dim is None:
            return None
        n = self.shape[self.split_dim] // shard.tp_size
        return shard.rank * n, (shard.rank + 1) * n


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _block_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    p, H, d = layer_prefix(i), cfg.hidden_size, cfg.head_dim
    bf = torch.bfloat16
    specs = [
        TensorSpec(p + "input_layernorm.weight", (H,), None, bf, "norm"),
        TensorSpec(p + "self_attn.q_proj.weight", (cfg.num_heads * d, H), 0, bf, "linear"),
        TensorSpec(p + "self_attn.k_proj.weight", (cfg.num_kv_heads * d, H), 0, bf, "linear"),
        TensorSpec(p + "self_attn.v_proj.weight", (cfg.num_kv_heads * d, H), 0, bf, "linear"),
        TensorSpec(p + "self_attn.o_proj.weight", (H, cfg.num_heads * d), 1, bf, "linear"),
        TensorSpec(p + "self_attn.sinks", (cfg.num_heads,), 0, bf, "sink"),
        TensorSpec(p + "post_attention_layernorm.weight", (H,), None, bf, "norm"),
        TensorSpec(p + "mlp.gate.weight", (cfg.num_experts, H), None, bf, "router"),
    ]
    return specs


def expert_names(cfg: ModelConfig, i: int, e: int) -> dict[str, str]:
    p = f"{layer_prefix(i)}mlp.experts.{e}."
    return {k: p + f"{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")}


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every non-expert tensor of the model (expert tensors are described by :func:`expert_specs`)."""
    H, bf = cfg.hidden_size, torch.bfloat16
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, H), 0, bf, "embed"),
             TensorSpec("model.norm.weight", (H,), None, bf, "norm"),
             TensorSpec("lm_head.weight", (cfg.vocab_size, H), 0, bf, "linear")]
    for i in range(cfg.num_layers + cfg.mtp_layers):
        specs += _block_specs(cfg, i)
    for j in range(cfg.mtp_layers):
        p = layer_prefix(cfg.num_layers + j)
        specs += [TensorSpec(p + "enorm.weight", (H,), None, bf, "norm"),
                  TensorSpec(p + "hnorm.weight", (H,), None, bf, "norm"),
                  TensorSpec(p + "eh_proj.weight", (H, 2 * H), None, bf, "linear"),
                  TensorSpec(p + "shared_head.norm.weight", (H,), None, bf, "norm")]
    return specs


def expert_local_shapes(cfg: ModelConfig, shard: Shard) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per projection: (weight shape, scale shape) of one expert in one rank's shard."""
    H, I, b = cfg.hidden_size, shard.expert_width, cfg.fp8_block
    out = {}
    for k, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        out[k] = (shape, fp8.scale_shape(shape, b))
    return out


def check_shardable(cfg: ModelConfig, shard: Shard) -> None:
    if shard.expert_width % cfg.fp8_block:
        raise CheckpointError(
            f"expert width per rank ({shard.expert_width}) must be a multiple of the FP8 block "
            f"({cfg.fp8_block}) so that block scales shard with the weights")


# --------------------------------------------------------------------------------------------------
# Random generation (one rank's shard directly)

def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _hashed_uniform(seed: int, key: str, full_shape: tuple[int, ...], split_dim: int | None,
                    rng_range: tuple[int, int] | None, device) -> torch.Tensor:
    """Uniform(-1, 1) for the slice [rng_range) along split_dim of a tensor of full_shape."""
    idx = [torch.arange(n, device=device, dtype=torch.int64) for n in full_shape]
    if split_dim is not None and rng_range is not None:
        idx[split_dim] = idx[split_dim][rng_range[0]:rng_range[1]]
    flat = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in range(len(full_shape) - 1, -1, -1):
        view = [1] * len(full_shape)
        view[dim] = -1
        flat = flat + idx[dim].view(view) * stride
        stride *= full_shape[dim]
    u = rng.uniform(seed ^ _name_key(key), flat, rng.WEIGHTS)
    return u * 2.0 - 1.0


def _init(spec_init: str, u: torch.Tensor, fan_in: int) -> torch.Tensor:
    if spec_init == "norm":
        return 1.0 + 0.1 * u
    if spec_init == "sink":
        return u
    if spec_init == "embed":
        return u * math.sqrt(3.0)
    return u * math.sqrt(3.0 / fan_in)


def random_tensors(cfg: ModelConfig, tp: TPConfig = TPConfig(), seed: int = 0,
                   device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for one rank's shard of a seeded random checkpoint, in a fixed order."""
    shard = make_shard(cfg, tp)
    check_shardable(cfg, shard)
    for s in tensor_specs(cfg):
        u = _hashed_uniform(seed, s.name, s.shape, s.split_dim, s.local_range(shard), device)
        fan_in = s.shape[-1]
        yield s.name, _init(s.init, u, fan_in).to(s.dtype)
    H, I = cfg.hidden_size, cfg.expert_width
    for i in range(cfg.num_layers + cfg.mtp_layers):
        # Generated per layer for all experts at once (fast on GPU), then split by expert.
        lo, hi = shard.rank * shard.expert_width, (shard.rank + 1) * shard.expert_width
        parts = {}
        for k, full, dim, fan in (("gate_proj", (cfg.num_experts, I, H), 1, H),
                                  ("up_proj", (cfg.num_experts, I, H), 1, H),
                                  ("down_proj", (cfg.num_experts, H, I), 2, I)):
            u = _hashed_uniform(seed, f"{layer_prefix(i)}experts.{k}", full, dim, (lo, hi), device)
            parts[k] = fp8.quantize(_init("linear", u, fan), cfg.fp8_block)
        for e in range(cfg.num_experts):
            for k, name in expert_names(cfg, i, e).items():
                q, sc = parts[k]
                yield name, q[e]
                yield name + "_scale_inv", sc[e]


# --------------------------------------------------------------------------------------------------
# Saving, hashing, loading

def _tensor_digest(h: "hashlib._Hash", name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _tensor_hex(name: str, t: torch.Tensor) -> str:
    sub = hashlib.sha256()
    _tensor_digest(sub, name, t)
    return sub.hexdigest()


def _combine(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]}\n".encode())
    return h.hexdigest()


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over per-tensor digests of (name, dtype, shape, bytes) in name order: independent of how
    the tensors are split into files, and equal to the hash :func:`save_checkpoint` records."""
    return _combine({n: _tensor_hex(n, t) for n, t in tensors.items()})


def save_checkpoint(path: str | Path, cfg: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]] | dict,
                    tp: TPConfig = TPConfig(), shard_bytes: int = SHARD_BYTES, extra: dict | None = None) -> str:
    """Write safetensors shards + index + config.json atomically (a temp dir renamed into place).
    Returns the content hash."""
    from safetensors.torch import save_file

    path = Path(path)
    items = tensors.items() if isinstance(tensors, dict) else tensors
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    weight_map, files, cur, cur_bytes = {}, [], {}, 0
    digests = {}

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(cur, str(tmp / fname), metadata={"format": "pt"})
            files.append(fname)
            for n in cur:
                weight_map[n] = fname
            cur, cur_bytes = {}, 0

    for name, t in items:
        t = t.detach().contiguous().cpu()
        digests[name] = _tensor_hex(name, t)
        cur[name] = t
        cur_bytes += t.numel() * t.element_size()
        if cur_bytes >= shard_bytes:
            flush()
    flush()
    chash = _combine(digests)
    shard = make_shard(cfg, tp)
    with open(tmp / INDEX_NAME, "w") as f:
        json.dump({"metadata": {"content_hash": chash, "format_version": FORMAT_VERSION},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    with open(tmp / "config.json", "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "model": cfg.to_dict(),
                   "tp": {"size": tp.size, "rank": shard.rank}, "content_hash": chash, **(extra or {})},
                  f, indent=1)
    os.chmod(tmp, 0o755)   # mkdtemp makes 0700; a checkpoint is shared data
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if path.exists():
        old = path.with_name(path.name + ".old")
        os.replace(path, old)
        os.replace(tmp, path)
        import shutil
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return chash


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: config.json missing")
    try:
        with open(cfg_file) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_file}: format_version {meta.get('format_version')!r}, "
                              f"this runtime reads {FORMAT_VERSION}")
    return meta


def checkpoint_hash(path: str | Path) -> str:
    """The content hash recorded at save time (verify with ``load_checkpoint(..., verify_hash=True)``)."""
    return read_config(path)["content_hash"]


def _expected(cfg: ModelConfig, shard: Shard) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    exp = {s.name: (s.local_shape(shard), s.dtype) for s in tensor_specs(cfg)}
    shapes = expert_local_shapes(cfg, shard)
    for i in range(cfg.num_layers + cfg.mtp_layers):
        for e in range(cfg.num_experts):
            for k, name in expert_names(cfg, i, e).items():
                w, sc = shapes[k]
                exp[name] = (w, fp8.E4M3)
                exp[name + "_scale_inv"] = (sc, torch.float32)
    return exp


def load_checkpoint(path: str | Path, cfg: ModelConfig, tp: TPConfig = TPConfig(), device="cpu",
                    verify_hash: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of one rank's shard, validated against ``cfg``. Every problem (missing, unexpected,
    misshapen, mistyped tensor; a model or rank mismatch) is listed in one CheckpointError."""
    from safetensors import safe_open

    path = Path(path)
    meta = read_config(path)
    stored = model_config_from_dict(meta["model"])
    if stored.to_dict() != cfg.to_dict():
        diff = {k: (v, cfg.to_dict()[k]) for k, v in stored.to_dict().items() if cfg.to_dict()[k] != v}
        raise CheckpointError(f"{path}: checkpoint is of model '{stored.name}', config asks for "
                              f"'{cfg.name}'; differing fields (stored, asked): {diff}")
    shard = make_shard(cfg, tp)
    ck_tp = meta.get("tp", {"size": 1, "rank": 0})
    whole = ck_tp["size"] == 1
    if not whole and (ck_tp["size"], ck_tp["rank"]) != (tp.size, shard.rank):
        raise CheckpointError(f"{path}: holds rank {ck_tp['rank']} of TP{ck_tp['size']}, "
                              f"asked for rank {shard.rank} of TP{tp.size}")
    index_file = path / INDEX_NAME
    if not index_file.is_file():
        raise CheckpointError(f"{path}: {INDEX_NAME} missing")
    with open(index_file) as f:
        weight_map = json.load(f)["weight_map"]
    stored_shard = make_shard(cfg, TPConfig(size=1)) if whole else shard
    expected = _expected(cfg, stored_shard)
    problems = []
    for name in sorted(set(expected) - set(weight_map)):
        problems.append(f"tensor {name}: missing")
    for name in sorted(set(weight_map) - set(expected)):
        problems.append(f"tensor {name}: unexpected (not part of model '{cfg.name}')")
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if name in expected:
            by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        fpath = path / fname
        if not fpath.is_file():
            problems.append(f"file {fname}: missing (holds {len(names)} tensors, e.g. {names[0]})")
            continue
        try:
            with safe_open(str(fpath), framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        problems.append(f"tensor {name}: listed in the index but absent from {fname}")
                        continue
                    t = f.get_tensor(name)
                    shape, dtype = expected[name]
                    if tuple(t.shape) != shape:
                        problems.append(f"tensor {name}: shape {tuple(t.shape)}, expected {shape}")
                    elif t.dtype != dtype:
                        problems.append(f"tensor {name}: dtype {t.dtype}, expected {dtype}")
                    else:
                        tensors[name] = t
        except Exception as e:  # a truncated or corrupt file
            problems.append(f"file {fname}: unreadable ({type(e).__name__}: {e})")
    if problems:
        head = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise CheckpointError(f"{path}: {len(problems)} problem(s) with checkpoint for '{cfg.name}':\n  {head}{more}")
    if verify_hash:
        got = content_hash(tensors)
        if got != meta["content_hash"]:
            raise CheckpointError(f"{path}: content hash {got[:16]}… differs from the recorded "
                                  f"{meta['content_hash'][:16]}… (the files were modified)")
    if whole and tp.size > 1:
        tensors = slice_for_rank(cfg, tensors, shard)
    return {k: v.to(device) for k, v in tensors.items()}


def slice_for_rank(cfg: ModelConfig, tensors: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """One rank's shard cut from a whole-model tensor dict."""
    out = {}
    specs = {s.name: s for s in tensor_specs(cfg)}
    for name, t in tensors.items():
        if name in specs:
            s = specs[name]
            r = s.local_range(shard)
            out[name] = t if r is None else t.narrow(s.split_dim, r[0], r[1] - r[0]).contiguous()
            continue
        # expert tensors: gate/up split along rows (dim 0), down along columns (dim 1); scales by blocks
        is_scale = name.endswith("_scale_inv")
        dim = 1 if ".down_proj." in name else 0
        n = shard.expert_width // (cfg.fp8_block if is_scale else 1)
        out[name] = t.narrow(dim, shard.rank * n, n).contiguous()
    return out
