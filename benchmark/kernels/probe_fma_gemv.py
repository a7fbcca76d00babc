"""Probe: the FP8 block-scaled weight-only linear at decode sizes with no shared memory in its
K loop.

    python benchmark/kernels/probe_fma_gemv.py --out $OUT/probe.md   (H100 / H200)
    TRITON_INTERPRET=1 python benchmark/kernels/probe_fma_gemv.py --smoke   (CPU check)

The library's `quantized_linear` streams its weight through a software pipeline of asynchronous
copies into shared memory and multiplies each K step's dequantised tile on the matrix unit with
the activation rows padded to 16: two CTA barriers a K step (the pipeline's, and the scale
tile's layout change through shared memory), and at one token its warps issue only 0.3-0.5
instructions a cycle (`benchmark/results/kernels.md`). The variants here load the weight from
global memory straight into the registers that use it (Gluon, where the layouts are chosen):

* FMA: each thread loads 16-byte pieces of weight rows, converts them to fp32, multiplies them
  by the matching activation channels on the FMA units, sums each piece in the thread, scales
  the piece's sum by its block's power of two (exact) and accumulates; the only cross-thread
  reduction is the last. M fused multiply-adds a weight byte: free at one token, the bound at
  16 rows. `PREFETCH` loads the next K step's weights before the current step's arithmetic. The
  same arithmetic in plain Triton (its own layouts) is the CPU-checkable form (`--smoke`).
* mma.sync, activation first: 16 padded activation rows as the first operand, the weight as the
  second, loaded into its operand registers.
* mma.sync, weight first: y^T = W x^T, 16 weight rows an instruction as the first operand
  (loaded into its registers, KW consecutive channels a thread), up to 8 tokens an instruction
  as the second (the activation tile loaded once a scale group and shared by the warp's row
  tiles); the matrix unit's cost does not grow with the tokens. A program's warps split its
  rows, or its K in slices (each warp its own slice and accumulator, the slices' sums added once
  after the loop): the x projection's 1792 rows are only 112 tiles of 16.

In all of them each scale group's (or piece's) product is scaled by its block's power of two
and added, and a row's arithmetic does not depend on the other rows. Every variant is checked
against dequantise-then-reference (fp32) and timed beside the library's kernel in CUDA graphs
over weight copies beyond L2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from sgl_dspark.kernels._triton_utils import (  # noqa: E402
    programmatic_launch,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import e8m0_to_fp32  # noqa: E402
from sgl_dspark.kernels.linear.quantized import quantized_linear  # noqa: E402
from sgl_dspark.kernels.linear.reference import dequantize_weight_ref  # noqa: E402

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels.graph_timing import max_rel_err  # noqa: E402

VEC = 16  # weight bytes (FP8 channels) a thread loads at once: one 16-byte load


@triton.jit
def _fma_fp8_kernel(
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
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    VEC: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (column block, row block). A K step is CHUNKS pieces of VEC channels per column.
    BLOCK_K: tl.constexpr = CHUNKS * VEC
    row0 = tl.program_id(1).to(tl.int64) * BLOCK_M
    x_ptr += row0 * stride_xm
    y_ptr += row0 * stride_ym
    M -= row0
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNKS)
    offs_v = tl.arange(0, VEC)
    offs_m = tl.arange(0, BLOCK_M)
    n3 = tl.minimum(offs_n, N - 1)[:, None, None].to(tl.int64)
    k3 = offs_c[None, :, None] * VEC + offs_v[None, None, :]  # [1, C, V]
    w3 = w_ptr + n3 * stride_wn + k3  # [BN, C, V]
    s2 = s_ptr + (tl.minimum(offs_n, N - 1) // SCALE_ROWS).to(tl.int64)[:, None] * stride_sn
    x3 = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm + k3  # [BM, C, V]
    mask_m3 = offs_m[:, None, None] < M
    wait_for_producers(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N, CHUNKS), tl.float32)
    if PREFETCH:
        w = tl.load(w3, mask=k3 < K, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w_next = tl.load(w3 + (k0 + BLOCK_K), mask=k3 + (k0 + BLOCK_K) < K, other=0.0)
        else:
            w = tl.load(w3 + k0, mask=k3 + k0 < K, other=0.0)
        kc = k0 + offs_c * VEC  # [C]
        e = tl.load(s2 + (kc // GROUP)[None, :], mask=(kc < K)[None, :], other=127)
        scale = e8m0_to_fp32(e)  # [BN, C], 2^(e - 127)
        x = tl.load(x3 + k0, mask=mask_m3 & (k3 + k0 < K), other=0.0).to(tl.float32)
        prod = x[:, None, :, :] * w.to(tl.float32)[None, :, :, :]  # [BM, BN, C, V]
        acc += tl.sum(prod, axis=3) * scale[None, :, :]
        if PREFETCH:
            w = w_next
    y = tl.sum(acc, axis=2)  # [BM, BN]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def fma_linear(x, weight, bn: int, chunks: int, warps: int, prefetch: bool, block_m: int = 0):
    bm = block_m or triton.next_power_of_2(x.shape[0])
    pdl = programmatic_launch(_fma_fp8_kernel, x.device)["PDL"]
    return _launch(
        _fma_fp8_kernel,
        x,
        weight,
        bn,
        bm,
        pdl,
        BLOCK_M=bm,
        CHUNKS=chunks,
        VEC=VEC,
        PREFETCH=prefetch,
        num_warps=warps,
        num_stages=1,
    )


@gluon.jit
def _wait_for_producers(PDL: gl.constexpr):
    """`_triton_utils.wait_for_producers` for Gluon kernels (the same two PTX instructions)."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )


@gluon.jit
def _slice_offsets(slice_stride, mid, last, WARPS_K: gl.constexpr, L: gl.constexpr):
    """Offsets [WARPS_K, len(mid), len(last)] in layout L: slice s at s * slice_stride, plus
    `mid` along axis 1 and `last` along axis 2 (each already in L's slice layout for its axis).
    The weight-first kernels' per-warp K slices of the weight and the activation."""
    s = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    tile = gl.expand_dims(gl.expand_dims(s * slice_stride, 1) + gl.expand_dims(mid, 0), 2)
    return tile + gl.expand_dims(gl.expand_dims(last, 0), 1)


@gluon.jit
def _e8m0_to_fp32(e):
    """`dequant.e8m0_to_fp32` for Gluon kernels: scale bytes -> 2^(e - 127), exactly."""
    return (e.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _add_scaled_group(acc, a, b, e, zero, TOKEN_AXIS: gl.constexpr):
    """acc + (a @ b) * 2^(e - 127): one scale group's product on mma.sync into a zeroed
    accumulator, its scales (one a weight row) broadcast along the product's token axis
    (exact), then added."""
    scale = gl.expand_dims(_e8m0_to_fp32(e), TOKEN_AXIS)
    return acc + mma_v2(a, b, zero) * scale


def _launch(kernel, x, weight, bn: int, rows: int, pdl: bool, **meta) -> torch.Tensor:
    """y = x @ dequant(W)^T by `kernel` (the probe's kernels share their arguments): grid
    (column blocks of bn, row blocks of `rows`); `pdl` launches it programmatically (Gluon
    kernels take the launch option themselves, Triton ones through `programmatic_launch`)."""
    m, k = x.shape
    n = weight.data.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(n, bn), triton.cdiv(m, rows))](
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
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_N=bn,
        **meta,
        **({"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}),
    )
    return out


# Four E4M3 bytes of one register -> four fp32 values (exact: every E4M3 value is an fp16
# value): two hardware pair conversions and four widenings, where Triton's own conversion
# unpacks and repacks the byte pairs first (about seven instructions a byte at sm90).
E4M3_TO_F32_PTX = gl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 h01, h23;
.reg .f16 a, b, c, d;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {a, b}, h01;
mov.b32 {c, d}, h23;
cvt.f32.f16 $0, a;
cvt.f32.f16 $1, b;
cvt.f32.f16 $2, c;
cvt.f32.f16 $3, d;
}""")


@gluon.jit
def _gluon_fma_fp8_kernel(
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
    GROUP: gl.constexpr,
    SCALE_ROWS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CHUNKS: gl.constexpr,
    VEC: gl.constexpr,
    THREADS_N: gl.constexpr,
    WARPS_N: gl.constexpr,
    PREFETCH: gl.constexpr,
    DECODE_PTX: gl.constexpr,
    PDL: gl.constexpr,
):
    """The same arithmetic as `_fma_fp8_kernel` with the layout chosen: a thread holds VEC
    consecutive channels of one piece for all BLOCK_M rows (the piece's sum stays in the
    thread), the warp's lanes spread over THREADS_N columns x the rest over pieces, the warps
    over WARPS_N columns x the rest over pieces."""
    WARPS: gl.constexpr = gl.num_warps()
    L4: gl.constexpr = gl.BlockedLayout(
        [BLOCK_M, 1, 1, VEC],
        [1, THREADS_N, 32 // THREADS_N, 1],
        [1, WARPS_N, WARPS // WARPS_N, 1],
        [3, 2, 1, 0],
    )
    W3: gl.constexpr = gl.SliceLayout(0, L4)  # [BN, C, V]
    X3: gl.constexpr = gl.SliceLayout(1, L4)  # [BM, C, V]
    ACC: gl.constexpr = gl.SliceLayout(3, L4)  # [BM, BN, C]
    S2: gl.constexpr = gl.SliceLayout(0, ACC)  # [BN, C]
    Y2: gl.constexpr = gl.SliceLayout(2, ACC)  # [BM, BN]
    BLOCK_K: gl.constexpr = CHUNKS * VEC
    row0 = gl.program_id(1).to(gl.int64) * BLOCK_M
    x_ptr += row0 * stride_xm
    y_ptr += row0 * stride_ym
    M -= row0
    col0 = gl.program_id(0) * BLOCK_N
    # weight pointers [BN, C, V]
    wn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, W3)))
    wc = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, W3)))
    wv = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(1, W3)))
    wn3 = gl.expand_dims(gl.expand_dims(gl.minimum(col0 + wn, N - 1).to(gl.int64), 1), 2)
    wk3 = gl.expand_dims(gl.expand_dims(wc * VEC, 0), 2) + gl.expand_dims(gl.expand_dims(wv, 0), 1)
    w3 = w_ptr + wn3 * stride_wn + wk3
    # activation pointers [BM, C, V]
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(2, X3)))
    xc = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
    xv = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
    xm3 = gl.expand_dims(gl.expand_dims(xm, 1), 2)
    xk3 = gl.expand_dims(gl.expand_dims(xc * VEC, 0), 2) + gl.expand_dims(gl.expand_dims(xv, 0), 1)
    x3 = x_ptr + xm3.to(gl.int64) * stride_xm + xk3
    # scale pointers [BN, C]
    sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
    sc = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, S2))
    s_rows = (gl.minimum(col0 + sn, N - 1) // SCALE_ROWS).to(gl.int64) * stride_sn
    _wait_for_producers(PDL)
    acc = gl.zeros((BLOCK_M, BLOCK_N, CHUNKS), gl.float32, layout=ACC)
    if PREFETCH:
        w = gl.load(w3, mask=wk3 < K, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w_next = gl.load(w3 + (k0 + BLOCK_K), mask=wk3 + (k0 + BLOCK_K) < K, other=0.0)
        else:
            w = gl.load(w3 + k0, mask=wk3 + k0 < K, other=0.0)
        kc = k0 + sc * VEC
        e = gl.load(
            s_ptr + gl.expand_dims(s_rows, 1) + gl.expand_dims(kc // GROUP, 0),
            mask=gl.expand_dims(kc < K, 0),
            other=127,
        )
        scale = _e8m0_to_fp32(e)
        x = gl.load(x3 + k0, mask=(xm3 < M) & (xk3 + k0 < K), other=0.0).to(gl.float32)
        if DECODE_PTX:
            wf = gl.inline_asm_elementwise(
                E4M3_TO_F32_PTX,
                "=r,=r,=r,=r,r",
                [w.to(gl.uint8, bitcast=True)],
                dtype=gl.float32,
                is_pure=True,
                pack=4,
            )
        else:
            wf = w.to(gl.float32)
        prod = gl.expand_dims(x, 1) * gl.expand_dims(wf, 0)
        acc += gl.sum(prod, axis=3) * gl.expand_dims(scale, 0)
        if PREFETCH:
            w = w_next
    y = gl.sum(acc, axis=2)  # [BM, BN] in Y2
    ym = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, Y2))
    yn = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, Y2))
    mask = (gl.expand_dims(ym, 1) < M) & (gl.expand_dims(yn, 0) < N)
    gl.store(
        y_ptr + gl.expand_dims(ym, 1).to(gl.int64) * stride_ym + gl.expand_dims(yn, 0),
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def gluon_fma_linear(x, weight, bn, chunks, warps, prefetch, threads_n=1, warps_n=1, ptx=False):
    bm = triton.next_power_of_2(x.shape[0])
    return _launch(
        _gluon_fma_fp8_kernel,
        x,
        weight,
        bn,
        bm,
        x.device.type == "cuda",
        BLOCK_M=bm,
        CHUNKS=chunks,
        VEC=VEC,
        THREADS_N=threads_n,
        WARPS_N=warps_n,
        PREFETCH=prefetch,
        DECODE_PTX=ptx,
        num_warps=warps,
    )


@gluon.jit
def _gluon_mma_fp8_kernel(
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
    GROUP: gl.constexpr,
    SCALE_ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUPS: gl.constexpr,
    KW: gl.constexpr,
    PDL: gl.constexpr,
):
    """The matrix unit (mma.sync m16n8k16, 16 padded activation rows) on weights loaded from
    global memory straight into the operand's registers: no shared memory and no barrier in
    the K loop. A K step is GROUPS scale groups; each group's product goes to a zeroed
    accumulator, is scaled by its blocks' powers of two (exact) and added."""
    WARPS: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8]
    )
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
    row0 = gl.program_id(1).to(gl.int64) * 16
    x_ptr += row0 * stride_xm
    y_ptr += row0 * stride_ym
    M -= row0
    col0 = gl.program_id(0) * BLOCK_N
    xm = gl.arange(0, 16, layout=gl.SliceLayout(1, A))
    xk = gl.arange(0, GROUP, layout=gl.SliceLayout(0, A))
    x2 = x_ptr + gl.expand_dims(xm.to(gl.int64) * stride_xm, 1) + gl.expand_dims(xk, 0)
    xmask = gl.expand_dims(xm < M, 1)
    wk = gl.arange(0, GROUP, layout=gl.SliceLayout(1, B))
    wn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, B))
    w2 = w_ptr + gl.expand_dims(gl.minimum(col0 + wn, N - 1).to(gl.int64) * stride_wn, 0)
    w2 = w2 + gl.expand_dims(wk, 1)
    sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    s1 = s_ptr + (gl.minimum(col0 + sn, N - 1) // SCALE_ROWS).to(gl.int64) * stride_sn
    _wait_for_producers(PDL)
    acc = gl.zeros((16, BLOCK_N), gl.float32, layout=MMA)
    zero = gl.zeros((16, BLOCK_N), gl.float32, layout=MMA)
    for k0 in range(0, K, GROUPS * GROUP):  # K a multiple of the step here (probe shapes)
        for g in gl.static_range(GROUPS):
            kg = k0 + g * GROUP
            w = gl.load(w2 + kg).to(gl.float32).to(gl.bfloat16)
            x = gl.load(x2 + kg, mask=xmask, other=0.0)
            acc = _add_scaled_group(acc, x, w, gl.load(s1 + kg // GROUP), zero, 0)
    ym = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    yn = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    mask = (gl.expand_dims(ym, 1) < M) & (gl.expand_dims(yn, 0) < N)
    gl.store(
        y_ptr + gl.expand_dims(ym, 1).to(gl.int64) * stride_ym + gl.expand_dims(yn, 0),
        acc.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def gluon_mma_linear(x, weight, bn, groups, warps, kw):
    return _launch(
        _gluon_mma_fp8_kernel,
        x,
        weight,
        bn,
        16,
        x.device.type == "cuda",
        GROUPS=groups,
        KW=kw,
        num_warps=warps,
    )


@gluon.jit
def _gluon_mma_w_first_kernel(
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
    GROUP: gl.constexpr,
    SCALE_ROWS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    TOKENS: gl.constexpr,
    GROUPS: gl.constexpr,
    KW: gl.constexpr,
    F16: gl.constexpr,
    LOADS_FIRST: gl.constexpr,
    WARPS_K: gl.constexpr,
    PDL: gl.constexpr,
):
    """y^T = W x^T on mma.sync m16n8k16: the weight is the first operand (16 of its rows an
    instruction, loaded from global memory straight into the operand registers, KW consecutive
    channels a thread), the activation rows the second (8 tokens an instruction, loaded once a
    scale group and shared by every row tile of the warp). Each scale group's product goes to a
    zeroed accumulator, scaled by its rows' powers of two (exact) and added. The program's
    warps split along N, and along K in WARPS_K slices (a step's GROUPS groups a slice, each
    slice with its own accumulator; the slices' sums added once at the end, through shared
    memory): a narrow projection (the x projection's 1792 rows are 112 row tiles of 16) then
    keeps several warps a scheduler. F16 (timing only): both operands in fp16, one pair
    conversion per two weight bytes (E4M3 is exact in fp16; the activations are not: fp16's
    range is narrower than bf16's). LOADS_FIRST (bf16): a step's loads written before its
    arithmetic (ptxas still schedules them)."""
    WARPS: gl.constexpr = gl.num_warps()
    # Axis 0 the K slice (a warp's), axis 1 the weight rows, axis 2 the tokens.
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_K, WARPS // WARPS_K, 1], instr_shape=[1, 16, 8]
    )
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
    SLICE: gl.constexpr = GROUPS * GROUP  # a warp's channels a step
    t0 = gl.program_id(1).to(gl.int64) * TOKENS
    x_ptr += t0 * stride_xm
    y_ptr += t0 * stride_ym
    M -= t0
    col0 = gl.program_id(0) * BLOCK_N
    # Weight [slice, row, channel] of group 0 of each slice.
    wn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    wk = gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(1, A)))
    w_rows = gl.minimum(col0 + wn, N - 1).to(gl.int64) * stride_wn
    w3 = w_ptr + _slice_offsets(SLICE, w_rows, wk, WARPS_K, A)
    # Activation [slice, channel, token].
    xk = gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(2, B)))
    xt = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, gl.SliceLayout(1, B)))
    x3 = x_ptr + _slice_offsets(SLICE, xk, xt.to(gl.int64) * stride_xm, WARPS_K, B)
    xmask = gl.expand_dims(gl.expand_dims(xt < M, 0), 1)
    # Scale bytes [slice, row] of group 0 of each slice.
    ss = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
    sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
    s_rows = (gl.minimum(col0 + sn, N - 1) // SCALE_ROWS).to(gl.int64) * stride_sn
    s2 = s_ptr + gl.expand_dims(ss * GROUPS, 1) + gl.expand_dims(s_rows, 0)
    _wait_for_producers(PDL)
    acc = gl.zeros((WARPS_K, BLOCK_N, TOKENS), gl.float32, layout=MMA)
    zero = gl.zeros((WARPS_K, BLOCK_N, TOKENS), gl.float32, layout=MMA)
    for k0 in range(0, K, WARPS_K * SLICE):  # K a multiple of the step here (probe shapes)
        # The step's pointers once; a group's offset within the step is then a constant the
        # loads fold into their address.
        w_step = w3 + k0
        x_step = x3 + k0
        s_step = s2 + k0 // GROUP
        if LOADS_FIRST:
            # Every load of the step written before any of its arithmetic (the tuples live
            # within the step, nothing is carried across iterations).
            wl = ()
            xl = ()
            el = ()
            for g in gl.static_range(GROUPS):
                wl = wl + (gl.load(w_step + g * GROUP),)
                xl = xl + (gl.load(x_step + g * GROUP, mask=xmask, other=0.0),)
                el = el + (gl.load(s_step + g),)
            for g in gl.static_range(GROUPS):
                w = wl[g].to(gl.float32).to(gl.bfloat16)
                acc = _add_scaled_group(acc, w, xl[g], el[g], zero, 2)
        else:
            for g in gl.static_range(GROUPS):
                if F16:
                    w = gl.load(w_step + g * GROUP).to(gl.float16)
                    x = gl.load(x_step + g * GROUP, mask=xmask, other=0.0)
                    x = x.to(gl.float32).to(gl.float16)
                else:
                    w = gl.load(w_step + g * GROUP).to(gl.float32).to(gl.bfloat16)
                    x = gl.load(x_step + g * GROUP, mask=xmask, other=0.0)
                acc = _add_scaled_group(acc, w, x, gl.load(s_step + g), zero, 2)
    # The slices' sums, in one fixed order (the layout's reduction tree over the warps).
    out = gl.sum(acc, axis=0)
    OUT: gl.constexpr = gl.SliceLayout(0, MMA)
    yn = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT))
    yt = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, OUT))
    mask = (gl.expand_dims(yt, 0) < M) & (gl.expand_dims(yn, 1) < N)
    gl.store(
        y_ptr + gl.expand_dims(yt, 0).to(gl.int64) * stride_ym + gl.expand_dims(yn, 1),
        out.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def gluon_mma_w_first_linear(
    x, weight, bn, groups, warps, kw, tokens=8, f16=False, loads_first=False, warps_k=1
):
    return _launch(
        _gluon_mma_w_first_kernel,
        x,
        weight,
        bn,
        tokens,
        x.device.type == "cuda",
        TOKENS=tokens,
        GROUPS=groups,
        KW=kw,
        F16=f16,
        LOADS_FIRST=loads_first,
        WARPS_K=warps_k,
        num_warps=warps,
    )


# V4.1-Flash decode shapes (N, K) of FP8 32 x 32 weights: the x projection, o_b, q_b, kv.
SHAPES = [("x_proj", 1792, 5120), ("o_b", 5120, 8192), ("q_b", 32768, 1280), ("wkv", 512, 5120)]
# Triton's own layout (BLOCK_N, CHUNKS, warps, prefetch): one variant (its layout inference
# puts the pieces' sums across threads and six CTA barriers in the K loop at sm90).
CONFIGS = [(4, 32, 4, True)]
# Gluon (BLOCK_N, CHUNKS, warps, prefetch, lanes over N, warps over N): the lanes and warps
# cover the tile exactly (no replicated work); pieces a thread a step = BN x C / (32 x warps).
GLUON_CONFIGS = [(8, 64, 4, True, 1, 4), (8, 64, 4, False, 1, 4)]
# Gluon matrix unit from registers, activation first (BLOCK_N, scale groups a K step, warps,
# operand k width): its first run was 1.2-3.7x slower than the library; one kept for reference.
MMA_CONFIGS = [(8, 8, 1, 8)]
# Gluon matrix unit from registers, weight first (BLOCK_N, scale groups a warp's K slice, warps,
# operand k width, tokens an accumulator, fp16 operands, loads first, warps along K).
W_FIRST_CONFIGS = [
    (16, 8, 1, 8, 8),
    (16, 16, 1, 8, 8),
    (16, 32, 1, 8, 8),
    (32, 8, 2, 8, 8),
    (32, 16, 2, 8, 8),
    (64, 8, 4, 8, 8),
    (16, 16, 1, 8, 16),
    (16, 16, 1, 8, 8, True),
    (32, 8, 2, 8, 8, False, True),
    (16, 16, 1, 8, 8, False, True),
    # K split over a program's warps: the narrow projections' few row tiles (the x
    # projection's 112) over more warps than the SMs' schedulers, each warp its own slice.
    (16, 8, 4, 8, 8, False, False, 4),
    (16, 4, 4, 8, 8, False, False, 4),
    (16, 8, 2, 8, 8, False, False, 2),
    (32, 8, 4, 8, 8, False, False, 2),
    (16, 8, 4, 8, 16, False, False, 4),
    (16, 8, 8, 8, 8, False, False, 8),
]
SMOKE = [(4, 4, 2, False), (4, 4, 2, True), (8, 2, 4, True)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument(
        "--only", default="", help="comma-separated substrings: the variants whose label holds one"
    )
    a = p.parse_args()
    start = time.time()
    wanted = a.shapes.split(",")
    shapes = [shape for shape in SHAPES if shape[0] in wanted]
    ms, configs = [int(v) for v in a.ms.split(",")], CONFIGS
    gluon_configs, mma_configs, w_first_configs = GLUON_CONFIGS, MMA_CONFIGS, W_FIRST_CONFIGS
    if a.smoke:  # the interpreter runs no Gluon kernel
        bq.SETUP.device = "cpu"
        shapes, ms, configs = [("smoke", 40, 200)], [1, 3], SMOKE
        gluon_configs, mma_configs, w_first_configs = [], [], []

    def variants_of(m: int, k: int) -> list[tuple[str, object]]:
        variants = [
            (
                "FMA BN{} BK{} w{}{}".format(c[0], c[1] * VEC, c[2], " prefetch" if c[3] else ""),
                lambda x, w, c=c: fma_linear(x, w, *c),
            )
            for c in configs
        ]
        variants += [
            (
                "Gluon FMA BN{} BK{} w{}{} lanesN{} warpsN{}{}".format(
                    c[0],
                    c[1] * VEC,
                    c[2],
                    " prefetch" if c[3] else "",
                    c[4],
                    c[5],
                    " PTX decode" if c[6:] and c[6] else "",
                ),
                lambda x, w, c=c: gluon_fma_linear(x, w, *c),
            )
            for c in gluon_configs
        ]
        variants += [
            (
                f"Gluon mma.sync BN{c[0]} BK{c[1] * 32} w{c[2]} kw{c[3]}",
                lambda x, w, c=c: gluon_mma_linear(x, w, *c),
            )
            for c in mma_configs
            if k % (c[1] * 32) == 0
        ]
        variants += [
            (
                f"Gluon mma.sync W first BN{c[0]} BK{c[1] * 32} w{c[2]} kw{c[3]} t{c[4]}"
                + (" fp16 operands" if c[5:] and c[5] else "")
                + (" loads first" if c[6:] and c[6] else "")
                + (f" wk{c[7]}" if c[7:] and c[7] > 1 else ""),
                lambda x, w, c=c: gluon_mma_w_first_linear(x, w, *c),
            )
            for c in w_first_configs
            if k % (c[1] * 32 * (c[7] if c[7:] else 1)) == 0
        ]
        return variants

    time_variants(shapes, "fp8", ms, variants_of, a.only, start + a.budget_s, a.out)


def time_variants(shapes, fmt: str, ms, variants_of, only: str, deadline: float, out) -> None:
    """The probes' table: for each shape (name, N, K[, format]), weight copies in its format
    (`fmt` where the shape names none; 32-channel scale groups) beyond L2; at each M, the
    library's `quantized_linear` and then every variant of `variants_of(m, k)` ((label,
    call(x, weight)) pairs; `only`: comma-separated substrings, the labels that hold one)
    checked against dequantise-then-reference (fp32), compared bit for bit with the library's
    output (`same bits`), and timed in CUDA graphs. The table is printed and rewritten to `out`
    after every row; past `deadline` (a `time.time()`) it says so and stops."""
    lines = [
        "| shape | M | variant | us | x library | TB/s (stored) | rel err | same bits |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def emit(*cells) -> None:
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        print(lines[-1], flush=True)
        if out:
            Path(out).write_text("\n".join(lines) + "\n")

    keep = [part for part in only.split(",") if part]
    for name, n, k, *shape_fmt in shapes:
        weight_fmt = shape_fmt[0] if shape_fmt else fmt
        gen = bq._generator(n + k)
        ws = [bq.quantize_random((n, k), weight_fmt, 32, gen)]
        ws += [
            bq.quantize_random((n, k), weight_fmt, 32, gen)
            for _ in range(bq._copies(ws[0].nbytes) - 1)
        ]
        deq = dequantize_weight_ref(ws[0], torch.float32)
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=bq.SETUP.device).to(torch.bfloat16)
            want = x.float() @ deq.T
            library = quantized_linear(x, ws[0])
            variants = [("library", quantized_linear)] + [
                (tag, call)
                for tag, call in variants_of(m, k)
                if not keep or any(part in tag for part in keep)
            ]
            base = None
            for tag, call in variants:
                if time.time() > deadline:
                    emit("stopped at the time budget", "", "", "", "", "", "", "")
                    return
                try:
                    y = call(x, ws[0])
                    err = max_rel_err(y, want)
                    same = "yes" if torch.equal(y, library) else "no"
                    us = bq.time_us(
                        [lambda w=w, c=call, x=x: c(x, w) for w in ws], bq._reps(len(ws))
                    )
                except Exception as exc:  # noqa: BLE001 - a shape the target cannot run
                    emit(name, m, tag, f"{type(exc).__name__}: {str(exc)[:80]}", *[""] * 4)
                    continue
                base = base or us
                emit(
                    name,
                    m,
                    tag,
                    f"{us:.2f}",
                    f"{base / us:.2f}",
                    f"{ws[0].nbytes / us / 1e6:.2f}",
                    f"{err:.1e}",
                    same,
                )
        del ws


if __name__ == "__main__":
    main()
