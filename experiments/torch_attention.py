"""What a torch user would run for the runtime's full-cache attention call (bench_kernels' torch rows).

The runtime's split + combine against torch's own fused attentions, on the same inputs and shapes
(``q`` [w, nh, d] against the cache's ``k`` / ``v`` [nkv, capacity, d], rows at positions
``start .. start + w - 1``, each seeing every key up to its own position):

* ``sdpa_attention``: ``torch.nn.functional.scaled_dot_product_attention`` with the grouped query
  heads (``enable_gqa``) and the causal boundary at the last key (``causal_lower_right``), through one
  of its backends (flash, efficient, cuDNN; ``math`` is its unfused reference). SDPA has no sink
  input and the public call returns no log-sum-exp, so it computes the call **without the sink
  logit**: its time is the least a torch user pays for this call, not a like-for-like output.
* ``flex_attention_sink``: ``torch.nn.attention.flex_attention`` (compiled by Inductor into Triton
  kernels), the same causal boundary as a block mask, and the sink applied exactly from the
  log-sum-exp it returns: o = o_flex * sigmoid(lse - sink), i.e. sum_j e^{s_j} v_j / (sum_j e^{s_j} +
  e^{sink}). The G = nh / nkv query heads of a KV head are packed as G * w query rows of one head
  (``packed=True``, the default), the way a torch user gets flex's decoding kernel (which splits the
  keys across programs): with 6 heads per KV head and ``enable_gqa`` instead, flex ran its prefill
  kernel, one program per head streaming every key (session 36, H200: 4.0 ms at 64K keys against the
  runtime's 14.5 us; ``packed=False`` keeps that form).

``calls`` builds one zero-argument call per input set of ``bench_kernels.attention_sets`` for a CUDA
graph (the masks are built once, outside the calls). The CPU tests check both against
``attention.attention_reference``, each with a negative control.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
FUSED = ("flash", "efficient", "cudnn")


def _views(q, k, v, n_keys):
    """[1, nh, w, d] queries and [1, nkv, n_keys, d] keys / values (views of the valid extent)."""
    return (q.transpose(0, 1).unsqueeze(0), k[:, :n_keys].unsqueeze(0), v[:, :n_keys].unsqueeze(0))


def sdpa_attention(q, k, v, start: int, backend: str = "math", *, boundary_shift: int = 0):
    """[w, nh, d]: the call through SDPA's ``backend``, without the sink. ``boundary_shift`` moves the
    causal boundary by that many keys (negative control: each row then sees one key too few or many)."""
    w = q.shape[0]
    n_keys = start + w
    q4, k4, v4 = _views(q, k, v, n_keys + min(boundary_shift, 0))
    mask = causal_lower_right(w, k4.shape[2])
    with sdpa_kernel([BACKENDS[backend]]):
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=q4.shape[1] != k4.shape[1])
    return o[0].transpose(0, 1)


def causal_block_mask(w: int, n_keys: int, device, *, group: int = 1, boundary_shift: int = 0):
    """flex's block mask over ``group`` * w query rows (row r: live row r % w, at position
    n_keys - w + r % w), each seeing keys 0 .. its position (+ ``boundary_shift``)."""
    off = n_keys - w + boundary_shift

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx % w + off

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=group * w, KV_LEN=n_keys, device=device)


def flex_attention_sink(q, k, v, start: int, sinks, *, block_mask=None, fn=flex_attention,
                        apply_sink: bool = True, packed: bool = True):
    """[w, nh, d]: the call through flex_attention (``fn``: the compiled one on the GPU), the sink
    applied from its log-sum-exp (``apply_sink=False``: left out, the negative control). ``packed``: a
    KV head's G query heads as G * w rows of one head (block mask of ``causal_block_mask(w, n, group=G)``);
    otherwise ``enable_gqa`` over [1, nh, w, d] (block mask with group 1)."""
    w, nh, d = q.shape
    nkv = k.shape[0]
    n_keys = start + w
    g = nh // nkv if packed else 1
    q4, k4, v4 = _views(q, k, v, n_keys)
    if packed:      # [1, nh, w, d] -> [1, nkv, G * w, d]: row r of KV head j is head j * G + r // w, live row r % w
        q4 = q4.reshape(1, nkv, g * w, d)
    if block_mask is None:
        block_mask = causal_block_mask(w, n_keys, q.device, group=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # return_lse's deprecation in newer torch, the CPU's slow path
        o, lse = fn(q4, k4, v4, block_mask=block_mask, enable_gqa=q4.shape[1] != k4.shape[1], return_lse=True)
    o, lse = o.reshape(1, nh, w, d), lse.reshape(1, nh, w)
    if apply_sink:
        o = o * torch.sigmoid(lse.float() - sinks.float()[None, :, None])[..., None].to(o.dtype)
    return o[0].transpose(0, 1)


def sdpa_backends(q, k, v, start: int) -> list[str]:
    """The fused SDPA backends that run this shape on this machine (each tried once)."""
    ok = []
    for name in FUSED:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sdpa_attention(q, k, v, start, name)
            ok.append(name)
        except RuntimeError:
            pass
    return ok


_COMPILED: dict = {}


def compiled_flex():
    """flex_attention compiled once per process (what a torch user would run on the GPU)."""
    if "flex" not in _COMPILED:
        import torch._dynamo as dynamo
        for key in ("cache_size_limit", "recompile_limit"):   # one compile per shape: 12 shapes in the bench
            if hasattr(dynamo.config, key):
                setattr(dynamo.config, key, max(getattr(dynamo.config, key), 64))
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["flex"]


def calls(kind: str, data, n_keys: int, backend: str | None = None, fn=None, packed: bool = True):
    """One call per input set ``(q, k, v, sinks, start_pos, out)`` of ``bench_kernels.attention_sets``:
    ``kind`` "sdpa" (``backend``) or "flex" (``fn``, default the compiled flex_attention; ``packed`` as
    ``flex_attention_sink``'s)."""
    q0, k0 = data[0][:2]
    w = q0.shape[0]
    start = n_keys - w
    if kind == "sdpa":
        return [(lambda q=q, k=k, v=v: sdpa_attention(q, k, v, start, backend)) for q, k, v, *_ in data]
    fn = fn or compiled_flex()
    bm = causal_block_mask(w, n_keys, q0.device, group=q0.shape[1] // k0.shape[0] if packed else 1)
    return [(lambda q=q, k=k, v=v, s=s: flex_attention_sink(q, k, v, start, s, block_mask=bm, fn=fn, packed=packed))
            for q, k, v, s, *_ in data]
