"""`interpreter_shortcuts.install` (the test suite's interpreter): it applies to this Triton, a
launch binds the language modules once whatever its helpers call and restores them, and the
replaced dtype table and bf16 <-> fp32 conversions give the shipped functions' results."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from interpreter_shortcuts import SHIPPED, install
from sgl_dspark.kernels._triton_utils import interpreted


@triton.jit
def _row_sums(x, BLOCK: tl.constexpr):  # a helper calling Triton's own helpers (tl.core)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    return acc + tl.sum(tl.reshape(x, [BLOCK, BLOCK]), axis=1)


@triton.jit
def _row_sums_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK * BLOCK + tl.arange(0, BLOCK * BLOCK)
    y = _row_sums(tl.load(x_ptr + offs), BLOCK)
    tl.store(y_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), tl.maximum(y, 0.0))


pytestmark = pytest.mark.skipif(
    not interpreted(_row_sums_kernel), reason="the CPU interpreter's behaviour"
)


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
    assert bindings == ["_sees_both_languages", "_row_sums_kernel"]
    assert (tl.load, tl.core.load, tl.core.reduce, tl.tensor.__add__) == before
    torch.testing.assert_close(y, x.view(24, 8).sum(1).clamp(min=0.0), rtol=1e-6, atol=1e-6)


def test_dtype_table_gives_the_shipped_dtypes() -> None:
    from triton.runtime import interpreter

    assert install()
    for ty in (tl.int1, tl.int8, tl.uint16, tl.int32, tl.int64, tl.float16, tl.bfloat16):
        for t in (ty, tl.block_type(ty, [4, 2]), tl.pointer_type(ty)):
            assert interpreter._get_np_dtype(t) == SHIPPED["_get_np_dtype"](t), t
            assert interpreter._get_np_dtype(t) == SHIPPED["_get_np_dtype"](t), t  # remembered
    pointers = tl.block_type(tl.pointer_type(tl.float32), [8])
    assert interpreter._get_np_dtype(pointers) == SHIPPED["_get_np_dtype"](pointers)


def _convert_both(data: np.ndarray, src, dst) -> tuple[np.ndarray, np.ndarray]:
    from triton.runtime import interpreter

    return interpreter._convert_float(data, src, dst, None), SHIPPED["_convert_float"](
        data, src, dst, None
    )


def test_bf16_fp32_conversions_give_the_shipped_bits() -> None:
    """Every bf16 pattern up to fp32 and a sample of fp32 patterns (every exponent, both signs,
    zeros, infinities, NaNs) down to bf16, in blocks with and without a subnormal (the latter
    taking the shortcut)."""
    assert install()
    bf16 = np.arange(2**16, dtype=np.uint16).reshape(-1, 64)
    for block in bf16:
        got, want = _convert_both(block, tl.bfloat16, tl.float32)
        assert got.dtype == want.dtype and np.array_equal(got, want), hex(block[0])
    g = np.random.default_rng(3)
    exponents = np.arange(256, dtype=np.uint32) << 23
    for sign in (0, 1 << 31):
        for _ in range(4):
            fp32 = sign | exponents[:, None] | g.integers(0, 2**23, (256, 64), dtype=np.uint32)
            fp32[:, 0] = sign | exponents  # zero / power-of-two mantissas, infinity
            for block in fp32:
                got, want = _convert_both(block.view(np.float32), tl.float32, tl.bfloat16)
                assert got.dtype == want.dtype and np.array_equal(got, want), hex(block[1])
