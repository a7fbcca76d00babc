"""Benchmark cases for the lightning-indexer logits (variable context) and the compressors'
decode-time block pooling (`sgl_dspark.kernels.indexer.logits`, `sgl_dspark.kernels.compressor.pool`).

``CASES`` has the format of `bench_spec.py` (name, make_inputs(M, device), reference, launcher,
check, bytes_moved(M)). M = bs * w token rows, mapped to (bs, w) as in the shape sheet
(`bench_spec._BS_W`). DeepSeek-V4-Flash shapes:
  * indexer: 64 index heads x 128 dims, m = 4, context capacity 8192 tokens -> n_max = 2048
    columns (the static graph width); each request's real context is drawn from 256..8192
    tokens, so the visible entries per row vary (the varctx schedule skips the rest). bf16.
  * pooling: head_dim 512 (the projections from H = 4096 run before the kernel and are not
    part of it); CSA m = 4 with overlap (rows of 2*512) and HCA m = 128 (rows of 512). Every
    request's last row ends a block (one entry per request per step, the most a w <= m step
    emits), the other rows are candidates that write the dummy entry. bf16 rows, fp32 bias.
  * decode step (`compressor_decode`, the engine's call: pooling + RoPE + entry store + ring
    store in one launch) at the HCA shapes, in a step where every request's last row ends a
    block and in a "steady" step one position earlier, where no row does (127 of 128 steps of
    an HCA layer): its reference is the same chain with the block-end writes masked instead
    of selected, so it needs no host sync and can be graph-captured.
The top-k that follows the indexer stays `torch.topk` and is not part of these cases.
"""

from __future__ import annotations

from typing import Any

import torch
from sgl_dspark.kernels.compressor.decode import compressor_decode
from sgl_dspark.kernels.compressor.pool import compressor_pool
from sgl_dspark.kernels.compressor.reference import compressor_pool_ref
from sgl_dspark.kernels.indexer.logits import indexer_logits
from sgl_dspark.kernels.indexer.reference import indexer_logits_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref

INDEX_HEADS, INDEX_DIM, CSA_RATIO = 64, 128, 4
CONTEXT = 8192
N_MAX = CONTEXT // CSA_RATIO  # 2048
HEAD_DIM, HCA_RATIO = 512, 128
MAX_VERIFY = 16  # ring rows beyond the span, as DeepseekV4KVPool sizes them
ROPE_DIM = 64
PAGE = 128  # a multiple of both compress ratios
M_VALUES = (1, 4, 8, 24, 32, 128)
_BS_W = {1: (1, 1), 4: (1, 4), 8: (1, 8), 24: (8, 3), 32: (8, 4), 128: (32, 4)}


def _bs_w(m: int) -> tuple[int, int]:
    return _BS_W.get(m, (max(m // 4, 1), 4))


def _gen(m: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(9000 + 100 * salt + m)


def _seq_lens(m: int, multiple: int, salt: int) -> torch.Tensor:
    """Per-request sequence lengths (deterministic in M, shared by inputs and byte counts)."""
    bs, w = _bs_w(m)
    lens = torch.randint(256, CONTEXT, (bs,), generator=_gen(m, salt))
    return (lens // multiple * multiple).clamp(min=max(multiple, w))


def _page_table(seq_lens: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Request slots 1..bs over pages drawn at random (page 0: the dummy page of slot 0)."""
    bs = seq_lens.shape[0]
    pages_per_req = CONTEXT // PAGE
    num_pages = bs * pages_per_req + 1
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).view(bs, pages_per_req)
    table = (torch.arange(CONTEXT) % PAGE).repeat(bs + 1, 1)
    table[1:] = (pages[:, :, None] * PAGE + torch.arange(PAGE)).reshape(bs, CONTEXT)
    return table, num_pages * PAGE


def _rows(seq_lens: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, request slots and per-row prefix of the last w tokens of every request."""
    bs, w = _bs_w(m)
    positions = (seq_lens[:, None] - w + torch.arange(w)[None, :]).reshape(-1)[:m]
    token_slot = (torch.arange(bs)[:, None] + 1).expand(bs, w).reshape(-1)[:m]
    prefix = (seq_lens - w)[:, None].expand(bs, w).reshape(-1)[:m]
    return positions.contiguous(), token_slot.contiguous(), prefix.contiguous()


# ----------------------------------------------------------------------------- indexer logits


def _indexer_inputs(m: int, device: str) -> dict[str, Any]:
    gen = _gen(m, 1)
    seq_lens = _seq_lens(m, 1, salt=1)
    table, num_slots = _page_table(seq_lens, gen)
    positions, token_slot, _ = _rows(seq_lens, m)
    tokens = positions.shape[0]
    tensors = dict(
        qi=torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen).to(torch.bfloat16),
        weights=torch.randn(tokens, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5,
        index_keys=torch.randn(num_slots // CSA_RATIO, INDEX_DIM, generator=gen).to(torch.bfloat16),
        positions=positions,
        token_slot=token_slot,
        req_to_token=table,
    )
    return {**{k: v.to(device) for k, v in tensors.items()}, "ratio": CSA_RATIO, "n_max": N_MAX}


def _indexer_check(want: torch.Tensor, got: torch.Tensor) -> None:
    # A tolerance: fp32 accumulation of exact bf16 products in another order.
    hidden = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), hidden), "-inf pattern differs"
    scale = want[~hidden].abs().max().item()
    torch.testing.assert_close(got[~hidden], want[~hidden], rtol=1e-4, atol=1e-5 * scale)


def _indexer_bytes(m: int) -> int:
    positions, _, _ = _rows(_seq_lens(m, 1, salt=1), m)
    visible = int(((positions + 1) // CSA_RATIO).sum())
    per_token = INDEX_HEADS * INDEX_DIM * 2 + INDEX_HEADS * 4 + N_MAX * 4 + 2 * 8
    return m * per_token + visible * (INDEX_DIM * 2 + 8)  # keys + their page-table entries


# ----------------------------------------------------------------------------- block pooling


def _pool_inputs(
    m: int, device: str, ratio: int, overlap: bool, head_dim: int = HEAD_DIM
) -> dict[str, Any]:
    salt = 2 if overlap else 3
    gen = _gen(m, salt)
    seq_lens = _seq_lens(m, ratio, salt=salt)
    table, _ = _page_table(seq_lens, gen)
    positions, token_slot, prefix = _rows(seq_lens, m)
    width = 2 * head_dim if overlap else head_dim
    span = 2 * ratio if overlap else ratio
    ring = 1 << (span + MAX_VERIFY - 1).bit_length()
    req_slots = seq_lens.shape[0] + 1
    tokens = positions.shape[0]
    tensors = dict(
        kv=torch.randn(tokens, width, generator=gen).to(torch.bfloat16),
        score=(2 * torch.randn(tokens, width, generator=gen)).to(torch.bfloat16),
        state_kv=torch.randn(req_slots, ring, width, generator=gen).to(torch.bfloat16),
        state_score=(2 * torch.randn(req_slots, ring, width, generator=gen)).to(torch.bfloat16),
        position_bias=0.5 * torch.randn(ratio, width, generator=gen),
        norm_weight=1 + 0.1 * torch.randn(head_dim, generator=gen),
        positions=positions,
        token_slot=token_slot,
        token_prefix=prefix,
        req_to_token=table,
    )
    return {
        **{k: v.to(device) for k, v in tensors.items()},
        "ratio": ratio,
        "overlap": overlap,
        "eps": 1e-6,
    }


def _pool_check(want: Any, got: Any) -> None:
    # A tolerance: the rounding points are reproduced; exp lowering and fp32 sum order differ, so a
    # bf16 value at a rounding boundary may move by an ulp (the norm can spread it to ~2 ulps).
    assert torch.equal(want.slots, got.slots), "entry slots differ"
    torch.testing.assert_close(got.entries.float(), want.entries.float(), rtol=2**-6, atol=2**-6)


def _pool_bytes(m: int, ratio: int, overlap: bool, head_dim: int = HEAD_DIM) -> int:
    bs, _ = _bs_w(m)
    width = 2 * head_dim if overlap else head_dim
    span = 2 * ratio if overlap else ratio
    ends = min(bs, m)  # one block end per request
    rows_read = ends * span * head_dim * 2 * 2  # kv + score half-rows, bf16
    return rows_read + ratio * width * 4 + m * (head_dim * 2 + 8 + 3 * 8) + ends * 8


def _pool_case(name: str, ratio: int, overlap: bool, head_dim: int) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=lambda m, device: _pool_inputs(m, device, ratio, overlap, head_dim),
        reference=compressor_pool_ref,
        launcher=compressor_pool,
        check=_pool_check,
        bytes_moved=lambda m: _pool_bytes(m, ratio, overlap, head_dim),
    )


# ----------------------------------------------------------------------------- decode step


def _decode_inputs(m: int, device: str, head_dim: int, steady: bool) -> dict[str, Any]:
    inputs = _pool_inputs(m, device, HCA_RATIO, False, head_dim)
    if steady:  # one position earlier: no row ends a block
        inputs["positions"] = inputs["positions"] - 1
        inputs["token_prefix"] = inputs["token_prefix"] - 1
    gen = _gen(m, 4)
    angles = torch.rand(inputs["positions"].shape[0], ROPE_DIM // 2, generator=gen) * 6.3
    slots = int(inputs["req_to_token"].max()) // HCA_RATIO + 1
    extra = dict(
        cos=angles.cos(),
        sin=angles.sin(),
        entries=torch.randn(slots, head_dim, generator=gen).to(torch.bfloat16),
        counters=torch.zeros(slots, dtype=torch.int32),
    )
    return {**inputs, **{k: v.to(device) for k, v in extra.items()}}


def compressor_decode_masked_ref(counters: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:
    """`compressor_decode_ref` with the entry writes masked rather than selected (a row that
    ends no block writes its slot's own value back), so it runs without a host sync."""
    pooled, slots = compressor_pool_ref(
        *(
            kw[k]
            for k in (
                "kv",
                "score",
                "state_kv",
                "state_score",
                "position_bias",
                "norm_weight",
                "positions",
                "token_slot",
                "token_prefix",
                "req_to_token",
                "ratio",
                "overlap",
                "eps",
            )
        )
    )
    rotated = rope_tail_ref(pooled.unsqueeze(1), kw["cos"], kw["sin"]).squeeze(1)
    ends = ((kw["positions"] + 1) % kw["ratio"] == 0)[:, None]
    entries = kw["entries"]
    entries[slots] = torch.where(ends, rotated.to(entries.dtype), entries[slots])
    ring_row = kw["positions"].remainder(kw["state_kv"].shape[1])
    kw["state_kv"][kw["token_slot"], ring_row] = kw["kv"]
    kw["state_score"][kw["token_slot"], ring_row] = kw["score"]
    return entries, kw["state_kv"], kw["state_score"]


def _decode_launch(**kw: Any) -> tuple[torch.Tensor, ...]:
    compressor_decode(**kw)
    return kw["entries"], kw["state_kv"], kw["state_score"]


def _decode_check(want: Any, got: Any) -> None:
    assert want[0].data_ptr() != got[0].data_ptr(), "the check needs two entry pools"
    assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2]), "ring rows differ"
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2**-6, atol=2**-6)


def _decode_bytes(m: int, head_dim: int, steady: bool) -> int:
    ring = m * head_dim * 2 * 2 * 2  # kv + score rows read, then written to the ring
    return ring + (m * 3 * 8 if steady else _pool_bytes(m, HCA_RATIO, False, head_dim))


def _decode_case(name: str, head_dim: int, steady: bool) -> dict[str, Any]:
    return dict(
        name=name,
        make_inputs=lambda m, device: _decode_inputs(m, device, head_dim, steady),
        reference=compressor_decode_masked_ref,
        launcher=_decode_launch,
        check=_decode_check,
        bytes_moved=lambda m: _decode_bytes(m, head_dim, steady),
    )


CASES: list[dict[str, Any]] = [
    dict(
        name="indexer_logits_h64_d128_m4_nmax2048",
        make_inputs=_indexer_inputs,
        reference=indexer_logits_ref,
        launcher=indexer_logits,
        check=_indexer_check,
        bytes_moved=_indexer_bytes,
    ),
    _pool_case("compressor_pool_csa_m4_dh512", CSA_RATIO, True, HEAD_DIM),
    _pool_case("compressor_pool_hca_m128_dh512", HCA_RATIO, False, HEAD_DIM),
    # The benchmark model's (mid_910m): attention head 128, indexer head 64.
    _pool_case("compressor_pool_csa_m4_dh128", CSA_RATIO, True, 128),
    _pool_case("compressor_pool_csa_m4_dh64_indexer", CSA_RATIO, True, 64),
    _pool_case("compressor_pool_hca_m128_dh128", HCA_RATIO, False, 128),
    _decode_case("compressor_decode_hca_m128_dh512", HEAD_DIM, False),
    _decode_case("compressor_decode_hca_m128_dh512_steady", HEAD_DIM, True),
    _decode_case("compressor_decode_hca_m128_dh128", 128, False),
    _decode_case("compressor_decode_hca_m128_dh128_steady", 128, True),
]
