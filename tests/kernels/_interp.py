"""Compatibility shims for the Triton CPU interpreter (TRITON_INTERPRET=1), test-only.

Triton 3.6's interpreter has two gaps that the compiled GPU path does not have:

* ``tl.dot`` on BF16 operands multiplies the raw uint16 storage (BF16 is stored as uint16 in the
  interpreter): we upcast BF16 operands to FP32 first (exact), which is what the tensor cores do.
* ``range(a, b)`` with bounds loaded from memory calls ``int()`` on a size-1 array, which NumPy >= 2
  refuses: we take the single element instead.
* ``libdevice.cos`` / ``sin`` / ``log`` (the CUDA math library's functions, which the RoPE and draft
  kernels call to match torch's results bit for bit) are stubs that return None: we route them to the
  interpreter's ``tl.cos`` / ``tl.sin`` / ``tl.log`` (NumPy's, within an ulp of torch's on the CPU).

Three more shims only save time (the interpreter's own work, same results):

* every call of a jitted helper re-patches ``triton.language`` through ``_patch_builtin``, which
  scans the package with ``inspect.getmembers`` (about a fifth of an interpreted step): the names of
  its builtins are kept per package after the first scan (a name counts if it holds a builtin or the
  interpreter's wrapper of one, so the scan finds the same names patched or not), and later calls
  look only at those names, patching the ones still builtin as before;
* ``_get_np_dtype`` built its type table on every call: built once;
* the integer overflow sanitizer (``InterpreterOptions.sanitize_overflow``, on by default) casts the
  operands of every 32-bit integer add, subtract and multiply to 64 bits, recomputes the result and
  compares it with the type's bounds, then hands the comparison to ``device_assert``, which drops it
  unless ``debug`` is on (off by default, and nothing here turns it on). So it checks nothing and cost
  about a third of an interpreted MoE launch: switched off while ``debug`` is off, kept when it is on.

``check_speed_shims()`` compares the first two against the originals (the tests call it, with a broken
variant as negative control).

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

    _install_speed_shims(I)

    from triton.language.extra import libdevice
    libdevice.cos = lambda x, **_: tl.cos(x)
    libdevice.sin = lambda x, **_: tl.sin(x)
    libdevice.log = lambda x, **_: tl.log(x)
    I._iqrt_shims_installed = True


def _builtin_names(pkg) -> list[str]:
    import inspect

    import triton.language as tl

    def builtin_or_patched(member):   # _patch_attr's wrapper keeps the builtin as its keyword default
        return tl.core.is_builtin(member) or tl.core.is_builtin((getattr(member, "__kwdefaults__", None) or {})
                                                                .get("member"))

    return [name for name, member in inspect.getmembers(pkg) if builtin_or_patched(member)]


def _install_speed_shims(I) -> None:
    """Replace ``I._patch_builtin`` and ``I._get_np_dtype`` by equivalents that do not redo work per
    call (module doc). The originals stay reachable as ``I._iqrt_orig_patch_builtin`` /
    ``I._iqrt_orig_get_np_dtype``."""
    import triton.language as tl

    orig_patch_builtin, orig_np_dtype = I._patch_builtin, I._get_np_dtype
    names: dict = {}   # id(pkg) -> (pkg, names of its builtins at the first scan)

    def patch_builtin(pkg, builder, scope):
        entry = names.get(id(pkg))
        if entry is None or entry[0] is not pkg:
            entry = names[id(pkg)] = (pkg, _builtin_names(pkg))
        for name in entry[1]:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                I._patch_attr(pkg, name, member, builder, scope)

    table: dict = {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            key = "pointer"
        got = table.get(key)
        if got is None:
            got = table[key] = orig_np_dtype(tt_dtype)
        return got

    I._iqrt_orig_patch_builtin, I._iqrt_orig_get_np_dtype = orig_patch_builtin, orig_np_dtype
    I._patch_builtin, I._get_np_dtype = patch_builtin, get_np_dtype
    I._iqrt_orig_options = I.interpreter_builder.options
    I.interpreter_builder.options = speed_options(I.interpreter_builder.options)


def speed_options(options):
    """The interpreter's options without the overflow sanitizer where ``device_assert`` would drop its
    check (``debug`` off); unchanged where the check is live (module doc)."""
    import dataclasses

    if options.debug or not options.sanitize_overflow:
        return options
    return dataclasses.replace(options, sanitize_overflow=False)


def check_speed_shims(I=None) -> dict:
    """What the speed shims must keep: the same attributes patched as the original ``_patch_builtin``
    (in an unpatched package and in one already patched, as a helper call finds it), and the same
    NumPy type for every Triton type. Returns {"patched": [names], "dtypes": n}; raises AssertionError
    on a difference."""
    import triton.language as tl

    if I is None:
        from triton.runtime import interpreter as I

    def patched_by(fn, pkg):
        scope = I._LangPatchScope()
        fn(pkg, I.interpreter_builder, scope)
        try:
            return sorted(name for _, name, _ in scope._changes)
        finally:
            scope.restore()

    out = {}
    for pkg in (tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        want, got = patched_by(I._iqrt_orig_patch_builtin, pkg), patched_by(I._patch_builtin, pkg)
        assert want == got and want, (pkg, sorted(set(want) ^ set(got)))
        outer = I._LangPatchScope()   # as a helper's call finds the package: already patched
        I._iqrt_orig_patch_builtin(pkg, I.interpreter_builder, outer)
        try:
            assert patched_by(I._iqrt_orig_patch_builtin, pkg) == patched_by(I._patch_builtin, pkg) == []
            # a first scan taken in that state still finds every builtin
            assert sorted(_builtin_names(pkg)) == want, pkg
        finally:
            outer.restore()
        out.setdefault("patched", []).extend(got)
    types = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
             tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e4nv, tl.float8e4b15]
    types += [tl.pointer_type(t) for t in types[:4]] + [tl.block_type(t, [4]) for t in types]
    types += [tl.block_type(tl.pointer_type(tl.float32), [4])]
    for t in types:
        assert I._get_np_dtype(t) == I._iqrt_orig_get_np_dtype(t), t
    out["dtypes"] = len(types)
    return out
