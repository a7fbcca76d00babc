"""Engram's gated add in one launch (`engram_gate_ref` is the spec): per token and stream, the
mean squares of the stream and of its key, their dot product through `q_weight * k_weight`, the
signed-square-root sigmoid gate and `stream + gate * value`, all in fp32, one program per
(token, stream) reading the `wkv` output in place.

Batch-invariant by construction: a program reads only its own row, and the three sums over D run
in a tree fixed by D alone (the block width and warp count follow D, never the number of
tokens), so a row's bits do not depend on the batch it is in, on any backend.

Exactness: within a tolerance of `engram_gate_ref`. The sums run in another order than torch's,
and the rsqrt and exp are the backend's (the interpreter's numpy, the GPU's approximations; the
divisions and the square root are correctly rounded), so the gate may differ from torch's in its
last fp32 bits. Given the same gate, the output equals torch bit for bit: the product and the
add are separate fp32 roundings (FMA contraction is off) and 16-bit outputs round to nearest
even. So bf16 / fp16 outputs differ by one unit in the last place where the gate's last bits
moved an element across a rounding boundary (rarely), fp32 outputs by the gate's error times
|value| plus an ulp; where the add cancels, a 16-bit output's error is that of fp32 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import FLOAT_DTYPES, require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_dtype,
    wait_for_producers,
)
from sgl_dspark.kernels.engram.reference import GATE_FLOOR

# A program holds one row of each operand in registers (the stream, the key, both weights, the
# value): 16384 fp32 per operand over 16 warps is 32 registers a thread each. V4.1's hidden size
# is 5120.
MAX_D = 16384


@triton.jit
def _engram_gate_kernel(
    streams_ptr,
    streams_stride_t,
    streams_stride_n,
    kv_ptr,
    kv_stride_t,
    q_ptr,
    k_ptr,
    out_ptr,
    n_streams,
    eps,
    scale,
    floor,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KIND: tl.constexpr,
    ON_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)  # the streams and the wkv output come from the kernels before
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # Masked lanes load 0 and add nothing to the sums; the tree over BLOCK_D depends on D only.
    s = tl.load(
        streams_ptr + t * streams_stride_t + j * streams_stride_n + offs, mask=mask, other=0.0
    ).to(tl.float32)
    kv_row = kv_ptr + t * kv_stride_t
    key = tl.load(kv_row + j * D + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + j * D + offs, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + j * D + offs, mask=mask, other=0.0).to(tl.float32)
    if (D & (D - 1)) == 0:
        # Dividing by a power of two is multiplying by its exact reciprocal (same rounding).
        ms_s = tl.sum(s * s, axis=0) * (1.0 / D)
        ms_k = tl.sum(key * key, axis=0) * (1.0 / D)
    else:
        ms_s = tl.div_rn(tl.sum(s * s, axis=0), D * 1.0)
        ms_k = tl.div_rn(tl.sum(key * key, axis=0), D * 1.0)
    rstd = tl.rsqrt(ms_s + eps) * tl.rsqrt(ms_k + eps)
    dot = tl.sum(s * (q * k) * key, axis=0) * rstd * scale
    # NaN propagates as in torch's clamp. A zero dot takes the positive root whatever its sign:
    # torch's sum starts from +0, so its dot of all-(-0) products is +0, where a tree of them
    # here would keep -0 and copysign would flip the gate.
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor, propagate_nan=tl.PropagateNan.ALL))
    signed = tl.where(dot < 0, -root, root)
    gate = tl.div_rn(1.0, 1.0 + tl.exp(-signed))
    # The value is needed only now: loaded late, it does not sit in registers during the sums.
    value = tl.load(kv_row + n_streams * D + offs, mask=mask, other=0.0).to(tl.float32)
    y = round_to_dtype(s + gate * value, KIND, ON_BITS)
    tl.store(out_ptr + (t * n_streams + j) * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gate_meta(d: int) -> dict[str, int]:
    """Launch meta-parameters from the row width only: they fix the layout of a row over
    threads, hence the summation trees (a rule that looked at the token count would make a row's
    bits depend on its batch)."""
    block_d = triton.next_power_of_2(d)
    return {"BLOCK_D": block_d, "num_warps": min(16, max(4, block_d // 512))}


def engram_gate(
    streams: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`engram_gate_ref` in one launch (within a tolerance, see the module doc), no host sync.

    Args:
        streams: [T, n, D] fp32/bf16/fp16, unit stride in D (any token and stream strides),
            1 <= D <= MAX_D.
        kv: [T, (n + 1) * D] any float dtype (the `wkv` output: n keys, then the value), unit
            stride in the last dim, any row stride.
        q_weight, k_weight: [n, D] contiguous, any float dtype.
        eps: added to each mean square.
        out: optional contiguous [T, n, D] buffer in streams' dtype.
    Returns:
        `out` (allocated when None); a row's bits do not depend on T or on the other rows.
    """
    require(
        streams.dim() == 3 and streams.dtype in FLOAT_DTYPES,
        f"streams: expected fp32/bf16/fp16 [T, n, D], got {streams.dtype} {tuple(streams.shape)}",
    )
    t, n, d = streams.shape
    require(
        streams.stride(2) == 1 or d == 1, f"streams: needs unit stride in D, got {streams.stride()}"
    )
    require(1 <= d <= MAX_D, f"streams: D must be in [1, {MAX_D}], got {d}")
    require(n >= 1, f"streams: needs at least one stream, got shape {tuple(streams.shape)}")
    device = streams.device
    require(
        kv.dim() == 2
        and tuple(kv.shape) == (t, (n + 1) * d)
        and kv.is_floating_point()
        and (kv.stride(1) == 1 or t == 0),
        f"kv: expected a float [{t}, {(n + 1) * d}] with unit stride in the last dim, got "
        f"{kv.dtype} {tuple(kv.shape)} strides {kv.stride()}",
    )
    require(kv.device == device, f"kv: expected device {device}, got {kv.device}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        require(
            tuple(w.shape) == (n, d) and w.is_floating_point() and w.is_contiguous(),
            f"{name}: expected a contiguous float [{n}, {d}], got {w.dtype} {tuple(w.shape)}",
        )
        require(w.device == device, f"{name}: expected device {device}, got {w.device}")
    if out is None:
        out = torch.empty(t, n, d, dtype=streams.dtype, device=device)
    require(
        tuple(out.shape) == (t, n, d)
        and out.dtype == streams.dtype
        and out.is_contiguous()
        and out.device == device,
        f"out: expected a contiguous {streams.dtype} [{t}, {n}, {d}] on {device}, got "
        f"{out.dtype} {tuple(out.shape)} on {out.device}",
    )
    if t == 0:
        return out
    _engram_gate_kernel[(t, n)](
        streams,
        streams.stride(0),
        streams.stride(1),
        kv,
        kv.stride(0),
        q_weight,
        k_weight,
        out,
        n,
        float(eps),
        d**-0.5,
        GATE_FLOOR,
        D=d,
        KIND=DTYPE_KIND[streams.dtype],
        ON_BITS=interpreted(_engram_gate_kernel),
        enable_fp_fusion=False,
        **programmatic_launch(_engram_gate_kernel, device),
        **_gate_meta(d),
    )
    return out


__all__ = ["MAX_D", "engram_gate"]
