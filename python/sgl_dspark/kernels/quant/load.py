"""Gather and decode cache rows of DeepSeek-V4.1's packed formats in one launch: the read side
of `store.py` (`quant_load_ref` is the spec: an index of the stored bytes, then
`dequantize_*_ref`). The window KV rows (E4M3 elements, one exponent byte per 32 channels), the
compressed latents (packed E2M1, one E4M3 scale per 16) and the index keys (packed E2M1, one
exponent byte per 32) are read as the uint8 rows the cache keeps and written decoded in the
output dtype, with no intermediate tensor.

One program per tile of rows: it loads each row's stored bytes and its scale bytes (one load
and one decode per scale byte, broadcast over the bytes of its block: a gather of each
element's scale byte compiled for sm90 to a dozen byte loads a thread and shared-memory rounds
behind barriers), decodes both to fp32 from the bits and writes value * scale rounded once to
the output dtype.

Exactness: bit-exact against the reference on any backend. Every decode is exact (E4M3 and E2M1
codes through fp16's bits and a power-of-two product, exponent bytes straight into fp32's
exponent field), so the only roundings are the reference's: one fp32 product, then one round to
the output dtype. Both are exact for every row the quantisers write; only raw scale bytes near
the bottom of the exponent range give bf16 subnormals that round, on the bits under the
interpreter (whose bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import e2m1_to, e8m0_to_fp32
from sgl_dspark.kernels.quant.reference import INDEX_BLOCK, LATENT_BLOCK, WINDOW_BLOCK
from sgl_dspark.kernels.quant.store import FORMATS

_BLOCKS = {"fp8_window": WINDOW_BLOCK, "fp4_latent": LATENT_BLOCK, "fp4_index": INDEX_BLOCK}
# Decoded values per program (rows * channels): at most a few KB of output per program, and
# fewer rows while that leaves the grid below _MIN_PROGRAMS (a decode step's few hundred rows
# would otherwise be a few dozen programs, latency-bound); each row stays one contiguous load.
# The decode is elementwise: no value depends on the tile.
_TILE = 4096
_MIN_PROGRAMS = 256


def _rows_per_program(n: int, padded_width: int) -> int:
    """Rows a program decodes: a power of two, at most `_TILE` values, and no more than keeps
    `_MIN_PROGRAMS` programs busy over `n` rows."""
    most = max(1, _TILE // padded_width)
    return min(most, triton.next_power_of_2(max(1, -(-n // _MIN_PROGRAMS))))


@triton.jit
def e4m3_to_fp32(codes):
    """E4M3 bytes -> their values in fp32, exactly. The sign bit placed at fp16's and the
    exponent and mantissa bits at the bottom of fp16's exponent and the top of its mantissa are
    the fp16 number value * 2^-8 (subnormals land on fp16's subnormals), so a shift-or, a
    reinterpretation and a power-of-two product decode every code; the NaN codes (0x7F, 0xFF)
    would land on 480 and are mapped to NaN, as torch's cast reads them."""
    c = codes.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    v = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((c & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _load_rows(
    block,
    rows_ptr,
    n,
    data_ptr,
    data_row_stride,
    scales_ptr,
    scales_row_stride,
    out_ptr,
    out_group,
    out_group_stride,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    ROWS: tl.constexpr,
    SPAN: tl.constexpr,
    FMT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """Rows [block * ROWS, (block + 1) * ROWS) of the flattened `rows` of one load (the kernel's
    whole work; `_quant_load_pair_kernel` runs two loads' tiles in one grid)."""
    offs_r = block * ROWS + tl.arange(0, ROWS)
    row_ok = offs_r < n
    row = tl.load(rows_ptr + offs_r, mask=row_ok, other=0).to(tl.int64)
    offs_w = tl.arange(0, WP)  # stored byte of the row
    mask = row_ok[:, None] & (offs_w < W)[None, :]
    stored = tl.load(
        data_ptr + row[:, None] * data_row_stride + offs_w[None, :], mask=mask, other=0
    )
    # Row r of the flattened rows is row (r % out_group) of group (r // out_group) of the output:
    # a group's rows are contiguous, groups out_group_stride elements apart.
    r64 = offs_r.to(tl.int64)
    out_row = out_ptr + ((r64 // out_group) * out_group_stride + (r64 % out_group) * D)[:, None]
    # The row's bytes as [ROWS, scale block, SPAN bytes under that scale]: each scale byte is
    # loaded and decoded once and broadcast over its block's bytes, not gathered per byte.
    NB: tl.constexpr = WP // SPAN
    offs_b = tl.arange(0, NB)
    s = tl.load(
        (scales_ptr + row[:, None] * scales_row_stride + offs_b[None, :])[:, :, None],
        mask=(row_ok[:, None] & (offs_b < W // SPAN)[None, :])[:, :, None],
        other=127,
    )
    codes = tl.reshape(stored, [ROWS, NB, SPAN])
    if FMT == 0:  # FP8 window: byte j is channel j
        v = round_to_dtype(e4m3_to_fp32(codes) * e8m0_to_fp32(s), OUT_KIND, ON_BITS)
        tl.store(out_row + offs_w[None, :], tl.reshape(v, [ROWS, WP]), mask=mask)
    else:  # FP4: byte j holds channels 2j (low nibble) and 2j + 1, always of one block
        if FMT == 1:
            scale = e4m3_to_fp32(s)
        else:
            scale = e8m0_to_fp32(s)
        lo = round_to_dtype(e2m1_to(codes & 15, tl.float32) * 16384.0 * scale, OUT_KIND, ON_BITS)
        hi = round_to_dtype(e2m1_to(codes >> 4, tl.float32) * 16384.0 * scale, OUT_KIND, ON_BITS)
        # Channels 2j and 2j + 1 side by side: one contiguous store a row, not two stores of
        # every other element (half of each written sector).
        pairs = tl.reshape(tl.join(lo, hi), [ROWS, 2 * WP])
        chans = tl.arange(0, 2 * WP)
        tl.store(out_row + chans[None, :], pairs, mask=row_ok[:, None] & (chans < 2 * W)[None, :])


@triton.jit
def _quant_load_kernel(
    rows_ptr,
    n,
    data_ptr,
    data_row_stride,
    scales_ptr,
    scales_row_stride,
    out_ptr,
    out_group,
    out_group_stride,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    ROWS: tl.constexpr,
    SPAN: tl.constexpr,
    FMT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the cache rows come from the store launches before this one
    _load_rows(
        tl.program_id(0),
        rows_ptr,
        n,
        data_ptr,
        data_row_stride,
        scales_ptr,
        scales_row_stride,
        out_ptr,
        out_group,
        out_group_stride,
        D,
        W,
        WP,
        ROWS,
        SPAN,
        FMT,
        OUT_KIND,
        ON_BITS,
    )


@triton.jit
def _quant_load_pair_kernel(
    a_rows_ptr,
    a_n,
    a_data_ptr,
    a_data_row_stride,
    a_scales_ptr,
    a_scales_row_stride,
    a_out_ptr,
    a_out_group,
    a_out_group_stride,
    a_blocks,
    b_rows_ptr,
    b_n,
    b_data_ptr,
    b_data_row_stride,
    b_scales_ptr,
    b_scales_row_stride,
    b_out_ptr,
    b_out_group,
    b_out_group_stride,
    A_D: tl.constexpr,
    A_W: tl.constexpr,
    A_WP: tl.constexpr,
    A_ROWS: tl.constexpr,
    A_SPAN: tl.constexpr,
    A_FMT: tl.constexpr,
    B_D: tl.constexpr,
    B_W: tl.constexpr,
    B_WP: tl.constexpr,
    B_ROWS: tl.constexpr,
    B_SPAN: tl.constexpr,
    B_FMT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Programs [0, a_blocks) decode load a's row tiles, the rest load b's, each as its own
    # launch would (an element's decode depends on nothing else).
    wait_for_producers(PDL)  # the cache rows come from the store launches before this one
    block = tl.program_id(0)
    if block < a_blocks:
        _load_rows(
            block,
            a_rows_ptr,
            a_n,
            a_data_ptr,
            a_data_row_stride,
            a_scales_ptr,
            a_scales_row_stride,
            a_out_ptr,
            a_out_group,
            a_out_group_stride,
            A_D,
            A_W,
            A_WP,
            A_ROWS,
            A_SPAN,
            A_FMT,
            OUT_KIND,
            ON_BITS,
        )
    else:
        _load_rows(
            block - a_blocks,
            b_rows_ptr,
            b_n,
            b_data_ptr,
            b_data_row_stride,
            b_scales_ptr,
            b_scales_row_stride,
            b_out_ptr,
            b_out_group,
            b_out_group_stride,
            B_D,
            B_W,
            B_WP,
            B_ROWS,
            B_SPAN,
            B_FMT,
            OUT_KIND,
            ON_BITS,
        )


def _launch_args(
    data: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    fmt: str,
    dtype: torch.dtype,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, object], dict[str, int]]:
    """`quant_load`'s argument checks (ValueError naming the argument): (out, allocated when
    None; the load's pointer and size arguments, `_load_rows`' order; its constexprs)."""
    require(fmt in FORMATS, f"fmt: expected one of {tuple(FORMATS)}, got {fmt!r}")
    require(dtype in DTYPE_KIND, f"dtype: expected fp32/bf16/fp16, got {dtype}")
    require(
        data.dtype == torch.uint8 and data.dim() == 2 and data.stride(1) == 1,
        f"data: expected uint8 [R, W] with unit stride, got {data.dtype} {tuple(data.shape)}",
    )
    width = data.shape[1]
    d = width if fmt == "fp8_window" else 2 * width
    block = _BLOCKS[fmt]
    require(d % block == 0, f"data: D={d} is not a multiple of the {fmt} block {block}")
    require(
        scales.dtype == torch.uint8
        and scales.dim() == 2
        and scales.shape == (data.shape[0], d // block)
        and scales.stride(1) == 1,
        f"scales: expected uint8 [{data.shape[0]}, {d // block}] with unit stride, "
        f"got {scales.dtype} {tuple(scales.shape)}",
    )
    require(scales.device == data.device, f"scales: expected device {data.device}")
    require(
        rows.dtype in (torch.int32, torch.int64),
        f"rows: expected int32/int64, got {rows.dtype}",
    )
    require(rows.device == data.device, f"rows: expected device {data.device}, got {rows.device}")
    shape = (*rows.shape, d)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    group = max(rows.shape[-1] if rows.dim() else 1, 1)
    group_stride = _group_stride(out, group, d)
    require(
        out.dtype == dtype and tuple(out.shape) == shape and group_stride is not None,
        f"out: expected {dtype} {shape} whose last two dims are contiguous, got {out.dtype} "
        f"{tuple(out.shape)} strides {out.stride()}",
    )
    require(out.device == data.device, f"out: expected device {data.device}, got {out.device}")
    flat = rows.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    wp = triton.next_power_of_2(width)
    args = {
        "rows_ptr": flat,
        "n": flat.numel(),
        "data_ptr": data,
        "data_row_stride": data.stride(0),
        "scales_ptr": scales,
        "scales_row_stride": scales.stride(0),
        "out_ptr": out,
        "out_group": group,
        "out_group_stride": group_stride,
    }
    consts = {
        "D": d,
        "W": width,
        "WP": wp,
        "ROWS": _rows_per_program(flat.numel(), wp),
        # Stored bytes under one scale byte (an FP4 byte holds two channels).
        "SPAN": block if fmt == "fp8_window" else block // 2,
        "FMT": FORMATS[fmt],
    }
    return out, args, consts


def quant_load(
    data: torch.Tensor,
    scales: torch.Tensor,
    rows: torch.Tensor,
    fmt: str,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quant_load_ref` in one launch, no host sync.

    Args:
        data, scales: the packed cache (`QuantizedRows`): uint8 [R, D] (FP8 codes) or [R, D/2]
            (E2M1 pairs), and uint8 [R, D / block] scale bytes; unit stride in the last dim.
        rows: int32/int64 cache rows, any shape; each in [0, R) (not checked: no host sync).
        fmt: "fp8_window", "fp4_latent" or "fp4_index".
        dtype: fp32/bf16/fp16, the decoded rows' dtype.
        out: optional [*rows.shape, D] of `dtype` to write into: contiguous, or for rows
            [T, K] a [T, K, D] view whose K x D block per token is contiguous (a slice of wider
            rows of keys).

    Returns:
        [*rows.shape, D] in `dtype`: row r's decoded values at each index of `rows`.
    """
    out, args, consts = _launch_args(data, scales, rows, fmt, dtype, out)
    n = args["n"]
    assert isinstance(n, int)
    if n == 0:
        return out
    _quant_load_kernel[(triton.cdiv(n, consts["ROWS"]),)](
        **args,
        **consts,
        OUT_KIND=DTYPE_KIND[dtype],
        ON_BITS=interpreted(_quant_load_kernel),
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_quant_load_kernel, data.device),
    )
    return out


# One load of `quant_load_pair`: (data, scales, rows, fmt, out), as `quant_load`'s.
LoadArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, torch.Tensor]


def quant_load_pair(a: LoadArgs, b: LoadArgs, dtype: torch.dtype) -> None:
    """Two `quant_load` calls into given outputs in one launch (DeepSeek-V4.1's window keys and
    attended latents, decoded side by side into one keys tensor); the same values as the two
    calls."""
    _, args_a, consts_a = _launch_args(*a[:4], dtype, a[4])
    _, args_b, consts_b = _launch_args(*b[:4], dtype, b[4])
    n_a, n_b = args_a["n"], args_b["n"]
    assert isinstance(n_a, int) and isinstance(n_b, int)
    blocks_a = triton.cdiv(n_a, consts_a["ROWS"])
    blocks = blocks_a + triton.cdiv(n_b, consts_b["ROWS"])
    if blocks == 0:
        return
    data = a[0]
    _quant_load_pair_kernel[(blocks,)](
        **{f"a_{k}": v for k, v in args_a.items()},
        a_blocks=blocks_a,
        **{f"b_{k}": v for k, v in args_b.items()},
        **{f"A_{k}": v for k, v in consts_a.items()},
        **{f"B_{k}": v for k, v in consts_b.items()},
        OUT_KIND=DTYPE_KIND[dtype],
        ON_BITS=interpreted(_quant_load_pair_kernel),
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_quant_load_pair_kernel, data.device),
    )


def _group_stride(out: torch.Tensor, group: int, d: int) -> int | None:
    """The elements between consecutive groups of `group` rows of `out` [..., group, D] when
    the kernel can write it (contiguous, or [T, group, D] with each group's rows contiguous:
    a slice of wider rows of keys), else None."""
    if out.is_contiguous():
        return group * d
    if out.dim() == 3 and out.stride(2) == 1 and (group <= 1 or out.stride(1) == d):
        return out.stride(0)
    return None


__all__ = ["e4m3_to_fp32", "quant_load", "quant_load_pair"]
