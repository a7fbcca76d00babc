"""The KV pool's compressed-entry addressing (`srt/mem_cache/kv_pool.py`), one definition for
the kernels that read entries through the request table (indexer scoring, index top-k, the
attention's dense entries).

Entry n of a request covers positions [n·m, (n + 1)·m) and lives at pool row
``req_to_token[request, n·m] // m`` (pages are multiples of m, so a block start's token slot is
a multiple of m). The column is clamped to the table's last one, so entries past the table stay
in bounds; their rows are garbage that the callers mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def entry_pool_rows_ref(
    ids: torch.Tensor, req_to_token: torch.Tensor, token_slot: torch.Tensor, ratio: int
) -> torch.Tensor:
    """int64 ``[T, N]`` pool rows of compressed entries ``ids`` ``[T, N]`` (or ``[1, N]``,
    broadcast) of each row's request (``token_slot`` ``[T]``: its row of ``req_to_token``)."""
    cols = (ids * ratio).clamp(max=req_to_token.shape[1] - 1)
    return req_to_token[token_slot[:, None], cols].long() // ratio


@triton.jit
def load_entry_rows(table_row, entry, ratio, table_width, mask):
    """Pool rows (int64) of entries ``entry`` of the request whose table row starts at
    ``table_row``; 0 where ``mask`` is false (nothing is loaded there)."""
    col = tl.minimum(entry.to(tl.int64) * ratio, table_width - 1)
    return tl.load(table_row + col, mask=mask, other=0).to(tl.int64) // ratio
