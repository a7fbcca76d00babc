"""Probe: the weight-only quantised linear with the weight as the matrix unit's first operand.

    python benchmark/kernels/probe_weight_operand.py --out $OUT/probe.md   (H200)
    TRITON_INTERPRET=1 python benchmark/kernels/probe_weight_operand.py --smoke   (CPU check)

The library's `quantized_linear` computes y[M, N] = x[M, K] @ W^T with the 16 padded activation
rows as the first operand, so on sm90 the dot is the warp-level `mma.sync` (HMMA) and the
dequantised weight tile is its second operand. Computed as y^T[N, M] = W[N, K] @ x^T, the weight
tile (64 or more columns) is the first operand of a warpgroup `wgmma`, which takes that operand
straight from registers, where it was dequantised; the activations (M padded to 16) are the
second operand, from shared memory. This probe times that orientation against the library's
kernel and the bf16 kernel, at V4-Flash decode shapes, over launch shapes, with the library's
decode (`dequant.quantized_tile`) unchanged, and for FP8 with 128-channel scale groups also the
scale applied to each group's fp32 partial product instead of to the weights (no per-weight
multiply). Narrow N gets K split over programs (fp32 atomics into a zeroed buffer: timing only,
the order of the sums is not fixed), and the library's own orientation and product with K split
over programs and a fixed-order sum (the column block's last program to arrive adds the
partials in split order: the bits do not depend on the arrival order, so it could ship). Every
variant is checked against dequantise-then-reference. For MXFP4 at wide N, a decode in inline
PTX (four code bytes per register: a sign-extending byte permute, a shift and a mask give two
weights' bf16 bits) with the low and high nibbles multiplied by the even and odd activation
channels in two dots; it compiles for NVIDIA only, so `--smoke` leaves it out.
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

from sgl_dspark.kernels.linear.dequant import (  # noqa: E402
    quantized_product,
    quantized_scales,
    quantized_tile,
)
from sgl_dspark.kernels.linear.quantized import quantized_linear  # noqa: E402
from sgl_dspark.kernels.linear.reference import dequantize_weight_ref  # noqa: E402
from sgl_dspark.kernels.linear.small_m import small_m_linear  # noqa: E402
from sgl_dspark.kernels.linear.weight_loads import (  # noqa: E402
    fp4_ptx_decode,
    fp4_rows_aligned,
    stored_rows,
)

from benchmark.kernels import bench_quant_gemm as bq  # noqa: E402
from benchmark.kernels.graph_timing import max_rel_err  # noqa: E402


@triton.jit
def _weight_first_kernel(
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
    FP4: tl.constexpr,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    POST_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    w_ok = offs_n < N
    m_ok = offs_m < M
    s_rows = s_ptr + (tl.minimum(offs_n, N - 1) // SCALE_ROWS).to(tl.int64) * stride_sn
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    k_len = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_len
    k_end = tl.minimum(k_begin + k_len, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + ks[:, None],
            mask=m_ok[None, :] & (ks < K)[:, None],
            other=0.0,
        )
        if DOT_FP32:
            xt = xt.to(tl.float32)
        if POST_SCALE:
            e = tl.load(s_rows + k0 // GROUP, mask=w_ok, other=127)
            one = tl.full([BLOCK_N], 127, tl.uint8)
            w = quantized_tile(
                w_rows, w_ok, one, k0, K, FP4, WORDS, GROUP, BLOCK_N, BLOCK_K, DOT_FP32
            )
            part = tl.dot(w, xt)
            acc += part * (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, None]
        else:
            e = quantized_scales(s_rows, w_ok, k0, K, GROUP, BLOCK_K)
            w = quantized_tile(
                w_rows, w_ok, e, k0, K, FP4, WORDS, GROUP, BLOCK_N, BLOCK_K, DOT_FP32
            )
            acc = tl.dot(w, xt, acc)
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT > 1:
        tl.atomic_add(y, acc, mask=m_ok[None, :] & w_ok[:, None])
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & w_ok[:, None])


def weight_first_linear(x, weight, bn, bk, warps, stages, post=False, split=1):
    m, k = x.shape
    n = weight.shape[0]
    data, words = stored_rows(weight)
    if split > 1:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    interp = x.device.type == "cpu"
    _weight_first_kernel[(triton.cdiv(n, bn), split)](
        x,
        data,
        weight.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        FP4=weight.fmt == "mxfp4",
        WORDS=words,
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_N=bn,
        BLOCK_K=bk,
        BLOCK_M=16,
        POST_SCALE=post,
        SPLIT=split,
        DOT_FP32=interp,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _split_fixed_order_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    FP4: tl.constexpr,
    PTX: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    # The library's orientation and product over K slice `split` of SPLIT (whole BLOCK_K steps);
    # the fp32 partial goes to part[split]; the column block's last program to arrive sums the
    # SPLIT partials in split order (the same bits whatever the arrival order) and resets the
    # block's counter for the next launch.
    col = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    w_ok = offs_n < N
    m_ok = offs_m < M
    k_len = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_begin = split * k_len
    k_here = tl.maximum(tl.minimum(K - k_begin, k_len), 0)
    PER_ELEMENT: tl.constexpr = 2 if FP4 else 1  # channels per stored element
    scale_row = (tl.minimum(offs_n, N - 1) // SCALE_ROWS).to(tl.int64)
    acc = quantized_product(
        x_ptr + k_begin + offs_m.to(tl.int64) * stride_xm,
        m_ok,
        w_ptr + k_begin // PER_ELEMENT + offs_n.to(tl.int64) * stride_wn,
        w_ok,
        s_ptr + k_begin // GROUP + scale_row * stride_sn,
        k_here,
        16,
        BLOCK_N,
        BLOCK_K,
        FP4,
        PTX,
        ALIGNED,
        GROUP,
        DOT_FP32,
        SPLIT_K,
    )
    tile = offs_m[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & w_ok[None, :]
    tl.store(part_ptr + split * M * N + tile, acc, mask=ok)
    arrived = tl.atomic_add(count_ptr + col, 1)  # acq_rel: the partials above are visible
    if arrived == SPLIT - 1:
        total = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT):
            total += tl.load(part_ptr + s * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
        y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y, total.to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(count_ptr + col, 0)


_SPLIT_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def split_fixed_order_linear(x, weight, bn, bk, split_k, warps, stages, split):
    """`quantized_linear` with K split over `split` programs per column block and a fixed-order
    sum of the partials by the block's last program (one launch, no atomics on the data)."""
    m, k = x.shape
    n = weight.shape[0]
    # A slice starts on a K step; its scales are indexed from the slice's first group.
    assert bk % weight.group == 0, "the K step must hold whole scale groups"
    data = weight.data
    key = (x.device, m, n, split, bn)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = (
            torch.empty((split, m, n), dtype=torch.float32, device=x.device),
            torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=x.device),
        )
    part, count = _SPLIT_BUFFERS[key]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _split_fixed_order_kernel[(triton.cdiv(n, bn), split)](
        x,
        data,
        weight.scale,
        out,
        part,
        count,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        weight.scale.stride(0),
        out.stride(0),
        FP4=weight.fmt == "mxfp4",
        PTX=fp4_ptx_decode(x.device),
        ALIGNED=fp4_rows_aligned(weight),
        GROUP=weight.group,
        SCALE_ROWS=weight.block_rows,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split_k,
        SPLIT=split,
        DOT_FP32=x.device.type == "cpu",
        num_warps=warps,
        num_stages=stages,
    )
    return out


# The library's orientation with K over programs: (BLOCK_N, BLOCK_K, SPLIT_K warps' slices,
# warps, stages, programs per column block).
SPLIT_FIXED = [
    (16, 1024, 8, 8, 3, 2),
    (16, 1024, 8, 8, 3, 4),
    (32, 512, 4, 4, 3, 4),
    (64, 256, 1, 4, 4, 4),
    (64, 256, 1, 4, 4, 8),
]
SPLIT_SMOKE = [(16, 128, 2, 2, 2, 2), (32, 128, 1, 4, 2, 3)]


# Four MXFP4 code bytes per 32-bit register in, the values * 2^-126 of their low nibbles (two
# registers of two bf16) and of their high nibbles out. A byte's high nibble is a bf16's sign
# and top exponent / mantissa bits once its byte is sign-extended (PRMT mode 8: the sign to bits
# 8-15) and shifted up 2; the low nibble takes the same path after the word is shifted up 4.
_NIBBLES_ASM = tl.constexpr(
    """
{
.reg .b32 t, u;
shl.b32 u, $4, 4;
prmt.b32 t, u, 0, 0x9180;
shl.b32 t, t, 2;
and.b32 $0, t, 0x81C081C0;
prmt.b32 t, u, 0, 0xB3A2;
shl.b32 t, t, 2;
and.b32 $1, t, 0x81C081C0;
prmt.b32 t, $4, 0, 0x9180;
shl.b32 t, t, 2;
and.b32 $2, t, 0x81C081C0;
prmt.b32 t, $4, 0, 0xB3A2;
shl.b32 t, t, 2;
and.b32 $3, t, 0x81C081C0;
}
"""
)


@triton.jit
def _nibble_kernel(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # MXFP4 only, K a multiple of BLOCK_K: the low nibbles (even channels) and the high nibbles
    # (odd channels) of a step's bytes decoded by the PTX above, each multiplied by its group's
    # 2^(e - 1), and two dots against the even and odd activation channels.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    w_ok = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    HALF: tl.constexpr = BLOCK_K // 2
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 2 + tl.arange(0, HALF))[None, :])
        g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        e = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :])
        mul = ((e.to(tl.int32) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        lo, hi = tl.inline_asm_elementwise(
            _NIBBLES_ASM,
            "=r,=r,=r,=r,r",
            [q],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
        per_group: tl.constexpr = [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]
        lo = tl.reshape(tl.reshape(lo, per_group) * mul[:, :, None], [BLOCK_N, HALF])
        hi = tl.reshape(tl.reshape(hi, per_group) * mul[:, :, None], [BLOCK_N, HALF])
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=(offs_m < M)[:, None],
            other=0.0,
        )
        x_even, x_odd = tl.split(tl.reshape(x, [16, HALF, 2]))
        acc = tl.dot(x_even, tl.trans(lo), acc)
        acc = tl.dot(x_odd, tl.trans(hi), acc)
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & w_ok[None, :])


def nibble_linear(x, weight, bn, bk, warps, stages):
    """MXFP4 `quantized_linear` with the nibbles decoded by inline PTX (NVIDIA only: neither the
    interpreter nor AMD runs it)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.fmt == "mxfp4" and k % bk == 0 and bk % weight.group == 0
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _nibble_kernel[(triton.cdiv(n, bn),)](
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
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return out


# (BLOCK_N, BLOCK_K, warps, stages) of the PTX nibble decode, wide N.
NIBBLES = [(64, 256, 4, 4), (64, 256, 4, 3), (128, 256, 8, 4)]


# (BLOCK_N, BLOCK_K, warps, stages, post-scale, split)
WIDE = [
    (64, 256, 4, 3, False, 1),
    (64, 256, 4, 4, False, 1),
    (128, 128, 4, 4, False, 1),
    (128, 256, 8, 3, False, 1),
    (128, 128, 8, 5, False, 1),
    (256, 128, 8, 3, False, 1),
    (64, 128, 4, 4, True, 1),
    (128, 128, 4, 4, True, 1),
    (128, 128, 8, 4, True, 1),
    (256, 128, 8, 4, True, 1),
]
NARROW = [
    (64, 256, 4, 3, False, 4),
    (64, 256, 4, 3, False, 8),
    (128, 128, 8, 4, False, 8),
    (64, 128, 4, 4, True, 8),
    (128, 128, 8, 4, True, 8),
]
SMOKE = [
    (64, 64, 4, 2, False, 1),
    (64, 32, 4, 2, True, 1),
    (64, 64, 4, 2, False, 2),
    (32, 128, 4, 2, False, 1),
]
SHAPES = [
    ("wide 32768x4096", 32768, 4096),
    ("q_b 32768x1024", 32768, 1024),
    ("o_b 4096x8192", 4096, 8192),
    ("shared gate_up 4096x4096", 4096, 4096),
]
FORMATS = (("fp8", 128), ("fp8", 32), ("mxfp4", 32))


def _tag(config: tuple) -> str:
    bn, bk, warps, stages, post, split = config
    tag = f"W-first BN{bn} BK{bk} w{warps} s{stages}"
    return tag + (" post" if post else "") + (f" split{split}" if split > 1 else "")


def _variants(
    fmt: str,
    group: int,
    configs: list[tuple],
    split_configs: list[tuple],
    nibble_configs: list[tuple],
) -> list[tuple[str, object]]:
    """The library's kernel, then the weight-first launch shapes that apply to the format
    (the post-scale needs one FP8 scale group per K step)."""
    out = [("library", quantized_linear)]
    for c in configs:
        if c[4] and not (fmt == "fp8" and group >= c[1]):
            continue
        out.append((_tag(c), lambda x, w, c=c: weight_first_linear(x, w, *c)))
    if fmt == "mxfp4":
        for c in nibble_configs:
            tag = "PTX nibbles BN{} BK{} w{} s{}".format(*c)
            out.append((tag, lambda x, w, c=c: nibble_linear(x, w, *c)))
    for c in split_configs:
        tag = "library order, BN{} BK{} slices{} w{} s{}, K over {} programs".format(*c)
        out.append((tag, lambda x, w, c=c: split_fixed_order_linear(x, w, *c)))
    return out


def _timed(call, x, weights) -> float:
    return bq.time_us([lambda w=w: call(x, w) for w in weights], bq._reps(len(weights)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--budget-s", type=float, default=480.0)
    a = p.parse_args()
    start = time.time()
    shapes, ms, configs = SHAPES, [1, 16], None
    if a.smoke:
        bq.SETUP.device = "cpu"
        shapes, ms, configs = [("smoke", 96, 160)], [1, 5], SMOKE
    lines = [
        "| shape | M | format | variant | us | x bf16 | TB/s (stored) | rel err |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def emit(*cells) -> None:
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        print(lines[-1], flush=True)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")

    for name, n, k in shapes:
        gen = bq._generator(n + k)
        wb = [bq._bf16_random((n, k), gen) for _ in range(bq._copies(n * k * 2))]
        for m in ms:
            x = torch.randn(m, k, generator=gen, device=bq.SETUP.device).to(torch.bfloat16)
            base = _timed(small_m_linear, x, wb)
            emit(
                name,
                m,
                "bf16",
                "small_m_linear",
                f"{base:.1f}",
                "1.00",
                f"{n * k * 2 / base / 1e6:.2f}",
                "-",
            )
            for fmt, group in FORMATS:
                if time.time() - start > a.budget_s:
                    emit(f"stopped at the {a.budget_s:.0f} s budget", "", "", "", "", "", "", "")
                    return
                ws = [bq.quantize_random((n, k), fmt, group, gen)]
                ws += [
                    bq.quantize_random((n, k), fmt, group, gen)
                    for _ in range(bq._copies(ws[0].nbytes) - 1)
                ]
                want = x.float() @ dequantize_weight_ref(ws[0], torch.float32).T
                shapes_here = configs or (WIDE if n > 8192 else NARROW + WIDE[:4])
                splits = SPLIT_SMOKE if a.smoke else (SPLIT_FIXED if n <= 8192 else [])
                nibbles = [] if a.smoke or n <= 8192 else NIBBLES
                for tag, call in _variants(fmt, group, shapes_here, splits, nibbles):
                    label = f"{fmt}/{group}"
                    try:
                        err = max_rel_err(call(x, ws[0]), want)
                        us = _timed(call, x, ws)
                    except Exception as exc:  # noqa: BLE001 - a shape the target cannot run
                        emit(
                            name,
                            m,
                            label,
                            tag,
                            f"{type(exc).__name__}: {str(exc)[:80]}",
                            "",
                            "",
                            "",
                        )
                        continue
                    tbps = ws[0].nbytes / us / 1e6
                    emit(
                        name,
                        m,
                        label,
                        tag,
                        f"{us:.1f}",
                        f"{base / us:.2f}",
                        f"{tbps:.2f}",
                        f"{err:.1e}",
                    )
                del ws
        del wb


if __name__ == "__main__":
    main()
