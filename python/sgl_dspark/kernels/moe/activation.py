"""Clamped SwiGLU (SiLU-mul-clamp) for the routed and shared experts in one launch, any width
(`silu_mul_clamp_ref` is the spec).

    y = silu(min(g, limit)) * clamp(u, -limit, limit),   gate_up = [g | u] along the last dim

silu(g) = g * sigmoid(g) with sigmoid(g) = 1 / (1 + exp2(-g * log2e)) (the exp2 form maps to one
hardware instruction on both vendors). Output epilogues (a constexpr switch on one kernel):
  * "plain": y in the input dtype (bf16 rounded to nearest even, or fp32);
  * "fp8_row" / "fp8_group": fp8 e4m3 codes q = clamp(y / s, -448, 448) with fp32 scales
    s = max(amax, 1e-10) / 448 (correctly rounded division) per row or per group of `group`
    columns (128 by default; the last group may be partial; optionally rounded up to a power of
    two, "ue8m0"), amax taken over the bf16-rounded y (what an unfused quant would have read):
    `quantize_act_fp8_ref` of the plain output, the quantiser of the FP8 GEMMs
    (`fp8/act_quant.py`, E4M3 rounded on the bits). Given equal y, the scales and codes are
    exact on every device, the CPU interpreter included.

The expert GEMMs that fuse the activation into their epilogue (the grouped stage 1, the
per-token stage 1, the MX MoE's) take its ops from here too: `clamped_swiglu_values` (the one
definition of the ops and their order), `swiglu_tile` (a [gate | up] product tile rounded as a
plain GEMM would store it, then activated) and `weighted_activation` (DeepSeek-V4.1's route
weight applied before the down projection).

Exactness: within a tolerance of `silu_mul_clamp_ref` (the same exp2 formula): the only
difference is the backend's exp2 (numpy vs torch on CPU, the hardware approximation on GPU):
rare 1-ulp flips. NaN in g or u propagates to y (the clamps are written as selects); NaN in the
fp8 paths is undefined (the amax of a NaN group is backend-specific).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    programmatic_launch,
    round_bf16_native_or_bits,
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.fp8.act_quant import (
    check_group,
    e4m3_codes,
    fp8_group_scale,
    store_quantized_groups,
)
from sgl_dspark.kernels.moe.reference import FP8_GROUP, Fp8Activation

_MAX_BLOCK = 1024
_OUT_MODES = {"plain": 0, "fp8_row": 1, "fp8_group": 2}


@triton.jit
def _clamped_swiglu(
    row_ptr,
    cols,
    inter,
    limit,
    HAS_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ON_BITS: tl.constexpr,
    EVEN: tl.constexpr,
):
    if EVEN:  # the programs tile the row exactly: unpredicated (vectorised) loads
        gate = tl.load(row_ptr + cols).to(tl.float32)
        up = tl.load(row_ptr + inter + cols).to(tl.float32)
    else:
        in_cols = cols < inter
        gate = tl.load(row_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + inter + cols, mask=in_cols, other=0.0).to(tl.float32)
    return clamped_swiglu_values(gate, up, limit, HAS_LIMIT, ROUND_BF16, ON_BITS)


@triton.jit
def clamped_swiglu_values(
    gate, up, limit, HAS_LIMIT: tl.constexpr, ROUND_BF16: tl.constexpr, ON_BITS: tl.constexpr
):
    """The clamped SwiGLU on fp32 gate / up values of any shape (the one definition of its ops
    and their order; kernels that fuse it into a GEMM call it to keep its bits). ROUND_BF16: the
    nearest-even bf16 value, kept in fp32 (on the bits when ON_BITS, i.e. interpreted)."""
    if HAS_LIMIT:
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    one = tl.full(gate.shape, 1.0, tl.float32)
    sigmoid = tl.div_rn(one, 1.0 + tl.exp2(-gate * 1.4426950408889634))
    y = gate * sigmoid * up
    if ROUND_BF16:
        y = round_bf16_native_or_bits(y, ON_BITS)
    return y


@triton.jit
def swiglu_tile(
    acc,
    limit,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ON_BITS: tl.constexpr,
):
    """The clamped SwiGLU of an fp32 [BLOCK_M, 2 * HALF] product tile whose columns [0, HALF)
    are gate and [HALF, 2 * HALF) the matching up outputs: rounded as a plain GEMM's store would
    round them, then `silu_mul_clamp`'s own ops (`clamped_swiglu_values`). Returns
    [BLOCK_M, HALF]."""
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), (0, 2, 1)))
    return clamped_swiglu_values(gate, up, limit, HAS_LIMIT, ROUND_BF16, ON_BITS)


@triton.jit
def weighted_activation(y, w, ROUND_BF16: tl.constexpr, ON_BITS: tl.constexpr):
    """DeepSeek-V4.1's route weight before the down projection: the stored activation rows y
    [BLOCK_M, N] (fp32 holding their stored values) times each row's fp32 weight w [BLOCK_M],
    rounded as stored (`moe_route_gate_up_ref`'s `(h.float() * w).to(dtype)`)."""
    y = y * w[:, None]
    if ROUND_BF16:
        y = round_bf16_native_or_bits(y, ON_BITS)
    return y


@triton.jit
def _silu_mul_clamp_kernel(
    in_ptr,
    out_ptr,
    scale_ptr,
    inter,
    stride_in,
    limit,
    HAS_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    OUT_MODE: tl.constexpr,
    UE8M0: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    ON_BITS: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # gate_up comes from the previous kernel; out may still be read
    row = tl.program_id(0).to(tl.int64)
    row_in = in_ptr + row * stride_in
    row_out = out_ptr + row * inter
    if OUT_MODE == 1:
        # Per-row scale: pass 1 finds amax, pass 2 recomputes y (cheaper than a round trip).
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, inter, BLOCK):
            y = _clamped_swiglu(
                row_in, c0 + tl.arange(0, BLOCK), inter, limit, HAS_LIMIT, ROUND_BF16, ON_BITS, EVEN
            )
            amax = tl.maximum(amax, tl.abs(y))
        scale = fp8_group_scale(tl.max(amax, axis=0), UE8M0)
        for c0 in range(0, inter, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            y = _clamped_swiglu(row_in, cols, inter, limit, HAS_LIMIT, ROUND_BF16, ON_BITS, EVEN)
            codes, _ = e4m3_codes(y, scale)
            tl.store(row_out + cols, codes, mask=cols < inter)
        tl.store(scale_ptr + row, scale)
    else:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        # Plain bf16 output: the store's own cast rounds (compiled); the fp8 epilogues read the
        # rounded values.
        y = _clamped_swiglu(
            row_in,
            cols,
            inter,
            limit,
            HAS_LIMIT,
            ROUND_BF16 and (OUT_MODE != 0 or ON_BITS),
            ON_BITS,
            EVEN,
        )
        if OUT_MODE == 0:
            if EVEN:
                tl.store(row_out + cols, y.to(out_ptr.dtype.element_ty))
            else:
                tl.store(row_out + cols, y.to(out_ptr.dtype.element_ty), mask=cols < inter)
        else:
            # Lanes past the row hold silu(0) * 0 = 0: a partial last group's amax is its own.
            n_groups = tl.cdiv(inter, GROUP)
            store_quantized_groups(
                y,
                cols,
                cols < inter,
                tl.program_id(1) * (BLOCK // GROUP),
                n_groups,
                row_out,
                scale_ptr + row * n_groups,
                BLOCK,
                GROUP,
                UE8M0,
                False,
            )


def _act_meta(rows: int, inter: int, mode: int) -> dict[str, int]:
    """Launch meta-parameters: BLOCK columns per program (a power of two >= 128; the launcher
    widens it to the fp8 group, so groups never straddle programs) and warps. Every output element (and every fp8
    group's or row's amax, a max) is computed the same way for any choice, so the bits do not
    depend on it; `benchmark/kernels/sweep_launch.py` times alternatives against this default:
    the plain output in 128-column programs (more programs at small M), the fp8 modes whole
    rows."""
    if mode == 0:
        return {"BLOCK": FP8_GROUP, "num_warps": 4}
    return {
        "BLOCK": min(_MAX_BLOCK, max(FP8_GROUP, triton.next_power_of_2(inter))),
        "num_warps": 4,
    }


def silu_mul_clamp(
    gate_up: torch.Tensor,
    limit: float | None = None,
    out_format: str = "plain",
    scale_ue8m0: bool = False,
    out: torch.Tensor | None = None,
    group: int = FP8_GROUP,
) -> torch.Tensor | Fp8Activation:
    """`silu_mul_clamp_ref` in one launch, any width.

    Args:
        gate_up: [R, 2I] bf16 or fp32, last dim contiguous (rows may be strided); gate columns
            first, up columns second.
        limit: swiglu_limit (> 0); None disables both clamps.
        out_format: "plain" -> [R, I] in gate_up's dtype; "fp8_row" / "fp8_group" ->
            `Fp8Activation` (fp8 e4m3 codes + fp32 scales per row / per `group` columns, the
            last group of a row partial when `group` does not divide I).
        scale_ue8m0: round fp8 scales up to a power of two.
        out: optional output for "plain" ([R, I], gate_up's dtype, contiguous).
        group: "fp8_group"'s columns per scale, a power of two in [16, 2048].
    """
    require(
        out_format in _OUT_MODES,
        f"out_format must be one of {sorted(_OUT_MODES)}, got {out_format!r}",
    )
    require(
        gate_up.dim() == 2 and (not gate_up.shape[1] % 2),
        f"gate_up must be [R, 2I], got {tuple(gate_up.shape)}",
    )
    require(
        gate_up.dtype in (torch.bfloat16, torch.float32),
        f"gate_up dtype must be bf16 or fp32, got {gate_up.dtype}",
    )
    require(gate_up.stride(1) == 1, "gate_up last dim must be contiguous")
    require(limit is None or limit > 0, f"limit must be > 0, got {limit}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    mode = _OUT_MODES[out_format]
    if mode == 2:
        check_group(group)
    scale = None
    if mode == 0:
        if out is None:
            out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        require(
            out.shape == (rows, inter) and out.dtype == gate_up.dtype and out.is_contiguous(),
            f"out must be contiguous {gate_up.dtype} {(rows, inter)}",
        )
    else:
        require(out is None, "out= is only supported for out_format='plain'")
        out = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
        n_scales = 1 if mode == 1 else triton.cdiv(inter, group)
        scale = torch.empty(rows, n_scales, dtype=torch.float32, device=gate_up.device)
    if rows and inter:
        meta = _act_meta(rows, inter, mode)
        if mode == 2:
            meta["BLOCK"] = max(meta["BLOCK"], group)
        assert mode != 2 or meta["BLOCK"] % group == 0, meta
        grid = (rows, 1 if mode == 1 else triton.cdiv(inter, meta["BLOCK"]))
        _silu_mul_clamp_kernel[grid](
            gate_up,
            out if mode == 0 else out.view(torch.uint8),  # fp8 modes store E4M3 bit patterns
            scale if scale is not None else out,
            inter,
            gate_up.stride(0),
            float(limit) if limit is not None else 0.0,
            HAS_LIMIT=limit is not None,
            ROUND_BF16=gate_up.dtype == torch.bfloat16,
            OUT_MODE=mode,
            UE8M0=bool(scale_ue8m0),
            GROUP=group,
            ON_BITS=interpreted(_silu_mul_clamp_kernel),
            EVEN=inter % meta["BLOCK"] == 0,
            # The reference rounds every product separately; keep the compiler from contracting
            # any future mul+add into an FMA, which would move y (so the amax and the fp8 scale)
            # by an ulp between the plain and the fp8 variants.
            enable_fp_fusion=False,
            **programmatic_launch(_silu_mul_clamp_kernel, gate_up.device),
            **meta,
        )
    if scale is not None:
        return Fp8Activation(out, scale)
    return out
