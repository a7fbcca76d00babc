"""Lightning-indexer logits (variable-context schedule): the Triton launcher vs its torch reference.

Within a tolerance: both accumulate in fp32 from the same values (bf16 products are exact in fp32,
fp32 inputs use an IEEE dot, never TF32); only the order of the Di-long dots and the Hi-long head
sum differs, so finite scores agree to ~1e-6 relative of the largest term. The -inf pattern (entries
beyond each token's visible count) must match exactly.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.indexer.logits import indexer_logits
from sgl_dspark.kernels.indexer.reference import indexer_logits_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _paged(seq_lens: list[int], extends: list[int], page: int, gen: torch.Generator):
    """Flat decode/verify rows of several requests over a shuffled page table (request slot 0 is
    the padding row pointing at the dummy page 0, as ReqToTokenPool does)."""
    max_ctx = -(-max(seq_lens) // page) * page
    num_pages = sum(-(-s // page) for s in seq_lens) + 2
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0 stays the dummy
    table = (torch.arange(max_ctx) % page).repeat(len(seq_lens) + 2, 1)
    req_slots = torch.randperm(len(seq_lens) + 1, generator=gen)[: len(seq_lens)] + 1
    used, positions, token_slot = 0, [], []
    for r, (seq, ext) in enumerate(zip(seq_lens, extends)):
        n_pages = -(-seq // page)
        pages = order[used : used + n_pages]
        used += n_pages
        table[req_slots[r], : n_pages * page] = (
            pages[:, None] * page + torch.arange(page)
        ).flatten()
        positions += list(range(seq - ext, seq))
        token_slot += [int(req_slots[r])] * ext
    return torch.tensor(positions), torch.tensor(token_slot), table, num_pages * page


def _inputs(seq_lens, extends, heads, head_dim, ratio, dtype, seed, page=16):
    gen = torch.Generator().manual_seed(seed)
    positions, token_slot, table, num_slots = _paged(seq_lens, extends, page, gen)
    tokens = positions.shape[0]
    qi = torch.randn(tokens, heads, head_dim, generator=gen)
    keys = torch.randn(num_slots // ratio, head_dim, generator=gen)
    # Head weights of both signs (so scores can be negative) and a few exact zeros.
    weights = torch.randn(tokens, heads, generator=gen) * heads**-0.5
    weights[:, :1] = 0.0
    return dict(
        qi=qi.to(dtype).to(DEVICE),
        weights=weights.to(DEVICE),
        index_keys=keys.to(dtype).to(DEVICE),
        positions=positions.to(DEVICE),
        token_slot=token_slot.to(DEVICE),
        req_to_token=table.to(DEVICE),
        ratio=ratio,
    )


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    hidden = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), hidden)
    assert torch.isfinite(got[~hidden]).all()
    scale = want[~hidden].abs().max().item() if (~hidden).any() else 1.0
    torch.testing.assert_close(got[~hidden], want[~hidden], rtol=1e-5, atol=1e-6 * scale)


CASES = [
    # (seq_lens, extends, heads, head_dim, ratio, n_max, block_n)
    ([9], [1], 16, 32, 4, 4, 16),  # the tiny model's indexer, one decode row
    ([3, 40, 77], [1, 1, 1], 5, 24, 4, 37, 16),  # 0 visible entries; n_max not a multiple
    ([57, 21], [4, 3], 64, 128, 4, 20, 16),  # DSV4 head shape, verify rows
    ([130, 6], [5, 2], 3, 40, 16, 9, 16),  # HCA-like ratio, odd heads/dims
    ([33, 12, 1], [2, 5, 1], 1, 16, 1, 40, 32),  # ratio 1: every position is an entry
    ([100], [3], 7, 20, 4, 25, 64),  # one chunk covers every entry
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_reference(index: int, dtype: torch.dtype) -> None:
    seq_lens, extends, heads, head_dim, ratio, n_max, block_n = CASES[index]
    inputs = _inputs(seq_lens, extends, heads, head_dim, ratio, dtype, seed=10 + index)
    want = indexer_logits_ref(**inputs, n_max=n_max)
    out = torch.full_like(want, float("nan"))  # poisoned: every column must be written
    got = indexer_logits(**inputs, n_max=n_max, out=out, block_n=block_n)
    assert got is out
    _check(got, want)
    assert torch.isfinite(want).any() and torch.isneginf(want).any()  # both regimes exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_weights_in_qi_dtype_scaled_inside(dtype: torch.dtype) -> None:
    """The layer's call: head weights as a column view of its fused projection (qi's dtype,
    row stride of the whole output) with Hi**-0.5 applied inside: equal to scaling an fp32 copy
    first (the kernel reproduces fp32(w) * scale, then the same math)."""
    inputs = _inputs([57, 21], [4, 3], 64, 128, 4, dtype, seed=8)
    heads = inputs["weights"].shape[1]
    fused = torch.randn(7, 3 * heads, generator=torch.Generator().manual_seed(1)).to(dtype)
    fused = fused.to(DEVICE)
    head_w = fused[:, heads : 2 * heads]
    scale = heads**-0.5
    scaled_copy = {**inputs, "weights": head_w.float() * scale}
    want = indexer_logits_ref(**scaled_copy, n_max=20)
    assert torch.equal(
        indexer_logits_ref(**{**inputs, "weights": head_w}, n_max=20, weight_scale=scale), want
    )
    got = indexer_logits(**{**inputs, "weights": head_w}, n_max=20, weight_scale=scale)
    assert torch.equal(got, indexer_logits(**scaled_copy, n_max=20))
    _check(got, want)


def test_strided_queries_and_empty_launches() -> None:
    inputs = _inputs([29, 50], [3, 2], 6, 32, 4, torch.float32, seed=3)
    fused = torch.randn(5, 2, 6, 32).to(DEVICE)  # e.g. a view of a fused projection
    fused[:, 0] = inputs["qi"]
    inputs["qi"] = fused[:, 0]  # token stride 384, head stride 32
    assert not inputs["qi"].is_contiguous()
    _check(indexer_logits(**inputs, n_max=13), indexer_logits_ref(**inputs, n_max=13))
    empty = {
        k: (v[:0] if k in ("qi", "weights", "positions", "token_slot") else v)
        for k, v in inputs.items()
    }
    assert indexer_logits(**empty, n_max=13).shape == (0, 13)
    assert indexer_logits(**inputs, n_max=0).shape == (5, 0)


def test_invisible_entries_are_never_read() -> None:
    # Keys of every entry that no token may see are NaN: a load of any of them (in a chunk
    # beyond the visible count or in the tail of a partial chunk) would surface as NaN.
    inputs = _inputs([70, 9, 140], [2, 1, 3], 4, 16, 4, torch.float32, seed=5)
    ratio, table = inputs["ratio"], inputs["req_to_token"]
    keys = torch.full_like(inputs["index_keys"], float("nan"))
    for pos, slot in zip(inputs["positions"].tolist(), inputs["token_slot"].tolist()):
        for n in range((pos + 1) // ratio):
            entry = int(table[slot, n * ratio]) // ratio
            keys[entry] = inputs["index_keys"][entry]
    inputs["index_keys"] = keys
    got = indexer_logits(**inputs, n_max=40, block_n=16)
    want = indexer_logits_ref(**inputs, n_max=40)
    assert not torch.isnan(got).any()
    _check(got, want)


def test_hand_derived_scores() -> None:
    # One request, ratio 2, one head of 16 dims. Token at position 5 sees entries 0..2, which
    # live at token slots 8, 12, 2 (entry slots 4, 6, 1); its query is e0 * 2.
    table = torch.tensor([[8, 9, 12, 13, 2, 3, 0, 0]])
    keys = torch.zeros(8, 16)
    keys[4, 0], keys[6, 0], keys[1, 0] = 3.0, -1.0, 0.5
    qi = torch.zeros(1, 1, 16)
    qi[0, 0, 0] = 2.0
    got = indexer_logits(
        qi.to(DEVICE),
        torch.tensor([[0.75]]).to(DEVICE),
        keys.to(DEVICE),
        torch.tensor([5]).to(DEVICE),
        torch.tensor([0]).to(DEVICE),
        table.to(DEVICE),
        2,
        4,
        block_n=16,
    ).cpu()
    expect = torch.tensor([[0.75 * 6.0 / 4.0, 0.0, 0.75 * 1.0 / 4.0, float("-inf")]])
    assert torch.equal(got, expect)


def test_rejects_bad_layouts() -> None:
    inputs = _inputs([20], [2], 4, 16, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weights"):
        indexer_logits(**{**inputs, "weights": inputs["weights"].double()}, n_max=5)
    with pytest.raises(ValueError, match="index_keys"):
        indexer_logits(**{**inputs, "index_keys": inputs["index_keys"].bfloat16()}, n_max=5)
    with pytest.raises(ValueError, match="block_n"):
        indexer_logits(**inputs, n_max=5, block_n=24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_positions() -> None:
    inputs = _inputs([90, 33], [2, 2], 8, 32, 4, torch.bfloat16, seed=9)
    out = torch.empty(4, 23, device=DEVICE)
    indexer_logits(**inputs, n_max=23, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_logits(**inputs, n_max=23, out=out)
    inputs["positions"].sub_(torch.tensor([30, 30, 1, 1], device=DEVICE))
    graph.replay()
    _check(out, indexer_logits_ref(**inputs, n_max=23))
