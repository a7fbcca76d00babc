"""The inverse RoPE as the epilogue of an attention kernel: the output's rope channels are rotated
back in registers before the store, with the bits `rope_tail(out, cos, sin, inverse=True)` would
give after the kernel (one launch less per layer). Used by `attention/window_sparse.py` and
`attention/draft.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import round_to_dtype


@triton.jit
def rotate_rounded_tail(
    v,
    cs_rows,
    row_ok,
    cos_ptr,
    sin_ptr,
    cs_stride,
    dim0,
    head_dim,
    rope_dim,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INVERSE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """The rope rotation as an epilogue of another kernel's output tile: v fp32 [ROWS, BLOCK_D]
    holds channels dim0 + [0, BLOCK_D) (dim0 even) of ROWS head rows, already rounded to the
    output dtype (what the producer would store); row r rotates by the angles of cos/sin row
    cs_rows[r], read only where row_ok[r] (rows the caller does not store, e.g. a row block's
    tail past the table, load nothing and pass through). The rope channels (the last rope_dim
    of head_dim) get the same fp32 products and rounding as `rope_tail` (the caller launches
    with FMA contraction off); the others pass through. Returns the tile to store."""
    a, b = tl.split(tl.reshape(v, [ROWS, BLOCK_D // 2, 2]))
    even = dim0 + 2 * tl.arange(0, BLOCK_D // 2)
    is_rope = (even >= head_dim - rope_dim) & (even < head_dim)
    pair = (even - (head_dim - rope_dim)) // 2
    cs = cs_rows[:, None].to(tl.int64) * cs_stride + pair[None, :]
    load = row_ok[:, None] & is_rope[None, :]
    cos = tl.load(cos_ptr + cs, mask=load, other=0.0)
    sin = tl.load(sin_ptr + cs, mask=load, other=0.0)
    if INVERSE:
        sin = -sin
    rot_a = tl.where(is_rope[None, :], round_to_dtype(a * cos - b * sin, KIND, ON_BITS), a)
    rot_b = tl.where(is_rope[None, :], round_to_dtype(a * sin + b * cos, KIND, ON_BITS), b)
    return tl.reshape(tl.join(rot_a, rot_b), [ROWS, BLOCK_D])


class EpilogueTables(NamedTuple):
    """Launch arguments of a `rotate_rounded_tail` epilogue: (cos, sin, their row stride, rd);
    without one, placeholders that the kernel never reads (ROPE off) and rd = 0."""

    cos: torch.Tensor
    sin: torch.Tensor
    stride: int
    rope_dim: int


def epilogue_tables(
    inverse_rope: tuple[torch.Tensor, torch.Tensor] | None,
    rows: int,
    head_dim: int,
    placeholder: torch.Tensor,
) -> EpilogueTables:
    """Checks the cos/sin rows another kernel rotates its output with (`rotate_rounded_tail`):
    fp32 [rows, rd/2], unit stride along rd/2, one row stride for both, on the placeholder's
    device, the rope channels pair-aligned (D - rd even)."""
    if inverse_rope is None:
        return EpilogueTables(placeholder, placeholder, 0, 0)
    cos, sin = inverse_rope
    device = placeholder.device
    require(
        cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == rows,
        f"inverse_rope: cos/sin must both be [{rows}, rd/2], got "
        f"{tuple(cos.shape)} and {tuple(sin.shape)}",
    )
    rope_dim = 2 * cos.shape[1]
    require(
        cos.dtype == torch.float32
        and sin.dtype == torch.float32
        and 2 <= rope_dim <= head_dim
        and (head_dim - rope_dim) % 2 == 0,
        f"inverse_rope: cos/sin must be fp32 with 2 <= rd <= D = {head_dim} and "
        f"D - rd even, got {cos.dtype}/{sin.dtype} rd = {rope_dim}",
    )
    require(
        (rows == 0 or (cos.stride(1) == 1 and sin.stride(1) == 1))
        and cos.stride(0) == sin.stride(0),
        f"inverse_rope: cos/sin need unit stride along rd/2 and one row stride, "
        f"got {cos.stride()} and {sin.stride()}",
    )
    require(
        cos.device == device and sin.device == device,
        f"inverse_rope: cos/sin are on {cos.device}/{sin.device}, not {device}",
    )
    return EpilogueTables(cos, sin, cos.stride(0), rope_dim)
