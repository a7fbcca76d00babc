"""The mHC boundary's kernel (device code): phase A, the pass over D (`stream_update.py`), and
phase B, the per-row finishes (`coefficients.py`). `post_combine.py` launches it (grids, launch shapes,
the phases' order, the checks) and its module doc describes the boundary."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_dspark.kernels._triton_utils import wait_for_producers
from sgl_dspark.kernels.mhc.coefficients import (
    finish_coeffs,
    finish_collapse_norm,
    finish_norm_chunk,
)
from sgl_dspark.kernels.mhc.stream_update import stream_update_and_partials


@triton.jit
def _mhc_post_combine_kernel(
    streams_ptr,
    y_ptr,
    post_ptr,
    comb_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    streams_out_ptr,
    pre_out_ptr,
    post_out_ptr,
    comb_out_ptr,
    x_in_ptr,
    x_normed_ptr,
    partials_ptr,
    collapse_pre_ptr,
    x_q_ptr,
    x_s_ptr,
    M,
    hc_eps,
    rms_eps,
    PHASE: tl.constexpr,
    D: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    RP: tl.constexpr,
    SP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FINISH_BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    HAS_COEFFS: tl.constexpr,
    PREV_PRE: tl.constexpr,
    FP8_OUT: tl.constexpr,
    FP8_GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    COLLAPSE_IN_A: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    FIRST_PART: tl.constexpr,
    PDL: tl.constexpr,
):
    """PHASE 0: grid (row tiles, D slices), see `stream_update_and_partials`. PHASE 1: grid
    (M, 2) (M, 1 without HAS_COEFFS), program (row, 0) collapses and norms, program (row, 1)
    forms post' and comb'; with COLLAPSE_IN_A, grid (M, HAS_COEFFS + norm chunks): program
    (row, 0) forms pre', post' and comb' (HAS_COEFFS), the others norm a chunk of x_in each.
    A phase-B launch may hold only some of a row's programs: its axis 1 starts at program
    FIRST_PART (the coefficients' program in a launch of its own, the norm chunks in another)."""
    if PHASE == 0:
        stream_update_and_partials(
            streams_ptr,
            y_ptr,
            post_ptr,
            comb_ptr,
            fn_ptr,
            collapse_pre_ptr,
            streams_out_ptr,
            x_in_ptr,
            partials_ptr,
            M,
            D,
            NUM_SLICES,
            N,
            RP,
            BLOCK_M,
            BLOCK_D,
            ROUND_BF16,
            HAS_UPDATE,
            HAS_COEFFS,
            COLLAPSE_IN_A,
            PDL,
        )
    else:
        wait_for_producers(PDL)  # phase A's partials, Rs' and x_in are read first
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1) + FIRST_PART
        # The coefficients' program: the first where phase A collapsed (pre' is then its to
        # form), else the second, beside the program that collapses with pre'.
        if HAS_COEFFS and part == (0 if COLLAPSE_IN_A else 1):
            finish_coeffs(
                row,
                pre_out_ptr,
                post_out_ptr,
                comb_out_ptr,
                partials_ptr,
                base_ptr,
                scale_ptr,
                hc_eps,
                rms_eps,
                D,
                NUM_SLICES,
                SINKHORN_ITERS,
                N,
                NP,
                RP,
                SP,
                COLLAPSE_IN_A,
            )
        elif COLLAPSE_IN_A:
            finish_norm_chunk(
                row,
                part - HAS_COEFFS,
                x_in_ptr,
                x_normed_ptr,
                partials_ptr,
                norm_w_ptr,
                rms_eps,
                x_q_ptr,
                x_s_ptr,
                D,
                NUM_SLICES,
                N,
                RP,
                SP,
                NORM_BLOCK,
                ROUND_BF16,
                FP8_OUT,
                FP8_GROUP,
                UE8M0,
            )
        else:
            finish_collapse_norm(
                row,
                streams_out_ptr,
                pre_out_ptr,
                collapse_pre_ptr,
                x_in_ptr,
                x_normed_ptr,
                partials_ptr,
                base_ptr,
                scale_ptr,
                norm_w_ptr,
                hc_eps,
                rms_eps,
                x_q_ptr,
                x_s_ptr,
                D,
                NUM_SLICES,
                N,
                NP,
                RP,
                SP,
                FINISH_BLOCK,
                ROUND_BF16,
                HAS_COEFFS,
                PREV_PRE,
                FP8_OUT,
                FP8_GROUP,
                UE8M0,
            )
