"""`interpreter_calls.install` (the test suite's interpreter without a language binding per
helper call): it applies to this Triton, a launch binds the language modules once whatever its
helpers call, results are the interpreter's, and the modules are restored after the launch."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from interpreter_calls import install

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter's behaviour"
)


@triton.jit
def _row_sums(x, BLOCK: tl.constexpr):  # a helper calling Triton's own helpers (tl.core)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    return acc + tl.sum(tl.reshape(x, [BLOCK, BLOCK]), axis=1)


@triton.jit
def _row_sums_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK * BLOCK + tl.arange(0, BLOCK * BLOCK)
    y = _row_sums(tl.load(x_ptr + offs), BLOCK)
    tl.store(y_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), tl.maximum(y, 0.0))


def test_a_launch_binds_the_languages_once_and_restores_them(monkeypatch) -> None:
    from triton.runtime import interpreter

    assert install() and install()  # applies to this Triton; a second call changes nothing
    bindings = []
    shipped = interpreter._patch_lang
    monkeypatch.setattr(
        interpreter, "_patch_lang", lambda fn: bindings.append(fn.__name__) or shipped(fn)
    )
    before = (tl.load, tl.core.load, tl.core.reduce, tl.tensor.__add__)
    x = torch.randn(3 * 8 * 8, generator=torch.Generator().manual_seed(1))
    y = torch.full((3 * 8,), float("nan"))
    _row_sums_kernel[(3,)](x, y, BLOCK=8)
    # Three programs, each calling three helpers: two bindings for the whole launch.
    assert bindings == ["sees_both", "_row_sums_kernel"]
    assert (tl.load, tl.core.load, tl.core.reduce, tl.tensor.__add__) == before
    torch.testing.assert_close(y, x.view(24, 8).sum(1).clamp(min=0.0), rtol=1e-6, atol=1e-6)
