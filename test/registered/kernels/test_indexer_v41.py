"""DeepSeek-V4.1's indexer kernels against their references: the scores of packed FP4 index keys
read through cache rows with the visibility and candidate-block masks (`v41_index_scores`,
tolerance: the sums run in another order; the masks exact), and the candidate source's block
scores (`candidate_block_max`, bit-exact). Keys are quantised by the reference quantiser from
random rows over many binades; rows whose entries are masked point at out-of-range cache rows,
which the kernel must not read."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.indexer.reference import candidate_block_max_ref, v41_index_scores_ref
from sgl_dspark.kernels.indexer.v41_logits import candidate_block_max, v41_index_scores
from sgl_dspark.kernels.quant.reference import fake_quant_fp4_index_ref, quantize_fp4_index_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t: int, heads: int, di: int, n: int, seed: int, block: int):
    g = torch.Generator().manual_seed(seed)
    rows_total = n * t + 5
    keys = torch.randn(rows_total, di, generator=g) * torch.exp2(
        torch.randint(-8, 4, (rows_total, 1), generator=g).float()
    )
    packed = quantize_fp4_index_ref(keys)
    qi = fake_quant_fp4_index_ref(torch.randn(t, heads, di, generator=g))
    weights = torch.randn(t, heads, generator=g).to(torch.bfloat16)
    visible = torch.randint(0, n + 1, (t,), generator=g)
    visible[0] = n
    entry_rows = torch.randint(0, rows_total, (t, n), generator=g)
    # entries past the visible count hold garbage rows: never read
    hidden = torch.arange(n)[None, :] >= visible[:, None]
    entry_rows = torch.where(hidden, torch.full_like(entry_rows, 10**9), entry_rows)
    nb = -(-n // block)
    keep = torch.rand(t, nb, generator=g) < 0.6
    keep[:, 0] = True
    return qi, weights, packed.packed, packed.scales, entry_rows, visible, keep


@pytest.mark.parametrize(
    ("t", "heads", "di", "n", "block"),
    [
        (1, 8, 32, 1, 1),
        (3, 4, 64, 37, 4),
        (5, 32, 128, 130, 8),
        (2, 16, 128, 300, 3),
        (2, 64, 128, 176, 8),  # the rank model's ratio-2 sources: 64 heads, 176 entries
        (2, 3, 64, 4200, 8),  # 64-entry programs past 4096 entries; heads padded to 16
    ],
)
@pytest.mark.parametrize("with_keep", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_scores_match_reference(t, heads, di, n, block, with_keep, q_dtype):
    """bf16 queries (the engine's) multiply in bf16 on a GPU: exact, since fake-quantised
    queries and decoded keys hold three significant bits."""
    qi, w, data, scales, rows, visible, keep = _case(t, heads, di, n, t * 1000 + n, block)
    qi = qi.to(q_dtype)
    kw = dict(weight_scale=heads**-0.5, keep_blocks=keep if with_keep else None, block=block)
    want = v41_index_scores_ref(
        qi, w, data, scales, rows.clamp(max=data.shape[0] - 1), visible, **kw
    )
    dev = [x.to(DEVICE) for x in (qi, w, data, scales, rows, visible)]
    if with_keep:
        kw["keep_blocks"] = keep.to(DEVICE)
    got = v41_index_scores(*dev, **kw).cpu()
    masked = torch.isinf(want)
    assert torch.equal(torch.isinf(got), masked)  # the masks are exact
    assert (~masked).any() and (masked.any() or t * n == 1)
    torch.testing.assert_close(got[~masked], want[~masked], rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize(("t", "n", "block"), [(1, 1, 1), (4, 37, 4), (3, 130, 8), (2, 2049, 8)])
def test_candidate_block_max_is_exact(t, n, block):
    g = torch.Generator().manual_seed(n)
    visible = torch.randint(0, n + 1, (t,), generator=g)
    visible[0] = 0  # a row that sees nothing pins nothing
    scores = torch.randn(t, n, generator=g)
    scores[torch.arange(n)[None, :] >= visible[:, None]] = float("-inf")
    want = candidate_block_max_ref(scores, visible, block)
    got = candidate_block_max(scores.to(DEVICE), visible.to(DEVICE), block).cpu()
    assert torch.equal(got, want)


def test_bad_arguments_name_the_field():
    qi, w, data, scales, rows, visible, keep = _case(2, 4, 64, 10, 1, 4)
    with pytest.raises(ValueError, match="key_scales"):
        v41_index_scores(qi, w, data, scales[:, :1], rows, visible, weight_scale=1.0)
    with pytest.raises(ValueError, match="keep_blocks"):
        v41_index_scores(
            qi, w, data, scales, rows, visible, weight_scale=1.0, keep_blocks=keep[:, :1], block=4
        )
    with pytest.raises(ValueError, match="visible"):
        candidate_block_max(torch.randn(2, 5), visible[:1], 2)
