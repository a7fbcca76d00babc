"""Benchmark cases for DeepSeek-V4 decode/verify attention (window through the page table +
compressed entries selected by the indexer + sinks; `sgl_dspark.kernels.attention.window_sparse`).

``CASES`` has the format of `bench_spec.py` (name, make_inputs(M, device), reference, launcher,
check, bytes_moved(M)). Shapes: 16 local heads (64 at TP4), Dh = 512, window 128, 512 selected
compressed entries per token (CSA index_topk), bf16. M = bs * w token rows, mapped to (bs, w) as
in `bench_spec._BS_W`; each request has a random context of 1k-4k tokens in
64-token pages drawn at random from the pool.

The last two cases add the inverse rope of the output's rd = 64 channels: as the attention's
epilogue (one launch, what the engine runs) and as a separate `rope_tail` launch after it; the
reference is the unfused torch chain.

Two cases time the same launcher: the default (split-K chosen from the shape: at these shapes
40 key tiles of 16 keys, so 20 splits at M=1 down to 3 at M=128 on 132 SMs) and the single pass
forced with ``num_splits=1``, to show what the split buys per M.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from sgl_dspark.kernels.attention.reference import window_sparse_attention_ref
from sgl_dspark.kernels.attention.window_sparse import window_sparse_attention
from sgl_dspark.kernels.rope.reference import rope_tail_ref
from sgl_dspark.kernels.rope.tail import rope_tail

HEADS_LOCAL, HEAD_DIM, WINDOW, NUM_EXTRA, PAGE = 16, 512, 128, 512, 64
M_VALUES = (1, 4, 8, 24, 32, 128)
_BS_W = {1: (1, 1), 4: (1, 4), 8: (1, 8), 24: (8, 3), 32: (8, 4), 128: (32, 4)}


def _inputs(
    m: int,
    device: str,
    heads: int = HEADS_LOCAL,
    window_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, Any]:
    """M token rows (`_BS_W`) of `heads` query heads, the window cache stored in `window_dtype`;
    `seed` draws another set of the same shapes."""
    gen = torch.Generator().manual_seed(4321 + m + 100_000 * seed)
    bs, w = _BS_W.get(m, (max(m // 4, 1), 4))
    seq_lens = torch.randint(1024, 4096, (bs,), generator=gen)
    max_ctx = 4096
    pages_per_req = max_ctx // PAGE
    num_pages = bs * pages_per_req + 1
    page_ids = torch.randperm(num_pages, generator=gen)[: bs * pages_per_req].view(bs, -1)
    rows = (page_ids[:, :, None] * PAGE + torch.arange(PAGE)).reshape(bs, max_ctx)
    table = torch.zeros(bs + 1, max_ctx, dtype=torch.int64)  # slot 0: the padding row
    table[1:] = rows
    positions = (seq_lens[:, None] - w + torch.arange(w)[None, :]).reshape(-1)[:m]
    token_slot = (torch.arange(bs)[:, None] + 1).expand(bs, w).reshape(-1)[:m]
    tokens = positions.shape[0]
    entry_rows = num_pages * PAGE // 4
    inputs = dict(
        q=torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(torch.bfloat16),
        window_kv=torch.randn(num_pages * PAGE, HEAD_DIM, generator=gen).to(window_dtype),
        positions=positions.contiguous(),
        token_slot=token_slot.contiguous(),
        req_to_token=table,
        sinks=torch.randn(heads, generator=gen),
        # The indexer's selection, read in place from the layer's entry pool (CSA, m = 4).
        extra_kv=torch.randn(entry_rows, HEAD_DIM, generator=gen).to(torch.bfloat16),
        extra_slots=torch.randint(0, entry_rows, (tokens, NUM_EXTRA), generator=gen),
        extra_valid=torch.rand(tokens, NUM_EXTRA, generator=gen) < 0.95,
    )
    return {
        **{k: v.to(device) for k, v in inputs.items()},
        "window": WINDOW,
        "scale": HEAD_DIM**-0.5,
    }


def _check(want: torch.Tensor, got: torch.Tensor) -> None:
    # A tolerance: online softmax in fp32 vs the reference's bf16 logits/probabilities.
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def _bytes(m: int) -> int:
    # Per token: q, output, window slot ids + rows, extra rows + slot ids + mask.
    per_token = (
        2 * HEADS_LOCAL * HEAD_DIM * 2
        + WINDOW * (8 + HEAD_DIM * 2)
        + NUM_EXTRA * (HEAD_DIM * 2 + 8 + 1)
        + 8 * 2
    )
    return m * per_token + HEADS_LOCAL * 4


ROPE_DIM = 64


def _rope_inputs(m: int, device: str, **shape: Any) -> dict[str, Any]:
    """`_inputs` (its keyword arguments `shape`) with the inverse rope's cos / sin tables."""
    inputs = _inputs(m, device, **shape)
    angles = (
        torch.rand(inputs["q"].shape[0], ROPE_DIM // 2, generator=torch.Generator().manual_seed(m))
        * 7
    )
    table = torch.cat((angles.cos(), angles.sin()), dim=1).to(device)  # as RopeTable.lookup
    return {**inputs, "cos": table[:, : ROPE_DIM // 2], "sin": table[:, ROPE_DIM // 2 :]}


def _attn_rope_ref(cos, sin, **inputs) -> torch.Tensor:
    return rope_tail_ref(window_sparse_attention_ref(**inputs), cos, sin, inverse=True)


def _attn_rope_epilogue(cos, sin, **inputs) -> torch.Tensor:
    return window_sparse_attention(**inputs, inverse_rope=(cos, sin))


def _attn_then_rope(cos, sin, **inputs) -> torch.Tensor:
    return rope_tail(window_sparse_attention(**inputs), cos, sin, inverse=True)


CASES: list[dict[str, Any]] = [
    dict(
        name="attn_window128_extra512_h16_d512",
        make_inputs=_inputs,
        reference=window_sparse_attention_ref,
        launcher=window_sparse_attention,
        check=_check,
        bytes_moved=_bytes,
    ),
    dict(
        name="attn_window128_extra512_h16_d512_single_pass",
        make_inputs=_inputs,
        reference=window_sparse_attention_ref,
        launcher=functools.partial(window_sparse_attention, num_splits=1),
        check=_check,
        bytes_moved=_bytes,
    ),
    dict(
        name="attn_window128_extra512_h16_d512 + inverse rope, fused epilogue",
        make_inputs=_rope_inputs,
        reference=_attn_rope_ref,
        launcher=_attn_rope_epilogue,
        check=_check,
        bytes_moved=_bytes,
    ),
    dict(
        name="attn_window128_extra512_h16_d512 + inverse rope, separate rope_tail launch",
        make_inputs=_rope_inputs,
        reference=_attn_rope_ref,
        launcher=_attn_then_rope,
        check=_check,
        bytes_moved=_bytes,
    ),
]
