"""Grouped expert GEMMs over `moe_sort`'s blocks vs `moe_grouped_gemm_ref` / `fused_moe_ref`.

Tolerances (only the fp32 summation order differs from torch's matmul):
  * fp32: IEEE fp32 dot products on every backend (tf32 off on GPU; the interpreter's fp32 tl.dot is
    a numpy fp32 matmul), so results agree to a few fp32 ulps of the row's magnitude: 1e-5.
  * bf16, one GEMM: the products are exact and both sides round an fp32 sum once to bf16, so they
    differ by at most one bf16 ulp (rtol 2^-7) where the sums straddle a rounding boundary.
  * bf16, the whole chain: one-ulp flips of stage 1 and the activation (exp2 lowering) feed
    stage 2, so a few bf16 ulps of |y| ~ 1: rtol = atol = 2^-6.
Rows the kernel must not write are poisoned with NaN and must still be NaN afterwards.

The activation fused into a GEMM must equal the unfused chain (GEMM -> `silu_mul_clamp` -> GEMM) BIT
FOR BIT on the GPU: `fused_moe` replaces that chain, and graph / speculative-decoding tests compare
tokens. The fusion runs `silu_mul_clamp`'s fp32 ops in its order and rounds to bf16 the way its
plain output does (compiled: `silu_mul_clamp` by its store's native nearest-even cast, the fusion by
the same cast; interpreted: all on the bits, since the interpreter's cast truncates), with the same
exp2 function.
  * Epilogue (`out_swiglu`, stage 1; what `fused_moe` uses): a tile pairs BLOCK_N / 2 gate with
    BLOCK_N / 2 up weight rows, so a gate or up column sits at another position of the tile than
    in the unfused stage 1. A compiled dot's sum for an output does not depend on its position;
    the interpreter's dot is numpy's fp32 matmul (OpenBLAS), whose sums do (permuting B's
    columns changes about a third of the fp32 results in the last bit). So the bits are asserted
    exactly on CUDA only, within CHAIN_TOL on CPU; on every backend the epilogue must equal,
    bit for bit, the unfused chain run on a weight whose rows are laid out as the epilogue's
    tiles (same positions), which pins its rounding and activation arithmetic on CPU too.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.moe.activation import silu_mul_clamp
from sgl_dspark.kernels.moe.grouped_gemm import fused_moe, moe_grouped_gemm
from sgl_dspark.kernels.moe.reference import (
    MoeSortOutput,
    fused_moe_ref,
    moe_grouped_gemm_ref,
    moe_sort_ref,
)
from sgl_dspark.kernels.moe.sort import moe_sort, prepare_moe_sort

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter converts scalar loop bounds through a numpy call that numpy 1.25+ deprecates.
# The activation of a very negative gate overflows exp2 to inf (sigmoid 0, as meant); numpy
# reports it.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
GEMM_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}
CHAIN_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=2**-6),
}


def _mask(kind: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "all_local":
        mask = torch.ones(num_experts, dtype=torch.int32)
    elif kind == "none_local":
        mask = torch.zeros(num_experts, dtype=torch.int32)
    elif kind == "ep_slice":  # rank 1 of 2
        mask = torch.zeros(num_experts, dtype=torch.int32)
        mask[num_experts // 2 :] = 1
    else:
        mask = (torch.rand(num_experts, generator=gen) < 0.5).to(torch.int32)
        mask[0] = 1
    return mask.to(DEVICE)


def _routes(
    num_tokens: int, topk: int, num_experts: int, routing: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    if routing == "hot":  # two experts take everything: several full blocks, idle experts
        ids = torch.randint(0, 2, (num_tokens, topk), generator=gen)
    elif routing == "one":  # every slot on expert 1: M * topk routes, full blocks if 32 | M*topk
        ids = torch.ones(num_tokens, topk, dtype=torch.int64)
    elif routing == "fills":  # out-of-range ids (-1 / E) are dropped by `moe_sort`
        ids = torch.randint(-1, num_experts + 1, (num_tokens, topk), generator=gen)
    else:
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]
    weights = torch.rand(num_tokens, topk, generator=gen)
    return ids.to(torch.int32).to(DEVICE), weights.to(DEVICE)


def _local_pairs(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bool [M, topk]: the routes `moe_sort` keeps, derived from ids and mask only."""
    num_experts = mask.numel()
    known = (ids >= 0) & (ids < num_experts)
    return known & (mask.long()[ids.long().clamp(0, num_experts - 1)] == 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so NaN poison compares equal to itself and -0 differs from +0)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _assert_same_bits(got: torch.Tensor, old: torch.Tensor, exact: bool, tol: dict) -> None:
    """The same NaN entries (the activation of NaN poison need not keep its bits), and elsewhere the same
    bits (exact) or values within `tol`."""
    nan = torch.isnan(got)
    assert torch.equal(nan, torch.isnan(old)), "the fused kernel wrote other entries"
    if exact:
        assert torch.equal(_bits(got[~nan]), _bits(old[~nan])), "fused bits differ from the chain"
    else:
        torch.testing.assert_close(got[~nan], old[~nan], **tol)


def _three_launches(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    sort: MoeSortOutput,
    topk: int,
    limit: float | None,
) -> torch.Tensor:
    """The composition `fused_moe` replaces: stage 1 -> `silu_mul_clamp` -> stage 2."""
    routes = (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, topk)
    rows = x.shape[0] * topk
    gate_up = torch.full((rows, gate_up_proj.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE)
    moe_grouped_gemm(x, gate_up_proj, *routes, out=gate_up)  # remote routes' rows stay NaN
    h = silu_mul_clamp(gate_up, limit)
    assert isinstance(h, torch.Tensor)
    out = torch.full((rows, down_proj.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE)
    return moe_grouped_gemm(h, down_proj, *routes, a_per_pair=True, out=out)


def _randn(
    shape: tuple[int, ...], scale: float, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("a_per_pair", [False, True])
@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,n_cols,k_dim,mask_kind,routing",
    [
        (0, 2, 8, 64, 32, "all_local", "topk"),
        (1, 2, 8, 64, 32, "all_local", "topk"),
        (1, 1, 4, 16, 16, "none_local", "topk"),
        (7, 3, 8, 96, 48, "random", "fills"),
        (16, 2, 8, 40, 64, "all_local", "hot"),  # expert 0/1: counts 32-ish, blocks fill up
        (33, 2, 6, 72, 80, "ep_slice", "hot"),  # hot experts remote: most routes dropped
        (48, 2, 4, 64, 64, "all_local", "one"),  # 96 routes: three full blocks, no sentinel
        (13, 4, 16, 128, 130, "random", "topk"),
    ],
)
def test_grouped_gemm_matches_ref(
    num_tokens: int,
    topk: int,
    num_experts: int,
    n_cols: int,
    k_dim: int,
    mask_kind: str,
    routing: str,
    a_per_pair: bool,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 31 + n_cols + k_dim + int(a_per_pair))
    mask = _mask(mask_kind, num_experts, gen)
    ids, weights = _routes(num_tokens, topk, num_experts, routing, gen)
    sort = moe_sort_ref(ids, weights, mask, hidden_size=0)
    num_local = max(int(mask.sum()), 1)  # one expert even when none is local: the kernel launches
    a = _randn((num_tokens * topk if a_per_pair else num_tokens, k_dim), 1.0, dtype, gen)
    weight = _randn((num_local, n_cols, k_dim), k_dim**-0.5, dtype, gen)
    args = (a, weight, sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, topk, a_per_pair)
    poison = torch.full((num_tokens * topk, n_cols), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_grouped_gemm(*args, out=poison.clone())
    want = moe_grouped_gemm_ref(*args, out=poison.clone())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for tile_major in (True, False):  # the program order moves no bit (auto picks one)
        forced = moe_grouped_gemm(*args, out=poison.clone(), tile_major=tile_major)
        assert torch.equal(forced.view(bits), got.view(bits)), f"tile_major={tile_major}"
    written = ~torch.isnan(got).all(dim=1)
    assert torch.equal(written, _local_pairs(ids, mask).reshape(-1)), "wrong rows written"
    assert torch.isnan(got[~written]).all(), "a skipped row was partly written"
    torch.testing.assert_close(got[written], want[written], **GEMM_TOL[dtype])
    if num_tokens:
        assert written.any() or mask_kind == "none_local" or routing in ("hot", "one")


def test_grouped_gemm_hand_derived() -> None:
    # Experts 0 and 2 local (local ids 0, 1); token 0 -> experts (2, 1), token 1 -> (0, 2).
    mask = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[2, 1], [0, 2]], dtype=torch.int32, device=DEVICE)
    sort = moe_sort(ids, torch.ones(2, 2, device=DEVICE), prepare_moe_sort(mask), 0)
    x = torch.tensor([[1.0] * 16, [2.0] * 8 + [-1.0] * 8], device=DEVICE)
    weight = torch.zeros(2, 16, 16, device=DEVICE)
    weight[0, 0, :] = 1.0  # local 0 (expert 0), column 0: row sum
    weight[1, 3, :2] = torch.tensor([3.0, -0.5], device=DEVICE)  # local 1 (expert 2), column 3
    out = torch.full((4, 16), float("nan"), device=DEVICE)
    moe_grouped_gemm(x, weight, sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, 2, out=out)
    want = torch.full((4, 16), float("nan"))
    want[0] = 0.0
    want[0, 3] = 1.0 * 3.0 - 1.0 * 0.5  # pair (token 0, slot 0) = expert 2
    want[2] = 0.0
    want[2, 0] = 8 * 2.0 - 8 * 1.0  # pair (token 1, slot 0) = expert 0
    want[3] = 0.0
    want[3, 3] = 2.0 * 3.0 - 2.0 * 0.5  # pair (token 1, slot 1) = expert 2
    assert torch.equal(out.cpu().nan_to_num(123.0), want.nan_to_num(123.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,hidden,inter,mask_kind,routing,limit",
    [
        (0, 2, 8, 64, 32, "all_local", "topk", 2.0),
        (1, 2, 8, 64, 32, "all_local", "topk", 2.0),
        (5, 2, 8, 48, 40, "random", "fills", None),
        (17, 3, 8, 64, 32, "all_local", "hot", 1.5),
        (9, 2, 6, 32, 48, "none_local", "topk", 2.0),
        (11, 2, 6, 64, 16, "ep_slice", "topk", 3.0),
        (3, 6, 8, 160, 64, "random", "topk", 1.0),  # D = 160: two K steps of stage 1
    ],
)
def test_fused_moe_matches_ref(
    num_tokens: int,
    topk: int,
    num_experts: int,
    hidden: int,
    inter: int,
    mask_kind: str,
    routing: str,
    limit: float | None,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + hidden + inter)
    mask = _mask(mask_kind, num_experts, gen)
    ids, weights = _routes(num_tokens, topk, num_experts, routing, gen)
    num_local = max(int(mask.sum()), 1)
    x = _randn((num_tokens, hidden), 1.0, dtype, gen)
    gate_up = _randn((num_local, 2 * inter, hidden), 3 * hidden**-0.5, dtype, gen)  # hits limit
    down = _randn((num_local, hidden, inter), inter**-0.5, dtype, gen)
    sort = moe_sort(ids, weights, prepare_moe_sort(mask), 0)
    out = torch.full((num_tokens, topk, hidden), float("nan"), dtype=dtype, device=DEVICE)
    got = fused_moe(x, gate_up, down, sort, topk, limit, out=out)
    assert got is out
    want = fused_moe_ref(x, gate_up, down, ids, mask, limit)
    local = _local_pairs(ids, mask)
    assert torch.isnan(got[~local]).all(), "a remote route was written"
    assert not torch.isnan(got[local]).any()
    torch.testing.assert_close(got[local], want[local], **CHAIN_TOL[dtype])
    old = _three_launches(x, gate_up, down, sort, topk, limit).view(got.shape)
    _assert_same_bits(got, old, DEVICE == "cuda", CHAIN_TOL[dtype])  # see the module docstring


def test_fused_moe_allocates_output_and_m0() -> None:
    gen = torch.Generator().manual_seed(5)
    mask = torch.ones(4, dtype=torch.int32, device=DEVICE)
    x = _randn((3, 32), 1.0, torch.float32, gen)
    gate_up = _randn((4, 32, 32), 0.2, torch.float32, gen)
    down = _randn((4, 32, 16), 0.2, torch.float32, gen)
    ids, weights = _routes(3, 2, 4, "topk", gen)
    got = fused_moe(x, gate_up, down, moe_sort(ids, weights, prepare_moe_sort(mask), 0), 2, 10.0)
    torch.testing.assert_close(
        got, fused_moe_ref(x, gate_up, down, ids, mask, 10.0), rtol=1e-5, atol=1e-5
    )
    empty = moe_sort(ids[:0], weights[:0], prepare_moe_sort(mask), 0)
    assert fused_moe(x[:0], gate_up, down, empty, 2, 10.0).shape == (0, 2, 32)


def _two_token_routes():
    """`moe_sort`'s layout for 2 tokens x top-2 on expert 0 of 4: (sort, the GEMMs' route
    arguments)."""
    mask = torch.ones(4, dtype=torch.int32, device=DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    sort = moe_sort(ids, torch.ones(2, 2, device=DEVICE), prepare_moe_sort(mask), 0)
    return sort, (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, 2)


def test_rejects_bad_layouts() -> None:
    sort, routes = _two_token_routes()
    x = torch.ones(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        moe_grouped_gemm(x, torch.ones(4, 16, 32, dtype=torch.bfloat16, device=DEVICE), *routes)
    with pytest.raises(ValueError, match="weight"):
        moe_grouped_gemm(x, torch.ones(4, 16, 31, device=DEVICE), *routes)
    with pytest.raises(ValueError, match="a_per_pair"):
        moe_grouped_gemm(x[:1], torch.ones(4, 16, 32, device=DEVICE), *routes, a_per_pair=True)
    with pytest.raises(ValueError, match="sorted_ids"):
        moe_grouped_gemm(
            x, torch.ones(4, 16, 32, device=DEVICE), sort.sorted_ids.long(), *routes[1:]
        )
    # `fused_moe` checks the whole sort up front (`fused_moe_out`, shared with `mx_fused_moe`).
    gate_up, down = torch.ones(4, 32, 32, device=DEVICE), torch.ones(4, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sorted_weights is on meta"):
        fused_moe(
            x, gate_up, down, sort._replace(sorted_weights=sort.sorted_weights.to("meta")), 2, 1.0
        )
    with pytest.raises(ValueError, match="block_size"):
        fused_moe(x, gate_up, down, sort, 2, 1.0, block_size=24)
    with pytest.raises(ValueError, match="gate_up_proj"):  # D of the weights is not x's
        fused_moe(x, torch.ones(4, 32, 16, device=DEVICE), down, sort, 2, 1.0)


def test_rejects_bad_swiglu_args() -> None:
    sort, routes = _two_token_routes()
    weight = torch.randn(4, 16, 32, device=DEVICE)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="swiglu_limit"):  # a limit without the fusion
        moe_grouped_gemm(x, weight, *routes, swiglu_limit=1.0)
    with pytest.raises(ValueError, match="out_swiglu"):  # weight [E, 2I, K] needs an even 2I
        moe_grouped_gemm(x, torch.randn(4, 15, 32, device=DEVICE), *routes, out_swiglu=True)
    with pytest.raises(ValueError, match="out must be"):  # out_swiglu's out is [M * topk, I]
        moe_grouped_gemm(x, weight, *routes, out_swiglu=True, out=torch.empty(4, 16))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="swiglu_limit"):
            moe_grouped_gemm(x, weight, *routes, out_swiglu=True, swiglu_limit=bad)
    with pytest.raises(ValueError, match="swiglu_limit"):  # fused_moe checks its limit too
        fused_moe(
            x,
            torch.randn(4, 64, 32, device=DEVICE),
            torch.randn(4, 32, 32, device=DEVICE),
            sort,
            2,
            0.0,
        )


@pytest.mark.parametrize("limit", [None, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,inter,hidden,mask_kind,routing",
    [
        (1, 1, 4, 48, 64, "all_local", "topk"),
        (1, 6, 8, 64, 32, "all_local", "topk"),
        (3, 2, 8, 48, 160, "random", "fills"),  # D = 160: two K steps, the last partial
        (8, 6, 8, 64, 64, "all_local", "topk"),
        (8, 2, 4, 24, 64, "random", "topk"),  # I = 24: the second tile's last 8 columns masked
        (33, 2, 6, 16, 48, "ep_slice", "hot"),
        (33, 6, 4, 64, 96, "all_local", "hot"),
    ],
)
def test_swiglu_epilogue_matches_composition(
    num_tokens: int,
    topk: int,
    num_experts: int,
    inter: int,
    hidden: int,
    mask_kind: str,
    routing: str,
    dtype: torch.dtype,
    limit: float | None,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 11 + topk * 3 + inter + hidden)
    mask = _mask(mask_kind, num_experts, gen)
    ids, weights = _routes(num_tokens, topk, num_experts, routing, gen)
    sort = moe_sort(ids, weights, prepare_moe_sort(mask), 0)
    num_local = max(int(mask.sum()), 1)
    x = _randn((num_tokens, hidden), 1.0, dtype, gen)
    weight = _randn((num_local, 2 * inter, hidden), 3 * hidden**-0.5, dtype, gen)  # |gate_up| ~ 3
    routes = (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, topk)
    rows = num_tokens * topk
    gate_up = moe_grouped_gemm(
        x,
        weight,
        *routes,
        out=torch.full((rows, 2 * inter), float("nan"), dtype=dtype, device=DEVICE),
    )
    old = silu_mul_clamp(gate_up, limit)  # unwritten (NaN) rows stay NaN
    assert isinstance(old, torch.Tensor)
    poison = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    got = moe_grouped_gemm(
        x, weight, *routes, out=poison.clone(), out_swiglu=True, swiglu_limit=limit
    )
    written = ~torch.isnan(got).all(dim=1)
    assert torch.equal(written, _local_pairs(ids, mask).reshape(-1)), "wrong rows written"
    assert torch.isnan(got[~written]).all(), "a skipped row was partly written"
    assert not torch.isnan(got[written]).any()
    _assert_same_bits(got, old, DEVICE == "cuda", CHAIN_TOL[dtype])  # see the module docstring
    # The chain with the epilogue's column placement: weight rows per tile of BLOCK_N (the
    # kernel's choice for N = 2I) as [HALF gate rows | HALF up rows], zero rows past I.
    half = min(32, max(16, 1 << (2 * inter - 1).bit_length())) // 2
    tiles = -(-inter // half)
    padded = torch.zeros(num_local, 2, tiles * half, hidden, dtype=dtype, device=DEVICE)
    padded[:, :, :inter] = weight.view(num_local, 2, inter, hidden)
    placed = (
        padded.view(num_local, 2, tiles, half, hidden)
        .transpose(1, 2)
        .reshape(num_local, tiles * 2 * half, hidden)
    )
    by_tile = moe_grouped_gemm(
        x,
        placed,
        *routes,
        out=torch.full((rows, tiles * 2 * half), float("nan"), dtype=dtype, device=DEVICE),
    )
    gate_up_placed = by_tile.view(rows, tiles, 2, half).transpose(1, 2).reshape(rows, 2, -1)
    same_place = silu_mul_clamp(gate_up_placed[:, :, :inter].reshape(rows, 2 * inter), limit)
    assert isinstance(same_place, torch.Tensor)
    _assert_same_bits(got, same_place, True, {})
    want = moe_grouped_gemm_ref(
        x, weight, *routes, out=poison.clone(), out_swiglu=True, swiglu_limit=limit
    )
    torch.testing.assert_close(got[written], want[written], **CHAIN_TOL[dtype])
    if limit is not None and written.any():  # both clamps acted, and the limit reached the kernel
        gate, up = gate_up[written, :inter], gate_up[written, inter:]
        assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()
        free = moe_grouped_gemm_ref(x, weight, *routes, out_swiglu=True)[written].float()
        assert (free - got[written].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,topk,num_experts,hidden,inter,mask_kind,routing",
    [
        (1, 3, 8, 64, 32, "all_local", "topk"),
        (6, 2, 8, 48, 40, "random", "fills"),
        (13, 4, 6, 96, 24, "all_local", "hot"),
    ],
)
def test_fused_moe_weight_before_down(
    num_tokens: int,
    topk: int,
    num_experts: int,
    hidden: int,
    inter: int,
    mask_kind: str,
    routing: str,
    dtype: torch.dtype,
) -> None:
    """DeepSeek-V4.1: each route's activation times its weight (the sort's sorted_weights),
    rounded as stored, before the down projection; weights spanning magnitudes and zeros."""
    gen = torch.Generator().manual_seed(num_tokens * 11 + inter)
    mask = _mask(mask_kind, num_experts, gen)
    ids, weights = _routes(num_tokens, topk, num_experts, routing, gen)
    weights = weights * torch.exp2(torch.randint(-4, 4, weights.shape, generator=gen)).to(DEVICE)
    weights[0, 0] = 0.0
    num_local = max(int(mask.sum()), 1)
    x = _randn((num_tokens, hidden), 1.0, dtype, gen)
    gate_up = _randn((num_local, 2 * inter, hidden), 3 * hidden**-0.5, dtype, gen)
    down = _randn((num_local, hidden, inter), inter**-0.5, dtype, gen)
    sort = moe_sort(ids, weights, prepare_moe_sort(mask), 0)
    out = torch.full((num_tokens, topk, hidden), float("nan"), dtype=dtype, device=DEVICE)
    got = fused_moe(x, gate_up, down, sort, topk, 2.0, out=out, weight_before_down=True)
    want = fused_moe_ref(x, gate_up, down, ids, mask, 2.0, topk_weights=weights)
    local = _local_pairs(ids, mask)
    assert torch.isnan(got[~local]).all(), "a remote route was written"
    torch.testing.assert_close(got[local], want[local], **CHAIN_TOL[dtype])
    unweighted = fused_moe_ref(x, gate_up, down, ids, mask, 2.0)
    if local[0, 0]:  # a zero weight zeroes the route
        assert not got[0, 0].any() and unweighted[0, 0].abs().max() > 0


def test_act_weights_needs_the_activation_and_sorted_shape() -> None:
    gen = torch.Generator().manual_seed(2)
    mask = torch.ones(4, dtype=torch.int32, device=DEVICE)
    ids, weights = _routes(3, 2, 4, "topk", gen)
    sort = moe_sort(ids, weights, prepare_moe_sort(mask), 0)
    x = _randn((3, 32), 1.0, torch.float32, gen)
    w = _randn((4, 32, 32), 0.2, torch.float32, gen)
    routes = (sort.sorted_ids, sort.sorted_expert_ids, sort.num_valid, 2)
    with pytest.raises(ValueError, match="act_weights needs out_swiglu"):
        moe_grouped_gemm(x, w, *routes, act_weights=sort.sorted_weights)
    with pytest.raises(ValueError, match="act_weights must be fp32"):
        moe_grouped_gemm(x, w, *routes, out_swiglu=True, act_weights=weights)
