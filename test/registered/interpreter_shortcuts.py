"""Triton's CPU interpreter with three of its costs removed, the same results (the test suite
runs every kernel in it: `install()` from conftest.py and the spawned test ranks).

1. A language binding per helper call. A kernel launch binds the `triton.language` modules the
   kernel sees (`tl`, `tl.core`) to interpreter builtins once for the whole grid and restores
   them after it (`GridExecutor.__call__`); each call of a `@triton.jit` helper inside it
   (`round_to_bf16`, `expert_dot`, `tl.sum`, `tl.zeros`, ...) binds them again
   (`InterpretedFunction.__call__`), walking every member of those modules with
   `inspect.getmembers`. Here a launch binds both modules once, by the interpreter's own
   binding function, restored after the grid as the launch's own binding is, and a helper whose
   language modules are all bound already skips its binding (one that sees another module is
   bound as shipped).
2. The numpy dtype of a Triton type (`_get_np_dtype`), whose table of 19 types the shipped
   function builds on every call: remembered per element type.
3. bf16 <-> fp32 conversions (`_convert_float`, a few dozen numpy passes): shifts of the bit
   patterns when no operand is subnormal, bf16 -> fp32 the pattern shifted up 16 and fp32 ->
   bf16 without a rounding mode (the interpreter truncates) its top half. These are the
   shipped results for every normal, zero, infinite and NaN pattern (compared over all 2^16 and
   2^32 patterns once; `test_interpreter_shortcuts.py` compares every bf16 pattern and a sample
   of fp32 ones); an array holding a subnormal goes to the shipped conversion, which treats
   subnormals its own way.

Together they take the tiny-model engines of the end-to-end tests 1.5-2x faster. When this
Triton's interpreter is not laid out as expected (other names), nothing is replaced and it runs
as shipped.
"""

from __future__ import annotations

import functools
import inspect
import threading

import triton.language as tl
from triton.language import core  # noqa: F401 - in the globals `_sees_both_languages` shows

_state = threading.local()  # .bound: ids of the language modules the running launch bound
SHIPPED: dict[str, object] = {}  # the replaced interpreter functions, by name


@functools.cache
def _languages(fn) -> frozenset[int]:
    """The language modules the interpreter binds for fn (those of `tl`, `tl.core` in its
    globals), by identity."""
    langs = (tl, tl.core)
    return frozenset(
        id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and any(v is m for m in langs)
    )


def _sees_both_languages() -> None:
    """Never called: its globals (this module's) hold `tl` and `tl.core`, so the interpreter
    binds both for it."""


def install() -> bool:
    """Apply the shortcuts (idempotent); False when this interpreter does not have the
    expected entry points."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if SHIPPED:
        return True
    names = ("GridExecutor", "InterpretedFunction", "_patch_lang", "_get_np_dtype")
    if not all(hasattr(interpreter, name) for name in (*names, "_convert_float")):
        return False
    executor, helper = interpreter.GridExecutor, interpreter.InterpretedFunction
    run_grid, call_helper = executor.__call__, helper.__call__
    both = _sees_both_languages

    @functools.wraps(run_grid)
    def grid_call(self, *args, **kwargs):
        outer = getattr(_state, "bound", None)
        scope = interpreter._patch_lang(both)
        _state.bound = _languages(both) | _languages(self.fn)
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            _state.bound = outer
            scope.restore()

    @functools.wraps(call_helper)
    def helper_call(self, *args, **kwargs):
        bound = getattr(_state, "bound", None)
        if bound is None or not _languages(self.fn) <= bound:
            return call_helper(self, *args, **kwargs)
        fn = self.rewrite()  # the shipped call without its binding
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    SHIPPED.update(
        grid_call=run_grid,
        helper_call=call_helper,
        _get_np_dtype=interpreter._get_np_dtype,
        _convert_float=interpreter._convert_float,
    )
    executor.__call__ = grid_call
    helper.__call__ = helper_call
    interpreter._get_np_dtype = _cached_np_dtype(interpreter._get_np_dtype)
    interpreter._convert_float = _bf16_fp32_on_the_bits(interpreter._convert_float)
    return True


def _cached_np_dtype(shipped):
    """`_get_np_dtype` remembered per element type (shortcut 2)."""
    import numpy as np

    known: dict = {}
    address = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return address
        found = known.get(tt_dtype)
        if found is None:
            found = known[tt_dtype] = shipped(tt_dtype)
        return found

    return np_dtype


def _bf16_fp32_on_the_bits(shipped):
    """`_convert_float` with bf16 <-> fp32 on the bit patterns (shortcut 3)."""
    import numpy as np

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            bits = data.view(np.uint16)
            if not np.any(((bits & 0x7F80) == 0) & ((bits & 0x7F) != 0)):
                return bits.astype(np.uint32) << 16
        elif input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode is None:
            bits = data.view(np.uint32)
            if not np.any(((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)):
                return (bits >> 16).astype(np.uint16)
        return shipped(data, input_dtype, output_dtype, rounding_mode)

    return convert
