"""DSpark draft attention core: the Triton launcher vs its torch reference (a tolerance).

Not bit-exact: the kernel's online softmax sums the keys tile by tile in fp32 (exp2 with log2(e)
folded into the scale), so fp32 results agree to ~1e-6 relative (asserted at 1e-5). With bf16
inputs the reference rounds its logits and probabilities to bf16 where the kernel keeps them in
fp32 (and the interpreter truncates the bf16 output), hence a few 1e-2 (see `test_bf16_...`).
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.attention.draft import draft_attention
from sgl_dspark.kernels.attention.reference import draft_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _inputs(
    batch: int,
    q_len: int,
    heads: int,
    head_dim: int,
    num_ctx: int,
    dtype: torch.dtype,
    seed: int,
    pool_dtype: torch.dtype | None = None,
) -> dict:
    """Random inputs shaped like a draft step: request 0 sits at a position < C (leading context
    positions invalid, their slots the dummy slot 0), request 1 (if any) sees no context at all,
    the others a random mask. The dummy slot and every unused pool row hold NaN, so reading one
    into the result would show."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = batch * num_ctx + 5
    pool = torch.randn(num_slots, head_dim, generator=gen)
    used = torch.randperm(num_slots - 1, generator=gen)[: batch * num_ctx] + 1
    slots = used.view(batch, num_ctx).clone()
    valid = torch.rand(batch, num_ctx, generator=gen) < 0.8
    if num_ctx:
        valid[0] = torch.arange(num_ctx) >= num_ctx // 3
    if batch > 1:
        valid[1] = False
    slots[~valid] = 0
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots[valid]] = False
    pool[unused] = float("nan")
    # Sinks from strongly negative (no effect) to strongly positive (absorbs most of the mass).
    sinks = torch.randn(heads, generator=gen) * 3
    sinks[: min(heads, 2)] = torch.tensor([-40.0, 8.0])[: min(heads, 2)]
    q = torch.randn(batch, q_len, heads, head_dim, generator=gen) * 2
    kv_block = torch.randn(batch, q_len, head_dim, generator=gen)
    return dict(
        q=q.to(dtype).to(DEVICE),
        ctx_pool=pool.to(pool_dtype or dtype).to(DEVICE),
        ctx_slots=slots.to(DEVICE),
        ctx_valid=valid.to(DEVICE),
        kv_block=kv_block.to(dtype).to(DEVICE),
        sinks=sinks.to(DEVICE),
        scale=head_dim**-0.5,
    )


def _ref(inputs: dict) -> torch.Tensor:
    """The reference with the NaN rows it must not read replaced by zeros (the reference
    multiplies them by a zero probability, which keeps the NaN; the kernel never loads them)."""
    pool = torch.nan_to_num(inputs["ctx_pool"], nan=0.0)
    return draft_attention_ref(**{**inputs, "ctx_pool": pool})


def _run_poisoned(inputs: dict) -> torch.Tensor:
    out = torch.full_like(inputs["q"], float("nan"))
    got = draft_attention(**inputs, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "NaN in the output: poisoned buffer or a masked row read"
    return got


def _upcast(inputs: dict) -> dict:
    return {
        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


# The full sweep (B, Q, H, Dh, C) in fp32: Q up to the largest block, heads below, at and above
# one row block, Dh 64/128 plus the DeepSeek-V4-Flash stage (64 heads, Dh 512) and a Dh that is
# not a power of two; C = 0 (no context), a short window and the benchmark's 128.
SWEEP = [
    (b, q, h, d, c)
    for b in (1, 3)
    for q in (1, 4, 7, 16)
    for h in (1, 3, 16)
    for d in (64, 128)
    for c in (0, 5, 128)
]
EXTRA = [(1, 7, 64, 512, 128), (2, 3, 5, 96, 20)]
BF16 = [(1, 7, 16, 128, 128), (3, 4, 3, 64, 5), (3, 16, 3, 128, 0), (1, 7, 64, 512, 128)]


@pytest.mark.parametrize("case", SWEEP + EXTRA, ids=str)
def test_fp32_matches_reference(case) -> None:
    inputs = _inputs(*case, dtype=torch.float32, seed=sum(case))
    got = _run_poisoned(inputs)
    # Reordered fp32 sums (online softmax): a few ulps, well within 1e-5.
    torch.testing.assert_close(got, _ref(inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", BF16, ids=str)
def test_bf16_matches_reference(case) -> None:
    inputs = _inputs(*case, dtype=torch.bfloat16, seed=7 + sum(case))
    got = _run_poisoned(inputs)
    assert got.dtype == torch.bfloat16
    # Against the same math in fp32 on the bf16 inputs: only the kernel's bf16 probabilities in
    # the PV product and the bf16 output rounding differ (the interpreter truncates): ~2^-7.
    torch.testing.assert_close(got.float(), _ref(_upcast(inputs)), rtol=2e-2, atol=2e-2)
    # Against the bf16 reference, which also rounds logits and probabilities to bf16: logits of
    # magnitude ~10 move by ~0.03, so a looser bound.
    torch.testing.assert_close(got.float(), _ref(inputs).float(), rtol=0.05, atol=0.05)


def test_mixed_pool_dtype_is_cast_on_load() -> None:
    # An fp32 pool under bf16 block rows: the context rows are rounded to bf16 before use, as the
    # reference's `.to(kv_block.dtype)`.
    inputs = _inputs(2, 3, 4, 64, 9, dtype=torch.bfloat16, seed=11, pool_dtype=torch.float32)
    got = _run_poisoned(inputs)
    rounded = {**inputs, "ctx_pool": inputs["ctx_pool"].to(torch.bfloat16)}
    torch.testing.assert_close(got.float(), _ref(_upcast(rounded)), rtol=2e-2, atol=2e-2)


def test_strided_views() -> None:
    # q and kv_block as slices of wider buffers, ctx_slots/ctx_valid as column slices: the
    # launcher passes every stride through.
    base = _inputs(2, 5, 3, 64, 12, dtype=torch.float32, seed=5)
    q_wide = torch.randn(2, 5, 4, 64, device=DEVICE)
    q_wide[:, :, 1:] = base["q"]
    kv_wide = torch.randn(2, 5, 80, device=DEVICE)
    kv_wide[..., 8:72] = base["kv_block"]
    slots_wide = torch.zeros(2, 20, dtype=torch.int64, device=DEVICE)
    slots_wide[:, 3:15] = base["ctx_slots"]
    valid_wide = torch.zeros(2, 20, dtype=torch.bool, device=DEVICE)
    valid_wide[:, 3:15] = base["ctx_valid"]
    strided = {
        **base,
        "q": q_wide[:, :, 1:],
        "kv_block": kv_wide[..., 8:72],
        "ctx_slots": slots_wide[:, 3:15],
        "ctx_valid": valid_wide[:, 3:15],
    }
    got = _run_poisoned(strided)
    torch.testing.assert_close(got, _ref(base), rtol=1e-5, atol=1e-5)


def test_int32_slots() -> None:
    inputs = _inputs(2, 3, 2, 64, 7, dtype=torch.float32, seed=3)
    inputs["ctx_slots"] = inputs["ctx_slots"].int()
    torch.testing.assert_close(_run_poisoned(inputs), _ref(inputs), rtol=1e-5, atol=1e-5)


def test_sink_only_softmax_sanity() -> None:
    # Hand-derived: no context and one block row k, so o = k * e^s / (e^s + e^sink).
    inputs = _inputs(1, 1, 2, 64, 0, dtype=torch.float32, seed=4)
    got = _run_poisoned(inputs)
    key = inputs["kv_block"][0, 0]
    logit = (inputs["q"][0, 0] @ key) * inputs["scale"]
    weight = torch.sigmoid(logit - inputs["sinks"])
    torch.testing.assert_close(got[0, 0], weight[:, None] * key[None, :], rtol=1e-5, atol=1e-6)


def test_empty_batch() -> None:
    inputs = _inputs(1, 3, 2, 64, 4, dtype=torch.float32, seed=0)
    empty = {
        k: v[:0] if k in ("q", "ctx_slots", "ctx_valid", "kv_block") else v
        for k, v in inputs.items()
    }
    assert draft_attention(**empty).shape == (0, 3, 2, 64)


def test_rejects_bad_arguments() -> None:
    inputs = _inputs(2, 3, 4, 64, 5, dtype=torch.float32, seed=1)
    bad = {
        "q": inputs["q"].double(),
        "kv_block": inputs["kv_block"][:, :2],
        "ctx_pool": inputs["ctx_pool"][:, :32],
        "ctx_slots": inputs["ctx_slots"].float(),
        "ctx_valid": inputs["ctx_valid"][:, :4],
        "sinks": inputs["sinks"][:3],
        "out": torch.empty(2, 3, 4, 64, dtype=torch.bfloat16, device=DEVICE),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            draft_attention(**{**inputs, name: value})
    with pytest.raises(ValueError, match="kv_block"):
        draft_attention(**{**inputs, "kv_block": inputs["kv_block"].bfloat16()})
    with pytest.raises(ValueError, match="ctx_valid"):
        draft_attention(**{**inputs, "ctx_valid": inputs["ctx_valid"].int()})
    # Non-unit stride along Dh: every tensor with a Dh axis names itself.
    for name in ("q", "kv_block", "ctx_pool"):
        t = inputs[name]
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=DEVICE)
        with pytest.raises(ValueError, match=f"{name} must have unit stride"):
            draft_attention(**{**inputs, name: wide[..., ::2]})
    out = torch.empty(2, 3, 4, 128, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="out must have unit stride"):
        draft_attention(**inputs, out=out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "batch,q_len,heads,head_dim,num_ctx,rope_dim",
    [
        (1, 7, 16, 128, 40, 64),  # the mid model's draft stage: block 7, Dh 128, rd 64
        (3, 4, 5, 64, 9, 64),  # rd = Dh; rows past one row block
        (2, 3, 2, 80, 0, 16),  # no context; Dh not a power of two
    ],
)
def test_inverse_rope_epilogue_equals_rope_tail_after(
    batch: int,
    q_len: int,
    heads: int,
    head_dim: int,
    num_ctx: int,
    rope_dim: int,
    dtype: torch.dtype,
) -> None:
    """The fused epilogue is `rope_tail(out, cos, sin, inverse=True)` of the kernel's own output
    at each block row's angles, bit for bit."""
    from sgl_dspark.kernels.rope.tail import rope_tail

    inputs = _inputs(batch, q_len, heads, head_dim, num_ctx, dtype, seed=head_dim + q_len)
    gen = torch.Generator().manual_seed(3)
    angles = torch.rand(batch * q_len, rope_dim // 2, generator=gen) * 7
    table = torch.cat((angles.cos(), angles.sin()), dim=1).to(DEVICE)
    cos, sin = table[:, : rope_dim // 2], table[:, rope_dim // 2 :]
    plain = draft_attention(**inputs).reshape(batch * q_len, heads, head_dim)
    want = rope_tail(plain, cos, sin, inverse=True).view(batch, q_len, heads, head_dim)
    got = draft_attention(
        **inputs, out=torch.full_like(inputs["q"], float("nan")), inverse_rope=(cos, sin)
    )
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
    assert not torch.equal(got, plain.view_as(got)), "the rotation did nothing"
    with pytest.raises(ValueError, match="inverse_rope"):
        draft_attention(**inputs, inverse_rope=(cos[:1], sin[:1]))
