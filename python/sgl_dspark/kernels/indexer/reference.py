"""The lightning indexer in torch: the reference of the indexer kernels (`logits.py`, `topk.py`,
`fp4_k_quant.py`, `fp4_q_rope.py`, DeepSeek-V4.1's `v41_logits.py`) and the "indexer" family's
torch scoring.

Scoring: for token t (position p, request slot r) and compressed entry n of its request,
    score[t, n] = sum_h w[t, h] * relu(qi[t, h] . K[n]) * Di**-0.5     for n < visible = (p+1) // m
    score[t, n] = -inf                                                  for n >= visible
where K[n] = index_keys[entry_pool_rows_ref(n)] (the request's entry n in the pool).

Top-k selection, per row t: the candidates are ``0 <= n < clamp(visible[t], 0, N)``; the selected
set is the k best candidates by (score descending, index ascending), so ties at the threshold go
to the lower index, and with fewer than k candidates all of them are selected; ``-0.0`` and
``+0.0`` are the same score, ``-inf`` candidates are ordinary candidates. The selected ids come in
ascending index order in slots ``0..s-1`` (s = ``min(k, candidates)``), then slots ``s..k-1``
hold id 0 with valid False; with ``entry_rows`` the selected slots hold the entries' pool rows.

FP4 (E2M1) format, shared by index keys and queries: groups of 32 consecutive channels share one
UE8M0 scale byte ``e`` (value ``2^(e-127)``), chosen as the smallest power of two >=
``max(amax/6, 1e-4)`` and clamped to [1, 254]. Each element ``x / 2^(e-127)`` is rounded to
nearest, ties to even code, onto the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (magnitudes above 6
saturate to 6); the code is ``sign << 3 | magnitude index`` where sign is the input's sign bit, so
-0.0 and negative values that round to zero encode as 0x8 (-0). Two codes per byte, low nibble =
even element. An all-zero group gets ``e = 114`` (2^-13, the first power of two >= 1e-4) and
codes 0; a group holding an infinity gets ``e = 254`` (the clamp). NaN inputs give undefined
codes. The query scales are laid out per token as [Di/32, 16, 4]: head h, group c at
[c, h % 16, h // 16] (16 heads per block, room for 4 blocks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_dspark.kernels.compressor.reference import entry_pool_rows_ref
from sgl_dspark.kernels.quant.reference import Fp4Rows, dequantize_fp4_index_ref
from sgl_dspark.kernels.rope.reference import rope_tail_ref

FP4_GROUP = 32
Q_SCALE_HEAD_BLOCK = 16  # query heads per block of the scale layout
Q_SCALE_HEAD_BLOCKS = 4  # the query scale layout has room for 4 × 16 = 64 heads
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_SCALE_FLOOR = 1e-4  # floor of amax/6 in the packing step
_FAKE_QUANT_AMAX_FLOOR = 6.0 * 2.0**-126  # floor of amax before the /6 in the fake-quant step


def indexer_logits_ref(
    qi: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    req_to_token: torch.Tensor,
    ratio: int,
    n_max: int,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """Indexer scores of every token against its request's compressed entries (module doc).

    Args:
        qi: [T, Hi, Di] rotated index queries (bf16/fp16/fp32).
        weights: [T, Hi] head weights (fp32 or qi's dtype), used as fp32(weights) * weight_scale
            (the layer passes its projection's output and Hi**-0.5).
        index_keys: [num_entry_slots, Di] index keys of the layer (qi's dtype).
        positions: [T] int position of each token.
        token_slot: [T] int request slot (row of req_to_token) of each token.
        req_to_token: [slots, max_ctx] int token slot of (request slot, position).
        ratio: compression ratio m (entry n covers positions [n*m, (n+1)*m)).
        n_max: output width (number of entry columns).
        weight_scale: multiplies the fp32 head weights.
    Returns:
        [T, n_max] fp32 scores, -inf where n >= (positions + 1) // ratio.
    """
    entry_ids = torch.arange(n_max, device=positions.device)
    slots = entry_pool_rows_ref(entry_ids[None, :], req_to_token, token_slot, ratio)  # [T, N]
    keys = index_keys[slots]  # [T, N, Di]
    return indexer_logits_of_keys_ref(
        qi, weights, keys, positions, ratio, weight_scale=weight_scale
    )


def indexer_logits_of_keys_ref(
    qi: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    *,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """`indexer_logits_ref` over keys already gathered per token: keys `[T, N, Di]` (entry n of
    token t's request at `keys[t, n]`). Returns `[T, N]` fp32, -inf at n >= (pos_t + 1) // ratio.
    """
    head_dim = qi.shape[-1]
    weights = weights.float() * weight_scale
    scores = torch.einsum("thd,tnd->thn", qi.float(), keys.float())
    scores = torch.relu(scores) * head_dim**-0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, N]
    visible = (positions + 1) // ratio
    entry_ids = torch.arange(keys.shape[1], device=positions.device)
    return scores.masked_fill(entry_ids[None, :] >= visible[:, None], float("-inf"))


def index_topk_ref(
    scores: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    entry_rows: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible entries per row, ids ascending, invalid slots last (module doc).

    Args:
        scores: fp32 ``[T, N]``; entries ``n >= visible[t]`` are ignored whatever they hold.
        visible: int ``[T]``; number of real entries of each row (clamped to ``[0, N]``).
        k: slots per row, ``k >= 1`` (may exceed N or visible).
        entry_rows: optional ``(req_to_token, token_slot, ratio)``: return pool rows, not ids.
    Returns:
        ``(ids, valid)``: int64 ``[T, k]`` and bool ``[T, k]``.
    """
    num_rows, width = scores.shape
    device = scores.device
    num_cand = visible.to(torch.int64).clamp(0, width)
    is_cand = torch.arange(width, device=device)[None, :] < num_cand[:, None]
    # -0.0 == +0.0; non-candidates get a harmless value, they are sorted last below anyway.
    key = torch.where(is_cand & (scores != 0), scores, torch.zeros_like(scores))
    # Stable sorts: by score descending (ties keep index order), then candidates first.
    by_score = torch.sort(-key, dim=1, stable=True).indices
    cand_first = torch.sort((~is_cand.gather(1, by_score)).to(torch.int8), dim=1, stable=True)
    order = by_score.gather(1, cand_first.indices)
    taken = min(k, width)
    top = torch.zeros(num_rows, k, dtype=torch.int64, device=device)
    top[:, :taken] = order[:, :taken]
    rank = torch.arange(k, device=device)[None, :]
    valid = rank < num_cand[:, None]
    # Ascending ids, invalid slots after every valid one.
    past_end = torch.where(valid, top, torch.full_like(top, width + k))
    ids = torch.sort(past_end, dim=1).values
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    if entry_rows is not None:
        ids = torch.where(valid, entry_pool_rows_ref(ids, *entry_rows), torch.zeros_like(ids))
    return ids, valid


def e2m1_encode_ref(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> E2M1 codes uint8, RNE, saturating at 6."""
    a = v.float().abs().clamp(max=6.0)
    # torch.round is round-half-to-even; scaling by the grid step of each binade makes it RNE on
    # the E2M1 grid (step .5 below 2, 1 in [2, 4), 2 in [4, 6]).
    q = torch.where(
        a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2)
    )
    mag = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode_ref(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> fp32 values; code 0x8 decodes to -0.0."""
    table = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    codes = codes.long()
    sign = torch.where((codes & 8) != 0, -1.0, 1.0).to(codes.device)
    return table[codes & 7] * sign


def _ceil_log2_ref(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) for positive normal fp32 v, exactly (frexp: v = m·2^k, m in [0.5, 1))."""
    mant, expo = torch.frexp(v)
    return torch.where(mant == 0.5, expo - 1, expo)


def _pow2_ref(k: torch.Tensor) -> torch.Tensor:
    """2^k as fp32 for integer k in [-126, 127], built from the exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def fp4_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 quantisation of the last dim (a multiple of 32; the format of the module doc).

    Args: x [..., K] float. Returns (codes uint8 [..., K/2], scales uint8 [..., K/32]) where
    scales are UE8M0 bytes. For K = 128, ``scales.view(torch.int32)`` is the little-endian word
    e0 | e1<<8 | e2<<16 | e3<<24.
    """
    k = x.shape[-1]
    assert k % FP4_GROUP == 0, f"last dim {k} is not a multiple of {FP4_GROUP}"
    groups = x.float().reshape(*x.shape[:-1], k // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    sf = torch.maximum(amax / 6, torch.tensor(_SCALE_FLOOR, dtype=torch.float32, device=x.device))
    exponent = torch.where(sf.isinf(), 254, (_ceil_log2_ref(sf) + 127).clamp(1, 254))
    codes = e2m1_encode_ref(groups / _pow2_ref(exponent - 127).unsqueeze(-1))
    codes = codes.reshape(*x.shape[:-1], k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, exponent.to(torch.uint8)


def fp4_dequant_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of fp4_quant_ref: (uint8 [..., K/2], uint8 [..., K/32]) -> fp32 [..., K]."""
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)
    values = e2m1_decode_ref(nibbles)
    k = values.shape[-1]
    factor = _pow2_ref(scales.long() - 127).repeat_interleave(FP4_GROUP, dim=-1)
    assert factor.shape[-1] == k, f"scales cover {factor.shape[-1]} channels, codes {k}"
    return values * factor


def fp4_fake_quant_ref(x: torch.Tensor) -> torch.Tensor:
    """The query's fake-quant per 32-group of the last dim: s = ceil_pow2(max(amax, 6·2^-126)/6),
    v = e2m1_rne(clamp(x/s, ±6))·s, returned in x's dtype (exactly representable in bf16)."""
    k = x.shape[-1]
    groups = x.float().reshape(*x.shape[:-1], k // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=_FAKE_QUANT_AMAX_FLOOR)
    s = _pow2_ref(_ceil_log2_ref(amax / 6))
    values = e2m1_decode_ref(e2m1_encode_ref((groups / s).clamp(-6.0, 6.0))) * s
    return values.reshape(x.shape).to(x.dtype)


def fp4_index_k_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index-key quantisation: x [T, K] -> (codes uint8 [T, K/2], scales uint8 [T, K/32])."""
    return fp4_quant_ref(x)


class IndexQFp4Output(NamedTuple):
    """Outputs of index_q_rope_fp4 for T tokens, Hi heads of Di channels."""

    codes: torch.Tensor  # uint8 [T, Hi, Di/2]
    scales: torch.Tensor  # uint8 [T, 1, Di/32, 16, 4]: head h, group c at [t, 0, c, h%16, h//16]
    head_weights: torch.Tensor | None  # [T, Hi] q's dtype, when weight_partials were given
    fake_quant: torch.Tensor | None  # [T, Hi·Di] q's dtype: rotated, fake-quantised q (step 2)


def index_q_rope_ref(
    x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Step 1 of the index-query chain: rotate the trailing rope_dim channels of x [T, H, Dh] by
    interleaved pairs (`rope_tail_ref`) at each token's position.

    cos_sin: fp32 [max_pos, rope_dim/2, 2] (cos, sin); positions [T]; positions outside the table
    use entry 0. The rotation is computed in fp32 and cast to x's dtype.
    """
    assert cos_sin.shape[1] * 2 == rope_dim, f"cos_sin {tuple(cos_sin.shape)}, rope_dim {rope_dim}"
    pos = positions.long()
    pos = torch.where((pos >= 0) & (pos < cos_sin.shape[0]), pos, 0)
    return rope_tail_ref(x, cos_sin[pos, :, 0].float(), cos_sin[pos, :, 1].float())


def index_q_rope_fp4_ref(
    q: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    n_heads: int,
    rope_dim: int,
    weight_partials: torch.Tensor | None = None,
    head_weight_scale: float = 1.0,
) -> IndexQFp4Output:
    """The index-query chain `index_q_rope_fp4` fuses: (1) RoPE of the trailing rope_dim
    channels, (2) FP4 fake-quant (`fp4_fake_quant_ref`), (3) FP4 quantisation of the
    fake-quantised values into codes and per-head scale bytes laid out for the scoring kernel,
    (4) optionally the head weights from split-K partials.

    Args:
        q: [T, Hi·Di] (indexer slice of the q projection); cos_sin, positions: index_q_rope_ref.
        weight_partials: optional fp32 [S, T, Hi] split-K partials of the head-weight projection,
            summed in order s = 0..S-1, times head_weight_scale (softmax_scale · Hi_total^-0.5),
            cast to q's dtype.
    """
    t = q.shape[0]
    head_dim = q.shape[1] // n_heads
    x = index_q_rope_ref(q.view(t, n_heads, head_dim), cos_sin, positions, rope_dim)
    fake_quant = fp4_fake_quant_ref(x)
    codes, exponents = fp4_quant_ref(fake_quant)
    scales = torch.zeros(
        t,
        1,
        head_dim // FP4_GROUP,
        Q_SCALE_HEAD_BLOCK,
        Q_SCALE_HEAD_BLOCKS,
        dtype=torch.uint8,
        device=q.device,
    )
    for h in range(n_heads):
        scales[:, 0, :, h % Q_SCALE_HEAD_BLOCK, h // Q_SCALE_HEAD_BLOCK] = exponents[:, h, :]
    head_weights = None
    if weight_partials is not None:
        acc = weight_partials[0].float()
        for s in range(1, weight_partials.shape[0]):
            acc = acc + weight_partials[s].float()
        factor = torch.tensor(head_weight_scale, dtype=torch.float32, device=q.device)
        head_weights = (acc * factor).to(q.dtype)
    return IndexQFp4Output(codes, scales, head_weights, fake_quant.reshape(t, n_heads * head_dim))


# ---- DeepSeek-V4.1: scoring packed FP4 keys, candidate blocks ---------------------------------


def v41_index_scores_ref(
    qi: torch.Tensor,
    weights: torch.Tensor,
    key_data: torch.Tensor,
    key_scales: torch.Tensor,
    entry_rows: torch.Tensor,
    visible: torch.Tensor,
    *,
    weight_scale: float,
    keep_blocks: torch.Tensor | None = None,
    block: int = 1,
) -> torch.Tensor:
    """DeepSeek-V4.1's index scores over a kv source's packed FP4 index keys (the reference of
    `v41_logits.py::v41_index_scores`): the module doc's score with K[n] the dequantised key at
    cache row `entry_rows[t, n]`, -inf at n >= visible[t] and, with `keep_blocks` `[T, nb]`
    bool (a candidate source's blocks of `block` entries), -inf outside the kept blocks.

    qi `[T, Hi, Di]` (the fake-quantised queries), weights `[T, Hi]`, key_data uint8 `[R, Di/2]`,
    key_scales uint8 `[R, Di/32]` (`quantize_fp4_index_ref`), entry_rows int `[T, N]`, visible
    int `[T]`. Returns `[T, N]` fp32."""
    rows = entry_rows.clamp(0, key_data.shape[0] - 1)
    keys = dequantize_fp4_index_ref(Fp4Rows(key_data[rows], key_scales[rows]), torch.float32)
    head_dim = qi.shape[-1]
    scores = torch.einsum("thd,tnd->thn", qi.float(), keys)
    scores = torch.relu(scores) * head_dim**-0.5
    scores = (scores * (weights.float() * weight_scale).unsqueeze(-1)).sum(dim=1)
    n = torch.arange(entry_rows.shape[1], device=entry_rows.device)
    hidden = n[None, :] >= visible[:, None]
    if keep_blocks is not None:
        hidden |= ~keep_blocks.gather(1, (n // block)[None, :].expand_as(hidden))
    return scores.masked_fill(hidden, float("-inf"))


def candidate_block_max_ref(
    scores: torch.Tensor, visible: torch.Tensor, block: int
) -> torch.Tensor:
    """The block scores of the two-level top-k: scores `[T, N]` (-inf where not visible) in
    blocks of `block` entries (the last one padded with -inf), each block's maximum, and +inf
    for the block holding the newest visible entry (`visible - 1`) of rows that see any.
    Returns `[T, ceil(N / block)]` fp32 (the reference of `v41_logits.py::candidate_block_max`)."""
    rows, width = scores.shape
    n_blocks = -(-width // block)
    padded = scores.new_full((rows, n_blocks * block), float("-inf"))
    padded[:, :width] = scores
    block_max = padded.view(rows, n_blocks, block).amax(dim=-1)
    newest = ((visible - 1).clamp(min=0) // block).clamp(max=n_blocks - 1)
    pinned = torch.where(
        visible > 0,
        torch.full_like(block_max[:, 0], float("inf")),
        block_max.gather(1, newest[:, None])[:, 0],
    )
    return block_max.scatter(1, newest[:, None], pinned[:, None])
