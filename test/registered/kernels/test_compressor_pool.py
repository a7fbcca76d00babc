"""Decode/verify block pooling of the CSA/HCA compressors: the Triton launcher vs its reference.

Within a tolerance: the kernel rounds to the kv dtype at every point the torch chain does (bias,
logits, softmax weights, products, span sum, normed output; bf16 on the bits), so what remains is
the exp lowering and the order of three fp32 sums (softmax denominator, span sum, mean of squares):
fp32 agrees to ~1e-6 relative; in bf16 a value that lands at a rounding boundary may round the other
way, which the norm can spread to at most ~2 ulps (same for fp16). Entry slots are exact.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from sgl_dspark.kernels.compressor.decode import compressor_decode
from sgl_dspark.kernels.compressor.pool import _channel_blocks, _pool_meta, compressor_pool
from sgl_dspark.kernels.compressor.reference import compressor_decode_ref, compressor_pool_ref
from sgl_dspark.kernels.rope.tail import rope_tail

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The module (the package's `compressor_pool` is the launcher function).
pool_module = importlib.import_module("sgl_dspark.kernels.compressor.pool")
# The Triton interpreter (numpy 1.26) warns on every scalar index it converts.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _inputs(prefix_lens, extends, head_dim, ratio, overlap, dtype, seed, max_verify=8, page=None):
    """A decode/verify forward over random pages, with state rings as the runtime leaves them:
    ring rows of positions [prefix - R, prefix) hold earlier rows; every other ring row (stale,
    or never written because the request is young) is NaN, so reading one would show."""
    gen = torch.Generator().manual_seed(seed)
    page = page or max(16, ratio)  # pages hold whole blocks, as the runtime's
    width = 2 * head_dim if overlap else head_dim
    span = 2 * ratio if overlap else ratio
    ring = _next_pow2(span + max_verify)
    seq_lens = [p + n for p, n in zip(prefix_lens, extends)]
    max_ctx = -(-max(seq_lens) // page) * page
    num_reqs = len(seq_lens)
    table = torch.zeros(num_reqs + 2, max_ctx, dtype=torch.int64)
    pages = (torch.randperm(num_reqs * max_ctx // page, generator=gen) + 1).view(num_reqs, -1)
    req_slots = (torch.randperm(num_reqs + 1, generator=gen) + 1)[:num_reqs]
    state_kv = torch.full((num_reqs + 2, ring, width), float("nan"))
    state_score = torch.full((num_reqs + 2, ring, width), float("nan"))
    positions, token_slot, token_prefix = [], [], []
    for r, (prefix, ext) in enumerate(zip(prefix_lens, extends)):
        slot = int(req_slots[r])
        table[slot] = (pages[r][:, None] * page + torch.arange(page)).flatten()
        for q in range(max(0, prefix - ring), prefix):
            state_kv[slot, q % ring] = torch.randn(width, generator=gen)
            state_score[slot, q % ring] = torch.randn(width, generator=gen) * 2
        positions += list(range(prefix, prefix + ext))
        token_slot += [slot] * ext
        token_prefix += [prefix] * ext
    tokens = len(positions)
    tensors = dict(
        kv=torch.randn(tokens, width, generator=gen),
        score=torch.randn(tokens, width, generator=gen) * 2,
        state_kv=state_kv,
        state_score=state_score,
        position_bias=torch.randn(ratio, width, generator=gen) * 0.5,
        norm_weight=1 + 0.1 * torch.randn(head_dim, generator=gen),
        positions=torch.tensor(positions, dtype=torch.int64),
        token_slot=torch.tensor(token_slot, dtype=torch.int64),
        token_prefix=torch.tensor(token_prefix, dtype=torch.int64),
        req_to_token=table,
    )
    for name in ("kv", "score", "state_kv", "state_score"):
        tensors[name] = tensors[name].to(dtype)
    return {
        **{k: v.to(DEVICE) for k, v in tensors.items()},
        "ratio": ratio,
        "overlap": overlap,
        "eps": 1e-6,
    }


def _check(got, want, dtype: torch.dtype) -> None:
    assert torch.equal(got.slots, want.slots)
    assert got.entries.dtype == dtype and got.entries.shape == want.entries.shape
    assert torch.isfinite(got.entries).all()
    # fp32: reordered sums; bf16 / fp16: up to ~2 ulps (2**-7 / 2**-10 relative per ulp).
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]
    torch.testing.assert_close(got.entries.float(), want.entries.float(), rtol=tol, atol=tol)


CASES = [
    # (prefix_lens, extends, head_dim, ratio, overlap)
    ([7], [1], 64, 4, True),  # one decode row that ends a CSA block
    ([0, 13, 2, 30], [4, 3, 2, 1], 24, 4, True),  # block 0 (absent Ca half), verify rows
    ([5, 44, 60], [8, 5, 4], 40, 4, True),  # spans reach into the ring
    ([14, 31, 0], [3, 1, 8], 24, 16, False),  # HCA-like; a request with no ring rows
    ([10, 3], [6, 7], 20, 3, True),  # ratio not a power of two
    ([21, 6], [2, 5], 48, 1, True),  # ratio 1: every row ends a block
    ([250], [8], 72, 128, False),  # m = 128: channels split over programs
    ([383, 120], [4, 9], 264, 128, False),  # m = 128, Dh not a power of two, split
    ([2040, 1023], [6, 3], 24, 1024, False),  # m = 1024: split and two span tiles
]


def _layout(head_dim: int, ratio: int, overlap: bool) -> tuple[int, int]:
    """(span tiles, programs per row) of the default launch."""
    span = 2 * ratio if overlap else ratio
    meta = _pool_meta(head_dim, span)
    return -(-span // meta["SPAN_BLOCK"]), _channel_blocks(meta, head_dim)


def test_cases_cover_the_one_pass_the_tiled_and_the_split_pooling() -> None:
    layouts = {_layout(d, r, ov) for _p, _e, d, r, ov in CASES}
    assert (1, 1) in layouts  # one program, one pass
    assert any(t == 1 and p > 1 for t, p in layouts)  # split channels, one pass
    assert any(t > 1 and p > 1 for t, p in layouts)  # split channels, span tiles
    # The benchmark model's and DSV4-Flash's HCA rows are split (one program per row over
    # 128 x Dh was latency-bound), as is DSV4-Flash's CSA row; the benchmark model's are not.
    assert _layout(128, 128, False)[1] > 1 and _layout(512, 128, False)[1] > 1
    assert _layout(512, 4, True)[1] > 1
    assert _layout(128, 4, True) == (1, 1) and _layout(64, 4, True) == (1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_reference(index: int, dtype: torch.dtype) -> None:
    prefix, extends, head_dim, ratio, overlap = CASES[index]
    inputs = _inputs(prefix, extends, head_dim, ratio, overlap, dtype, seed=20 + index)
    want = compressor_pool_ref(**inputs)
    ends = (inputs["positions"] + 1) % ratio == 0
    assert ends.any()
    out = torch.full_like(want.entries, float("nan"))  # poisoned outputs
    out_slots = torch.full_like(want.slots, -7)
    got = compressor_pool(**inputs, out=out, out_slots=out_slots)
    assert got.entries is out and got.slots is out_slots
    _check(got, want, dtype)
    assert (got.slots[ends] > 0).all() and (got.slots[~ends] == 0).all()
    assert (got.entries[~ends] == 0).all() and (got.entries[ends] != 0).any()


def test_bias_in_kv_dtype_and_strided_rows() -> None:
    inputs = _inputs([9, 22], [3, 2], 32, 4, True, torch.bfloat16, seed=3)
    inputs["position_bias"] = inputs["position_bias"].bfloat16()
    wide = torch.randn(5, 3 * 64).bfloat16().to(DEVICE)  # kv and score as column slices
    wide[:, :64], wide[:, 64:128] = inputs["kv"], inputs["score"]
    inputs["kv"], inputs["score"] = wide[:, :64], wide[:, 64:128]
    _check(compressor_pool(**inputs), compressor_pool_ref(**inputs), torch.bfloat16)


def test_hand_derived_entry() -> None:
    # HCA, m = 2, Dh = 1: the block ending at position 3 pools positions 2 (ring) and 3 (fresh)
    # with logits log(1) + 0 and log(3) + 0 -> weights 1/4, 3/4 -> pooled 0.25*4 + 0.75*8 = 7;
    # RMSNorm of one channel gives sign(7) = 1, times the norm weight 0.5.
    table = torch.arange(8).view(1, 8) + 8
    state = torch.zeros(1, 4, 1)
    state_kv, state_score = state.clone(), state.clone()
    state_kv[0, 2, 0], state_score[0, 2, 0] = 4.0, 0.0
    got = compressor_pool(
        torch.tensor([[8.0]]).to(DEVICE),
        torch.tensor([[3.0]]).log().to(DEVICE),
        state_kv.to(DEVICE),
        state_score.to(DEVICE),
        torch.zeros(2, 1).to(DEVICE),
        torch.tensor([0.5]).to(DEVICE),
        torch.tensor([3]).to(DEVICE),
        torch.tensor([0]).to(DEVICE),
        torch.tensor([3]).to(DEVICE),
        table.to(DEVICE),
        2,
        False,
        0.0,
    )
    torch.testing.assert_close(got.entries.cpu(), torch.tensor([[0.5]]), rtol=1e-6, atol=0)
    assert got.slots.tolist() == [(8 + 2) // 2]


def test_empty_and_bad_inputs() -> None:
    inputs = _inputs([6], [2], 16, 4, True, torch.float32, seed=1)
    empty = {
        k: (v[:0] if k in ("kv", "score", "positions", "token_slot", "token_prefix") else v)
        for k, v in inputs.items()
    }
    got = compressor_pool(**empty)
    assert got.entries.shape == (0, 16) and got.slots.shape == (0,)
    with pytest.raises(ValueError, match="kv width"):
        compressor_pool(**{**inputs, "overlap": False})
    with pytest.raises(ValueError, match="state_kv"):
        compressor_pool(**{**inputs, "state_kv": inputs["state_kv"].bfloat16()})


# ---- the fused decode step: pooling + RoPE + entry store + ring store ---------------------------


def _rope_rows(positions: torch.Tensor, rope_half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 500 ** (torch.arange(rope_half, dtype=torch.float32) / rope_half)
    ang = positions.float().cpu()[:, None] * inv[None, :]
    return ang.cos().to(DEVICE), ang.sin().to(DEVICE)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ty = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return a.shape == b.shape and torch.equal(a.view(ty[a.dtype]), b.view(ty[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_fused_decode_matches_reference(index: int, dtype: torch.dtype) -> None:
    """Entries of block-end rows land rotated at their slots (a tolerance vs the reference; bit for bit
    vs the two-kernel composition pool -> rope_tail), no other entry slot is touched, and the
    rings get every row's raw kv/score exactly."""
    prefix, extends, head_dim, ratio, overlap = CASES[index]
    inputs = _inputs(prefix, extends, head_dim, ratio, overlap, dtype, seed=40 + index)
    rope_half = max(1, head_dim // 4)
    cos, sin = _rope_rows(inputs["positions"] - (ratio - 1), rope_half)
    n_slots = int(inputs["req_to_token"].max()) // ratio + 1
    entries0 = torch.full((n_slots, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    want = {k: inputs[k].clone() for k in ("state_kv", "state_score")}
    want_entries = entries0.clone()
    compressor_decode_ref(**{**inputs, **want}, cos=cos, sin=sin, entries=want_entries)
    got = {k: inputs[k].clone() for k in ("state_kv", "state_score")}
    got_entries = entries0.clone()
    compressor_decode(**{**inputs, **got}, cos=cos, sin=sin, entries=got_entries)
    for k in got:
        assert _same_bits(got[k], want[k]), k
    written = ~torch.isnan(want_entries).any(dim=1)
    assert written.any() and torch.equal(written, ~torch.isnan(got_entries).any(dim=1))
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(
        got_entries[written].float(), want_entries[written].float(), rtol=tol, atol=tol
    )
    pooled = compressor_pool(**inputs)
    ends = (inputs["positions"] + 1) % ratio == 0
    composed = rope_tail(pooled.entries.unsqueeze(1), cos, sin).squeeze(1)
    assert _same_bits(got_entries[pooled.slots[ends]], composed[ends])


def _unsplit_meta(head_dim: int, span: int) -> dict[str, int]:
    meta = dict(_pool_meta(head_dim, span))
    meta["BLOCK_C"] = meta["BLOCK_D"]
    meta["SPAN_BLOCK"] = min(meta["SPAN_BLOCK"], 4096 // meta["BLOCK_D"])
    return meta


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if _layout(*c[2:])[1] > 1])
def test_split_rows_round_trip_exactly(index: int, monkeypatch) -> None:
    """A split row's programs store kv-dtype values and the last arrival norms what they
    stored, so the entries equal one program's per row with the same span tiles (in the
    interpreter, whose per-channel sums do not depend on the tile's width; compiled, the tile
    shape may change the sums' order: a tolerance, as against the reference)."""
    prefix, extends, head_dim, ratio, overlap = CASES[index]
    inputs = _inputs(prefix, extends, head_dim, ratio, overlap, torch.bfloat16, seed=60 + index)
    counters = torch.zeros(len(inputs["positions"]), dtype=torch.int32, device=DEVICE)
    split = compressor_pool(**inputs, counters=counters)
    assert (counters == 0).all()  # left as found
    span = 2 * ratio if overlap else ratio
    same_tiles = _pool_meta(head_dim, span)["SPAN_BLOCK"]
    monkeypatch.setattr(
        pool_module, "_pool_meta", lambda d, s: {**_unsplit_meta(d, s), "SPAN_BLOCK": same_tiles}
    )
    whole = compressor_pool(**inputs)
    assert torch.equal(split.slots, whole.slots)
    if DEVICE == "cpu":
        assert _same_bits(split.entries, whole.entries)
    else:
        _check(split, whole, torch.bfloat16)


def test_split_counters_survive_rows_sharing_the_dummy_entry() -> None:
    """Padding rows (request slot 0, whose pages are the dummy page) that end a block all pool
    into entry 0 in one launch: their arrivals interleave on one counter, which every launch
    still leaves at zero, and the real rows' entries are unaffected."""
    inputs = _inputs([250, 120], [8, 8], 72, 128, False, torch.float32, seed=7)
    assert _layout(72, 128, False)[1] > 1
    pad = 3
    for key, fill in (("positions", 127), ("token_slot", 0), ("token_prefix", 127)):
        inputs[key] = torch.cat((inputs[key], torch.full((pad,), fill, device=DEVICE)))
    for key in ("kv", "score"):
        inputs[key] = torch.cat(
            (inputs[key], torch.randn(pad, inputs[key].shape[1], device=DEVICE))
        )
    assert (inputs["req_to_token"][0] == 0).all()
    for key in ("state_kv", "state_score"):  # the dummy request's ring: stale but finite
        inputs[key][0] = torch.randn(inputs[key][0].shape, device=DEVICE)
    rope_half = 18
    cos, sin = _rope_rows(inputs["positions"] - 127, rope_half)
    n_slots = int(inputs["req_to_token"].max()) // 128 + 1
    counters = torch.zeros(n_slots + 5, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        want_entries = torch.full((n_slots, 72), float("nan"), device=DEVICE)
        compressor_decode_ref(
            **{
                **inputs,
                "state_kv": inputs["state_kv"].clone(),
                "state_score": inputs["state_score"].clone(),
            },
            cos=cos,
            sin=sin,
            entries=want_entries,
        )
        got_entries = torch.full((n_slots, 72), float("nan"), device=DEVICE)
        compressor_decode(
            **{
                **inputs,
                "state_kv": inputs["state_kv"].clone(),
                "state_score": inputs["state_score"].clone(),
            },
            cos=cos,
            sin=sin,
            entries=got_entries,
            counters=counters,
        )
        assert (counters == 0).all()
        real = ~torch.isnan(want_entries).any(dim=1)
        real[0] = False
        assert real.sum() == 2
        torch.testing.assert_close(got_entries[real], want_entries[real], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got_entries[0]).all()  # the dummy: some padding row's


def test_fused_decode_bad_inputs() -> None:
    inputs = _inputs([6], [2], 16, 4, True, torch.float32, seed=2)
    cos, sin = _rope_rows(inputs["positions"], 4)
    entries = torch.zeros(64, 16, device=DEVICE)
    with pytest.raises(ValueError, match="entries"):
        compressor_decode(**inputs, cos=cos, sin=sin, entries=entries.bfloat16())
    with pytest.raises(ValueError, match="cos/sin"):
        compressor_decode(**inputs, cos=cos[:, :3], sin=sin, entries=entries)
    with pytest.raises(ValueError, match="too short"):
        compressor_decode(
            **{
                **inputs,
                "state_kv": inputs["state_kv"][:, :4],
                "state_score": inputs["state_score"][:, :4],
            },
            cos=cos,
            sin=sin,
            entries=entries,
        )
    for bad in (torch.zeros(63, dtype=torch.int32), torch.zeros(64, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            compressor_decode(**inputs, cos=cos, sin=sin, entries=entries, counters=bad.to(DEVICE))
