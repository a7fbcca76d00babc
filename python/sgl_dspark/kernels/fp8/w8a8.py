"""W8A8 block-scaled GEMMs: FP8 activations (per-token-group scales, `act_quant.py`) times FP8
weights kept as stored (E8M0 scales per block), on the matrix units' FP8 MMA
(`w8a8_linear_ref`, `w8a8_grouped_linear_ref` and `w8a8_split_k_linear_ref` are the spec).

One kernel, three launchers:
  * `w8a8_linear`: prefill-sized linear layers. Each program owns a BLOCK_M x BLOCK_N output
    tile (grouped launch order: GROUP_M row tiles walk the same column band, so the weight
    stays in L2) and streams K in steps of BLOCK_K channels, each step taken as chunks of SUB =
    min(activation group, weight group, BLOCK_K) channels: one FP8 x FP8 `tl.dot` from zero per
    chunk (fp32 out), then `(part * s_a[m]) * s_w[n]` joins the fp32 accumulator. Promoting
    every chunk keeps the FP8 MMA's short internal accumulation to one scale group.
  * `w8a8_grouped_linear`: G such products in one launch (the grouped output projection).
  * `w8a8_split_k_linear`: a fixed-shape, weight-bound projection with a long K (the DSpark
    main projection: K = taps x D, M = the graph's rows), taking its activation in the model
    dtype: quantised once (`quantize_act_fp8`), then the GEMM on the codes with the K range cut
    into S splits over a third grid axis, each writing an fp32 partial, then
    `_split_k_reduce_kernel` sums the partials in split order and rounds. The quantisation is a
    launch of its own because in the GEMM's prologue every column tile's program would
    quantise the same activation chunk again (N / BLOCK_N times over, on the critical path).
    S depends on (M, N, K) only (`split_k_splits`): fixed for a captured graph, so the bits are
    deterministic.

Exactness: against the reference with the same activation quantisation, the products are exact
and the chunk terms are formed and summed in the reference's order with FMA contraction off
(fp32); only each chunk's own sum P_c is the matrix unit's (the reference rounds the exact sum
once): a tolerance of the fp32 sums, far below the output's rounding (bf16 outputs differ in
rare last-bit flips). The split-K variant's activation codes and scales are `quantize_act_fp8`'s
(the reference's, bit for bit); it sums different chunks per split than the plain GEMM: not
bitwise equal to it, deterministic for a given S. Against dequantise-then-bf16 the
activation's E4M3 rounding is the change (`w8a8_bf16_gap_bound_ref`). Tiles depend on M (a
row's last bits may depend on the number of rows: 64-row tiles up to 64 rows, 128 above). The CPU interpreter has no FP8 dot: there
the codes are widened to fp32 (exact) and the dot runs in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_dspark.kernels._checks import require
from sgl_dspark.kernels._triton_utils import (
    DTYPE_KIND,
    interpreted,
    programmatic_launch,
    round_to_storage,
    wait_for_producers,
)
from sgl_dspark.kernels.fp8.act_quant import check_group, quantize_act_fp8
from sgl_dspark.kernels.fp8.reference import Fp8ActFormat, Fp8Activation
from sgl_dspark.kernels.linear.dequant import e8m0_to_fp32
from sgl_dspark.kernels.linear.reference import QuantizedWeight, check_quantized_weight

BLOCK_K = 128
MIN_CHUNK = 32  # an FP8 MMA's K step: smaller scale groups cannot take this path
# Split-K: aim at this many programs (about two per SM or CU), with fp32 partial traffic (write
# and read) at most 1/4 of the weight's bytes.
_SPLIT_TARGET_PROGRAMS = 256
_SPLIT_MAX_TRAFFIC = 0.25
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def w8a8_chunk(
    a_rows,
    a_ok,
    sa_rows,
    w_rows,
    w_ok,
    sw_rows,
    k0,
    k_dim,
    A_GROUP: tl.constexpr,
    W_GROUP: tl.constexpr,
    SUB: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The scaled product of channels [k0, k0 + SUB) as fp32 [BM, BN] (module doc).

    a_rows [BM]: pointers to the activation rows (FP8 codes), a_ok [BM]; sa_rows [BM]: pointers
    to the rows' scales; w_rows [BN]: pointers to the weight rows of each output column, w_ok
    [BN]; sw_rows [BN]: pointers to their E8M0 scale rows."""
    k = k0 + tl.arange(0, SUB)
    k_ok = k < k_dim
    w = tl.load(w_rows[None, :] + k[:, None], mask=k_ok[:, None] & w_ok[None, :], other=0.0)
    a = tl.load(a_rows[:, None] + k[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
    # A chunk past K (K below the K step) has no scale column: reading one would read past the
    # row (the next row's scale, or past the end of the last row's allocation), and a NaN there
    # makes NaN of the chunk's zero product.
    sa = tl.load(sa_rows + k0 // A_GROUP, mask=a_ok & (k0 < k_dim), other=0.0)
    if DOT_FP32:
        part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, w)
    sw = e8m0_to_fp32(tl.load(sw_rows + k0 // W_GROUP, mask=w_ok & (k0 < k_dim), other=0))
    return part * sa[:, None] * sw[None, :]


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,
    sa_ptr,
    w_ptr,
    sw_ptr,
    out_ptr,
    M,
    N,
    K,
    k_split,
    stride_am,
    stride_sam,
    stride_wn,
    stride_swn,
    stride_om,
    stride_ag,
    stride_sag,
    stride_wg,
    stride_og,
    A_GROUP: tl.constexpr,
    W_GROUP: tl.constexpr,
    W_ROWS: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PARTIAL: tl.constexpr,
    OUT_KIND: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (tile, split, group). Tiles in grouped order: GROUP_M row tiles per column band.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * num_n)
    first_m = band * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    wait_for_producers(PDL)  # the activation is the previous kernel's output
    a_rows = a_ptr + group * stride_ag + offs_m.to(tl.int64) * stride_am
    sa_rows = sa_ptr + group * stride_sag + offs_m.to(tl.int64) * stride_sam
    w_rows = w_ptr + group * stride_wg + offs_n.to(tl.int64) * stride_wn
    # Group g's weight is rows g * N + n of the stacked weight (its scale blocks may span groups).
    sw_rows = sw_ptr + ((group * N + offs_n.to(tl.int64)) // W_ROWS) * stride_swn
    k_start = split * k_split
    k_end = tl.minimum(K, k_start + k_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB):
            acc += w8a8_chunk(
                a_rows,
                mask_m,
                sa_rows,
                w_rows,
                mask_n,
                sw_rows,
                k0 + j * SUB,
                K,
                A_GROUP,
                W_GROUP,
                SUB,
                DOT_FP32,
            )
    mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:  # split s of a [S, M, N] fp32 workspace
        rows = split.to(tl.int64) * M + offs_m.to(tl.int64)
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        acc = round_to_storage(acc, OUT_KIND)
        out_rows = out_ptr + group * stride_og + offs_m[:, None].to(tl.int64) * stride_om
        tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr,
    out_ptr,
    total,
    N,
    stride_om,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_KIND: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = sum over s = 0..SPLITS-1 in order of ws[s, m, n], rounded once.

    `total` = M * N comes from the host: a scalar argument equal to 1 is a compile-time
    constant on the GPU, a Python int with no `.to`."""
    wait_for_producers(PDL)  # the partials are the previous kernel's output
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
    acc = round_to_storage(acc, OUT_KIND)
    rows, cols = offs // N, offs % N
    tl.store(out_ptr + rows * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def chunk_width(act_group: int, weight: QuantizedWeight) -> int:
    """Channels per FP8 dot (module doc)."""
    return min(act_group, weight.group, BLOCK_K)


def supports(act_group: int, weight: QuantizedWeight) -> bool:
    """Whether an FP8 weight and activations in groups of `act_group` can take these kernels:
    each chunk must be at least one FP8 MMA K step (32 channels)."""
    return weight.fmt == "fp8" and chunk_width(act_group, weight) >= MIN_CHUNK


def split_k_supports(act_group: int, weight: QuantizedWeight) -> bool:
    """Whether `w8a8_split_k_linear` takes them: its reference (`w8a8_split_k_linear_ref`)
    chunks K by min(act_group, weight.group), and a split (whole K steps of `BLOCK_K`) must be
    whole chunks."""
    return supports(act_group, weight) and min(act_group, weight.group) <= BLOCK_K


# Row tiles of at least 64: Hopper's FP8 MMA is the warpgroup MMA, whose tile has 64 rows
# (Triton lowers a smaller tile to the older MMA, which has no FP8 form on sm90 and converts the
# operands to fp16).
_MIN_BLOCK_M = 64


def _gemm_meta(m: int) -> dict[str, int]:
    """Launch shape (the one place sweeps override): 128 x 128 tiles with 8 warps above 64
    rows, else 64 x 128 with 4; K steps of 128 channels."""
    if m > _MIN_BLOCK_M:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": _MIN_BLOCK_M, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}


def _split_meta(m: int) -> dict[str, int]:
    """Split-K launch shape: narrow column tiles, so a small M still spreads the weight stream
    over many programs."""
    return {"BLOCK_M": _MIN_BLOCK_M, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}


def split_k_splits(m: int, n: int, k: int) -> int:
    """How many K splits the split-K GEMM uses for (M, N, K): enough programs to fill the
    device (about `_SPLIT_TARGET_PROGRAMS`), at most one per K step, and fp32 partials of at most
    `_SPLIT_MAX_TRAFFIC` of the weight's bytes. A function of the shape alone (the bits depend on
    it)."""
    meta = _split_meta(m)
    tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
    want = max(1, _SPLIT_TARGET_PROGRAMS // tiles)
    traffic_cap = max(1, int(_SPLIT_MAX_TRAFFIC * k / (8 * max(m, 1))))
    return max(1, min(want, traffic_cap, triton.cdiv(k, BLOCK_K)))


def _check_weight(weight: QuantizedWeight, k: int, device: torch.device) -> None:
    check_quantized_weight(weight)
    require(weight.fmt == "fp8", f"weight: an FP8 weight, got {weight.fmt}")
    require(weight.data.dim() == 2, f"weight must be 2-D [N, K], got {weight.shape}")
    require(weight.shape[1] == k, f"weight: expected K={k} channels, got {weight.shape[1]}")
    require(
        weight.data.device == device and weight.scale.device == device,
        f"weight is on {weight.data.device}, the activation on {device}",
    )
    require(
        weight.data.stride(1) == 1 and weight.scale.stride(1) == 1,
        "weight data and scale need unit stride along K",
    )


def _check_act(act: Fp8Activation, group: int, lead: tuple[int, ...], k: int) -> None:
    check_group(group)
    require(
        act.q.dtype == torch.float8_e4m3fn and tuple(act.q.shape) == (*lead, k),
        f"act.q: float8_e4m3fn {[*lead, k]}, got {act.q.dtype} {tuple(act.q.shape)}",
    )
    n_groups = triton.cdiv(k, group)
    require(
        act.scale.dtype == torch.float32 and tuple(act.scale.shape) == (*lead, n_groups),
        f"act.scale: fp32 {[*lead, n_groups]} for groups of {group}, got {act.scale.dtype} "
        f"{tuple(act.scale.shape)}",
    )
    require(
        k == 0 or (act.q.stride(-1) == 1 and act.scale.stride(-1) == 1),
        "act.q and act.scale need unit stride along their last dim",
    )


def _out(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, out: torch.Tensor | None
) -> torch.Tensor:
    require(dtype in _OUT_DTYPES, f"out_dtype must be bf16/fp16/fp32, got {dtype}")
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    require(
        tuple(out.shape) == shape and out.dtype == dtype and out.device == device,
        f"out: expected {dtype} {list(shape)} on {device}, got {out.dtype} {tuple(out.shape)}",
    )
    require(out.numel() == 0 or out.stride(-1) == 1, "out needs unit stride along N")
    return out


def _chunk(group: int, weight: QuantizedWeight) -> int:
    sub = chunk_width(group, weight)
    require(
        sub >= MIN_CHUNK,
        f"W8A8 needs scale groups of >= {MIN_CHUNK} channels, got activation {group} and weight "
        f"{weight.group}",
    )
    return sub


def w8a8_linear(
    act: Fp8Activation,
    weight: QuantizedWeight,
    group: int,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w8a8_linear_ref(act, weight, group, out_dtype)` in one launch (no host sync;
    graph-safe).

    Args:
        act: `quantize_act_fp8(x, group, ...)` of x [M, K] (codes with unit stride along K, any
            row stride; scales [M, ceil(K / group)]).
        weight: FP8 `QuantizedWeight` [N, K] (E8M0 scales per block_rows x weight.group block).
        group: the activation's channels per scale; min(group, weight.group) >= 32.
        out_dtype: bf16, fp16 or fp32 (rounded to nearest even).
        out: optional [M, N] of out_dtype with unit stride along N.
    Returns:
        [M, N] (within a tolerance of the reference, module doc).
    """
    require(act.q.dim() == 2, f"act.q must be [M, K], got {tuple(act.q.shape)}")
    m, k = act.q.shape
    _check_act(act, group, (m,), k)
    _check_weight(weight, k, act.q.device)
    n = weight.shape[0]
    out = _out((m, n), out_dtype, act.q.device, out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    sub = _chunk(group, weight)
    meta = _gemm_meta(m)
    _launch(act.q, act.scale, weight, out, (m, n, k), k, 1, 1, (0, 0, 0, 0), group, sub, meta)
    return out


def w8a8_grouped_linear(
    act: Fp8Activation,
    weight: QuantizedWeight,
    group: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`w8a8_grouped_linear_ref` in one launch: G `w8a8_linear`s, each group's bits as its own
    call.

    Args:
        act: the quantised x [M, G, K] (codes [M, G, K], scales [M, G, ceil(K / group)], unit
            stride along their last dims).
        weight: FP8 [G * N, K], contiguous rows (group g's weight is rows [g * N, (g + 1) * N)).
    Returns:
        [M, G, N] contiguous.
    """
    require(
        act.q.dim() == 3
        and weight.data.dim() == 2
        and weight.shape[0] % max(act.q.shape[1], 1) == 0,
        f"act.q must be [M, G, K] and weight [G * N, K], got {tuple(act.q.shape)} and "
        f"{weight.shape}",
    )
    m, groups, k = act.q.shape
    _check_act(act, group, (m, groups), k)
    _check_weight(weight, k, act.q.device)
    n = weight.shape[0] // max(groups, 1)
    out = _out((m, groups, n), out_dtype, act.q.device, None)
    if m == 0 or n == 0 or groups == 0:
        return out
    if k == 0:
        return out.zero_()
    sub = _chunk(group, weight)
    strides = (act.q.stride(1), act.scale.stride(1), n * weight.data.stride(0), out.stride(1))
    first = weight._replace(data=weight.data[:n])
    meta = _gemm_meta(m)
    _launch(
        act.q[:, 0],
        act.scale[:, 0],
        first,
        out[:, 0],
        (m, n, k),
        k,
        1,
        groups,
        strides,
        group,
        sub,
        meta,
    )
    return out


def w8a8_split_k_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    fmt: Fp8ActFormat,
    out: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """`w8a8_split_k_linear_ref(x, weight, fmt, k_split)` in three launches (`quantize_act_fp8`
    once, the split GEMM on its codes, then the ordered reduce; no host sync).

    Args:
        x: [M, K] bf16/fp16/fp32 with unit stride along K.
        weight: FP8 `QuantizedWeight` [N, K]; 32 <= min(fmt.group, weight.group) <= 128.
        fmt: the activation quantisation (group, power-of-two scales).
        out: optional [M, N] of x's dtype with unit stride along N.
        splits: K splits (None: `split_k_splits(M, N, K)`); the launch uses
            ceil(K / k_split) of them, k_split = ceil(K steps / splits) * 128 channels.
    Returns:
        [M, N] in x's dtype.
    """
    require(x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}")
    require(x.dtype in _OUT_DTYPES, f"x: dtype must be bf16/fp16/fp32, got {x.dtype}")
    m, k = x.shape
    check_group(fmt.group)
    _check_weight(weight, k, x.device)
    require(
        split_k_supports(fmt.group, weight),
        f"split-K needs chunks of {MIN_CHUNK} to {BLOCK_K} channels (a split is a whole number "
        f"of K steps and of chunks): min(activation group {fmt.group}, weight group "
        f"{weight.group}) is not",
    )
    n = weight.shape[0]
    out = _out((m, n), x.dtype, x.device, out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    require(x.stride(1) == 1, f"x needs unit stride along K, got {x.stride()}")
    steps = triton.cdiv(k, BLOCK_K)
    splits = splits or split_k_splits(m, n, k)
    require(splits >= 1, f"splits must be >= 1, got {splits}")
    k_split = triton.cdiv(steps, min(splits, steps)) * BLOCK_K
    used = triton.cdiv(k, k_split)
    act = quantize_act_fp8(x, fmt.group, fmt.ue8m0)
    # One split writes the output; several write fp32 partials [S, M, N] for the reduce.
    dest = out if used == 1 else torch.empty(used, m, n, dtype=torch.float32, device=x.device)
    sub = chunk_width(fmt.group, weight)
    meta = _split_meta(m)
    _launch(
        act.q,
        act.scale,
        weight,
        dest,
        (m, n, k),
        k_split,
        used,
        1,
        (0, 0, 0, 0),
        fmt.group,
        sub,
        meta,
    )
    if used > 1:
        reduce_splits(dest, out)
    return out


def reduce_splits(partials: torch.Tensor, out: torch.Tensor) -> None:
    """out[m, n] = the sum over s = 0..S-1, in that order, of the fp32 split partials
    `partials` [S, M, N] (contiguous), rounded once to out's dtype (out [M, N], unit stride
    along N), in one launch of `_split_k_reduce_kernel`."""
    splits, m, n = partials.shape
    block = 1024
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials,
        out,
        m * n,
        n,
        out.stride(0),
        SPLITS=splits,
        BLOCK=block,
        OUT_KIND=DTYPE_KIND[out.dtype],
        num_warps=4,
        **programmatic_launch(_split_k_reduce_kernel, out.device),
    )


def _launch(
    a: torch.Tensor,
    sa: torch.Tensor,
    weight: QuantizedWeight,
    out: torch.Tensor,
    mnk: tuple[int, int, int],
    k_split: int,
    splits: int,
    groups: int,
    group_strides: tuple[int, int, int, int],
    a_group: int,
    sub: int,
    meta: dict[str, int],
) -> None:
    """One GEMM launch over (tiles, splits, groups) of FP8 codes `a` with scales `sa` in groups
    of `a_group` channels. `out` is the output, or with several splits the [S, M, N] fp32
    workspace."""
    m, n, k = mnk
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), splits, groups)
    partial = splits > 1
    _w8a8_gemm_kernel[grid](
        a,
        sa,
        weight.data,
        weight.scale,
        out,
        m,
        n,
        k,
        k_split,
        a.stride(0),
        sa.stride(0),
        weight.data.stride(0),
        weight.scale.stride(0),
        0 if partial else out.stride(0),
        *group_strides,
        A_GROUP=a_group,
        W_GROUP=weight.group,
        W_ROWS=weight.block_rows,
        SUB=sub,
        BLOCK_K=BLOCK_K,
        GROUP_M=8,
        PARTIAL=partial,
        OUT_KIND=DTYPE_KIND[torch.float32 if partial else out.dtype],
        # The CPU interpreter has no FP8 dot: exact fp32 products there.
        DOT_FP32=interpreted(_w8a8_gemm_kernel),
        # The chunk terms are rounded as the reference rounds them (no fused multiply-add).
        enable_fp_fusion=False,
        **meta,
        **programmatic_launch(_w8a8_gemm_kernel, a.device),
    )


__all__ = [
    "BLOCK_K",
    "chunk_width",
    "reduce_splits",
    "split_k_splits",
    "split_k_supports",
    "supports",
    "w8a8_grouped_linear",
    "w8a8_linear",
    "w8a8_split_k_linear",
]
