"""Benchmark cases for the mHC post-combine and the FP4 indexer quantisation (keys and queries).

``CASES`` is a list of dicts with keys:
    name         str
    make_inputs  (M, device) -> dict of keyword arguments, at DeepSeek-V4-Flash decode shapes
    reference    (**inputs) -> output   (the unfused torch reference)
    launcher     (**inputs) -> output   (the Triton launcher; graph-capturable)
    check        (reference_output, launcher_output) -> None, raises AssertionError on mismatch
    bytes_moved  (M) -> int, the minimal HBM traffic of the fused op (bandwidth floor)
M is the number of token rows: mHC rows, new index keys, or index queries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sgl_dspark.kernels.indexer.fp4_k_quant import fp4_index_k_quant
from sgl_dspark.kernels.indexer.fp4_q_rope import index_q_rope_fp4
from sgl_dspark.kernels.indexer.reference import fp4_index_k_quant_ref, index_q_rope_fp4_ref
from sgl_dspark.kernels.mhc.post_combine import mhc_post_combine
from sgl_dspark.kernels.mhc.reference import mhc_post_combine_ref

HIDDEN = 4096
HC = 4
HC_SINKHORN_ITERS = 20
INDEX_HEADS, INDEX_HEAD_DIM, ROPE_DIM = 64, 128, 64
HEAD_WEIGHT_SPLITS = 8  # split-K partials of the head-weight projection
ROPE_TABLE = 8192
M_VALUES = (1, 4, 8, 24, 32, 128)


def _gen(m: int) -> torch.Generator:
    return torch.Generator().manual_seed(4321 + m)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


# ----------------------------------------------------------------------------- mhc_post_combine


def _mhc_inputs(m: int, device: str, hidden: int = HIDDEN) -> dict[str, Any]:
    gen = _gen(m)
    r = (2 + HC) * HC
    tensors = dict(
        streams=torch.randn(m, HC, hidden, generator=gen).to(torch.bfloat16),
        y=torch.randn(m, hidden, generator=gen).to(torch.bfloat16),
        post=torch.rand(m, HC, generator=gen) * 2,
        comb=torch.rand(m, HC, HC, generator=gen) / HC,
        fn=torch.randn(r, HC * hidden, generator=gen) * 0.02,
        base=torch.randn(r, generator=gen) * 0.1,
        scale=torch.ones(3),
        norm_weight=1 + 0.1 * torch.randn(hidden, generator=gen),
    )
    return {
        **{k: v.to(device) for k, v in tensors.items()},
        "hc_eps": 1e-6,
        "sinkhorn_iters": HC_SINKHORN_ITERS,
        "rms_eps": 1e-6,
    }


def _mhc_check(want: Any, got: Any) -> None:
    # Rs' is bit-exact; the rest passes through reductions/exp whose order differs (a tolerance).
    assert torch.equal(_bits(want.streams), _bits(got.streams)), "streams differ"
    for name in ("pre", "post", "comb"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6)
    # x_in = sum_j pre[j] * Rs'[j]: pre may differ by its 1e-5 relative tolerance, so where the
    # terms cancel, x_in's absolute error is bounded by 1e-5 * sum_j |pre[j] * Rs'[j]|, which can
    # exceed a fixed atol (the M = 128 run had 2 of 524288 elements there). Per element: one bf16
    # ulp of the result plus that cancellation bound; the normed output is computed from the
    # rounded x_in, so it also inherits x_in's whole error (one x_in ulp + cancellation) scaled
    # by rstd * |w| (|w| <= 1.5 for these inputs).
    mag = (want.pre.float()[:, :, None] * want.streams.float()).abs().sum(1)
    x_in_w = want.x_in.float()
    rstd = torch.rsqrt(x_in_w.pow(2).mean(-1, keepdim=True) + 1e-6)
    x_in_err = 2.0**-7 * x_in_w.abs() + 2e-5 * mag
    bounds = {"x_in": 2e-5 * mag, "x_normed": x_in_err * rstd * 1.5}
    for name in ("x_in", "x_normed"):
        w, g = getattr(want, name).float(), getattr(got, name).float()
        tol = 2.0**-7 * w.abs() + bounds[name] + 1e-30
        bad = ((g - w).abs() > tol).sum().item()
        assert bad == 0, f"{name}: {bad} elements outside one ulp + the cancellation bound"
        assert (w != g).float().mean().item() < 0.02, f"{name}: too many 1-ulp differences"


def _mhc_bytes(m: int, hidden: int = HIDDEN) -> int:
    r = (2 + HC) * HC
    per_row = (2 * HC * hidden + 3 * hidden) * 2 + (2 * HC + 2 * HC * HC + HC) * 4
    return m * per_row + (r * HC * hidden + r + 3 + hidden) * 4


# The engine's tiny DSV4 config runs the boundary at D = 1024 (about 20 calls per decode step).
ENGINE_HIDDEN = 1024


def _mhc_inputs_engine(m: int, device: str) -> dict[str, Any]:
    return _mhc_inputs(m, device, ENGINE_HIDDEN)


def _mhc_bytes_engine(m: int) -> int:
    return _mhc_bytes(m, ENGINE_HIDDEN)


# ----------------------------------------------------------------------------- fp4_index_k_quant


def _k_inputs(m: int, device: str) -> dict[str, Any]:
    x = torch.randn(m, INDEX_HEAD_DIM, generator=_gen(m)).to(torch.bfloat16)
    return {"x": x.to(device)}


def _k_check(want: Any, got: Any) -> None:
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), "codes/scales differ"


# The key quantisation's unfused chain: quantise, then write each row into its
# 68-byte cache slot (64 payload + 4 scale bytes); slot 0 is the reserved dummy (a padded row's)
# and is never written. The slots are a shuffled subset of a 4096-slot cache.
CACHE_SLOTS = 4096


def _k_store_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    loc = torch.randperm(CACHE_SLOTS - 1, generator=gen)[:m] + 1
    if m >= 4:
        loc[-1] = 0  # a graph bucket's padding row
    cache = torch.randint(
        0,
        256,
        (CACHE_SLOTS, INDEX_HEAD_DIM // 2 + INDEX_HEAD_DIM // 32),
        generator=gen,
        dtype=torch.uint8,
    )
    x = torch.randn(m, INDEX_HEAD_DIM, generator=gen).to(torch.bfloat16)
    return {"x": x.to(device), "loc": loc.to(device), "cache": cache.to(device)}


def fp4_index_k_store_ref(x: torch.Tensor, loc: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`fp4_index_k_quant_ref`, then the cache write: `cache[loc[t]] = codes[t] | scales[t]` for loc != 0
    (no host sync: a dummy row writes slot 0's own bytes back)."""
    codes, scales = fp4_index_k_quant_ref(x)
    rows = torch.cat([codes, scales], dim=1).to(cache.dtype)
    cache[loc] = torch.where((loc != 0)[:, None], rows, cache[loc])
    return cache


def _k_store_launch(x: torch.Tensor, loc: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    half = INDEX_HEAD_DIM // 2
    fp4_index_k_quant(x, loc=loc, out_codes=cache[:, :half], out_scales=cache[:, half:])
    return cache


def _k_store_check(want: torch.Tensor, got: torch.Tensor) -> None:
    assert want.data_ptr() != got.data_ptr(), "the check needs two caches"
    assert torch.equal(want, got), "cache bytes differ"


# ----------------------------------------------------------------------------- index_q_rope_fp4


def _q_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m)
    angles = torch.rand(ROPE_TABLE, ROPE_DIM // 2, generator=gen) * 6.3
    tensors = dict(
        q=torch.randn(m, INDEX_HEADS * INDEX_HEAD_DIM, generator=gen).to(torch.bfloat16),
        cos_sin=torch.stack([angles.cos(), angles.sin()], dim=-1),
        positions=torch.randint(0, ROPE_TABLE, (m,), generator=gen),
        weight_partials=torch.randn(HEAD_WEIGHT_SPLITS, m, INDEX_HEADS, generator=gen),
    )
    return {
        **{k: v.to(device) for k, v in tensors.items()},
        "n_heads": INDEX_HEADS,
        "rope_dim": ROPE_DIM,
        "head_weight_scale": INDEX_HEAD_DIM**-0.5 * INDEX_HEADS**-0.5,
    }


def _q_check(want: Any, got: Any) -> None:
    assert torch.equal(want.codes, got.codes), "codes differ"
    assert torch.equal(want.scales, got.scales), "scales differ"
    assert torch.equal(_bits(want.head_weights), _bits(got.head_weights)), "head weights differ"


def _q_bytes(m: int) -> int:
    read = INDEX_HEADS * INDEX_HEAD_DIM * 2 + 8 + ROPE_DIM * 4
    read += HEAD_WEIGHT_SPLITS * INDEX_HEADS * 4
    written = INDEX_HEADS * INDEX_HEAD_DIM // 2 + INDEX_HEAD_DIM // 32 * 64 + INDEX_HEADS * 2
    return m * (read + written)


def _case(
    name: str,
    make_inputs: Callable[[int, str], dict[str, Any]],
    reference: Callable,
    launcher: Callable,
    check: Callable,
    bytes_moved: Callable[[int], int],
) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=make_inputs,
        reference=reference,
        launcher=launcher,
        check=check,
        bytes_moved=bytes_moved,
    )


CASES: list[dict[str, Any]] = [
    _case(
        "mhc_post_combine_norm_bf16_hc4",
        _mhc_inputs,
        mhc_post_combine_ref,
        mhc_post_combine,
        _mhc_check,
        _mhc_bytes,
    ),
    _case(
        "mhc_post_combine_norm_bf16_hc4_d1024",
        _mhc_inputs_engine,
        mhc_post_combine_ref,
        mhc_post_combine,
        _mhc_check,
        _mhc_bytes_engine,
    ),
    _case(
        "fp4_index_k_quant_128",
        _k_inputs,
        fp4_index_k_quant_ref,
        fp4_index_k_quant,
        _k_check,
        lambda m: m * (INDEX_HEAD_DIM * 2 + INDEX_HEAD_DIM // 2 + 4),
    ),
    _case(
        "fp4_index_k_quant_store_68B_slots",
        _k_store_inputs,
        fp4_index_k_store_ref,
        _k_store_launch,
        _k_store_check,
        lambda m: m * (INDEX_HEAD_DIM * 2 + 8 + 2 * (INDEX_HEAD_DIM // 2 + 4)),
    ),
    _case(
        "index_q_rope_fp4_pack_weights_64h",
        _q_inputs,
        index_q_rope_fp4_ref,
        index_q_rope_fp4,
        _q_check,
        _q_bytes,
    ),
]
