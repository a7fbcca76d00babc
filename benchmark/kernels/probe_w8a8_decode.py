"""Probe: decode-sized linears on FP8 activations (W8A8), the weight's FP8 codes fed to the matrix
unit as stored, against the library's W8A16 kernel that turns every weight byte into bf16 first.

    python benchmark/kernels/probe_w8a8_decode.py --out $OUT/probe.md   (H100 / H200)
    (interpreter check: test/registered/kernels/test_probe_w8a8_decode.py)

At one to sixteen tokens the library's quantised linear (`quantized_linear`, W8A16) is bound
inside its programs, not by HBM (from L2 it is only 10-12% faster; `benchmark/results/kernels.md`),
and much of its K loop turns FP8 bytes into bf16 operands. With the activation quantised to FP8
per 32-channel group (the numerics of DeepSeek's own inference code, which quantises every FP8
GEMM's input) the weight needs no decode at all, but on sm90 only the warpgroup MMA multiplies
E4M3 natively, and its tile has 64 rows: `mma.sync.m16n8k32.e4m3` compiles to a conversion of
both operands to fp16 and an fp16 MMA, and Triton widens a `tl.dot` of FP8 operands below 64 rows
the same way. The library's `w8a8_linear` (prefill-sized) puts the tokens on the 64-row side, so
at one token 63 of its 64 rows are padding, each scaled per scale group.

The kernel here puts the weight there instead (y^T = W x^T): a program owns BLOCK_N weight rows
(64 or 128) and up to 16 tokens, so a V4.1-Flash projection has few column tiles (the x
projection's 1792 rows are 28) and its K range is split over programs until about a target count
of programs runs; each split's fp32 sums go to a workspace that the library's ordered split-K
reduce (`fp8/w8a8.py`) adds in split order. A step is GROUPS scale groups of 32 channels, each
group's product from zero, scaled as the library's W8A8 chunk is, (product * token scale) * row
scale, then added (FMA contraction off).

Rows: the library's W8A16 kernel on bf16 activations (the `x library` base), the library's
`w8a8_linear` and the probe's variants on the same activations quantised once beforehand
(`quantize_act_fp8`, 32-channel groups, power-of-two scales; not timed: a producer would write
the codes in its epilogue). Before timing, every W8A8 row is checked against `w8a8_linear_ref`
on the same codes (an error row if it is off by more than the output's rounding of sums in
another order); the `rel err` column is against dequantise-then-bf16 reference, so for the
W8A8 rows it holds the activation's E4M3 rounding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from sgl_dspark.kernels._triton_utils import (  # noqa: E402
    interpreted,
    programmatic_launch,
    round_to_bf16,
    wait_for_producers,
)
from sgl_dspark.kernels.fp8 import w8a8 as w8a8_kernels  # noqa: E402
from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8  # noqa: E402
from sgl_dspark.kernels.fp8.reference import Fp8Activation, w8a8_linear_ref  # noqa: E402
from sgl_dspark.kernels.linear.dequant import e8m0_to_fp32  # noqa: E402
from sgl_dspark.kernels.linear.reference import QuantizedWeight  # noqa: E402

from benchmark.kernels.probe_fma_gemv import time_variants  # noqa: E402

GROUP = 32  # channels per activation scale: V4.1's weight blocks are 32 x 32


@triton.jit
def _w8a8_wgmma_kernel(
    x_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    k_split,
    stride_xm,
    stride_sxm,
    stride_wn,
    stride_sn,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKENS: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTIAL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    """y^T = W x^T with the weight's rows the 64-row side of sm90's warpgroup MMA (E4M3 x E4M3;
    a tl.dot of FP8 operands below 64 rows is widened to fp16 on sm90): a program owns BLOCK_N
    weight rows and TOKENS tokens over its split's K range [split * k_split, +k_split), a step
    GROUPS scale groups, each group's product from zero, scaled (product * token scale) * row
    scale and added. PARTIAL: the split's fp32 sums go to a [splits, M, N] workspace that
    `_split_k_reduce_kernel` sums in split order; else the bf16 output."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    t0 = tl.program_id(2) * TOKENS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = t0 + tl.arange(0, TOKENS)
    t_ok = offs_t < M
    n_ok = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_rows = w_ptr + rows * stride_wn
    s_rows = s_ptr + (rows // SCALE_ROWS) * stride_sn
    x_rows = x_ptr + offs_t.to(tl.int64) * stride_xm
    sx_rows = sx_ptr + offs_t.to(tl.int64) * stride_sxm
    k_start = split * k_split
    k_end = tl.minimum(K, k_start + k_split)
    wait_for_producers(PDL)  # the activation is the previous kernel's output
    acc = tl.zeros([BLOCK_N, TOKENS], tl.float32)
    for k0 in range(k_start, k_end, GROUPS * GROUP):  # K a multiple of the step (probe shapes)
        for c in tl.static_range(GROUPS):
            kc = k0 + c * GROUP + tl.arange(0, GROUP)
            w = tl.load(w_rows[:, None] + kc[None, :])
            x = tl.load(x_rows[None, :] + kc[:, None], mask=t_ok[None, :], other=0.0)
            sw = e8m0_to_fp32(tl.load(s_rows + (k0 + c * GROUP) // GROUP))
            sx = tl.load(sx_rows + (k0 + c * GROUP) // GROUP, mask=t_ok, other=0.0)
            if DOT_FP32:  # the CPU interpreter has no FP8 dot: the exact fp32 codes
                part = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(w, x)
            acc += (part * sx[None, :]) * sw[:, None]
    mask = n_ok[:, None] & t_ok[None, :]
    if PARTIAL:
        dest = out_ptr + (split.to(tl.int64) * M + offs_t[None, :]) * N + offs_n[:, None]
        tl.store(dest, acc, mask=mask)
    else:
        acc = round_to_bf16(acc)
        dest = out_ptr + offs_t[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=mask)


def w8a8_wgmma_linear(
    act: Fp8Activation,
    weight: QuantizedWeight,
    bn: int = 64,
    chunks: int = 4,
    splits: int = 1,
    stages: int = 4,
    tokens: int = 16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = dequant(act) @ dequant(W)^T in bf16 by `_w8a8_wgmma_kernel` (+ the ordered reduce of
    `fp8/w8a8.py` with several splits): act the codes and fp32 scales of
    `quantize_act_fp8(x, 32, ue8m0=True)`, W an FP8 weight in 32 x 32 blocks; `splits` K
    splits of whole steps (chunks x 32 channels), K a multiple of the step; `out` an optional
    contiguous bf16 [M, N] to write."""
    m, k = act.q.shape
    n = weight.data.shape[0]
    step = chunks * GROUP
    if weight.fmt != "fp8" or weight.group != GROUP or weight.block_rows != GROUP:
        raise ValueError(f"the probe takes FP8 weights in 32 x 32 blocks, got {weight.fmt}")
    if k % step:
        raise ValueError(f"K {k} is not a multiple of the step {step}")
    k_split = triton.cdiv(k // step, splits) * step
    used = triton.cdiv(k, k_split)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=act.q.device)
    if out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 [{m}, {n}]")
    dest = out if used == 1 else torch.empty(used, m, n, dtype=torch.float32, device=out.device)
    _w8a8_wgmma_kernel[(triton.cdiv(n, bn), used, triton.cdiv(m, tokens))](
        act.q,
        act.scale,
        weight.data,
        weight.scale,
        dest,
        m,
        n,
        k,
        k_split,
        act.q.stride(0),
        act.scale.stride(0),
        weight.data.stride(0),
        weight.scale.stride(0),
        GROUP=GROUP,
        SCALE_ROWS=weight.block_rows,
        BLOCK_N=bn,
        TOKENS=tokens,
        GROUPS=chunks,
        PARTIAL=used > 1,
        DOT_FP32=interpreted(_w8a8_wgmma_kernel),
        enable_fp_fusion=False,  # the chunk terms rounded as the reference rounds them
        num_warps=4,
        num_stages=stages,
        **programmatic_launch(_w8a8_wgmma_kernel, out.device),
    )
    if used > 1:
        w8a8_kernels.reduce_splits(dest, out)
    return out


class QuantisedInputs:
    """The W8A8 rows' activation, quantised once per input, so the timed call is the GEMM
    alone; and each (variant, input, weight shape) checked once against `w8a8_linear_ref` on
    the same codes, at its first call (outside the timing's graph capture: the check syncs).
    Inputs are keyed by their storage and kept alive here, so no later input reuses a key."""

    def __init__(self) -> None:
        self._acts: dict[tuple, tuple[torch.Tensor, Fp8Activation]] = {}
        self._checked: set[tuple] = set()

    def act(self, x: torch.Tensor) -> Fp8Activation:
        key = (x.data_ptr(), tuple(x.shape))
        if key not in self._acts:
            self._acts[key] = (x, quantize_act_fp8(x, GROUP, ue8m0=True))
        return self._acts[key][1]

    def checked(self, label: str, x: torch.Tensor, w: QuantizedWeight, y: torch.Tensor):
        key = (label, x.data_ptr(), tuple(x.shape), tuple(w.data.shape))
        if key not in self._checked:
            want = w8a8_linear_ref(self.act(x), w, GROUP, torch.float32)
            # One bf16 rounding (up to 2^-8 of a value) of fp32 sums in another order.
            gap = (y.float() - want).abs().max() / want.abs().max().clamp(min=1e-30)
            if not (y.isfinite().all() and gap < 2**-7):
                raise AssertionError(f"{label}: {gap:.2e} off w8a8_linear_ref")
            self._checked.add(key)
        return y


# V4.1-Flash's dense projections as the rank model stores them (FP8 32 x 32): (name, N, K).
SHAPES = [("x_proj", 1792, 5120), ("o_b", 5120, 8192), ("q_b", 32768, 1280), ("wkv", 512, 5120)]
# The warpgroup-MMA kernel: (BLOCK_N, scale groups a step, pipeline stages, programs aimed at);
# the K splits are those programs over the shape's column tiles, at most one a step.
WGMMA_CONFIGS = [
    (64, 4, 4, 132),
    (64, 4, 4, 264),
    (64, 4, 4, 528),
    (64, 4, 6, 264),
    (64, 2, 8, 264),
    (128, 4, 4, 264),
    (128, 2, 6, 264),
]


def wgmma_splits(n: int, k: int, bn: int, chunks: int, programs: int) -> int:
    """K splits giving about `programs` programs over N's column tiles (whole steps each)."""
    return max(1, min(k // (chunks * GROUP), round(programs / triton.cdiv(n, bn))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--only", default="", help="comma-separated substrings of variant labels")
    a = p.parse_args()
    deadline = time.time() + a.budget_s
    wanted = a.shapes.split(",")
    shapes = [shape for shape in SHAPES if shape[0] in wanted]
    inputs = QuantisedInputs()

    def variants_of(m: int, k: int) -> list[tuple[str, object]]:
        def w8a8_library(x, w):
            y = w8a8_kernels.w8a8_linear(inputs.act(x), w, GROUP)
            return inputs.checked("library w8a8_linear", x, w, y)

        variants = [("library w8a8_linear (64-row tiles)", w8a8_library)]
        for bn, chunks, stages, programs in WGMMA_CONFIGS:
            if k % (chunks * GROUP):
                continue
            label = f"W8A8 wgmma BN{bn} BK{chunks * GROUP} {stages} stages ~{programs} programs"

            def wgmma(x, w, c=(bn, chunks, stages, programs), label=label):
                bn, chunks, stages, programs = c
                splits = wgmma_splits(w.shape[0], k, bn, chunks, programs)
                y = w8a8_wgmma_linear(inputs.act(x), w, bn, chunks, splits, stages)
                return inputs.checked(label, x, w, y)

            variants.append((label, wgmma))
        return variants

    time_variants(
        shapes, "fp8", [int(v) for v in a.ms.split(",")], variants_of, a.only, deadline, a.out
    )


if __name__ == "__main__":
    main()
