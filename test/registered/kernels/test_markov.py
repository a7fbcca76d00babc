"""Greedy Markov-head draft loop: ``markov_greedy`` vs ``markov_greedy_ref`` / ``markov_sample``.

Exactness (see the module docstring of ``sgl_dspark.kernels.spec.markov``): drafts must be the exact
argmax (torch order: NaN first, then first index) of the kernel's own ``step_logits``, the
embeddings an exact copy of ``W1[prev]`` along the kernel's own chain, and ``step_logits`` must
match the torch math on that chain up to the rounding of a reordered dot product (one ulp of
W2's dtype on the bias, plus fp32 accumulation error). Drafts equal the reference exactly with
fp32 weights on random inputs and, in 16-bit, on inputs whose top-1 margin dwarfs the rounding.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
from sgl_dspark.kernels.spec import markov
from sgl_dspark.kernels.spec.markov import _plan, markov_greedy
from sgl_dspark.kernels.spec.reference import MarkovGreedyOutput, markov_greedy_ref
from sgl_dspark.srt.speculative.dspark.sampling import markov_sample

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Relative spacing of the W2 dtype: the bias may land one ulp of it away from torch's.
_ULP = {F32: 2.0**-23, BF16: 2.0**-7, F16: 2.0**-10}


def _inputs(batch, gamma, vocab, rank, base_dtype, w1_dtype, w2_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, gamma, vocab, generator=gen) * 2
    w1 = torch.randn(vocab, rank, generator=gen)
    w2 = torch.randn(vocab, rank, generator=gen) / rank**0.5
    anchors = torch.randint(0, vocab, (batch,), generator=gen)
    return (
        base.to(base_dtype).to(DEVICE),
        w1.to(w1_dtype).to(DEVICE),
        w2.to(w2_dtype).to(DEVICE),
        anchors.to(DEVICE),
    )


def _poisoned_out(batch, gamma, vocab, rank, w1_dtype) -> MarkovGreedyOutput:
    return MarkovGreedyOutput(
        torch.full((batch, gamma), -7, dtype=torch.int64, device=DEVICE),
        torch.full((batch, gamma, vocab), float("nan"), dtype=F32, device=DEVICE),
        torch.full((batch, gamma, rank), float("nan"), dtype=w1_dtype, device=DEVICE),
    )


def _check_own_chain(got: MarkovGreedyOutput, base, w1, w2, anchors) -> None:
    """The kernel's outputs are consistent with its own draft chain (see module docstring)."""
    # Drafts: exact argmax of the kernel's own z (torch tie and NaN rules).
    assert torch.equal(got.drafts, torch.argmax(got.step_logits, dim=-1))
    prevs = torch.cat([anchors.long()[:, None], got.drafts[:, :-1]], dim=1)
    assert torch.equal(got.embeds, w1[prevs])
    e = w1[prevs].to(w2.dtype)
    bias = torch.matmul(e, w2.t()).float()
    want = base.float() + bias
    dot_bound = torch.matmul(e.float().abs(), w2.float().abs().t()) * (w2.shape[1] * 2.0**-22)
    tol = _ULP[w2.dtype] * bias.abs() + dot_bound + 2.0**-23 * want.abs() + 2.0**-24
    diff = (got.step_logits - want).abs()
    same_nan = got.step_logits.isnan() == want.isnan()
    assert bool(same_nan.all()), "NaN positions of step_logits differ"
    finite = want.isfinite()
    assert bool((diff[finite] <= tol[finite]).all()), f"max excess {(diff - tol)[finite].max()}"
    assert torch.equal(got.step_logits[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    if w2.dtype != F32 and want.numel() >= 100:
        # A 16-bit bias is rounded after an fp32 dot, so a reordered sum moves it only when it
        # sits on a rounding boundary: nearly every z is bit-identical (catches wrong rounding).
        same = (got.step_logits == want) | (got.step_logits.isnan() & want.isnan())
        assert same.float().mean().item() >= 0.95


_DTYPE_CYCLE = [(F32, F32, F32), (BF16, BF16, BF16), (F32, F32, BF16), (BF16, F32, F32)]
_CHUNK_CYCLE = [None, 3, 7]
# Every (B, G, V, r) of the sweep, with the dtype triple and the forced chunk count rotating.
CASES = [  # batch, gamma, vocab, rank, base dtype, w1 dtype, w2 dtype, num_chunks
    (b, g, v, r, *_DTYPE_CYCLE[(i + i // 2) % 4], _CHUNK_CYCLE[i % 3])
    for i, (b, g, v, r) in enumerate(product((1, 3), (1, 4, 7), (1, 37, 1000, 5000), (8, 48)))
] + [
    (3, 4, 1000, 48, F32, BF16, F32, 3),  # e rounded fp32 <- bf16 table, fp32 head
    (3, 4, 300, 48, F16, F16, F16, 4),
    (1, 4, 300, 48, F32, BF16, F16, None),
    (35, 2, 300, 8, F32, BF16, BF16, 3),  # two row blocks of the tl.dot path
]


@pytest.mark.parametrize("batch,gamma,vocab,rank,base_dt,w1_dt,w2_dt,num_chunks", CASES)
def test_kernel_matches_torch(batch, gamma, vocab, rank, base_dt, w1_dt, w2_dt, num_chunks):
    seed = batch * 1000003 + gamma * 1009 + vocab * 7 + rank
    base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, base_dt, w1_dt, w2_dt, seed)
    out = _poisoned_out(batch, gamma, vocab, rank, w1_dt)
    got = markov_greedy(base, w1, w2, anchors, out=out, num_chunks=num_chunks)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))
    assert not bool(got.step_logits.isnan().any()) and not bool(got.embeds.isnan().any())
    assert bool((got.drafts >= 0).all()) and bool((got.drafts < vocab).all())
    _check_own_chain(got, base, w1, w2, anchors)
    if w2_dt == F32:  # fp32 bias: only fp32 reassociation, random margins are far larger
        want = markov_greedy_ref(base, w1, w2, anchors)
        assert torch.equal(got.drafts, want.drafts)
        assert torch.equal(got.embeds, want.embeds)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_drafts_equal_reference_with_clear_margin(batch, dtype) -> None:
    gamma, vocab, rank = 7, 1000, 48
    base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, dtype, dtype, dtype, 11 + batch)
    gen = torch.Generator().manual_seed(5 + batch)
    winners = torch.randint(0, vocab, (batch, gamma), generator=gen).to(DEVICE)
    # |bias| ~ N(0, 1), |U| ~ N(0, 4): a +64 planted winner is far beyond one bf16 ulp.
    base.scatter_add_(2, winners[..., None], torch.full_like(base[..., :1], 64.0))
    got = markov_greedy(base, w1, w2, anchors, num_chunks=6)
    want = markov_greedy_ref(base, w1, w2, anchors)
    assert torch.equal(want.drafts, winners)
    assert torch.equal(got.drafts, want.drafts)
    assert torch.equal(got.embeds, want.embeds)
    _check_own_chain(got, base, w1, w2, anchors)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_ties_pick_first_index(batch, dtype) -> None:
    gamma, vocab, rank = 4, 1000, 8
    base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, dtype, dtype, dtype, 77 + batch)
    gen = torch.Generator().manual_seed(99 + batch)
    # Tied tokens inside one 128-column block, across blocks and across the 143-column chunks.
    tied = torch.tensor([130, 131, 142, 143, 400, 999], device=DEVICE)
    first = int(tied[torch.randperm(len(tied), generator=gen)[0]])
    tied = tied[tied >= first]
    w2[tied] = w2[first].clone()  # equal rows: equal dot products, bit for bit
    base[:, :, tied] = 40.0  # equal base, far above the rest
    got = markov_greedy(base, w1, w2, anchors, num_chunks=7)
    want = markov_greedy_ref(base, w1, w2, anchors)
    assert torch.equal(want.drafts, torch.full_like(want.drafts, first))
    assert torch.equal(got.drafts, want.drafts)
    _check_own_chain(got, base, w1, w2, anchors)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["nan", "inf"])
def test_nan_and_inf_follow_torch_argmax(batch, mode) -> None:
    gamma, vocab, rank = 4, 1000, 8
    base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, F32, F32, F32, 3 + batch)
    gen = torch.Generator().manual_seed(31 + batch)
    if mode == "nan":  # a NaN wins; with several, the first one
        hit = torch.rand(batch, gamma, vocab, generator=gen) < 2.0 / vocab
        base[hit.to(DEVICE)] = float("nan")
    else:  # some rows all -inf (argmax 0), some with +inf entries
        base[:, 1] = float("-inf")
        base[0, 2, [5, 600]] = float("inf")
    got = markov_greedy(base, w1, w2, anchors, num_chunks=5)
    want = markov_greedy_ref(base, w1, w2, anchors)
    assert torch.equal(got.drafts, want.drafts)
    assert torch.equal(got.embeds, want.embeds)
    _check_own_chain(got, base, w1, w2, anchors)
    if mode == "inf":
        assert bool((want.drafts[:, 1] == 0).all()) and int(want.drafts[0, 2]) == 5


def test_strided_inputs() -> None:
    batch, gamma, vocab, rank = 3, 4, 500, 40
    wide_base, wide_w1, wide_w2, anchors = _inputs(batch, 2 * gamma, vocab, 64, F32, BF16, BF16, 8)
    base, w1, w2 = wide_base[:, 1::2], wide_w1[:, :rank], wide_w2[:, 3 : 3 + rank]
    got = markov_greedy(base, w1, w2, anchors, num_chunks=3)
    want = markov_greedy(base.contiguous(), w1.contiguous(), w2.contiguous(), anchors, num_chunks=3)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    _check_own_chain(got, base, w1, w2, anchors)


@pytest.mark.parametrize(
    "dtypes", [(F32, F32, F32), (BF16, BF16, BF16), (F32, F32, BF16), (F16, BF16, F16)]
)
def test_reference_equals_markov_sample(dtypes) -> None:
    base_dt, w1_dt, w2_dt = dtypes
    for batch, gamma, vocab, rank in [(1, 7, 37, 8), (3, 4, 1000, 48), (2, 1, 1, 16)]:
        base, w1, w2, anchors = _inputs(batch, gamma, vocab, rank, base_dt, w1_dt, w2_dt, vocab)
        ones = torch.ones(batch, device=DEVICE)
        ms = markov_sample(base, w1, w2, anchors, ones, ones.bool())
        ref = markov_greedy_ref(base, w1, w2, anchors)
        assert torch.equal(ref.drafts, ms.drafts)
        assert torch.equal(ref.step_logits, ms.step_logits)
        assert torch.equal(ref.embeds, ms.markov_embeds)


@pytest.mark.parametrize("batch,gamma", [(0, 7), (3, 0), (0, 0)])
def test_empty_returns_without_launch(monkeypatch, batch, gamma) -> None:
    class _NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched for an empty problem")

    monkeypatch.setattr(markov, "_markov_step_kernel", _NoLaunch())
    base, w1, w2, anchors = _inputs(batch, gamma, 37, 8, F32, F32, F32, 1)
    got = markov_greedy(base, w1, w2, anchors)
    assert got.drafts.shape == (batch, gamma) and got.step_logits.shape == (batch, gamma, 37)
    assert got.embeds.shape == (batch, gamma, 8) and got.embeds.dtype == F32
    out = _poisoned_out(batch, gamma, 37, 8, F32)
    assert markov_greedy(base, w1, w2, anchors, out=out) is out


def _bad(name: str):
    base, w1, w2, anchors = _inputs(2, 3, 37, 8, F32, F32, F32, 2)
    args = dict(base_logits=base, w1=w1, w2=w2, anchors=anchors)
    bad = {
        "base_2d": dict(base_logits=base[:, 0]),
        "base_int": dict(base_logits=base.long()),
        "vocab_zero": dict(base_logits=base[:, :, :0], w1=w1[:0], w2=w2[:0]),
        "w1_rows": dict(w1=w1[:36]),
        "w2_rank": dict(w2=torch.randn(37, 9, device=DEVICE)),
        "w2_dtype": dict(w2=w2.double()),
        "rank_too_big": dict(
            w1=torch.randn(37, 1025, device=DEVICE), w2=torch.randn(37, 1025, device=DEVICE)
        ),
        "w2_col_stride": dict(w2=torch.randn(8, 37, device=DEVICE).t()),
        "anchors_shape": dict(anchors=anchors[:1]),
        "anchors_float": dict(anchors=anchors.float()),
        "out_shape": dict(out=_poisoned_out(2, 3, 36, 8, F32)),
        "out_dtype": dict(out=_poisoned_out(2, 3, 37, 8, BF16)),
        "num_chunks": dict(num_chunks=0),
    }[name]
    return {**args, **bad}


@pytest.mark.parametrize(
    "name",
    [
        "base_2d",
        "base_int",
        "vocab_zero",
        "w1_rows",
        "w2_rank",
        "w2_dtype",
        "rank_too_big",
        "w2_col_stride",
        "anchors_shape",
        "anchors_float",
        "out_shape",
        "out_dtype",
        "num_chunks",
    ],
)
def test_bad_inputs_raise(name) -> None:
    kwargs = _bad(name)
    with pytest.raises(ValueError):
        markov_greedy(
            kwargs.pop("base_logits"),
            kwargs.pop("w1"),
            kwargs.pop("w2"),
            kwargs.pop("anchors"),
            **kwargs,
        )


@pytest.mark.parametrize(
    "batch,vocab,rank,elem",
    [
        (1, 32000, 64, 2),
        (32, 32000, 64, 2),
        (1, 129280, 256, 2),
        (8, 129280, 256, 4),
        (1, 1, 1, 4),
        (3, 5000, 48, 2),
    ],
)
def test_plan_covers_vocab_once(batch, vocab, rank, elem) -> None:
    plan = _plan(batch, vocab, rank, elem, None)
    assert (plan.num_chunks - 1) * plan.chunk < vocab <= plan.num_chunks * plan.chunk
    assert plan.chunk % plan.block_v == 0 and plan.block_r >= rank
    assert plan.block_v * plan.block_r <= 8192 and plan.num_chunks <= 256
    assert plan.block_b * max(plan.block_v, plan.block_p) <= 1024
    assert plan.use_dot and plan.block_b >= 16  # B = 1 pads to 16 rows too (faster on GPU)
