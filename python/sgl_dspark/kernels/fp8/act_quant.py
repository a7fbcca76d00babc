"""Per-token-group FP8 activation quantisation (`quantize_act_fp8_ref` and
`quantize_act_mxfp8_ref` are the spec): the Triton pieces every producer folds into its epilogue
(`fp8_group_scale`, `e4m3_codes`, `quantize_groups`: the mHC boundary's normed output, the
SiLU-mul-clamp epilogue and the MX MoE stage 1), and a launcher of its own for activations whose
producer does not fold it (`quantize_act_fp8`; the split-K GEMM quantises its input with it).

Exactness: bit-exact against the reference on every backend, the CPU interpreter included: the
scale is a correctly rounded division (`div_rn`), rounded up to a power of two on the bits, the
quotient x / s too, and E4M3 rounds to nearest even on the fp32 bits (`quant.store.e4m3_round`,
torch's cast on every code boundary) instead of the backend's fp32 -> fp8 cast (the
interpreter's is wrong at ties and binade edges). Zero-padded lanes (a partial last group) never
raise an amax. NaN inputs give undefined codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import programmatic_launch, wait_for_producers
from sgl_dspark.kernels.fp8.reference import MX_GROUP, Fp8Activation
from sgl_dspark.kernels.quant.reference import Fp8Rows
from sgl_dspark.kernels.quant.store import e4m3_round

_MAX_BLOCK = 2048
_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def fp8_group_scale(amax, UE8M0: tl.constexpr):
    """max(amax, 1e-10) / 448, correctly rounded; UE8M0: the next power of two at or above it
    (on the bits)."""
    scale = tl.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & 0x7F800000
        bits = tl.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent)
        scale = bits.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def e4m3_codes(y, scale):
    """E4M3FN codes (uint8 bit patterns) of clamp(y / scale, -448, 448), rounded to nearest even,
    and their fp32 values (the values a dot of the codes multiplies)."""
    q = tl.div_rn(y, scale)
    q = tl.where(q > 448.0, 448.0, tl.where(q < -448.0, -448.0, q))
    code, value = e4m3_round(tl.abs(q))
    negative = q.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 is code 0x80, as torch's
    code = tl.where(negative, code | 0x80, code)
    value = tl.where(negative, -value, value)
    return code.to(tl.uint8), value


@triton.jit
def quantize_groups(y, BLOCK: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr):
    """fp32 y [BLOCK] (GROUP divides BLOCK; whole groups) -> (codes uint8 [BLOCK], scales fp32
    [BLOCK // GROUP])."""
    groups = tl.reshape(y, [BLOCK // GROUP, GROUP])
    scale = fp8_group_scale(tl.max(tl.abs(groups), axis=1), UE8M0)
    codes, _ = e4m3_codes(groups, scale[:, None])
    return tl.reshape(codes, [BLOCK]), scale


@triton.jit
def e8m0_byte(scale):
    """The E8M0 exponent byte of a power-of-two fp32 scale."""
    return ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)


@triton.jit
def store_quantized_groups(
    y,
    cols,
    col_ok,
    first_group,
    n_groups,
    q_row_ptr,
    s_row_ptr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    E8M0_OUT: tl.constexpr,
):
    """Quantise fp32 y [BLOCK] (row columns `cols`, whole groups from group `first_group` on,
    lanes past the row zero) and store its codes at `q_row_ptr + cols` and its scales (fp32, or
    E8M0 bytes with E8M0_OUT) at `s_row_ptr + group`, groups below `n_groups` only."""
    codes, scale = quantize_groups(y, BLOCK, GROUP, UE8M0)
    tl.store(q_row_ptr + cols, codes, mask=col_ok)
    group_ids = first_group + tl.arange(0, BLOCK // GROUP)
    if E8M0_OUT:
        tl.store(s_row_ptr + group_ids, e8m0_byte(scale), mask=group_ids < n_groups)
    else:
        tl.store(s_row_ptr + group_ids, scale, mask=group_ids < n_groups)


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    UE8M0: tl.constexpr,
    E8M0_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # x is the previous kernel's output; q may still be read
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < K
    y = tl.load(x_ptr + row * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
    store_quantized_groups(
        y,
        cols,
        col_ok,
        tl.program_id(1) * (BLOCK // GROUP),
        tl.cdiv(K, GROUP),
        q_ptr + row * stride_q,
        s_ptr + row * stride_s,
        BLOCK,
        GROUP,
        UE8M0,
        E8M0_OUT,
    )


def check_group(group: int) -> None:
    require(
        group >= 16 and group & (group - 1) == 0 and group <= _MAX_BLOCK,
        f"group must be a power of two in [16, {_MAX_BLOCK}], got {group}",
    )


def _launch(
    x: torch.Tensor, group: int, ue8m0: bool, e8m0_out: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    require(x.dtype in _FLOAT_INPUTS, f"x: dtype must be bf16/fp16/fp32, got {x.dtype}")
    require(x.dim() >= 1, "x must have a channel dim")
    check_group(group)
    *lead, k = x.shape
    rows = x.reshape(-1, k) if x.dim() != 2 else x
    require(k == 0 or rows.stride(-1) == 1, f"x needs unit stride along K, got {x.stride()}")
    n_groups = triton.cdiv(k, group)
    q = torch.empty(*lead, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale_dtype = torch.uint8 if e8m0_out else torch.float32
    scale = torch.empty(*lead, n_groups, dtype=scale_dtype, device=x.device)
    m = rows.shape[0]
    if m and k:
        block = max(group, min(_MAX_BLOCK, triton.next_power_of_2(k)))
        _act_quant_kernel[(m, triton.cdiv(k, block))](
            rows,
            q.view(torch.uint8).view(m, k),
            scale.view(m, n_groups),
            k,
            rows.stride(0),
            k,
            n_groups,
            GROUP=group,
            BLOCK=block,
            UE8M0=ue8m0,
            E8M0_OUT=e8m0_out,
            num_warps=4 if block >= 1024 else 2,
            **programmatic_launch(_act_quant_kernel, x.device),
        )
    return q, scale


def quantize_act_fp8(x: torch.Tensor, group: int = 128, ue8m0: bool = False) -> Fp8Activation:
    """`quantize_act_fp8_ref` in one launch (no host sync; graph-safe).

    Args:
        x: [..., K] bf16/fp16/fp32, unit stride along K (2-D: any row stride; otherwise rows
            that reshape to [-1, K] without a copy).
        group: channels per scale, a power of two in [16, 2048]; the last group of a row may be
            partial.
        ue8m0: scales rounded up to a power of two.
    Returns:
        Fp8Activation(q float8_e4m3fn [..., K] contiguous, scale fp32 [..., ceil(K / group)]).
    """
    return Fp8Activation(*_launch(x, group, ue8m0, False))


def quantize_act_mxfp8(x: torch.Tensor) -> Fp8Rows:
    """`quantize_act_mxfp8_ref` in one launch: Fp8Rows(codes float8_e4m3fn [..., K], E8M0
    exponent bytes uint8 [..., K / 32]); K a multiple of 32."""
    require(x.shape[-1] % MX_GROUP == 0, f"MXFP8 needs K % 32 == 0, got K = {x.shape[-1]}")
    return Fp8Rows(*_launch(x, MX_GROUP, True, True))


__all__ = [
    "check_group",
    "e4m3_codes",
    "e8m0_byte",
    "fp8_group_scale",
    "quantize_act_fp8",
    "quantize_act_mxfp8",
    "quantize_groups",
    "store_quantized_groups",
]
