"""FP8 activations (`kernels/fp8/`): the per-token-group quantiser, the W8A8 block-scaled GEMM,
its grouped and split-K variants, against `kernels/fp8/reference.py`.

* Quantiser: codes and scales bit-exact on every backend (E4M3 rounded on the fp32 bits), and
  every element within the stated error bound of its input.
* W8A8: against the reference with the same activation quantisation the products are exact and
  only each chunk's sum differs (the interpreter's numpy dot, or the GPU's FP8 MMA, vs the
  reference's exactly rounded sum): outputs within SUM_EPS of sum |terms| before rounding; in
  the interpreter bf16 outputs equal up to rare one-ulp flips. Against dequantise-then-bf16 (`small_m_linear_ref` on the bf16
  activation): within `w8a8_bf16_gap_bound_ref` plus the two outputs' roundings.
* Split-K: the activation quantised once by the quantiser (its codes are the GEMM's operand),
  then against its reference (the same splits), deterministic, and within fp32 rounding of the
  unsplit GEMM.

Shapes cover partial scale blocks (N and K not multiples of the block), K not a multiple of the
128-channel step, rows padded to the 64-row tile (M < 64) and past it, partial column tiles,
V4 (128 x 128) and V4.1 (32 x 32) weight blocks with activation groups of 128 and 32, and
power-of-two scales. Inputs span many binades (so E4M3 subnormals occur); outputs are poisoned.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.fp8 import w8a8
from sgl_dspark.kernels.fp8.act_quant import quantize_act_fp8, quantize_act_mxfp8
from sgl_dspark.kernels.fp8.reference import (
    Fp8ActFormat,
    Fp8Activation,
    act_quant_error_bound_ref,
    dequantize_act_fp8_ref,
    quantize_act_fp8_ref,
    quantize_act_mxfp8_ref,
    w8a8_bf16_gap_bound_ref,
    w8a8_grouped_linear_ref,
    w8a8_linear_ref,
    w8a8_split_k_linear_ref,
)
from sgl_dspark.kernels.fp8.w8a8 import (
    BLOCK_K,
    split_k_splits,
    w8a8_grouped_linear,
    w8a8_linear,
    w8a8_split_k_linear,
)
from sgl_dspark.kernels.linear.reference import QuantizedWeight, small_m_linear_ref
from sgl_dspark.srt.model_loader.quantization import (
    fp8_block_to_runtime,
    mxfp4_to_runtime,
    quantize_fp8_block,
    quantize_mxfp4,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def fp8_weight(n: int, k: int, block: int, gen: torch.Generator) -> QuantizedWeight:
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) * 0.05, (block, block))
    w = fp8_block_to_runtime(q, s, (block, block))
    return w._replace(data=w.data.to(DEVICE), scale=w.scale.to(DEVICE))


def activations(shape: tuple[int, ...], gen: torch.Generator, dtype=torch.bfloat16):
    """Random values over many binades (E4M3's subnormals occur), with an all-zero row (the
    amax floor) and a negative zero."""
    x = torch.randn(*shape, generator=gen) * torch.exp2(
        torch.randint(-10, 6, shape, generator=gen).float()
    )
    if shape[0] > 1:
        x[1] = 0.0
        x[0, ..., 0] = -0.0
    return x.to(dtype).to(DEVICE)


def _same_bits(got: Fp8Activation, want: Fp8Activation) -> None:
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == want.q.shape
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(
    "m,k,group",
    [
        (0, 128, 128),
        (1, 1, 128),
        (3, 100, 128),
        (5, 300, 128),
        (2, 4100, 128),
        (4, 96, 32),
        (3, 200, 64),
    ],
)
def test_quantizer_is_the_reference_bit_for_bit(m, k, group, ue8m0, dtype) -> None:
    gen = torch.Generator().manual_seed(m * 131 + k + group + ue8m0)
    x = activations((m, k), gen, dtype)
    got = quantize_act_fp8(x, group, ue8m0)
    want = quantize_act_fp8_ref(x, group, ue8m0)
    _same_bits(got, want)
    if ue8m0 and m:  # powers of two
        assert torch.equal(got.scale, torch.exp2(torch.round(torch.log2(got.scale))))
    # Every element within the stated bound of its input (E4M3's half step).
    err = (dequantize_act_fp8_ref(got, group) - x.float()).abs()
    assert (err <= act_quant_error_bound_ref(x, got, group)).all()


def test_quantizer_strided_rows_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(7)
    wide = activations((4, 500), gen)
    view = wide[:, 100:356]  # a column block: row stride 500
    _same_bits(quantize_act_fp8(view, 128, True), quantize_act_fp8_ref(view, 128, True))
    x3 = activations((3, 2, 160), gen)  # [M, G, K]: groups of the grouped projection
    got = quantize_act_fp8(x3, 32)
    assert got.q.shape == (3, 2, 160) and got.scale.shape == (3, 2, 5)
    _same_bits(got, quantize_act_fp8_ref(x3, 32))


def test_mxfp8_quantizer() -> None:
    gen = torch.Generator().manual_seed(11)
    x = activations((5, 224), gen)
    got, want = quantize_act_mxfp8(x), quantize_act_mxfp8_ref(x)
    assert got.exponents.dtype == torch.uint8 and got.exponents.shape == (5, 7)
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(got.exponents, want.exponents)
    with pytest.raises(ValueError, match="K % 32"):
        quantize_act_mxfp8(x[:, :100])


# How far a chunk's sum may lie from the exactly rounded one, relative to sum |terms|: the
# interpreter sums in fp32 (numpy); a GPU's FP8 MMA accumulates the products of a chunk with
# fewer than fp32's bits (about 14 on Hopper, after aligning them to the largest, so products
# binades below it lose more) before the kernel promotes the chunk. The H200 reaches 2^-11.4
# on these inputs (values over 16 binades), so the bound leaves a factor 2.6.
SUM_EPS = 2.0**-10 if torch.cuda.is_available() else 2.0**-20


def _assert_w8a8_close(got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor) -> None:
    """got vs the same-quantisation reference: chunk sums in another order (each within SUM_EPS
    of sum |terms|), then each rounded once to the output dtype. Two sums that straddle a
    rounding boundary round one unit in the last place apart however close they are, so the
    bound is the sums' gap plus one ulp of the larger output (twice the unit roundoff times
    it). In fp32 (the interpreter) bf16 outputs differ in rare last-bit flips only; the GPU's
    shorter accumulator makes them more frequent."""
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}[got.dtype]
    larger = torch.maximum(got.float().abs(), want.float().abs())
    slack = terms * SUM_EPS + 2 * unit * larger
    assert ((got.float() - want.float()).abs() <= slack).all()
    if got.dtype != torch.float32 and not torch.cuda.is_available():
        assert (got != want).float().mean() <= 0.02


def _abs_terms(act: Fp8Activation, weight: QuantizedWeight, group: int) -> torch.Tensor:
    """sum_k |x_k w_k| of the dequantised operands (the scale of the fp32 sums' error)."""
    from sgl_dspark.kernels.linear.reference import dequantize_weight_ref

    x = dequantize_act_fp8_ref(act, group).abs().double()
    w = dequantize_weight_ref(weight, torch.float32).abs().double()
    return (x @ w.t()).float()


# (M, N, K, weight block, activation group, ue8m0)
W8A8_CASES = [
    (1, 200, 300, 128, 128, False),  # one row padded to the tile; partial K and N blocks
    (70, 140, 260, 128, 128, True),  # two row tiles; K past two steps, partial
    (130, 64, 1100, 128, 128, False),  # 128-row tiles, the second partial; 9 K steps
    (33, 96, 96, 32, 32, True),  # V4.1's 32 x 32 blocks: 32-channel chunks
    (17, 40, 200, 32, 128, False),  # activation groups of 128 over 32-channel weight blocks
    (20, 72, 256, 128, 32, True),  # activation groups of 32 inside 128-channel weight blocks
]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", W8A8_CASES)
def test_w8a8_linear(case: tuple, out_dtype: torch.dtype) -> None:
    m, n, k, block, group, ue8m0 = case
    gen = torch.Generator().manual_seed(W8A8_CASES.index(case))
    w = fp8_weight(n, k, block, gen)
    x = activations((m, k), gen, out_dtype)
    act = quantize_act_fp8(x, group, ue8m0)
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    got = w8a8_linear(act, w, group, out_dtype, out=out)
    assert got is out and not torch.isnan(got).any()
    _assert_w8a8_close(got, w8a8_linear_ref(act, w, group, out_dtype), _abs_terms(act, w, group))
    # Against dequantise-then-bf16 on the unquantised activation: the stated bound.
    dense = small_m_linear_ref(x, w).float()
    gap = w8a8_bf16_gap_bound_ref(x, act, w, group)
    rounding = (dense.abs() + got.float().abs()) * (2.0**-8 if out_dtype != torch.float32 else 0)
    assert ((got.float() - dense).abs() <= gap + rounding).all()


def _fenced(t: torch.Tensor, pad: int) -> torch.Tensor:
    """t's values [R, C] in a buffer whose rows are `pad` elements apart and followed by `pad`
    more, every element outside t a NaN (0x7F in FP8 codes, 0xFF in E8M0 bytes): a read past a
    row, or past the last row, brings a NaN into the result."""
    rows, cols = t.shape
    nan = {torch.float8_e4m3fn: 0x7F, torch.uint8: 0xFF}
    if t.dtype in nan:
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        buf = torch.full((rows + 1, cols + pad), nan[t.dtype], dtype=torch.uint8, device=t.device)
        buf[:rows, :cols] = raw
        return buf[:rows, :cols].view(t.dtype)
    buf = torch.full((rows + 1, cols + pad), float("nan"), dtype=t.dtype, device=t.device)
    buf[:rows, :cols] = t
    return buf[:rows, :cols]


# (M, N, K, weight block, activation group): K below the 128-channel step (chunks past K
# exist), K past a step and partial, rows in one and in two tiles.
FENCED_CASES = [(20, 72, 64, 32, 32), (5, 40, 96, 32, 32), (70, 33, 200, 128, 128)]


@pytest.mark.parametrize("case", FENCED_CASES)
def test_w8a8_reads_nothing_past_its_operands(case: tuple) -> None:
    """The GEMM reads only its operands' elements: activation codes and scales, weight codes
    and scales fenced by NaN give the result of their contiguous copies, with no NaN."""
    m, n, k, block, group = case
    gen = torch.Generator().manual_seed(sum(case))
    w = fp8_weight(n, k, block, gen)
    act = quantize_act_fp8(activations((m, k), gen), group, True)
    want = w8a8_linear(act, w, group)
    fenced_act = Fp8Activation(_fenced(act.q, 16), _fenced(act.scale, 3))
    fenced_w = w._replace(data=_fenced(w.data, 16), scale=_fenced(w.scale, 3))
    got = w8a8_linear(fenced_act, fenced_w, group)
    assert not torch.isnan(got).any()
    assert torch.equal(got, want)


def test_w8a8_grouped_linear() -> None:
    gen = torch.Generator().manual_seed(5)
    m, groups, n, k = 19, 3, 40, 200  # partial K block, 40-row groups across 128-row blocks
    w = fp8_weight(groups * n, k, 128, gen)
    x = activations((m, groups, k), gen)
    act = quantize_act_fp8(x, 128, True)
    got = w8a8_grouped_linear(act, w, 128)
    assert got.shape == (m, groups, n) and got.is_contiguous()
    want = w8a8_grouped_linear_ref(act, w, 128, torch.bfloat16)
    for g in range(groups):  # each group's bits as its own call
        part = Fp8Activation(act.q[:, g].contiguous(), act.scale[:, g].contiguous())
        rows = w.per_row()
        rows = rows._replace(
            data=rows.data[g * n : (g + 1) * n], scale=rows.scale[g * n : (g + 1) * n]
        )
        _assert_w8a8_close(got[:, g], want[:, g], _abs_terms(part, rows, 128))
        assert torch.equal(got[:, g], w8a8_linear(part, rows, 128))


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize(
    "m,n,k,block,group", [(1, 130, 700, 128, 128), (24, 64, 1000, 32, 32), (3, 50, 384, 128, 64)]
)
def test_split_k(m, n, k, block, group, splits) -> None:
    gen = torch.Generator().manual_seed(m + n + k + splits)
    w = fp8_weight(n, k, block, gen)
    x = activations((m, k), gen)
    fmt = Fp8ActFormat(group, True)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = w8a8_split_k_linear(x, w, fmt, out=out, splits=splits)
    assert got is out and not torch.isnan(got).any()
    steps = -(-k // BLOCK_K)
    k_split = -(-steps // min(splits, steps)) * BLOCK_K
    act = quantize_act_fp8_ref(x, group, True)
    terms = _abs_terms(act, w, group)
    _assert_w8a8_close(got, w8a8_split_k_linear_ref(x, w, fmt, k_split), terms)
    # The unsplit GEMM on the quantiser's codes agrees.
    _assert_w8a8_close(got, w8a8_linear(quantize_act_fp8(x, group, True), w, group), terms * 2)
    # Deterministic for a given split count.
    assert torch.equal(w8a8_split_k_linear(x, w, fmt, splits=splits), got)


@pytest.mark.parametrize(
    "m,block,group", [(1, 128, 128), (3, 32, 32), (64, 128, 64), (130, 32, 128)]
)
def test_split_k_quantises_once_then_equals_its_reference(m, block, group, monkeypatch) -> None:
    """One quantiser launch whose codes and scales are the reference's bit for bit and are the
    split GEMM's operands; the result is the reference's at every split count (the CPU's fp32
    dot: within the chunk sums' tolerance, rare one-ulp bf16 flips)."""
    n, k = 72, 1000  # 8 K steps, the last partial; two column tiles, the second partial
    gen = torch.Generator().manual_seed(m * 7 + block + group)
    w = fp8_weight(n, k, block, gen)
    scale = torch.exp2(torch.randint(-10, 6, (m, k), generator=gen).float())
    x = (
        (torch.rand(m, k, generator=gen) + 0.25)
        * scale
        * (torch.randint(0, 2, (m, k), generator=gen) * 2 - 1)
    )
    x = x.to(torch.bfloat16).to(DEVICE)
    assert (x != 0).all()
    fmt = Fp8ActFormat(group, True)
    want_act = quantize_act_fp8_ref(x, group, True)
    terms = _abs_terms(want_act, w, group)
    quantised, operands = [], []
    real_quantize, real_launch = w8a8.quantize_act_fp8, w8a8._launch

    def quantize(*args, **kwargs):
        quantised.append(real_quantize(*args, **kwargs))
        return quantised[-1]

    def launch(a, sa, *rest):
        operands.append((a, sa))
        return real_launch(a, sa, *rest)

    monkeypatch.setattr(w8a8, "quantize_act_fp8", quantize)
    monkeypatch.setattr(w8a8, "_launch", launch)
    for splits in (1, 2, 3, 8):
        quantised.clear()
        operands.clear()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        got = w8a8_split_k_linear(x, w, fmt, out=out, splits=splits)
        assert got is out and not torch.isnan(got).any()
        assert len(quantised) == 1 and len(operands) == 1
        _same_bits(quantised[0], want_act)
        assert operands[0][0] is quantised[0].q and operands[0][1] is quantised[0].scale
        k_split = -(-8 // splits) * BLOCK_K
        _assert_w8a8_close(got, w8a8_split_k_linear_ref(x, w, fmt, k_split), terms)


def test_split_count_is_a_function_of_the_shape() -> None:
    # Decode rows of the V4-Flash main projection (3 x 4096 -> 4096): several splits; prefill
    # rows: partial traffic caps it at one.
    assert split_k_splits(1, 4096, 12288) > 1
    assert split_k_splits(32, 4096, 12288) >= split_k_splits(128, 4096, 12288)
    assert split_k_splits(4096, 4096, 12288) == 1
    assert split_k_splits(16, 4096, 100) == 1  # one K step


def test_bad_arguments_raise() -> None:
    gen = torch.Generator().manual_seed(1)
    w = fp8_weight(64, 128, 128, gen)
    x = activations((20, 128), gen)
    act = quantize_act_fp8(x, 128)
    with pytest.raises(ValueError, match="groups of >= 32"):
        w8a8_linear(quantize_act_fp8(x, 16), w, 16)
    with pytest.raises(ValueError, match="act.scale"):
        w8a8_linear(act, w, 64)
    with pytest.raises(ValueError, match="expected K=128"):
        w8a8_linear(act, fp8_weight(64, 96, 32, gen), 128)
    fp4 = mxfp4_to_runtime(*quantize_mxfp4(torch.randn(64, 128), 32), 32)
    with pytest.raises(ValueError, match="FP8 weight"):
        w8a8_linear(act, fp4._replace(data=fp4.data.to(DEVICE), scale=fp4.scale.to(DEVICE)), 128)
    with pytest.raises(ValueError, match="split-K needs chunks"):  # chunks of 256 channels
        w8a8_split_k_linear(x, fp8_weight(64, 128, 256, gen), Fp8ActFormat(256, True))
    with pytest.raises(ValueError, match="split-K needs chunks"):  # chunks of 16 channels
        w8a8_split_k_linear(x, fp8_weight(64, 128, 128, gen), Fp8ActFormat(16, True))
    with pytest.raises(ValueError, match="group must be a power of two"):
        quantize_act_fp8(x, 48)
