"""The clamped SwiGLU (`silu_mul_clamp`) vs `silu_mul_clamp_ref` (same exp2 formula).

Plain output: the kernel and the reference differ only in the backend's exp2 (numpy vs torch on
CPU, ex2.approx on GPU), so outputs are bit-equal except rare 1-ulp flips. fp8 output: scales and
e4m3 codes are compared exactly where the rounded activations agree, on every backend: the kernel
rounds E4M3 on the fp32 bits (the interpreter's own fp32->fp8 cast is wrong at ties and binade
edges, so the kernel never uses it).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from sgl_dspark.kernels.fp8.reference import quantize_act_fp8_ref
from sgl_dspark.kernels.moe.activation import silu_mul_clamp
from sgl_dspark.kernels.moe.reference import Fp8Activation, silu_mul_clamp_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts scalar loop bounds through a numpy call that numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
ON_GPU = DEVICE == "cuda"
activation_module = importlib.import_module("sgl_dspark.kernels.moe.activation")
MAX_FLIP_FRACTION = 1e-3  # exp2 lowering: ~6e-6 of bf16 outputs flip, far below this


def _gate_up(rows: int, inter: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, 2 * inter, generator=gen) * 4  # crosses limit 7 on both sides
    if rows and inter:
        x[0, 0] = float("nan")  # NaN gate propagates
        x[-1, -1] = float("inf")  # clamped to +limit
    return x.to(dtype).to(DEVICE)


def _assert_close_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16: rare flips of at most 1 ulp. fp32 keeps the exp2 differences visible: every value
    within 8 ulps (exp2 is ~1 ulp on CPU, ~2 ulps as ex2.approx on GPU; x g x u adds 2 roundings)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    both_nan = torch.isnan(got) & torch.isnan(ref)
    flips = ~((got == ref) | both_nan)
    if ref.dtype == torch.bfloat16:
        assert int(flips.sum()) <= MAX_FLIP_FRACTION * flips.numel()
        max_ulps = 1.0
    else:
        max_ulps = 8.0
    if flips.any():
        ulp = torch.finfo(ref.dtype).eps * ref[flips].float().abs()
        assert ((got[flips].float() - ref[flips].float()).abs() <= ulp * max_ulps * 1.01).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(0, 64), (1, 1), (4, 100), (24, 512), (5, 2048), (2, 3000)])
def test_plain_matches_ref(rows: int, inter: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + inter)
    gate_up = _gate_up(rows, inter, dtype, gen)
    for limit in (7.0, None):
        out = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
        got = silu_mul_clamp(gate_up, limit, out=out)
        assert got is out
        _assert_close_ulp(got, silu_mul_clamp_ref(gate_up, limit))


def test_strided_rows_and_analytic_values() -> None:
    # gate_up as a view with a row stride wider than 2I.
    base = torch.zeros(3, 10, device=DEVICE)
    gate_up = base[:, :8]
    gate_up[:, :4] = torch.tensor([0.0, 1.0, 20.0, -20.0])  # g
    gate_up[:, 4:] = torch.tensor([5.0, 2.0, 3.0, -30.0])  # u (clamped to +-10)
    got = silu_mul_clamp(gate_up, 10.0)

    # silu(0)=0; silu(1)*2 = 2/(1+e^-1); min(20,10)=10 -> silu(10)*3; silu(-20)*(-10) ~ 2e-8*10.
    def silu(v: float) -> float:
        return v / (1 + math.exp(-v))

    expected = torch.tensor(
        [0.0, 2 * silu(1.0), 3 * silu(10.0), -10 * silu(-20.0)], dtype=torch.float64
    )
    torch.testing.assert_close(got[0].cpu().double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(got[0], got[2])


def _pow2_at_or_above(value: float) -> float:
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    return value if mantissa == 0.5 else math.ldexp(1.0, exponent)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("out_format", ["fp8_row", "fp8_group"])
@pytest.mark.parametrize("rows,inter", [(0, 128), (1, 128), (3, 384), (24, 512), (2, 2048)])
def test_fp8_epilogue(rows: int, inter: int, out_format: str, ue8m0: bool) -> None:
    gen = torch.Generator().manual_seed(rows + inter + 3 * ue8m0)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    got = silu_mul_clamp(gate_up, 7.0, out_format, ue8m0)
    ref = silu_mul_clamp_ref(gate_up, 7.0, out_format, ue8m0)
    assert isinstance(got, Fp8Activation) and isinstance(ref, Fp8Activation)
    assert got.q.dtype == torch.float8_e4m3fn and got.scale.shape == ref.scale.shape
    if rows == 0:
        return
    plain = silu_mul_clamp_ref(gate_up, 7.0).float()
    y_got = silu_mul_clamp(gate_up, 7.0).float()
    width = inter if out_format == "fp8_row" else 128
    # Scales are exact wherever the kernel's rounded activations equal the reference's.
    same_group = (y_got == plain).reshape(rows, -1, width).all(dim=-1)
    assert same_group.float().mean() > 0.9
    # The reference's scale is the correctly rounded amax / 448 on every device. Expected value
    # on the CPU (CUDA torch divides by a scalar through its reciprocal): the fp64 quotient
    # rounded once to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits).
    amax = plain.reshape(rows, -1, width).abs().amax(dim=-1).clamp(min=1e-10).cpu()
    exact_scale = (amax.double() / 448).float()
    if ue8m0:
        exact_scale = torch.tensor([list(map(_pow2_at_or_above, r)) for r in exact_scale.tolist()])
    assert torch.equal(ref.scale.cpu(), exact_scale)
    assert torch.equal(got.scale[same_group], ref.scale[same_group])
    if ue8m0:  # powers of two
        assert torch.equal(got.scale, torch.exp2(torch.round(torch.log2(got.scale))))
    in_same = same_group[..., None].expand(-1, -1, width).reshape(rows, inter)
    same_code = got.q.view(torch.uint8) == ref.q.view(torch.uint8)
    assert same_code[in_same].all()


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(
    "rows,inter,group", [(3, 100, 128), (2, 200, 32), (4, 384, 256), (1, 2048, 128)]
)
def test_fp8_group_is_the_gemm_quantiser_of_the_plain_output(
    rows: int, inter: int, group: int, ue8m0: bool
) -> None:
    """The "fp8_group" epilogue equals `quantize_act_fp8_ref` of the kernel's own plain output,
    bit for bit on every backend (E4M3 rounded on the bits), for any group size, partial last
    groups included (I not a multiple of the group)."""
    gen = torch.Generator().manual_seed(rows * 31 + inter + group)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    got = silu_mul_clamp(gate_up, 7.0, "fp8_group", ue8m0, group=group)
    assert isinstance(got, Fp8Activation)
    want = quantize_act_fp8_ref(silu_mul_clamp(gate_up, 7.0), group, ue8m0)
    assert got.scale.shape == (rows, -(-inter // group))
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


def test_bad_inputs_raise() -> None:
    x = torch.zeros(2, 200, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="group must be a power of two"):
        silu_mul_clamp(x, 7.0, "fp8_group", group=48)
    with pytest.raises(ValueError, match="out_format"):
        silu_mul_clamp(x, 7.0, "mxfp8")
    with pytest.raises(ValueError, match="limit"):
        silu_mul_clamp(x, -1.0)
    with pytest.raises(ValueError, match=r"\[R, 2I\]"):
        silu_mul_clamp(x[:, :199])
    with pytest.raises(ValueError, match="dtype"):
        silu_mul_clamp(x.half())


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager() -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = _gate_up(32, 2048, torch.bfloat16, gen)
    eager = silu_mul_clamp(gate_up, 7.0, "fp8_group")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = silu_mul_clamp(gate_up, 7.0, "fp8_group")
    graph.replay()
    torch.cuda.synchronize()
    assert isinstance(eager, Fp8Activation) and isinstance(captured, Fp8Activation)
    assert torch.equal(captured.q.view(torch.uint8), eager.q.view(torch.uint8))
    assert torch.equal(captured.scale, eager.scale)


@pytest.mark.parametrize("block,num_warps", [(128, 1), (256, 2), (2048, 8)])
def test_launch_meta_never_changes_results(block: int, num_warps: int, monkeypatch) -> None:
    """Columns per program and warps are free (`_act_meta`): every element, group amax and row
    amax is computed the same way, so each variant gives the default's bits (and the
    reference's, within the exp2 allowance), also when BLOCK is wider than the row."""
    gen = torch.Generator().manual_seed(block + num_warps)
    gate_up = _gate_up(3, 384, torch.bfloat16, gen)
    plain = silu_mul_clamp(gate_up, 7.0)
    fp8 = {f: silu_mul_clamp(gate_up, 7.0, f, True) for f in ("fp8_row", "fp8_group")}
    monkeypatch.setattr(
        activation_module,
        "_act_meta",
        lambda rows, inter, mode: {"BLOCK": block, "num_warps": num_warps},
    )
    got = silu_mul_clamp(gate_up, 7.0, out=torch.full_like(plain, float("nan")))
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))
    _assert_close_ulp(got, silu_mul_clamp_ref(gate_up, 7.0))
    for out_format, want in fp8.items():
        variant = silu_mul_clamp(gate_up, 7.0, out_format, True)
        assert torch.equal(variant.q.view(torch.uint8), want.q.view(torch.uint8))
        assert torch.equal(variant.scale, want.scale)
