"""The lightning indexer's query chain in one launch: RoPE tail, FP4 fake-quant, FP4 pack into the
scoring kernel's scale layout, and optionally the head weights from split-K partials
(`index_q_rope_fp4_ref` is the spec; the format is in `reference.py`). Bit-exact: every step is
elementwise with a defined rounding (the bf16 rounding of the rotation on the bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import programmatic_launch, round_to_bf16, wait_for_producers
from sgl_dspark.kernels.indexer.fp4_codec import (
    ceil_pow2_biased_exponent,
    e2m1_decode,
    e2m1_encode,
    fp4_quant_groups,
    pow2_from_biased_exponent,
)
from sgl_dspark.kernels.indexer.reference import (
    FP4_GROUP,
    Q_SCALE_HEAD_BLOCK,
    Q_SCALE_HEAD_BLOCKS,
    IndexQFp4Output,
)


@triton.jit
def _index_q_rope_fp4_kernel(
    q_ptr,
    cos_sin_ptr,
    pos_ptr,
    codes_ptr,
    scales_ptr,
    partials_ptr,
    weights_ptr,
    fake_quant_ptr,
    q_row_stride,
    max_pos,
    n_heads,
    partial_stride,
    head_weight_scale,
    NUM_PARTIALS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    WRITE_FAKE_QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, 4): 16 heads of one token per program; head blocks beyond n_heads zero-fill
    their scale slots."""
    wait_for_producers(PDL)  # q and the weight partials are the projections' outputs
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    heads = head_block * 16 + tl.arange(0, 16)
    offs_g = tl.arange(0, GP)
    offs_p = tl.arange(0, 16)
    g_ok = offs_g < G
    scale_offs = t * (G * 64) + offs_g[None, :] * 64 + tl.arange(0, 16)[:, None] * 4 + head_block
    if head_block * 16 >= n_heads:
        zeros = tl.zeros([16, GP], tl.int32).to(tl.uint8)
        tl.store(scales_ptr + scale_offs, zeros, mask=g_ok[None, :])
        return

    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.where((pos >= 0) & (pos < max_pos), pos, 0)
    pair = (offs_g * 16)[None, :, None] + offs_p[None, None, :]  # pair index inside a head
    mask = g_ok[None, :, None] & (heads < n_heads)[:, None, None]
    src = q_ptr + t * q_row_stride + heads[:, None, None] * HEAD_DIM + 2 * pair
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)

    # Step 1: rotate the trailing ROPE_DIM channels (complex multiply by e^{i·phi}).
    NOPE_PAIRS: tl.constexpr = (HEAD_DIM - ROPE_DIM) // 2
    is_rope = pair >= NOPE_PAIRS
    table = cos_sin_ptr + pos * ROPE_DIM + 2 * (pair - NOPE_PAIRS)
    cos = tl.load(table, mask=mask & is_rope, other=1.0)
    sin = tl.load(table + 1, mask=mask & is_rope, other=0.0)
    rot_a = a * cos - b * sin
    rot_b = a * sin + b * cos
    if ROUND_BF16:
        rot_a = round_to_bf16(rot_a)
        rot_b = round_to_bf16(rot_b)
    a = tl.where(is_rope, rot_a, a)
    b = tl.where(is_rope, rot_b, b)

    # Step 2: fake-quant with a power-of-two scale (amax floored before the /6).
    amax = tl.maximum(tl.max(tl.abs(a), axis=2), tl.max(tl.abs(b), axis=2))
    sf = tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-126), 6.0)
    s = pow2_from_biased_exponent(ceil_pow2_biased_exponent(sf))[:, :, None]
    a = e2m1_decode(e2m1_encode(tl.div_rn(a, s))) * s
    b = e2m1_decode(e2m1_encode(tl.div_rn(b, s))) * s
    if WRITE_FAKE_QUANT:
        dst = fake_quant_ptr + t * n_heads * HEAD_DIM + heads[:, None, None] * HEAD_DIM + 2 * pair
        tl.store(dst, a.to(fake_quant_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + 1, b.to(fake_quant_ptr.dtype.element_ty), mask=mask)

    # Step 3: real quantisation of the (exactly bf16) fake-quant values, floor after the /6.
    packed, exponent = fp4_quant_groups(a, b)
    dst = codes_ptr + t * n_heads * (HEAD_DIM // 2) + heads[:, None, None] * (HEAD_DIM // 2) + pair
    tl.store(dst, packed.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + scale_offs, exponent.to(tl.uint8), mask=g_ok[None, :])

    # Step 4: head weights, split-K partials summed in order.
    if HAS_WEIGHTS:
        acc = tl.load(partials_ptr + t * n_heads + heads)
        for sk in range(1, NUM_PARTIALS):
            acc = acc + tl.load(partials_ptr + sk * partial_stride + t * n_heads + heads)
        w = acc * head_weight_scale
        if ROUND_BF16:
            w = round_to_bf16(w)
        tl.store(weights_ptr + t * n_heads + heads, w.to(weights_ptr.dtype.element_ty))


def index_q_rope_fp4(
    q: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    n_heads: int,
    rope_dim: int,
    weight_partials: torch.Tensor | None = None,
    head_weight_scale: float = 1.0,
    return_fake_quant: bool = False,
    out: IndexQFp4Output | None = None,
) -> IndexQFp4Output:
    """`index_q_rope_fp4_ref` in one launch, bit for bit.

    Args:
        q: [T, n_heads·Di] bf16 or fp32, unit inner stride; n_heads a multiple of 16, <= 64;
            Di a multiple of 32.
        cos_sin: fp32 [max_pos, rope_dim/2, 2] contiguous; rope_dim even, <= Di.
        positions: int32/int64 [T]; out-of-table positions use entry 0.
        weight_partials: optional fp32 [S, T, n_heads] contiguous (see the reference).
        return_fake_quant: also write the step-2 tensor [T, n_heads·Di].
        out: optional preallocated outputs; the fields used must be given with the right shapes.
    """
    require(q.dim() == 2, f"q: expected [T, n_heads*Di], got {tuple(q.shape)}")
    t, width = q.shape
    require(
        n_heads % Q_SCALE_HEAD_BLOCK == 0
        and 0 < n_heads <= Q_SCALE_HEAD_BLOCK * Q_SCALE_HEAD_BLOCKS,
        f"n_heads: must be a multiple of 16 in [16, 64], got {n_heads}",
    )
    require(width % n_heads == 0, f"q: width {width} is not a multiple of n_heads={n_heads}")
    head_dim = width // n_heads
    require(head_dim % FP4_GROUP == 0, f"q: head dim {head_dim} must be a multiple of 32")
    require(
        rope_dim % 2 == 0 and 0 < rope_dim <= head_dim,
        f"rope_dim: must be even in (0, {head_dim}], got {rope_dim}",
    )
    require(q.dtype in (torch.bfloat16, torch.float32), f"q: must be bf16/fp32, got {q.dtype}")
    require(q.stride(1) == 1 or t == 0, "q: inner stride must be 1")
    require(
        cos_sin.dim() == 3
        and cos_sin.shape[1:] == (rope_dim // 2, 2)
        and cos_sin.dtype == torch.float32
        and cos_sin.is_contiguous(),
        f"cos_sin: expected contiguous fp32 [max_pos, {rope_dim // 2}, 2]",
    )
    require(
        positions.shape == (t,) and positions.dtype in (torch.int32, torch.int64),
        f"positions: expected int32/int64 [{t}]",
    )
    positions = positions.contiguous()
    if weight_partials is not None:
        require(
            weight_partials.dim() == 3
            and weight_partials.shape[1:] == (t, n_heads)
            and weight_partials.shape[0] >= 1
            and weight_partials.dtype == torch.float32
            and weight_partials.is_contiguous(),
            f"weight_partials: expected contiguous fp32 [S>=1, {t}, {n_heads}]",
        )
    g = head_dim // FP4_GROUP
    dev = q.device
    specs: list[tuple[tuple[int, ...], torch.dtype, bool]] = [  # (shape, dtype, wanted)
        ((t, n_heads, head_dim // 2), torch.uint8, True),
        ((t, 1, g, Q_SCALE_HEAD_BLOCK, Q_SCALE_HEAD_BLOCKS), torch.uint8, True),
        ((t, n_heads), q.dtype, weight_partials is not None),
        ((t, width), q.dtype, return_fake_quant),
    ]
    given: tuple[torch.Tensor | None, ...] = out if out is not None else (None,) * 4
    bufs: list[torch.Tensor | None] = []
    for name, buf, (shape, dt, want) in zip(IndexQFp4Output._fields, given, specs):
        if want and buf is None and out is None:
            buf = torch.empty(shape, dtype=dt, device=dev)
        if want:
            require(
                buf is not None
                and tuple(buf.shape) == shape
                and buf.dtype == dt
                and buf.is_contiguous()
                and buf.device == dev,
                f"out.{name}: expected contiguous {dt} {shape} on {dev}",
            )
        bufs.append(buf if want else None)
    codes, scales, head_weights, fake_quant = bufs
    assert codes is not None and scales is not None
    out = IndexQFp4Output(codes, scales, head_weights, fake_quant)
    if t == 0:
        return out
    _index_q_rope_fp4_kernel[(t, Q_SCALE_HEAD_BLOCKS)](
        q,
        cos_sin,
        positions,
        out.codes,
        out.scales,
        weight_partials if weight_partials is not None else q,
        out.head_weights if out.head_weights is not None else q,
        out.fake_quant if out.fake_quant is not None else q,
        q.stride(0),
        cos_sin.shape[0],
        n_heads,
        t * n_heads,
        float(head_weight_scale),
        NUM_PARTIALS=weight_partials.shape[0] if weight_partials is not None else 0,
        HEAD_DIM=head_dim,
        ROPE_DIM=rope_dim,
        G=g,
        GP=triton.next_power_of_2(g),
        ROUND_BF16=q.dtype == torch.bfloat16,
        HAS_WEIGHTS=weight_partials is not None,
        WRITE_FAKE_QUANT=return_fake_quant,
        num_warps=4,
        enable_fp_fusion=False,
        **programmatic_launch(_index_q_rope_fp4_kernel, q.device),
    )
    return out
