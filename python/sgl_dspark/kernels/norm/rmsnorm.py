"""RMSNorm over the last dim in one launch (the torch chain of `rms_norm_ref` is ~8 kernels).

Exactness: within a tolerance of `rms_norm_ref`. The kernel sums squares in a tree fixed by the
row width N (the block shape and warp count depend on N only, never on the row count, so a row's
result does not depend on the batch it is in), while torch's `mean` uses its own order. The
rsqrt is `tl.rsqrt` (the hardware approximation on GPU, as torch's CUDA rsqrt; numpy's
`1 / sqrt` in the interpreter, where torch's CPU rsqrt differs in the last bit for ~15% of
inputs). Given the same rstd, every later step equals torch bit for bit: products are separate
fp32 roundings (FMA contraction is disabled) and 16-bit results are rounded to nearest even. So
outputs differ from the reference by at most one or two units in the last place of x's dtype,
and only where rstd's last bits differ (fp32: a few ulps; bf16/fp16: well under 1% of elements
in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)

# The whole row lives in registers (one load, one store); 16384 fp32 values over 16 warps is 32
# registers a thread, the most we allow. DeepSeek-V4's widest norm is the hidden size (4096).
MAX_N = 16384
# Elements of x one program handles when rows of <= 512 are packed several per program.
_PACKED_TILE = 2048


@triton.jit
def _norm_rows(
    x_ptr,
    weight_ptr,
    out_ptr,
    n_rows,
    x_row_stride,
    eps,
    block,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    KIND: tl.constexpr,
    FULL_TILE: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [block * BLOCK_M, (block + 1) * BLOCK_M) of one norm (the kernel's whole work;
    `_rms_norm_pair_kernel` runs two norms' blocks in one grid)."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :]
    # The weight is loaded with x, in x's [BLOCK_M, BLOCK_N] shape: loaded after the reduction
    # it would be a second memory round trip on the critical path, and a 1-D layout would go
    # through shared memory to meet x's.
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
        # a multiply has no slow path: a correctly rounded division can call a slow subroutine
        # for a zero dividend (the masked rows of a packed tile at small M, all-zero rows).
        mean_sq = sum_sq * (1.0 / N)
    else:
        mean_sq = tl.div_rn(sum_sq, N * 1.0)
    rstd = tl.rsqrt(mean_sq + eps)[:, None]
    if HAS_WEIGHT:
        y = w * (x * rstd)
    else:
        y = x * round_to_dtype(rstd, KIND, ON_BITS)
    if ON_BITS:  # compiled, the store's own cast rounds to nearest even
        y = round_to_dtype(y, KIND, ON_BITS)
    if FULL_TILE:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


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
    KIND: tl.constexpr,
    FULL_TILE: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    _norm_rows(
        x_ptr,
        weight_ptr,
        out_ptr,
        n_rows,
        x_row_stride,
        eps,
        tl.program_id(0),
        N,
        BLOCK_M,
        BLOCK_N,
        HAS_WEIGHT,
        KIND,
        FULL_TILE,
        ON_BITS,
        PDL,
    )


@triton.jit
def _rms_norm_pair_kernel(
    a_ptr,
    a_weight_ptr,
    a_out_ptr,
    a_rows,
    a_row_stride,
    a_eps,
    a_blocks,
    b_ptr,
    b_weight_ptr,
    b_out_ptr,
    b_rows,
    b_row_stride,
    b_eps,
    A_N: tl.constexpr,
    A_BLOCK_M: tl.constexpr,
    A_BLOCK_N: tl.constexpr,
    A_HAS_WEIGHT: tl.constexpr,
    A_FULL_TILE: tl.constexpr,
    B_N: tl.constexpr,
    B_BLOCK_M: tl.constexpr,
    B_BLOCK_N: tl.constexpr,
    B_HAS_WEIGHT: tl.constexpr,
    B_FULL_TILE: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Programs [0, a_blocks) run norm a's row blocks, the rest norm b's, each with its own
    # launch's tile (the warps are the launch's: `rms_norm_pair` fuses only equal ones).
    block = tl.program_id(0)
    if block < a_blocks:
        _norm_rows(
            a_ptr,
            a_weight_ptr,
            a_out_ptr,
            a_rows,
            a_row_stride,
            a_eps,
            block,
            A_N,
            A_BLOCK_M,
            A_BLOCK_N,
            A_HAS_WEIGHT,
            KIND,
            A_FULL_TILE,
            ON_BITS,
            PDL,
        )
    else:
        _norm_rows(
            b_ptr,
            b_weight_ptr,
            b_out_ptr,
            b_rows,
            b_row_stride,
            b_eps,
            block - a_blocks,
            B_N,
            B_BLOCK_M,
            B_BLOCK_N,
            B_HAS_WEIGHT,
            KIND,
            B_FULL_TILE,
            ON_BITS,
            PDL,
        )


def _norm_meta(n: int) -> dict[str, int]:
    """Launch meta-parameters from the row width only. They fix the layout of a row over
    threads, hence its summation tree (Triton's per-thread vector width follows the tile size):
    any change, rows per program included, can move rstd's last bit, and a rule that looked at
    the row count would make a row's bits depend on its batch. `benchmark/kernels/
    sweep_launch.py` times alternatives and flags those whose bits differ from this default:
    one row per program above 512 (packed rows would idle at M = 1), warps growing with N."""
    block_n = triton.next_power_of_2(n)
    if block_n <= 512:
        # Rows of <= 512 (per-head norms: 64 x M rows of 512) are packed 2048 elements per
        # program: one row per program would launch thousands of small programs.
        return {"BLOCK_M": _PACKED_TILE // block_n, "BLOCK_N": block_n, "num_warps": 4}
    return {"BLOCK_M": 1, "BLOCK_N": block_n, "num_warps": min(16, max(4, block_n // 512))}


def _checked(
    x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """`rms_norm`'s argument checks (ValueError naming the argument): (out, allocated when None;
    x's row stride)."""
    require(
        x.dtype in FLOAT_DTYPES and x.dim() >= 1,
        f"x must be [..., N] fp32/bf16/fp16, got {x.dtype} {tuple(x.shape)}",
    )
    n = x.shape[-1]
    two_d_rows = x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= n
    require(
        x.is_contiguous() or two_d_rows,
        f"x must be contiguous or 2-D with unit stride along N, got shape "
        f"{tuple(x.shape)} strides {x.stride()}",
    )
    row_stride = n if x.is_contiguous() else x.stride(0)
    if weight is not None:
        require(
            weight.shape == (n,) and weight.is_floating_point() and weight.stride(0) == 1,
            f"weight must be a contiguous float [{n}], got {weight.dtype} "
            f"{tuple(weight.shape)} strides {weight.stride()}",
        )
        require(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    require(
        out.shape == x.shape
        and out.dtype == x.dtype
        and out.is_contiguous()
        and out.device == x.device,
        f"out must be a contiguous {x.dtype} {tuple(x.shape)} on {x.device}, "
        f"got {out.dtype} {tuple(out.shape)} on {out.device}",
    )
    require(
        n <= MAX_N or x.numel() == 0,
        f"rms_norm supports rows of at most {MAX_N} elements, got N={n}",
    )
    return out, row_stride


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rms_norm_ref` in one launch (within a tolerance, see the module doc).

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
    out, row_stride = _checked(x, weight, out)
    if x.numel() == 0:
        return out
    n = x.shape[-1]
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
        KIND=DTYPE_KIND[x.dtype],
        FULL_TILE=meta["BLOCK_M"] == 1 and meta["BLOCK_N"] == n,
        ON_BITS=interpreted(_rms_norm_kernel),
        enable_fp_fusion=False,
        **programmatic_launch(_rms_norm_kernel, x.device),
        **meta,
    )
    return out


# One norm of `rms_norm_pair`: (x, weight or None, eps).
NormArgs = tuple[torch.Tensor, torch.Tensor | None, float]


def rms_norm_pair(a: NormArgs, b: NormArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `rms_norm` calls (arguments as there, each without `out`) in one launch when their
    tiles run on as many warps, else two: every row's bits are its own call's (each norm keeps
    its own tile, hence its summation tree). x's of one dtype and device (DeepSeek-V4.1's q_a
    and kv norms, column blocks of one projection output)."""
    (xa, wa, eps_a), (xb, wb, eps_b) = a, b
    require(
        xa.dtype == xb.dtype and xa.device == xb.device,
        f"rms_norm_pair: x's of one dtype and device, got {xa.dtype} on {xa.device} and "
        f"{xb.dtype} on {xb.device}",
    )
    meta_a, meta_b = _norm_meta(xa.shape[-1]), _norm_meta(xb.shape[-1])
    if meta_a["num_warps"] != meta_b["num_warps"] or xa.numel() == 0 or xb.numel() == 0:
        return rms_norm(xa, wa, eps_a), rms_norm(xb, wb, eps_b)
    out_a, stride_a = _checked(xa, wa, None)
    out_b, stride_b = _checked(xb, wb, None)
    rows_a, rows_b = xa.numel() // xa.shape[-1], xb.numel() // xb.shape[-1]
    blocks_a = triton.cdiv(rows_a, meta_a["BLOCK_M"])
    blocks = blocks_a + triton.cdiv(rows_b, meta_b["BLOCK_M"])
    _rms_norm_pair_kernel[(blocks,)](
        xa,
        xa if wa is None else wa,
        out_a,
        rows_a,
        stride_a,
        float(eps_a),
        blocks_a,
        xb,
        xb if wb is None else wb,
        out_b,
        rows_b,
        stride_b,
        float(eps_b),
        A_N=xa.shape[-1],
        A_BLOCK_M=meta_a["BLOCK_M"],
        A_BLOCK_N=meta_a["BLOCK_N"],
        A_HAS_WEIGHT=wa is not None,
        A_FULL_TILE=meta_a["BLOCK_M"] == 1 and meta_a["BLOCK_N"] == xa.shape[-1],
        B_N=xb.shape[-1],
        B_BLOCK_M=meta_b["BLOCK_M"],
        B_BLOCK_N=meta_b["BLOCK_N"],
        B_HAS_WEIGHT=wb is not None,
        B_FULL_TILE=meta_b["BLOCK_M"] == 1 and meta_b["BLOCK_N"] == xb.shape[-1],
        KIND=DTYPE_KIND[xa.dtype],
        ON_BITS=interpreted(_rms_norm_pair_kernel),
        num_warps=meta_a["num_warps"],
        enable_fp_fusion=False,
        **programmatic_launch(_rms_norm_pair_kernel, xa.device),
    )
    return out_a, out_b
