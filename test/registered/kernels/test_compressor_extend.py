"""Prefill (extend) step of the compressors: `compressor_extend` (two launches over row lists)
against its reference, and the host-built row lists of `ForwardBatch` against device masks.

Chunks are longer than the state ring (rows of one request would collide there) and start after
a prefix whose last ring rows hold earlier chunks (NaN elsewhere, so a stale read would show).
Exactness as `compressor_decode` (entries within a tolerance, see test_compressor_pool.py), ring
rows bit exact.
"""

from __future__ import annotations

import pytest
import torch
from sgl_dspark.kernels.compressor.extend import compressor_extend
from sgl_dspark.kernels.compressor.reference import compressor_extend_ref
from sgl_dspark.srt.core.forward_batch import ForwardBatch, ForwardMode
from test_compressor_pool import DEVICE, _inputs, _rope_rows, _same_bits

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

CASES = [
    # (prefix_lens, extends, head_dim, ratio, overlap)
    ([0], [37], 24, 4, True),  # a fresh prompt: block 0 has no Ca half
    ([12, 0, 40], [29, 9, 50], 32, 4, True),  # later chunks read the ring of earlier ones
    ([0, 130], [300, 77], 16, 128, False),  # HCA: few block ends, long chunks
    ([5, 3, 9], [17, 2, 1], 20, 3, True),  # m not a power of two; 1-row chunk
]


def _row_lists(inputs: dict, extends: list[int], ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent of ForwardBatch: device masks over the flat rows."""
    pos, m = inputs["positions"], inputs["ratio"]
    ends = torch.nonzero((pos + 1) % m == 0).squeeze(1)
    req_end = torch.cat(
        [torch.full((n,), p + n) for p, n in zip(_prefixes(inputs, extends), extends)]
    ).to(DEVICE)
    keep = torch.nonzero(pos >= req_end - ring).squeeze(1)
    return ends.contiguous(), keep.contiguous()


def _prefixes(inputs: dict, extends: list[int]) -> list[int]:
    starts = torch.tensor([0] + extends[:-1]).cumsum(0).tolist()
    return [int(inputs["token_prefix"][s]) for s in starts]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_extend_matches_reference(index: int, dtype: torch.dtype, padded: bool) -> None:
    """padded: the kernel gets the lists padded with -1 to a static size, as a prefill graph's
    (`ForwardBatch.block_end_rows` of a `host_lens=False` batch); those entries are skipped."""
    prefix, extends, head_dim, ratio, overlap = CASES[index]
    inputs = _inputs(prefix, extends, head_dim, ratio, overlap, dtype, seed=70 + index)
    ring = inputs["state_kv"].shape[1]
    assert max(extends) > ring or ratio == 3  # the case the decode step cannot take
    ends, keep = _row_lists(inputs, extends, ring)
    cos, sin = _rope_rows(inputs["positions"] - (ratio - 1), max(1, head_dim // 4))
    n_slots = int(inputs["req_to_token"].max()) // ratio + 1
    entries0 = torch.full((n_slots, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    want = {k: inputs[k].clone() for k in ("state_kv", "state_score")}
    want_entries = entries0.clone()
    compressor_extend_ref(
        **{**inputs, **want},
        cos=cos,
        sin=sin,
        entries=want_entries,
        block_end_rows=ends,
        ring_rows=keep,
    )
    if padded:
        pad = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)
        ends, keep = torch.cat([ends, pad]), torch.cat([keep, pad[:3]])
        ref_padded = {k: inputs[k].clone() for k in ("state_kv", "state_score")}
        ref_entries = entries0.clone()
        compressor_extend_ref(
            **{**inputs, **ref_padded},
            cos=cos,
            sin=sin,
            entries=ref_entries,
            block_end_rows=ends,
            ring_rows=keep,
        )
        assert _same_bits(ref_entries, want_entries)
        assert all(_same_bits(ref_padded[k], want[k]) for k in want)
    got = {k: inputs[k].clone() for k in ("state_kv", "state_score")}
    got_entries = entries0.clone()
    compressor_extend(
        **{**inputs, **got},
        cos=cos,
        sin=sin,
        entries=got_entries,
        block_end_rows=ends,
        ring_rows=keep,
    )
    for k in got:
        assert _same_bits(got[k], want[k]), k
        # the ring now holds exactly the last R rows of each request (and the untouched rest)
        assert not torch.equal(got[k].nan_to_num(), inputs[k].nan_to_num())
    written = ~torch.isnan(want_entries).any(dim=1)
    assert int(written.sum()) == int((ends >= 0).sum()) > 0
    assert torch.equal(written, ~torch.isnan(got_entries).any(dim=1))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(
        got_entries[written].float(), want_entries[written].float(), rtol=tol, atol=tol
    )


def test_extend_rejects_bad_row_lists() -> None:
    inputs = _inputs([0], [9], 16, 4, True, torch.float32, seed=3)
    cos, sin = _rope_rows(inputs["positions"], 4)
    entries = torch.zeros(64, 16, device=DEVICE)
    rows = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="block_end_rows"):
        compressor_extend(
            **inputs, cos=cos, sin=sin, entries=entries, block_end_rows=rows.int(), ring_rows=rows
        )
    with pytest.raises(ValueError, match="ring_rows"):
        compressor_extend(
            **inputs, cos=cos, sin=sin, entries=entries, block_end_rows=rows, ring_rows=rows[::2]
        )


@pytest.mark.parametrize(
    "prefix,extends", [([0, 7, 31], [13, 1, 40]), ([3], [2]), ([8, 0], [8, 4])]
)
@pytest.mark.parametrize("ratio", [1, 3, 4, 128])
def test_forward_batch_row_lists_match_masks(prefix, extends, ratio) -> None:
    table = torch.zeros(len(prefix) + 1, 256, dtype=torch.int64)
    batch = ForwardBatch.build(
        ForwardMode.EXTEND,
        [[1] * n for n in extends],
        prefix,
        list(range(1, len(prefix) + 1)),
        table,
    )
    pos = batch.positions
    seq_end = batch.seq_lens[batch.token_req]
    assert torch.equal(batch.block_end_rows(ratio), torch.nonzero((pos + 1) % ratio == 0)[:, 0])
    for count in (1, 5, 16):
        assert torch.equal(batch.last_rows(count), torch.nonzero(pos >= seq_end - count)[:, 0])
