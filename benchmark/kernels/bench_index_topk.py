"""Benchmark cases for the lightning-indexer top-k selection (`sgl_dspark.kernels.indexer.topk`).

``CASES`` has the format of `bench_spec.py` (name, make_inputs(M, device), reference, launcher,
check, bytes_moved(M)); M = T query rows. Shapes:
  * DeepSeek-V4-Flash: 64K context / CSA ratio 4 -> N = 16384 entries per row, index_topk 512;
    each row sees a random visible count in [N/2, N].
  * the 910M mid model: N = 160, k = 64; visible in [N/2, N].
Entries past a row's visible count hold -inf, as the indexer logits do, so the runtime path
below (``torch.topk`` + compare + ``where``) picks exactly the top-k candidates. The reference
is that runtime path; its ids come in score order and ours ascending, so the check compares the
selected sets (equal to ``index_topk_ref``'s: continuous random scores have no ties).
"""

from __future__ import annotations

from typing import Any

import torch
from sgl_dspark.kernels.indexer.topk import index_topk

_INT64_MAX = torch.iinfo(torch.int64).max


def _runtime_topk(
    scores: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The path the runtime uses today: topk, mask ids past the visible count, zero them."""
    top = scores.topk(k, dim=-1).indices
    valid = top < visible[:, None]
    return torch.where(valid, top, torch.zeros_like(top)), valid


def _make_inputs(m: int, device: str, width: int, k: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4242 + 7 * m + width)
    visible = torch.randint(width // 2, width + 1, (m,), generator=gen)
    scores = torch.randn(m, width, generator=gen)
    scores[torch.arange(width)[None, :] >= visible[:, None]] = float("-inf")
    return {"scores": scores.to(device), "visible": visible.to(device), "k": k}


def _same_selection(
    want: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]
) -> None:
    # Exact: the selected id sets must match; slot order differs (score order vs ascending).
    def selected(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, valid = out
        return torch.sort(torch.where(valid, ids, torch.full_like(ids, _INT64_MAX)), dim=1).values

    assert torch.equal(want[1].sum(1), got[1].sum(1)), "selected counts differ"
    assert torch.equal(selected(want), selected(got)), "selected id sets differ"
    assert torch.equal(got[0], torch.where(got[1], got[0], torch.zeros_like(got[0]))), (
        "invalid slots must hold id 0"
    )


def _bytes(m: int, width: int, k: int) -> int:
    # Scores read once + visible counts + ids (int64) and valid (bool) written.
    return m * (width * 4 + 8 + k * (8 + 1))


def _case(name: str, width: int, k: int) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=lambda m, device: _make_inputs(m, device, width, k),
        reference=_runtime_topk,
        launcher=index_topk,
        check=_same_selection,
        bytes_moved=lambda m: _bytes(m, width, k),
    )


CASES: list[dict[str, Any]] = [
    _case("index_topk_n16384_k512", 16384, 512),
    _case("index_topk_n160_k64_910m", 160, 64),
]
