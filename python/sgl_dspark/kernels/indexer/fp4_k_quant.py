"""FP4 quantisation of the lightning indexer's keys in one launch, written straight into their
cache rows (`fp4_index_k_quant_ref` is the spec; the format is in `reference.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.indexer.fp4_codec import fp4_quant_groups
from sgl_dspark.kernels.indexer.reference import FP4_GROUP


@triton.jit
def _fp4_index_k_quant_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    loc_ptr,
    T,
    x_row_stride,
    codes_row_stride,
    scales_row_stride,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    HAS_LOC: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x is the previous kernel's output; the cache rows may be read
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < T
    if HAS_LOC:  # issued with the row's loads: one round trip before the stores, not two
        out_rows = tl.load(loc_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_p = tl.arange(0, 16)
    mask = row_ok[:, None, None] & (offs_g < G)[None, :, None]
    cols = (offs_g * 32)[None, :, None] + 2 * offs_p[None, None, :]
    src = x_ptr + rows.to(tl.int64)[:, None, None] * x_row_stride + cols
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    packed, exponent = fp4_quant_groups(even, odd)
    if HAS_LOC:
        row_ok = row_ok & (out_rows != 0)  # slot 0 is the reserved dummy slot: publish nothing
    mask = row_ok[:, None, None] & (offs_g < G)[None, :, None]
    dst = codes_ptr + out_rows[:, None, None] * codes_row_stride + cols // 2
    tl.store(dst, packed.to(codes_ptr.dtype.element_ty), mask=mask)
    dst = scales_ptr + out_rows[:, None] * scales_row_stride + offs_g[None, :]
    mask = row_ok[:, None] & (offs_g < G)[None, :]
    tl.store(dst, exponent.to(scales_ptr.dtype.element_ty), mask=mask)


def _k_quant_meta(t: int, k: int) -> dict[str, int]:
    """Launch meta-parameters (rows per program, warps). Every row is quantised on its own with
    exact operations, so the bits do not depend on them; `benchmark/kernels/sweep_launch.py`
    times alternatives against this default (one row per one-warp program: the rows are
    short)."""
    return {"BLOCK_ROWS": 1, "num_warps": 1}


def fp4_index_k_quant(
    x: torch.Tensor,
    *,
    loc: torch.Tensor | None = None,
    out_codes: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp4_index_k_quant_ref` in one launch, optionally scattered to cache rows (bit-exact).

    Args:
        x: [T, K] bf16/fp16/fp32 with unit inner stride (any row stride); K a multiple of 32.
        loc: optional int32/int64 [T] destination rows; rows with loc == 0 (reserved dummy slot)
            are not written. Requires out_codes and out_scales.
        out_codes: uint8/int8 [rows, K/2], unit inner stride (e.g. ``cache[:, :K//2]``).
        out_scales: uint8/int8 [rows, K/32], unit inner stride (e.g. ``cache[:, K//2:]``).
    Returns:
        (out_codes, out_scales); allocated as [T, K/2] / [T, K/32] uint8 when not given.
    """
    require(x.dim() == 2, f"x: expected [T, K], got shape {tuple(x.shape)}")
    t, k = x.shape
    require(k % FP4_GROUP == 0 and k > 0, f"x: K={k} must be a positive multiple of 32")
    require(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x: bad dtype {x.dtype}")
    require(x.stride(1) == 1 or t == 0, "x: inner stride must be 1")
    if loc is not None:
        require(
            out_codes is not None and out_scales is not None,
            "loc: out_codes and out_scales are required with loc",
        )
        require(
            loc.shape == (t,) and loc.dtype in (torch.int32, torch.int64) and loc.is_contiguous(),
            f"loc: expected contiguous int32/int64 [{t}], got {loc.dtype} {tuple(loc.shape)}",
        )
    rows = out_codes.shape[0] if out_codes is not None else t
    if out_codes is None:
        out_codes = torch.empty(t, k // 2, dtype=torch.uint8, device=x.device)
    if out_scales is None:
        out_scales = torch.empty(t, k // FP4_GROUP, dtype=torch.uint8, device=x.device)
    for name, buf, width in (
        ("out_codes", out_codes, k // 2),
        ("out_scales", out_scales, k // FP4_GROUP),
    ):
        require(buf.dtype in (torch.uint8, torch.int8), f"{name}: uint8/int8, not {buf.dtype}")
        require(
            buf.dim() == 2 and buf.shape == (rows, width) and buf.stride(1) == 1,
            f"{name}: expected [{rows}, {width}] with inner stride 1, got {tuple(buf.shape)}",
        )
        require(buf.device == x.device, f"{name}: expected device {x.device}")
    require(loc is not None or rows == t, f"out_codes: expected {t} rows without loc, got {rows}")
    if t == 0:
        return out_codes, out_scales
    g = k // FP4_GROUP
    meta = _k_quant_meta(t, k)
    _fp4_index_k_quant_kernel[(triton.cdiv(t, meta["BLOCK_ROWS"]),)](
        x,
        out_codes,
        out_scales,
        loc if loc is not None else x,
        t,
        x.stride(0),
        out_codes.stride(0),
        out_scales.stride(0),
        G=g,
        GP=triton.next_power_of_2(g),
        HAS_LOC=loc is not None,
        enable_fp_fusion=False,
        **programmatic_launch(_fp4_index_k_quant_kernel, x.device),
        **meta,
    )
    return out_codes, out_scales
