"""Compatibility shims for the Triton CPU interpreter (TRITON_INTERPRET=1), test-only.

Triton 3.6's interpreter has two gaps that the compiled GPU path does not have:

* ``tl.dot`` on BF16 operands multiplies the raw uint16 storage (BF16 is stored as uint16 in the
  interpreter): we upcast BF16 operands to FP32 first (exact), which is what the tensor cores do.
* ``range(a, b)`` with bounds loaded from memory calls ``int()`` on a size-1 array, which NumPy >= 2
  refuses: we take the single element instead.
* ``libdevice.cos`` / ``sin`` / ``log`` (the CUDA math library's functions, which the RoPE and draft
  kernels call to match torch's results bit for bit) are stubs that return None: we route them to the
  interpreter's ``tl.cos`` / ``tl.sin`` / ``tl.log`` (NumPy's, within an ulp of torch's on the CPU).

Known and NOT shimmed: the interpreter's FP32 -> E4M3 conversion mis-rounds values whose rounding
carries into the next binade (e.g. 31.9 -> 16 instead of 32). The MoE kernels therefore encode E4M3
with integer arithmetic (``_e4m3_bits``) and never use that conversion.
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def install() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as I

    if getattr(I, "_iqrt_shims_installed", False):
        return
    orig_patch = I._patch_lang_tensor

    def patched(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    I._patch_lang_tensor = patched

    orig_dot = I.InterpreterBuilder.create_dot

    def _up(h):
        if h.dtype.scalar == tl.bfloat16:
            data = I._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return I.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, _up(a), _up(b), d, input_precision, max_num_imprecise_acc)

    I.InterpreterBuilder.create_dot = create_dot

    from triton.language.extra import libdevice
    libdevice.cos = lambda x, **_: tl.cos(x)
    libdevice.sin = lambda x, **_: tl.sin(x)
    libdevice.log = lambda x, **_: tl.log(x)
    I._iqrt_shims_installed = True
