"""Probe: the quantised small-M linear with its weight and activation tiles moved by the tensor
memory accelerator (TMA) instead of per-thread asynchronous copies.

    python benchmark/kernels/probe_tma_linear.py --out $OUT/probe.md   (H100 / H200)
    TRITON_INTERPRET=1 python benchmark/kernels/probe_tma_linear.py --smoke   (CPU check)

The library's `quantized_linear` streams each K step's weight and activation tiles into shared
memory with 16-byte asynchronous copies that every thread issues (a weight tile of 16 columns x
512 FP8 channels is 512 copies, the 16-row activation tile 1,024, 15 of its 16 rows padding at
one token), waits on them with a CTA barrier, and at one token its warps issue only 0.3-0.5
instructions a cycle, stalled on memory and barriers (`benchmark/results/kernels.md`). Here the
same tiles are tensor-descriptor loads (Triton's `TensorDescriptor`): one thread starts a step's
copy, its completion is an mbarrier the consumers wait on, rows past M and columns past N are
filled with zeros by the copy engine (no padding bytes read), and the threads issue no address
arithmetic or copy instructions for the tiles.

Everything after the load is the library's: the scale bytes (`quantized_scales`, a step ahead
where the library loads them ahead), the decode (`fp8_scaled_tile`, `fp4_scaled_halves`), the
dots in the same slices (`dequant._accumulate`), the rounding. With the library's launch shape
the sums are in the library's order, so every variant with the library's K step and slices must
give its bits exactly (the `same bits` column); the other shapes are checked against
dequantise-then-reference. Timed beside the library in CUDA graphs over weight copies beyond L2
(`probe_fma_gemv.time_variants`, the probes' shared table).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from sgl_dspark.kernels._triton_utils import (  # noqa: E402
    interpreted,
    prefetch_tile_l2,
    programmatic_launch,
    round_to_bf16,
    sm_count,
    wait_for_producers,
)
from sgl_dspark.kernels.linear.dequant import (  # noqa: E402
    _accumulate,
    fp4_scaled_halves,
    fp8_scaled_tile,
    quantized_scales,
)
from sgl_dspark.kernels.linear.quantized import _quantized_meta  # noqa: E402
from sgl_dspark.kernels.linear.weight_loads import (  # noqa: E402
    fp4_ptx_decode,
    scale_alignment,
    scales_loaded_ahead,
)

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels.probe_fma_gemv import time_variants  # noqa: E402

BLOCK_M = 16


@triton.jit
def _tma_linear_kernel(
    x_desc,
    w_desc,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_ym,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,
    SCALE_ALIGN: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    # Rows past M, columns past N and channels past K come in as zeros from the descriptors;
    # only the scale loads are bounded (EVEN_K: K a multiple of BLOCK_K, no bound along K).
    n0 = tl.program_id(0) * BLOCK_N
    row0 = tl.program_id(2) * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    scale_row = tl.minimum(offs_n, N - 1).to(tl.int64) // SCALE_ROWS
    PER_BYTE: tl.constexpr = 2 if FP4 else 1  # channels per stored byte
    if PDL and PREFETCH:
        prefetch_tile_l2(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, 0, K // PER_BYTE, 512)
    wait_for_producers(PDL)
    s_rows = tl.multiple_of(s_ptr + scale_row * stride_sn, SCALE_ALIGN)
    if SPLIT_K == 1:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([SPLIT_K, BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCALES_AHEAD:
        e_next = quantized_scales(s_rows, mask_n, 0, K, GROUP, BLOCK_K, EVEN_K)
    for k0 in range(0, K, BLOCK_K):
        if SCALES_AHEAD:
            e = e_next
            k_next = k0 + BLOCK_K
            e_next = quantized_scales(
                s_rows, mask_n & (k_next < K), k_next, K, GROUP, BLOCK_K, EVEN_K
            )
        else:
            e = quantized_scales(s_rows, mask_n, k0, K, GROUP, BLOCK_K, EVEN_K)
        a = x_desc.load([row0, k0])
        if DOT_FP32:
            a = a.to(tl.float32)
        if FP4:
            q = w_desc.load([n0, k0 // 2])
            w_even, w_odd = fp4_scaled_halves(q, e, BLOCK_N, BLOCK_K, GROUP, DOT_FP32, PTX)
            a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
            acc = _accumulate(acc, a_even, w_even, SPLIT_K, DOT_FP32)
            acc = _accumulate(acc, a_odd, w_odd, SPLIT_K, DOT_FP32)
        else:
            codes = w_desc.load([n0, k0])
            w = fp8_scaled_tile(codes, e, BLOCK_N, BLOCK_K, GROUP, DOT_FP32)
            acc = _accumulate(acc, a, w, SPLIT_K, DOT_FP32)
    if SPLIT_K > 1:
        acc = tl.sum(acc, axis=0)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


def tma_linear(
    x: torch.Tensor,
    weight,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    stages: int | None = None,
    warps: int | None = None,
    prefetch: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantized_linear(x, weight)` (bf16 x) with the tiles loaded through tensor descriptors
    (into `out` [M, N] if given); a None launch parameter takes the library's value for the
    shape (`_quantized_meta`)."""
    m, k = x.shape
    n = weight.data.shape[0]
    meta = _quantized_meta(weight.fmt, n, k, 1, sm_count(x.device))
    meta = {
        "BLOCK_N": block_n or meta["BLOCK_N"],
        "BLOCK_K": block_k or meta["BLOCK_K"],
        "SPLIT_K": split_k or meta["SPLIT_K"],
        "num_stages": stages or meta["num_stages"],
        "num_warps": warps or meta["num_warps"],
    }
    assert x.dtype == torch.bfloat16, x.dtype
    fp4 = weight.fmt == "mxfp4"
    data = weight.data if not fp4 else weight.data.view(torch.uint8)
    per_byte = 2 if fp4 else 1
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, meta["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(data, [meta["BLOCK_N"], meta["BLOCK_K"] // per_byte])
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, meta["BLOCK_N"]), 1, triton.cdiv(m, BLOCK_M))
    _tma_linear_kernel[grid](
        x_desc,
        w_desc,
        data,
        weight.scale,
        out,
        m,
        n,
        k,
        data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        FP4=fp4,
        PTX=fp4_ptx_decode(x.device) and not interpreted(_tma_linear_kernel),
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_M=BLOCK_M,
        SCALES_AHEAD=scales_loaded_ahead(
            weight, meta["BLOCK_N"], meta["BLOCK_K"], meta["num_warps"]
        ),
        SCALE_ALIGN=scale_alignment(weight),
        EVEN_K=k % meta["BLOCK_K"] == 0,
        ROUND_BF16=True,
        # As the library: the CPU interpreter multiplies the exact fp32 weights.
        DOT_FP32=interpreted(_tma_linear_kernel),
        PREFETCH=prefetch,
        **meta,
        **programmatic_launch(_tma_linear_kernel, x.device),
    )
    return out


# V4.1-Flash's dense projections as the rank model stores them (FP8 32 x 32), and its per-token
# experts' shapes in MXFP4 (a routed expert's gate-up and down projections as plain linears):
# (name, N, K, format).
SHAPES = [
    ("x_proj", 1792, 5120, "fp8"),
    ("o_b", 5120, 8192, "fp8"),
    ("down", 5120, 2304, "mxfp4"),
    ("q_b", 32768, 1280, "fp8"),
    ("gate_up", 4608, 5120, "mxfp4"),
    ("wkv", 512, 5120, "fp8"),
]
# (label, launch overrides): the library's shape first, then deeper pipelines and other steps.
VARIANTS = [
    ("TMA library shape", {}),
    ("TMA library shape, no L2 prefetch", {"prefetch": False}),
    ("TMA 6 stages", {"stages": 6}),
    ("TMA BK256 split2 6 stages", {"block_k": 256, "split_k": 2, "stages": 6, "warps": 2}),
    ("TMA BN32 4 stages", {"block_n": 32}),
]
SMOKE_SHAPES = [
    ("smoke fp8", 40, 1024, "fp8"),
    ("smoke mxfp4", 40, 1024, "mxfp4"),
    ("smoke fp8 ragged K", 24, 1184, "fp8"),
    ("smoke mxfp4 ragged K", 72, 1088, "mxfp4"),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--only", default="", help="comma-separated substrings of variant labels")
    a = p.parse_args()
    deadline = time.time() + a.budget_s
    wanted = a.shapes.split(",")
    shapes = [s for s in SHAPES if s[0] in wanted]
    ms = [int(v) for v in a.ms.split(",")]
    if a.smoke:
        bq.SETUP.device = "cpu"
        shapes, ms = SMOKE_SHAPES, [1, 3]

    def variants_of(m: int, k: int) -> list[tuple[str, object]]:
        return [(tag, lambda x, w, kw=kw: tma_linear(x, w, **kw)) for tag, kw in VARIANTS]

    time_variants(shapes, "fp8", ms, variants_of, a.only, deadline, a.out)


if __name__ == "__main__":
    main()
