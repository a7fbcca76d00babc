"""One-launch draft inputs + verify-window plan (`prepare_draft_inputs`) vs its reference and a
Python-loop oracle."""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.spec.draft_inputs import prepare_draft_inputs
from sgl_dspark.kernels.spec.reference import DraftInputs, prepare_draft_inputs_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK_ID, PAD_POS, PAD_SLOT = 128000, 3, 7


def _oracle_slot(table: torch.Tensor, valid: bool, seq: int, pool: int, j: int) -> int:
    pool_rows, table_width = table.shape
    ok = valid and 0 <= seq + j < table_width and 0 <= pool < pool_rows
    return int(table[pool, seq + j]) if ok else PAD_SLOT


def _oracle(anchors, seqs, pools, table, n_valid, q, w) -> DraftInputs:
    ids, dpos, dslot, vpos, vslot = [], [], [], [], []
    for r in range(len(anchors)):
        valid = r < n_valid
        pos = [int(seqs[r]) + j if valid else PAD_POS for j in range(max(q, w))]
        slots = [
            _oracle_slot(table, valid, int(seqs[r]), int(pools[r]), j) for j in range(max(q, w))
        ]
        ids.append([int(anchors[r]) if valid else MASK_ID] + [MASK_ID] * (q - 1))
        dpos.append(pos[:q])
        vpos.append(pos[:w])
        dslot.append(slots[:q])
        vslot.append(slots[:w])
    return DraftInputs(
        *(
            torch.tensor(x, dtype=torch.long).reshape(len(anchors), width)
            for x, width in zip((ids, dpos, dslot, vpos, vslot), (q, q, q, w, w))
        )
    )


def _inputs(rows: int, gen: torch.Generator, idx_dtype: torch.dtype):
    pool_rows, table_width = rows + 3, 64
    table = torch.randperm(pool_rows * table_width, generator=gen).add(100)
    table = table.reshape(pool_rows, table_width).to(torch.int32)
    anchors = torch.randint(1, 120000, (rows,), generator=gen)
    seqs = torch.randint(0, table_width - 8, (rows,), generator=gen)
    pools = torch.randperm(pool_rows, generator=gen)[:rows]
    if rows > 2:
        seqs[1] = table_width - 2  # window runs past the table: pad slots
        pools[2] = pool_rows + 5  # pool row out of range: pad slots
    return anchors.to(idx_dtype), seqs.to(idx_dtype), pools.to(idx_dtype), table


@pytest.mark.parametrize("rows", [0, 1, 4, 24, 37])
@pytest.mark.parametrize("draft_len,verify_width", [(5, 6), (6, 6), (1, 1), (3, 2), (7, 8)])
@pytest.mark.parametrize("pad_rows", [0, 3, "all"])
def test_matches_reference_and_oracle(rows, draft_len, verify_width, pad_rows) -> None:
    idx_dtype = torch.int64 if draft_len % 2 else torch.int32
    gen = torch.Generator().manual_seed(rows * 100 + draft_len * 10 + verify_width)
    anchors, seqs, pools, table = _inputs(rows, gen, idx_dtype)
    n_valid_int = 0 if pad_rows == "all" else max(rows - pad_rows, 0)
    n_valid = torch.tensor(n_valid_int, dtype=torch.int32)
    kwargs = dict(
        draft_len=draft_len,
        verify_width=verify_width,
        mask_token_id=MASK_ID,
        pad_position=PAD_POS,
        pad_slot=PAD_SLOT,
    )
    want = prepare_draft_inputs_ref(anchors, seqs, pools, table, n_valid, **kwargs)
    oracle = _oracle(
        anchors.tolist(), seqs.tolist(), pools.tolist(), table, n_valid_int, draft_len, verify_width
    )
    for name, w, o in zip(DraftInputs._fields, want, oracle):
        assert torch.equal(w, o), name
    out = DraftInputs(*(torch.full_like(t, -999, device=DEVICE) for t in want))
    dev = [t.to(DEVICE) for t in (anchors, seqs, pools, table)]
    got = prepare_draft_inputs(*dev, n_valid.to(DEVICE).reshape(1), out=out, **kwargs)
    for name, g, o, w in zip(DraftInputs._fields, got, out, want):
        assert g.data_ptr() == o.data_ptr(), name
        assert torch.equal(g.cpu(), w), name


def test_allocates_outputs_and_accepts_strided_table() -> None:
    gen = torch.Generator().manual_seed(9)
    anchors, seqs, pools, table = _inputs(11, gen, torch.int64)
    wide = torch.zeros(table.shape[0], table.shape[1] + 17, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = wide[:, : table.shape[1]]  # row stride > width, like a view into a larger pool
    n_valid = torch.tensor([9], dtype=torch.int64)
    kwargs = dict(
        draft_len=5, verify_width=6, mask_token_id=MASK_ID, pad_position=PAD_POS, pad_slot=PAD_SLOT
    )
    want = prepare_draft_inputs_ref(anchors, seqs, pools, table, n_valid, **kwargs)
    got = prepare_draft_inputs(
        *(t.to(DEVICE) for t in (anchors, seqs, pools, strided, n_valid)), **kwargs
    )
    for name, g, w in zip(DraftInputs._fields, got, want):
        assert torch.equal(g.cpu(), w), name


def test_bad_arguments_raise() -> None:
    x = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    n_valid = torch.tensor(4, device=DEVICE)
    kwargs = dict(draft_len=2, verify_width=3, mask_token_id=1)
    with pytest.raises(ValueError, match="seq_lens"):
        prepare_draft_inputs(x, x[:3], x, table, n_valid, **kwargs)
    with pytest.raises(ValueError, match="req_to_token"):
        prepare_draft_inputs(x, x, x, table.t(), n_valid, **kwargs)
    with pytest.raises(ValueError, match="n_valid"):
        prepare_draft_inputs(x, x, x, table, x, **kwargs)
    with pytest.raises(ValueError, match="draft_len"):
        prepare_draft_inputs(x, x, x, table, n_valid, draft_len=0, verify_width=3, mask_token_id=1)
