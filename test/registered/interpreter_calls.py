"""Triton's CPU interpreter, minus a repeated setup on every call of a `@triton.jit` helper.

Under TRITON_INTERPRET=1 a kernel launch binds the `triton.language` modules visible to the
kernel (`tl`, `tl.core`) to interpreter builtins once, for the whole grid, and restores them when
the grid is done (`GridExecutor.__call__`). Each call of a jit *helper* from inside the kernel
(`InterpretedFunction.__call__`: `round_to_bf16`, `expert_dot`, the mHC picks, ...) binds them
again: it walks every member of those modules with `inspect.getmembers` and sets the same
bindings anew, about a millisecond a call. The tiny-model engines of the end-to-end tests make
tens of thousands of such calls per engine (a quarter to a third of their time).

`install()` binds both modules once per launch (Triton's own helpers such as `tl.sum` and
`tl.zeros` see `tl.core`, the kernels `tl`), by the interpreter's own binding function, restored
after the grid as the launch's own binding is, and then skips a helper's binding when it would
change nothing: every language module the helper sees is bound already. A helper that sees
another is bound as shipped. Results are the interpreter's own: the same builtins run on the
same values. When this Triton's interpreter is not laid out as expected (other names), nothing
is replaced and the interpreter runs as shipped.
"""

from __future__ import annotations

import functools
import inspect
import threading

_state = threading.local()  # .bound: the language modules the running launch has bound


@functools.cache
def _languages(fn) -> frozenset[int]:
    """The language modules `_patch_lang` binds for fn (those of `tl`, `tl.core` in its
    globals), by identity."""
    import triton.language as tl

    langs = (tl, tl.core)
    return frozenset(
        id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and any(v is m for m in langs)
    )


def _sees_both_languages():
    """A function whose globals hold `tl` and `tl.core`: the interpreter binds both for it."""
    import triton.language as tl

    namespace = {"tl": tl, "core": tl.core}
    exec("def sees_both():\n    pass", namespace)
    return namespace["sees_both"]


def install() -> bool:
    """Replace the two interpreter entry points (idempotent); False when not applicable."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    helper = getattr(interpreter, "InterpretedFunction", None)
    needed = (executor, helper, getattr(interpreter, "_patch_lang", None))
    if any(x is None for x in needed) or getattr(helper, "_binds_once", False):
        return getattr(helper, "_binds_once", False)
    run_grid, call_helper = executor.__call__, helper.__call__

    both = _sees_both_languages()

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
        fn = self.rewrite()  # the shipped call without its re-binding
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__ = grid_call
    helper.__call__ = helper_call
    helper._binds_once = True
    return True
