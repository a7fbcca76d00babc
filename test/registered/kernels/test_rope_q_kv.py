"""Query heads + KV row in one launch (`rope_q_kv`), against the unfused reference chain and
against the single-job kernel (`rope_tail`), whose rows it must reproduce."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.rope.q_kv import rope_q_kv
from sgl_dspark.kernels.rope.reference import rope_q_kv_ref, rope_tail_ref
from sgl_dspark.kernels.rope.tail import rope_tail
from test_rope import (
    _EPS,
    DEVICE,
    _assert_bits_equal,
    _assert_close_to_composition,
    _assert_norm_after_rstd,
    _norm_inputs,
    _to,
)


def _case(tokens, heads, head_dim, kv_dim, rope_dim, dtype, seed):
    q, cos, sin, _ = _norm_inputs(tokens, heads, head_dim, rope_dim, dtype, seed, weighted=False)
    kv, _, _, weight = _norm_inputs(tokens, 1, kv_dim, rope_dim, dtype, seed + 1, weighted=True)
    return q, kv[:, 0], cos, sin, weight


def _kv_normed_by_kernel(q, kv, cos, kv_norm_eps, weight):
    """The fused launch's own normed KV rows: the identity rotation returns them exactly
    (test_rope's `_normed_by_kernel`, through the pair launch so the warps are the same)."""
    ones = torch.ones_like(cos)
    _, rows = rope_q_kv(
        q, kv, ones, ones * 0, q_norm_eps=_EPS, kv_norm_eps=kv_norm_eps, kv_norm_weight=weight
    )
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize(
    "tokens,heads,out_heads,head_dim,kv_dim,rope_dim",
    [
        (1, 16, 64, 512, 512, 64),  # DSV4-Flash per rank: 16 heads padded to 64, one KV head
        (5, 16, 16, 128, 128, 64),  # the 910M benchmark model's layer
        (33, 3, 8, 64, 96, 32),  # q and KV of different widths, heads padded to 8
        (7, 12, 10, 40, 40, 6),  # un-padded, rd/2 not a power of two
    ],
)
def test_without_norms_bit_exact(
    tokens, heads, out_heads, head_dim, kv_dim, rope_dim, scatter, dtype
) -> None:
    q, kv, cos, sin, _ = _case(tokens, heads, head_dim, kv_dim, rope_dim, dtype, seed=tokens)
    pool = torch.full(
        (tokens + 9, kv_dim) if scatter else (tokens, kv_dim), float("nan"), dtype=dtype
    )
    rows = torch.randperm(tokens + 9, generator=torch.Generator().manual_seed(3))[:tokens]
    want_q, want_pool = rope_q_kv_ref(
        q,
        kv,
        cos,
        sin,
        q_out_heads=out_heads,
        kv_out=pool.clone(),
        kv_rows=rows if scatter else None,
    )
    q, kv, cos, sin, pool, rows = _to(DEVICE, q, kv, cos, sin, pool, rows)
    q_out = torch.full((tokens, out_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    kv_out = pool
    got_q, got_kv = rope_q_kv(
        q, kv, cos, sin, q_out=q_out, kv_out=kv_out, kv_rows=rows if scatter else None
    )
    assert got_q is q_out and got_kv.data_ptr() == kv_out.data_ptr()
    _assert_bits_equal(got_q, want_q)
    # Scattered: slots outside the batch's rows keep their poison (bits: NaN == NaN).
    _assert_bits_equal(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 6, 33])
@pytest.mark.parametrize(
    "heads,out_heads,head_dim,kv_dim,rope_dim,weighted",
    [(16, 64, 512, 512, 64, True), (16, 16, 128, 128, 64, True), (5, 8, 96, 64, 32, False)],
)
def test_with_norms(tokens, heads, out_heads, head_dim, kv_dim, rope_dim, weighted, dtype) -> None:
    """The engine's call: weightless q-head norm + pad, weighted kv_norm + scatter into the pool.
    q equals the single-job kernel bit for bit; the KV row is the rotation of the launch's own
    rounded norm bit for bit, and within a tolerance of the composition."""
    q, kv, cos, sin, weight = _case(
        tokens, heads, head_dim, kv_dim, rope_dim, dtype, seed=17 * tokens + heads
    )
    weight = weight if weighted else None
    want_q, want_kv = rope_q_kv_ref(
        q,
        kv,
        cos,
        sin,
        q_out_heads=out_heads,
        q_norm_eps=_EPS,
        kv_norm_eps=_EPS,
        kv_norm_weight=weight,
    )
    q, kv, cos, sin, weight = _to(DEVICE, q, kv, cos, sin, weight)
    pool = torch.full((50, kv_dim), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(50, generator=torch.Generator().manual_seed(tokens))[:tokens]
    slots = slots.to(DEVICE)
    got_q, _ = rope_q_kv(
        q,
        kv,
        cos,
        sin,
        q_out_heads=out_heads,
        q_norm_eps=_EPS,
        kv_norm_eps=_EPS,
        kv_norm_weight=weight,
        kv_out=pool,
        kv_rows=slots,
    )
    _assert_bits_equal(got_q, rope_tail(q, cos, sin, out_heads=out_heads, norm_eps=_EPS))
    _assert_close_to_composition(got_q, want_q)
    got_kv = pool[slots]
    normed = _kv_normed_by_kernel(q, kv, cos, _EPS, weight)
    _assert_norm_after_rstd(normed, kv, _EPS, weight)
    _assert_bits_equal(got_kv, rope_tail_ref(normed[:, None], cos, sin)[:, 0])
    _assert_close_to_composition(got_kv, want_kv)
    others = torch.ones(50, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.isnan(pool[others].float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_batch(dtype) -> None:
    """Verify rows must reproduce decode rows: each token of an M = 8 launch equals, bit for bit,
    the same token launched alone, for q and for the normed KV row."""
    q, kv, cos, sin, weight = _to(DEVICE, *_case(8, 16, 128, 128, 64, dtype, seed=5))
    q_all, kv_all = rope_q_kv(
        q, kv, cos, sin, q_norm_eps=_EPS, kv_norm_eps=_EPS, kv_norm_weight=weight
    )
    for m in range(8):
        one = slice(m, m + 1)
        q_one, kv_one = rope_q_kv(
            q[one],
            kv[one],
            cos[one],
            sin[one],
            q_norm_eps=_EPS,
            kv_norm_eps=_EPS,
            kv_norm_weight=weight,
        )
        _assert_bits_equal(q_all[one], q_one)
        _assert_bits_equal(kv_all[one], kv_one)


def test_empty_batch_and_no_query_heads() -> None:
    q, kv, cos, sin, weight = _to(DEVICE, *_case(4, 3, 64, 64, 16, torch.bfloat16, seed=9))
    q0, kv0 = rope_q_kv(q[:0], kv[:0], cos[:0], sin[:0], kv_norm_eps=_EPS, kv_norm_weight=weight)
    assert q0.shape == (0, 3, 64) and kv0.shape == (0, 64)
    # No query heads to write: the KV row still lands in the pool.
    pool = torch.full((6, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([5, 0, 3, 1], device=DEVICE)
    q_none, _ = rope_q_kv(q, kv, cos, sin, q_out_heads=0, kv_out=pool, kv_rows=slots)
    assert q_none.shape == (4, 0, 64)
    _assert_bits_equal(pool[slots], rope_tail_ref(kv[:, None].cpu(), cos.cpu(), sin.cpu())[:, 0])
    assert torch.isnan(pool[[2, 4]].float()).all()


def test_bad_arguments_raise() -> None:
    q, kv, cos, sin, weight = _to(DEVICE, *_case(3, 2, 32, 32, 8, torch.float32, seed=1))
    with pytest.raises(ValueError, match="kv must be"):
        rope_q_kv(q, kv[:, None], cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_q_kv(q, kv[:2], cos, sin)
    with pytest.raises(ValueError, match="out_rows needs an out"):
        rope_q_kv(q, kv, cos, sin, kv_rows=torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="kv_out must be"):
        rope_q_kv(q, kv, cos, sin, kv_out=torch.empty(3, 1, 32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        rope_q_kv(q, kv, cos, sin, kv_out=torch.empty(3, 32, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight must be"):
        rope_q_kv(q, kv, cos, sin, kv_norm_eps=_EPS, kv_norm_weight=weight[:16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_norm", [True, False])
@pytest.mark.parametrize(
    "tokens,heads,head_dim,rope_dim",
    [
        (1, 64, 512, 64),  # DeepSeek-V4.1-Flash: 64 heads of 512, a rope tail of 64
        (5, 8, 128, 64),
        (9, 3, 64, 32),
    ],
)
def test_queries_and_quantised_kv_store_are_their_own_calls(
    tokens, heads, head_dim, rope_dim, q_norm, dtype
) -> None:
    """`rope_q_quant_store_kv`: the rotated queries are `rope_tail`'s bits (with and without
    the per-head norm) and the window cache's bytes and scales are `quant_store`'s, other rows
    of the cache untouched (poisoned first)."""
    from sgl_dspark.kernels.quant.store import quant_store
    from sgl_dspark.kernels.rope.q_kv import rope_q_quant_store_kv

    q, kv, cos, sin, _ = _to(
        DEVICE, *_case(tokens, heads, head_dim, head_dim, rope_dim, dtype, seed=tokens)
    )
    g = torch.Generator().manual_seed(tokens + heads)
    rows = torch.randperm(3 * tokens + 2, generator=g)[:tokens].to(DEVICE)
    poison = torch.randint(0, 256, (3 * tokens + 2, head_dim), generator=g, dtype=torch.uint8)
    scales_poison = torch.randint(0, 256, (3 * tokens + 2, head_dim // 32), generator=g)
    cache = (poison.to(DEVICE), scales_poison.to(torch.uint8).to(DEVICE))
    mine, want = [c.clone() for c in cache], [c.clone() for c in cache]
    eps = _EPS if q_norm else None
    got_q = rope_q_quant_store_kv(q, cos, sin, kv, rows, *mine, "fp8_window", q_norm_eps=eps)
    want_q = rope_tail(q, cos, sin, norm_eps=eps)
    quant_store(kv, rows, *want, "fp8_window", cos, sin)
    _assert_bits_equal(got_q, want_q)
    assert torch.equal(mine[0], want[0]) and torch.equal(mine[1], want[1])
    untouched = torch.ones(3 * tokens + 2, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(mine[0].cpu()[untouched], poison[untouched])
    assert not torch.equal(mine[0].cpu()[~untouched], poison[~untouched])
