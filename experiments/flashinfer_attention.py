"""What a vLLM / SGLang user would run for the runtime's full-cache attention call: FlashInfer.

The serving engines verify speculative drafts with FlashInfer's batch prefill ("append") attention over
a paged KV cache: the ``w`` live rows of one request as ``w`` query tokens, causal at the cache's end
(row i at position kv_len - w + i, the runtime's rows), the grouped query heads of a KV head packed
together, the keys split across programs when one request alone cannot fill the GPU, and a merge
launch after. This module runs that call on the runtime's own inputs (``bench_kernels.attention_sets``:
``q`` [w, nh, d], ``k`` / ``v`` [nkv, capacity, d], start_pos = n_keys - w) so that
``ab_attention.py`` can replay it beside the runtime's split + combine in paired rounds.

FlashInfer is not a dependency of this repository and nothing of it is committed. On the GPU machine
(no package index there) it travels as a wheel built here from its source distribution:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --no-binary=:all: -d /tmp/fi flashinfer-python==0.3.1
    python3 -m pip wheel --no-deps -w .whl /tmp/fi/flashinfer_python-0.3.1.tar.gz     # 5.7 MB, pure Python

and each device call carries ``.whl`` and starts with
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site``.
Its kernels are compiled on first use by nvcc on the GPU machine (FlashInfer's JIT; minutes, cached
under ~/.cache/flashinfer for the machine's life). 0.3.1 is the newest release whose wheel fits the
device tool's 64 MiB working tree (0.7.4's is 101 MB).

Config names (``PATTERN``): ``fi_{backend}_p{page}[_sink]``. ``backend``: the prefill wrapper with
FlashInfer's ``fa2`` (its portable kernels), ``fa3`` (its Hopper kernels) or ``auto`` (its own choice), or
``holistic``, its ``BatchAttention`` (one persistent launch scheduling the key chunks of every request,
then its merge); ``page``: tokens per KV
page, the cache viewed as contiguous pages ``[capacity / page, page, nkv, d]`` listed in order (no
gather cost beyond the page table's reads). Without ``_sink`` the call is FlashInfer's kernels alone,
without the sink logit (0.3.1's prefill kernels take no sink): the least a FlashInfer user pays, not a
like-for-like output. With ``_sink`` the sink is applied exactly from the log-sum-exp FlashInfer
returns (``apply_sink``): what the runtime computes, at the cost of two small torch launches.

``python3 experiments/flashinfer_attention.py`` (GPU) checks every config against
``attention.attention_reference`` at a few shapes, with a negative control (the log-sum-exp read in
the natural base instead of base 2), and prints the table; ``tests/test_flashinfer_attention.py`` runs
``apply_sink`` on the CPU.
"""
from __future__ import annotations

import math
import os
import re
import sys

import torch

PATTERN = re.compile(r"fi_(fa2|fa3|auto|holistic)_p(\d+)(_sink)?")
WORKSPACE_BYTES = 128 * 2**20   # FlashInfer's recommended float workspace (split-KV partials)


def available() -> str | None:
    """FlashInfer's version when it can be imported here, else None."""
    try:
        import flashinfer
    except Exception:   # noqa: BLE001  (not installed, or installed without what it imports)
        return None
    return getattr(flashinfer, "__version__", "?")


def apply_sink(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, *, lse_base2: bool = True) -> torch.Tensor:
    """o [w, nh, d] (softmax over the keys only) and its log-sum-exp ``lse`` [w, nh] -> the output with
    the sink logit in the denominator: sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}) =
    o * sigmoid(lse_e - sink_h). FlashInfer's lse is in base 2 (log2 sum 2^{s_j log2 e});
    ``lse_base2=False`` reads it as natural (the negative control of the checks)."""
    lse_e = lse.float() * (math.log(2.0) if lse_base2 else 1.0)
    return (o.float() * torch.sigmoid(lse_e - sinks.float()[None, :])[..., None]).to(o.dtype)


def parse(name: str) -> tuple[str, int, bool]:
    """Config name -> (backend, tokens per page, with the sink)."""
    m = PATTERN.fullmatch(name)
    if not m:
        raise ValueError(f"{name!r} is not a FlashInfer config (fi_{{fa2|fa3|auto|holistic}}_p{{page}}[_sink])")
    return m.group(1), int(m.group(2)), bool(m.group(3))


def planned(backend: str, page: int, w: int, nh: int, nkv: int, d: int, n_keys: int, device, sm_scale: float):
    """A ``BatchPrefillWithPagedKVCacheWrapper`` planned for one request of ``w`` query rows over
    ``n_keys`` keys in pages 0 .. ceil(n_keys / page) - 1, causal, BF16, with CUDA-graph buffers (so its
    ``run`` can be captured). The plan is the same for every input set of a shape."""
    import flashinfer
    npages = -(-n_keys // page)
    i32 = dict(dtype=torch.int32)
    host = dict(qo=torch.tensor([0, w], **i32), kv=torch.tensor([0, npages], **i32),
                idx=torch.arange(npages, **i32), last=torch.tensor([n_keys - (npages - 1) * page], **i32))
    bufs = {k: v.to(device) for k, v in host.items()}
    if backend == "holistic":   # BatchAttention: no graph buffers to give; its plan lives in its workspaces
        wr = flashinfer.BatchAttention("NHD", device=str(device))
        wr.plan(host["qo"], host["kv"], bufs["idx"], torch.tensor([n_keys], **i32), nh, nkv, d, d, page, causal=True,
                sm_scale=sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        return wr
    wr = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", use_cuda_graph=True,
        qo_indptr_buf=bufs["qo"], paged_kv_indptr_buf=bufs["kv"], paged_kv_indices_buf=bufs["idx"],
        paged_kv_last_page_len_buf=bufs["last"], backend=backend)
    wr.plan(host["qo"], host["kv"], host["idx"], host["last"], nh, nkv, d, page, causal=True, sm_scale=sm_scale,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wr


def paged(x: torch.Tensor, page: int) -> torch.Tensor:
    """The runtime's cache [nkv, capacity, d] as FlashInfer's NHD pages [capacity / page, page, nkv, d]
    (a view: one KV head only, where both layouts are the same bytes)."""
    nkv, cap, d = x.shape
    if nkv != 1:
        raise ValueError(f"the page view needs one KV head per cache (the q1 shard), got {nkv}")
    if cap % page:
        raise ValueError(f"capacity {cap} is not a multiple of the page size {page}")
    return x.view(cap // page, page, 1, d)


def call(wr, q, k, v, sinks, page: int, sink: bool, holistic: bool, *, lse_base2: bool = True):
    """One attention call through the planned wrapper (``holistic``: a ``BatchAttention``): [w, nh, d]."""
    kv = (paged(k, page), paged(v, page))
    if holistic:   # BatchAttention always returns (o, lse)
        o, lse = wr.run(q, kv)
    elif sink:
        o, lse = wr.run(q, kv, return_lse=True)
    else:
        return wr.run(q, kv)
    return apply_sink(o, lse, sinks, lse_base2=lse_base2) if sink else o


def calls(name: str, data, n_keys: int, *, lse_base2: bool = True):
    """One zero-argument call per input set ``(q, k, v, sinks, start_pos, out)`` of
    ``bench_kernels.attention_sets`` for config ``name``; None when FlashInfer cannot be imported."""
    if available() is None:
        return None
    backend, page, sink = parse(name)
    q0, k0 = data[0][:2]
    w, nh, d = q0.shape
    wr = planned(backend, page, w, nh, k0.shape[0], d, n_keys, q0.device, 1.0 / math.sqrt(d))
    holistic = backend == "holistic"
    return [(lambda q=q, k=k, v=v, s=s: call(wr, q, k, v, s, page, sink, holistic, lse_base2=lse_base2))
            for q, k, v, s, *_ in data]


def _rel_err(out, ref) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def check(names, contexts=(16384 + 64, 65536), widths=(4, 6, 8), bound=2e-2):
    """Every config against the FP32 reference (with the sink for ``_sink`` configs, without it
    otherwise) on the first input set of each shape: max |out - ref| / max |ref|. Negative control per
    shape: the first ``_sink`` config with the log-sum-exp read in the natural base must exceed
    ``bound``. Returns the rows; raises SystemExit when a config fails or the control passes."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import attention_sets
    from runtime.kernels import attention as A
    rows, bad = [], []
    for ctx in contexts:
        for w in widths:
            data = attention_sets(1, w, 6, 1, 128, ctx + 64, ctx - w, ctx)
            q, k, v, s = data[0][:4]
            refs = {flag: A.attention_reference(q, k, v, ctx - w, s if flag else None, dtype=torch.float32)
                    for flag in (False, True)}
            for name in names:
                sink = parse(name)[2]
                out = calls(name, data, ctx)[0]().float()
                err = _rel_err(out, refs[sink])
                rows.append(dict(config=name, ctx=ctx, w=w, err=err))
                if not err < bound:
                    bad.append(f"{name} at {ctx} keys, w = {w}: {err:.3g}")
            ctl = next((n for n in names if parse(n)[2]), None)
            if ctl:
                out = calls(ctl, data, ctx, lse_base2=False)[0]().float()
                err = _rel_err(out, refs[True])
                rows.append(dict(config=f"{ctl} (control: natural-base lse)", ctx=ctx, w=w, err=err))
                if err < bound:
                    bad.append(f"the control {ctl} with a natural-base lse passed at {ctx} keys, w = {w}: {err:.3g}")
    for r in rows:
        print(f"{r['config']:>40} {r['ctx']:>7} keys  w {r['w']}  max rel err {r['err']:.2e}", flush=True)
    if bad:
        raise SystemExit("FlashInfer check failed:\n  " + "\n  ".join(bad))
    return rows


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Check FlashInfer's attention configs against the runtime's reference (GPU).")
    ap.add_argument("--configs", default="fi_fa2_p16,fi_fa2_p16_sink,fi_fa3_p16,fi_auto_p16,fi_fa2_p1,fi_holistic_p16",
                    help="comma list of fi_{fa2|fa3|auto|holistic}_p{page}[_sink]; the first _sink config also runs "
                         "the negative control (its lse read in the natural base, which must fail the bound)")
    args = ap.parse_args()
    ver = available()
    if ver is None or not torch.cuda.is_available():
        raise SystemExit("needs FlashInfer (see the module's docstring) and a CUDA GPU")
    print(f"flashinfer {ver}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    check(args.configs.split(","))
