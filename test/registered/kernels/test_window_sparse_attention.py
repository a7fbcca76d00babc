"""Window + compressed-entry attention with sinks: the Triton launcher vs its torch reference,
single pass and split-K (flash-decoding) with its merge kernel, in the engine's two ways of
passing the compressed entries (the indexer's selection per token; every complete entry).

Not bit-exact: the kernel's online softmax rescales and sums the keys tile by tile in fp32 (and
uses exp2 with log2(e) folded into the scale), and split-K adds the partials in yet another order,
so the additions happen in another order than the reference's one-shot softmax and matmul; fp32
results agree to ~1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import triton
from sgl_dspark.kernels._triton_utils import sm_count
from sgl_dspark.kernels.attention.reference import (
    dense_entries_ref,
    read_rows,
    window_rows_ref,
    window_sparse_attention_ref,
)
from sgl_dspark.kernels.attention.window_sparse import (
    _auto_num_splits,
    _merge_attention_splits_kernel,
    window_sparse_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged_batch(seq_lens: list[int], extends: list[int], page_size: int, gen: torch.Generator):
    """A flat batch like ForwardBatch over a ReqToTokenPool-style table: request slot 0 is the
    padding row, requests get shuffled request slots and pages drawn at random from a pool."""
    num_reqs = len(seq_lens)
    max_ctx = -(-max(seq_lens) // page_size) * page_size
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 3
    page_order = torch.randperm(num_pages, generator=gen)
    table = (torch.arange(max_ctx) % page_size).repeat(num_reqs + 2, 1)  # dummy page rows
    req_slots = (torch.randperm(num_reqs + 1, generator=gen) + 1)[:num_reqs]
    used = 0
    positions, token_slot = [], []
    for r, (seq, ext) in enumerate(zip(seq_lens, extends)):
        n_pages = -(-seq // page_size)
        pages = page_order[used : used + n_pages]
        used += n_pages
        row = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        table[req_slots[r], : n_pages * page_size] = row
        positions += list(range(seq - ext, seq))
        token_slot += [int(req_slots[r])] * ext
    return (torch.tensor(positions), torch.tensor(token_slot), table, num_pages * page_size)


def _inputs(seq_lens, extends, heads, head_dim, window, num_extra, dtype, seed, invalid_rows=(1,)):
    gen = torch.Generator().manual_seed(seed)
    positions, token_slot, table, num_slots = _paged_batch(seq_lens, extends, 4, gen)
    tokens = positions.shape[0]
    q = torch.randn(tokens, heads, head_dim, generator=gen) * 2
    window_kv = torch.randn(num_slots, head_dim, generator=gen)
    # Sinks from strongly negative (no effect) to strongly positive (absorbs most of the mass).
    sinks = torch.randn(heads, generator=gen) * 3
    sinks[: min(heads, 2)] = torch.tensor([-40.0, 12.0])[: min(heads, 2)]
    extra = {}
    if num_extra is not None:
        # The selected entries (CSA): pool rows per token, read only where valid. Row 0 (where
        # invalid picks point) and every row no valid pick names hold NaN: reading one would
        # show in the output.
        pool = torch.randn(2 * num_extra * tokens + 2, head_dim, generator=gen)
        slots = torch.randint(1, pool.shape[0], (tokens, num_extra), generator=gen)
        valid = torch.rand(tokens, num_extra, generator=gen) < 0.6
        for row in invalid_rows:
            if row < tokens:
                valid[row] = False  # a token that sees no extra key at all
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        unread = torch.ones(pool.shape[0], dtype=torch.bool)
        unread[slots[valid]] = False
        pool[unread] = float("nan")
        extra = dict(
            extra_kv=pool.to(dtype).to(DEVICE),
            extra_valid=valid.to(DEVICE),
            extra_slots=slots.to(DEVICE),
        )
    return dict(
        q=q.to(dtype).to(DEVICE),
        window_kv=window_kv.to(dtype).to(DEVICE),
        positions=positions.to(DEVICE),
        token_slot=token_slot.to(DEVICE),
        req_to_token=table.to(DEVICE),
        window=window,
        sinks=sinks.to(DEVICE),
        scale=head_dim**-0.5,
        **extra,
    )


def _ref(inputs: dict) -> torch.Tensor:
    """The reference with the pool's NaN rows replaced by zeros: it gathers every pick, the
    invalid ones too, and multiplies them by a zero probability, which keeps a NaN; the kernel
    never loads them."""
    if inputs.get("extra_kv") is None:
        return window_sparse_attention_ref(**inputs)
    return window_sparse_attention_ref(**{**inputs, "extra_kv": inputs["extra_kv"].nan_to_num()})


def _run_poisoned(inputs: dict, num_splits: int | None = None) -> torch.Tensor:
    out = torch.full_like(inputs["q"], float("nan"))
    got = window_sparse_attention(**inputs, out=out, num_splits=num_splits)
    assert got is out
    assert not torch.isnan(got).any(), "kernel left poisoned output"
    return got


def _upcast(inputs: dict) -> dict:
    return {
        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


CASES = [
    # (seq_lens, extends, heads, head_dim, window, num_extra)
    ([9], [1], 16, 64, 4, None),  # plain decode, window < position
    ([3, 17, 6], [1, 1, 1], 5, 32, 8, 13),  # window longer than some positions, odd heads
    ([12, 5, 30], [4, 3, 4], 16, 128, 6, 0),  # verify widths 4/3/4, N = 0
    ([2, 25], [2, 3], 20, 64, 16, 37),  # heads > one head block, window > position
    ([40], [1], 3, 512, 5, 21),  # DSV4 head dim
    ([1], [1], 1, 32, 1, 3),  # window 1, the first token of a request
    ([130, 70], [2, 1], 16, 512, 128, 40),  # DSV4 local heads, window 128, Dh 512
]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_fp32_matches_reference(index: int) -> None:
    inputs = _inputs(*CASES[index], dtype=torch.float32, seed=100 + index)
    want = _ref(inputs)
    got = _run_poisoned(inputs)
    # Reordered fp32 sums (online softmax): a few ulps, well within 1e-5.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index", [1, 2, 3, 4, 6])
def test_bf16_matches_reference(index: int) -> None:
    inputs = _inputs(*CASES[index], dtype=torch.bfloat16, seed=200 + index)
    got = _run_poisoned(inputs)
    # Against the same math in fp32 on the bf16 inputs: only the kernel's bf16 probabilities in
    # the PV product and the final bf16 rounding differ (the interpreter truncates), so ~2^-7.
    exact = _ref(_upcast(inputs))
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    # Against the bf16 reference, which also rounds logits and probabilities to bf16: the bf16
    # logits shift the outputs by up to ~0.03 absolute (measured 0.031), so a looser bound.
    want = _ref(inputs)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_empty_batch() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=0)
    empty = {
        k: v[:0] if k in ("q", "positions", "token_slot", "extra_slots", "extra_valid") else v
        for k, v in inputs.items()
    }
    got = window_sparse_attention(**empty)
    assert got.shape == (0, 4, 32)


def test_sink_only_softmax_sanity() -> None:
    # Hand-derived: one visible key k (window 1, no extras), so o = k * e^s / (e^s + e^sink).
    inputs = _inputs([6], [1], 2, 32, 1, None, dtype=torch.float32, seed=3)
    got = _run_poisoned(inputs)
    key = inputs["window_kv"][inputs["req_to_token"][inputs["token_slot"][0], 5]]
    logit = (inputs["q"][0] @ key) * inputs["scale"]
    weight = torch.sigmoid(logit - inputs["sinks"])
    torch.testing.assert_close(got[0], weight[:, None] * key[None, :], rtol=1e-5, atol=1e-6)


def test_rejects_bad_layouts() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="extra_valid"):
        window_sparse_attention(**{**inputs, "extra_valid": None})
    with pytest.raises(ValueError, match="extra_slots"):
        window_sparse_attention(**{**inputs, "extra_slots": inputs["extra_slots"].float()})
    with pytest.raises(ValueError, match="extra_kv must be a pool"):
        window_sparse_attention(**{**inputs, "extra_kv": inputs["extra_kv"][None]})
    with pytest.raises(ValueError, match="extra_kv"):
        window_sparse_attention(**{**inputs, "extra_kv": None})
    with pytest.raises(ValueError, match="window_kv"):
        window_sparse_attention(**{**inputs, "window_kv": inputs["window_kv"].double()})
    with pytest.raises(ValueError, match="sinks"):
        window_sparse_attention(**{**inputs, "sinks": inputs["sinks"][:2]})


# Split-K sweep. Tile sizes: Dh 64/96/128 use 64-key tiles, Dh 512 16-key tiles, so "tiles" below
# is cdiv(window, BLOCK_N) + cdiv(N, BLOCK_N) and forced splits beyond it leave empty splits.
SPLIT_CASES = [
    # (seq_lens, extends, heads, head_dim, window, num_extra, rows with no valid extra key)
    ([6], [1], 3, 64, 4, None, ()),  # T=1, 1 tile: every split past 1 is empty
    ([2, 9, 40], [1, 1, 1], 5, 128, 32, 5, (0,)),  # T=3, early tokens mask most window slots
    ([3, 90], [3, 4], 7, 96, 40, 100, (1, 4)),  # T=7, splits mixing window and extra tiles
    ([1, 130, 4], [1, 2, 4], 6, 64, 128, 0, ()),  # T=7, N=0, position 0 sees one key
    ([60, 3], [1, 2], 72, 128, 100, 37, (2,)),  # 2 head blocks (64 + 8 heads)
    ([20, 150], [2, 1], 5, 512, 128, 37, (0,)),  # Dh 512: 8 + 3 tiles of 16 keys
]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("index", range(len(SPLIT_CASES)))
def test_split_fp32_matches_reference(index: int, num_splits: int) -> None:
    *case, invalid_rows = SPLIT_CASES[index]
    inputs = _inputs(*case, dtype=torch.float32, seed=300 + index, invalid_rows=invalid_rows)
    want = _ref(inputs)
    got = _run_poisoned(inputs, num_splits=num_splits)
    # Reordered fp32 sums (online softmax per split, then the weighted merge): a few ulps.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("index", [1, 2, 5])
def test_split_bf16_matches_reference(index: int, num_splits: int) -> None:
    *case, invalid_rows = SPLIT_CASES[index]
    inputs = _inputs(*case, dtype=torch.bfloat16, seed=400 + index, invalid_rows=invalid_rows)
    got = _run_poisoned(inputs, num_splits=num_splits)
    # Same bounds and reasons as test_bf16_matches_reference: each split rounds its probabilities
    # to bf16 before the PV product (relative to its own running max) and the output is rounded
    # once (truncated by the interpreter), ~2^-7 relative against the fp32 math on bf16 inputs...
    exact = _ref(_upcast(inputs))
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    # ...and the bf16 reference's own bf16 logits/probabilities add up to ~0.03 absolute.
    want = _ref(inputs)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_split_empty_batch() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=5)
    empty = {
        k: v[:0] if k in ("q", "positions", "token_slot", "extra_slots", "extra_valid") else v
        for k, v in inputs.items()
    }
    for num_splits in (None, 1, 3):
        assert window_sparse_attention(**empty, num_splits=num_splits).shape == (0, 4, 32)


def test_merge_ignores_empty_partials() -> None:
    # Hand-built partials (m in the log2 domain, the sink in natural-log units as the model's):
    # o = sum_s 2^m_s acc_s / (sum_s 2^m_s l_s + e^sink), where a split with m = -inf (no key
    # seen and no finite start) must weigh exactly 0.
    gen = torch.Generator().manual_seed(7)
    tokens, splits, heads, head_dim = 3, 5, 4, 48
    m = torch.randn(tokens, splits, heads, generator=gen) * 4
    l_part = torch.rand(tokens, splits, heads, generator=gen) * 3 + 0.1
    acc = torch.randn(tokens, splits, heads, head_dim, generator=gen)
    empty = torch.rand(tokens, splits, heads, generator=gen) < 0.4
    empty[0, :, 0] = True  # a (token, head) whose every split is empty: only the sink remains
    m[empty], l_part[empty], acc[empty] = float("-inf"), 0.0, 0.0
    sinks = torch.randn(heads, generator=gen) * 2
    weight = torch.exp2(m.double())  # [T, S, H]
    denom = (weight * l_part.double()).sum(1) + torch.exp(sinks.double())
    want = (weight[..., None] * acc.double()).sum(1) / denom[..., None]
    out = torch.full((tokens, heads, head_dim), float("nan"), device=DEVICE)
    block_d = 32  # 2 dim blocks, the second one partial
    _merge_attention_splits_kernel[(tokens, heads, triton.cdiv(head_dim, block_d))](
        acc.to(DEVICE),
        m.to(DEVICE),
        l_part.to(DEVICE),
        sinks.to(DEVICE),
        out,
        out,
        out,
        0,
        heads,
        splits,
        out.stride(0),
        out.stride(1),
        0,
        HEAD_DIM=head_dim,
        S_POW2=8,
        BLOCK_D=block_d,
        ROPE=False,
        KIND=0,
        ON_BITS=False,
        PDL=False,
    )
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-6)
    assert torch.all(out[0, 0] == 0)  # all-empty: zero mass over the sink's denominator


def test_auto_split_choice() -> None:
    # Enough programs: single pass. Few programs: capped by tiles / 2 and by 32 splits.
    assert _auto_num_splits(programs=132, total_tiles=40, sm_count=132) == 1
    assert _auto_num_splits(programs=1, total_tiles=40, sm_count=132) == 20
    assert _auto_num_splits(programs=1, total_tiles=1000, sm_count=132) == 32
    assert _auto_num_splits(programs=24, total_tiles=40, sm_count=132) == 11
    assert _auto_num_splits(programs=1, total_tiles=1, sm_count=132) == 1
    # The launcher's automatic choice is one of the forced ones (bit-identical to it).
    inputs = _inputs([3, 90], [3, 4], 7, 96, 40, 100, dtype=torch.float32, seed=9)
    auto = _run_poisoned(inputs)
    # 7 tokens x 1 head block; 64-key tiles: 1 window tile + 2 extra tiles.
    chosen = _auto_num_splits(7, 3, sm_count(inputs["q"].device))
    assert chosen == 2
    assert torch.equal(auto, _run_poisoned(inputs, num_splits=chosen))


def test_rejects_bad_num_splits() -> None:
    inputs = _inputs([4], [1], 4, 32, 4, 5, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="num_splits"):
        window_sparse_attention(**inputs, num_splits=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_cuda_graph_replay_matches_eager(num_splits: int | None) -> None:
    # Scratch is allocated inside the capture and no host value is read: replays with new
    # inputs copied into the captured buffers give exactly the eager result.
    case = ([20, 150], [2, 1], 16, 512, 128, 37)
    static = _inputs(*case, dtype=torch.bfloat16, seed=11)
    fresh = _inputs(*case, dtype=torch.bfloat16, seed=12)
    window_sparse_attention(**static, num_splits=num_splits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = window_sparse_attention(**static, num_splits=num_splits)
    before = captured.clone()
    # New values into the captured buffers (the page table and positions stay: they are the
    # captured batch's layout, which the fresh case need not share).
    for key in ("q", "window_kv", "extra_kv", "extra_valid", "extra_slots", "sinks"):
        static[key].copy_(fresh[key])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, window_sparse_attention(**static, num_splits=num_splits))
    assert not torch.equal(captured, before)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,num_entries", [(4, 30), (8, 3), (128, 2), (1, 70)])
def test_dense_entries_equal_explicit_slots(
    num_splits: int, dtype: torch.dtype, ratio: int, num_entries: int
) -> None:
    """extra_entries (HCA): the kernel derives each entry's pool row and visibility from the
    table and the position; the same keys and mask as passing `dense_entries_ref`'s rows and
    mask as extra_slots / extra_valid. Rows of entries not yet complete are garbage (NaN) and
    must never be read; entries past the table's width read its last column (masked).

    The same bits, except compiled bf16 split-K: there the two variants were seen to differ in
    a few output ulps on a GPU, while fp32 and single-pass bf16 are equal, so the keys and
    masks agree; the cause inside the compiled 16-bit split variants is not isolated. There
    both must agree with the reference (within its tolerance) and with each other to bf16
    rounding."""
    inputs = _inputs(
        [40, 9, 270, 1],
        [1, 3, 2, 1],
        heads=5,
        head_dim=64,
        window=16,
        num_extra=None,
        dtype=dtype,
        seed=43 + ratio,
    )
    gen = torch.Generator().manual_seed(ratio)
    table = inputs["req_to_token"]
    pool = torch.randn(int(table.max()) // ratio + 2, 64, generator=gen).to(dtype).to(DEVICE)
    rows, valid = dense_entries_ref(
        inputs["positions"], inputs["token_slot"], table, num_entries, ratio
    )
    assert bool(valid.any()) and not bool(valid.all())
    visible_rows = rows[valid].unique()
    garbage = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    garbage[visible_rows] = False
    pool[garbage] = float("nan")  # only rows of visible entries hold numbers
    explicit = {
        **inputs,
        "extra_kv": pool,
        "extra_slots": torch.where(valid, rows, 0),
        "extra_valid": valid,
    }
    dense = {**inputs, "extra_kv": pool, "extra_entries": (num_entries, ratio)}
    want = _run_poisoned(explicit, num_splits)
    got = _run_poisoned(dense, num_splits)
    if dtype == torch.bfloat16 and num_splits > 1 and DEVICE == "cuda":
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, want)
    ref = window_sparse_attention_ref(
        **{**inputs, "extra_kv": pool.nan_to_num(), "extra_entries": (num_entries, ratio)}
    )
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), ref.float(), **tol)
    with pytest.raises(ValueError, match="extra_entries"):
        window_sparse_attention(**{**dense, "extra_valid": valid})
    with pytest.raises(ValueError, match="extra_entries"):
        window_sparse_attention(**{**dense, "extra_slots": rows})
    with pytest.raises(ValueError, match="extra_entries"):
        window_sparse_attention(**{**dense, "extra_entries": (num_entries, 0)})
    with pytest.raises(ValueError, match="extra_kv must be a pool"):
        window_sparse_attention(**{**dense, "extra_kv": pool[None]})


def _rope_tables(tokens: int, rope_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as the engine passes them: column views of one fp32 [T, rd] block (RopeTable)."""
    angles = torch.rand(tokens, rope_dim // 2, generator=torch.Generator().manual_seed(seed)) * 7
    table = torch.cat((angles.cos(), angles.sin()), dim=1).to(DEVICE)
    return table[:, : rope_dim // 2], table[:, rope_dim // 2 :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "index,rope_dim",
    [
        (0, 64),  # rd = Dh: every channel rotates
        (1, 16),  # 5 heads: head block and dim block partial
        (2, 64),  # verify rows, Dh 128 (the mid model's layout)
        (4, 64),  # DSV4 Dh 512 with rd 64
    ],
)
def test_inverse_rope_epilogue_equals_rope_tail_after(
    index: int, rope_dim: int, num_splits: int, dtype: torch.dtype
) -> None:
    """The fused epilogue is `rope_tail(out, cos, sin, inverse=True)` of the kernel's own output,
    bit for bit (the same fp32 products, no FMA, one nearest-even rounding)."""
    from sgl_dspark.kernels.rope.reference import rope_tail_ref
    from sgl_dspark.kernels.rope.tail import rope_tail

    inputs = _inputs(*CASES[index], dtype=dtype, seed=700 + index)
    tokens, heads, _ = inputs["q"].shape
    cos, sin = _rope_tables(tokens, rope_dim, seed=index)
    plain = window_sparse_attention(**inputs, num_splits=num_splits)
    want = rope_tail(plain, cos, sin, inverse=True)
    out = torch.full_like(inputs["q"], float("nan"))
    got = window_sparse_attention(**inputs, num_splits=num_splits, inverse_rope=(cos, sin), out=out)
    assert got is out
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), want.view(bits))
    assert not torch.equal(got, plain), "the rotation did nothing"
    # The reference's inverse rope is the same rotation of its own output.
    ref = _ref({**inputs, "inverse_rope": (cos, sin)})
    assert torch.equal(ref, rope_tail_ref(_ref(inputs), cos, sin, inverse=True))


def test_inverse_rope_bad_tables() -> None:
    inputs = _inputs(*CASES[0], dtype=torch.float32, seed=1)
    cos, sin = _rope_tables(1, 64, seed=1)
    with pytest.raises(ValueError, match="inverse_rope"):
        window_sparse_attention(**inputs, inverse_rope=(cos.double(), sin))
    with pytest.raises(ValueError, match="inverse_rope"):
        window_sparse_attention(**inputs, inverse_rope=_rope_tables(1, 66, seed=1))  # rd > D
    with pytest.raises(ValueError, match="out"):
        window_sparse_attention(**inputs, out=torch.empty(1, 15, 64, device=DEVICE))


def _fp8_window(inputs: dict) -> dict:
    """The inputs with the window KV stored as FP8 E4M3 (values x 8, so codes span the range
    and some saturate)."""
    window = (inputs["window_kv"].float() * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {**inputs, "window_kv": window}


# Unit roundoffs: bf16 rounds to 8 significant bits (to nearest even, in the kernel and the
# reference alike); fp32 sums are counted at one ulp (2^-23) per addition rather than half of
# one, since the tensor cores' fp32 accumulation may truncate instead of rounding.
_U_BF16 = 2.0**-8
_U_ACC = 2.0**-23


def _gamma(n: int) -> float:
    """Relative bound of n fp32 operations in a row (a sum of n + 1 terms in any order is within
    gamma_n * sum |terms| of the exact sum)."""
    return n * _U_ACC / (1 - n * _U_ACC)


def _bf16_kernel_bound(inputs: dict, p_dtype: torch.dtype | None = None):
    """(o, bound): the exact output (float64 math on the stored values) and a per-element bound
    on |kernel - o| for 16-bit q and keys exact in bf16 (an FP8 window converts exactly).

    Per token and head, with p_j the softmax weights of the keys and the sink (value 0) and v_j
    the key rows, o = sum_j p_j v_j. The kernel computes:
      * the logits as fp32 dot products of D exact bf16 x bf16 products in some order, times
        the fp32 scale (log2(e) folded in), minus the running max: each logit within
        delta = gamma_{D+3} * M of the exact one, M = scale * max_j sum_i |q_i k_ji| (or the
        largest sink). Shifting the logits by at most delta moves every weight by a factor
        within exp(+-2 delta), and since the weights (sink included) sum to 1,
        |sum_j (p'_j - p_j) v_j| = |sum_j (p'_j - p_j)(v_j - o)| <= (e^(2 delta) - 1) * C with
        C = sum_j p_j |v_j - o| (the sink's term is p_sink |o|);
      * the probabilities rounded to bf16 before the PV product: at most u_bf16 * A, where
        A = sum_j p_j |v_j| (in split-K each split rounds its own, relative to its own max: the
        same relative bound);
      * exp2, the rescales by exp2(m_old - m_new), the fp32 sums of l and acc, the split merge
        and the division: relative eta = gamma_{5N+8} on numerator and denominator (N keys, at
        most one rescale per key tile, tiles and splits <= N, exp2 within 2 ulp);
      * one rounding of the output to bf16: u_bf16 * |output|.
    `p_dtype`: the exact math with the probabilities rounded to that dtype instead (a wrong
    kernel to check the bound against)."""
    q = inputs["q"].double()
    rows, valid = window_rows_ref(
        inputs["positions"], inputs["token_slot"], inputs["req_to_token"], inputs["window"]
    )
    keys = read_rows(inputs["window_kv"], rows, torch.float64)
    if inputs.get("extra_kv") is not None:
        extra = inputs["extra_kv"].nan_to_num()[inputs["extra_slots"]]  # NaN rows: never valid
        keys = torch.cat((keys, extra.double()), dim=1)
        valid = torch.cat((valid, inputs["extra_valid"]), dim=1)
    scale, sinks = inputs["scale"], inputs["sinks"].double()
    logits = torch.einsum("thd,tkd->thk", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_column = sinks[None, :, None].expand(q.shape[0], -1, 1)
    weights = torch.softmax(torch.cat((logits, sink_column), dim=-1), dim=-1)
    p, p_sink = weights[..., :-1], weights[..., -1:]
    if p_dtype is not None:
        p = p.to(p_dtype).double()
    o = torch.einsum("thk,tkd->thd", p, keys)
    a = torch.einsum("thk,tkd->thd", p, keys.abs())
    c = torch.einsum("thk,thkd->thd", p, (keys[:, None] - o[:, :, None]).abs()) + p_sink * o.abs()
    magnitude = torch.einsum("thd,tkd->thk", q.abs(), keys.abs()) * scale
    m = magnitude.masked_fill(~valid[:, None, :], 0).amax(dim=-1)
    m = torch.maximum(m, sinks.abs()[None, :])
    head_dim, num_keys = q.shape[-1], keys.shape[1]
    eps_logits = torch.expm1(2 * _gamma(head_dim + 3) * m)[..., None]
    eta = _gamma(5 * num_keys + 8)
    before_rounding = (_U_BF16 + eta) * (1 + eps_logits) * a + eps_logits * c + eta * o.abs()
    return o, before_rounding + _U_BF16 * (o.abs() + before_rounding)


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str):
    err = (got.double() - want).abs()
    ratio = (err / bound).max().item()
    assert bool((err <= bound).all()), f"{what}: error up to {ratio:.2f}x the bound"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", [1, 3, 6])
def test_fp8_window_cache(index: int, dtype: torch.dtype, num_splits: int) -> None:
    """An FP8 window cache (`--kv-cache-dtype fp8_e4m3`) is read back exactly in q's dtype: the
    reference on the FP8 pool equals the reference on that pool converted first, and the kernel
    on the FP8 pool matches it as it does for a pool of q's dtype."""
    inputs = _inputs(*CASES[index], dtype=dtype, seed=300 + index)
    inputs = _fp8_window(inputs)
    converted = {**inputs, "window_kv": inputs["window_kv"].to(dtype)}
    want = _ref(inputs)
    assert torch.equal(want, _ref(converted))
    got = _run_poisoned(inputs, num_splits=num_splits)
    same_dtype = _run_poisoned(converted, num_splits=num_splits)
    if dtype == torch.float32:
        # logits 8x larger amplify the fp32 summation-order differences of softmax and the
        # weighted sum: the absolute bound of test_fp32_matches_reference scaled by 8 * 8
        torch.testing.assert_close(got, want, rtol=1e-5, atol=64e-5)
        assert torch.equal(got, same_dtype)
        return
    exact, bound = _bf16_kernel_bound(inputs)
    _assert_within(got, exact, bound, "FP8 pool")
    if DEVICE == "cpu":  # the interpreter forms the same fp32 products for both pools
        assert torch.equal(got, same_dtype)
    else:
        # Compiled, keys converted from FP8 in registers reach the MMA in another operand
        # layout than keys loaded as bf16, which groups the K products of the logits
        # differently: the same bound, not the same bits.
        _assert_within(same_dtype, exact, bound, "pool of q's dtype")
    # The bound catches a wrong kernel: probabilities rounded to the cache's FP8 for the PV
    # product, or a window one key short.
    wrong_p, _ = _bf16_kernel_bound(inputs, p_dtype=torch.float8_e4m3fn)
    assert bool(((wrong_p - exact).abs() > bound).any())
    short = _ref(_upcast({**converted, "window": converted["window"] - 1}))
    assert bool(((short.double() - exact).abs() > bound).any())


def test_rejects_other_window_storage_dtypes() -> None:
    inputs = _inputs(*CASES[0], dtype=torch.float32, seed=7)
    bad = {**inputs, "window_kv": inputs["window_kv"].to(torch.float16)}
    with pytest.raises(ValueError, match="window_kv"):
        window_sparse_attention(**bad)
