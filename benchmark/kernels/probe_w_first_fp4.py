"""Probe: MXFP4 weight-only linears at decode sizes on mma.sync with the weight as the first
operand, loaded from global memory straight into its registers (no shared memory, no CTA barrier
in the K loop): the MXFP4 form of `probe_fma_gemv.py`'s weight-first kernel.

    python benchmark/kernels/probe_w_first_fp4.py --out $OUT/probe.md   (H100 / H200)

y^T = W x^T, 16 weight rows an instruction as the first operand and up to 8 (or 16) tokens as
the second, so the matrix unit's cost does not grow with the tokens and a row's arithmetic does
not depend on the other rows. A thread loads 4 consecutive code bytes of a row (8 channels; 16
bytes a row hold one 32-channel scale group), decodes and scales them in registers with the
library's inline PTX (`dequant.E2M1_SCALED_PTX`: a byte permute, a shift, a mask and a packed
bf16 multiply per two weights; the multiply by the group's 2^(e - 1) also lifts the values out of
the subnormal range the decode leaves them in), and multiplies the even channels (low nibbles)
then the odd ones (high nibbles) into the accumulator, one k16 instruction each a group. The
activation's 8 consecutive channels a thread (one 16-byte load a token, shared by the warp's row
tiles) split into the even and odd operands in registers. A program's warps split its rows, or
its K in slices (each warp its own slice and accumulator, the slices' sums added once after the
loop), so that one expert's 5120 rows (320 tiles of 16) keep several warps a scheduler.

The shapes are the per-token MoE's: one routed expert's down projection (5120 x 2304), a token's
seven (six routed and the folded shared expert, stacked: 35840 x 2304) and its seven gate/up
projections (32256 x 5120). Each variant is checked against dequantise-then-reference (fp32) and
timed beside the library's `quantized_linear` in CUDA graphs over weight copies beyond L2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "python")]

from sgl_dspark.kernels.linear.dequant import E2M1_SCALED_PTX  # noqa: E402

from benchmark.kernels.probe_fma_gemv import (  # noqa: E402
    _launch,
    _slice_offsets,
    _wait_for_producers,
    time_variants,
)

# `E2M1_SCALED_PTX` with one multiplier pair for the four bytes ($5; $6..$8, the same register
# repeated by the packing, unused): the four code bytes of a thread share a row and a group.
E2M1_PAIR_SCALED = gl.constexpr(E2M1_SCALED_PTX.value.replace("$6", "$5"))


@gluon.jit
def _w_first_fp4_kernel(
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
    WARPS_K: gl.constexpr,
    PDL: gl.constexpr,
):
    """A program: BLOCK_N weight rows x TOKENS tokens, its warps split along N and along K in
    WARPS_K slices (each slice GROUPS 32-channel groups a step, its own accumulator; the slices'
    sums added once at the end), over K in steps of WARPS_K x GROUPS groups (K a multiple of
    the step: the probe's shapes)."""
    WARPS: gl.constexpr = gl.num_warps()
    HALF: gl.constexpr = GROUP // 2  # code bytes of a row in one group
    SLICE: gl.constexpr = GROUPS * GROUP  # a warp's channels a step
    # Axis 0 the K slice (a warp's), axis 1 the weight rows, axis 2 the tokens.
    MMA: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS_K, WARPS // WARPS_K, 1], instr_shape=[1, 16, 8]
    )
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    # The activation [slice, channel, token]: a thread holds 8 consecutive channels of a token
    # (one 16-byte load), the lanes as B's (4 along the channels, 8 tokens), the warps of a
    # slice each a copy.
    X3: gl.constexpr = gl.BlockedLayout(
        [1, 8, 1], [1, 4, 8], [WARPS_K, WARPS // WARPS_K, 1], [1, 2, 0]
    )
    t0 = gl.program_id(1).to(gl.int64) * TOKENS
    x_ptr += t0 * stride_xm
    y_ptr += t0 * stride_ym
    M -= t0
    col0 = gl.program_id(0) * BLOCK_N
    # Code bytes [slice, row, byte] of group 0 of each slice.
    wn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    wb = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, A)))
    w_rows = gl.minimum(col0 + wn, N - 1).to(gl.int64) * stride_wn
    w3 = w_ptr + _slice_offsets(SLICE // 2, w_rows, wb, WARPS_K, A)
    xk = gl.arange(0, GROUP, layout=gl.SliceLayout(0, gl.SliceLayout(2, X3)))
    xt = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, gl.SliceLayout(1, X3)))
    x3 = x_ptr + _slice_offsets(SLICE, xk, xt.to(gl.int64) * stride_xm, WARPS_K, X3)
    xmask = gl.expand_dims(gl.expand_dims(xt < M, 0), 1)
    # Scale bytes [slice, row] of group 0 of each slice, beside the code bytes.
    ss = gl.arange(0, WARPS_K, layout=gl.SliceLayout(1, gl.SliceLayout(2, A)))
    sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    s_rows = (gl.minimum(col0 + sn, N - 1) // SCALE_ROWS).to(gl.int64) * stride_sn
    s2 = s_ptr + gl.expand_dims(ss * GROUPS, 1) + gl.expand_dims(s_rows, 0)
    _wait_for_producers(PDL)
    acc = gl.zeros((WARPS_K, BLOCK_N, TOKENS), gl.float32, layout=MMA)
    # The pointers advance a step at a time (loop-carried), so a group's offset within the
    # step is a constant the loads fold into their address.
    for _k0 in range(0, K, WARPS_K * SLICE):
        for g in gl.static_range(GROUPS):
            q = gl.load(w3 + g * HALF)
            # 2^(e - 1) as a bf16 pair (exponent byte e + 126 in both halves), one multiply-add
            # from the scale byte, beside each code byte of its row.
            e = gl.load(s2 + g).to(gl.uint32)
            pair = gl.broadcast(gl.expand_dims(e * 0x00800080 + 0x3F003F00, 2), q)[0]
            lo, hi = gl.inline_asm_elementwise(
                E2M1_PAIR_SCALED,
                "=r,=r,=r,=r,r,r,r,r,r",
                [q, pair],
                dtype=(gl.bfloat16, gl.bfloat16),
                is_pure=True,
                pack=4,
            )
            xv = gl.load(x3 + g * GROUP, mask=xmask, other=0.0)  # [slice, GROUP, TOKENS]
            xv = gl.permute(gl.reshape(xv, [WARPS_K, HALF, 2, TOKENS]), [0, 1, 3, 2])
            x_even, x_odd = gl.split(xv)  # channels 2b and 2b + 1
            acc = mma_v2(lo, gl.convert_layout(x_even, B), acc)
            acc = mma_v2(hi, gl.convert_layout(x_odd, B), acc)
        w3 += WARPS_K * SLICE // 2
        s2 += WARPS_K * GROUPS
        x3 += WARPS_K * SLICE
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


def w_first_fp4_linear(
    x, weight, bn: int, groups: int, warps: int, tokens: int = 8, warps_k: int = 1
):
    return _launch(
        _w_first_fp4_kernel,
        x,
        weight,
        bn,
        tokens,
        x.device.type == "cuda",
        TOKENS=tokens,
        GROUPS=groups,
        WARPS_K=warps_k,
        num_warps=warps,
    )


# The per-token MoE's MXFP4 shapes (N, K): one expert's down projection, a token's seven
# stacked, its seven gate/up projections stacked.
SHAPES = [("down_1", 5120, 2304), ("down_7", 35840, 2304), ("gate_up_7", 32256, 5120)]
# (BLOCK_N, groups a warp's K slice a step, warps, tokens an accumulator, warps along K)
CONFIGS = [
    (16, 8, 1, 8),
    (32, 8, 2, 8),
    (64, 8, 4, 8),
    (32, 4, 1, 8),
    (64, 4, 2, 8),
    (32, 8, 2, 16),
    (16, 4, 2, 8, 2),
    (16, 2, 4, 8, 4),
    (32, 4, 4, 8, 2),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--ms", default="1,4,16")
    p.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    p.add_argument("--budget-s", type=float, default=240.0)
    a = p.parse_args()
    shapes = [shape for shape in SHAPES if shape[0] in a.shapes.split(",")]

    def variants_of(m: int, k: int) -> list[tuple[str, object]]:
        return [
            (
                f"W first BN{c[0]} BK{c[1] * 32} w{c[2]} t{c[3]}"
                + (f" wk{c[4]}" if c[4:] and c[4] > 1 else ""),
                lambda x, w, c=c: w_first_fp4_linear(x, w, *c),
            )
            for c in CONFIGS
            if k % (c[1] * 32 * (c[4] if c[4:] else 1)) == 0
        ]

    ms = [int(v) for v in a.ms.split(",")]
    time_variants(shapes, "mxfp4", ms, variants_of, "", time.time() + a.budget_s, a.out)


if __name__ == "__main__":
    main()
