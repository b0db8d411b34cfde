"""Faster custom-combine reductions and scans for Triton's CPU interpreter (tests only; kernels are not changed).

The interpreter runs ``tl.reduce`` / ``tl.associative_scan`` with a user combine function (the scan kernels'
``_combine``, the forward's ``_later``) one element at a time in Python: about 70% of a backward test's time went into
the forward's segment reductions and scans. For an elementwise combine function (arithmetic and ``tl.where`` only, as
all of ours are; Python control flow on the values would see a whole slice) applying it to whole slices along the
reduced axis does the same floating-point operations in the same order as the interpreter's own loop (the first
element, then each later one combined into the running value, cast back to the inputs' dtypes after every step), so
the results are bitwise the interpreter's. ``test_vectorized_interpreter_reduce_and_scan_are_bitwise_the_originals``
(``tests/unit/test_selective_scan.py``) checks that on the Triton the suite runs with.
The scan kernels' own combine functions (``_combine``, ``_later``) run as the same numpy operations on the slices,
without the interpreter's per-operation type checks (the same operations in the same order: still bitwise).

The interpreter also re-patches ``triton.language`` on every nested ``@triton.jit`` call; inside a launch that already
patched the same modules that is skipped.

``install()`` patches ``triton.runtime.interpreter`` (``ReduceOps.generic_reduce``, ``ScanOps.generic_scan``,
``_patch_lang``, ``GridExecutor.__call__``) when those names exist (run with Triton 3.9, the CI's; 3.6 has the same
names, but its interpreter fails these tests with numpy 2 with or without the patch), and returns False without
patching anything otherwise (the tests then run at the interpreter's own speed). ``tests/conftest.py`` calls it once per
session, after the kernel test modules have set ``TRITON_INTERPRET=1`` and imported triton.
"""

from __future__ import annotations

import numpy as np

_ORIGINALS: dict[str, object] = {}


def _at(ndim: int, axis: int, k: int) -> tuple:
    return tuple(k if i == axis else slice(None) for i in range(ndim))


def _wrap(op, data, shape: tuple, dtype):
    """A slice (shape ``shape``; () for a 1-D input's elements) as the interpreter's tensor, cast to ``dtype``."""
    data = np.asarray(data)
    return op.to_tensor(np.broadcast_to(data, shape) if shape else data.reshape(()), dtype)


def _np_combine(a1, b1, a2, b2):
    # anytrain.kernels.selective_scan_common._combine on numpy arrays
    return a1 * a2, a2 * b1 + b2


def _np_later(x1, i1, x2, i2):
    # anytrain.kernels.selective_scan_fwd._later on numpy arrays
    later = i2 > i1
    return np.where(later, x2, x1), np.where(later, i2, i1)


_NUMPY_COMBINES = {
    ("anytrain.kernels.selective_scan_common", "_combine"): _np_combine,
    ("anytrain.kernels.selective_scan_fwd", "_later"): _np_later,
}


def _numpy_combine(op):
    """The numpy twin of ``op``'s combine function, or None."""
    fn = op.combine_fn.fn
    return _NUMPY_COMBINES.get((getattr(fn, "__module__", None), getattr(fn, "__name__", None)))


def _fold(fn, datas, axis: int, scan: bool):
    """The interpreter's loop (the first slice, then each later one combined into the running value, cast back to the
    inputs' dtypes) on numpy slices with the numpy twin ``fn``: the running values, or (scan) every step's."""
    acc = [np.asarray(d[_at(d.ndim, axis, 0)]) for d in datas]
    outs = [np.zeros(d.shape, dtype=d.dtype) for d in datas] if scan else None
    for k in range(datas[0].shape[axis]):
        if k:
            cur = [d[_at(d.ndim, axis, k)] for d in datas]
            acc = [np.asarray(r).astype(d.dtype, copy=False) for r, d in zip(fn(*acc, *cur), datas, strict=True)]
        if scan:
            for o, a in zip(outs, acc, strict=True):
                o[_at(o.ndim, axis, k)] = a
    return outs if scan else acc


def _combine(op, acc: tuple, cur: tuple, inputs, shape: tuple) -> tuple:
    """One combine step on whole slices, each result cast back to its input's dtype (as the interpreter stores it)."""
    import triton.language as tl

    ret = op.combine_fn.fn(*acc, *cur)
    ret = ret if isinstance(ret, tuple) else (ret,)
    return tuple(
        _wrap(op, r.handle.data if isinstance(r, tl.core.tensor) else r, shape, a.dtype)
        for r, a in zip(ret, inputs, strict=True)
    )


def _slices(op, datas, inputs, axis: int, k: int) -> tuple:
    return tuple(
        _wrap(op, d[_at(d.ndim, axis, k)], d.shape[:axis] + d.shape[axis + 1 :], a.dtype)
        for d, a in zip(datas, inputs, strict=True)
    )


def _generic_reduce(self, input):
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    datas = [arg.handle.data for arg in input]
    out_shape = datas[0].shape[:axis] + datas[0].shape[axis + 1 :]
    fn = _numpy_combine(self)
    if fn is not None:
        acc = _fold(fn, datas, axis, scan=False)
    else:
        acc = _slices(self, datas, input, axis, 0)
        for k in range(1, datas[0].shape[axis]):
            acc = _combine(self, acc, _slices(self, datas, input, axis, k), input, out_shape)
        acc = [t.handle.data for t in acc]
    ret = []
    for a, arg, d in zip(acc, input, datas, strict=True):
        data = a.reshape(out_shape).astype(d.dtype)
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(datas[0].shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        ret.append(self.to_tensor(data, arg.dtype))
    return ret


def _generic_scan(self, input):
    datas = [arg.handle.data for arg in input]
    shape, axis = datas[0].shape, self.axis
    slice_shape = shape[:axis] + shape[axis + 1 :]
    fn = _numpy_combine(self)
    if fn is not None:
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(_fold(fn, datas, axis, scan=True), input, strict=True)]
    outs = [np.zeros(shape, dtype=d.dtype) for d in datas]
    acc = _slices(self, datas, input, axis, 0)
    for k in range(shape[axis]):
        if k:
            acc = _combine(self, acc, _slices(self, datas, input, axis, k), input, slice_shape)
        for o, t in zip(outs, acc, strict=True):
            o[_at(len(shape), axis, k)] = t.handle.data.reshape(slice_shape)
    return [self.to_tensor(o, arg.dtype) for o, arg in zip(outs, input, strict=True)]


_LAUNCHES: list[set] = []  # per running kernel launch: the language modules patched inside it so far


def _lang_ids(fn) -> set:
    import triton.language as tl

    return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}


def _patch_lang_once(fn):
    """The interpreter patches triton.language again on every nested @jit call (``inspect.getmembers`` over the
    modules: ~1 ms a call, about a third of a backward test). Inside a launch that already patched the same modules
    the nested patch changes nothing, so it is skipped; outside a launch (a @jit function called from Python) and for
    modules not patched yet in this launch the interpreter's own function runs."""
    from triton.runtime import interpreter

    ids = _lang_ids(fn)
    if _LAUNCHES and ids and ids <= _LAUNCHES[-1]:
        return interpreter._LangPatchScope()  # nothing to restore
    scope = _ORIGINALS["patch_lang"](fn)
    if _LAUNCHES:
        _LAUNCHES[-1] |= ids
    return scope


def _launch(self, *args, **kwargs):
    _LAUNCHES.append(set())  # the launch's own patch (its first _patch_lang call) is recorded here
    try:
        return _ORIGINALS["launch"](self, *args, **kwargs)
    finally:
        _LAUNCHES.pop()


def install() -> bool:
    """Patch the interpreter's generic reduce / scan with the sliced versions and skip its redundant nested language
    patches; False if its layout is not the known one (nothing is patched then)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    reduce_ops, scan_ops = getattr(interpreter, "ReduceOps", None), getattr(interpreter, "ScanOps", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if reduce_ops is None or scan_ops is None or scope_cls is None or not hasattr(scope_cls, "restore"):
        return False
    needed = ("generic_reduce", "unravel", "to_tensor")
    if not all(hasattr(reduce_ops, n) for n in needed) or not hasattr(scan_ops, "generic_scan"):
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    if not callable(getattr(interpreter, "_patch_lang", None)) or executor is None:
        return False
    if not _ORIGINALS:
        _ORIGINALS["reduce"], _ORIGINALS["scan"] = reduce_ops.generic_reduce, scan_ops.generic_scan
        _ORIGINALS["patch_lang"], _ORIGINALS["launch"] = interpreter._patch_lang, executor.__call__
    reduce_ops.generic_reduce, scan_ops.generic_scan = _generic_reduce, _generic_scan
    interpreter._patch_lang, executor.__call__ = _patch_lang_once, _launch
    return True


def installed() -> bool:
    """Whether the interpreter runs this module's functions now."""
    from triton.runtime import interpreter

    return bool(_ORIGINALS) and interpreter.ReduceOps.generic_reduce is _generic_reduce


def uninstall() -> None:
    """Put the interpreter's own functions back (for the bitwise comparison test)."""
    if _ORIGINALS:
        from triton.runtime import interpreter

        interpreter.ReduceOps.generic_reduce = _ORIGINALS["reduce"]
        interpreter.ScanOps.generic_scan = _ORIGINALS["scan"]
        interpreter._patch_lang = _ORIGINALS["patch_lang"]
        interpreter.GridExecutor.__call__ = _ORIGINALS["launch"]
