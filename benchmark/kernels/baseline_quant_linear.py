"""The previous W8A16 / W4A16 small-M linear (tree `ff6732b`), kept only as the A/B baseline of
`bench_quant_gemm.py`: one matrix-unit dot per scale group with the group's scale applied to
the partial sum, MXFP4 nibbles decoded byte by byte through fp16. Bench-only: nothing in
`sgl_dspark` calls it (`kernels/linear/quantized.py` replaced it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from sgl_dspark.kernels._triton_utils import programmatic_launch, round_to_bf16, wait_for_producers
from sgl_dspark.kernels.linear.reference import QuantizedWeight

_BLOCK_M = 16


@triton.jit
def _e2m1_to(codes, DTYPE: tl.constexpr):
    # 4-bit E2M1 codes -> their values times 2^-14 (fp16 bits), then DTYPE.
    c = codes.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(DTYPE)


@triton.jit
def _chunk_dot(
    a_rows,
    a_ok,
    w_rows,
    w_ok,
    s_rows,
    k0,
    k_dim,
    FP4: tl.constexpr,
    SUB: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # One scale group's (or K step's) dot from zero, times the columns' scales.
    if FP4:
        HALF: tl.constexpr = SUB // 2
        j = k0 // 2 + tl.arange(0, HALF)
        j_ok = j < k_dim // 2
        a_mask = a_ok[:, None] & j_ok[None, :]
        a_even = tl.load(a_rows[:, None] + 2 * j[None, :], mask=a_mask, other=0.0)
        a_odd = tl.load(a_rows[:, None] + 2 * j[None, :] + 1, mask=a_mask, other=0.0)
        packed = tl.load(w_rows[None, :] + j[:, None], mask=j_ok[:, None] & w_ok[None, :], other=0)
        if DOT_FP32:
            w_lo = _e2m1_to(packed & 15, tl.float32)
            w_hi = _e2m1_to(packed >> 4, tl.float32)
            part = tl.dot(a_even.to(tl.float32), w_lo, input_precision="ieee")
            part = tl.dot(a_odd.to(tl.float32), w_hi, part, input_precision="ieee")
        else:
            w_lo = _e2m1_to(packed & 15, a_even.dtype)
            w_hi = _e2m1_to(packed >> 4, a_even.dtype)
            part = tl.dot(a_even, w_lo)
            part = tl.dot(a_odd, w_hi, part)
    else:
        k = k0 + tl.arange(0, SUB)
        k_ok = k < k_dim
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows[None, :] + k[:, None], mask=k_ok[:, None] & w_ok[None, :], other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w.to(a.dtype))
    e = tl.load(s_rows + k0 // GROUP, mask=w_ok & (k0 < k_dim), other=0)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    if FP4:
        scale = scale * 16384.0
    return part * scale[None, :]


@triton.jit
def _baseline_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_xg,
    stride_wg,
    stride_yg,
    FP4: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    group = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    wait_for_producers(PDL)
    x_rows = x_ptr + group * stride_xg + offs_m.to(tl.int64) * stride_xm
    w_rows = w_ptr + group * stride_wg + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + ((group * N + offs_n.to(tl.int64)) // SCALE_ROWS) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB):
            acc += _chunk_dot(
                x_rows, mask_m, w_rows, mask_n, s_rows, k0 + j * SUB, K, FP4, SUB, GROUP, DOT_FP32
            )
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_rows = y_ptr + group * stride_yg + offs_m[:, None].to(tl.int64) * stride_ym
    tl.store(
        y_rows + offs_n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _meta(fmt: str, group: int, n: int, k: int) -> dict[str, int]:
    block_n = 16 if n <= 8192 else 64
    per_byte = 2 if fmt == "mxfp4" else 1
    step = max(16, min(min(512 * per_byte, 16 * group), triton.next_power_of_2(max(k, 1))))
    block_k = max(step, 32) if fmt == "mxfp4" else step
    stages = 4 if block_k * (1 if fmt == "fp8" else 0.5) >= 256 else 6
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_stages": stages if block_n <= 16 else 3,
        "num_warps": 4,
    }


def _launch(x, weight: QuantizedWeight, out, groups: int, group_strides) -> None:
    (m, k), n = x.shape, weight.data.shape[0]
    meta = _meta(weight.fmt, weight.group, n, k)
    _baseline_kernel[(triton.cdiv(n, meta["BLOCK_N"]), groups)](
        x,
        weight.data,
        weight.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        *group_strides,
        FP4=weight.fmt == "mxfp4",
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_M=_BLOCK_M,
        SUB=min(weight.group, meta["BLOCK_K"]),
        ROUND_BF16=x.dtype == torch.bfloat16,
        DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
        **meta,
        **programmatic_launch(_baseline_kernel, x.device),
    )


def baseline_quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The previous `quantized_linear` (x [M <= 16, K] bf16, weight [N, K])."""
    out = torch.empty((x.shape[0], weight.data.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, out, 1, (0, 0, 0))
    return out


def baseline_quantized_grouped_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The previous `quantized_grouped_linear` (x [M, G, K], weight [G * N, K])."""
    m, groups, _ = x.shape
    n = weight.data.shape[0] // groups
    out = torch.empty((m, groups, n), dtype=x.dtype, device=x.device)
    first = weight._replace(data=weight.data[:n])
    strides = (x.stride(1), n * weight.data.stride(0), out.stride(1))
    _launch(x[:, 0], first, out[:, 0], groups, strides)
    return out
