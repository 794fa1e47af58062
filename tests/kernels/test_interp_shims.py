"""The interpreter's speed shims (``_interp._install_speed_shims``) against Triton's own functions:
the same attributes patched, the same NumPy types; a broken shim of each kind is caught. CPU only:
the shims exist where the kernels are interpreted."""
from __future__ import annotations

import pytest

from . import _interp

pytestmark = pytest.mark.skipif(not _interp.interpreting(), reason="the shims are installed only under the interpreter")


def test_speed_shims_match_the_originals():
    got = _interp.check_speed_shims()
    assert {"load", "store", "dot", "exp2"} <= set(got["patched"]) and got["dtypes"] > 30


def test_a_shim_that_forgets_a_builtin_is_caught():
    from triton.runtime import interpreter as I

    good = I._patch_builtin

    def forgets_store(pkg, builder, scope):
        good(pkg, builder, scope)
        for i, (obj, name, original) in enumerate(list(scope._changes)):
            if name == "store":   # undo that one patch, as a shim missing the name would
                setattr(obj, name, original)
                del scope._changes[i]
                break

    I._patch_builtin = forgets_store
    try:
        with pytest.raises(AssertionError):
            _interp.check_speed_shims()
    finally:
        I._patch_builtin = good


def test_a_shim_with_a_wrong_type_is_caught():
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as I

    good = I._get_np_dtype
    I._get_np_dtype = lambda t: np.dtype(np.float16) if t == tl.bfloat16 else good(t)
    try:
        with pytest.raises(AssertionError, match="bf16"):
            _interp.check_speed_shims()
    finally:
        I._get_np_dtype = good
