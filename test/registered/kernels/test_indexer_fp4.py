"""Index-key FP4 quantisation (`fp4_index_k_quant`) and the index-query chain (`index_q_rope_fp4`:
RoPE + fake-quant + pack + head weights).

Both kernels are elementwise with defined rounding, so every output is compared bit for bit with
the reference (floats through an integer view, so -0.0 vs +0.0 counts). The references themselves
are checked against hand-derived values (E2M1 ties, scale edges), HF's RoPE and analytic bounds.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from sgl_dspark.kernels.indexer.fp4_k_quant import fp4_index_k_quant
from sgl_dspark.kernels.indexer.fp4_q_rope import index_q_rope_fp4
from sgl_dspark.kernels.indexer.reference import (
    IndexQFp4Output,
    e2m1_decode_ref,
    e2m1_encode_ref,
    fp4_dequant_ref,
    fp4_fake_quant_ref,
    fp4_index_k_quant_ref,
    index_q_rope_fp4_ref,
    index_q_rope_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
k_quant_module = importlib.import_module("sgl_dspark.kernels.indexer.fp4_k_quant")
POISON = 0xAB

# (value, expected code) derived by hand from the grid {0, .5, 1, 1.5, 2, 3, 4, 6} (codes 0..7):
# ties go to the even code, the sign bit is bit 3.
HAND_CODES = [
    (0.0, 0),
    (0.5, 1),
    (1.0, 2),
    (1.5, 3),
    (2.0, 4),
    (3.0, 5),
    (4.0, 6),
    (6.0, 7),
    (0.25, 0),
    (0.75, 2),
    (1.25, 2),
    (1.75, 4),
    (2.5, 4),
    (3.5, 6),
    (5.0, 6),  # ties
    (0.2, 0),
    (0.3, 1),
    (1.1, 2),
    (2.6, 5),
    (4.9, 6),
    (5.1, 7),
    (5.9, 7),
    (-0.0, 8),
    (-0.1, 8),
    (-0.75, 10),
    (-2.5, 12),
    (-5.0, 14),
    (-6.0, 15),
    (0.1, 0),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _midpoint_neighbours() -> list[tuple[float, int]]:
    """Values one fp32 ulp either side of each midpoint round away from the tie."""
    cases = []
    for mid, lower, upper in [
        (0.25, 0, 1),
        (0.75, 1, 2),
        (1.25, 2, 3),
        (1.75, 3, 4),
        (2.5, 4, 5),
        (3.5, 5, 6),
        (5.0, 6, 7),
    ]:
        m = torch.tensor(mid)
        cases.append((torch.nextafter(m, torch.tensor(0.0)).item(), lower))
        cases.append((torch.nextafter(m, torch.tensor(9.0)).item(), upper))
    return cases


def test_e2m1_encode_ref_hand_values() -> None:
    values, codes = zip(*(HAND_CODES + _midpoint_neighbours() + [(7.0, 7), (1e9, 7), (-1e9, 15)]))
    got = e2m1_encode_ref(torch.tensor(values, dtype=torch.float32))
    assert got.tolist() == list(codes)
    decoded = e2m1_decode_ref(torch.tensor([8, 0, 15, 3], dtype=torch.uint8))
    assert decoded.tolist() == [0.0, 0.0, -6.0, 1.5]
    assert torch.signbit(decoded).tolist() == [True, False, True, False]


def test_k_quant_kernel_rounds_like_hand_table() -> None:
    """Every group holds 6.0, so its scale is exactly 1 (byte 127) and codes are the raw E2M1."""
    cases = HAND_CODES + _midpoint_neighbours()
    per_row = 31
    rows = math.ceil(len(cases) / per_row)
    x = torch.full((rows, 32), 0.0)
    expected = torch.zeros(rows, 32, dtype=torch.uint8)
    for i, (v, c) in enumerate(cases):
        x[i // per_row, i % per_row], expected[i // per_row, i % per_row] = v, c
    x[:, 31], expected[:, 31] = 6.0, 7
    expected[len(cases) // per_row, len(cases) % per_row : 31] = 0  # padding zeros
    codes, scales = fp4_index_k_quant(x.to(DEVICE))
    assert torch.equal(_nibbles(codes.cpu()), expected)
    assert scales.cpu().flatten().tolist() == [127] * rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_k_quant_scale_edges(dtype: torch.dtype) -> None:
    """Hand-derived UE8M0 bytes: e = 127 + ceil(log2(max(amax/6, 1e-4)))."""
    rows, expected_scale, expected_code0 = [], [], []

    def add(row: torch.Tensor, scale: int, code0: int) -> None:
        rows.append(row)
        expected_scale.append(scale)
        expected_code0.append(code0)

    add(torch.zeros(32), 114, 0)  # all zero: 1e-4 -> 2^-13
    add(torch.full((32,), -0.0), 114, 8)  # negative zero keeps its sign bit
    add(torch.full((32,), 1e-5), 114, 0)  # below the floor: 1e-5 / 2^-13 = 0.08 -> 0
    for k in (-3, 0, 5, 100):
        add(torch.full((32,), 6.0 * 2.0**k), 127 + k, 7)  # amax/6 a power of two: no round-up
        # One bf16 ulp above: the next power of two, and 6.03125/2 = 3.016 rounds to 3 (code 5).
        add(torch.full((32,), (6.0 + 2.0**-5) * 2.0**k), 128 + k, 5)
    x = torch.stack(rows).to(dtype)
    for codes, scales in (fp4_index_k_quant_ref(x), fp4_index_k_quant(x.to(DEVICE))):
        assert scales.cpu().flatten().tolist() == expected_scale
        assert _nibbles(codes.cpu())[:, 0].tolist() == expected_code0


def _random_rows(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (fp16: kept finite, down into its subnormals)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-6.0, 3.0) if dtype == torch.float16 else (-6.0, 6.0)
    x = torch.randn(t, k, generator=g) * 10.0 ** (torch.rand(t, 1, generator=g) * (hi - lo) + lo)
    if t > 2:
        x[1] = 0.0
        x[2, : k // 2] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("t", [0, 1, 7, 8, 9, 37])
@pytest.mark.parametrize(
    "k,dtype", [(128, torch.bfloat16), (96, torch.float32), (32, torch.float16)]
)
def test_k_quant_matches_ref(t: int, k: int, dtype: torch.dtype) -> None:
    x = _random_rows(t, k, dtype, seed=t * 1000 + k).to(DEVICE)
    codes = torch.full((t, k // 2), POISON, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((t, k // 32), POISON, dtype=torch.uint8, device=DEVICE)
    fp4_index_k_quant(x, out_codes=codes, out_scales=scales)
    ref_codes, ref_scales = fp4_index_k_quant_ref(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)


def test_dequant_error_bound_and_exact_grid_roundtrip() -> None:
    x = _random_rows(64, 128, torch.float32, seed=3)
    codes, scales = fp4_index_k_quant_ref(x)
    deq = fp4_dequant_ref(codes, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    # Half the widest grid step (2, in [4, 6]) times the scale bounds the error.
    assert ((deq - x).abs() <= step).all()
    # Values already on the grid (with an exact power-of-two scale) round-trip exactly.
    assert torch.equal(fp4_dequant_ref(*fp4_index_k_quant_ref(deq)), deq)


def test_k_quant_scatter_to_cache_slots() -> None:
    t, k, slots = 9, 128, 20
    x = _random_rows(t, k, torch.bfloat16, seed=4).to(DEVICE)
    # Scatter into a 68-byte-per-slot cache through strided views; slot 0 is the dummy.
    cache = torch.full((slots, k // 2 + k // 32), POISON, dtype=torch.uint8, device=DEVICE)
    loc = torch.tensor([5, 0, 17, 3, 0, 11, 1, 19, 8], dtype=torch.int64, device=DEVICE)
    fp4_index_k_quant(x, loc=loc, out_codes=cache[:, : k // 2], out_scales=cache[:, k // 2 :])
    ref_codes, ref_scales = fp4_index_k_quant_ref(x)
    expected = torch.full_like(cache, POISON)
    written = loc != 0
    expected[loc[written]] = torch.cat([ref_codes, ref_scales], dim=1)[written]
    assert torch.equal(cache, expected)
    # An int8 cache and an x that is a strided column slice of a wider tensor.
    wide = torch.cat([torch.ones(t, 16, dtype=x.dtype, device=DEVICE), x], dim=1)
    cache8 = torch.zeros(slots, k // 2 + k // 32, dtype=torch.int8, device=DEVICE)
    fp4_index_k_quant(
        wide[:, 16:],
        loc=loc.to(torch.int32),
        out_codes=cache8[:, : k // 2],
        out_scales=cache8[:, k // 2 :],
    )
    assert torch.equal(cache8.view(torch.uint8)[loc[written]], expected[loc[written]])


# ------------------------------------------------------------------------------------------------
# The index-query chain
# ------------------------------------------------------------------------------------------------


def _q_inputs(
    t: int,
    heads: int,
    head_dim: int,
    rope_dim: int,
    dtype: torch.dtype,
    seed: int,
    num_partials: int | None,
    max_pos: int = 40,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, head_dim, generator=g) * 3
    if heads > 2:
        q[:, 1] *= 1e-6  # tiny head: the two quant stages floor their amax differently
        q[:, 2] = 0.0
    angles = torch.rand(max_pos, rope_dim // 2, generator=g) * 6.3
    cos_sin = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    if t >= 3:
        positions[:3] = torch.tensor([-1, max_pos, max_pos + 7])  # outside the table -> entry 0
    partials = None
    if num_partials is not None:
        partials = torch.randn(num_partials, t, heads, generator=g).to(DEVICE)
    return dict(
        q=q.reshape(t, heads * head_dim).to(dtype).to(DEVICE),
        cos_sin=cos_sin.to(DEVICE),
        positions=positions.to(DEVICE),
        n_heads=heads,
        rope_dim=rope_dim,
        weight_partials=partials,
        head_weight_scale=128**-0.5 * 64**-0.5,
    )


def _poisoned_q_out(t: int, heads: int, head_dim: int, dtype: torch.dtype) -> IndexQFp4Output:
    return IndexQFp4Output(
        torch.full((t, heads, head_dim // 2), POISON, dtype=torch.uint8, device=DEVICE),
        torch.full((t, 1, head_dim // 32, 16, 4), POISON, dtype=torch.uint8, device=DEVICE),
        torch.full((t, heads), float("nan"), dtype=dtype, device=DEVICE),
        torch.full((t, heads * head_dim), float("nan"), dtype=dtype, device=DEVICE),
    )


@pytest.mark.parametrize(
    "t,heads,head_dim,rope_dim,dtype,num_partials",
    [
        (1, 16, 128, 64, torch.bfloat16, 1),
        (5, 32, 128, 64, torch.bfloat16, 3),
        (3, 64, 128, 64, torch.float32, 2),
        (4, 48, 96, 32, torch.bfloat16, 8),
        (2, 16, 64, 64, torch.bfloat16, None),
    ],
)
def test_index_q_matches_ref(
    t: int, heads: int, head_dim: int, rope_dim: int, dtype: torch.dtype, num_partials: int | None
) -> None:
    inp = _q_inputs(t, heads, head_dim, rope_dim, dtype, seed=t + heads, num_partials=num_partials)
    ref = index_q_rope_fp4_ref(**inp)
    out = _poisoned_q_out(t, heads, head_dim, dtype)
    if num_partials is None:
        out = out._replace(head_weights=None)
    got = index_q_rope_fp4(**inp, return_fake_quant=True, out=out)
    assert torch.equal(got.codes, ref.codes)
    assert torch.equal(got.scales, ref.scales)
    assert torch.equal(_bits(got.fake_quant), _bits(ref.fake_quant))
    if num_partials is None:
        assert got.head_weights is None and ref.head_weights is None
    else:
        assert torch.equal(_bits(got.head_weights), _bits(ref.head_weights))
    # Scale slots of head blocks that do not exist are zero; the rest are real exponents.
    assert (got.scales[..., heads // 16 :] == 0).all()
    assert (got.scales[..., : heads // 16] >= 100).all()


def test_index_q_out_of_table_positions_use_entry_zero() -> None:
    inp = _q_inputs(3, 16, 128, 64, torch.bfloat16, seed=1, num_partials=None)
    got = index_q_rope_fp4(**inp)
    inp["positions"] = torch.zeros_like(inp["positions"])
    at_zero = index_q_rope_fp4(**inp)
    assert torch.equal(got.codes, at_zero.codes) and torch.equal(got.scales, at_zero.scales)


def test_index_q_default_outputs_and_empty() -> None:
    inp = _q_inputs(2, 16, 128, 64, torch.bfloat16, seed=2, num_partials=None)
    got = index_q_rope_fp4(**inp)
    assert got.head_weights is None and got.fake_quant is None
    assert torch.equal(got.codes, index_q_rope_fp4_ref(**inp).codes)
    # q as a column slice of a wider projection output (row stride > width).
    wide = torch.cat([inp["q"], torch.ones_like(inp["q"][:, :64])], dim=1)
    sliced = index_q_rope_fp4(**{**inp, "q": wide[:, : inp["q"].shape[1]]})
    assert torch.equal(sliced.codes, got.codes) and torch.equal(sliced.scales, got.scales)
    empty = index_q_rope_fp4(**_q_inputs(0, 32, 128, 64, torch.bfloat16, seed=0, num_partials=2))
    assert empty.codes.shape == (0, 32, 64) and empty.scales.shape == (0, 1, 4, 16, 4)
    assert empty.head_weights.shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_tail_ref_matches_hf(dtype: torch.dtype) -> None:
    hf_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    inp = _q_inputs(6, 16, 128, 64, dtype, seed=6, num_partials=None, max_pos=64)
    t = 6
    x = inp["q"].cpu().view(t, 16, 128)
    pos = inp["positions"].cpu()
    pos = torch.where((pos >= 0) & (pos < 64), pos, 0)
    cos, sin = inp["cos_sin"].cpu()[pos].unbind(-1)
    hf = hf_mod.apply_rotary_pos_emb(x.transpose(0, 1).unsqueeze(0), cos[None], sin[None])
    ours = index_q_rope_ref(x, inp["cos_sin"].cpu(), inp["positions"].cpu(), 64)
    assert torch.equal(_bits(ours), _bits(hf[0].transpose(0, 1).contiguous()))


def test_fake_quant_ref_properties() -> None:
    x = _random_rows(16, 128, torch.bfloat16, seed=8).view(16, 4, 32)
    fq = fp4_fake_quant_ref(x)
    assert torch.equal(_bits(fp4_fake_quant_ref(fq)), _bits(fq))  # idempotent
    # Each group is (E2M1 grid value) × s, s the smallest power of two >= max(amax, 6·2^-126)/6.
    amax = x.float().abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    s = torch.exp2(torch.ceil(torch.log2(amax.double() / 6))).float()
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    ratio = (fq.float() / s).abs()
    assert torch.isin(ratio, grid).all()
    assert ((fq.float() - x.float()).abs() <= s).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(n_heads=8), "n_heads"),
        (dict(rope_dim=63), "rope_dim"),
        (dict(rope_dim=256), "rope_dim"),
    ],
)
def test_index_q_bad_arguments_raise(change: dict, match: str) -> None:
    inp = _q_inputs(2, 16, 128, 64, torch.bfloat16, seed=0, num_partials=None)
    inp.update(change)
    with pytest.raises(ValueError, match=match):
        index_q_rope_fp4(**inp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_k_quant_infinite_group_uses_the_top_scale(dtype: torch.dtype) -> None:
    """amax = inf is the only way to the largest scale byte, 254 (2^127), whose reciprocal is
    the subnormal 2^-127: finite values are still divided exactly (3e38 / 2^127 = 1.76 -> 2.0,
    code 4; 1.0 / 2^127 -> +0, code 0; -1.0 -> -0, code 8); inf saturates to 6 (code 7)."""
    x = torch.randn(3, 64)
    x[0, :4] = torch.tensor([float("inf"), 3e38, 1.0, -1.0])
    x[2, 40:44] = torch.tensor([-float("inf"), -3e38, 0.0, -0.0])
    x = x.to(dtype)
    codes, scales = fp4_index_k_quant(x.to(DEVICE))
    ref_codes, ref_scales = fp4_index_k_quant_ref(x)
    assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales)
    assert scales[0, 0].item() == 254 and scales[2, 1].item() == 254
    assert _nibbles(codes.cpu())[0, :4].tolist() == [7, 4, 0, 8]
    assert _nibbles(codes.cpu())[2, 40:44].tolist() == [15, 12, 0, 8]


@pytest.mark.parametrize("block_rows,num_warps", [(1, 1), (2, 2), (16, 4), (32, 8)])
def test_k_quant_launch_meta_never_changes_results(
    block_rows: int, num_warps: int, monkeypatch
) -> None:
    """Rows per program and warps are free: every row is quantised on its own (partial row
    blocks at T = 1, 5, 37 included)."""
    monkeypatch.setattr(
        k_quant_module,
        "_k_quant_meta",
        lambda t, k: {"BLOCK_ROWS": block_rows, "num_warps": num_warps},
    )
    for t in (1, 5, 37):
        x = _random_rows(t, 128, torch.bfloat16, seed=t + block_rows).to(DEVICE)
        codes = torch.full((t, 64), POISON, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((t, 4), POISON, dtype=torch.uint8, device=DEVICE)
        fp4_index_k_quant(x, out_codes=codes, out_scales=scales)
        ref_codes, ref_scales = fp4_index_k_quant_ref(x)
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
