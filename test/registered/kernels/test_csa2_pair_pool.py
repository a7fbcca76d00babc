"""DeepSeek-V4.1's ratio-2 compressor step at decode / verify (`csa2_pair_pool`) against its torch
reference (`csa2_pair_pool_ref`, the chain the model ran), on random batches of requests with
verify-sized row runs, prefixes of either parity (so partners come from this forward and from
the ring) and pre-filled rings.

Exact: start positions, pool rows (0 where no group closes), and the rings after the step (the
fp32 copies of every row, nothing else written). Pooled rows: within a tolerance, the kernel's
`exp` lowering differs from torch's (module doc of `pair_pool.py`); one unit in the last place
of the dtype at most, since the weights and products differ only in fp32's last bits. A
hand-derived case (equal scores: weights exactly 1/2) checks the pooling without the reference.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.compressor.pair_pool import csa2_pair_pool
from sgl_dspark.kernels.compressor.reference import csa2_pair_pool_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(rtol=2**-20, atol=2**-20),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-7),
    torch.float16: dict(rtol=2**-10, atol=2**-10),
}


def _batch(runs: list[tuple[int, int]], d: int, dtype: torch.dtype, ring: int, seed: int):
    """Requests as (prefix, rows) runs on slots 1, 2, ...: their rows' positions, slots and
    prefixes, random kv / scores, random rings and a random page table."""
    g = torch.Generator().manual_seed(seed)
    positions, slots, prefixes = [], [], []
    for r, (prefix, n) in enumerate(runs):
        positions += range(prefix, prefix + n)
        slots += [r + 1] * n
        prefixes += [prefix] * n
    t, n_slots = len(positions), len(runs) + 1
    width = max(p for p, _ in runs) + max(n for _, n in runs) + 2
    return dict(
        kv=(torch.randn(t, d, generator=g) * 2).to(dtype).to(DEVICE),
        score=(torch.randn(t, d, generator=g) * 3).to(dtype).to(DEVICE),
        ring_kv=torch.randn(n_slots, ring, d, generator=g).to(DEVICE),
        ring_score=(torch.randn(n_slots, ring, d, generator=g) * 3).to(DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        token_slot=torch.tensor(slots, device=DEVICE),
        token_prefix=torch.tensor(prefixes, device=DEVICE),
        req_to_token=torch.randint(0, 1 << 20, (n_slots, width), generator=g)
        .to(torch.int32)
        .to(DEVICE),
    )


CASES = [
    # (prefix, rows) runs, Dh
    ([(5, 1)], 512),  # one decode row; its partner (position 4) from the ring
    ([(6, 1)], 64),  # closes no group: pool row 0
    ([(7, 4), (0, 1), (12, 3)], 96),  # verify runs: partners from this forward and the ring
    ([(3, 2), (10, 2), (1, 1), (8, 4)], 40),  # Dh not a power of two
    ([(0, 3)], 32),  # position 0's partner is absent (-1): read at ring row 0, never a group
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
def test_pair_pool_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    runs, d = case
    b = _batch(runs, d, dtype, ring=8, seed=CASES.index(case))
    mine = {k: v.clone() for k, v in b.items()}
    ref = {k: v.clone() for k, v in b.items()}
    got = csa2_pair_pool(**mine)
    want = csa2_pair_pool_ref(**ref)
    assert torch.equal(got.start_positions, want.start_positions)
    assert torch.equal(got.entry_rows, want.entry_rows)
    assert got.pooled.dtype == dtype and got.pooled.shape == b["kv"].shape
    torch.testing.assert_close(got.pooled, want.pooled, **TOL[dtype])
    # The rings: every row recorded at position mod R, in fp32, nothing else touched.
    assert torch.equal(mine["ring_kv"], ref["ring_kv"])
    assert torch.equal(mine["ring_score"], ref["ring_score"])
    rows = b["positions"] % 8
    assert torch.equal(mine["ring_kv"][b["token_slot"], rows], b["kv"].float())
    assert not torch.equal(mine["ring_kv"], b["ring_kv"])


def test_equal_scores_average_the_pair() -> None:
    """Equal gate scores weight both rows by exactly 1/2: the group of positions (4, 5) is the
    mean of row 4 (from the ring) and row 5 (this forward), and (6, 7) of rows 6 and 7 (both
    this forward); pool rows are req_to_token[slot, start] // 2."""
    d = 48
    b = _batch([(5, 3)], d, torch.float32, ring=8, seed=3)
    b["score"] = torch.full_like(b["score"], 0.75)
    b["ring_score"][1, 4] = 0.75
    ring_row_4 = b["ring_kv"][1, 4].clone()
    kv = b["kv"].clone()
    got = csa2_pair_pool(**b)
    assert torch.equal(got.pooled[0], ring_row_4 * 0.5 + kv[0] * 0.5)
    assert torch.equal(got.pooled[2], kv[1] * 0.5 + kv[2] * 0.5)
    table = b["req_to_token"][1].long()
    assert got.entry_rows.tolist() == [int(table[4]) // 2, 0, int(table[6]) // 2]
    assert got.start_positions.tolist() == [4, 5, 6]


def test_bad_arguments_are_named() -> None:
    b = _batch([(3, 2)], 32, torch.bfloat16, ring=8, seed=1)
    with pytest.raises(ValueError, match="ring_kv"):
        csa2_pair_pool(**{**b, "ring_kv": b["ring_kv"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="kv / score"):
        csa2_pair_pool(**{**b, "score": b["score"][:1]})
    with pytest.raises(ValueError, match="token_prefix"):
        csa2_pair_pool(**{**b, "token_prefix": b["token_prefix"][:1]})
