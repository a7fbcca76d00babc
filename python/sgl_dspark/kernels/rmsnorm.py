"""RMSNorm over the last dim in one launch (the chain of ~8 torch kernels of `norm.rms_norm`).

Two variants, as in DeepSeek-V4 (deepseek_v4_model.md §0), with different rounding points:
    weighted:   y = dtype( w_f32 * (x_f32 * rstd) )           rstd = 1 / sqrt(mean(x_f32^2) + eps)
    weightless: y = dtype( x_f32 * dtype(rstd) )              (HF's UnweightedRMSNorm: rstd is cast
                                                               to x's dtype before the multiply)

Exactness: X2 (kernels.md §0.3). The kernel sums squares in a tree fixed by the row width N (the
block shape and warp count depend on N only, never on the row count, so a row's result does not
depend on the batch it is in), while torch's `mean` uses its own order. The rsqrt is `tl.rsqrt`
(the hardware approximation on GPU, as torch's CUDA rsqrt; numpy's `1 / sqrt` in the interpreter,
where torch's CPU rsqrt differs in the last bit for ~15% of inputs). Given the same rstd, every
later step equals torch bit for bit: products are separate fp32 roundings (FMA contraction is
disabled) and bf16 results are rounded to nearest-even (on the bits in the interpreter, whose
own fp32 -> bf16 cast truncates, §0.4; compiled, by the native cast: the same bits). So outputs differ from the reference by at most one or two
units in the last place of x's dtype, and only where rstd's last bits differ (fp32: a few ulps;
bf16/fp16: well under 1% of elements in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import (
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_bf16_native_or_bits,
    round_to_storage,
    wait_for_producers,
)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The whole row lives in registers (one load, one store); 16384 fp32 values over 16 warps is 32
# registers a thread, the most we allow. DeepSeek-V4's widest norm is the hidden size (4096).
MAX_N = 16384
# Elements of x one program handles when rows of <= 512 are packed several per program.
_PACKED_TILE = 2048


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Reference (the spec): RMSNorm over the last dim of x, math in fp32.

    x: [..., N] fp32/bf16/fp16. weight: [N] (any float dtype) or None.
    Weighted: `(w_f32 * (x_f32 * rsqrt(mean(x_f32^2) + eps))).to(x.dtype)`.
    Weightless: `x * rsqrt(mean(x_f32^2) + eps).to(x.dtype)` (rstd rounded to x's dtype first).
    Returns a tensor of x's shape and dtype.
    """
    if weight is None:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return x * rstd.to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


@triton.jit
def _round_to_dtype(v, IS_BF16: tl.constexpr, IS_FP16: tl.constexpr, ON_BITS: tl.constexpr):
    """fp32 -> the nearest-even value of the storage dtype, kept in fp32 (exact on store). bf16
    on the bits in the interpreter only (`_triton_utils.interpreted`); compiled, the native
    cast rounds the same way."""
    if IS_BF16:
        v = round_bf16_native_or_bits(v, ON_BITS)
    elif IS_FP16:
        v = round_to_storage(v, 2)
    return v


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    n_rows,
    x_row_stride,
    eps,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    IS_BF16: tl.constexpr,
    IS_FP16: tl.constexpr,
    FULL_TILE: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :]
    # The weight is loaded with x, in x's [BLOCK_M, BLOCK_N] shape: loaded after the reduction
    # it was a second memory round trip on the critical path, and its 1-D layout went through
    # shared memory to meet x's (seen in the sm90 SASS).
    w_ptrs = weight_ptr + (rows * 0)[:, None] + cols[None, :]
    if HAS_WEIGHT and PDL:
        # The weight is no kernel's output: it streams into L2 while the previous kernel
        # finishes. A prefetch, not a load, so the compiler cannot move x's load above the
        # wait with it.
        prefetch_tile_l2(weight_ptr, tl.zeros([1], tl.int32), 0, 0, N, BLOCK_N)
    wait_for_producers(PDL)
    if FULL_TILE:  # one row per program (grid = rows) and N == BLOCK_N: no lane overhangs
        if HAS_WEIGHT:
            w = tl.load(w_ptrs).to(tl.float32)
        x = tl.load(x_ptrs).to(tl.float32)
    else:
        if HAS_WEIGHT:
            w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    # Masked columns load 0 and add nothing; the tree over BLOCK_N depends on N only.
    sum_sq = tl.sum(x * x, axis=1)
    if (N & (N - 1)) == 0:
        # Dividing by a power of two is multiplying by its exact reciprocal (same rounding), and
        # a multiply has no slow path: NVIDIA's div_rn calls a slow subroutine for a zero
        # dividend (the masked rows of a packed tile at small M, all-zero rows).
        mean_sq = sum_sq * (1.0 / N)
    else:
        mean_sq = tl.div_rn(sum_sq, N * 1.0)
    rstd = tl.rsqrt(mean_sq + eps)[:, None]
    if HAS_WEIGHT:
        y = w * (x * rstd)
    else:
        y = x * _round_to_dtype(rstd, IS_BF16, IS_FP16, ON_BITS)
    if ON_BITS:  # compiled, the store's own cast rounds to nearest even
        y = _round_to_dtype(y, IS_BF16, IS_FP16, ON_BITS)
    if FULL_TILE:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_meta(n: int) -> dict[str, int]:
    """Launch meta-parameters from the row width only. They fix the layout of a row over
    threads, hence its summation tree (Triton's per-thread vector width follows the tile size):
    any change, rows per program included, can move rstd's last bit, and a rule that looked at
    the row count would make a row's bits depend on its batch. `benchmark/kernels/
    sweep_launch.py` times alternatives and flags those whose bits differ from this default.
    H200 sweep (kernels.md): one row per program (D 1024: 1.67 against 1.93 us at M = 1, where
    4-row programs idle 3 rows) and 8 warps at D 4096 (2.07 against 2.14 us), same bits there."""
    block_n = triton.next_power_of_2(n)
    if block_n <= 512:
        # Rows of <= 512 (per-head norms: 64 x M rows of 512) are packed 2048 elements per
        # program: one row per program left the wide launches at 1.2-1.6x torch.compile's time
        # (thousands of 128-thread programs). H200 sweep at N 512 (sixth session, kernels.md):
        # 4 rows won at M = 128 (3.69 against 6.39 us for 1 row), 1-2 rows at M = 1 / 24 by
        # 0.1 us.
        return {"BLOCK_M": _PACKED_TILE // block_n, "BLOCK_N": block_n, "num_warps": 4}
    return {"BLOCK_M": 1, "BLOCK_N": block_n, "num_warps": min(16, max(4, block_n // 512))}


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of a `[..., N]` tensor, in one launch (X2, see module).

    Args:
        x: [..., N] fp32/bf16/fp16, 1 <= N <= MAX_N (any N, not only powers of two); rows = the
            product of the leading dims. Contiguous, or 2-D rows with unit stride along N and any
            row stride (a column block of a wider projection output, read in place).
        weight: [N] contiguous float tensor on x's device (weighted variant), or None
            (weightless: rstd rounded to x's dtype before the multiply).
        eps: added to the mean square.
        out: optional contiguous buffer of x's shape and dtype (may be x itself: each program
            reads its rows completely before writing them).
    Returns:
        `out` (allocated when None). Empty inputs return before any launch. No host sync, so the
        call can be captured in a CUDA graph.
    """
    if x.dtype not in _SUPPORTED_DTYPES or x.dim() < 1:
        raise ValueError(f"x must be [..., N] fp32/bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    n = x.shape[-1]
    if x.is_contiguous():
        row_stride = n
    elif x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= n:
        row_stride = x.stride(0)
    else:
        raise ValueError(
            f"x must be contiguous or 2-D with unit stride along N, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    if weight is not None:
        if weight.shape != (n,) or not weight.is_floating_point() or weight.stride(0) != 1:
            raise ValueError(
                f"weight must be a contiguous float [{n}], got {weight.dtype} "
                f"{tuple(weight.shape)} strides {weight.stride()}"
            )
        if weight.device != x.device:
            raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif (
        out.shape != x.shape
        or out.dtype != x.dtype
        or not out.is_contiguous()
        or (out.device != x.device)
    ):
        raise ValueError(
            f"out must be a contiguous {x.dtype} {tuple(x.shape)} on {x.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if x.numel() == 0:
        return out
    if n > MAX_N:
        raise ValueError(f"rms_norm supports rows of at most {MAX_N} elements, got N={n}")
    n_rows = x.numel() // n
    meta = _norm_meta(n)
    _rms_norm_kernel[(triton.cdiv(n_rows, meta["BLOCK_M"]),)](
        x,
        x if weight is None else weight,
        out,
        n_rows,
        row_stride,
        float(eps),
        N=n,
        HAS_WEIGHT=weight is not None,
        IS_BF16=x.dtype == torch.bfloat16,
        IS_FP16=x.dtype == torch.float16,
        FULL_TILE=meta["BLOCK_M"] == 1 and meta["BLOCK_N"] == n,
        ON_BITS=interpreted(_rms_norm_kernel),
        enable_fp_fusion=False,
        **programmatic_launch(_rms_norm_kernel, x.device),
        **meta,
    )
    return out
