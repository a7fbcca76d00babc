"""Routed experts on microscaling formats: MXFP8 activations x MXFP4 expert weights through
`tl.dot_scaled`, for targets whose matrix units execute it (gfx950's scaled MFMA, Blackwell's
block-scaled MMA at 128-row blocks; `targets.mx_dot_rows`). `mx_fused_moe_ref` is the spec.

The layout is `fused_moe`'s (`moe/grouped_gemm.py`): `moe_sort`'s blocks of one local expert,
one (block x N tile) per program, two launches of one kernel:

  stage 1: h = MXFP8(act(x_mx @ gate_up[e].T))   x_mx: x quantised to MXFP8 by its producer (the
           mHC boundary when it writes this format) or by `quantize_act_mxfp8`; the epilogue
           rounds the product as a plain GEMM stores it, applies the clamped SwiGLU
           (`swiglu_tile`, and the V4.1 route weight) and quantises the activation to MXFP8 per
           32 channels: E4M3 codes and E8M0 bytes per route row, stage 2's operands as they are
           (as AITER's MegaMoE stage 1 emits them);
  stage 2: y = h_mx @ down[e].T                   rounded to x's dtype, per (token, slot).

Each K step is one `tl.dot_scaled(a, a_scales, "e4m3", w, w_scales, "e2m1")` over 128 channels
(4 scale groups), the weight tile taken packed as stored (two E2M1 codes a byte along K, the
low nibble first, which is `dot_scaled`'s packing) and its E8M0 bytes as stored.

Exactness: against `mx_fused_moe_ref`, the matrix unit multiplies exact MXFP8 x MXFP4 products
with their scales and accumulates in fp32 in its own order: a tolerance of the fp32 sums; the
epilogue's activation and its MXFP8 codes are bit-exact given the rounded product. Against
dequantise-then-bf16 (the W4A16 path) the change is the MXFP8 rounding of x and of the
activation (`act_quant_error_bound_ref` with group 32). The Triton interpreter cannot run
`tl.dot_scaled`: on CPU tensors the kernel forms the same products from the dequantised tiles
with an fp32 dot (EMULATE), so the tests check everything else it does (routing, epilogue,
quantisation) there; the scaled instruction is checked by compiling for gfx950.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    interpreted,
    programmatic_launch,
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.fp8.act_quant import (
    e4m3_codes,
    e8m0_byte,
    fp8_group_scale,
    quantize_act_mxfp8,
)
from sgl_dspark.kernels.fp8.reference import MX_GROUP
from sgl_dspark.kernels.linear.dequant import E2M1_FP16_SHIFT, e2m1_to, e8m0_to_fp32
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight
from sgl_dspark.kernels.moe.activation import swiglu_tile, weighted_activation
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe_out
from sgl_dspark.kernels.moe.reference import MoeSortOutput
from sgl_dspark.kernels.quant.reference import Fp8Rows

BLOCK_K = 128
_BLOCK_N = 128  # stage 1: 64 gate and 64 up columns a tile, two MXFP8 groups of output


@triton.jit
def _emulated_scaled_dot(a, a_exp, w, w_exp, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """`tl.dot_scaled(a, a_exp, "e4m3", w, w_exp, "e2m1")` from dequantised tiles (fp32 dot):
    the interpreter's stand-in. a [BM, BK] E4M3, a_exp [BM, BK / 32], w [BK / 2, BN] packed
    E2M1 (low nibble = even channel), w_exp [BN, BK / 32]."""
    G: tl.constexpr = BK // 32
    a_val = tl.reshape(a.to(tl.float32), [BM, G, 32]) * e8m0_to_fp32(a_exp)[:, :, None]
    lo = e2m1_to(w & 15, tl.float32) * E2M1_FP16_SHIFT
    hi = e2m1_to(w >> 4, tl.float32) * E2M1_FP16_SHIFT
    w_val = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BK, BN])  # channel 2j, 2j + 1
    w_val = tl.reshape(w_val, [G, 32, BN]) * tl.trans(e8m0_to_fp32(w_exp))[:, None, :]
    return tl.dot(tl.reshape(a_val, [BM, BK]), tl.reshape(w_val, [BK, BN]), input_precision="ieee")


@triton.jit
def _mx_moe_gemm_kernel(
    a_ptr,
    a_exp_ptr,
    w_ptr,
    w_exp_ptr,
    out_ptr,
    out_exp_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_valid_ptr,
    act_weights_ptr,
    num_tokens,
    n_cols,
    k_dim,
    stride_a,
    stride_a_exp,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_out,
    stride_out_exp,
    limit,
    TOPK: tl.constexpr,
    A_PER_PAIR: tl.constexpr,
    OUT_SWIGLU: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    WEIGHT_ACT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EMULATE: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the sort's layout and the activation come from earlier kernels
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_valid_ptr):
        return  # past the valid prefix: undefined ids
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    packed = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    token = (packed & 0xFFFFFF).to(tl.int64)
    pair = token * TOPK + (packed >> 24).to(tl.int64)
    live = token < num_tokens
    a_rows = pair if A_PER_PAIR else token
    if OUT_SWIGLU:
        # Tile columns [0, HALF): gate rows j of the weight; [HALF, BLOCK_N): up rows I + j.
        HALF: tl.constexpr = BLOCK_N // 2
        cols = pid_n * HALF + tl.arange(0, BLOCK_N) % HALF
        col_ok = cols < n_cols
        w_rows = tl.where(tl.arange(0, BLOCK_N) < HALF, cols, cols + n_cols).to(tl.int64)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w_rows = cols.to(tl.int64)
    G: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_g = tl.arange(0, G)
    a_base = a_ptr + a_rows * stride_a
    a_exp_base = a_exp_ptr + a_rows * stride_a_exp
    w_base = w_ptr + expert * stride_we + w_rows * stride_wn
    w_exp_base = w_exp_ptr + expert * stride_wse + w_rows * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + offs_k < k_dim
        g_ok = k0 // 32 + offs_g < k_dim // 32
        a = tl.load(
            a_base[:, None] + k0 + offs_k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0
        )
        a_exp = tl.load(
            a_exp_base[:, None] + k0 // 32 + offs_g[None, :],
            mask=live[:, None] & g_ok[None, :],
            other=0,
        )
        w = tl.load(
            w_base[None, :] + k0 // 2 + offs_kb[:, None],
            mask=(k0 // 2 + offs_kb < k_dim // 2)[:, None] & col_ok[None, :],
            other=0,
        )
        w_exp = tl.load(
            w_exp_base[:, None] + k0 // 32 + offs_g[None, :],
            mask=col_ok[:, None] & g_ok[None, :],
            other=0,
        )
        if EMULATE:
            acc += _emulated_scaled_dot(a, a_exp, w, w_exp, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = tl.dot_scaled(a, a_exp, "e4m3", w, w_exp, "e2m1", acc)
    if OUT_SWIGLU:
        y = swiglu_tile(acc, limit, BLOCK_M, HALF, HAS_LIMIT, ROUND_BF16, ON_BITS)
        if WEIGHT_ACT:
            rw = tl.load(act_weights_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            y = weighted_activation(y, rw, ROUND_BF16, ON_BITS)
        # MXFP8 per 32 output channels: the tile's HALF columns are whole groups.
        groups = tl.reshape(y, [BLOCK_M, HALF // 32, 32])
        scale = fp8_group_scale(tl.max(tl.abs(groups), axis=2), True)
        codes, _ = e4m3_codes(groups, scale[:, :, None])
        j = pid_n * HALF + tl.arange(0, HALF)
        tl.store(
            out_ptr + pair[:, None] * stride_out + j[None, :],
            tl.reshape(codes, [BLOCK_M, HALF]),
            mask=live[:, None] & (j < n_cols)[None, :],
        )
        gj = pid_n * (HALF // 32) + tl.arange(0, HALF // 32)
        tl.store(
            out_exp_ptr + pair[:, None] * stride_out_exp + gj[None, :],
            e8m0_byte(scale),
            mask=live[:, None] & (gj < n_cols // 32)[None, :],
        )
    else:
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        tl.store(
            out_ptr + pair[:, None] * stride_out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=live[:, None] & col_ok[None, :],
        )


def check_mx_weight(name: str, weight: QuantizedWeight, k: int) -> None:
    """An MXFP4 expert stack [E, N, K] with scale groups of 32 and contiguous rows."""
    check_quantized_weight(weight, name)
    require(
        weight.fmt == "mxfp4" and weight.group == MX_GROUP and weight.data.dim() == 3,
        f"{name}: an MXFP4 expert stack with scale groups of 32, got {weight.fmt} / "
        f"{weight.group} {weight.shape}",
    )
    require(weight.shape[2] == k, f"{name}: expected K = {k}, got {weight.shape[2]}")
    require(
        weight.data.stride(2) == 1 and weight.scale.stride(2) == 1,
        f"{name}: data and scales need unit stride along K",
    )


def mx_supported(gate_up: object, down: object) -> bool:
    """Whether both expert stacks are MXFP4 with groups of 32 (the MX path's weights)."""
    return all(
        isinstance(w, QuantizedWeight) and w.fmt == "mxfp4" and w.group == MX_GROUP
        for w in (gate_up, down)
    )


def _launch(
    a: Fp8Rows,
    weight: QuantizedWeight,
    sort: MoeSortOutput,
    num_tokens: int,
    topk: int,
    out: torch.Tensor,
    out_exp: torch.Tensor | None,
    block_size: int,
    limit: float | None,
    act_weights: torch.Tensor | None,
    round_bf16: bool,
) -> None:
    swiglu = out_exp is not None
    n_cols = weight.shape[1] // 2 if swiglu else weight.shape[1]
    k_dim = weight.shape[2]
    grid = (sort.sorted_expert_ids.numel(), triton.cdiv(weight.shape[1], _BLOCK_N))
    _mx_moe_gemm_kernel[grid](
        a.codes,
        a.exponents,
        weight.data,
        weight.scale,
        out,
        out_exp if out_exp is not None else out,
        sort.sorted_ids,
        sort.sorted_expert_ids,
        sort.num_valid,
        act_weights if act_weights is not None else sort.sorted_weights,
        num_tokens,
        n_cols,
        k_dim,
        a.codes.stride(0),
        a.exponents.stride(0),
        weight.data.stride(0),
        weight.data.stride(1),
        weight.scale.stride(0),
        weight.scale.stride(1),
        out.stride(0),
        out_exp.stride(0) if out_exp is not None else 0,
        float(limit) if limit is not None else 0.0,
        TOPK=topk,
        A_PER_PAIR=not swiglu,
        OUT_SWIGLU=swiglu,
        HAS_LIMIT=limit is not None,
        WEIGHT_ACT=act_weights is not None,
        ROUND_BF16=round_bf16,
        BLOCK_M=block_size,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=BLOCK_K,
        EMULATE=interpreted(_mx_moe_gemm_kernel),
        ON_BITS=interpreted(_mx_moe_gemm_kernel),
        num_warps=4,
        num_stages=2,
        **programmatic_launch(_mx_moe_gemm_kernel, a.codes.device),
    )


def mx_fused_moe(
    x: torch.Tensor,
    gate_up_proj: QuantizedWeight,
    down_proj: QuantizedWeight,
    sort: MoeSortOutput,
    topk: int,
    limit: float | None,
    block_size: int = 32,
    out: torch.Tensor | None = None,
    weight_before_down: bool = False,
    x_mx: Fp8Rows | None = None,
) -> torch.Tensor:
    """`mx_fused_moe_ref` over `moe_sort`'s layout: stage 1 with the SwiGLU and the MXFP8
    epilogue, then stage 2 (two launches, plus `quantize_act_mxfp8` of x when `x_mx` is not
    given; no host sync).

    Args:
        x: [M, D] bf16 or fp32, contiguous.
        gate_up_proj: MXFP4 [E_loc, 2I, D] (gate rows, then up rows), scale groups of 32.
        down_proj: MXFP4 [E_loc, D, I]; D and I multiples of 32.
        sort: `moe_sort(...)` of the routes for `block_size` (a power of two >= 16).
        topk, limit, weight_before_down: as `fused_moe`.
        out: optional contiguous [M, topk, D] in x's dtype.
        x_mx: x's MXFP8 form when its producer wrote it (`quantize_act_mxfp8_ref(x)`'s values).
    Returns:
        y [M, topk, D]; rows of remote routes are left as they were.
    """
    require(
        x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous(),
        f"x must be contiguous bf16/fp32 [M, D], got {x.dtype} {tuple(x.shape)}",
    )
    num_tokens, hidden = x.shape
    check_mx_weight("gate_up_proj", gate_up_proj, hidden)
    require(gate_up_proj.shape[1] % 64 == 0, "gate_up_proj: 2I must be a multiple of 64")
    inter = gate_up_proj.shape[1] // 2
    check_mx_weight("down_proj", down_proj, inter)
    out = fused_moe_out(x, gate_up_proj, down_proj, sort, topk, limit, block_size, out)
    require(hidden % MX_GROUP == 0, f"MXFP8 activations need D % 32 == 0, got D = {hidden}")
    if num_tokens == 0 or gate_up_proj.shape[0] == 0:
        return out
    if x_mx is None:
        x_mx = quantize_act_mxfp8(x)
    require(
        tuple(x_mx.codes.shape) == (num_tokens, hidden)
        and tuple(x_mx.exponents.shape) == (num_tokens, hidden // MX_GROUP)
        and x_mx.codes.dtype == torch.float8_e4m3fn
        and x_mx.exponents.dtype == torch.uint8,
        "x_mx: MXFP8 rows of x (codes [M, D] float8_e4m3fn, exponents [M, D / 32] uint8)",
    )
    rows = num_tokens * topk
    h = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
    h_exp = torch.empty(rows, inter // MX_GROUP, dtype=torch.uint8, device=x.device)
    bf16 = x.dtype == torch.bfloat16
    act_weights = sort.sorted_weights if weight_before_down else None
    _launch(
        x_mx,
        gate_up_proj,
        sort,
        num_tokens,
        topk,
        h.view(torch.uint8),
        h_exp,
        block_size,
        limit,
        act_weights,
        bf16,
    )
    _launch(
        Fp8Rows(h, h_exp),
        down_proj,
        sort,
        num_tokens,
        topk,
        out.view(rows, hidden),
        None,
        block_size,
        None,
        None,
        bf16,
    )
    return out


__all__ = ["check_mx_weight", "mx_fused_moe", "mx_supported"]
