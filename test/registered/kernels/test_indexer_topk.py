"""Indexer top-k selection: kernel vs index_topk_ref (bit-exact), and the reference vs a
brute-force Python selection.

Edge cases: visible 0 / negative / N / > N, k > N and k > visible, many exact ties at the
threshold (lower index wins), -inf candidates that must fill k by index, large finite garbage
beyond visible that must be ignored, signed zeros (equal scores), several chunks per row with
the threshold bucket straddling chunk boundaries."""

from __future__ import annotations

import importlib

import pytest
import torch
from sgl_dspark.kernels.compressor.reference import entry_pool_rows_ref
from sgl_dspark.kernels.indexer.reference import index_topk_ref
from sgl_dspark.kernels.indexer.topk import index_topk

# The module itself (the package re-exports the launcher under the same name).
topk_module = importlib.import_module("sgl_dspark.kernels.indexer.topk")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ("randn", "ties", "neginf", "zeros")


def _scores(rows: int, width: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "ties":
        # Few distinct values: the threshold value is shared by many entries.
        return torch.randint(-2, 3, (rows, width), generator=gen).float() * 0.5
    x = torch.randn(rows, width, generator=gen) * 3
    if mode == "neginf":
        x[torch.rand(rows, width, generator=gen) < 0.6] = float("-inf")
        if rows > 1:
            x[1] = float("-inf")  # a row of -inf candidates only: selection by index
    if mode == "zeros":
        choice = torch.randint(0, 4, (rows, width), generator=gen)
        values = torch.tensor([-0.0, 0.0, 1.5, -1.5])
        x = values[choice]
    return x


def _visible(rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    vis = torch.randint(0, width + 1, (rows,), generator=gen)
    special = [0, width, width + 7, -3]
    for r in range(min(rows, len(special))):
        vis[r] = special[(r + rows) % len(special)]
    return vis


def _with_garbage(
    scores: torch.Tensor, visible: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """Large finite values past each row's visible count: selected only if the mask is wrong."""
    rows, width = scores.shape
    beyond = torch.arange(width)[None, :] >= visible.clamp(0, width)[:, None]
    garbage = 1e30 * (1 + torch.rand(rows, width, generator=gen))
    return torch.where(beyond, garbage, scores)


def _brute_force(
    scores: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = scores.shape
    ids = torch.zeros(rows, k, dtype=torch.int64)
    valid = torch.zeros(rows, k, dtype=torch.bool)
    for r in range(rows):
        row = scores[r].tolist()
        n = min(max(int(visible[r]), 0), width)
        # Python compares -0.0 == 0.0, so signed zeros tie and the index decides.
        chosen = sorted(sorted(range(n), key=lambda i: (-row[i], i))[:k])
        ids[r, : len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
        valid[r, : len(chosen)] = True
    return ids, valid


def _run_kernel(
    scores: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = scores.shape[0]
    out_ids = torch.full((rows, k), -12345, dtype=torch.int64, device=DEVICE)
    # Poison: True everywhere, so a slot the kernel forgets to clear shows up as valid.
    out_valid = torch.ones(rows, k, dtype=torch.bool, device=DEVICE)
    ids, valid = index_topk(
        scores.to(DEVICE), visible.to(DEVICE), k, out_ids=out_ids, out_valid=out_valid
    )
    assert ids.data_ptr() == out_ids.data_ptr() and valid.data_ptr() == out_valid.data_ptr()
    return ids.cpu(), valid.cpu()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "rows,width", [(0, 64), (1, 1), (3, 5), (17, 64), (3, 100), (17, 257), (3, 1500), (1, 1500)]
)
@pytest.mark.parametrize("k", [1, 4, 64])
def test_kernel_matches_reference(rows: int, width: int, k: int, mode: str) -> None:
    gen = torch.Generator().manual_seed(rows * 100003 + width * 101 + k + 7 * MODES.index(mode))
    visible = _visible(rows, width, gen)
    scores = _with_garbage(_scores(rows, width, mode, gen), visible, gen)
    want_ids, want_valid = index_topk_ref(scores, visible, k)
    got_ids, got_valid = _run_kernel(scores, visible, k)
    assert torch.equal(got_valid, want_valid)
    assert torch.equal(got_ids, want_ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_n", [32, 64])
def test_many_chunks_per_row(monkeypatch: pytest.MonkeyPatch, block_n: int, mode: str) -> None:
    """Small chunks: the histogram passes and the in-order compaction span many chunks, and the
    tied threshold entries straddle chunk boundaries."""
    real = topk_module._block_sizes
    monkeypatch.setattr(
        topk_module, "_block_sizes", lambda width, k: (block_n, *real(width, k)[1:])
    )
    gen = torch.Generator().manual_seed(block_n + 31 * MODES.index(mode))
    rows, width = 5, 300
    visible = _visible(rows, width, gen)
    scores = _with_garbage(_scores(rows, width, mode, gen), visible, gen)
    for k in (3, 40, 299):
        want = index_topk_ref(scores, visible, k)
        got = _run_kernel(scores, visible, k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), k


@pytest.mark.parametrize("mode", ["randn", "ties"])
def test_flash_width_and_k512(mode: str) -> None:
    """DeepSeek-V4-Flash row width (64K context / 4) and index_topk 512: several 4096 chunks."""
    gen = torch.Generator().manual_seed(16384 + MODES.index(mode))
    rows, width, k = 2, 16384, 512
    visible = torch.tensor([width, 9001])
    scores = _with_garbage(_scores(rows, width, mode, gen), visible, gen)
    want = index_topk_ref(scores, visible, k)
    got = _run_kernel(scores, visible, k)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_row_stride_and_int32_visible() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 80, generator=gen)
    scores = base[:, 10:70]  # row stride 80, unit column stride
    visible = torch.randint(0, 61, (6,), generator=gen).to(torch.int32)
    want = index_topk_ref(scores, visible, 8)
    got = index_topk(scores.to(DEVICE), visible.to(DEVICE), 8)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_close_values_need_all_radix_passes() -> None:
    """Scores one ulp apart: the k-th key is only resolved by the last 8-bit pass."""
    rows, width, k = 3, 200, 37
    gen = torch.Generator().manual_seed(11)
    bits = torch.tensor(1.0).view(torch.int32) + torch.randint(0, 40, (rows, width), generator=gen)
    scores = bits.to(torch.int32).view(torch.float32)
    visible = torch.tensor([width, 150, 90])
    want = index_topk_ref(scores, visible, k)
    got = _run_kernel(scores, visible, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("mode", MODES)
def test_reference_matches_brute_force(mode: str) -> None:
    gen = torch.Generator().manual_seed(77 + MODES.index(mode))
    for rows, width, k in [(4, 1, 1), (4, 5, 3), (6, 12, 5), (5, 9, 20), (7, 40, 8), (3, 0, 2)]:
        visible = _visible(rows, width, gen)
        scores = _with_garbage(_scores(rows, width, mode, gen), visible, gen)
        want = _brute_force(scores, visible, k)
        got = index_topk_ref(scores, visible, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, width, k)


def test_hand_derived_case() -> None:
    # Row 0: best 3 of [5, 7, 7, -inf, 7, 1] by (score desc, index asc) = {1, 2, 4}.
    # Row 1: 2 candidates (visible 2) of which one is -inf: both selected, slot 2 invalid.
    # Row 2: visible 0: nothing selected.
    inf = float("inf")
    scores = torch.tensor(
        [
            [5.0, 7.0, 7.0, -inf, 7.0, 1.0],
            [-inf, 2.0, 9.0, 9.0, 9.0, 9.0],
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        ]
    )
    visible = torch.tensor([6, 2, 0])
    ids = torch.tensor([[1, 2, 4], [0, 1, 0], [0, 0, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    for got in (index_topk_ref(scores, visible, 3), _run_kernel(scores, visible, 3)):
        assert torch.equal(got[0], ids) and torch.equal(got[1], valid)


def test_allocates_outputs_and_empty_batch() -> None:
    scores = torch.randn(2, 10, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids, valid = index_topk(scores, torch.tensor([10, 4], device=DEVICE), 4)
    assert ids.dtype == torch.int64 and valid.dtype == torch.bool and ids.shape == (2, 4)
    want = index_topk_ref(scores.cpu(), torch.tensor([10, 4]), 4)
    assert torch.equal(ids.cpu(), want[0]) and torch.equal(valid.cpu(), want[1])
    empty_ids, empty_valid = index_topk(
        scores[:0], torch.zeros(0, dtype=torch.int64, device=DEVICE), 4
    )
    assert empty_ids.shape == (0, 4) and empty_valid.shape == (0, 4)


def _entry_table(
    rows: int, width: int, ratio: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request-to-token table whose block starts are distinct multiples of `ratio` (random
    pages, as the allocator hands them out), narrower than `width * ratio` so that the
    clamp to its last column is exercised, and a random request row per token."""
    req_slots, cols = 5, max(1, (width * ratio) // 2 + 3)
    table = torch.randperm(req_slots * cols * 4, generator=gen)[: req_slots * cols] * ratio
    table = table.view(req_slots, cols) + torch.randint(0, ratio, (req_slots, cols), generator=gen)
    token_slot = torch.randint(0, req_slots, (rows,), generator=gen)
    return table, token_slot


@pytest.mark.parametrize("mode", ["randn", "ties"])
@pytest.mark.parametrize(
    "rows,width,k,ratio",
    [(1, 1, 1, 4), (3, 100, 4, 4), (17, 257, 64, 4), (5, 40, 8, 128), (3, 1500, 64, 1)],
)
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_entry_rows_match_reference(
    rows: int, width: int, k: int, ratio: int, mode: str, table_dtype: torch.dtype
) -> None:
    """With `entry_rows` the kernel writes the selected entries' pool rows (what the attention
    reads), the same as the reference's ids mapped through the table; invalid slots hold 0."""
    gen = torch.Generator().manual_seed(rows * 31 + width + k + ratio)
    visible = _visible(rows, width, gen)
    scores = _with_garbage(_scores(rows, width, mode, gen), visible, gen)
    table, token_slot = _entry_table(rows, width, ratio, gen)
    want_ids, want_valid = index_topk_ref(scores, visible, k)
    want_rows, want_valid2 = index_topk_ref(scores, visible, k, (table, token_slot, ratio))
    assert torch.equal(want_valid, want_valid2)
    mapped = torch.where(want_valid, entry_pool_rows_ref(want_ids, table, token_slot, ratio), 0)
    assert torch.equal(want_rows, mapped)
    out_ids = torch.full((rows, k), -12345, dtype=torch.int64, device=DEVICE)
    got_rows, got_valid = index_topk(
        scores.to(DEVICE),
        visible.to(DEVICE),
        k,
        out_ids=out_ids,
        entry_rows=(table.to(table_dtype).to(DEVICE), token_slot.to(DEVICE), ratio),
    )
    assert torch.equal(got_valid.cpu(), want_valid)
    assert torch.equal(got_rows.cpu(), want_rows)
    if rows and bool(want_valid.any()):
        assert not torch.equal(want_rows[want_valid], want_ids[want_valid])


def test_entry_pool_rows_ref_by_hand() -> None:
    table = torch.tensor([[0, 1, 2, 3, 40, 41, 42, 43, 8, 9], [12, 13, 14, 15, 4, 5, 6, 7, 36, 37]])
    token_slot = torch.tensor([1, 0])
    ids = torch.tensor([[0, 1, 2], [2, 1, 0]])
    # Entry n starts at column 4n of the request's row.
    want = torch.tensor([[12 // 4, 4 // 4, 36 // 4], [8 // 4, 40 // 4, 0]])
    assert torch.equal(entry_pool_rows_ref(ids, table, token_slot, 4), want)
    # Past the table's last column: the last column is read (those entries are masked later).
    assert torch.equal(
        entry_pool_rows_ref(torch.tensor([[3]]), table, torch.tensor([0]), 4),
        torch.tensor([[9 // 4]]),
    )


def test_bad_inputs_raise() -> None:
    scores = torch.randn(3, 8, device=DEVICE)
    visible = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match="scores"):
        index_topk(scores.half(), visible, 2)
    with pytest.raises(ValueError, match="scores"):
        index_topk(scores[0], visible, 2)
    with pytest.raises(ValueError, match="visible"):
        index_topk(scores, visible.float(), 2)
    with pytest.raises(ValueError, match="visible"):
        index_topk(scores, visible[:2], 2)
    with pytest.raises(ValueError, match="k"):
        index_topk(scores, visible, 0)
    with pytest.raises(ValueError, match="column stride"):
        index_topk(scores.t().contiguous().t(), visible, 2)
    with pytest.raises(ValueError, match="out_ids"):
        index_topk(scores, visible, 2, out_ids=torch.empty(3, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="out_valid"):
        index_topk(
            scores, visible, 2, out_valid=torch.empty(3, 2, dtype=torch.uint8, device=DEVICE)
        )
    table = torch.zeros(2, 16, dtype=torch.int64, device=DEVICE)
    slot = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="req_to_token"):
        index_topk(scores, visible, 2, entry_rows=(table.float(), slot, 4))
    with pytest.raises(ValueError, match="token_slot"):
        index_topk(scores, visible, 2, entry_rows=(table, slot[:2], 4))
    with pytest.raises(ValueError, match="ratio"):
        index_topk(scores, visible, 2, entry_rows=(table, slot, 0))
