"""The KV pool's compressed-entry addressing in Triton (`entry_pool_rows_ref` is the spec), one
definition for the kernels that read entries through the request table: indexer scoring, the
index top-k and the attention's dense entries."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_entry_rows(table_row, entry, ratio, table_width, mask):
    """Pool rows (int64) of entries ``entry`` of the request whose table row starts at
    ``table_row``; 0 where ``mask`` is false (nothing is loaded there)."""
    col = tl.minimum(entry.to(tl.int64) * ratio, table_width - 1)
    return tl.load(table_row + col, mask=mask, other=0).to(tl.int64) // ratio
