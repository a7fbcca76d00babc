"""Window + extra-key attention with sinks: the Triton launcher vs its torch reference (X2).

Not bit-exact: the kernel's online softmax rescales and sums the keys tile by tile in fp32 (and
uses exp2 with log2(e) folded into the scale), so the additions happen in another order than the
reference's one-shot softmax and matmul; fp32 results agree to ~1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.sparse_attention import (
    window_sparse_attention,
    window_sparse_attention_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_batch(seq_lens: list[int], extends: list[int], page_size: int, gen: torch.Generator):
    """A flat batch like ForwardBatch over a ReqToTokenPool-style table: request slot 0 is the
    padding row, requests get shuffled request slots and pages drawn at random from a pool."""
    num_reqs = len(seq_lens)
    max_ctx = -(-max(seq_lens) // page_size) * page_size
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 3
    page_order = torch.randperm(num_pages, generator=gen)
    table = (torch.arange(max_ctx) % page_size).repeat(num_reqs + 2, 1)  # dummy page rows
    req_slots = (torch.randperm(num_reqs + 1, generator=gen) + 1)[:num_reqs]
    used = 0
    positions, token_slot = [], []
    for r, (seq, ext) in enumerate(zip(seq_lens, extends)):
        n_pages = -(-seq // page_size)
        pages = page_order[used:used + n_pages]
        used += n_pages
        row = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        table[req_slots[r], : n_pages * page_size] = row
        positions += list(range(seq - ext, seq))
        token_slot += [int(req_slots[r])] * ext
    return (torch.tensor(positions), torch.tensor(token_slot), table,
            num_pages * page_size)


def _inputs(seq_lens, extends, heads, head_dim, window, num_extra, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    positions, token_slot, table, num_slots = _paged_batch(seq_lens, extends, 4, gen)
    tokens = positions.shape[0]
    q = torch.randn(tokens, heads, head_dim, generator=gen) * 2
    window_kv = torch.randn(num_slots, head_dim, generator=gen)
    # Sinks from strongly negative (no effect) to strongly positive (absorbs most of the mass).
    sinks = torch.randn(heads, generator=gen) * 3
    sinks[: min(heads, 2)] = torch.tensor([-40.0, 12.0])[: min(heads, 2)]
    extra_kv = extra_valid = None
    if num_extra is not None:
        extra_kv = torch.randn(tokens, num_extra, head_dim, generator=gen)
        extra_valid = torch.rand(tokens, num_extra, generator=gen) < 0.6
        if tokens > 1:
            extra_valid[1] = False  # a token that sees no extra key at all
        extra_kv = extra_kv.to(dtype).to(DEVICE)
        extra_valid = extra_valid.to(DEVICE)
    return dict(
        q=q.to(dtype).to(DEVICE), window_kv=window_kv.to(dtype).to(DEVICE),
        positions=positions.to(DEVICE), token_slot=token_slot.to(DEVICE),
        req_to_token=table.to(DEVICE), window=window, sinks=sinks.to(DEVICE),
        scale=head_dim**-0.5, extra_kv=extra_kv, extra_valid=extra_valid,
    )


def _run_poisoned(inputs: dict) -> torch.Tensor:
    out = torch.full_like(inputs["q"], float("nan"))
    got = window_sparse_attention(**inputs, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "kernel left poisoned output"
    return got


def _upcast(inputs: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs.items()}


CASES = [
    # (seq_lens, extends, heads, head_dim, window, num_extra)
    ([9], [1], 16, 64, 4, None),                 # plain decode, window < position
    ([3, 17, 6], [1, 1, 1], 5, 32, 8, 13),      # window longer than some positions, odd heads
    ([12, 5, 30], [4, 3, 4], 16, 128, 6, 0),    # verify widths 4/3/4, N = 0
    ([2, 25], [2, 3], 20, 64, 16, 37),          # heads > one head block, window > position
    ([40], [1], 3, 512, 5, 21),                 # DSV4 head dim
    ([1], [1], 1, 32, 1, 3),                    # window 1, the first token of a request
    ([130, 70], [2, 1], 16, 512, 128, 40),      # DSV4 local heads, window 128, Dh 512
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_fp32_matches_reference(index: int) -> None:
    inputs = _inputs(*CASES[index], dtype=torch.float32, seed=100 + index)
    want = window_sparse_attention_ref(**inputs)
    got = _run_poisoned(inputs)
    # Reordered fp32 sums (online softmax): a few ulps, well within 1e-5.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index", [1, 2, 3, 4, 6])
def test_bf16_matches_reference(index: int) -> None:
    inputs = _inputs(*CASES[index], dtype=torch.bfloat16, seed=200 + index)
    got = _run_poisoned(inputs)
    # Against the same math in fp32 on the bf16 inputs: only the kernel's bf16 probabilities in
    # the PV product and the final bf16 rounding differ (the interpreter truncates), so ~2^-7.
    exact = window_sparse_attention_ref(**_upcast(inputs))
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    # Against the bf16 reference, which also rounds logits and probabilities to bf16: the bf16
    # logits shift the outputs by up to ~0.03 absolute (measured 0.031), so a looser bound.
    want = window_sparse_attention_ref(**inputs)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_empty_batch() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=0)
    empty = {k: v[:0] if k in ("q", "positions", "token_slot", "extra_kv", "extra_valid") else v
             for k, v in inputs.items()}
    got = window_sparse_attention(**empty)
    assert got.shape == (0, 4, 32)


def test_sink_only_softmax_sanity() -> None:
    # Hand-derived: one visible key k (window 1, no extras), so o = k * e^s / (e^s + e^sink).
    inputs = _inputs([6], [1], 2, 32, 1, None, dtype=torch.float32, seed=3)
    got = _run_poisoned(inputs)
    key = inputs["window_kv"][inputs["req_to_token"][inputs["token_slot"][0], 5]]
    logit = (inputs["q"][0] @ key) * inputs["scale"]
    weight = torch.sigmoid(logit - inputs["sinks"])
    torch.testing.assert_close(got[0], weight[:, None] * key[None, :], rtol=1e-5, atol=1e-6)


def test_rejects_bad_layouts() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="extra_valid"):
        window_sparse_attention(**{**inputs, "extra_valid": None})
    with pytest.raises(ValueError, match="window_kv"):
        window_sparse_attention(**{**inputs, "window_kv": inputs["window_kv"].double()})
    with pytest.raises(ValueError, match="sinks"):
        window_sparse_attention(**{**inputs, "sinks": inputs["sinks"][:2]})
