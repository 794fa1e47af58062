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


def _overflowing_add_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y):
        tl.store(Y, tl.load(X) + 2147483647)   # int32: 1 + (2^31 - 1) wraps

    return kernel


@pytest.mark.parametrize("debug", [False, True], ids=["debug_off", "debug_on"])
def test_the_overflow_sanitizer_is_off_only_where_its_check_is_dropped(debug):
    """Triton's own options: with ``debug`` off the sanitizer's comparison never reaches an assert (an
    int32 add that wraps runs and stores the wrapped value), so the shim turns it off; the same launch
    stores the same value. With ``debug`` on (the negative control) the check is live: the launch fails,
    and the shim keeps the sanitizer, so it still fails."""
    import dataclasses

    import torch
    from triton.runtime import interpreter as I

    orig = I._iqrt_orig_options
    assert orig.sanitize_overflow and not orig.debug   # Triton's defaults, as the shim's reasoning needs
    theirs = dataclasses.replace(orig, debug=debug)
    ours = _interp.speed_options(theirs)
    assert ours.sanitize_overflow is debug
    kernel = _overflowing_add_kernel()
    x = torch.ones(1, dtype=torch.int32)
    got = {}
    try:
        for name, opts in (("theirs", theirs), ("ours", ours)):
            I.interpreter_builder.options = opts
            y = torch.zeros(1, dtype=torch.int32)
            if debug:
                with pytest.raises(Exception, match="int32 overflow detected"):
                    kernel[(1,)](x, y)
            else:
                kernel[(1,)](x, y)
                got[name] = y.item()
    finally:
        I.interpreter_builder.options = _interp.speed_options(orig)
    assert debug or got == {"theirs": -2**31, "ours": -2**31}
    assert I.interpreter_builder.options.sanitize_overflow is False   # the suite's setting, restored
